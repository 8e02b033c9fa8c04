/*
 * arch/x86/sparse.c -- AVX2+FMA kernels of the block-sparse product
 * (../../sparse.c): per output row, the kept groups' 32-byte spans of 4-bit
 * codes, read where they lie in the row.
 *   float   codes against x in split order (low nibbles are the even
 *           elements), as the dense nested float kernel.
 *   intdot  vpmaddubsw of the unsigned codes against int8 x in split order
 *           (|pair| <= 2*15*127), int32 lanes 0-3 block 2s and 4-7 block 2s+1,
 *           times the blocks' d, as the dense nested intdot kernel.
 * Two kept groups per step (two accumulators); the bias term b_g * xsum_g in
 * the same pass; the scale dtype a constant in each copy of the row loop.
 * Oracles: ../../sparse.c.
 */
#include "../../sparse_internal.h"
#include "simd.h"

#if GBX_X86

#define GBX_SPARSE_FN __attribute__((target("avx2,fma,f16c")))

/* 8 code bytes -> 8 low nibbles (elements 2k) and 8 high (2k+1) as floats */
GBX_SPARSE_FN GBX_INLINE void unpack8(const uint8_t *p, __m256 *lo, __m256 *hi)
{
    const __m256i u = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    __m256i l = _mm256_and_si256(u, _mm256_set1_epi32(0x0F));
    __m256i h = _mm256_srli_epi32(u, 4);
    GBX_NIBBLE_ORDER(__m256i, l, h);
    *lo = _mm256_cvtepi32_ps(l);
    *hi = _mm256_cvtepi32_ps(h);
}

/* a span's 64 codes times x (split order): 8 partial sums */
GBX_SPARSE_FN GBX_INLINE __m256 span_float(const uint8_t *w, const gbx_span_f32 *xs)
{
    __m256 lo, hi;
    unpack8(w, &lo, &hi);
    __m256 t0 = _mm256_mul_ps(lo, _mm256_loadu_ps(xs->even));
    __m256 t1 = _mm256_mul_ps(hi, _mm256_loadu_ps(xs->odd));
    for (int q = 1; q < 4; ++q) {
        unpack8(w + 8 * q, &lo, &hi);
        t0 = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xs->even + 8 * q), t0);
        t1 = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xs->odd + 8 * q), t1);
    }
    return _mm256_add_ps(t0, t1);
}

/* int32 lane l of a span: sum of codes * xq over bytes 4l..4l+3 of both halves */
GBX_SPARSE_FN GBX_INLINE __m256i span_isum(const uint8_t *w, const gbx_span_q8 *xs)
{
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m256i v = _mm256_loadu_si256((const __m256i *)w);
    __m256i l = _mm256_and_si256(v, m4);
    __m256i h = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    GBX_NIBBLE_ORDER(__m256i, l, h);
    const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(l, _mm256_loadu_si256((const __m256i *)xs->even)),
                                       _mm256_maddubs_epi16(h, _mm256_loadu_si256((const __m256i *)xs->odd)));
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

/* One row over the kept groups: two groups per step into two accumulators;
 * the bias term (b_g * xsum_g) in a scalar chain beside them.  SPAN_TERM(w,
 * sp) is a span's 8 partial sums, before the group's scale. */
#define GBX_SPARSE_ROW(NAME, SPAN_TERM)                                                                    \
    GBX_SPARSE_FN GBX_INLINE float NAME(const gbx_sparse_ctx *c, const uint8_t *row, size_t off,           \
                                        const int dtype)                                                   \
    {                                                                                                      \
        const int32_t *blocks = c->blocks;                                                                 \
        const int n = c->nkept, spans = c->spans;                                                         \
        const float *xsum = c->xsum;                                                                       \
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();                                     \
        float yb0 = 0.0f, yb1 = 0.0f;                                                                      \
        int i = 0;                                                                                         \
        for (; i + 2 <= n; i += 2) {                                                                       \
            const int g0 = blocks[i], g1 = blocks[i + 1];                                                  \
            __m256 t0 = SPAN_TERM(row, g0 * spans), t1 = SPAN_TERM(row, g1 * spans);                       \
            for (int k = 1; k < spans; ++k) {                                                              \
                t0 = _mm256_add_ps(t0, SPAN_TERM(row, g0 * spans + k));                                    \
                t1 = _mm256_add_ps(t1, SPAN_TERM(row, g1 * spans + k));                                    \
            }                                                                                              \
            acc0 = _mm256_fmadd_ps(t0, _mm256_set1_ps(gbx_scale1_x86(c->scales, off + (size_t)g0, dtype)), acc0); \
            acc1 = _mm256_fmadd_ps(t1, _mm256_set1_ps(gbx_scale1_x86(c->scales, off + (size_t)g1, dtype)), acc1); \
            yb0 += gbx_scale1_x86(c->biases, off + (size_t)g0, dtype) * xsum[g0];                                 \
            yb1 += gbx_scale1_x86(c->biases, off + (size_t)g1, dtype) * xsum[g1];                                 \
        }                                                                                                  \
        if (i < n) {                                                                                       \
            const int g0 = blocks[i];                                                                      \
            __m256 t0 = SPAN_TERM(row, g0 * spans);                                                        \
            for (int k = 1; k < spans; ++k)                                                                \
                t0 = _mm256_add_ps(t0, SPAN_TERM(row, g0 * spans + k));                                    \
            acc0 = _mm256_fmadd_ps(t0, _mm256_set1_ps(gbx_scale1_x86(c->scales, off + (size_t)g0, dtype)), acc0); \
            yb0 += gbx_scale1_x86(c->biases, off + (size_t)g0, dtype) * xsum[g0];                                 \
        }                                                                                                  \
        return hsum_avx2(_mm256_add_ps(acc0, acc1)) + (yb0 + yb1);                                         \
    }

/* The rows [r0, r1), the scale dtype a constant in each copy of the row. */
#define GBX_SPARSE_ROWS(NAME, ROW)                                                                         \
    GBX_SPARSE_FN void NAME(const gbx_ctx *cc, int r0, int r1)                                             \
    {                                                                                                      \
        const gbx_sparse_ctx *c = gbx_sparse_of(cc);                                                       \
        for (int r = r0; r < r1; ++r) {                                                                    \
            const uint8_t *row = c->codes + (size_t)r * c->row_bytes;                                      \
            const size_t off = (size_t)r * c->ng;                                                          \
            float v;                                                                                       \
            if (c->dtype == GBX_DTYPE_F32)                                                                 \
                v = ROW(c, row, off, GBX_DTYPE_F32);                                                       \
            else if (c->dtype == GBX_DTYPE_F16)                                                            \
                v = ROW(c, row, off, GBX_DTYPE_F16);                                                       \
            else                                                                                           \
                v = ROW(c, row, off, GBX_DTYPE_BF16);                                                      \
            c->y[r] = c->factor * v;                                                                       \
        }                                                                                                  \
    }

#define GBX_FLOAT_TERM(row, sp) span_float((row) + (size_t)(sp) * (GBX_SPAN / 2), c->xf + (sp))
#define GBX_INTDOT_TERM(row, sp)                                                                           \
    _mm256_mul_ps(_mm256_cvtepi32_ps(span_isum((row) + (size_t)(sp) * (GBX_SPAN / 2), c->a->split + (sp))),  \
                  _mm256_load_ps(c->a->span_d + 8 * (size_t)(sp)))

GBX_SPARSE_ROW(row_float, GBX_FLOAT_TERM)
GBX_SPARSE_ROW(row_intdot, GBX_INTDOT_TERM)
GBX_SPARSE_ROWS(gbx_sparse4_float_avx2, row_float)
GBX_SPARSE_ROWS(gbx_sparse4_intdot_avx2, row_intdot)

#endif /* GBX_X86 */
