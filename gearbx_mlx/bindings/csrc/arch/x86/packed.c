/*
 * arch/x86/packed.c -- x86-64 kernels of the packed int4/int8 formats.
 *
 * float: AVX2+FMA.  intdot: 256-bit vpdpbusd (AVX512-VNNI+VL or AVX-VNNI)
 * where present, else AVX2 vpmaddubsw.  Weights are software-prefetched
 * GBX_PREFETCH_BYTES ahead.  Every function carries its own target
 * attribute, so the rest of the library stays baseline x86-64 and
 * dispatch.c picks them at run time.  Oracles: ../../ref.c.
 */
#include "simd.h"

#if GBX_X86

/* One block of 32 activations -> int8, bit-identical to the scalar oracle:
 * same scalar d and 1/d, one IEEE multiply, clamp, round half to even. */
GBX_AVX2_FN void gbx_quantize_blocks_avx2(const float *x, int nfull, int8_t *qs, float *d, int32_t *sum)
{
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 lim = _mm256_set1_ps(127.0f), nlim = _mm256_set1_ps(-127.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int b = 0; b < nfull; ++b) {
        const float *xb = x + (size_t)b * GBX_QK;
        __m256 v[4];
        __m256 m = _mm256_setzero_ps();
        for (int k = 0; k < 4; ++k) {
            v[k] = _mm256_loadu_ps(xb + 8 * k);
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[k]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
        const float db = amax / 127.0f;
        const float id = db != 0.0f ? 1.0f / db : 0.0f;
        const __m256 vid = _mm256_set1_ps(id);
        __m256i q[4];
        for (int k = 0; k < 4; ++k) {
            __m256 t = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(v[k], vid), nlim), lim);
            q[k] = _mm256_cvtps_epi32(_mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        }
        const __m256i s32 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256(s32, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
        /* packs work per 128-bit lane; the final permute restores order */
        const __m256i p16a = _mm256_packs_epi32(q[0], q[1]);
        const __m256i p16b = _mm256_packs_epi32(q[2], q[3]);
        const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b), order);
        _mm256_storeu_si256((__m256i *)(qs + (size_t)b * GBX_QK), p8);
        d[b] = db;
        sum[b] = _mm_cvtsi128_si32(s4);
    }
}

/* int8 float: 32 values (one block) per step */
GBX_AVX2_FN GBX_INLINE __m256 q8_float_block_avx2(const gbx_ctx *c, const int8_t *w, const float *s, int b, __m256 acc)
{
    const int8_t *wb = w + (size_t)b * GBX_QK;
    const float *xb = c->x + (size_t)b * GBX_QK;
    __m256 t0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)wb))),
                              _mm256_loadu_ps(xb));
    __m256 t1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(wb + 8)))),
                              _mm256_loadu_ps(xb + 8));
    t0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(wb + 16)))),
                         _mm256_loadu_ps(xb + 16), t0);
    t1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(wb + 24)))),
                         _mm256_loadu_ps(xb + 24), t1);
    return _mm256_fmadd_ps(_mm256_add_ps(t0, t1), _mm256_broadcast_ss(s + (b >> c->gshift)), acc);
}

GBX_AVX2_FN void gbx_q8_float_avx2(const gbx_ctx *c, int r0, int r1)
{
    const int nfull = c->I / GBX_QK;
    for (int r = r0; r < r1; ++r) {
        const int8_t *w = (const int8_t *)(c->w + (size_t)r * c->row_bytes);
        const float *s = c->s + (size_t)r * c->ng;
        /* two accumulators: one FMA chain per block would cap the loop at
         * its latency */
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        int b = 0;
        for (; b + 2 <= nfull; b += 2) {
            GBX_PREFETCH(w + (size_t)b * GBX_QK + GBX_PREFETCH_BYTES);
            acc0 = q8_float_block_avx2(c, w, s, b, acc0);
            acc1 = q8_float_block_avx2(c, w, s, b + 1, acc1);
        }
        if (b < nfull)
            acc0 = q8_float_block_avx2(c, w, s, b, acc0);
        c->y[r] = hsum_avx2(_mm256_add_ps(acc0, acc1)) + tail_float(c, (const uint8_t *)w, s, 8, nfull * GBX_QK);
    }
}

/* 8 weight bytes -> 8 signed low nibbles (elements 2k) and 8 high (2k+1) */
GBX_AVX2_FN GBX_INLINE void q4_unpack8_avx2(const uint8_t *p, __m256 *lo, __m256 *hi)
{
    const __m256i u = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    const __m256i off = _mm256_set1_epi32(GBX_INT4_OFFSET);
    __m256i l = _mm256_sub_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x0F)), off);
    __m256i h = _mm256_sub_epi32(_mm256_srli_epi32(u, 4), off);
    GBX_NIBBLE_ORDER(__m256i, l, h);
    *lo = _mm256_cvtepi32_ps(l);
    *hi = _mm256_cvtepi32_ps(h);
}

/* int4 float: one span (32 bytes, 64 values) per step against split-order x */
GBX_AVX2_FN void gbx_q4_float_avx2(const gbx_ctx *c, int r0, int r1)
{
    const int nspans = c->I / GBX_SPAN;
    for (int r = r0; r < r1; ++r) {
        const uint8_t *w = c->w + (size_t)r * c->row_bytes;
        const float *s = c->s + (size_t)r * c->ng;
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        for (int p = 0; p < nspans; ++p) {
            const uint8_t *wp = w + (size_t)p * (GBX_SPAN / 2);
            const gbx_span_f32 *xs = c->xf + p;
            if (p & 1)
                GBX_PREFETCH(wp + GBX_PREFETCH_BYTES);
            __m256 lo, hi, ta, tb;
            /* bytes 0-15 are block 2p, bytes 16-31 block 2p+1 (groups may differ) */
            q4_unpack8_avx2(wp, &lo, &hi);
            ta = _mm256_mul_ps(lo, _mm256_loadu_ps(xs->even));
            __m256 ta2 = _mm256_mul_ps(hi, _mm256_loadu_ps(xs->odd));
            q4_unpack8_avx2(wp + 8, &lo, &hi);
            ta = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xs->even + 8), ta);
            ta2 = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xs->odd + 8), ta2);
            q4_unpack8_avx2(wp + 16, &lo, &hi);
            tb = _mm256_mul_ps(lo, _mm256_loadu_ps(xs->even + 16));
            __m256 tb2 = _mm256_mul_ps(hi, _mm256_loadu_ps(xs->odd + 16));
            q4_unpack8_avx2(wp + 24, &lo, &hi);
            tb = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xs->even + 24), tb);
            tb2 = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xs->odd + 24), tb2);
            acc0 = _mm256_fmadd_ps(_mm256_add_ps(ta, ta2), _mm256_broadcast_ss(s + ((2 * p) >> c->gshift)), acc0);
            acc1 = _mm256_fmadd_ps(_mm256_add_ps(tb, tb2), _mm256_broadcast_ss(s + ((2 * p + 1) >> c->gshift)), acc1);
        }
        c->y[r] = hsum_avx2(_mm256_add_ps(acc0, acc1)) + tail_float(c, w, s, 4, nspans * GBX_SPAN);
    }
}

/* One span (32 weight bytes, 64 values) split into stored nibbles u = q + 8:
 * lo holds elements 0,2,..,62 and hi 1,3,..,63, matching gbx_span_q8. */
GBX_AVX2_FN GBX_INLINE void q4_span_split_avx2(const uint8_t *w, __m256i *lo, __m256i *hi)
{
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m256i v = _mm256_loadu_si256((const __m256i *)w);
    __m256i l = _mm256_and_si256(v, m4);
    __m256i h = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    GBX_NIBBLE_ORDER(__m256i, l, h);
    *lo = l;
    *hi = h;
}

/* sum of u * xq per int32 lane, offset not removed: vpmaddubsw takes u
 * (1..15, unsigned) against signed xq, so no sign trick is needed.
 * |pair| <= 2*15*127, so the two halves add up in int16 without saturating. */
GBX_AVX2_FN GBX_INLINE __m256i q4_span_usum_avx2(const uint8_t *w, const gbx_span_q8 *xs)
{
    __m256i lo, hi;
    q4_span_split_avx2(w, &lo, &hi);
    const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)xs->even)),
                                       _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)xs->odd)));
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

enum { GMODE_ROW = 0, GMODE_G32 = 1, GMODE_WIDE = 2 };

/* The scale of each lane of span p: blocks 2p and 2p+1 may lie in different
 * groups only when groups are 32 wide. */
GBX_AVX2_FN GBX_INLINE __m256 span_scales_avx2(const float *s, int p, int gshift, const int gmode)
{
    if (gmode == GMODE_G32)
        return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_broadcast_ss(s + 2 * p)),
                                    _mm_broadcast_ss(s + 2 * p + 1), 1);
    return _mm256_broadcast_ss(s + ((2 * p) >> gshift));
}

/* What a span step reads besides the weights, copied out of the context into
 * locals so that the loop keeps the pointers in registers. */
typedef struct {
    const gbx_span_q8 *split;
    const float *span_d, *span_corr;
    const int32_t *span_nbias;
    int gshift;
} gbx_q4_span_args;

/* AVX2 span step.  Per row (the common case) the offset is removed once per
 * row with corr_total; with groups, per span with one fmsub. */
GBX_AVX2_FN GBX_INLINE __m256 q4_intdot_span_avx2(const gbx_q4_span_args g, const uint8_t *w, const float *s, int p,
                                                  __m256 acc, const int gmode)
{
    const __m256 f = _mm256_cvtepi32_ps(q4_span_usum_avx2(w + (size_t)p * (GBX_SPAN / 2), g.split + p));
    const __m256 dv = _mm256_load_ps(g.span_d + 8 * (size_t)p);
    if (gmode == GMODE_ROW)
        return _mm256_fmadd_ps(f, dv, acc);
    const __m256 t = _mm256_fmsub_ps(f, dv, _mm256_load_ps(g.span_corr + 8 * (size_t)p));
    return _mm256_fmadd_ps(t, span_scales_avx2(s, p, g.gshift, gmode), acc);
}

/* Row loop shared by the AVX2 and VNNI kernels: two accumulators, because a
 * single FMA chain would cap the loop at the FMA latency. */
#define GBX_Q4_INTDOT_ROWS(SPAN_FN, GMODE, ROW_CORR)                                                           \
    do {                                                                                                       \
        const gbx_q4_span_args g_ = {c->a->split, c->a->span_d, c->a->span_corr, c->a->span_nbias, c->gshift}; \
        const int nspans_ = c->a->nspans;                                                                      \
        for (int r = r0; r < r1; ++r) {                                                                        \
            const uint8_t *w = c->w + (size_t)r * c->row_bytes;                                                \
            const float *s = c->s + (size_t)r * c->ng;                                                         \
            __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();                                     \
            int p = 0;                                                                                         \
            for (; p + 2 <= nspans_; p += 2) {                                                                 \
                GBX_PREFETCH(w + (size_t)p * (GBX_SPAN / 2) + GBX_PREFETCH_BYTES);                             \
                acc0 = SPAN_FN(g_, w, s, p, acc0, GMODE);                                                      \
                acc1 = SPAN_FN(g_, w, s, p + 1, acc1, GMODE);                                                  \
            }                                                                                                  \
            if (p < nspans_)                                                                                   \
                acc0 = SPAN_FN(g_, w, s, p, acc0, GMODE);                                                      \
            float y = hsum_avx2(_mm256_add_ps(acc0, acc1));                                                    \
            if (GMODE == GMODE_ROW)                                                                            \
                y = (y - (ROW_CORR)) * s[0];                                                                   \
            c->y[r] = y + tail_intdot(c, w, s, 4, 2 * nspans_);                                                \
        }                                                                                                      \
    } while (0)

GBX_AVX2_FN void gbx_q4_intdot_avx2(const gbx_ctx *c, int r0, int r1)
{
    if (c->ng == 1)
        GBX_Q4_INTDOT_ROWS(q4_intdot_span_avx2, GMODE_ROW, c->a->corr_total);
    else if (c->gs == 32)
        GBX_Q4_INTDOT_ROWS(q4_intdot_span_avx2, GMODE_G32, 0.0f);
    else
        GBX_Q4_INTDOT_ROWS(q4_intdot_span_avx2, GMODE_WIDE, 0.0f);
}

/* int8 intdot: vpmaddubsw wants unsigned x signed, hence |w| and sign(x, w);
 * |pair| <= 2*127*127 < 32767. */
GBX_AVX2_FN GBX_INLINE __m256i q8_block_isum_avx2(const uint8_t *w, const int8_t *xq)
{
    const __m256i wv = _mm256_loadu_si256((const __m256i *)w);
    const __m256i xv = _mm256_loadu_si256((const __m256i *)xq);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(wv), _mm256_sign_epi8(xv, wv)), _mm256_set1_epi16(1));
}

#define GBX_Q8_INTDOT_STEP(ISUM_FN, PER_ROW, b, acc)                                                     \
    do {                                                                                                 \
        const __m256 f_ = _mm256_cvtepi32_ps(ISUM_FN(w + (size_t)(b)*GBX_QK, a->qs + (size_t)(b)*GBX_QK)); \
        const __m256 d_ = _mm256_broadcast_ss(a->d + (b));                                               \
        if (PER_ROW)                                                                                     \
            acc = _mm256_fmadd_ps(f_, d_, acc);                                                          \
        else                                                                                             \
            acc = _mm256_fmadd_ps(_mm256_mul_ps(f_, d_), _mm256_broadcast_ss(s + ((b) >> c->gshift)), acc); \
    } while (0)

#define GBX_Q8_INTDOT_ROWS(ISUM_FN, PER_ROW)                                 \
    do {                                                                     \
        const gbx_act_q8 *a = c->a;                                          \
        const int nfull = c->I / GBX_QK;                                     \
        for (int r = r0; r < r1; ++r) {                                      \
            const uint8_t *w = c->w + (size_t)r * c->row_bytes;              \
            const float *s = c->s + (size_t)r * c->ng;                       \
            __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();   \
            int b = 0;                                                       \
            for (; b + 2 <= nfull; b += 2) {                                 \
                GBX_PREFETCH(w + (size_t)b * GBX_QK + GBX_PREFETCH_BYTES);   \
                GBX_Q8_INTDOT_STEP(ISUM_FN, PER_ROW, b, acc0);               \
                GBX_Q8_INTDOT_STEP(ISUM_FN, PER_ROW, b + 1, acc1);           \
            }                                                                \
            if (b < nfull)                                                   \
                GBX_Q8_INTDOT_STEP(ISUM_FN, PER_ROW, b, acc0);               \
            float y = hsum_avx2(_mm256_add_ps(acc0, acc1));                  \
            if (PER_ROW)                                                     \
                y *= s[0];                                                   \
            c->y[r] = y + tail_intdot(c, w, s, 8, nfull);                    \
        }                                                                    \
    } while (0)

GBX_AVX2_FN void gbx_q8_intdot_avx2(const gbx_ctx *c, int r0, int r1)
{
    if (c->ng == 1)
        GBX_Q8_INTDOT_ROWS(q8_block_isum_avx2, 1);
    else
        GBX_Q8_INTDOT_ROWS(q8_block_isum_avx2, 0);
}

#if GBX_VNNI512 || GBX_AVXVNNI
/* VNNI span step: the accumulator starts at -8 * sum(xq) per lane, so the two
 * vpdpbusd leave the exact integer isum. */
#define GBX_DEF_VNNI(SUFFIX, ATTR, DPBUSD)                                                                      \
    ATTR GBX_INLINE __m256 q4_intdot_span_##SUFFIX(const gbx_q4_span_args g, const uint8_t *w, const float *s, int p, \
                                                   __m256 acc, const int gmode)                                 \
    {                                                                                                          \
        __m256i lo, hi;                                                                                        \
        q4_span_split_avx2(w + (size_t)p * (GBX_SPAN / 2), &lo, &hi);                                          \
        __m256i i = _mm256_load_si256((const __m256i *)(g.span_nbias + 8 * (size_t)p));                        \
        i = DPBUSD(i, lo, _mm256_loadu_si256((const __m256i *)g.split[p].even));                               \
        i = DPBUSD(i, hi, _mm256_loadu_si256((const __m256i *)g.split[p].odd));                                \
        const __m256 f = _mm256_cvtepi32_ps(i);                                                                \
        const __m256 dv = _mm256_load_ps(g.span_d + 8 * (size_t)p);                                            \
        if (gmode == GMODE_ROW)                                                                                \
            return _mm256_fmadd_ps(f, dv, acc);                                                                \
        return _mm256_fmadd_ps(_mm256_mul_ps(f, dv), span_scales_avx2(s, p, g.gshift, gmode), acc);            \
    }                                                                                                          \
    ATTR void gbx_q4_intdot_##SUFFIX(const gbx_ctx *c, int r0, int r1)                                      \
    {                                                                                                          \
        if (c->ng == 1)                                                                                        \
            GBX_Q4_INTDOT_ROWS(q4_intdot_span_##SUFFIX, GMODE_ROW, 0.0f);                                      \
        else if (c->gs == 32)                                                                                  \
            GBX_Q4_INTDOT_ROWS(q4_intdot_span_##SUFFIX, GMODE_G32, 0.0f);                                      \
        else                                                                                                   \
            GBX_Q4_INTDOT_ROWS(q4_intdot_span_##SUFFIX, GMODE_WIDE, 0.0f);                                     \
    }                                                                                                          \
    ATTR GBX_INLINE __m256i q8_block_isum_##SUFFIX(const uint8_t *w, const int8_t *xq)                         \
    {                                                                                                          \
        const __m256i wv = _mm256_loadu_si256((const __m256i *)w);                                             \
        const __m256i xv = _mm256_loadu_si256((const __m256i *)xq);                                            \
        return DPBUSD(_mm256_setzero_si256(), _mm256_abs_epi8(wv), _mm256_sign_epi8(xv, wv));                  \
    }                                                                                                          \
    ATTR void gbx_q8_intdot_##SUFFIX(const gbx_ctx *c, int r0, int r1)                                      \
    {                                                                                                          \
        if (c->ng == 1)                                                                                        \
            GBX_Q8_INTDOT_ROWS(q8_block_isum_##SUFFIX, 1);                                                     \
        else                                                                                                   \
            GBX_Q8_INTDOT_ROWS(q8_block_isum_##SUFFIX, 0);                                                     \
    }

#endif
#if GBX_VNNI512
GBX_DEF_VNNI(vnni512, GBX_VNNI512_FN, _mm256_dpbusd_epi32)
#endif
#if GBX_AVXVNNI
GBX_DEF_VNNI(avxvnni, GBX_AVXVNNI_FN, _mm256_dpbusd_avx_epi32)
#endif


/* Read-bandwidth probe (bandwidth.c): 128 bytes a step, four accumulators. */
GBX_AVX2_FN void gbx_read_rows_avx2(const gbx_ctx *c, int r0, int r1)
{
    for (int r = r0; r < r1; ++r) {
        const uint8_t *p = c->w + (size_t)r * c->row_bytes;
        __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
        size_t k = 0;
        for (; k + 128 <= c->row_bytes; k += 128) {
            GBX_PREFETCH(p + k + GBX_PREFETCH_BYTES);
            GBX_PREFETCH(p + k + 64 + GBX_PREFETCH_BYTES);
            a0 = _mm256_add_epi64(a0, _mm256_loadu_si256((const __m256i *)(p + k)));
            a1 = _mm256_add_epi64(a1, _mm256_loadu_si256((const __m256i *)(p + k + 32)));
            a2 = _mm256_add_epi64(a2, _mm256_loadu_si256((const __m256i *)(p + k + 64)));
            a3 = _mm256_add_epi64(a3, _mm256_loadu_si256((const __m256i *)(p + k + 96)));
        }
        uint64_t t[4];
        _mm256_storeu_si256((__m256i *)t, _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3)));
        uint64_t s = t[0] + t[1] + t[2] + t[3];
        for (; k < c->row_bytes; ++k)
            s += p[k];
        c->sums[r] = s;
    }
}

#endif /* GBX_X86 */
