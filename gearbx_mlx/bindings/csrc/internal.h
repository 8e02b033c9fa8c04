/*
 * internal.h -- what the C kernel sources share and the API does not show:
 * which instruction sets this build can carry, the call context handed to
 * row kernels, the scalar tails, and the kernels each arch/ file defines.
 *
 * Build-time switches:
 *   GEARBX_PLANT_NIBBLE_BUG  swap low/high nibbles in every fast 4-bit kernel
 *                            (tests must catch it; never set in a release)
 *   GEARBX_PLANT_SIX_BUG     read the codes of each 3-byte triplet in reverse
 *                            order in every fast 6-bit kernel (likewise)
 *   GEARBX_NO_THREADS        no pthreads: every call runs on the caller
 *   GEARBX_NO_DOTPROD        leave the AArch64 vdotq_s32 kernels out
 *   GEARBX_FORCE_SCALAR      report no x86 SIMD, so the scalar kernels run
 *                            (tests of the fallback of CPUs without AVX2)
 *   GBX_PREFETCH_BYTES       x86 software-prefetch distance (default 2048)
 */
#ifndef GEARBX_CPU_INTERNAL_H
#define GEARBX_CPU_INTERNAL_H

#include <stdlib.h>
#include <string.h>

#include "gearbx_cpu.h"

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

#define GBX_INLINE static inline __attribute__((always_inline))
#define GBX_MAX_THREADS 64

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
/* Bit offset of code k (0..3) inside its 3-byte triplet of a 6-bit plane. */
#ifdef GEARBX_PLANT_SIX_BUG
#define GBX_SIX_SHIFT(k) (18 - 6 * (k))
#else
#define GBX_SIX_SHIFT(k) (6 * (k))
#endif

/* Symbols shared between the library's files, kept out of its exports. */
#if defined(__GNUC__) || defined(__clang__)
#define GBX_HIDDEN __attribute__((visibility("hidden")))
#else
#define GBX_HIDDEN
#endif

/*
 * int4 kernels split nibbles without re-interleaving them: the low nibbles of
 * the 32 weight bytes of a span are elements 0,2,..,62 and the high nibbles
 * 1,3,..,63.  So the activations of each full span are stored once per call
 * in that "split order"; a SIMD lane of low nibbles then meets its x directly.
 * Elements after the last full span (I % 64 of them) stay in natural order
 * and are handled by the scalar tail.
 */
typedef struct {
    int8_t even[GBX_SPAN / 2]; /* xq[64p + 0], xq[64p + 2], ..., xq[64p + 62] */
    int8_t odd[GBX_SPAN / 2];  /* xq[64p + 1], xq[64p + 3], ..., xq[64p + 63] */
} gbx_span_q8;

typedef struct {
    float even[GBX_SPAN / 2];
    float odd[GBX_SPAN / 2];
} gbx_span_f32;

GBX_STATIC_ASSERT(sizeof(gbx_span_q8) == GBX_SPAN, "span of int8 activations is 64 bytes");
GBX_STATIC_ASSERT(sizeof(gbx_span_f32) == 4 * GBX_SPAN, "span of fp32 activations is 256 bytes");
GBX_STATIC_ASSERT(sizeof(float) == 4, "scales and activations are IEEE binary32");

/*
 * Activations of one intdot call, built once by the calling thread and read by
 * every worker.  Arrays are owned by the call (one allocation).
 */
typedef struct {
    int n;               /* in_features */
    int nblocks;         /* ceil(n / GBX_QK); the last block may be partial */
    int nspans;          /* n / GBX_SPAN full spans */
    int8_t *qs;          /* [n]        natural order, |q| <= 127 */
    float *d;            /* [nblocks]  x ~= d[b] * qs */
    int32_t *sum;        /* [nblocks]  sum of qs in the block */
    gbx_span_q8 *split;  /* [nspans]   int4 kernels only: split order */
    /* x86 kernels multiply the stored nibbles u = q + 8 (unsigned, as
     * vpmaddubsw / vpdpbusd want) and remove sum(8 * xq) afterwards; these
     * hold that offset per int32 lane (lane l of a span covers bytes 4l..4l+3
     * of both halves: lanes 0-3 block 2p, lanes 4-7 block 2p+1). */
    float *span_d;        /* [nspans*8] d of the lane's block */
    int32_t *span_nbias;  /* [nspans*8] -8 * (lane's sum of xq): VNNI accumulator start */
    float *span_corr;     /* [nspans*8] 8 * d * (lane's sum of xq): AVX2 correction */
    float corr_total;     /* sum of span_corr over all lanes (per-row scales) */
} gbx_act_q8;


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
    const struct gbx_nested_ctx *nest; /* gbx_nested_gemv */
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


/* ------------------------------------------------------------------------ */
/* Nested planes (nested.c, arch/x86/nested.c, arch/arm/nested.c)         */
/* ------------------------------------------------------------------------ */

/* A half-precision scale or bias as float: exact for every value, subnormals,
 * infinities and NaN included. */
GBX_INLINE float gbx_f16_to_f32(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    uint32_t u;
    if (exp == 0) {
        const float v = (float)man * 5.9604644775390625e-8f; /* man * 2^-24 */
        memcpy(&u, &v, 4);
        u |= sign;
    } else if (exp == 31) {
        u = sign | 0x7F800000u | (man << 13);
    } else {
        u = sign | ((exp + 112u) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

GBX_INLINE float gbx_bf16_to_f32(uint16_t h)
{
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Element i of a scale or bias row of `dtype` (GBX_DTYPE_*). */
GBX_INLINE float gbx_scale_at(const void *p, size_t i, int dtype)
{
    if (dtype == GBX_DTYPE_F32)
        return ((const float *)p)[i];
    const uint16_t h = ((const uint16_t *)p)[i];
    return dtype == GBX_DTYPE_F16 ? gbx_f16_to_f32(h) : gbx_bf16_to_f32(h);
}

/* Code j of a row of codes at `bits` (4, 6 or 8): byte j/2's low nibble for
 * even j at 4 bits; bits 6j .. 6j+5 of the row at 6 bits (MLX packs least
 * significant first, words little-endian).  Never reads past code j's bytes. */
GBX_INLINE int gbx_code_at(const uint8_t *row, int bits, int j)
{
    if (bits == 8)
        return row[j];
    if (bits == 6) {
        const size_t bit = (size_t)j * 6;
        const unsigned sh = (unsigned)(bit & 7);
        unsigned v = (unsigned)row[bit >> 3] >> sh;
        if (sh > 2)
            v |= (unsigned)row[(bit >> 3) + 1] << (8 - sh);
        return (int)(v & 63u);
    }
    const uint8_t b = row[j >> 1];
    return (j & 1) ? b >> 4 : b & 0x0F;
}

typedef struct gbx_nested_ctx gbx_nested_ctx;
typedef struct gbx_plane_rt gbx_plane_rt;

/* The contribution of one plane to output row r for activation row k,
 * before its factor: sum_g s_g * (codes . x)_g + b_g * xsum_g. */
typedef float (*gbx_plane_fn)(const gbx_nested_ctx *c, const gbx_plane_rt *p, int r, int k);

/* Rows r0..r1 (of every activation row) of a gear of one 4-bit plane (the low
 * gear) or two of one scale dtype (the mid gear), the planes in one pass over
 * each row: each plane's spans as fn[0][dtype] computes them, its bias term
 * summed into its lanes before one horizontal sum (so equal to the per-plane
 * kernels' sum up to float32 rounding: exact on the C driver's integer data). */
typedef void (*gbx_rows4_fn)(const gbx_nested_ctx *c, int r0, int r1);

/* One plane as the kernels read it. */
struct gbx_plane_rt {
    const uint8_t *codes; /* row r at codes + r * row_bytes */
    size_t row_bytes;
    const void *scales, *biases; /* row r at element r * ng */
    int bits, dtype;
    int ng;               /* groups per row */
    int gshift;           /* group of block b = b >> gshift */
    float factor;
    /* [m][ng] sum of x over each of this plane's groups: of the float x on the
     * float path, of the int8 activations (sum_b d_b * sum_b) on the intdot
     * path, so there the codes and the bias term see the same x (with the
     * float sums, the unsigned codes' offset would carry the activation
     * error: 3x larger).  Planes of one group size share the array. */
    const float *xsum;
    gbx_plane_fn fn;      /* the kernel chosen for this plane */
};

/* Everything one nested call shares (read-only) between its threads; per
 * activation row k the arrays below start at k * their row length. */
struct gbx_nested_ctx {
    gbx_plane_rt p[GBX_MAX_PLANES];
    int n;                   /* planes read */
    int m;                   /* activation rows */
    int O, I;
    int nspans;              /* I / GBX_SPAN: 4-bit kernels' full spans */
    const float *x;          /* [m][I] natural order */
    const gbx_span_f32 *xf;  /* [m][nspans] float path: split order */
    const gbx_act_q8 *a;     /* [m] intdot path */
    float *y;                /* [m][O] */
    gbx_rows4_fn rows4;       /* the gear's rows kernel (one or two 4-bit planes, intdot), or NULL */
};

/* nested.c, for both of its callers (the GEMV and unpack.c's unpacking):
 * 1 if every plane has its codes, scales and biases; the context's planes
 * (all but gshift and fn), n, O and I filled, the rest zero; fn(rows) over
 * the thread pool with the context, row_weights the weights a row reads. */
GBX_HIDDEN int gbx_planes_present(const gbx_plane *planes, int n);
GBX_HIDDEN void gbx_nested_setup(gbx_nested_ctx *c, const gbx_plane *planes, int n, int out_features,
                                 int in_features);
GBX_HIDDEN int gbx_nested_run(gbx_rows_fn fn, const gbx_nested_ctx *c, int rows, size_t row_weights, int nthreads,
                              long spin_ns);

/* Scalar parts of a plane's row, blocks [b0, b1) of GBX_QK codes, without the
 * bias term: the kernels of a CPU without SIMD and the tails of the others. */
GBX_INLINE float gbx_nested_tail_float(const gbx_nested_ctx *c, const gbx_plane_rt *p, int r, int k, int b0, int b1)
{
    const uint8_t *row = p->codes + (size_t)r * p->row_bytes;
    const float *x = c->x + (size_t)k * c->I;
    float y = 0.0f;
    for (int b = b0; b < b1; ++b) {
        float acc = 0.0f;
        for (int j = b * GBX_QK; j < (b + 1) * GBX_QK; ++j)
            acc += (float)gbx_code_at(row, p->bits, j) * x[j];
        y += gbx_scale_at(p->scales, (size_t)r * p->ng + (size_t)(b >> p->gshift), p->dtype) * acc;
    }
    return y;
}

GBX_INLINE float gbx_nested_tail_intdot(const gbx_nested_ctx *c, const gbx_plane_rt *p, int r, int k, int b0, int b1)
{
    const uint8_t *row = p->codes + (size_t)r * p->row_bytes;
    const gbx_act_q8 *a = c->a + k;
    float y = 0.0f;
    for (int b = b0; b < b1; ++b) {
        int32_t isum = 0;
        for (int j = b * GBX_QK; j < (b + 1) * GBX_QK; ++j)
            isum += gbx_code_at(row, p->bits, j) * a->qs[j];
        y += gbx_scale_at(p->scales, (size_t)r * p->ng + (size_t)(b >> p->gshift), p->dtype) * (a->d[b] * (float)isum);
    }
    return y;
}

/* sum_g v_g * w_g over a row of ng scales or biases (v) against floats (w). */
GBX_INLINE float gbx_group_dot_scalar(const void *v, size_t off, int dtype, const float *w, int ng)
{
    float y = 0.0f;
    for (int g = 0; g < ng; ++g)
        y += gbx_scale_at(v, off + (size_t)g, dtype) * w[g];
    return y;
}

/* xs[g] = sum of x over group g, natural order (ref.c; the float paths), and
 * the same of the int8 activations, sum_{b in g} d_b * sum_b (the intdot paths). */
GBX_HIDDEN void gbx_nested_group_sums(const float *x, int in_features, int gs, float *xs);
GBX_HIDDEN void gbx_nested_group_sums_q8(const float *d, const int32_t *sum, int in_features, int gs, float *xs);

/* Build the activation buffers of an intdot call (dispatch.c). */
GBX_HIDDEN int gbx_build_act(const float *x, int n, int bits, gbx_act_q8 *a, void **mem);
GBX_HIDDEN gbx_span_f32 *gbx_build_split_f32(const float *x, int n, void **mem);

/* Names of the nested families this CPU gets (nested.c, for gbx_get_info). */
GBX_HIDDEN void gbx_nested_isa_names(const char **float_isa, const char **intdot_isa);

/* A family of nested kernels: one function per (bits, dtype) of a plane.
 * [GBX_BITS_SLOT(bits)][dtype]: 4-bit, 8-bit, 6-bit; NULL where none (the
 * scalar kernel of the path then reads that plane). */
#define GBX_BITS_SLOT(bits) ((bits) == 4 ? 0 : (bits) == 8 ? 1 : 2)
typedef struct {
    const char *name;
    gbx_plane_fn fn[3][3];
    gbx_rows4_fn pair4[3]; /* [dtype]; NULL where the family has none */
    gbx_rows4_fn one4[3];  /* [dtype]: the same for a gear of one 4-bit plane */
} gbx_nested_kernels;

/* ------------------------------------------------------------------------ */
/* CPU features (dispatch.c) and the thread pool (pool.c)                   */
/* ------------------------------------------------------------------------ */

typedef struct {
    int avx2;
    int vnni512; /* AVX512-VNNI with 256-bit (VL) forms */
    int avx512f; /* 512-bit float forms (the dense unpacking), where the compiler has GBX_VNNI512 */
    int avxvnni;
    int dotprod;
    int f16c;    /* x86 half-precision conversions (the nested kernels' scales) */
} gbx_cpu_features;

/* Filled once by gbx_cpu_init(); read-only afterwards. */
GBX_HIDDEN extern gbx_cpu_features gbx_cpu;
GBX_HIDDEN void gbx_cpu_init(void);
/* 0 the best x86 kernels; 1 plain AVX2; 2 no AVX512-VNNI (gbx_set_isa_limit). The dense
 * unpacking takes AVX-512 at 0 only. */
GBX_HIDDEN extern int gbx_isa_limit;

/* Threads for a product of `weights` weights over `rows` rows: nthreads (<= 0:
 * the default), fewer where each would get less than the minimum work. */
GBX_HIDDEN int gbx_pool_parts(int nthreads, long long weights, int rows);
/* fn(c, r0, r1) over rows [0, rows) on `parts` threads (the caller among
 * them); returns when every row is done. */
GBX_HIDDEN int gbx_run_rows(gbx_rows_fn fn, const gbx_ctx *c, int rows, int parts, size_t row_weights);
/* The same, the workers sleeping spin_ns after the job rather than after
 * GBX_POOL_SPIN_NS, which decode calls want (they come back-to-back); 0: at
 * once, for a job that the caller follows with other work (the prefill's
 * unpacking, followed by a BLAS product whose threads want every CPU). */
#define GBX_POOL_SPIN_NS 200000L /* 0.2 ms */
GBX_HIDDEN int gbx_run_rows_spin(gbx_rows_fn fn, const gbx_ctx *c, int rows, int parts, size_t row_weights,
                                 long spin_ns);

/* ------------------------------------------------------------------------ */
/* Kernels of arch/x86 and arch/arm (chosen in dispatch.c)                  */
/* ------------------------------------------------------------------------ */

#if GBX_X86
GBX_HIDDEN void gbx_quantize_blocks_avx2(const float *x, int nfull, int8_t *qs, float *d, int32_t *sum);
GBX_HIDDEN void gbx_q4_float_avx2(const gbx_ctx *c, int r0, int r1);
GBX_HIDDEN void gbx_q8_float_avx2(const gbx_ctx *c, int r0, int r1);
GBX_HIDDEN void gbx_q4_intdot_avx2(const gbx_ctx *c, int r0, int r1);
GBX_HIDDEN void gbx_q8_intdot_avx2(const gbx_ctx *c, int r0, int r1);
#if GBX_VNNI512
GBX_HIDDEN void gbx_q4_intdot_vnni512(const gbx_ctx *c, int r0, int r1);
GBX_HIDDEN void gbx_q8_intdot_vnni512(const gbx_ctx *c, int r0, int r1);
#endif
#if GBX_AVXVNNI
GBX_HIDDEN void gbx_q4_intdot_avxvnni(const gbx_ctx *c, int r0, int r1);
GBX_HIDDEN void gbx_q8_intdot_avxvnni(const gbx_ctx *c, int r0, int r1);
#endif
GBX_HIDDEN void gbx_read_rows_avx2(const gbx_ctx *c, int r0, int r1);
/* nested: AVX2+FMA+F16C float and intdot, and the VNNI intdot where compiled */
GBX_HIDDEN extern const gbx_nested_kernels gbx_nested_float_avx2, gbx_nested_intdot_avx2;
#if GBX_VNNI512
GBX_HIDDEN extern const gbx_nested_kernels gbx_nested_intdot_vnni512;
#endif
#if GBX_AVXVNNI
GBX_HIDDEN extern const gbx_nested_kernels gbx_nested_intdot_avxvnni;
#endif
#endif

#if GBX_NEON
GBX_HIDDEN void gbx_quantize_blocks_neon(const float *x, int nfull, int8_t *qs, float *d, int32_t *sum);
GBX_HIDDEN void gbx_q4_float_neon(const gbx_ctx *c, int r0, int r1);
GBX_HIDDEN void gbx_q8_float_neon(const gbx_ctx *c, int r0, int r1);
GBX_HIDDEN void gbx_q4_intdot_neon(const gbx_ctx *c, int r0, int r1);
GBX_HIDDEN void gbx_q8_intdot_neon(const gbx_ctx *c, int r0, int r1);
#if GBX_DOTPROD
GBX_HIDDEN void gbx_q4_intdot_dotprod(const gbx_ctx *c, int r0, int r1);
GBX_HIDDEN void gbx_q8_intdot_dotprod(const gbx_ctx *c, int r0, int r1);
#endif
GBX_HIDDEN extern const gbx_nested_kernels gbx_nested_float_neon, gbx_nested_intdot_neon;
#if GBX_DOTPROD
GBX_HIDDEN extern const gbx_nested_kernels gbx_nested_intdot_dotprod;
#endif
#endif

#endif /* GEARBX_CPU_INTERNAL_H */
