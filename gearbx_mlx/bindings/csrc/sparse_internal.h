/*
 * sparse_internal.h -- what the block-sparse kernels (sparse.c and its arch/
 * files) share: the call context and the row kernels of each ISA.
 */
#ifndef GEARBX_SPARSE_INTERNAL_H
#define GEARBX_SPARSE_INTERNAL_H

#include "gearbx_sparse.h"
#include "internal.h"

/* One call's context.  `base` comes first so that the pool, which hands row
 * kernels a gbx_ctx pointer, hands them this context (container of base). */
typedef struct {
    gbx_ctx base;
    const uint8_t *codes;  /* row r at codes + r * row_bytes */
    size_t row_bytes;
    const void *scales, *biases; /* row r at element r * ng */
    int dtype, ng, gs;
    int spans;             /* gs / GBX_SPAN: spans of 64 codes per group */
    const int32_t *blocks; /* kept groups, ascending */
    int nkept;
    float factor;
    const gbx_span_f32 *xf; /* float path: x in split order, [I / GBX_SPAN] */
    const gbx_act_q8 *a;    /* intdot path */
    const float *xsum;      /* [ng]: group sums of x (float) or of the int8 x (intdot) */
    float *y;
} gbx_sparse_ctx;

GBX_INLINE const gbx_sparse_ctx *gbx_sparse_of(const gbx_ctx *c) { return (const gbx_sparse_ctx *)c; }

/* sum over kept groups of b_{r,g} * xsum_g: the bias term of row r. */
GBX_INLINE float gbx_sparse_bias_term(const gbx_sparse_ctx *c, int r)
{
    const size_t off = (size_t)r * c->ng;
    float y = 0.0f;
    for (int i = 0; i < c->nkept; ++i)
        y += gbx_scale_at(c->biases, off + (size_t)c->blocks[i], c->dtype) * c->xsum[c->blocks[i]];
    return y;
}

#if GBX_X86
GBX_HIDDEN void gbx_sparse4_float_avx2(const gbx_ctx *c, int r0, int r1);
GBX_HIDDEN void gbx_sparse4_intdot_avx2(const gbx_ctx *c, int r0, int r1);
#endif
#if GBX_NEON
GBX_HIDDEN void gbx_sparse4_float_neon(const gbx_ctx *c, int r0, int r1);
GBX_HIDDEN void gbx_sparse4_intdot_neon(const gbx_ctx *c, int r0, int r1);
#if GBX_DOTPROD
GBX_HIDDEN void gbx_sparse4_intdot_dotprod(const gbx_ctx *c, int r0, int r1);
#endif
#endif

#endif /* GEARBX_SPARSE_INTERNAL_H */
