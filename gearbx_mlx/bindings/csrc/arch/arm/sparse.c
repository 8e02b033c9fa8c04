/*
 * arch/arm/sparse.c -- NEON kernels of the block-sparse product
 * (../../sparse.c): per output row, the kept groups' 32-byte spans of 4-bit
 * codes, read where they lie in the row.
 *   float   codes against x in split order, as the dense nested float kernel.
 *   intdot  unsigned codes (<= 15) as int8 against int8 x in split order:
 *           vdotq_s32 where the CPU has it, else vmull/vpadal (|pair| <=
 *           2*15*127 fits int16); each 16-byte half of a span is one block of
 *           GBX_QK with its own d.
 * Oracles: ../../sparse.c.
 */
#include "../../sparse_internal.h"
#include "simd.h"

#if GBX_NEON

/* 16 code bytes -> unsigned low nibbles (elements 2k) and high (2k+1) */
GBX_INLINE void split16(const uint8_t *p, uint8x16_t *lo, uint8x16_t *hi)
{
    const uint8x16_t v = vld1q_u8(p);
    uint8x16_t l = vandq_u8(v, vdupq_n_u8(0x0F));
    uint8x16_t h = vshrq_n_u8(v, 4);
    GBX_NIBBLE_ORDER(uint8x16_t, l, h);
    *lo = l;
    *hi = h;
}

/* 16 unsigned bytes as floats times x[16] into two accumulators */
GBX_INLINE void fma16_u8(float32x4_t *t0, float32x4_t *t1, uint8x16_t q, const float *x)
{
    const uint16x8_t l = vmovl_u8(vget_low_u8(q)), h = vmovl_high_u8(q);
    *t0 = vfmaq_f32(*t0, vcvtq_f32_u32(vmovl_u16(vget_low_u16(l))), vld1q_f32(x));
    *t1 = vfmaq_f32(*t1, vcvtq_f32_u32(vmovl_high_u16(l)), vld1q_f32(x + 4));
    *t0 = vfmaq_f32(*t0, vcvtq_f32_u32(vmovl_u16(vget_low_u16(h))), vld1q_f32(x + 8));
    *t1 = vfmaq_f32(*t1, vcvtq_f32_u32(vmovl_high_u16(h)), vld1q_f32(x + 12));
}

void gbx_sparse4_float_neon(const gbx_ctx *cc, int r0, int r1)
{
    const gbx_sparse_ctx *c = gbx_sparse_of(cc);
    for (int r = r0; r < r1; ++r) {
        const uint8_t *row = c->codes + (size_t)r * c->row_bytes;
        const size_t off = (size_t)r * c->ng;
        float32x4_t acc0 = vdupq_n_f32(0.0f), acc1 = vdupq_n_f32(0.0f);
        for (int i = 0; i < c->nkept; ++i) {
            const int g = c->blocks[i];
            const float s = gbx_scale1_neon(c->scales, off + (size_t)g, c->dtype);
            for (int k = 0; k < c->spans; ++k) {
                const int sp = g * c->spans + k;
                const uint8_t *w = row + (size_t)sp * (GBX_SPAN / 2);
                const gbx_span_f32 *xs = c->xf + sp;
                float32x4_t t0 = vdupq_n_f32(0.0f), t1 = vdupq_n_f32(0.0f);
                for (int h = 0; h < 2; ++h) {
                    uint8x16_t lo, hi;
                    split16(w + 16 * h, &lo, &hi);
                    fma16_u8(&t0, &t1, lo, xs->even + 16 * h);
                    fma16_u8(&t0, &t1, hi, xs->odd + 16 * h);
                }
                acc0 = vfmaq_n_f32(acc0, t0, s);
                acc1 = vfmaq_n_f32(acc1, t1, s);
            }
        }
        c->y[r] = c->factor * (vaddvq_f32(vaddq_f32(acc0, acc1)) + gbx_sparse_bias_term(c, r));
    }
}

#define GBX_SPARSE_INTDOT_NEON(NAME, ATTR, DOT)                                                          \
    ATTR void NAME(const gbx_ctx *cc, int r0, int r1)                                                    \
    {                                                                                                    \
        const gbx_sparse_ctx *c = gbx_sparse_of(cc);                                                     \
        const gbx_act_q8 *a = c->a;                                                                      \
        for (int r = r0; r < r1; ++r) {                                                                  \
            const uint8_t *row = c->codes + (size_t)r * c->row_bytes;                                    \
            const size_t off = (size_t)r * c->ng;                                                        \
            float32x4_t acc0 = vdupq_n_f32(0.0f), acc1 = vdupq_n_f32(0.0f);                              \
            for (int i = 0; i < c->nkept; ++i) {                                                         \
                const int g = c->blocks[i];                                                              \
                const float s = gbx_scale1_neon(c->scales, off + (size_t)g, c->dtype);                           \
                for (int k = 0; k < c->spans; ++k) {                                                     \
                    const int sp = g * c->spans + k;                                                     \
                    const uint8_t *w = row + (size_t)sp * (GBX_SPAN / 2);                                \
                    const gbx_span_q8 *xs = a->split + sp;                                               \
                    uint8x16_t lo, hi;                                                                   \
                    split16(w, &lo, &hi);                                                                \
                    int32x4_t ia = DOT(vdupq_n_s32(0), vreinterpretq_s8_u8(lo), vld1q_s8(xs->even));     \
                    ia = DOT(ia, vreinterpretq_s8_u8(hi), vld1q_s8(xs->odd));                            \
                    split16(w + 16, &lo, &hi);                                                           \
                    int32x4_t ib = DOT(vdupq_n_s32(0), vreinterpretq_s8_u8(lo), vld1q_s8(xs->even + 16)); \
                    ib = DOT(ib, vreinterpretq_s8_u8(hi), vld1q_s8(xs->odd + 16));                       \
                    acc0 = vfmaq_n_f32(acc0, vcvtq_f32_s32(ia), a->d[2 * sp] * s);                       \
                    acc1 = vfmaq_n_f32(acc1, vcvtq_f32_s32(ib), a->d[2 * sp + 1] * s);                   \
                }                                                                                        \
            }                                                                                            \
            c->y[r] = c->factor * (vaddvq_f32(vaddq_f32(acc0, acc1)) + gbx_sparse_bias_term(c, r));      \
        }                                                                                                \
    }

#define GBX_NO_ATTR
GBX_SPARSE_INTDOT_NEON(gbx_sparse4_intdot_neon, GBX_NO_ATTR, dot16_mull)
#if GBX_DOTPROD
GBX_SPARSE_INTDOT_NEON(gbx_sparse4_intdot_dotprod, GBX_DOTPROD_FN, vdotq_s32)
#endif

#endif /* GBX_NEON */
