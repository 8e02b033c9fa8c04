/*
 * gearbx_cpu.h -- packed GEMV on the CPU: the public API of the C kernels.
 *
 * The weight formats are those of ../gearbx_format.h (shared with the GPU
 * kernels and Python).  This header adds what only the CPU kernels need: the
 * activation blocks of the integer-dot paths, and the entry points.
 *
 * Two families of kernels compute y:
 *   float   fp32 activations, fp32 accumulation.
 *   intdot  x quantized once per call to int8, one scale per block of
 *           GBX_QK values (d_b = max|x_b| / 127, round half to even);
 *           isum_b = sum_{j in b} q_ij * xq_j is an exact integer and
 *           y_i = sum_g s_{i,g} * sum_{b in g} d_b * isum_b.
 * Every fast kernel has a scalar *_ref oracle (ref.c) that stays forever;
 * the fast ones differ from it only in float summation order.
 *
 * Source layout: ref.c (oracles), dispatch.c (CPU features, kernel choice,
 * entry points), pool.c (threads), bandwidth.c (read-bandwidth probe),
 * nested.c (nested planes' GEMV), unpack.c (a nested gear as one matrix),
 * arch/x86/ and arch/arm/ (SIMD kernels), internal.h (what they share),
 * test_main.c (self-test driver).
 */
#ifndef GEARBX_CPU_H
#define GEARBX_CPU_H

#include <stddef.h>
#include <stdint.h>

#include "gearbx_format.h" /* metal_kernels/, on the include path */

#ifdef __cplusplus
extern "C" {
#endif

#define GBX_ABI_VERSION 2

/* ---- activation blocks of the intdot path ------------------------------- */
#define GBX_QK 32             /* values per activation scale d_b */
#define GBX_SPAN (2 * GBX_QK) /* int4 kernels walk 64 values = 32 weight bytes */

GBX_STATIC_ASSERT(GBX_QK % 16 == 0, "a block must fill whole 128-bit vectors");
GBX_STATIC_ASSERT(GBX_GROUP_MIN % GBX_QK == 0, "every group is whole blocks");

/* ---- API ---------------------------------------------------------------- */
enum {
    GBX_OK = 0,
    GBX_E_BITS = -1,    /* bits not 4 or 8 */
    GBX_E_GROUP = -2,   /* group_size not 0/32/64/128, or in_features % group_size */
    GBX_E_SHAPE = -3,   /* in_features < 1, out_features < 0, or odd in_features for int4 */
    GBX_E_PATH = -4,    /* unknown path */
    GBX_E_NOMEM = -5,
    GBX_E_NULL = -6,    /* a required pointer is NULL */
    GBX_E_THREADS = -7, /* worker thread could not be started */
    GBX_E_PLANES = -8   /* nested: not 1..GBX_MAX_PLANES planes, a plane of bits
                           other than 4/8, an unknown scale dtype, or a factor
                           that is not finite */
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
    const char *nested_float_isa;  /* gbx_nested_gemv's float kernels: "avx2", "neon", "scalar" */
    const char *nested_intdot_isa; /* and its intdot kernels (names as intdot_isa) */
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

/* ---- nested gears: MLX affine planes (gearbx_format.h) ------------------ */

/* One plane of an (O, I) matrix: what it adds to each weight is
 * factor * (scale * q + bias), q the unsigned code, one scale and bias per
 * group of group_size inputs (each plane its own group size). */
typedef struct {
    const uint32_t *codes; /* (O, I * bits / 32), codes least significant first */
    const void *scales;    /* (O, I / group_size) in `dtype` */
    const void *biases;    /* (O, I / group_size) in `dtype` */
    int bits;              /* 4 or 8 */
    int group_size;        /* 32, 64 or 128 */
    int dtype;             /* GBX_DTYPE_F32, GBX_DTYPE_F16 or GBX_DTYPE_BF16 */
    float factor;          /* 2^-exponent of the plane (any finite value) */
} gbx_plane;

/*
 * y[k][O] = sum_{p < n} factor_p * deq(plane p) x[k] for k < m: the gear that
 * reads the first n planes, for m activation rows x[k][I] (m > 1: a verify
 * of m tokens reads each weight row from memory once).  No layer bias: the
 * caller adds it.  Paths as
 * gbx_gemv's, except that GBX_PATH_AUTO is GBX_PATH_FLOAT here: a gear that
 * accepts the error of int8 activations asks for GBX_PATH_INTDOT.  The
 * intdot path computes each group's product sum_{b in g} d_b * isum_b and
 * its bias term b_g * sum_{b in g} d_b * sum_b from the int8 activations
 * (the same x for both: with the float sums in the bias term the unsigned
 * codes' offset would carry the activation error).  Threads and
 * results as gbx_gemv (independent of the thread count).
 */
int gbx_nested_gemv(const gbx_plane *planes, int n, const float *x, float *y, int m,
                    int out_features, int in_features, int path, int nthreads);

/* Scalar oracles of gbx_nested_gemv (arguments already checked; one thread). */
int gbx_nested_float_ref(const gbx_plane *planes, int n, const float *x, float *y, int m,
                         int out_features, int in_features);
int gbx_nested_intdot_ref(const gbx_plane *planes, int n, const float *x, float *y, int m,
                          int out_features, int in_features);

/* Argument check of gbx_nested_gemv (pointers aside). */
int gbx_check_nested(const gbx_plane *planes, int n, int m, int out_features, int in_features, int path);

/*
 * w[r - row0][I] = sum_{p < n} factor_p * deq(plane p)[r] in float32 for rows
 * row0 <= r < row1 of the (out_features, in_features) planes: the gear of the
 * first n planes as one matrix (or a block of its rows), for a BLAS product
 * of many activation rows.
 * Per element q * (scale * factor) + bias * factor, rounded as a product and
 * a sum (no fused multiply-add), the planes added in order: the values of
 * gearbx_mlx.nested.planes.unpack_plane summed, bit for bit.  Rows are split
 * over nthreads threads (<= 0: the default).  Returns GBX_OK or a GBX_E_*
 * code (checks as gbx_check_nested; GBX_E_SHAPE unless
 * 0 <= row0 <= row1 <= out_features).
 */
int gbx_nested_unpack(const gbx_plane *planes, int n, float *w, int row0, int row1, int out_features,
                      int in_features, int nthreads);

#ifdef __cplusplus
}
#endif
#endif /* GEARBX_CPU_H */
