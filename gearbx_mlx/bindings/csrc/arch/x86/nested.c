/*
 * arch/x86/nested.c -- x86-64 kernels of the nested planes (../../nested.c).
 *
 * One function per plane (bits 4, 6 or 8) and scale dtype, returning the
 * plane's part of one output row: sum_g s_g (codes . x)_g + b_g xsum_g.
 *   float   AVX2+FMA against float32 x; 4-bit codes against x in split order
 *           (low nibbles are the even elements, as in the packed int4 kernels).
 *           6-bit codes: a block of 32 is 24 bytes; vpshufb puts each 3-byte
 *           triplet (four codes) in a 32-bit lane and vpsrlvd/vpand take code
 *           k of it, so 8 codes cost 3 integer ops and one conversion.
 *   intdot  int8 x (GBX_QK blocks).  4 bits: vpmaddubsw takes the unsigned
 *           codes as they are (|pair| <= 2*15*127).  8 bits: 255*127*2
 *           would saturate vpmaddubsw's int16 pairs, so plain AVX2 multiplies
 *           u - 128 (signed, |pair| <= 2*128*127) and adds back
 *           128 * sum(xq) per group (from nested_ctx.xsum); vpdpbusd (AVX512-VNNI
 *           or AVX-VNNI) sums into int32 without pairs, so it takes u as is.
 *           6 bits: codes unpacked to bytes (<= 63: 2*63*127 fits the int16
 *           pairs), so vpmaddubsw takes them as they are on every x86 path.
 * Scales and biases are converted per group on the fly (F16C for float16),
 * so a plane reads exactly its own bytes.  Oracles: ../../ref.c.
 */
#include "simd.h"

#if GBX_X86

#define GBX_NESTED_FN __attribute__((target("avx2,fma,f16c")))

/* ---- scales and biases -------------------------------------------------- */

GBX_NESTED_FN GBX_INLINE __m256 scale8(const void *p, size_t i, const int dtype)
{
    if (dtype == GBX_DTYPE_F32)
        return _mm256_loadu_ps((const float *)p + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    if (dtype == GBX_DTYPE_F16)
        return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* sum_g v[off + g] * w[g] over ng groups: a bias row against the group sums
 * of x. */
GBX_NESTED_FN GBX_INLINE float group_dot(const void *v, size_t off, const float *w, int ng, const int dtype)
{
    __m256 acc = _mm256_setzero_ps();
    int g = 0;
    for (; g + 8 <= ng; g += 8)
        acc = _mm256_fmadd_ps(scale8(v, off + (size_t)g, dtype), _mm256_loadu_ps(w + g), acc);
    float y = hsum_avx2(acc);
    for (; g < ng; ++g)
        y += gbx_scale1_x86(v, off + (size_t)g, dtype) * w[g];
    return y;
}

/* The scales of blocks 2s (low 4 lanes) and 2s+1 (high 4 lanes) of span s:
 * one group unless groups are 32 wide (then both, in one load and a permute). */
GBX_NESTED_FN GBX_INLINE __m256 span_scales(const void *sc, size_t off, int s, int gshift, const int dtype)
{
    if (gshift > 0)
        return _mm256_set1_ps(gbx_scale1_x86(sc, off + (size_t)((2 * s) >> gshift), dtype));
    const size_t i = off + 2 * (size_t)s;
    __m128 two;
    if (dtype == GBX_DTYPE_F32) {
        two = _mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)((const float *)sc + i)));
    } else {
        int32_t u;
        memcpy(&u, (const uint16_t *)sc + i, sizeof u);
        const __m128i h = _mm_cvtsi32_si128(u);
        two = dtype == GBX_DTYPE_F16 ? _mm_cvtph_ps(h) : _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(h), 16));
    }
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(two), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
}

/* acc plus sum_g v[off + g] * w[g] over the whole eights of ng groups, lane
 * by lane; the remaining groups' sum in *rest (group_dot without its own
 * horizontal sum: a row then makes one). */
GBX_NESTED_FN GBX_INLINE __m256 group_fma(__m256 acc, const void *v, size_t off, const float *w, int ng, float *rest,
                                          const int dtype)
{
    int g = 0;
    for (; g + 8 <= ng; g += 8)
        acc = _mm256_fmadd_ps(scale8(v, off + (size_t)g, dtype), _mm256_loadu_ps(w + g), acc);
    float y = 0.0f;
    for (; g < ng; ++g)
        y += gbx_scale1_x86(v, off + (size_t)g, dtype) * w[g];
    *rest = y;
    return acc;
}

/* ---- float path ----------------------------------------------------------- */

/* 8 code bytes -> 8 low nibbles (elements 2k) and 8 high (2k+1) as floats */
GBX_NESTED_FN GBX_INLINE void u4_unpack8(const uint8_t *p, __m256 *lo, __m256 *hi)
{
    const __m256i u = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    __m256i l = _mm256_and_si256(u, _mm256_set1_epi32(0x0F));
    __m256i h = _mm256_srli_epi32(u, 4);
    GBX_NIBBLE_ORDER(__m256i, l, h);
    *lo = _mm256_cvtepi32_ps(l);
    *hi = _mm256_cvtepi32_ps(h);
}

GBX_NESTED_FN GBX_INLINE float plane4_float(const gbx_nested_ctx *c, const gbx_plane_rt *p, int r, int k,
                                            const int dtype)
{
    const uint8_t *w = p->codes + (size_t)r * p->row_bytes;
    const size_t off = (size_t)r * p->ng;
    const gbx_span_f32 *xf = c->xf + (size_t)k * c->nspans;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int s = 0; s < c->nspans; ++s) {
        const uint8_t *wp = w + (size_t)s * (GBX_SPAN / 2);
        const gbx_span_f32 *xs = xf + s;
        if (s & 1)
            GBX_PREFETCH(wp + GBX_PREFETCH_BYTES);
        __m256 lo, hi;
        /* bytes 0-15 are block 2s, bytes 16-31 block 2s+1 */
        u4_unpack8(wp, &lo, &hi);
        __m256 ta = _mm256_mul_ps(lo, _mm256_loadu_ps(xs->even));
        __m256 ta2 = _mm256_mul_ps(hi, _mm256_loadu_ps(xs->odd));
        u4_unpack8(wp + 8, &lo, &hi);
        ta = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xs->even + 8), ta);
        ta2 = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xs->odd + 8), ta2);
        u4_unpack8(wp + 16, &lo, &hi);
        __m256 tb = _mm256_mul_ps(lo, _mm256_loadu_ps(xs->even + 16));
        __m256 tb2 = _mm256_mul_ps(hi, _mm256_loadu_ps(xs->odd + 16));
        u4_unpack8(wp + 24, &lo, &hi);
        tb = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xs->even + 24), tb);
        tb2 = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xs->odd + 24), tb2);
        const float sa = gbx_scale1_x86(p->scales, off + (size_t)((2 * s) >> p->gshift), dtype);
        const float sb = p->gshift ? sa : gbx_scale1_x86(p->scales, off + (size_t)(2 * s + 1), dtype);
        acc0 = _mm256_fmadd_ps(_mm256_add_ps(ta, ta2), _mm256_set1_ps(sa), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_add_ps(tb, tb2), _mm256_set1_ps(sb), acc1);
    }
    return hsum_avx2(_mm256_add_ps(acc0, acc1)) + gbx_nested_tail_float(c, p, r, k, 2 * c->nspans, c->I / GBX_QK) +
           group_dot(p->biases, off, p->xsum + (size_t)k * p->ng, p->ng, dtype);
}

/* 32 codes of block b times x: two partial sums (two FMA chains) */
GBX_NESTED_FN GBX_INLINE __m256 u8_block_float(const uint8_t *wb, const float *xb)
{
#define GBX_U8F(o) _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(wb + (o)))))
    __m256 t0 = _mm256_mul_ps(GBX_U8F(0), _mm256_loadu_ps(xb));
    __m256 t1 = _mm256_mul_ps(GBX_U8F(8), _mm256_loadu_ps(xb + 8));
    t0 = _mm256_fmadd_ps(GBX_U8F(16), _mm256_loadu_ps(xb + 16), t0);
    t1 = _mm256_fmadd_ps(GBX_U8F(24), _mm256_loadu_ps(xb + 24), t1);
#undef GBX_U8F
    return _mm256_add_ps(t0, t1);
}

GBX_NESTED_FN GBX_INLINE float plane8_float(const gbx_nested_ctx *c, const gbx_plane_rt *p, int r, int k,
                                            const int dtype)
{
    const uint8_t *w = p->codes + (size_t)r * p->row_bytes;
    const size_t off = (size_t)r * p->ng;
    const float *x = c->x + (size_t)k * c->I;
    const int nb = c->I / GBX_QK;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int b = 0;
    for (; b + 2 <= nb; b += 2) {
        GBX_PREFETCH(w + (size_t)b * GBX_QK + GBX_PREFETCH_BYTES);
        const __m256 t0 = u8_block_float(w + (size_t)b * GBX_QK, x + (size_t)b * GBX_QK);
        const __m256 t1 = u8_block_float(w + (size_t)(b + 1) * GBX_QK, x + (size_t)(b + 1) * GBX_QK);
        const float s0 = gbx_scale1_x86(p->scales, off + (size_t)(b >> p->gshift), dtype);
        const float s1 = p->gshift ? s0 : gbx_scale1_x86(p->scales, off + (size_t)(b + 1), dtype);
        acc0 = _mm256_fmadd_ps(t0, _mm256_set1_ps(s0), acc0);
        acc1 = _mm256_fmadd_ps(t1, _mm256_set1_ps(s1), acc1);
    }
    if (b < nb)
        acc0 = _mm256_fmadd_ps(u8_block_float(w + (size_t)b * GBX_QK, x + (size_t)b * GBX_QK),
                               _mm256_set1_ps(gbx_scale1_x86(p->scales, off + (size_t)(b >> p->gshift), dtype)), acc0);
    return hsum_avx2(_mm256_add_ps(acc0, acc1)) + group_dot(p->biases, off, p->xsum + (size_t)k * p->ng, p->ng, dtype);
}

/* Lane shuffles of a 6-bit block (24 bytes: A = bytes 0-15, B = bytes 8-23,
 * each broadcast to both 128-bit halves): for codes 8q .. 8q+7, lanes 0-3
 * get triplet 2q (bytes 6q .. 6q+2) and lanes 4-7 triplet 2q+1, each in the
 * low 24 bits of a 32-bit lane. */
#define GBX_TRIP(b) (b), (b) + 1, (b) + 2, -1, (b), (b) + 1, (b) + 2, -1, (b), (b) + 1, (b) + 2, -1, (b), (b) + 1, (b) + 2, -1
#define GBX_SIX_MASK(lo, hi) _mm256_setr_epi8(GBX_TRIP(lo), GBX_TRIP(hi))
#define GBX_SIX_SHIFTS \
    _mm256_setr_epi32(GBX_SIX_SHIFT(0), GBX_SIX_SHIFT(1), GBX_SIX_SHIFT(2), GBX_SIX_SHIFT(3), GBX_SIX_SHIFT(0), \
                      GBX_SIX_SHIFT(1), GBX_SIX_SHIFT(2), GBX_SIX_SHIFT(3))

/* 32 six-bit codes of a block (24 bytes at wb) times x: two partial sums */
GBX_NESTED_FN GBX_INLINE __m256 u6_block_float(const uint8_t *wb, const float *xb)
{
    const __m256i a = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)wb));
    const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(wb + 8)));
    const __m256i sh = GBX_SIX_SHIFTS, m6 = _mm256_set1_epi32(63);
#define GBX_U6F(v, lo, hi) \
    _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(_mm256_shuffle_epi8(v, GBX_SIX_MASK(lo, hi)), sh), m6))
    __m256 t0 = _mm256_mul_ps(GBX_U6F(a, 0, 3), _mm256_loadu_ps(xb));
    __m256 t1 = _mm256_mul_ps(GBX_U6F(a, 6, 9), _mm256_loadu_ps(xb + 8));
    t0 = _mm256_fmadd_ps(GBX_U6F(b, 4, 7), _mm256_loadu_ps(xb + 16), t0);
    t1 = _mm256_fmadd_ps(GBX_U6F(b, 10, 13), _mm256_loadu_ps(xb + 24), t1);
#undef GBX_U6F
    return _mm256_add_ps(t0, t1);
}

GBX_NESTED_FN GBX_INLINE float plane6_float(const gbx_nested_ctx *c, const gbx_plane_rt *p, int r, int k,
                                            const int dtype)
{
    const uint8_t *w = p->codes + (size_t)r * p->row_bytes;
    const size_t off = (size_t)r * p->ng;
    const float *x = c->x + (size_t)k * c->I;
    const int nb = c->I / GBX_QK;
    enum { BB = GBX_QK * 6 / 8 }; /* bytes of a block */
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int b = 0;
    for (; b + 2 <= nb; b += 2) {
        GBX_PREFETCH(w + (size_t)b * BB + GBX_PREFETCH_BYTES);
        const __m256 t0 = u6_block_float(w + (size_t)b * BB, x + (size_t)b * GBX_QK);
        const __m256 t1 = u6_block_float(w + (size_t)(b + 1) * BB, x + (size_t)(b + 1) * GBX_QK);
        const float s0 = gbx_scale1_x86(p->scales, off + (size_t)(b >> p->gshift), dtype);
        const float s1 = p->gshift ? s0 : gbx_scale1_x86(p->scales, off + (size_t)(b + 1), dtype);
        acc0 = _mm256_fmadd_ps(t0, _mm256_set1_ps(s0), acc0);
        acc1 = _mm256_fmadd_ps(t1, _mm256_set1_ps(s1), acc1);
    }
    if (b < nb)
        acc0 = _mm256_fmadd_ps(u6_block_float(w + (size_t)b * BB, x + (size_t)b * GBX_QK),
                               _mm256_set1_ps(gbx_scale1_x86(p->scales, off + (size_t)(b >> p->gshift), dtype)), acc0);
    return hsum_avx2(_mm256_add_ps(acc0, acc1)) + group_dot(p->biases, off, p->xsum + (size_t)k * p->ng, p->ng, dtype);
}

/* ---- intdot path ---------------------------------------------------------- */

/* The 32 six-bit codes of a block (24 bytes at wb) as bytes, in order: each
 * 32-bit lane takes a triplet (lanes 0-3 codes 0-15 from A, lanes 4-7 codes
 * 16-31 from B = bytes 8-23) and spreads its four codes to its four bytes. */
GBX_NESTED_FN GBX_INLINE __m256i u6_block_bytes(const uint8_t *wb)
{
    const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)wb)),
                                              _mm_loadu_si128((const __m128i *)(wb + 8)), 1);
    const __m256i d = _mm256_shuffle_epi8(
        v, _mm256_setr_epi8(0, 1, 2, -1, 3, 4, 5, -1, 6, 7, 8, -1, 9, 10, 11, -1, 4, 5, 6, -1, 7, 8, 9, -1, 10, 11,
                            12, -1, 13, 14, 15, -1));
    const __m256i m = _mm256_set1_epi32(63);
#define GBX_SIXB(k) _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(d, GBX_SIX_SHIFT(k)), m), 8 * (k))
    return _mm256_or_si256(_mm256_or_si256(GBX_SIXB(0), GBX_SIXB(1)), _mm256_or_si256(GBX_SIXB(2), GBX_SIXB(3)));
#undef GBX_SIXB
}

/* int32 lanes of block b's exact sum of codes * xq (6-bit codes) */
GBX_NESTED_FN GBX_INLINE __m256i u6_block_isum(const uint8_t *wb, const int8_t *xq)
{
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u6_block_bytes(wb), _mm256_loadu_si256((const __m256i *)xq)),
                             _mm256_set1_epi16(1));
}

GBX_NESTED_FN GBX_INLINE float plane6_intdot(const gbx_nested_ctx *c, const gbx_plane_rt *p, int r, int k,
                                             const int dtype)
{
    const uint8_t *w = p->codes + (size_t)r * p->row_bytes;
    const size_t off = (size_t)r * p->ng;
    const gbx_act_q8 *a = c->a + k;
    const int nb = c->I / GBX_QK;
    enum { BB = GBX_QK * 6 / 8 };
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int b = 0;
    for (; b + 2 <= nb; b += 2) {
        GBX_PREFETCH(w + (size_t)b * BB + GBX_PREFETCH_BYTES);
        const __m256 f0 = _mm256_cvtepi32_ps(u6_block_isum(w + (size_t)b * BB, a->qs + (size_t)b * GBX_QK));
        const __m256 f1 = _mm256_cvtepi32_ps(u6_block_isum(w + (size_t)(b + 1) * BB, a->qs + (size_t)(b + 1) * GBX_QK));
        const float s0 = gbx_scale1_x86(p->scales, off + (size_t)(b >> p->gshift), dtype);
        const float s1 = p->gshift ? s0 : gbx_scale1_x86(p->scales, off + (size_t)(b + 1), dtype);
        acc0 = _mm256_fmadd_ps(f0, _mm256_set1_ps(a->d[b] * s0), acc0);
        acc1 = _mm256_fmadd_ps(f1, _mm256_set1_ps(a->d[b + 1] * s1), acc1);
    }
    if (b < nb) {
        const __m256 f0 = _mm256_cvtepi32_ps(u6_block_isum(w + (size_t)b * BB, a->qs + (size_t)b * GBX_QK));
        acc0 = _mm256_fmadd_ps(f0, _mm256_set1_ps(a->d[b] * gbx_scale1_x86(p->scales, off + (size_t)(b >> p->gshift), dtype)),
                               acc0);
    }
    return hsum_avx2(_mm256_add_ps(acc0, acc1)) + group_dot(p->biases, off, p->xsum + (size_t)k * p->ng, p->ng, dtype);
}

/* One span of 4-bit codes as unsigned bytes: low nibbles (elements 0,2,..,62)
 * and high nibbles (1,3,..,63), matching gbx_span_q8. */
GBX_NESTED_FN GBX_INLINE void u4_span_split(const uint8_t *w, __m256i *lo, __m256i *hi)
{
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m256i v = _mm256_loadu_si256((const __m256i *)w);
    __m256i l = _mm256_and_si256(v, m4);
    __m256i h = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    GBX_NIBBLE_ORDER(__m256i, l, h);
    *lo = l;
    *hi = h;
}

/* int32 lane l of span s: sum of codes * xq over bytes 4l..4l+3 of both
 * halves (lanes 0-3 block 2s, lanes 4-7 block 2s+1), exact. */
GBX_NESTED_FN GBX_INLINE __m256i u4_span_isum_avx2(const uint8_t *w, const gbx_span_q8 *xs)
{
    __m256i lo, hi;
    u4_span_split(w, &lo, &hi);
    const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)xs->even)),
                                       _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)xs->odd)));
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

/* int32 lanes of block b's sum of (u - 128) * xq (u ^ 0x80 is u - 128 as int8;
 * vpmaddubsw takes |w| and sign(x, w)). */
GBX_NESTED_FN GBX_INLINE __m256i u8_block_isum_signed(const uint8_t *wb, const int8_t *xq)
{
    const __m256i ws = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)wb), _mm256_set1_epi8((char)0x80));
    const __m256i xv = _mm256_loadu_si256((const __m256i *)xq);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(ws), _mm256_sign_epi8(xv, ws)), _mm256_set1_epi16(1));
}

/* The 4-bit and 8-bit intdot rows, written once for each exact integer dot:
 * SPAN_ISUM(w, xs) a span of 4-bit codes, BLOCK_ISUM(w, xq) a block of 8-bit
 * codes; SIGNED8 says BLOCK_ISUM multiplies u - 128: 128 * sum_g s_g xsum_g adds
 * the rest (xsum holds the int8 activations' group sums). */
#define GBX_DEF_NESTED_INTDOT(SUFFIX, ATTR, SPAN_ISUM, BLOCK_ISUM, SIGNED8)                                        \
    ATTR GBX_INLINE float plane4_intdot_##SUFFIX(const gbx_nested_ctx *c, const gbx_plane_rt *p, int r, int k,   \
                                                 const int dtype)                                                \
    {                                                                                                            \
        const uint8_t *w = p->codes + (size_t)r * p->row_bytes;                                                  \
        const size_t off = (size_t)r * p->ng;                                                                    \
        const gbx_act_q8 *a = c->a + k;                                                                          \
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();                                           \
        int s = 0;                                                                                               \
        for (; s + 2 <= c->nspans; s += 2) {                                                                     \
            GBX_PREFETCH(w + (size_t)s * (GBX_SPAN / 2) + GBX_PREFETCH_BYTES);                                   \
            const __m256 f0 = _mm256_cvtepi32_ps(SPAN_ISUM(w + (size_t)s * (GBX_SPAN / 2), a->split + s));       \
            const __m256 f1 = _mm256_cvtepi32_ps(SPAN_ISUM(w + (size_t)(s + 1) * (GBX_SPAN / 2), a->split + s + 1)); \
            acc0 = _mm256_fmadd_ps(_mm256_mul_ps(f0, _mm256_load_ps(a->span_d + 8 * (size_t)s)),                 \
                                   span_scales(p->scales, off, s, p->gshift, dtype), acc0);                      \
            acc1 = _mm256_fmadd_ps(_mm256_mul_ps(f1, _mm256_load_ps(a->span_d + 8 * (size_t)(s + 1))),           \
                                   span_scales(p->scales, off, s + 1, p->gshift, dtype), acc1);                  \
        }                                                                                                        \
        if (s < c->nspans) {                                                                                     \
            const __m256 f0 = _mm256_cvtepi32_ps(SPAN_ISUM(w + (size_t)s * (GBX_SPAN / 2), a->split + s));       \
            acc0 = _mm256_fmadd_ps(_mm256_mul_ps(f0, _mm256_load_ps(a->span_d + 8 * (size_t)s)),                 \
                                   span_scales(p->scales, off, s, p->gshift, dtype), acc0);                      \
        }                                                                                                        \
        return hsum_avx2(_mm256_add_ps(acc0, acc1)) +                                                            \
               gbx_nested_tail_intdot(c, p, r, k, 2 * c->nspans, c->I / GBX_QK) +                                \
               group_dot(p->biases, off, p->xsum + (size_t)k * p->ng, p->ng, dtype);                             \
    }                                                                                                            \
    ATTR GBX_INLINE float plane8_intdot_##SUFFIX(const gbx_nested_ctx *c, const gbx_plane_rt *p, int r, int k,   \
                                                 const int dtype)                                                \
    {                                                                                                            \
        const uint8_t *w = p->codes + (size_t)r * p->row_bytes;                                                  \
        const size_t off = (size_t)r * p->ng;                                                                    \
        const gbx_act_q8 *a = c->a + k;                                                                          \
        const int nb = c->I / GBX_QK;                                                                            \
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();                                           \
        int b = 0;                                                                                               \
        for (; b + 2 <= nb; b += 2) {                                                                            \
            GBX_PREFETCH(w + (size_t)b * GBX_QK + GBX_PREFETCH_BYTES);                                           \
            const __m256 f0 = _mm256_cvtepi32_ps(BLOCK_ISUM(w + (size_t)b * GBX_QK, a->qs + (size_t)b * GBX_QK)); \
            const __m256 f1 =                                                                                    \
                _mm256_cvtepi32_ps(BLOCK_ISUM(w + (size_t)(b + 1) * GBX_QK, a->qs + (size_t)(b + 1) * GBX_QK));  \
            const float s0 = gbx_scale1_x86(p->scales, off + (size_t)(b >> p->gshift), dtype);                           \
            const float s1 = p->gshift ? s0 : gbx_scale1_x86(p->scales, off + (size_t)(b + 1), dtype);                   \
            acc0 = _mm256_fmadd_ps(f0, _mm256_set1_ps(a->d[b] * s0), acc0);                                      \
            acc1 = _mm256_fmadd_ps(f1, _mm256_set1_ps(a->d[b + 1] * s1), acc1);                                  \
        }                                                                                                        \
        if (b < nb) {                                                                                            \
            const __m256 f0 = _mm256_cvtepi32_ps(BLOCK_ISUM(w + (size_t)b * GBX_QK, a->qs + (size_t)b * GBX_QK)); \
            const float s0 = gbx_scale1_x86(p->scales, off + (size_t)(b >> p->gshift), dtype);                           \
            acc0 = _mm256_fmadd_ps(f0, _mm256_set1_ps(a->d[b] * s0), acc0);                                      \
        }                                                                                                        \
        float y = hsum_avx2(_mm256_add_ps(acc0, acc1));                                                          \
        if (SIGNED8)                                                                                             \
            y += 128.0f * group_dot(p->scales, off, p->xsum + (size_t)k * p->ng, p->ng, dtype);                  \
        return y + group_dot(p->biases, off, p->xsum + (size_t)k * p->ng, p->ng, dtype);                         \
    }                                                                                                            \
    /* Row r of a gear of plane 0 alone or of planes 0 and 1 (TWO), all 4-bit, in one    \
     * pass over the row: each plane's own spans, in plane4_intdot's order, and its bias   \
     * term folded into its accumulator, so a plane makes one horizontal sum (the reads    \
     * and the per-row work are what bound a one-row product of these small matrices).     \
     * PG, QG: the planes' gshift (constants in the default plan's copies).                */ \
    ATTR GBX_INLINE void rows4_row_##SUFFIX(const gbx_nested_ctx *c, int r, int k, const int two, const int pg,  \
                                            const int qg, const int dtype)                                       \
    {                                                                                                            \
        const gbx_plane_rt *p = c->p, *q = c->p + (two ? 1 : 0);                                                 \
        const uint8_t *w = p->codes + (size_t)r * p->row_bytes, *v = q->codes + (size_t)r * q->row_bytes;        \
        const size_t off = (size_t)r * p->ng, offq = (size_t)r * q->ng;                                          \
        const gbx_act_q8 *a = c->a + k;                                                                          \
        __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, bcc0 = acc0, bcc1 = acc0;                                \
        int s = 0;                                                                                               \
        for (; s + 2 <= c->nspans; s += 2) {                                                                     \
            GBX_PREFETCH(w + (size_t)s * (GBX_SPAN / 2) + GBX_PREFETCH_BYTES);                                   \
            if (two)                                                                                             \
                GBX_PREFETCH(v + (size_t)s * (GBX_SPAN / 2) + GBX_PREFETCH_BYTES);                                \
            const __m256 d0 = _mm256_load_ps(a->span_d + 8 * (size_t)s);                                         \
            const __m256 d1 = _mm256_load_ps(a->span_d + 8 * (size_t)(s + 1));                                   \
            const __m256 f0 = _mm256_cvtepi32_ps(SPAN_ISUM(w + (size_t)s * (GBX_SPAN / 2), a->split + s));       \
            const __m256 f1 = _mm256_cvtepi32_ps(SPAN_ISUM(w + (size_t)(s + 1) * (GBX_SPAN / 2), a->split + s + 1)); \
            acc0 = _mm256_fmadd_ps(_mm256_mul_ps(f0, d0), span_scales(p->scales, off, s, pg, dtype), acc0);      \
            acc1 = _mm256_fmadd_ps(_mm256_mul_ps(f1, d1), span_scales(p->scales, off, s + 1, pg, dtype), acc1);  \
            if (two) {                                                                                           \
                const __m256 g0 = _mm256_cvtepi32_ps(SPAN_ISUM(v + (size_t)s * (GBX_SPAN / 2), a->split + s));   \
                const __m256 g1 =                                                                                \
                    _mm256_cvtepi32_ps(SPAN_ISUM(v + (size_t)(s + 1) * (GBX_SPAN / 2), a->split + s + 1));       \
                bcc0 = _mm256_fmadd_ps(_mm256_mul_ps(g0, d0), span_scales(q->scales, offq, s, qg, dtype), bcc0); \
                bcc1 = _mm256_fmadd_ps(_mm256_mul_ps(g1, d1), span_scales(q->scales, offq, s + 1, qg, dtype), bcc1); \
            }                                                                                                    \
        }                                                                                                        \
        if (s < c->nspans) {                                                                                     \
            const __m256 d0 = _mm256_load_ps(a->span_d + 8 * (size_t)s);                                         \
            const __m256 f0 = _mm256_cvtepi32_ps(SPAN_ISUM(w + (size_t)s * (GBX_SPAN / 2), a->split + s));       \
            acc0 = _mm256_fmadd_ps(_mm256_mul_ps(f0, d0), span_scales(p->scales, off, s, pg, dtype), acc0);      \
            if (two) {                                                                                           \
                const __m256 g0 = _mm256_cvtepi32_ps(SPAN_ISUM(v + (size_t)s * (GBX_SPAN / 2), a->split + s));   \
                bcc0 = _mm256_fmadd_ps(_mm256_mul_ps(g0, d0), span_scales(q->scales, offq, s, qg, dtype), bcc0); \
            }                                                                                                    \
        }                                                                                                        \
        const int tail = 2 * c->nspans < c->I / GBX_QK;                                                          \
        float rp;                                                                                                \
        acc0 = group_fma(_mm256_add_ps(acc0, acc1), p->biases, off, p->xsum + (size_t)k * p->ng, p->ng, &rp, dtype); \
        float yp = hsum_avx2(acc0) + rp;                                                                         \
        if (tail)                                                                                                \
            yp += gbx_nested_tail_intdot(c, p, r, k, 2 * c->nspans, c->I / GBX_QK);                              \
        float y = 0.0f;                                                                                          \
        y += p->factor * yp;                                                                                     \
        if (two) {                                                                                               \
            float rq;                                                                                            \
            bcc0 = group_fma(_mm256_add_ps(bcc0, bcc1), q->biases, offq, q->xsum + (size_t)k * q->ng, q->ng, &rq, dtype); \
            float yq = hsum_avx2(bcc0) + rq;                                                                     \
            if (tail)                                                                                            \
                yq += gbx_nested_tail_intdot(c, q, r, k, 2 * c->nspans, c->I / GBX_QK);                          \
            y += q->factor * yq;                                                                                 \
        }                                                                                                        \
        c->y[(size_t)k * c->O + r] = y;                                                                          \
    }                                                                                                            \
    /* Rows r0..r1 of every activation row, with the default plan's group sizes (64, and 32  \
     * for plane 1) as constants in their own copy.                                          */ \
    ATTR GBX_INLINE void rows4_##SUFFIX(const gbx_nested_ctx *c, int r0, int r1, const int two, const int dtype) \
    {                                                                                                            \
        const int pg = c->p[0].gshift, qg = two ? c->p[1].gshift : 0;                                            \
        if (pg == 1 && qg == 0) {                                                                                \
            for (int r = r0; r < r1; ++r)                                                                        \
                for (int k = 0; k < c->m; ++k)                                                                   \
                    rows4_row_##SUFFIX(c, r, k, two, 1, 0, dtype);                                               \
            return;                                                                                              \
        }                                                                                                        \
        for (int r = r0; r < r1; ++r)                                                                            \
            for (int k = 0; k < c->m; ++k)                                                                       \
                rows4_row_##SUFFIX(c, r, k, two, pg, qg, dtype);                                                 \
    }                                                                                                            \
    ATTR GBX_INLINE void pair4_rows_##SUFFIX(const gbx_nested_ctx *c, int r0, int r1, const int dtype)          \
    {                                                                                                            \
        rows4_##SUFFIX(c, r0, r1, 1, dtype);                                                                     \
    }                                                                                                            \
    ATTR GBX_INLINE void one4_rows_##SUFFIX(const gbx_nested_ctx *c, int r0, int r1, const int dtype)           \
    {                                                                                                            \
        rows4_##SUFFIX(c, r0, r1, 0, dtype);                                                                     \
    }

/* One exported function per (bits, dtype): the dtype a compile-time constant. */
#define GBX_NESTED_INST(ATTR, BODY, NAME, DT) \
    ATTR static float NAME(const gbx_nested_ctx *c, const gbx_plane_rt *p, int r, int k) { return BODY(c, p, r, k, DT); }
#define GBX_PAIR_INST(ATTR, BODY, NAME, DT) \
    ATTR static void NAME(const gbx_nested_ctx *c, int r0, int r1) { BODY(c, r0, r1, DT); }
/* The intdot families' rows kernels of two 4-bit planes (PAIR4) and of one (ONE4) */
#define GBX_PAIR_TABLE(TABLE, ATTR, PAIR4, ONE4)                               \
    GBX_PAIR_INST(ATTR, PAIR4, TABLE##_p4_f32, GBX_DTYPE_F32)                  \
    GBX_PAIR_INST(ATTR, PAIR4, TABLE##_p4_f16, GBX_DTYPE_F16)                  \
    GBX_PAIR_INST(ATTR, PAIR4, TABLE##_p4_bf16, GBX_DTYPE_BF16)                \
    GBX_PAIR_INST(ATTR, ONE4, TABLE##_o4_f32, GBX_DTYPE_F32)                   \
    GBX_PAIR_INST(ATTR, ONE4, TABLE##_o4_f16, GBX_DTYPE_F16)                   \
    GBX_PAIR_INST(ATTR, ONE4, TABLE##_o4_bf16, GBX_DTYPE_BF16)
#define GBX_PAIRS_OF(TABLE) \
    {TABLE##_p4_f32, TABLE##_p4_f16, TABLE##_p4_bf16}, {TABLE##_o4_f32, TABLE##_o4_f16, TABLE##_o4_bf16}
#define GBX_NESTED_TABLE(TABLE, ISA, ATTR, BODY4, BODY8, BODY6, PAIRS)         \
    GBX_NESTED_INST(ATTR, BODY4, TABLE##_4_f32, GBX_DTYPE_F32)                 \
    GBX_NESTED_INST(ATTR, BODY4, TABLE##_4_f16, GBX_DTYPE_F16)                 \
    GBX_NESTED_INST(ATTR, BODY4, TABLE##_4_bf16, GBX_DTYPE_BF16)               \
    GBX_NESTED_INST(ATTR, BODY8, TABLE##_8_f32, GBX_DTYPE_F32)                 \
    GBX_NESTED_INST(ATTR, BODY8, TABLE##_8_f16, GBX_DTYPE_F16)                 \
    GBX_NESTED_INST(ATTR, BODY8, TABLE##_8_bf16, GBX_DTYPE_BF16)               \
    GBX_NESTED_INST(ATTR, BODY6, TABLE##_6_f32, GBX_DTYPE_F32)                 \
    GBX_NESTED_INST(ATTR, BODY6, TABLE##_6_f16, GBX_DTYPE_F16)                 \
    GBX_NESTED_INST(ATTR, BODY6, TABLE##_6_bf16, GBX_DTYPE_BF16)               \
    const gbx_nested_kernels TABLE = {ISA,                                     \
                                      {{TABLE##_4_f32, TABLE##_4_f16, TABLE##_4_bf16}, \
                                       {TABLE##_8_f32, TABLE##_8_f16, TABLE##_8_bf16}, \
                                       {TABLE##_6_f32, TABLE##_6_f16, TABLE##_6_bf16}}, \
                                      PAIRS};

GBX_NESTED_TABLE(gbx_nested_float_avx2, "avx2", GBX_NESTED_FN, plane4_float, plane8_float, plane6_float, )

GBX_DEF_NESTED_INTDOT(avx2, GBX_NESTED_FN, u4_span_isum_avx2, u8_block_isum_signed, 1)
GBX_PAIR_TABLE(gbx_nested_intdot_avx2, GBX_NESTED_FN, pair4_rows_avx2, one4_rows_avx2)
GBX_NESTED_TABLE(gbx_nested_intdot_avx2, "avx2", GBX_NESTED_FN, plane4_intdot_avx2, plane8_intdot_avx2,
                 plane6_intdot, GBX_PAIRS_OF(gbx_nested_intdot_avx2))

/* vpdpbusd: unsigned codes times int8 x, four products per int32 lane, no
 * int16 pairs to saturate. */
#define GBX_DEF_NESTED_VNNI(SUFFIX, ATTR, DPBUSD)                                                       \
    ATTR GBX_INLINE __m256i u4_span_isum_##SUFFIX(const uint8_t *w, const gbx_span_q8 *xs)              \
    {                                                                                                   \
        __m256i lo, hi;                                                                                 \
        u4_span_split(w, &lo, &hi);                                                                     \
        const __m256i i = DPBUSD(_mm256_setzero_si256(), lo, _mm256_loadu_si256((const __m256i *)xs->even)); \
        return DPBUSD(i, hi, _mm256_loadu_si256((const __m256i *)xs->odd));                            \
    }                                                                                                   \
    ATTR GBX_INLINE __m256i u8_block_isum_##SUFFIX(const uint8_t *wb, const int8_t *xq)                 \
    {                                                                                                   \
        return DPBUSD(_mm256_setzero_si256(), _mm256_loadu_si256((const __m256i *)wb),                  \
                      _mm256_loadu_si256((const __m256i *)xq));                                         \
    }                                                                                                   \
    GBX_DEF_NESTED_INTDOT(SUFFIX, ATTR, u4_span_isum_##SUFFIX, u8_block_isum_##SUFFIX, 0)

#if GBX_VNNI512
#define GBX_NESTED_VNNI512_FN __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512vnni")))
GBX_DEF_NESTED_VNNI(vnni512, GBX_NESTED_VNNI512_FN, _mm256_dpbusd_epi32)
GBX_PAIR_TABLE(gbx_nested_intdot_vnni512, GBX_NESTED_VNNI512_FN, pair4_rows_vnni512, one4_rows_vnni512)
GBX_NESTED_TABLE(gbx_nested_intdot_vnni512, "avx512vnni", GBX_NESTED_VNNI512_FN, plane4_intdot_vnni512,
                 plane8_intdot_vnni512, plane6_intdot, GBX_PAIRS_OF(gbx_nested_intdot_vnni512))
#endif
#if GBX_AVXVNNI
#define GBX_NESTED_AVXVNNI_FN __attribute__((target("avx2,fma,f16c,avxvnni")))
GBX_DEF_NESTED_VNNI(avxvnni, GBX_NESTED_AVXVNNI_FN, _mm256_dpbusd_avx_epi32)
GBX_PAIR_TABLE(gbx_nested_intdot_avxvnni, GBX_NESTED_AVXVNNI_FN, pair4_rows_avxvnni, one4_rows_avxvnni)
GBX_NESTED_TABLE(gbx_nested_intdot_avxvnni, "avxvnni", GBX_NESTED_AVXVNNI_FN, plane4_intdot_avxvnni,
                 plane8_intdot_avxvnni, plane6_intdot, GBX_PAIRS_OF(gbx_nested_intdot_avxvnni))
#endif

#endif /* GBX_X86 */
