/*
 * arch/arm/packed.c -- AArch64 kernels of the packed int4/int8 formats.
 *
 * float: NEON.  intdot: vdotq_s32 where the CPU has dotprod (chosen at run
 * time, see internal.h), else vmull_s8/vpadalq_s16.  The kernels rely on
 * the hardware prefetchers (not measured on an Apple core).
 * Oracles: ../../ref.c.
 */
#include "simd.h"

#if GBX_NEON

void gbx_quantize_blocks_neon(const float *x, int nfull, int8_t *qs, float *d, int32_t *sum)
{
    const float32x4_t lim = vdupq_n_f32(127.0f), nlim = vdupq_n_f32(-127.0f);
    for (int b = 0; b < nfull; ++b) {
        const float *xb = x + (size_t)b * GBX_QK;
        float32x4_t v[8];
        float32x4_t m = vdupq_n_f32(0.0f);
        for (int k = 0; k < 8; ++k) {
            v[k] = vld1q_f32(xb + 4 * k);
            m = vmaxq_f32(m, vabsq_f32(v[k]));
        }
        const float amax = vmaxvq_f32(m);
        const float db = amax / 127.0f;
        const float id = db != 0.0f ? 1.0f / db : 0.0f;
        int32x4_t q[8];
        int32x4_t s = vdupq_n_s32(0);
        for (int k = 0; k < 8; ++k) {
            const float32x4_t t = vminq_f32(vmaxq_f32(vmulq_n_f32(v[k], id), nlim), lim);
            q[k] = vcvtnq_s32_f32(t); /* round half to even, like nearbyintf */
            s = vaddq_s32(s, q[k]);
        }
        for (int k = 0; k < 8; k += 2) {
            const int16x8_t h = vcombine_s16(vmovn_s32(q[k]), vmovn_s32(q[k + 1]));
            vst1_s8(qs + (size_t)b * GBX_QK + 4 * k, vmovn_s16(h));
        }
        d[b] = db;
        sum[b] = vaddvq_s32(s);
    }
}

void gbx_q8_float_neon(const gbx_ctx *c, int r0, int r1)
{
    const int nfull = c->I / GBX_QK;
    for (int r = r0; r < r1; ++r) {
        const int8_t *w = (const int8_t *)(c->w + (size_t)r * c->row_bytes);
        const float *s = c->s + (size_t)r * c->ng;
        float32x4_t acc0 = vdupq_n_f32(0.0f), acc1 = vdupq_n_f32(0.0f);
        for (int b = 0; b < nfull; ++b) {
            float32x4_t t0 = vdupq_n_f32(0.0f), t1 = vdupq_n_f32(0.0f);
            fma16_neon(&t0, &t1, vld1q_s8(w + (size_t)b * GBX_QK), c->x + (size_t)b * GBX_QK);
            fma16_neon(&t0, &t1, vld1q_s8(w + (size_t)b * GBX_QK + 16), c->x + (size_t)b * GBX_QK + 16);
            const float sg = s[b >> c->gshift];
            if (b & 1)
                acc1 = vfmaq_n_f32(acc1, vaddq_f32(t0, t1), sg);
            else
                acc0 = vfmaq_n_f32(acc0, vaddq_f32(t0, t1), sg);
        }
        c->y[r] = vaddvq_f32(vaddq_f32(acc0, acc1)) + tail_float(c, (const uint8_t *)w, s, 8, nfull * GBX_QK);
    }
}

void gbx_q4_float_neon(const gbx_ctx *c, int r0, int r1)
{
    const int nspans = c->I / GBX_SPAN;
    for (int r = r0; r < r1; ++r) {
        const uint8_t *w = c->w + (size_t)r * c->row_bytes;
        const float *s = c->s + (size_t)r * c->ng;
        float32x4_t acc0 = vdupq_n_f32(0.0f), acc1 = vdupq_n_f32(0.0f);
        for (int p = 0; p < nspans; ++p) {
            const gbx_span_f32 *xs = c->xf + p;
            for (int h = 0; h < 2; ++h) { /* block 2p + h: bytes 16h..16h+15 */
                int8x16_t lo, hi;
                q4_split16_neon(w + (size_t)p * (GBX_SPAN / 2) + 16 * h, &lo, &hi);
                float32x4_t t0 = vdupq_n_f32(0.0f), t1 = vdupq_n_f32(0.0f);
                fma16_neon(&t0, &t1, lo, xs->even + 16 * h);
                fma16_neon(&t0, &t1, hi, xs->odd + 16 * h);
                const float sg = s[(2 * p + h) >> c->gshift];
                if (h)
                    acc1 = vfmaq_n_f32(acc1, vaddq_f32(t0, t1), sg);
                else
                    acc0 = vfmaq_n_f32(acc0, vaddq_f32(t0, t1), sg);
            }
        }
        c->y[r] = vaddvq_f32(vaddq_f32(acc0, acc1)) + tail_float(c, w, s, 4, nspans * GBX_SPAN);
    }
}

/* The intdot bodies are written once and instantiated per dot product:
 * the dotprod instance must carry its own target attribute. */
#define GBX_Q4_INTDOT_NEON_BODY(DOT)                                                                    \
    const gbx_act_q8 *a = c->a;                                                                         \
    for (int r = r0; r < r1; ++r) {                                                                     \
        const uint8_t *w = c->w + (size_t)r * c->row_bytes;                                             \
        const float *s = c->s + (size_t)r * c->ng;                                                      \
        float32x4_t acc0 = vdupq_n_f32(0.0f), acc1 = vdupq_n_f32(0.0f);                                 \
        for (int p = 0; p < a->nspans; ++p) {                                                           \
            const gbx_span_q8 *xs = a->split + p;                                                       \
            int8x16_t lo, hi;                                                                           \
            q4_split16_neon(w + (size_t)p * (GBX_SPAN / 2), &lo, &hi);                                  \
            int32x4_t ia = DOT(vdupq_n_s32(0), lo, vld1q_s8(xs->even));                                 \
            ia = DOT(ia, hi, vld1q_s8(xs->odd));                                                        \
            q4_split16_neon(w + (size_t)p * (GBX_SPAN / 2) + 16, &lo, &hi);                             \
            int32x4_t ib = DOT(vdupq_n_s32(0), lo, vld1q_s8(xs->even + 16));                            \
            ib = DOT(ib, hi, vld1q_s8(xs->odd + 16));                                                   \
            acc0 = vfmaq_n_f32(acc0, vmulq_n_f32(vcvtq_f32_s32(ia), a->d[2 * p]), s[(2 * p) >> c->gshift]); \
            acc1 = vfmaq_n_f32(acc1, vmulq_n_f32(vcvtq_f32_s32(ib), a->d[2 * p + 1]),                    \
                               s[(2 * p + 1) >> c->gshift]);                                            \
        }                                                                                               \
        c->y[r] = vaddvq_f32(vaddq_f32(acc0, acc1)) + tail_intdot(c, w, s, 4, 2 * a->nspans);           \
    }

#define GBX_Q8_INTDOT_NEON_BODY(DOT)                                                                    \
    const gbx_act_q8 *a = c->a;                                                                         \
    const int nfull = c->I / GBX_QK;                                                                    \
    for (int r = r0; r < r1; ++r) {                                                                     \
        const int8_t *w = (const int8_t *)(c->w + (size_t)r * c->row_bytes);                            \
        const float *s = c->s + (size_t)r * c->ng;                                                      \
        float32x4_t acc0 = vdupq_n_f32(0.0f), acc1 = vdupq_n_f32(0.0f);                                 \
        for (int b = 0; b < nfull; ++b) {                                                               \
            const int8_t *wb = w + (size_t)b * GBX_QK;                                                  \
            const int8_t *xb = a->qs + (size_t)b * GBX_QK;                                              \
            int32x4_t i0 = DOT(vdupq_n_s32(0), vld1q_s8(wb), vld1q_s8(xb));                             \
            i0 = DOT(i0, vld1q_s8(wb + 16), vld1q_s8(xb + 16));                                         \
            const float32x4_t t = vmulq_n_f32(vcvtq_f32_s32(i0), a->d[b]);                              \
            if (b & 1)                                                                                  \
                acc1 = vfmaq_n_f32(acc1, t, s[b >> c->gshift]);                                         \
            else                                                                                        \
                acc0 = vfmaq_n_f32(acc0, t, s[b >> c->gshift]);                                         \
        }                                                                                               \
        c->y[r] = vaddvq_f32(vaddq_f32(acc0, acc1)) + tail_intdot(c, (const uint8_t *)w, s, 8, nfull);  \
    }

void gbx_q4_intdot_neon(const gbx_ctx *c, int r0, int r1) { GBX_Q4_INTDOT_NEON_BODY(dot16_mull) }
void gbx_q8_intdot_neon(const gbx_ctx *c, int r0, int r1) { GBX_Q8_INTDOT_NEON_BODY(dot16_mull) }
#if GBX_DOTPROD
GBX_DOTPROD_FN void gbx_q4_intdot_dotprod(const gbx_ctx *c, int r0, int r1) { GBX_Q4_INTDOT_NEON_BODY(vdotq_s32) }
GBX_DOTPROD_FN void gbx_q8_intdot_dotprod(const gbx_ctx *c, int r0, int r1) { GBX_Q8_INTDOT_NEON_BODY(vdotq_s32) }
#endif


#endif /* GBX_NEON */
