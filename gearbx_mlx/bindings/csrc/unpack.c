/*
 * unpack.c -- a gear's weights as one float32 matrix: w = sum_{p<n} deq(p),
 * for a BLAS product of several activation rows (a prefill on the CPU).
 *
 * Each element is formed exactly as gearbx_mlx.nested.planes.unpack_plane
 * forms it in MLX: s' = scale * factor and b' = bias * factor per group (a
 * power of two: exact), then q * s' + b' rounded as a product and a sum (no
 * fused multiply-add), and the planes added in order, plane 0 first.  So
 * the result equals the MLX oracle bit for bit.  The whole file is compiled
 * without floating-point contraction (GCC's default -ffp-contract=fast would
 * otherwise fuse q * s' + b' where the target has FMA, e.g. AArch64); the
 * AVX2 kernels are compiled for "avx2" without "fma" for the same reason,
 * and the AVX-512 one (CPUs with AVX-512F, unless gbx_set_isa_limit asks for
 * plain AVX2) relies on the file's setting alone.  Elsewhere the scalar loops
 * are written for the compiler to vectorize.  Rows are split over the thread
 * pool (pool.c).
 */
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "internal.h"

/* o[j] = q_j * s + b (first plane) or o[j] += q_j * s + b, for the gs codes
 * of one group starting at byte `cr`. */
GBX_INLINE void group_4(float *restrict o, const uint8_t *restrict cr, int gs, float s, float b, int add)
{
    if (add)
        for (int j = 0; j < gs / 2; ++j) {
            o[2 * j] = o[2 * j] + ((float)(cr[j] & 15) * s + b);
            o[2 * j + 1] = o[2 * j + 1] + ((float)(cr[j] >> 4) * s + b);
        }
    else
        for (int j = 0; j < gs / 2; ++j) {
            o[2 * j] = (float)(cr[j] & 15) * s + b;
            o[2 * j + 1] = (float)(cr[j] >> 4) * s + b;
        }
}

GBX_INLINE void group_8(float *restrict o, const uint8_t *restrict cr, int gs, float s, float b, int add)
{
    if (add)
        for (int j = 0; j < gs; ++j)
            o[j] = o[j] + ((float)cr[j] * s + b);
    else
        for (int j = 0; j < gs; ++j)
            o[j] = (float)cr[j] * s + b;
}

/* 6 bits: every 3 bytes hold 4 codes, least significant first (a group of
 * 32, 64 or 128 codes is whole triplets). */
GBX_INLINE void group_6(float *restrict o, const uint8_t *restrict cr, int gs, float s, float b, int add)
{
    for (int t = 0; t < gs / 4; ++t) {
        const uint32_t v = (uint32_t)cr[3 * t] | (uint32_t)cr[3 * t + 1] << 8 | (uint32_t)cr[3 * t + 2] << 16;
        for (int k = 0; k < 4; ++k) {
            const float d = (float)((v >> (6 * k)) & 63u) * s + b;
            o[4 * t + k] = add ? o[4 * t + k] + d : d;
        }
    }
}

/* The rows [r0, r1) of the block: each row's planes summed in plane order, one
 * group at a time, through the group functions G4, G8 and G6 (of one ISA). */
#define GBX_UNPACK_ROWS(NAME, ATTR, G4, G8, G6)                                                     \
    ATTR static void NAME(const gbx_ctx *cc, int r0, int r1)                                       \
    {                                                                                              \
        const gbx_nested_ctx *c = cc->nest;                                                        \
        for (int k = r0; k < r1; ++k) {                                                            \
            const int r = c->m + k; /* c->m: the first row of the block (row0) */                  \
            float *out = c->y + (size_t)k * c->I;                                                  \
            for (int i = 0; i < c->n; ++i) {                                                       \
                const gbx_plane_rt *p = c->p + i;                                                  \
                const uint8_t *row = p->codes + (size_t)r * p->row_bytes;                          \
                const int gs = c->I / p->ng;                                                       \
                const size_t gbytes = (size_t)gs * p->bits / 8;                                    \
                for (int g = 0; g < p->ng; ++g) {                                                  \
                    const size_t at = (size_t)r * p->ng + (size_t)g;                               \
                    const float s = gbx_scale_at(p->scales, at, p->dtype) * p->factor;             \
                    const float b = gbx_scale_at(p->biases, at, p->dtype) * p->factor;             \
                    float *o = out + (size_t)g * gs;                                               \
                    const uint8_t *cr = row + (size_t)g * gbytes;                                  \
                    if (p->bits == 4)                                                              \
                        G4(o, cr, gs, s, b, i > 0);                                                \
                    else if (p->bits == 8)                                                         \
                        G8(o, cr, gs, s, b, i > 0);                                                \
                    else                                                                           \
                        G6(o, cr, gs, s, b, i > 0);                                                \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    }

GBX_UNPACK_ROWS(unpack_rows, , group_4, group_8, group_6)

#if GBX_X86
/* AVX2 without FMA: each q * s' + b' stays a rounded product and a rounded sum. */
#define GBX_UNPACK_AVX2_FN __attribute__((target("avx2")))

/* Eight codes (epu8 in the low 8 bytes of c) -> o[0..7], stored or added. */
GBX_UNPACK_AVX2_FN GBX_INLINE void put8_avx2(float *o, __m128i c, __m256 s, __m256 b, int add)
{
    const __m256 d = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(c)), s), b);
    _mm256_storeu_ps(o, add ? _mm256_add_ps(_mm256_loadu_ps(o), d) : d);
}

/* A group of gs (a multiple of 32) 4-bit codes: 16 bytes hold 32 codes, low nibble first. */
GBX_UNPACK_AVX2_FN GBX_INLINE void group_4_avx2(float *o, const uint8_t *cr, int gs, float sf, float bf, int add)
{
    const __m256 s = _mm256_set1_ps(sf), b = _mm256_set1_ps(bf);
    const __m128i mask = _mm_set1_epi8(15);
    for (int j = 0; j < gs; j += 32) {
        const __m128i v = _mm_loadu_si128((const __m128i *)(cr + j / 2));
        const __m128i lo = _mm_and_si128(v, mask), hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
        const __m128i c0 = _mm_unpacklo_epi8(lo, hi), c1 = _mm_unpackhi_epi8(lo, hi); /* codes in order */
        put8_avx2(o + j, c0, s, b, add);
        put8_avx2(o + j + 8, _mm_srli_si128(c0, 8), s, b, add);
        put8_avx2(o + j + 16, c1, s, b, add);
        put8_avx2(o + j + 24, _mm_srli_si128(c1, 8), s, b, add);
    }
}

GBX_UNPACK_AVX2_FN GBX_INLINE void group_8_avx2(float *o, const uint8_t *cr, int gs, float sf, float bf, int add)
{
    const __m256 s = _mm256_set1_ps(sf), b = _mm256_set1_ps(bf);
    for (int j = 0; j < gs; j += 16) {
        const __m128i v = _mm_loadu_si128((const __m128i *)(cr + j));
        put8_avx2(o + j, v, s, b, add);
        put8_avx2(o + j + 8, _mm_srli_si128(v, 8), s, b, add);
    }
}

/* A group of gs (a multiple of 32) 6-bit codes, 8 at a time: code k of the 8 (bits
 * 6k .. 6k+5 of their 6 bytes) is the dword at byte k*3/4, shifted right by 6k mod 8.
 * One 16-byte load covers 8 codes; it never reaches past the group's bytes (the
 * last ones are loaded from 16 bytes before the group's end, and the shuffle's
 * indices start d bytes in), and a dword's bytes past the load read as zero,
 * where no code of the 8 has any of its bits. */
GBX_UNPACK_AVX2_FN GBX_INLINE void group_6_avx2(float *o, const uint8_t *cr, int gs, float sf, float bf, int add)
{
    const __m256 s = _mm256_set1_ps(sf), b = _mm256_set1_ps(bf);
    /* dword k's bytes k*3/4 + 0..3, within each 128-bit lane (the load is in both) */
    const __m256i base = _mm256_setr_epi8(0, 1, 2, 3, 0, 1, 2, 3, 1, 2, 3, 4, 2, 3, 4, 5,
                                          3, 4, 5, 6, 3, 4, 5, 6, 4, 5, 6, 7, 5, 6, 7, 8);
    const __m256i shift = _mm256_setr_epi32(0, 6, 4, 2, 0, 6, 4, 2);
    const __m256i m63 = _mm256_set1_epi32(63), fifteen = _mm256_set1_epi8(15);
    const int gbytes = gs * 6 / 8;
    for (int t = 0; t < gs / 8; ++t) {
        int at = 6 * t, d = 0;
        if (at + 16 > gbytes) {
            d = at - (gbytes - 16);
            at = gbytes - 16;
        }
        const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(cr + at)));
        const __m256i idx = _mm256_add_epi8(base, _mm256_set1_epi8((char)d));
        /* indices past 15 get their top bit set: pshufb writes zero there */
        const __m256i safe = _mm256_or_si256(idx, _mm256_cmpgt_epi8(idx, fifteen));
        const __m256i q = _mm256_and_si256(_mm256_srlv_epi32(_mm256_shuffle_epi8(v, safe), shift), m63);
        const __m256 dv = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(q), s), b);
        _mm256_storeu_ps(o + 8 * t, add ? _mm256_add_ps(_mm256_loadu_ps(o + 8 * t), dv) : dv);
    }
}

GBX_UNPACK_ROWS(unpack_rows_avx2, GBX_UNPACK_AVX2_FN, group_4_avx2, group_8_avx2, group_6_avx2)
#endif

#if GBX_VNNI512
/* AVX-512 (CPUs with AVX-512F, at gbx_set_isa_limit 0), for gears of 4- and 8-bit
 * planes (a gear with a 6-bit plane keeps unpack_rows_avx2).  Still a rounded
 * product and a rounded sum: the file is compiled without contraction. */
#define GBX_UNPACK_AVX512_FN __attribute__((target("avx2,avx512f")))

/* Planes of 4 and 8 bits (every group a multiple of 32): each span of 32 weights
 * formed from every plane in registers, plane 0 first (the same sums as a plane
 * at a time), and stored once, where a plane at a time stores a span once per
 * plane and loads it back for the next (its stores were its hottest instructions
 * in a profile).  Streaming stores, which skip reading a line in before writing
 * it, measured slower: the product that follows then reads the matrix back from
 * memory. */
GBX_UNPACK_AVX512_FN static void unpack_rows_fused_avx512(const gbx_ctx *cc, int r0, int r1)
{
    const gbx_nested_ctx *c = cc->nest;
    const __m128i mask = _mm_set1_epi8(15);
    int gshift[GBX_MAX_PLANES];
    for (int i = 0; i < c->n; ++i)
        gshift[i] = __builtin_ctz((unsigned)(c->I / c->p[i].ng));
    for (int k = r0; k < r1; ++k) {
        const int r = c->m + k;
        float *out = c->y + (size_t)k * c->I;
        for (int j = 0; j < c->I; j += 32) {
            __m512 a0 = _mm512_setzero_ps(), a1 = a0;
            for (int i = 0; i < c->n; ++i) {
                const gbx_plane_rt *p = c->p + i;
                const size_t at = (size_t)r * p->ng + (size_t)(j >> gshift[i]);
                const __m512 s = _mm512_set1_ps(gbx_scale_at(p->scales, at, p->dtype) * p->factor);
                const __m512 b = _mm512_set1_ps(gbx_scale_at(p->biases, at, p->dtype) * p->factor);
                const uint8_t *row = p->codes + (size_t)r * p->row_bytes;
                __m128i c0, c1;
                if (p->bits == 4) {
                    const __m128i v = _mm_loadu_si128((const __m128i *)(row + j / 2));
                    const __m128i lo = _mm_and_si128(v, mask), hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
                    c0 = _mm_unpacklo_epi8(lo, hi);
                    c1 = _mm_unpackhi_epi8(lo, hi);
                } else {
                    c0 = _mm_loadu_si128((const __m128i *)(row + j));
                    c1 = _mm_loadu_si128((const __m128i *)(row + j + 16));
                }
                const __m512 d0 = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(c0)), s), b);
                const __m512 d1 = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(c1)), s), b);
                a0 = i ? _mm512_add_ps(a0, d0) : d0;
                a1 = i ? _mm512_add_ps(a1, d1) : d1;
            }
            _mm512_storeu_ps(out + j, a0);
            _mm512_storeu_ps(out + j + 16, a1);
        }
    }
}
#endif

int gbx_nested_unpack(const gbx_plane *planes, int n, float *w, int row0, int row1, int out_features,
                      int in_features, int nthreads)
{
    int rc = gbx_check_nested(planes, n, 1, out_features, in_features, GBX_PATH_FLOAT);
    if (rc != GBX_OK)
        return rc;
    if (row0 < 0 || row1 < row0 || row1 > out_features)
        return GBX_E_SHAPE;
    if (row1 == row0)
        return GBX_OK;
    if (!w || !gbx_planes_present(planes, n))
        return GBX_E_NULL;
    gbx_cpu_init();
    gbx_nested_ctx c;
    gbx_nested_setup(&c, planes, n, out_features, in_features);
    c.m = row0;
    c.y = w;
    gbx_rows_fn fn = unpack_rows;
#if GBX_X86
    if (gbx_cpu.avx2)
        fn = unpack_rows_avx2;
#endif
#if GBX_VNNI512
    if (gbx_cpu.avx512f && gbx_isa_limit == 0) {
        int six = 0;
        for (int i = 0; i < n; ++i)
            six = six || planes[i].bits == 6;
        if (!six)
            fn = unpack_rows_fused_avx512;
    }
#endif
    return gbx_nested_run(fn, &c, row1 - row0, (size_t)in_features * (size_t)n, nthreads, 0);
}
