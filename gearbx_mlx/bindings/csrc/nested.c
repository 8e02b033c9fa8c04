/*
 * nested.c -- the gears of nested bit planes: y = sum_{p<n} 2^-e_p deq(p) x
 * (gearbx_format.h), checks, kernel choice and the entry point.
 *
 * A plane is MLX's affine quantization: unsigned codes, a scale and a bias
 * per group.  Per output row, plane and group the kernels compute
 *     s_g * (codes . x)_g + b_g * xsum_g
 * where xsum_g (the group's sum of x: of the int8 activations on the intdot
 * path) is computed once per call, so a bias
 * costs one multiply-add per group.  Each plane of a gear may have its own
 * bits (4, 6 or 8) and scale dtype; each gets the kernel of its (bits, dtype)
 * from the family of the chosen path (arch/x86/nested.c, arch/arm/nested.c,
 * or the scalar one below; a family without a kernel for some bits leaves
 * those planes to the scalar one), and a row sums its planes' results times
 * their factors.  Oracles: ref.c (gbx_nested_float_ref, gbx_nested_intdot_ref).
 */
#include <math.h>

#include "internal.h"

/* ------------------------------------------------------------------------ */
/* Scalar kernels (CPUs without SIMD)                                       */
/* ------------------------------------------------------------------------ */

static float plane_float_scalar(const gbx_nested_ctx *c, const gbx_plane_rt *p, int r, int k)
{
    return gbx_nested_tail_float(c, p, r, k, 0, c->I / GBX_QK) +
           gbx_group_dot_scalar(p->biases, (size_t)r * p->ng, p->dtype, p->xsum + (size_t)k * p->ng, p->ng);
}

static float plane_intdot_scalar(const gbx_nested_ctx *c, const gbx_plane_rt *p, int r, int k)
{
    return gbx_nested_tail_intdot(c, p, r, k, 0, c->I / GBX_QK) +
           gbx_group_dot_scalar(p->biases, (size_t)r * p->ng, p->dtype, p->xsum + (size_t)k * p->ng, p->ng);
}

static const gbx_nested_kernels nested_float_scalar = {
    "scalar", {{plane_float_scalar, plane_float_scalar, plane_float_scalar},
               {plane_float_scalar, plane_float_scalar, plane_float_scalar},
               {plane_float_scalar, plane_float_scalar, plane_float_scalar}}};
static const gbx_nested_kernels nested_intdot_scalar = {
    "scalar", {{plane_intdot_scalar, plane_intdot_scalar, plane_intdot_scalar},
               {plane_intdot_scalar, plane_intdot_scalar, plane_intdot_scalar},
               {plane_intdot_scalar, plane_intdot_scalar, plane_intdot_scalar}}};

/* ------------------------------------------------------------------------ */
/* Kernel choice                                                            */
/* ------------------------------------------------------------------------ */

static const gbx_nested_kernels *pick_nested_float(void)
{
#if GBX_X86
    if (gbx_cpu.avx2 && gbx_cpu.f16c)
        return &gbx_nested_float_avx2;
#endif
#if GBX_NEON
    return &gbx_nested_float_neon;
#endif
    return &nested_float_scalar;
}

static const gbx_nested_kernels *pick_nested_intdot(void)
{
#if GBX_VNNI512
    if (gbx_cpu.vnni512 && gbx_cpu.f16c && gbx_isa_limit == 0)
        return &gbx_nested_intdot_vnni512;
#endif
#if GBX_AVXVNNI
    if (gbx_cpu.avxvnni && gbx_cpu.f16c && gbx_isa_limit != 1)
        return &gbx_nested_intdot_avxvnni;
#endif
#if GBX_X86
    if (gbx_cpu.avx2 && gbx_cpu.f16c)
        return &gbx_nested_intdot_avx2;
#endif
#if GBX_DOTPROD
    if (gbx_cpu.dotprod)
        return &gbx_nested_intdot_dotprod;
#endif
#if GBX_NEON
    return &gbx_nested_intdot_neon;
#endif
    return &nested_intdot_scalar;
}

void gbx_nested_isa_names(const char **float_isa, const char **intdot_isa)
{
    gbx_cpu_init();
    *float_isa = pick_nested_float()->name;
    *intdot_isa = pick_nested_intdot()->name;
}

/* ------------------------------------------------------------------------ */
/* Shared by the GEMV below and the unpacking of unpack.c                   */
/* ------------------------------------------------------------------------ */

int gbx_planes_present(const gbx_plane *planes, int n)
{
    for (int i = 0; i < n; ++i)
        if (!planes[i].codes || !planes[i].scales || !planes[i].biases)
            return 0;
    return 1;
}

void gbx_nested_setup(gbx_nested_ctx *c, const gbx_plane *planes, int n, int out_features, int in_features)
{
    memset(c, 0, sizeof *c);
    for (int i = 0; i < n; ++i) {
        gbx_plane_rt *p = c->p + i;
        p->codes = (const uint8_t *)planes[i].codes;
        p->row_bytes = (size_t)in_features * planes[i].bits / 8;
        p->scales = planes[i].scales;
        p->biases = planes[i].biases;
        p->bits = planes[i].bits;
        p->dtype = planes[i].dtype;
        p->ng = in_features / planes[i].group_size;
        p->factor = planes[i].factor;
    }
    c->n = n, c->O = out_features, c->I = in_features;
}

int gbx_nested_run(gbx_rows_fn fn, const gbx_nested_ctx *c, int rows, size_t row_weights, int nthreads,
                   long spin_ns)
{
    gbx_ctx cc;
    memset(&cc, 0, sizeof cc);
    cc.nest = c;
    const int parts = gbx_pool_parts(nthreads, (long long)rows * (long long)row_weights, rows);
    return gbx_run_rows_spin(fn, &cc, rows, parts, row_weights, spin_ns);
}

/* ------------------------------------------------------------------------ */
/* Entry point                                                              */
/* ------------------------------------------------------------------------ */

int gbx_check_nested(const gbx_plane *planes, int n, int m, int out_features, int in_features, int path)
{
    if (!planes)
        return GBX_E_NULL;
    if (n < 1 || n > GBX_MAX_PLANES)
        return GBX_E_PLANES;
    for (int i = 0; i < n; ++i) {
        const gbx_plane *p = planes + i;
        if (p->bits != GBX_PLANE_BITS_LO && p->bits != GBX_PLANE_BITS_HI && p->bits != GBX_PLANE_BITS_6)
            return GBX_E_PLANES;
        if (p->dtype != GBX_DTYPE_F32 && p->dtype != GBX_DTYPE_F16 && p->dtype != GBX_DTYPE_BF16)
            return GBX_E_PLANES;
        if (!isfinite(p->factor))
            return GBX_E_PLANES;
        const int gs = p->group_size;
        if (gs < GBX_GROUP_MIN || gs > GBX_GROUP_MAX || (gs & (gs - 1)) || (in_features > 0 && in_features % gs))
            return GBX_E_GROUP;
    }
    if (m < 1 || in_features < 1 || out_features < 0)
        return GBX_E_SHAPE;
    if (path < GBX_PATH_AUTO || path > GBX_PATH_INTDOT_REF)
        return GBX_E_PATH;
    return GBX_OK;
}

/* A gear of one or two 4-bit planes through the family's rows kernel (c->rows4),
 * which writes rows r0..r1 of every activation row. */
static void nested_rows4(const gbx_ctx *cc, int r0, int r1) { cc->nest->rows4(cc->nest, r0, r1); }

static void nested_rows(const gbx_ctx *cc, int r0, int r1)
{
    const gbx_nested_ctx *c = cc->nest;
    for (int r = r0; r < r1; ++r)
        for (int k = 0; k < c->m; ++k) { /* the row's planes stay in L1 across the m activations */
            float acc = 0.0f;
            for (int i = 0; i < c->n; ++i)
                acc += c->p[i].factor * c->p[i].fn(c, c->p + i, r, k);
            c->y[(size_t)k * c->O + r] = acc;
        }
}

static int log2_int(int v)
{
    int k = 0;
    while ((1 << k) < v)
        ++k;
    return k;
}

/* Per-call activation buffers of either path, for m rows of x. */
typedef struct {
    float *xsum[GBX_MAX_PLANES]; /* one [m][ng] array per distinct group size */
    gbx_span_f32 *xf;
    gbx_act_q8 *a;
    void **act_mem;
    int m;
} nested_buffers;

static void free_buffers(nested_buffers *b)
{
    if (b->act_mem)
        for (int k = 0; k < b->m; ++k)
            free(b->act_mem[k]);
    free(b->act_mem), free(b->a), free(b->xf);
    for (int i = 0; i < GBX_MAX_PLANES; ++i)
        free(b->xsum[i]);
}

/* The group sums of every plane: one array per distinct group size. */
static int build_group_sums(gbx_nested_ctx *c, int intdot, nested_buffers *b)
{
    for (int i = 0; i < c->n; ++i) {
        gbx_plane_rt *p = c->p + i;
        for (int j = 0; j < i && !p->xsum; ++j)
            if (c->p[j].ng == p->ng)
                p->xsum = c->p[j].xsum;
        if (p->xsum)
            continue;
        float *xs = b->xsum[i] = malloc(sizeof(float) * (size_t)c->m * p->ng);
        if (!xs)
            return GBX_E_NOMEM;
        const int gs = c->I / p->ng;
        for (int k = 0; k < c->m; ++k) {
            if (intdot)
                gbx_nested_group_sums_q8(c->a[k].d, c->a[k].sum, c->I, gs, xs + (size_t)k * p->ng);
            else
                gbx_nested_group_sums(c->x + (size_t)k * c->I, c->I, gs, xs + (size_t)k * p->ng);
        }
        p->xsum = xs;
    }
    return GBX_OK;
}

static int build_buffers(gbx_nested_ctx *c, int intdot, int any4, nested_buffers *b)
{
    const int m = c->m;
    memset(b, 0, sizeof *b);
    b->m = m;
    if (!intdot) {
        if (any4 && c->nspans > 0) {
            b->xf = malloc(sizeof(gbx_span_f32) * (size_t)m * c->nspans);
            if (!b->xf)
                return GBX_E_NOMEM;
            for (int k = 0; k < m; ++k)
                for (int s = 0; s < c->nspans; ++s) {
                    const float *xs = c->x + (size_t)k * c->I + (size_t)s * GBX_SPAN;
                    gbx_span_f32 *o = b->xf + (size_t)k * c->nspans + s;
                    for (int j = 0; j < GBX_SPAN / 2; ++j)
                        o->even[j] = xs[2 * j], o->odd[j] = xs[2 * j + 1];
                }
        }
        c->xf = b->xf;
        return build_group_sums(c, 0, b);
    }
    b->a = calloc((size_t)m, sizeof(gbx_act_q8));
    b->act_mem = calloc((size_t)m, sizeof(void *));
    if (!b->a || !b->act_mem)
        return GBX_E_NOMEM;
    for (int k = 0; k < m; ++k) {
        /* bits 4 also builds the split order the 4-bit kernels read */
        const int rc = gbx_build_act(c->x + (size_t)k * c->I, c->I, any4 ? 4 : 8, b->a + k, b->act_mem + k);
        if (rc != GBX_OK)
            return rc;
    }
    c->a = b->a;
    return build_group_sums(c, 1, b);
}

int gbx_nested_gemv(const gbx_plane *planes, int n, const float *x, float *y, int m, int out_features,
                    int in_features, int path, int nthreads)
{
    int rc = gbx_check_nested(planes, n, m, out_features, in_features, path);
    if (rc != GBX_OK)
        return rc;
    if (out_features == 0)
        return GBX_OK;
    if (!x || !y)
        return GBX_E_NULL;
    if (!gbx_planes_present(planes, n))
        return GBX_E_NULL;
    gbx_cpu_init();
    if (path == GBX_PATH_REF)
        return gbx_nested_float_ref(planes, n, x, y, m, out_features, in_features);
    if (path == GBX_PATH_INTDOT_REF)
        return gbx_nested_intdot_ref(planes, n, x, y, m, out_features, in_features);

    const int intdot = path == GBX_PATH_INTDOT;
    const gbx_nested_kernels *kern = intdot ? pick_nested_intdot() : pick_nested_float();
    gbx_nested_ctx c;
    gbx_nested_setup(&c, planes, n, out_features, in_features);
    int any4 = 0;
    for (int i = 0; i < n; ++i) {
        gbx_plane_rt *p = c.p + i;
        p->gshift = log2_int(planes[i].group_size / GBX_QK);
        p->fn = kern->fn[GBX_BITS_SLOT(p->bits)][p->dtype];
        if (!p->fn)
            p->fn = (intdot ? &nested_intdot_scalar : &nested_float_scalar)->fn[GBX_BITS_SLOT(p->bits)][p->dtype];
        any4 |= p->bits == 4;
    }
    c.m = m;
    c.nspans = in_features / GBX_SPAN;
    c.x = x, c.y = y;

    nested_buffers buf;
    if (n == 2 && planes[0].bits == 4 && planes[1].bits == 4 && planes[0].dtype == planes[1].dtype)
        c.rows4 = kern->pair4[planes[0].dtype];
    else if (n == 1 && planes[0].bits == 4)
        c.rows4 = kern->one4[planes[0].dtype];
    rc = build_buffers(&c, intdot, any4, &buf);
    if (rc == GBX_OK)
        rc = gbx_nested_run(c.rows4 ? nested_rows4 : nested_rows, &c, out_features,
                            (size_t)in_features * (size_t)n * (size_t)m, nthreads, GBX_POOL_SPIN_NS);
    free_buffers(&buf);
    return rc;
}
