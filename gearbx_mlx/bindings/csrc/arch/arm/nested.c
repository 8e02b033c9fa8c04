/*
 * arch/arm/nested.c -- AArch64 kernels of the nested planes (../../nested.c).
 *
 * One function per plane (bits 4, 8, and 6 on the float path: vld3
 * deinterleaves 3-byte triplets; 6-bit intdot planes take the scalar kernel of
 * nested.c) and scale dtype, returning the
 * plane's part of one output row: sum_g s_g (codes . x)_g + b_g xsum_g.
 *   float   NEON FMA against float32 x (4-bit codes against split-order x).
 *   intdot  int8 x (GBX_QK blocks), exact int32 dot products: vdotq_s32
 *           where the CPU has dotprod, else vmull_s8/vpadalq_s16.  Both are
 *           signed x signed: 4-bit codes (0..15) are valid int8 as they are;
 *           8-bit codes are taken as u - 128 (|pair| <= 2*128*127 fits the
 *           int16 of vmull) and 128 * sum(xq) per group is added back
 *           (from nested_ctx.xsum).
 * Oracles: ../../ref.c.
 */
#include "simd.h"

#if GBX_NEON

/* ---- scales and biases -------------------------------------------------- */

GBX_INLINE float32x4_t scale4_neon(const void *p, size_t i, const int dtype)
{
    if (dtype == GBX_DTYPE_F32)
        return vld1q_f32((const float *)p + i);
    const uint16x4_t h = vld1_u16((const uint16_t *)p + i);
    if (dtype == GBX_DTYPE_F16)
        return vcvt_f32_f16(vreinterpret_f16_u16(h));
    return vreinterpretq_f32_u32(vshll_n_u16(h, 16));
}

/* sum_g v[off + g] * w[g] over ng groups (a bias or scale row against the
 * group sums of x) */
GBX_INLINE float group_dot_neon(const void *v, size_t off, const float *w, int ng, const int dtype)
{
    float32x4_t acc = vdupq_n_f32(0.0f);
    int g = 0;
    for (; g + 4 <= ng; g += 4)
        acc = vfmaq_f32(acc, scale4_neon(v, off + (size_t)g, dtype), vld1q_f32(w + g));
    float y = vaddvq_f32(acc);
    for (; g < ng; ++g)
        y += gbx_scale1_neon(v, off + (size_t)g, dtype) * w[g];
    return y;
}

/* ---- float path ----------------------------------------------------------- */

/* 16 unsigned codes -> floats multiplied into two accumulators */
GBX_INLINE void fma16_u8_neon(float32x4_t *t0, float32x4_t *t1, uint8x16_t q, const float *x)
{
    const uint16x8_t l = vmovl_u8(vget_low_u8(q)), h = vmovl_high_u8(q);
    *t0 = vfmaq_f32(*t0, vcvtq_f32_u32(vmovl_u16(vget_low_u16(l))), vld1q_f32(x));
    *t1 = vfmaq_f32(*t1, vcvtq_f32_u32(vmovl_high_u16(l)), vld1q_f32(x + 4));
    *t0 = vfmaq_f32(*t0, vcvtq_f32_u32(vmovl_u16(vget_low_u16(h))), vld1q_f32(x + 8));
    *t1 = vfmaq_f32(*t1, vcvtq_f32_u32(vmovl_high_u16(h)), vld1q_f32(x + 12));
}

/* 16 code bytes of 4 bits -> low nibbles (elements 2k), high (2k+1), unsigned */
GBX_INLINE void u4_split16_neon(const uint8_t *p, uint8x16_t *lo, uint8x16_t *hi)
{
    const uint8x16_t v = vld1q_u8(p);
    uint8x16_t l = vandq_u8(v, vdupq_n_u8(0x0F));
    uint8x16_t h = vshrq_n_u8(v, 4);
    GBX_NIBBLE_ORDER(uint8x16_t, l, h);
    *lo = l;
    *hi = h;
}

GBX_INLINE float plane4_float_neon(const gbx_nested_ctx *c, const gbx_plane_rt *p, int r, int k, const int dtype)
{
    const uint8_t *w = p->codes + (size_t)r * p->row_bytes;
    const size_t off = (size_t)r * p->ng;
    const gbx_span_f32 *xf = c->xf + (size_t)k * c->nspans;
    float32x4_t acc0 = vdupq_n_f32(0.0f), acc1 = vdupq_n_f32(0.0f);
    for (int s = 0; s < c->nspans; ++s) {
        const gbx_span_f32 *xs = xf + s;
        for (int h = 0; h < 2; ++h) { /* block 2s + h: bytes 16h..16h+15 */
            uint8x16_t lo, hi;
            u4_split16_neon(w + (size_t)s * (GBX_SPAN / 2) + 16 * h, &lo, &hi);
            float32x4_t t0 = vdupq_n_f32(0.0f), t1 = vdupq_n_f32(0.0f);
            fma16_u8_neon(&t0, &t1, lo, xs->even + 16 * h);
            fma16_u8_neon(&t0, &t1, hi, xs->odd + 16 * h);
            const float sg = gbx_scale1_neon(p->scales, off + (size_t)((2 * s + h) >> p->gshift), dtype);
            if (h)
                acc1 = vfmaq_n_f32(acc1, vaddq_f32(t0, t1), sg);
            else
                acc0 = vfmaq_n_f32(acc0, vaddq_f32(t0, t1), sg);
        }
    }
    return vaddvq_f32(vaddq_f32(acc0, acc1)) + gbx_nested_tail_float(c, p, r, k, 2 * c->nspans, c->I / GBX_QK) +
           group_dot_neon(p->biases, off, p->xsum + (size_t)k * p->ng, p->ng, dtype);
}

GBX_INLINE float plane8_float_neon(const gbx_nested_ctx *c, const gbx_plane_rt *p, int r, int k, const int dtype)
{
    const uint8_t *w = p->codes + (size_t)r * p->row_bytes;
    const size_t off = (size_t)r * p->ng;
    const float *x = c->x + (size_t)k * c->I;
    float32x4_t acc0 = vdupq_n_f32(0.0f), acc1 = vdupq_n_f32(0.0f);
    for (int b = 0; b < c->I / GBX_QK; ++b) {
        float32x4_t t0 = vdupq_n_f32(0.0f), t1 = vdupq_n_f32(0.0f);
        fma16_u8_neon(&t0, &t1, vld1q_u8(w + (size_t)b * GBX_QK), x + (size_t)b * GBX_QK);
        fma16_u8_neon(&t0, &t1, vld1q_u8(w + (size_t)b * GBX_QK + 16), x + (size_t)b * GBX_QK + 16);
        const float sg = gbx_scale1_neon(p->scales, off + (size_t)(b >> p->gshift), dtype);
        if (b & 1)
            acc1 = vfmaq_n_f32(acc1, vaddq_f32(t0, t1), sg);
        else
            acc0 = vfmaq_n_f32(acc0, vaddq_f32(t0, t1), sg);
    }
    return vaddvq_f32(vaddq_f32(acc0, acc1)) + group_dot_neon(p->biases, off, p->xsum + (size_t)k * p->ng, p->ng, dtype);
}

/* A block of 32 six-bit codes (24 bytes): vld3 deinterleaves its 8 triplets,
 * so four vectors hold codes 4i, 4i+1, 4i+2, 4i+3 (i = 0..7), and vld4
 * deinterleaves x the same way. */
GBX_INLINE float32x4_t u6_block_float_neon(const uint8_t *wb, const float *xb)
{
    const uint8x8x3_t t = vld3_u8(wb);
    uint8x8_t q[4];
    q[0] = vand_u8(t.val[0], vdup_n_u8(0x3F));
    q[1] = vorr_u8(vshr_n_u8(t.val[0], 6), vshl_n_u8(vand_u8(t.val[1], vdup_n_u8(0x0F)), 2));
    q[2] = vorr_u8(vshr_n_u8(t.val[1], 4), vshl_n_u8(vand_u8(t.val[2], vdup_n_u8(0x03)), 4));
    q[3] = vshr_n_u8(t.val[2], 2);
#ifdef GEARBX_PLANT_SIX_BUG
    uint8x8_t u = q[0];
    q[0] = q[3], q[3] = u, u = q[1], q[1] = q[2], q[2] = u;
#endif
    const float32x4x4_t x0 = vld4q_f32(xb), x1 = vld4q_f32(xb + 16);
    float32x4_t a = vdupq_n_f32(0.0f), b = vdupq_n_f32(0.0f);
    for (int k = 0; k < 4; ++k) {
        const uint16x8_t w16 = vmovl_u8(q[k]);
        a = vfmaq_f32(a, vcvtq_f32_u32(vmovl_u16(vget_low_u16(w16))), x0.val[k]);
        b = vfmaq_f32(b, vcvtq_f32_u32(vmovl_high_u16(w16)), x1.val[k]);
    }
    return vaddq_f32(a, b);
}

GBX_INLINE float plane6_float_neon(const gbx_nested_ctx *c, const gbx_plane_rt *p, int r, int k, const int dtype)
{
    const uint8_t *w = p->codes + (size_t)r * p->row_bytes;
    const size_t off = (size_t)r * p->ng;
    const float *x = c->x + (size_t)k * c->I;
    float32x4_t acc0 = vdupq_n_f32(0.0f), acc1 = vdupq_n_f32(0.0f);
    for (int b = 0; b < c->I / GBX_QK; ++b) {
        const float32x4_t t = u6_block_float_neon(w + (size_t)b * (GBX_QK * 6 / 8), x + (size_t)b * GBX_QK);
        const float sg = gbx_scale1_neon(p->scales, off + (size_t)(b >> p->gshift), dtype);
        if (b & 1)
            acc1 = vfmaq_n_f32(acc1, t, sg);
        else
            acc0 = vfmaq_n_f32(acc0, t, sg);
    }
    return vaddvq_f32(vaddq_f32(acc0, acc1)) + group_dot_neon(p->biases, off, p->xsum + (size_t)k * p->ng, p->ng, dtype);
}

/* ---- intdot path ---------------------------------------------------------- */

/* Written once, instantiated per dot product (the dotprod instance carries
 * its own target attribute). */
#define GBX_DEF_NESTED_INTDOT_NEON(SUFFIX, ATTR, DOT)                                                        \
    ATTR GBX_INLINE float plane4_intdot_##SUFFIX(const gbx_nested_ctx *c, const gbx_plane_rt *p, int r, int k, \
                                                 const int dtype)                                          \
    {                                                                                                      \
        const uint8_t *w = p->codes + (size_t)r * p->row_bytes;                                            \
        const size_t off = (size_t)r * p->ng;                                                              \
        const gbx_act_q8 *a = c->a + k;                                                                    \
        float32x4_t acc0 = vdupq_n_f32(0.0f), acc1 = vdupq_n_f32(0.0f);                                    \
        for (int s = 0; s < c->nspans; ++s) {                                                              \
            const gbx_span_q8 *xs = a->split + s;                                                          \
            uint8x16_t lo, hi;                                                                             \
            u4_split16_neon(w + (size_t)s * (GBX_SPAN / 2), &lo, &hi);                                     \
            int32x4_t ia = DOT(vdupq_n_s32(0), vreinterpretq_s8_u8(lo), vld1q_s8(xs->even));               \
            ia = DOT(ia, vreinterpretq_s8_u8(hi), vld1q_s8(xs->odd));                                      \
            u4_split16_neon(w + (size_t)s * (GBX_SPAN / 2) + 16, &lo, &hi);                                \
            int32x4_t ib = DOT(vdupq_n_s32(0), vreinterpretq_s8_u8(lo), vld1q_s8(xs->even + 16));          \
            ib = DOT(ib, vreinterpretq_s8_u8(hi), vld1q_s8(xs->odd + 16));                                 \
            const float sa = gbx_scale1_neon(p->scales, off + (size_t)((2 * s) >> p->gshift), dtype);          \
            const float sb = p->gshift ? sa : gbx_scale1_neon(p->scales, off + (size_t)(2 * s + 1), dtype);    \
            acc0 = vfmaq_n_f32(acc0, vcvtq_f32_s32(ia), a->d[2 * s] * sa);                                 \
            acc1 = vfmaq_n_f32(acc1, vcvtq_f32_s32(ib), a->d[2 * s + 1] * sb);                             \
        }                                                                                                  \
        return vaddvq_f32(vaddq_f32(acc0, acc1)) +                                                         \
               gbx_nested_tail_intdot(c, p, r, k, 2 * c->nspans, c->I / GBX_QK) +                          \
               group_dot_neon(p->biases, off, p->xsum + (size_t)k * p->ng, p->ng, dtype);                  \
    }                                                                                                      \
    ATTR GBX_INLINE float plane8_intdot_##SUFFIX(const gbx_nested_ctx *c, const gbx_plane_rt *p, int r, int k, \
                                                 const int dtype)                                          \
    {                                                                                                      \
        const uint8_t *w = p->codes + (size_t)r * p->row_bytes;                                            \
        const size_t off = (size_t)r * p->ng;                                                              \
        const gbx_act_q8 *a = c->a + k;                                                                    \
        const uint8x16_t flip = vdupq_n_u8(0x80);                                                          \
        float32x4_t acc0 = vdupq_n_f32(0.0f), acc1 = vdupq_n_f32(0.0f);                                    \
        for (int b = 0; b < c->I / GBX_QK; ++b) {                                                          \
            const uint8_t *wb = w + (size_t)b * GBX_QK;                                                    \
            const int8_t *xb = a->qs + (size_t)b * GBX_QK;                                                 \
            const int8x16_t w0 = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(wb), flip));                        \
            const int8x16_t w1 = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(wb + 16), flip));                   \
            int32x4_t i0 = DOT(vdupq_n_s32(0), w0, vld1q_s8(xb));                                          \
            i0 = DOT(i0, w1, vld1q_s8(xb + 16));                                                           \
            const float t = a->d[b] * gbx_scale1_neon(p->scales, off + (size_t)(b >> p->gshift), dtype);       \
            if (b & 1)                                                                                     \
                acc1 = vfmaq_n_f32(acc1, vcvtq_f32_s32(i0), t);                                            \
            else                                                                                           \
                acc0 = vfmaq_n_f32(acc0, vcvtq_f32_s32(i0), t);                                            \
        }                                                                                                  \
        return vaddvq_f32(vaddq_f32(acc0, acc1)) +                                                         \
               128.0f * group_dot_neon(p->scales, off, p->xsum + (size_t)k * p->ng, p->ng, dtype) +        \
               group_dot_neon(p->biases, off, p->xsum + (size_t)k * p->ng, p->ng, dtype);                  \
    }

#define GBX_NESTED_INST(ATTR, BODY, NAME, DT) \
    ATTR static float NAME(const gbx_nested_ctx *c, const gbx_plane_rt *p, int r, int k) { return BODY(c, p, r, k, DT); }
#define GBX_NESTED_TABLE(TABLE, ISA, ATTR, BODY4, BODY8)                               \
    GBX_NESTED_TABLE6(TABLE, ISA, ATTR, BODY4, BODY8, NULL, NULL, NULL)
#define GBX_NESTED_TABLE6(TABLE, ISA, ATTR, BODY4, BODY8, F6_32, F6_16, F6_BF16)        \
    GBX_NESTED_INST(ATTR, BODY4, TABLE##_4_f32, GBX_DTYPE_F32)                         \
    GBX_NESTED_INST(ATTR, BODY4, TABLE##_4_f16, GBX_DTYPE_F16)                         \
    GBX_NESTED_INST(ATTR, BODY4, TABLE##_4_bf16, GBX_DTYPE_BF16)                       \
    GBX_NESTED_INST(ATTR, BODY8, TABLE##_8_f32, GBX_DTYPE_F32)                         \
    GBX_NESTED_INST(ATTR, BODY8, TABLE##_8_f16, GBX_DTYPE_F16)                         \
    GBX_NESTED_INST(ATTR, BODY8, TABLE##_8_bf16, GBX_DTYPE_BF16)                       \
    const gbx_nested_kernels TABLE = {ISA,                                             \
                                      {{TABLE##_4_f32, TABLE##_4_f16, TABLE##_4_bf16}, \
                                       {TABLE##_8_f32, TABLE##_8_f16, TABLE##_8_bf16}, \
                                       {F6_32, F6_16, F6_BF16}}};

#define GBX_NO_ATTR
GBX_NESTED_INST(GBX_NO_ATTR, plane6_float_neon, gbx_nested_float_neon_6_f32, GBX_DTYPE_F32)
GBX_NESTED_INST(GBX_NO_ATTR, plane6_float_neon, gbx_nested_float_neon_6_f16, GBX_DTYPE_F16)
GBX_NESTED_INST(GBX_NO_ATTR, plane6_float_neon, gbx_nested_float_neon_6_bf16, GBX_DTYPE_BF16)
GBX_NESTED_TABLE6(gbx_nested_float_neon, "neon", GBX_NO_ATTR, plane4_float_neon, plane8_float_neon,
                  gbx_nested_float_neon_6_f32, gbx_nested_float_neon_6_f16, gbx_nested_float_neon_6_bf16)
GBX_DEF_NESTED_INTDOT_NEON(mull, GBX_NO_ATTR, dot16_mull)
GBX_NESTED_TABLE(gbx_nested_intdot_neon, "neon", GBX_NO_ATTR, plane4_intdot_mull, plane8_intdot_mull)
#if GBX_DOTPROD
GBX_DEF_NESTED_INTDOT_NEON(dotprod, GBX_DOTPROD_FN, vdotq_s32)
GBX_NESTED_TABLE(gbx_nested_intdot_dotprod, "neon-dotprod", GBX_DOTPROD_FN, plane4_intdot_dotprod,
                 plane8_intdot_dotprod)
#endif

#endif /* GBX_NEON */
