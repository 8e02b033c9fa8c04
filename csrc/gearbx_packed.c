/*
 * gearbx_packed.c -- fast packed int4/int8 GEMV: SIMD kernels, scalar tails,
 * run-time dispatch, and a small pthread pool that splits rows.
 *
 * Kernel families (chosen per call from what the CPU reports):
 *   x86-64   float: AVX2+FMA.  intdot: 256-bit vpdpbusd (AVX512-VNNI+VL or
 *            AVX-VNNI) where present, else AVX2 vpmaddubsw.  Weights are
 *            software-prefetched 2 KiB ahead.
 *   AArch64  float: NEON.  intdot: vdotq_s32 where the CPU has dotprod,
 *            else vmull_s8/vpadalq_s16.
 *   other    the scalar tails from element 0.
 * Layouts and the maths each kernel must reproduce: gearbx_packed.h.
 * Oracles: gearbx_packed_ref.c.  Self-test: test_main.c.
 *
 * Build-time switches:
 *   GEARBX_PLANT_NIBBLE_BUG  swap low/high nibbles in every fast int4 kernel
 *                            (tests must catch it; never set in a release)
 *   GEARBX_NO_THREADS        no pthreads: every call runs on the caller
 *   GEARBX_NO_DOTPROD        leave the AArch64 vdotq_s32 kernels out
 *   GBX_PREFETCH_BYTES       x86 software-prefetch distance (default 2048)
 */
#include <stdlib.h>
#include <string.h>

#include "gearbx_packed.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define GBX_X86 1
#include <immintrin.h>
/* AVX2 code is compiled per function, so the rest of the library (and the
 * oracles) stays baseline x86-64 and a CPU without AVX2 never meets it. */
#define GBX_AVX2_FN __attribute__((target("avx2,fma")))
/* vpdpbusd does vpmaddubsw + vpmaddwd + add in one instruction: the 256-bit
 * EVEX form (AVX512-VNNI + VL: Zen 4, Ice Lake and later Xeons) or the VEX
 * form (AVX-VNNI: Alder Lake and later).  Each needs a compiler that can
 * both target it and ask the CPU for it. */
#if (defined(__clang__) && __clang_major__ >= 14) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 10)
#define GBX_VNNI512 1
#define GBX_VNNI512_FN __attribute__((target("avx2,fma,avx512f,avx512vl,avx512vnni")))
#else
#define GBX_VNNI512 0
#endif
#if (defined(__clang__) && __clang_major__ >= 17) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11)
#define GBX_AVXVNNI 1
#define GBX_AVXVNNI_FN __attribute__((target("avx2,fma,avxvnni")))
#else
#define GBX_AVXVNNI 0
#endif
#else
#define GBX_X86 0
#define GBX_VNNI512 0
#define GBX_AVXVNNI 0
#endif

#if defined(__aarch64__) && defined(__ARM_NEON)
#define GBX_NEON 1
#include <arm_neon.h>
/*
 * vdotq_s32 kernels.  With GCC they are compiled per function (target
 * "arch=armv8.2-a+dotprod", the target arm_neon.h gives vdotq_s32) and
 * chosen at run time from HWCAP, so the rest of the binary stays baseline:
 * a whole-file -march=armv8.2-a+dotprod lets GCC turn plain int8 loops
 * (scalar tails, the oracle) into sdot, which faults on a Cortex-A72
 * whatever the dispatcher does.  Other compilers get the kernels only when
 * the whole build targets dotprod (e.g. -mcpu=apple-m1).
 */
#if defined(GEARBX_NO_DOTPROD)
#define GBX_DOTPROD 0
#elif defined(__ARM_FEATURE_DOTPROD)
#define GBX_DOTPROD 1
#define GBX_DOTPROD_FN
#elif defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 10
#define GBX_DOTPROD 1
#define GBX_DOTPROD_FN __attribute__((target("arch=armv8.2-a+dotprod")))
#else
#define GBX_DOTPROD 0
#endif
#if defined(__linux__)
#include <sys/auxv.h>
#endif
#else
#define GBX_NEON 0
#define GBX_DOTPROD 0
#endif

#if defined(_WIN32) && !defined(GEARBX_NO_THREADS)
#define GEARBX_NO_THREADS 1
#endif
#ifndef GEARBX_NO_THREADS
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>
#include <unistd.h>
#endif

#define GBX_INLINE static inline __attribute__((always_inline))
#define GBX_MAX_THREADS 64
/* Below this many weights per thread, the hand-off costs more than it saves. */
#define GBX_MIN_WEIGHTS_PER_THREAD (1 << 16)
static int g_min_work = GBX_MIN_WEIGHTS_PER_THREAD;

#ifdef GEARBX_PLANT_NIBBLE_BUG
#define GBX_NIBBLE_ORDER(T, lo, hi) \
    do {                            \
        T t_ = lo;                  \
        lo = hi;                    \
        hi = t_;                    \
    } while (0)
#else
#define GBX_NIBBLE_ORDER(T, lo, hi) ((void)0)
#endif

/* ------------------------------------------------------------------------ */
/* Call context shared (read-only) by the threads of one call               */
/* ------------------------------------------------------------------------ */

typedef struct {
    const uint8_t *w;        /* row i starts at w + i * row_bytes */
    size_t row_bytes;
    const float *s;          /* row i scales at s + i * ng */
    int ng;
    int I;
    int gs;                  /* effective group size (I when per row) */
    int gshift;              /* group of block b = b >> gshift */
    const float *x;          /* natural order fp32 */
    const gbx_span_f32 *xf;  /* int4 float kernels: split order */
    const gbx_act_q8 *a;     /* intdot kernels */
    float *y;
    uint64_t *sums;          /* gbx_read_bandwidth: one checksum per row */
} gbx_ctx;

typedef void (*gbx_rows_fn)(const gbx_ctx *c, int r0, int r1);

/* ------------------------------------------------------------------------ */
/* Scalar tails: the part of a row after the last full SIMD step.  With     */
/* start 0 they are also the kernels of a CPU without SIMD.  Always inlined: */
/* a call from AVX2 code into SSE-encoded code with dirty upper registers   */
/* cost 40% of a small product here (AVX-SSE transition).                   */
/* ------------------------------------------------------------------------ */

GBX_INLINE float tail_float(const gbx_ctx *c, const uint8_t *w, const float *s, int bits, int j0)
{
    float y = 0.0f;
    for (int j = j0; j < c->I;) {
        const int g = j / c->gs;
        const int j1 = (g + 1) * c->gs;
        float acc = 0.0f;
        if (bits == 4) {
            for (; j < j1; j += 2) {
                const uint8_t b = w[j >> 1];
                acc += (float)GBX_INT4_LO(b) * c->x[j];
                acc += (float)GBX_INT4_HI(b) * c->x[j + 1];
            }
        } else {
            for (; j < j1; ++j)
                acc += (float)((const int8_t *)w)[j] * c->x[j];
        }
        y += s[g] * acc;
    }
    return y;
}

GBX_INLINE float tail_intdot(const gbx_ctx *c, const uint8_t *w, const float *s, int bits, int b0)
{
    const gbx_act_q8 *a = c->a;
    float y = 0.0f;
    for (int b = b0; b < a->nblocks; ++b) {
        const int j0 = b * GBX_QK;
        const int j1 = j0 + GBX_QK < c->I ? j0 + GBX_QK : c->I;
        int32_t isum = 0;
        if (bits == 4) {
            for (int j = j0; j < j1; j += 2) {
                const uint8_t q = w[j >> 1];
                isum += GBX_INT4_LO(q) * a->qs[j] + GBX_INT4_HI(q) * a->qs[j + 1];
            }
        } else {
            for (int j = j0; j < j1; ++j)
                isum += ((const int8_t *)w)[j] * a->qs[j];
        }
        y += s[b >> c->gshift] * (a->d[b] * (float)isum);
    }
    return y;
}

static void rows_float_scalar(const gbx_ctx *c, int r0, int r1, int bits)
{
    for (int r = r0; r < r1; ++r)
        c->y[r] = tail_float(c, c->w + (size_t)r * c->row_bytes, c->s + (size_t)r * c->ng, bits, 0);
}
static void q4_float_scalar(const gbx_ctx *c, int r0, int r1) { rows_float_scalar(c, r0, r1, 4); }
static void q8_float_scalar(const gbx_ctx *c, int r0, int r1) { rows_float_scalar(c, r0, r1, 8); }

static void rows_intdot_scalar(const gbx_ctx *c, int r0, int r1, int bits)
{
    for (int r = r0; r < r1; ++r)
        c->y[r] = tail_intdot(c, c->w + (size_t)r * c->row_bytes, c->s + (size_t)r * c->ng, bits, 0);
}
static void q4_intdot_scalar(const gbx_ctx *c, int r0, int r1) { rows_intdot_scalar(c, r0, r1, 4); }
static void q8_intdot_scalar(const gbx_ctx *c, int r0, int r1) { rows_intdot_scalar(c, r0, r1, 8); }

/* ------------------------------------------------------------------------ */
/* x86: AVX2 + FMA                                                          */
/* ------------------------------------------------------------------------ */
#if GBX_X86

/* Software prefetch this far ahead of the weight stream: the hardware
 * prefetchers alone left a single thread at about half the read bandwidth,
 * because the arithmetic between loads keeps few misses in flight. */
#ifndef GBX_PREFETCH_BYTES
#define GBX_PREFETCH_BYTES 2048
#endif
#define GBX_PREFETCH(p) _mm_prefetch((const char *)(p), _MM_HINT_T0)
/* (NEON kernels rely on the hardware prefetchers: not measured there.) */

GBX_AVX2_FN GBX_INLINE float hsum_avx2(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One block of 32 activations -> int8, bit-identical to the scalar oracle:
 * same scalar d and 1/d, one IEEE multiply, clamp, round half to even. */
GBX_AVX2_FN static void quantize_blocks_avx2(const float *x, int nfull, int8_t *qs, float *d, int32_t *sum)
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

GBX_AVX2_FN static void q8_float_avx2(const gbx_ctx *c, int r0, int r1)
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
GBX_AVX2_FN static void q4_float_avx2(const gbx_ctx *c, int r0, int r1)
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

GBX_AVX2_FN static void q4_intdot_avx2(const gbx_ctx *c, int r0, int r1)
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

GBX_AVX2_FN static void q8_intdot_avx2(const gbx_ctx *c, int r0, int r1)
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
    ATTR static void q4_intdot_##SUFFIX(const gbx_ctx *c, int r0, int r1)                                      \
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
    ATTR static void q8_intdot_##SUFFIX(const gbx_ctx *c, int r0, int r1)                                      \
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

#endif /* GBX_X86 */

/* ------------------------------------------------------------------------ */
/* AArch64: NEON (+ vdotq_s32 where the compiler targets dotprod)           */
/* ------------------------------------------------------------------------ */
#if GBX_NEON

static void quantize_blocks_neon(const float *x, int nfull, int8_t *qs, float *d, int32_t *sum)
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

/* int8 x int8 -> int32 lanes without dotprod: |a_k b_k + a_k+8 b_k+8| <=
 * 2*127*127 fits int16.  Its lane split differs from vdotq_s32's; the lane
 * total, an exact integer, does not. */
GBX_INLINE int32x4_t dot16_mull(int32x4_t acc, int8x16_t a, int8x16_t b)
{
    int16x8_t p = vmull_s8(vget_low_s8(a), vget_low_s8(b));
    p = vmlal_high_s8(p, a, b);
    return vpadalq_s16(acc, p);
}

/* 16 signed int8 -> 16 floats multiplied into two accumulators */
GBX_INLINE void fma16_neon(float32x4_t *t0, float32x4_t *t1, int8x16_t q, const float *x)
{
    const int16x8_t l = vmovl_s8(vget_low_s8(q)), h = vmovl_high_s8(q);
    *t0 = vfmaq_f32(*t0, vcvtq_f32_s32(vmovl_s16(vget_low_s16(l))), vld1q_f32(x));
    *t1 = vfmaq_f32(*t1, vcvtq_f32_s32(vmovl_high_s16(l)), vld1q_f32(x + 4));
    *t0 = vfmaq_f32(*t0, vcvtq_f32_s32(vmovl_s16(vget_low_s16(h))), vld1q_f32(x + 8));
    *t1 = vfmaq_f32(*t1, vcvtq_f32_s32(vmovl_high_s16(h)), vld1q_f32(x + 12));
}

/* 16 weight bytes of int4 -> signed low nibbles (elements 2k), high (2k+1) */
GBX_INLINE void q4_split16_neon(const uint8_t *p, int8x16_t *lo, int8x16_t *hi)
{
    const uint8x16_t v = vld1q_u8(p);
    const int8x16_t off = vdupq_n_s8(GBX_INT4_OFFSET);
    int8x16_t l = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(v, vdupq_n_u8(0x0F))), off);
    int8x16_t h = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(v, 4)), off);
    GBX_NIBBLE_ORDER(int8x16_t, l, h);
    *lo = l;
    *hi = h;
}

static void q8_float_neon(const gbx_ctx *c, int r0, int r1)
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

static void q4_float_neon(const gbx_ctx *c, int r0, int r1)
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

static void q4_intdot_neon(const gbx_ctx *c, int r0, int r1) { GBX_Q4_INTDOT_NEON_BODY(dot16_mull) }
static void q8_intdot_neon(const gbx_ctx *c, int r0, int r1) { GBX_Q8_INTDOT_NEON_BODY(dot16_mull) }
#if GBX_DOTPROD
GBX_DOTPROD_FN static void q4_intdot_dotprod(const gbx_ctx *c, int r0, int r1) { GBX_Q4_INTDOT_NEON_BODY(vdotq_s32) }
GBX_DOTPROD_FN static void q8_intdot_dotprod(const gbx_ctx *c, int r0, int r1) { GBX_Q8_INTDOT_NEON_BODY(vdotq_s32) }
#endif

#endif /* GBX_NEON */

/* ------------------------------------------------------------------------ */
/* Read-bandwidth probe: the roofline the GEMV kernels are measured against */
/* ------------------------------------------------------------------------ */

static void read_rows_scalar(const gbx_ctx *c, int r0, int r1)
{
    for (int r = r0; r < r1; ++r) {
        const uint8_t *p = c->w + (size_t)r * c->row_bytes;
        uint64_t s0 = 0, s1 = 0;
        size_t k = 0;
        for (; k + 16 <= c->row_bytes; k += 16) {
            uint64_t a, b;
            memcpy(&a, p + k, 8), memcpy(&b, p + k + 8, 8);
            s0 += a, s1 += b;
        }
        for (; k < c->row_bytes; ++k)
            s0 += p[k];
        c->sums[r] = s0 + s1;
    }
}

#if GBX_X86
GBX_AVX2_FN static void read_rows_avx2(const gbx_ctx *c, int r0, int r1)
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
#endif

/* ------------------------------------------------------------------------ */
/* Run-time CPU features and kernel choice                                  */
/* ------------------------------------------------------------------------ */

static struct {
    int avx2;
    int vnni512; /* AVX512-VNNI with 256-bit (VL) forms */
    int avxvnni;
    int dotprod;
} g_cpu;

static void detect_cpu(void)
{
#if GBX_X86
    __builtin_cpu_init();
    /* libgcc/compiler-rt also check that the OS saves the YMM registers */
    g_cpu.avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#if GBX_VNNI512
    g_cpu.vnni512 = g_cpu.avx2 && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");
#endif
#if GBX_AVXVNNI
    g_cpu.avxvnni = g_cpu.avx2 && __builtin_cpu_supports("avxvnni");
#endif
#endif
#if GBX_DOTPROD
#if defined(__APPLE__)
    g_cpu.dotprod = 1; /* every arm64 Mac (M1 on) has it */
#elif defined(__linux__) && defined(HWCAP_ASIMDDP)
    g_cpu.dotprod = (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
#else
    g_cpu.dotprod = 1; /* built for dotprod and no way to ask: trust the build */
#endif
#endif
}

#ifndef GEARBX_NO_THREADS
static pthread_once_t g_cpu_once = PTHREAD_ONCE_INIT;
static void cpu_init(void) { pthread_once(&g_cpu_once, detect_cpu); }
#else
static int g_cpu_done;
static void cpu_init(void)
{
    if (!g_cpu_done)
        detect_cpu(), g_cpu_done = 1;
}
#endif

typedef struct {
    const char *name;
    gbx_rows_fn q4, q8;
} gbx_kernels;

/* tests and benchmarks reach the lesser kernels on a CPU that has more */
static int g_isa_limit;
int gbx_set_isa_limit(int level)
{
    const int old = g_isa_limit;
    g_isa_limit = level == 1 || level == 2 ? level : 0;
    return old;
}

static gbx_kernels pick_float(void)
{
#if GBX_X86
    if (g_cpu.avx2)
        return (gbx_kernels){"avx2", q4_float_avx2, q8_float_avx2};
#endif
#if GBX_NEON
    return (gbx_kernels){"neon", q4_float_neon, q8_float_neon};
#endif
    return (gbx_kernels){"scalar", q4_float_scalar, q8_float_scalar};
}

static gbx_kernels pick_intdot(void)
{
#if GBX_VNNI512
    if (g_cpu.vnni512 && g_isa_limit == 0)
        return (gbx_kernels){"avx512vnni", q4_intdot_vnni512, q8_intdot_vnni512};
#endif
#if GBX_AVXVNNI
    if (g_cpu.avxvnni && g_isa_limit != 1)
        return (gbx_kernels){"avxvnni", q4_intdot_avxvnni, q8_intdot_avxvnni};
#endif
#if GBX_X86
    if (g_cpu.avx2)
        return (gbx_kernels){"avx2", q4_intdot_avx2, q8_intdot_avx2};
#endif
#if GBX_DOTPROD
    if (g_cpu.dotprod)
        return (gbx_kernels){"neon-dotprod", q4_intdot_dotprod, q8_intdot_dotprod};
#endif
#if GBX_NEON
    return (gbx_kernels){"neon", q4_intdot_neon, q8_intdot_neon};
#endif
    return (gbx_kernels){"scalar", q4_intdot_scalar, q8_intdot_scalar};
}

void gbx_quantize_act(const float *x, int n, int8_t *qs, float *d, int32_t *sum)
{
    cpu_init();
    const int nfull = n / GBX_QK;
    int done = 0;
#if GBX_X86
    if (g_cpu.avx2)
        quantize_blocks_avx2(x, nfull, qs, d, sum), done = nfull;
#endif
#if GBX_NEON
    quantize_blocks_neon(x, nfull, qs, d, sum), done = nfull;
#endif
    /* partial last block (and everything on a scalar CPU): the oracle itself */
    if (done * GBX_QK < n)
        gbx_quantize_act_ref(x + (size_t)done * GBX_QK, n - done * GBX_QK, qs + (size_t)done * GBX_QK, d + done,
                             sum + done);
}

/* ------------------------------------------------------------------------ */
/* Per-call activation buffers (one allocation, 64-byte aligned parts)      */
/* ------------------------------------------------------------------------ */

static size_t align64(size_t n) { return (n + 63) & ~(size_t)63; }

/* int4 float kernels: x in split order, span by span */
static gbx_span_f32 *build_split_f32(const float *x, int n, void **mem)
{
    const int nspans = n / GBX_SPAN;
    *mem = malloc(align64(sizeof(gbx_span_f32) * (size_t)nspans) + 64);
    if (!*mem)
        return NULL;
    gbx_span_f32 *xf = (gbx_span_f32 *)align64((size_t)*mem);
    for (int p = 0; p < nspans; ++p)
        for (int k = 0; k < GBX_SPAN / 2; ++k) {
            xf[p].even[k] = x[(size_t)p * GBX_SPAN + 2 * k];
            xf[p].odd[k] = x[(size_t)p * GBX_SPAN + 2 * k + 1];
        }
    return xf;
}

static int build_act(const float *x, int n, int bits, gbx_act_q8 *a, void **mem)
{
    a->n = n;
    a->nblocks = (n + GBX_QK - 1) / GBX_QK;
    a->nspans = bits == 4 ? n / GBX_SPAN : 0;
    const size_t nb = (size_t)a->nblocks, ns = (size_t)a->nspans;
    const size_t o_qs = 0, o_d = align64(o_qs + (size_t)n), o_sum = align64(o_d + 4 * nb),
                 o_split = align64(o_sum + 4 * nb), o_sd = align64(o_split + sizeof(gbx_span_q8) * ns),
                 o_nb = align64(o_sd + 32 * ns), o_corr = align64(o_nb + 32 * ns), total = align64(o_corr + 32 * ns);
    *mem = malloc(total + 64);
    if (!*mem)
        return GBX_E_NOMEM;
    char *base = (char *)align64((size_t)*mem);
    a->qs = (int8_t *)(base + o_qs);
    a->d = (float *)(base + o_d);
    a->sum = (int32_t *)(base + o_sum);
    a->split = (gbx_span_q8 *)(base + o_split);
    a->span_d = (float *)(base + o_sd);
    a->span_nbias = (int32_t *)(base + o_nb);
    a->span_corr = (float *)(base + o_corr);
    gbx_quantize_act(x, n, a->qs, a->d, a->sum);
    float total_corr = 0.0f;
    for (size_t p = 0; p < ns; ++p) {
        const int8_t *q = a->qs + p * GBX_SPAN;
        gbx_span_q8 *sp = a->split + p;
        for (int k = 0; k < GBX_SPAN / 2; ++k) {
            sp->even[k] = q[2 * k];
            sp->odd[k] = q[2 * k + 1];
        }
        for (int l = 0; l < 8; ++l) {
            int32_t t = 0;
            for (int k = 4 * l; k < 4 * l + 4; ++k)
                t += sp->even[k] + sp->odd[k];
            const float dl = a->d[2 * p + (l >> 2)];
            a->span_d[8 * p + l] = dl;
            a->span_nbias[8 * p + l] = -GBX_INT4_OFFSET * t;
            a->span_corr[8 * p + l] = dl * (float)(GBX_INT4_OFFSET * t);
            total_corr += a->span_corr[8 * p + l];
        }
    }
    a->corr_total = total_corr;
    return GBX_OK;
}

/* ------------------------------------------------------------------------ */
/* Worker pool.  Rows are cut into chunks that the caller and the workers   */
/* claim one at a time, so a worker the OS has not scheduled yet delays     */
/* nobody: the caller takes its chunks (a static split made every product   */
/* wait for the slowest thread, a whole time slice on a busy 2-CPU VM).     */
/* Workers spin a little (decode calls come back-to-back), then sleep.      */
/* ------------------------------------------------------------------------ */

static int g_threads; /* 0 until set: online CPUs */

static int online_cpus(void)
{
#ifndef GEARBX_NO_THREADS
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    if (n < 1)
        n = 1;
    return n > GBX_MAX_THREADS ? GBX_MAX_THREADS : (int)n;
#else
    return 1;
#endif
}

int gbx_set_threads(int n)
{
    if (n <= 0)
        n = online_cpus();
    if (n > GBX_MAX_THREADS)
        n = GBX_MAX_THREADS;
#ifdef GEARBX_NO_THREADS
    n = 1;
#endif
    g_threads = n;
    return n;
}

int gbx_set_min_work(int weights_per_thread)
{
    const int old = g_min_work;
    g_min_work = weights_per_thread > 0 ? weights_per_thread : GBX_MIN_WEIGHTS_PER_THREAD;
    return old;
}

int gbx_get_threads(void)
{
    if (g_threads <= 0)
        gbx_set_threads(0);
    return g_threads;
}

#ifndef GEARBX_NO_THREADS

#define GBX_SPIN_NS 200000L /* 0.2 ms */

static struct {
    pthread_mutex_t owner; /* one call uses the pool at a time */
    pthread_mutex_t mtx;   /* with cv: sleeping workers */
    pthread_cond_t cv;
    int nworkers;
    unsigned gen;          /* owner only: generation of the last job */
    /* (generation << 32) | next unclaimed chunk.  A claim is a CAS on both,
     * so a late worker can never take a chunk of a job it did not read.
     * Before the next job's fields are written the chunk part is set to
     * GBX_CLOSED (see run_rows), so no claim of the old job can succeed
     * against the new job's nchunks. */
    _Atomic uint64_t state;
    atomic_int done;       /* chunks finished in the current job */
    atomic_int parts;      /* threads the current job wants (workers id < parts join) */
    atomic_int sleepers;
    /* the job: written by the owner before the generation is published, and
     * stable while any chunk is unfinished */
    gbx_rows_fn fn;
    const gbx_ctx *ctx;
    int rows, chunk_rows;
    atomic_int nchunks; /* also read before a claim, to stop early */
    /* generation a worker starts from, set before it is created */
    unsigned start_gen[GBX_MAX_THREADS];
} g_pool = {.owner = PTHREAD_MUTEX_INITIALIZER, .mtx = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static void cpu_relax(void)
{
#if GBX_X86
    _mm_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long)ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static unsigned state_gen(uint64_t st) { return (unsigned)(st >> 32); }

/* chunk index of a finished job: not below any nchunks */
#define GBX_CLOSED 0x7FFFFFFFu

/* -DGEARBX_STRESS_POOL (test builds only: csrc/test_main.c --pool-stress)
 * sleeps inside the windows where a late worker meets the next job, so that a
 * hand-off race shows up in seconds instead of once in a loaded CI run. */
#ifdef GEARBX_STRESS_POOL
static _Thread_local int g_stress_worker; /* set by worker_main */
#define GBX_STRESS_PAUSE(cond, us) ((cond) ? (void)usleep(us) : (void)0)
#else
#define GBX_STRESS_PAUSE(cond, us) ((void)0)
#endif

/* Claim and run chunks of job `gen` until none is left. */
static void run_chunks(unsigned gen)
{
    for (;;) {
        uint64_t st = atomic_load_explicit(&g_pool.state, memory_order_acquire);
        /* test builds: a thread about to find the job drained stalls here */
        GBX_STRESS_PAUSE(g_stress_worker && (int)(uint32_t)st >= atomic_load(&g_pool.nchunks), 100);
        if (state_gen(st) != gen || (int)(uint32_t)st >= atomic_load_explicit(&g_pool.nchunks, memory_order_acquire))
            return;
        if (!atomic_compare_exchange_weak_explicit(&g_pool.state, &st, st + 1, memory_order_acq_rel,
                                                   memory_order_acquire))
            continue;
        /* chunk k of job gen is ours and unfinished: the job fields are stable */
        const int k = (int)(uint32_t)st;
        GBX_STRESS_PAUSE(1, 20); /* test builds: a thread holding a chunk is descheduled */
        const int r0 = k * g_pool.chunk_rows;
        const int r1 = r0 + g_pool.chunk_rows < g_pool.rows ? r0 + g_pool.chunk_rows : g_pool.rows;
        g_pool.fn(g_pool.ctx, r0, r1);
        atomic_fetch_add_explicit(&g_pool.done, 1, memory_order_release);
    }
}

static void *worker_main(void *arg)
{
    const int id = (int)(size_t)arg;
#ifdef GEARBX_STRESS_POOL
    g_stress_worker = 1;
#endif
    unsigned seen = g_pool.start_gen[id];
    for (;;) {
        unsigned g = state_gen(atomic_load_explicit(&g_pool.state, memory_order_acquire));
        if (g == seen) {
            const long t0 = now_ns();
            for (int i = 1; (g = state_gen(atomic_load_explicit(&g_pool.state, memory_order_acquire))) == seen; ++i) {
                cpu_relax();
                if ((i & 255) == 0 && now_ns() - t0 > GBX_SPIN_NS)
                    break;
            }
            if (g == seen) {
                pthread_mutex_lock(&g_pool.mtx);
                atomic_fetch_add(&g_pool.sleepers, 1);
                while ((g = state_gen(atomic_load(&g_pool.state))) == seen)
                    pthread_cond_wait(&g_pool.cv, &g_pool.mtx);
                atomic_fetch_sub(&g_pool.sleepers, 1);
                pthread_mutex_unlock(&g_pool.mtx);
            }
        }
        seen = g;
        if (id < atomic_load_explicit(&g_pool.parts, memory_order_relaxed))
            run_chunks(g);
    }
    return NULL;
}

/* after fork() only the calling thread exists: forget the workers */
static void pool_atfork_child(void)
{
    pthread_mutex_init(&g_pool.owner, NULL);
    pthread_mutex_init(&g_pool.mtx, NULL);
    pthread_cond_init(&g_pool.cv, NULL);
    g_pool.nworkers = 0;
    atomic_store(&g_pool.sleepers, 0);
}
static pthread_once_t g_atfork_once = PTHREAD_ONCE_INIT;
static void register_atfork(void) { pthread_atfork(NULL, NULL, pool_atfork_child); }

/* Called with g_pool.owner held. */
static int pool_grow(int nworkers)
{
    pthread_once(&g_atfork_once, register_atfork);
    while (g_pool.nworkers < nworkers) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        g_pool.start_gen[g_pool.nworkers + 1] = g_pool.gen;
        const int rc = pthread_create(&t, &attr, worker_main, (void *)(size_t)(g_pool.nworkers + 1));
        pthread_attr_destroy(&attr);
        if (rc != 0)
            return GBX_E_THREADS;
        g_pool.nworkers++;
    }
    return GBX_OK;
}

/* Fewest weights per chunk: a claim costs one CAS (tens of ns). */
#define GBX_CHUNK_WEIGHTS (1 << 15)

static int run_rows(gbx_rows_fn fn, const gbx_ctx *c, int rows, int parts, size_t row_weights)
{
    /* A second caller (another Python thread) computes on its own thread
     * instead of waiting for the pool. */
    if (parts <= 1 || pthread_mutex_trylock(&g_pool.owner) != 0) {
        fn(c, 0, rows);
        return GBX_OK;
    }
    pool_grow(parts - 1); /* on failure: run with the workers there are */
    if (parts > g_pool.nworkers + 1)
        parts = g_pool.nworkers + 1;
    if (parts <= 1) {
        pthread_mutex_unlock(&g_pool.owner);
        fn(c, 0, rows);
        return GBX_OK;
    }
    int chunk = (int)(GBX_CHUNK_WEIGHTS / (row_weights ? row_weights : 1));
    const int fair = (rows + 4 * parts - 1) / (4 * parts); /* at least ~4 chunks per thread */
    if (chunk > fair)
        chunk = fair;
    if (chunk < 1)
        chunk = 1;
    /* Close the previous job before its fields change.  Its state is still
     * (gen, nchunks_old), and a late worker (woken for it, descheduled, back
     * after it finished) may have read that state and be about to read
     * nchunks: seeing the new, larger count, its CAS on the unchanged state
     * would succeed and it would run a chunk of *this* job and add to `done`
     * (bumped after the reset below), so this call could return while a real
     * chunk is still running on a worker: results missing, and the worker
     * reading x/w/y/act after the caller freed them (segfault).  After this
     * store every CAS of the old job fails, and a worker that sees the new
     * nchunks (acquire) also sees this store. */
    atomic_store(&g_pool.state, ((uint64_t)g_pool.gen << 32) | GBX_CLOSED);
    g_pool.fn = fn;
    g_pool.ctx = c;
    g_pool.rows = rows;
    g_pool.chunk_rows = chunk;
    const int nchunks = (rows + chunk - 1) / chunk;
    atomic_store_explicit(&g_pool.nchunks, nchunks, memory_order_release);
    atomic_store(&g_pool.parts, parts);
    atomic_store(&g_pool.done, 0);
    GBX_STRESS_PAUSE(1, 200); /* test builds: job written, not yet published */
    const unsigned gen = ++g_pool.gen;
    atomic_store(&g_pool.state, (uint64_t)gen << 32); /* seq_cst: pairs with the sleepers check */
    if (atomic_load(&g_pool.sleepers) > 0) {
        pthread_mutex_lock(&g_pool.mtx);
        pthread_cond_broadcast(&g_pool.cv);
        pthread_mutex_unlock(&g_pool.mtx);
    }
    run_chunks(gen);
    /* only chunks already claimed by a running worker are left */
    for (int i = 1; atomic_load_explicit(&g_pool.done, memory_order_acquire) < nchunks; ++i) {
        cpu_relax();
        if ((i & 1023) == 0)
            sched_yield();
    }
    pthread_mutex_unlock(&g_pool.owner);
    return GBX_OK;
}

#else /* GEARBX_NO_THREADS */

static int run_rows(gbx_rows_fn fn, const gbx_ctx *c, int rows, int parts, size_t row_weights)
{
    (void)parts, (void)row_weights;
    fn(c, 0, rows);
    return GBX_OK;
}

#endif

/* ------------------------------------------------------------------------ */
/* Public entry points                                                      */
/* ------------------------------------------------------------------------ */

int gbx_check_args(int out_features, int in_features, int bits, int group_size, int path)
{
    if (bits != 4 && bits != 8)
        return GBX_E_BITS;
    if (in_features < 1 || out_features < 0 || (bits == 4 && (in_features & 1)))
        return GBX_E_SHAPE;
    if (group_size != 0 && group_size != 32 && group_size != 64 && group_size != 128)
        return GBX_E_GROUP;
    if (group_size != 0 && in_features % group_size != 0)
        return GBX_E_GROUP;
    if (path < GBX_PATH_AUTO || path > GBX_PATH_INTDOT_REF)
        return GBX_E_PATH;
    return GBX_OK;
}

static int log2_int(int v)
{
    int k = 0;
    while ((1 << k) < v)
        ++k;
    return k;
}

int gbx_gemv(const void *w, const float *scales, const float *x, float *y, int out_features, int in_features,
             int bits, int group_size, int path, int nthreads)
{
    int rc = gbx_check_args(out_features, in_features, bits, group_size, path);
    if (rc != GBX_OK)
        return rc;
    if (out_features == 0)
        return GBX_OK;
    if (!w || !scales || !x || !y)
        return GBX_E_NULL;
    cpu_init();
    if (path == GBX_PATH_REF) {
        gbx_gemv_float_ref(w, scales, x, y, out_features, in_features, bits, group_size);
        return GBX_OK;
    }
    if (path == GBX_PATH_INTDOT_REF)
        return gbx_gemv_intdot_ref(w, scales, x, y, out_features, in_features, bits, group_size);

    gbx_ctx c;
    memset(&c, 0, sizeof c);
    c.w = (const uint8_t *)w;
    c.row_bytes = bits == 4 ? (size_t)in_features / 2 : (size_t)in_features;
    c.s = scales;
    c.ng = group_size ? in_features / group_size : 1;
    c.I = in_features;
    c.gs = group_size ? group_size : in_features;
    c.gshift = group_size ? log2_int(group_size / GBX_QK) : 30; /* per row: every block in group 0 */
    c.x = x;
    c.y = y;

    void *mem = NULL;
    gbx_act_q8 act;
    gbx_rows_fn fn;
    if (path == GBX_PATH_FLOAT) {
        const gbx_kernels k = pick_float();
        fn = bits == 4 ? k.q4 : k.q8;
        if (bits == 4) {
            c.xf = build_split_f32(x, in_features, &mem);
            if (!c.xf)
                return GBX_E_NOMEM;
        }
    } else { /* AUTO, INTDOT */
        const gbx_kernels k = pick_intdot();
        fn = bits == 4 ? k.q4 : k.q8;
        rc = build_act(x, in_features, bits, &act, &mem);
        if (rc != GBX_OK)
            return rc;
        c.a = &act;
    }

    int parts = nthreads > 0 ? nthreads : gbx_get_threads();
    const long long work = (long long)out_features * in_features / g_min_work;
    if (parts > GBX_MAX_THREADS)
        parts = GBX_MAX_THREADS;
    if (parts > work)
        parts = work < 1 ? 1 : (int)work;
    if (parts > out_features)
        parts = out_features;
    rc = run_rows(fn, &c, out_features, parts, (size_t)in_features);
    free(mem);
    return rc;
}

uint64_t gbx_read_bandwidth(const void *buf, size_t bytes, int nthreads)
{
    /* rows of 64 KiB so the pool splits the buffer like a weight matrix */
    const size_t row = 65536;
    const int rows = (int)(bytes / row);
    if (!buf || rows < 1)
        return 0;
    cpu_init();
    uint64_t *sums = calloc((size_t)rows, sizeof(uint64_t));
    if (!sums)
        return 0;
    gbx_ctx c;
    memset(&c, 0, sizeof c);
    c.w = (const uint8_t *)buf;
    c.row_bytes = row;
    c.sums = sums;
    gbx_rows_fn fn = read_rows_scalar;
#if GBX_X86
    if (g_cpu.avx2)
        fn = read_rows_avx2;
#endif
    int parts = nthreads > 0 ? nthreads : gbx_get_threads();
    if (parts > rows)
        parts = rows;
    run_rows(fn, &c, rows, parts, row);
    uint64_t s = 0;
    for (int r = 0; r < rows; ++r)
        s += sums[r];
    free(sums);
    return s;
}

void gbx_get_info(gbx_info_t *info)
{
    cpu_init();
    memset(info, 0, sizeof *info);
    info->abi_version = GBX_ABI_VERSION;
    info->compiled_avx2 = GBX_X86;
    info->compiled_neon = GBX_NEON;
    info->compiled_dotprod = GBX_DOTPROD;
    info->cpu_avx2 = g_cpu.avx2;
    info->cpu_vnni = g_cpu.vnni512 || g_cpu.avxvnni;
    info->cpu_dotprod = g_cpu.dotprod;
    info->threads = gbx_get_threads();
    info->max_threads = GBX_MAX_THREADS;
    info->float_isa = pick_float().name;
    info->intdot_isa = pick_intdot().name;
}

const char *gbx_strerror(int code)
{
    switch (code) {
    case GBX_OK: return "ok";
    case GBX_E_BITS: return "bits must be 4 or 8";
    case GBX_E_GROUP: return "group_size must be None/0, 32, 64 or 128 and divide in_features";
    case GBX_E_SHAPE: return "bad shape: in_features >= 1 (even for int4), out_features >= 0";
    case GBX_E_PATH: return "unknown kernel path";
    case GBX_E_NOMEM: return "out of memory for the activation buffers";
    case GBX_E_NULL: return "a buffer pointer is NULL";
    case GBX_E_THREADS: return "could not start a worker thread";
    default: return "unknown gearbx error";
    }
}
