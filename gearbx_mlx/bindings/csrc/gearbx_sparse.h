/*
 * gearbx_sparse.h -- block-sparse one-row product over one MLX affine plane.
 *
 * An activation-sparse drafter computes y = W x over a few input groups of W
 * only: the blocks a token activates.  W is one plane of gearbx_format.h (MLX
 * affine, 4-bit codes least significant first in uint32 words, one scale and
 * bias per group of group_size inputs), row-major (O, I).  A block is one
 * quantization group: inputs [g * gs, (g + 1) * gs) of every row, i.e. the
 * gs / 2 bytes at offset g * gs / 2 of each row's codes, and element g of each
 * row's scales and biases.  So the kernel reads, per output row and kept
 * block, one contiguous 32-byte (gs 64) or 64-byte (gs 128) segment, a scale
 * and a bias, and nothing of the dropped blocks:
 *
 *     y_r = sum_{g in blocks} s_{r,g} (codes_{r,g} . x_g) + b_{r,g} xsum_g
 *
 * (xsum_g the sum of x over group g).  Paths as gbx_nested_gemv's: float
 * (fp32 x) or intdot (x quantized to int8 in blocks of GBX_QK exactly as the
 * dense intdot kernels quantize it, so the result is the dense intdot
 * product of the kept groups), and their scalar oracles.  The kernels of
 * each path live in sparse.c (scalar), arch/x86/sparse.c (AVX2) and
 * arch/arm/sparse.c (NEON, dotprod).
 */
#ifndef GEARBX_SPARSE_H
#define GEARBX_SPARSE_H

#include "gearbx_cpu.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * y[O] = the product above over the nkept groups listed in blocks (strictly
 * ascending, each in [0, I / group_size)).  plane: 4-bit codes, group_size 64
 * or 128, factor applied to the result.  No layer bias (the caller adds it).
 * Threads and results as gbx_gemv (independent of the thread count).
 * Returns GBX_OK, GBX_E_BITS (not 4-bit), GBX_E_GROUP (group not 64/128 or
 * not dividing I), GBX_E_SHAPE (a block out of range or out of order, nkept
 * < 0, I < 1), GBX_E_PLANES (scale dtype), GBX_E_PATH or GBX_E_NULL.
 */
int gbx_sparse_gemv(const gbx_plane *plane, const float *x, const int32_t *blocks, int nkept, float *y,
                    int out_features, int in_features, int path, int nthreads);

/*
 * The keep groups of group_size consecutive inputs of x[n] with the largest
 * sum |x| (ties: the lower group), written ascending to blocks[keep]; keep is
 * clamped to [0, n / group_size].  Returns the number written, or a GBX_E_*
 * code (n % group_size, group_size < 1, NULL).
 */
int gbx_top_blocks(const float *x, int n, int group_size, int keep, int32_t *blocks);

/* Both: the keep heaviest groups of x (gbx_top_blocks, into blocks[keep]),
 * then gbx_sparse_gemv over them.  Returns as gbx_sparse_gemv. */
int gbx_sparse_gemv_top(const gbx_plane *plane, const float *x, int keep, int32_t *blocks, float *y,
                        int out_features, int in_features, int path, int nthreads);

/* Argument check of gbx_sparse_gemv (pointers and blocks aside). */
int gbx_check_sparse(const gbx_plane *plane, int out_features, int in_features, int path);

#ifdef __cplusplus
}
#endif
#endif /* GEARBX_SPARSE_H */
