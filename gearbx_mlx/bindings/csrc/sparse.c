/*
 * sparse.c -- block-sparse one-row product over one MLX affine plane
 * (gearbx_sparse.h): checks, block choice, scalar kernels (the oracles and the
 * kernels of a CPU without SIMD), kernel choice and the entry points.
 *
 * Rows are split over the thread pool as in the dense GEMV; each row walks
 * the kept groups in the order given, so a row's result does not depend on
 * the thread count.  The activation buffers are those of the dense nested
 * kernels (x in split order, or int8 blocks of GBX_QK with their split
 * order), built for the kept groups only (build_kept).
 */
#include <math.h>

#include "sparse_internal.h"

/* ------------------------------------------------------------------------ */
/* Scalar kernels                                                           */
/* ------------------------------------------------------------------------ */

static void sparse4_float_scalar(const gbx_ctx *cc, int r0, int r1)
{
    const gbx_sparse_ctx *c = gbx_sparse_of(cc);
    const float *x = c->base.x;
    for (int r = r0; r < r1; ++r) {
        const uint8_t *row = c->codes + (size_t)r * c->row_bytes;
        const size_t off = (size_t)r * c->ng;
        float y = 0.0f;
        for (int i = 0; i < c->nkept; ++i) {
            const int g = c->blocks[i];
            float acc = 0.0f;
            for (int j = g * c->gs; j < (g + 1) * c->gs; ++j)
                acc += (float)gbx_code_at(row, 4, j) * x[j];
            y += gbx_scale_at(c->scales, off + (size_t)g, c->dtype) * acc;
        }
        c->y[r] = c->factor * (y + gbx_sparse_bias_term(c, r));
    }
}

static void sparse4_intdot_scalar(const gbx_ctx *cc, int r0, int r1)
{
    const gbx_sparse_ctx *c = gbx_sparse_of(cc);
    const gbx_act_q8 *a = c->a;
    const int bpg = c->gs / GBX_QK;
    for (int r = r0; r < r1; ++r) {
        const uint8_t *row = c->codes + (size_t)r * c->row_bytes;
        const size_t off = (size_t)r * c->ng;
        float y = 0.0f;
        for (int i = 0; i < c->nkept; ++i) {
            const int g = c->blocks[i];
            const float s = gbx_scale_at(c->scales, off + (size_t)g, c->dtype);
            for (int b = g * bpg; b < (g + 1) * bpg; ++b) {
                int32_t isum = 0;
                for (int j = b * GBX_QK; j < (b + 1) * GBX_QK; ++j)
                    isum += gbx_code_at(row, 4, j) * a->qs[j];
                y += s * (a->d[b] * (float)isum);
            }
        }
        c->y[r] = c->factor * (y + gbx_sparse_bias_term(c, r));
    }
}

/* ------------------------------------------------------------------------ */
/* Checks and block choice                                                  */
/* ------------------------------------------------------------------------ */

int gbx_check_sparse(const gbx_plane *plane, int out_features, int in_features, int path)
{
    if (!plane)
        return GBX_E_NULL;
    if (plane->bits != 4)
        return GBX_E_BITS;
    if (plane->dtype != GBX_DTYPE_F32 && plane->dtype != GBX_DTYPE_F16 && plane->dtype != GBX_DTYPE_BF16)
        return GBX_E_PLANES;
    if (!isfinite(plane->factor))
        return GBX_E_PLANES;
    const int gs = plane->group_size;
    if ((gs != 64 && gs != 128) || (in_features > 0 && in_features % gs))
        return GBX_E_GROUP;
    if (in_features < 1 || out_features < 0)
        return GBX_E_SHAPE;
    if (path < GBX_PATH_AUTO || path > GBX_PATH_INTDOT_REF)
        return GBX_E_PATH;
    return GBX_OK;
}

int gbx_top_blocks(const float *x, int n, int group_size, int keep, int32_t *blocks)
{
    if (group_size < 1 || n < 0 || n % group_size)
        return GBX_E_GROUP;
    const int ng = n / group_size;
    if (keep > ng)
        keep = ng;
    if (keep <= 0)
        return 0;
    if (!x || !blocks)
        return GBX_E_NULL;
    float *mass = malloc(sizeof(float) * (size_t)ng);
    int32_t *order = malloc(sizeof(int32_t) * (size_t)ng);
    if (!mass || !order) {
        free(mass), free(order);
        return GBX_E_NOMEM;
    }
    for (int g = 0; g < ng; ++g) { /* eight partial sums: the compiler vectorizes them */
        const float *xg = x + (size_t)g * group_size;
        float t[8] = {0};
        int j = 0;
        for (; j + 8 <= group_size; j += 8)
            for (int k = 0; k < 8; ++k)
                t[k] += fabsf(xg[j + k]);
        for (; j < group_size; ++j)
            t[0] += fabsf(xg[j]);
        mass[g] = ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
    }
    /* the keep heaviest, by insertion into a list sorted by (mass desc, index asc) */
    int len = 0;
    for (int g = 0; g < ng; ++g) {
        if (len == keep && !(mass[g] > mass[order[len - 1]]))
            continue;
        int at = len < keep ? len++ : keep - 1;
        while (at > 0 && mass[g] > mass[order[at - 1]]) {
            order[at] = order[at - 1];
            --at;
        }
        order[at] = g;
    }
    /* ascending group order: mark, then sweep */
    for (int g = 0; g < ng; ++g)
        mass[g] = 0.0f;
    for (int i = 0; i < keep; ++i)
        mass[order[i]] = 1.0f;
    int k = 0;
    for (int g = 0; g < ng; ++g)
        if (mass[g] != 0.0f)
            blocks[k++] = g;
    free(mass), free(order);
    return k;
}

/* ------------------------------------------------------------------------ */
/* Kernel choice and entry points                                           */
/* ------------------------------------------------------------------------ */

static gbx_rows_fn pick(int intdot)
{
#if GBX_X86
    if (gbx_cpu.avx2)
        return intdot ? gbx_sparse4_intdot_avx2 : gbx_sparse4_float_avx2;
#endif
#if GBX_DOTPROD
    if (intdot && gbx_cpu.dotprod)
        return gbx_sparse4_intdot_dotprod;
#endif
#if GBX_NEON
    return intdot ? gbx_sparse4_intdot_neon : gbx_sparse4_float_neon;
#endif
    return intdot ? sparse4_intdot_scalar : sparse4_float_scalar;
}

/* The activations of the kept groups only, as the dense kernels build them
 * for the whole row (dispatch.c): int8 blocks of GBX_QK (quantized block by
 * block, so a kept block's codes are the dense call's) in split order with
 * each lane's d, or fp32 x in split order; and each kept group's sum of x (of
 * the int8 x on the intdot path).  One allocation, mem; dropped groups'
 * entries are left unset and never read. */
typedef struct {
    gbx_act_q8 a;
    gbx_span_f32 *xf;
    float *xsum;
    void *mem;
} kept_act;

static size_t align64(size_t n) { return (n + 63) & ~(size_t)63; }

static int build_kept(const float *x, int n, int gs, const int32_t *blocks, int nkept, int intdot, int split,
                      kept_act *k)
{
    const int nb = n / GBX_QK, ns = n / GBX_SPAN, ng = n / gs, bpg = gs / GBX_QK, spg = gs / GBX_SPAN;
    const size_t o_d = align64((size_t)n), o_sum = align64(o_d + 4 * (size_t)nb),
                 o_split = align64(o_sum + 4 * (size_t)nb), o_sd = align64(o_split + sizeof(gbx_span_q8) * ns),
                 o_xf = align64(o_sd + 32 * (size_t)ns), o_xs = align64(o_xf + (split && !intdot ? sizeof(gbx_span_f32) * ns : 0)),
                 total = o_xs + 4 * (size_t)ng;
    memset(k, 0, sizeof *k);
    k->mem = malloc(total + 64);
    if (!k->mem)
        return GBX_E_NOMEM;
    char *base = (char *)align64((size_t)k->mem);
    gbx_act_q8 *a = &k->a;
    a->n = n, a->nblocks = nb, a->nspans = ns;
    a->qs = (int8_t *)base, a->d = (float *)(base + o_d), a->sum = (int32_t *)(base + o_sum);
    a->split = (gbx_span_q8 *)(base + o_split), a->span_d = (float *)(base + o_sd);
    k->xf = split && !intdot ? (gbx_span_f32 *)(base + o_xf) : NULL;
    k->xsum = (float *)(base + o_xs);
    for (int i = 0; i < nkept; ++i) {
        const int g = blocks[i];
        const float *xg = x + (size_t)g * gs;
        float xs = 0.0f;
        if (intdot) {
            int8_t *q = a->qs + (size_t)g * gs;
            gbx_quantize_act(xg, gs, q, a->d + g * bpg, a->sum + g * bpg);
            for (int b = g * bpg; b < (g + 1) * bpg; ++b)
                xs += a->d[b] * (float)a->sum[b];
            for (int sp = g * spg; sp < (g + 1) * spg; ++sp) {
                const int8_t *qp = a->qs + (size_t)sp * GBX_SPAN;
                for (int j = 0; j < GBX_SPAN / 2; ++j)
                    a->split[sp].even[j] = qp[2 * j], a->split[sp].odd[j] = qp[2 * j + 1];
                for (int l = 0; l < 8; ++l)
                    a->span_d[8 * sp + l] = a->d[2 * sp + (l >> 2)];
            }
        } else {
            for (int j = 0; j < gs; ++j)
                xs += xg[j];
            for (int sp = g * spg; k->xf && sp < (g + 1) * spg; ++sp) {
                const float *xp = x + (size_t)sp * GBX_SPAN;
                for (int j = 0; j < GBX_SPAN / 2; ++j)
                    k->xf[sp].even[j] = xp[2 * j], k->xf[sp].odd[j] = xp[2 * j + 1];
            }
        }
        k->xsum[g] = xs;
    }
    return GBX_OK;
}

static int blocks_valid(const int32_t *blocks, int nkept, int ng)
{
    if (nkept < 0 || nkept > ng)
        return 0;
    for (int i = 0; i < nkept; ++i)
        if (blocks[i] < 0 || blocks[i] >= ng || (i > 0 && blocks[i] <= blocks[i - 1]))
            return 0;
    return 1;
}

int gbx_sparse_gemv(const gbx_plane *plane, const float *x, const int32_t *blocks, int nkept, float *y,
                    int out_features, int in_features, int path, int nthreads)
{
    int rc = gbx_check_sparse(plane, out_features, in_features, path);
    if (rc != GBX_OK)
        return rc;
    if (out_features == 0)
        return GBX_OK;
    if (!x || !y || (nkept > 0 && !blocks) || !gbx_planes_present(plane, 1))
        return GBX_E_NULL;
    const int gs = plane->group_size, ng = in_features / gs;
    if (!blocks_valid(blocks, nkept, ng))
        return GBX_E_SHAPE;
    gbx_cpu_init();
    const int intdot = path == GBX_PATH_INTDOT || path == GBX_PATH_INTDOT_REF;
    const int ref = path == GBX_PATH_REF || path == GBX_PATH_INTDOT_REF;

    gbx_sparse_ctx c;
    memset(&c, 0, sizeof c);
    c.codes = (const uint8_t *)plane->codes;
    c.row_bytes = (size_t)in_features / 2;
    c.scales = plane->scales, c.biases = plane->biases;
    c.dtype = plane->dtype, c.ng = ng, c.gs = gs, c.spans = gs / GBX_SPAN;
    c.blocks = blocks, c.nkept = nkept, c.factor = plane->factor;
    c.base.x = x, c.base.I = in_features, c.y = y;

    kept_act k;
    rc = build_kept(x, in_features, gs, blocks, nkept, intdot, !ref, &k);
    c.a = &k.a, c.xf = k.xf, c.xsum = k.xsum;
    if (rc == GBX_OK) {
        const gbx_rows_fn fn = ref ? (intdot ? sparse4_intdot_scalar : sparse4_float_scalar) : pick(intdot);
        const size_t row_weights = (size_t)nkept * (size_t)gs;
        if (ref)
            fn(&c.base, 0, out_features);
        else
            rc = gbx_run_rows(fn, &c.base, out_features,
                              gbx_pool_parts(nthreads, (long long)out_features * (long long)row_weights, out_features),
                              row_weights);
    }
    free(k.mem);
    return rc;
}

int gbx_sparse_gemv_top(const gbx_plane *plane, const float *x, int keep, int32_t *blocks, float *y,
                        int out_features, int in_features, int path, int nthreads)
{
    int rc = gbx_check_sparse(plane, out_features, in_features, path);
    if (rc != GBX_OK)
        return rc;
    const int k = gbx_top_blocks(x, in_features, plane->group_size, keep, blocks);
    if (k < 0)
        return k;
    return gbx_sparse_gemv(plane, x, blocks, k, y, out_features, in_features, path, nthreads);
}
