/*
 * gearbx_packed.h -- packed int4/int8 GEMV on the CPU: layouts, constants, API.
 *
 * This header is the single definition of the packed formats shared with
 * gearbx_mlx/quant.py and gearbx_mlx/packed.py.  Change it there and here
 * together, never one side alone.
 *
 * Weights W (O rows, I columns), symmetric quantization:
 *   scales  float32 (O, n_groups); n_groups = 1 (per row, group_size 0)
 *           or I / group_size with group_size in {32, 64, 128}.
 *   int8    int8  (O, I), q in [-127, 127].
 *   int4    uint8 (O, I/2), I even: element j of a row lives in byte j/2,
 *           low nibble for even j, high nibble for odd j, stored as q + 8
 *           (so 1..15; q in [-7, 7]).
 *   y_i = sum_g s_{i,g} * sum_{j in g} q_ij * x_j      (no bias: caller adds it)
 *
 * Two families of kernels compute y:
 *   float   fp32 activations, fp32 accumulation.
 *   intdot  x quantized once per call to int8, one scale per block of
 *           GBX_QK values (d_b = max|x_b| / 127, round half to even);
 *           isum_b = sum_{j in b} q_ij * xq_j is an exact integer and
 *           y_i = sum_g s_{i,g} * sum_{b in g} d_b * isum_b.
 * Every fast kernel has a scalar *_ref oracle (gearbx_packed_ref.c) that
 * stays forever; the fast ones differ from it only in float summation order.
 */
#ifndef GEARBX_PACKED_H
#define GEARBX_PACKED_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__cplusplus)
#define GBX_STATIC_ASSERT(c, m) static_assert(c, m)
#else
#define GBX_STATIC_ASSERT(c, m) _Static_assert(c, m)
#endif

#define GBX_ABI_VERSION 1

/* ---- weight formats ---------------------------------------------------- */
#define GBX_QMAX_INT8 127
#define GBX_QMAX_INT4 7
#define GBX_INT4_OFFSET 8
/* signed value of element 2k (LO) and 2k+1 (HI) from byte k of an int4 row */
#define GBX_INT4_LO(b) ((int)((b) & 0x0F) - GBX_INT4_OFFSET)
#define GBX_INT4_HI(b) ((int)((uint8_t)(b) >> 4) - GBX_INT4_OFFSET)

/* ---- activation blocks of the intdot path ------------------------------- */
#define GBX_QK 32             /* values per activation scale d_b */
#define GBX_SPAN (2 * GBX_QK) /* int4 kernels walk 64 values = 32 weight bytes */

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
GBX_STATIC_ASSERT(GBX_QK % 16 == 0, "a block must fill whole 128-bit vectors");
GBX_STATIC_ASSERT(32 % GBX_QK == 0, "every group size (32/64/128) must be whole blocks");
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

/* ---- API ---------------------------------------------------------------- */
enum {
    GBX_OK = 0,
    GBX_E_BITS = -1,    /* bits not 4 or 8 */
    GBX_E_GROUP = -2,   /* group_size not 0/32/64/128, or in_features % group_size */
    GBX_E_SHAPE = -3,   /* in_features < 1, out_features < 0, or odd in_features for int4 */
    GBX_E_PATH = -4,    /* unknown path */
    GBX_E_NOMEM = -5,
    GBX_E_NULL = -6,    /* a required pointer is NULL */
    GBX_E_THREADS = -7  /* worker thread could not be started */
};

enum {
    GBX_PATH_AUTO = 0,       /* fastest available: intdot */
    GBX_PATH_FLOAT = 1,      /* best float kernel for this CPU */
    GBX_PATH_INTDOT = 2,     /* best intdot kernel for this CPU */
    GBX_PATH_REF = 3,        /* scalar float oracle */
    GBX_PATH_INTDOT_REF = 4  /* scalar intdot oracle */
};

typedef struct {
    int abi_version;
    int compiled_avx2;     /* AVX2+FMA kernels are in the binary */
    int compiled_neon;     /* AArch64 NEON kernels are in the binary */
    int compiled_dotprod;  /* NEON vdotq_s32 kernels are in the binary */
    int cpu_avx2;          /* this CPU runs AVX2 and FMA (run-time check) */
    int cpu_dotprod;       /* this CPU runs vdotq_s32 (run-time check) */
    int cpu_vnni;          /* this CPU runs 256-bit vpdpbusd (AVX512-VNNI+VL or AVX-VNNI) */
    int threads;           /* threads a call uses by default */
    int max_threads;
    const char *float_isa;  /* behind GBX_PATH_FLOAT: "avx2", "neon", "scalar" */
    const char *intdot_isa; /* behind GBX_PATH_INTDOT: "avx512vnni", "avxvnni",
                               "avx2", "neon-dotprod", "neon", "scalar" */
} gbx_info_t;

/*
 * y[O] = W x.  w: int8 (O, I) or uint8 (O, I/2); scales: (O, n_groups);
 * x: [I]; y: [O] (written, not accumulated).  group_size 0 = per row.
 * nthreads <= 0 uses the configured default (small products use fewer);
 * threads claim chunks of rows, and each row is computed the same way
 * whatever thread runs it, so the result does not depend on the thread
 * count.  Inputs must be finite.  Returns GBX_OK or a GBX_E_* code.
 */
int gbx_gemv(const void *w, const float *scales, const float *x, float *y,
             int out_features, int in_features, int bits, int group_size,
             int path, int nthreads);

int gbx_set_threads(int n); /* n <= 0: number of online CPUs; returns the value set */
int gbx_get_threads(void);
/* Fewest weights a thread is given (smaller products use fewer threads);
 * n <= 0 restores the default.  Returns the previous value. */
int gbx_set_min_work(int weights_per_thread);
/* x86 intdot kernels to use, to test and time the lesser ones on a CPU that
 * has more: 0 the best; 1 plain AVX2 (no VNNI); 2 no AVX512-VNNI (AVX-VNNI
 * if present, else AVX2).  Returns the previous setting. */
int gbx_set_isa_limit(int level);
void gbx_get_info(gbx_info_t *info);
const char *gbx_strerror(int code);

/* Benchmark helper: read the first bytes/65536 * 65536 bytes of buf with
 * nthreads threads (same pool and row split as gbx_gemv); returns a checksum
 * (the sum of its 64-bit words) so the reads cannot be optimized away. */
uint64_t gbx_read_bandwidth(const void *buf, size_t bytes, int nthreads);

/* Quantize activations in blocks of GBX_QK (last block may be partial). */
void gbx_quantize_act_ref(const float *x, int n, int8_t *qs, float *d, int32_t *sum);
void gbx_quantize_act(const float *x, int n, int8_t *qs, float *d, int32_t *sum);

/* Scalar oracles: arguments as gbx_gemv, already validated; single thread. */
void gbx_gemv_float_ref(const void *w, const float *scales, const float *x, float *y,
                        int out_features, int in_features, int bits, int group_size);
int gbx_gemv_intdot_ref(const void *w, const float *scales, const float *x, float *y,
                        int out_features, int in_features, int bits, int group_size);

/* Argument check shared by gbx_gemv and the Python wrapper's messages. */
int gbx_check_args(int out_features, int in_features, int bits, int group_size, int path);

#ifdef __cplusplus
}
#endif
#endif /* GEARBX_PACKED_H */
