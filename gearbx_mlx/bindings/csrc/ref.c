/*
 * ref.c -- scalar oracles for every fast kernel (arch/x86, arch/arm).
 *
 * Plain loops in natural element order, kept forever: each fast kernel is
 * tested against these, and they define the rounding of the activation
 * quantizer that the SIMD quantizers must reproduce bit for bit.
 */
#include <math.h>
#include <stdlib.h>

#include "internal.h" /* gbx_scale_at, gbx_code_at: plain scalar helpers */

static int effective_group(int in_features, int group_size)
{
    return group_size > 0 ? group_size : in_features;
}

/* Round half to even (the default FP environment), clamp to +-127.
 * NaN maps to 0 so that no float-to-int conversion is undefined. */
static int8_t quantize_one(float v)
{
    float r = nearbyintf(v);
    if (!(r == r))
        return 0;
    if (r > 127.0f)
        r = 127.0f;
    if (r < -127.0f)
        r = -127.0f;
    return (int8_t)r;
}

void gbx_quantize_act_ref(const float *x, int n, int8_t *qs, float *d, int32_t *sum)
{
    for (int b = 0, j0 = 0; j0 < n; ++b, j0 += GBX_QK) {
        const int j1 = j0 + GBX_QK < n ? j0 + GBX_QK : n;
        float amax = 0.0f;
        for (int j = j0; j < j1; ++j) {
            const float a = fabsf(x[j]);
            amax = a > amax ? a : amax;
        }
        /* The SIMD quantizers compute d and id with these same two scalar
         * operations, so all of them agree exactly. */
        const float db = amax / 127.0f;
        const float id = db != 0.0f ? 1.0f / db : 0.0f;
        int32_t s = 0;
        for (int j = j0; j < j1; ++j) {
            qs[j] = quantize_one(x[j] * id);
            s += qs[j];
        }
        d[b] = db;
        sum[b] = s;
    }
}

static int weight_at(const void *w, size_t row_elems, int bits, int i, int j)
{
    if (bits == 8)
        return ((const int8_t *)w)[(size_t)i * row_elems + (size_t)j];
    const uint8_t b = ((const uint8_t *)w)[(size_t)i * (row_elems / 2) + (size_t)(j >> 1)];
    return (j & 1) ? GBX_INT4_HI(b) : GBX_INT4_LO(b);
}

void gbx_gemv_float_ref(const void *w, const float *scales, const float *x, float *y,
                        int out_features, int in_features, int bits, int group_size)
{
    const int gs = effective_group(in_features, group_size);
    const int ng = in_features / gs;
    for (int i = 0; i < out_features; ++i) {
        float acc = 0.0f;
        for (int g = 0; g < ng; ++g) {
            float ag = 0.0f;
            for (int j = g * gs; j < (g + 1) * gs; ++j)
                ag += (float)weight_at(w, (size_t)in_features, bits, i, j) * x[j];
            acc += scales[(size_t)i * ng + g] * ag;
        }
        y[i] = acc;
    }
}

int gbx_gemv_intdot_ref(const void *w, const float *scales, const float *x, float *y,
                        int out_features, int in_features, int bits, int group_size)
{
    const int gs = effective_group(in_features, group_size);
    const int ng = in_features / gs;
    const int nb = (in_features + GBX_QK - 1) / GBX_QK;
    int8_t *qs = malloc((size_t)in_features);
    float *d = malloc(sizeof(float) * (size_t)nb);
    int32_t *sum = malloc(sizeof(int32_t) * (size_t)nb);
    if (!qs || !d || !sum) {
        free(qs), free(d), free(sum);
        return GBX_E_NOMEM;
    }
    gbx_quantize_act_ref(x, in_features, qs, d, sum);
    for (int i = 0; i < out_features; ++i) {
        float acc = 0.0f;
        for (int g = 0; g < ng; ++g) {
            float ag = 0.0f;
            /* a group is whole blocks, except per row where the last block
             * may be partial */
            for (int j0 = g * gs; j0 < (g + 1) * gs; j0 += GBX_QK) {
                const int j1 = j0 + GBX_QK < (g + 1) * gs ? j0 + GBX_QK : (g + 1) * gs;
                int32_t isum = 0;
                for (int j = j0; j < j1; ++j)
                    isum += weight_at(w, (size_t)in_features, bits, i, j) * qs[j];
                ag += d[j0 / GBX_QK] * (float)isum;
            }
            acc += scales[(size_t)i * ng + g] * ag;
        }
        y[i] = acc;
    }
    free(qs), free(d), free(sum);
    return GBX_OK;
}

/* ---- nested planes ------------------------------------------------------ */

/* The sum of x over each group of gs inputs, in natural order (every nested
 * path takes the bias term from these same sums). */
void gbx_nested_group_sums(const float *x, int in_features, int gs, float *xs)
{
    for (int g = 0; g < in_features / gs; ++g) {
        float t = 0.0f;
        for (int j = g * gs; j < (g + 1) * gs; ++j)
            t += x[j];
        xs[g] = t;
    }
}

/* The group sums of int8 activations, sum_{b in g} d_b * sum_b in block order:
 * the intdot paths' bias term sees the x their codes see. */
void gbx_nested_group_sums_q8(const float *d, const int32_t *sum, int in_features, int gs, float *xs)
{
    const int bpg = gs / GBX_QK;
    for (int g = 0; g < in_features / gs; ++g) {
        float t = 0.0f;
        for (int b = g * bpg; b < (g + 1) * bpg; ++b)
            t += d[b] * (float)sum[b];
        xs[g] = t;
    }
}

/* One plane's part of y[i]: sum_g s_g * dot_g + b_g * xs_g, dot_g from `dots`. */
static float plane_row(const gbx_plane *p, int i, int ng, const float *dots, const float *xs)
{
    float acc = 0.0f;
    for (int g = 0; g < ng; ++g) {
        const size_t at = (size_t)i * ng + (size_t)g;
        acc += gbx_scale_at(p->scales, at, p->dtype) * dots[g] + gbx_scale_at(p->biases, at, p->dtype) * xs[g];
    }
    return acc;
}

int gbx_nested_float_ref(const gbx_plane *planes, int n, const float *x, float *y, int m,
                         int out_features, int in_features)
{
    /* sized for the smallest group a plane may have */
    const int ngmax = in_features / GBX_GROUP_MIN;
    float *xs = malloc(sizeof(float) * (size_t)ngmax), *dots = malloc(sizeof(float) * (size_t)ngmax);
    if (!xs || !dots) {
        free(xs), free(dots);
        return GBX_E_NOMEM;
    }
    for (int k = 0; k < m; ++k) {
        const float *xk = x + (size_t)k * in_features;
        for (int i = 0; i < out_features; ++i) {
            float acc = 0.0f;
            for (int pi = 0; pi < n; ++pi) {
                const gbx_plane *p = planes + pi;
                const int gs = p->group_size, ng = in_features / gs;
                const uint8_t *row = (const uint8_t *)p->codes + (size_t)i * in_features * p->bits / 8;
                gbx_nested_group_sums(xk, in_features, gs, xs);
                for (int g = 0; g < ng; ++g) {
                    float t = 0.0f;
                    for (int j = g * gs; j < (g + 1) * gs; ++j)
                        t += (float)gbx_code_at(row, p->bits, j) * xk[j];
                    dots[g] = t;
                }
                acc += p->factor * plane_row(p, i, ng, dots, xs);
            }
            y[(size_t)k * out_features + i] = acc;
        }
    }
    free(xs), free(dots);
    return GBX_OK;
}

int gbx_nested_intdot_ref(const gbx_plane *planes, int n, const float *x, float *y, int m,
                          int out_features, int in_features)
{
    const int ngmax = in_features / GBX_GROUP_MIN, nb = in_features / GBX_QK;
    float *xs = malloc(sizeof(float) * (size_t)ngmax), *dots = malloc(sizeof(float) * (size_t)ngmax);
    int8_t *qs = malloc((size_t)in_features);
    float *d = malloc(sizeof(float) * (size_t)nb);
    int32_t *sum = malloc(sizeof(int32_t) * (size_t)nb);
    if (!xs || !dots || !qs || !d || !sum) {
        free(xs), free(dots), free(qs), free(d), free(sum);
        return GBX_E_NOMEM;
    }
    for (int k = 0; k < m; ++k) {
        const float *xk = x + (size_t)k * in_features;
        gbx_quantize_act_ref(xk, in_features, qs, d, sum);
        for (int i = 0; i < out_features; ++i) {
            float acc = 0.0f;
            for (int pi = 0; pi < n; ++pi) {
                const gbx_plane *p = planes + pi;
                const int gs = p->group_size, ng = in_features / gs;
                const uint8_t *row = (const uint8_t *)p->codes + (size_t)i * in_features * p->bits / 8;
                gbx_nested_group_sums_q8(d, sum, in_features, gs, xs);
                for (int g = 0; g < ng; ++g) {
                    float t = 0.0f;
                    for (int b = g * gs / GBX_QK; b < (g + 1) * gs / GBX_QK; ++b) {
                        int32_t isum = 0; /* exact: |code * xq| <= 255 * 127 */
                        for (int j = b * GBX_QK; j < (b + 1) * GBX_QK; ++j)
                            isum += gbx_code_at(row, p->bits, j) * qs[j];
                        t += d[b] * (float)isum;
                    }
                    dots[g] = t;
                }
                acc += p->factor * plane_row(p, i, ng, dots, xs);
            }
            y[(size_t)k * out_features + i] = acc;
        }
    }
    free(xs), free(dots), free(qs), free(d), free(sum);
    return GBX_OK;
}
