/*
 * test_main.c -- self-check of every fast kernel against the scalar oracles.
 *
 * Built natively or cross-compiled and run under qemu-aarch64 by
 * tests/test_neon_qemu.py.  Prints "isa float=... intdot=..." then either
 * "OK <n> checks" (exit 0) or "MISMATCH ..." lines (exit 1).
 *
 * Two kinds of data:
 *   exact   integer weights and activations with max|x| = 127 in every
 *           block (so d_b = 1) and power-of-two scales: every partial sum is
 *           an integer below 2^24, so all paths must agree bit for bit
 *           whatever their summation order.  A nibble-order bug fails here.
 *   random  float activations with outliers; fast vs oracle within a
 *           relative tolerance of the sum of |terms|.
 * gbx_nested_unpack is checked bit for bit on the planes of every nested
 * case (a fused multiply-add in it would fail there).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "internal.h" /* gbx_scale_at: the scalar dtype conversions */

static unsigned long long g_rng = 0x9E3779B97F4A7C15ull;
static unsigned rnd(void)
{
    g_rng ^= g_rng << 13, g_rng ^= g_rng >> 7, g_rng ^= g_rng << 17;
    return (unsigned)(g_rng >> 32);
}
static int rnd_int(int lo, int hi) { return lo + (int)(rnd() % (unsigned)(hi - lo + 1)); }
static float rnd_unit(void) { return (float)((rnd() >> 8) * (1.0 / 16777216.0)) * 2.0f - 1.0f; }

static int g_checks, g_fail;

/* failures per (check name, bits), printed at the end */
#define MAX_KINDS 32
static struct {
    const char *what;
    int bits, count;
} g_kinds[MAX_KINDS];

static void count_kind(const char *what, int bits)
{
    for (int k = 0; k < MAX_KINDS; ++k) {
        if (!g_kinds[k].what) {
            g_kinds[k].what = what, g_kinds[k].bits = bits;
        }
        if (g_kinds[k].bits == bits && strcmp(g_kinds[k].what, what) == 0) {
            ++g_kinds[k].count;
            return;
        }
    }
}

static void report(const char *what, int bits, int O, int I, int gs, int th, int row, double got, double want)
{
    ++g_fail;
    count_kind(what, bits);
    if (g_fail <= 20)
        printf("MISMATCH %s bits=%d O=%d I=%d gs=%d threads=%d row=%d got=%.9g want=%.9g\n", what, bits, O, I, gs,
               th, row, got, want);
}

/* q: (O, I) ints in [-qmax, qmax] -> packed storage of the header */
static void pack(const int *q, int O, int I, int bits, void *w)
{
    for (int i = 0; i < O; ++i)
        for (int j = 0; j < I; ++j) {
            const int v = q[(size_t)i * I + j];
            if (bits == 8) {
                ((int8_t *)w)[(size_t)i * I + j] = (int8_t)v;
            } else {
                uint8_t *b = (uint8_t *)w + (size_t)i * (I / 2) + j / 2;
                const uint8_t u = (uint8_t)(v + GBX_INT4_OFFSET);
                *b = (j & 1) ? (uint8_t)((*b & 0x0F) | (u << 4)) : (uint8_t)((*b & 0xF0) | u);
            }
        }
}

static void check_case(int bits, int O, int I, int gs, int exact)
{
    const int qmax = bits == 8 ? GBX_QMAX_INT8 : GBX_QMAX_INT4;
    const int ng = gs ? I / gs : 1;
    int *q = malloc(sizeof(int) * (size_t)O * I);
    void *w = calloc((size_t)O * I, 1);
    float *s = malloc(sizeof(float) * (size_t)O * ng);
    float *x = malloc(sizeof(float) * (size_t)I);
    float *yr = malloc(sizeof(float) * (size_t)O), *yir = malloc(sizeof(float) * (size_t)O);
    float *y = malloc(sizeof(float) * (size_t)O), *y1 = malloc(sizeof(float) * (size_t)O);
    double *absf = calloc((size_t)O, sizeof(double)), *absi = calloc((size_t)O, sizeof(double));

    for (size_t k = 0; k < (size_t)O * I; ++k)
        q[k] = rnd_int(-qmax, qmax);
    for (size_t k = 0; k < (size_t)O * ng; ++k)
        s[k] = exact ? (float)(1 << rnd_int(0, 1)) : 0.001f + 0.01f * (rnd_unit() + 1.0f);
    for (int j = 0; j < I; ++j) {
        if (exact)
            x[j] = (j % GBX_QK == 0) ? (rnd() & 1 ? 127.0f : -127.0f) : (float)rnd_int(-20, 20);
        else
            x[j] = rnd_unit() * (rnd() % 97 == 0 ? 30.0f : 1.0f); /* a few outliers */
    }
    pack(q, O, I, bits, w);

    /* sum of |terms| per row, for the random-data tolerances */
    int8_t *xq = malloc((size_t)I);
    float *d = malloc(sizeof(float) * (size_t)(I / GBX_QK + 1));
    int32_t *sm = malloc(sizeof(int32_t) * (size_t)(I / GBX_QK + 1));
    gbx_quantize_act_ref(x, I, xq, d, sm);
    for (int i = 0; i < O; ++i)
        for (int j = 0; j < I; ++j) {
            const double sq = fabs((double)s[(size_t)i * ng + (gs ? j / gs : 0)] * q[(size_t)i * I + j]);
            absf[i] += sq * fabs(x[j]);
            absi[i] += sq * fabs((double)d[j / GBX_QK] * xq[j]);
        }

    if (gbx_gemv(w, s, x, yr, O, I, bits, gs, GBX_PATH_REF, 1) != GBX_OK ||
        gbx_gemv(w, s, x, yir, O, I, bits, gs, GBX_PATH_INTDOT_REF, 1) != GBX_OK) {
        report("ref-call-failed", bits, O, I, gs, 1, -1, 0, 0);
        goto done;
    }
    for (int i = 0; exact && i < O; ++i, ++g_checks)
        if (yr[i] != yir[i])
            report("exact-ref-vs-intdot-ref", bits, O, I, gs, 1, i, yir[i], yr[i]);

    const int paths[2] = {GBX_PATH_FLOAT, GBX_PATH_INTDOT};
    for (int pi = 0; pi < 2; ++pi) {
        const int path = paths[pi];
        const float *want = path == GBX_PATH_FLOAT ? yr : yir;
        const double *sabs = path == GBX_PATH_FLOAT ? absf : absi;
        for (int th = 1; th <= 3; ++th) {
            for (int i = 0; i < O; ++i) /* a row the call skips must not pass on an earlier result */
                y[i] = -1e30f;
            if (gbx_gemv(w, s, x, y, O, I, bits, gs, path, th) != GBX_OK) {
                report("call-failed", bits, O, I, gs, th, -1, 0, 0);
                continue;
            }
            const char *name = path == GBX_PATH_FLOAT ? "float" : "intdot";
            for (int i = 0; i < O; ++i, ++g_checks) {
                const double err = fabs((double)y[i] - want[i]);
                if (exact ? y[i] != want[i] : err > 2e-5 * sabs[i] + 1e-30)
                    report(name, bits, O, I, gs, th, i, y[i], want[i]);
            }
            if (th == 1)
                memcpy(y1, y, sizeof(float) * (size_t)O);
            else
                for (int i = 0; i < O; ++i, ++g_checks)
                    if (y[i] != y1[i]) /* rows are computed alike on any thread */
                        report("thread-invariance", bits, O, I, gs, th, i, y[i], y1[i]);
        }
    }
done:
    free(q), free(w), free(s), free(x), free(yr), free(yir), free(y), free(y1), free(absf), free(absi);
    free(xq), free(d), free(sm);
}

static void check_quantizer(int n)
{
    float *x = malloc(sizeof(float) * (size_t)n);
    int8_t *q0 = malloc((size_t)n), *q1 = malloc((size_t)n);
    const int nb = (n + GBX_QK - 1) / GBX_QK;
    float *d0 = malloc(sizeof(float) * nb), *d1 = malloc(sizeof(float) * nb);
    int32_t *s0 = malloc(sizeof(int32_t) * nb), *s1 = malloc(sizeof(int32_t) * nb);
    for (int j = 0; j < n; ++j) {
        const int b = j / GBX_QK;
        if (b % 3 == 0) /* ties: d = 1 and halves exercise round-half-even */
            x[j] = (j % GBX_QK == 0) ? 127.0f : (float)rnd_int(-126, 126) + 0.5f;
        else if (b % 3 == 1)
            x[j] = 0.0f; /* all-zero block: d = 0, q = 0 */
        else
            x[j] = rnd_unit() * 3.0f;
    }
    gbx_quantize_act_ref(x, n, q0, d0, s0);
    gbx_quantize_act(x, n, q1, d1, s1);
    for (int j = 0; j < n; ++j, ++g_checks)
        if (q0[j] != q1[j])
            report("quantize-q", 0, 1, n, 0, 1, j, q1[j], q0[j]);
    for (int b = 0; b < nb; ++b, g_checks += 2) {
        if (d0[b] != d1[b])
            report("quantize-d", 0, 1, n, 0, 1, b, d1[b], d0[b]);
        if (s0[b] != s1[b])
            report("quantize-sum", 0, 1, n, 0, 1, b, s1[b], s0[b]);
    }
    free(x), free(q0), free(q1), free(d0), free(d1), free(s0), free(s1);
}

/* ---- nested planes ------------------------------------------------------ */

/* float -> float16 bits, round toward zero, normal range (test data only:
 * every kernel reads the same bits, whatever value they hold). */
static uint16_t to_f16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t sign = (u >> 16) & 0x8000u;
    int e = (int)((u >> 23) & 0xFF) - 127 + 15;
    if (e <= 0)
        return (uint16_t)sign;
    if (e >= 31)
        e = 30;
    return (uint16_t)(sign | ((uint32_t)e << 10) | ((u >> 13) & 0x3FFu));
}

static void store_scale(void *p, size_t i, int dtype, float v)
{
    if (dtype == GBX_DTYPE_F32) {
        ((float *)p)[i] = v;
    } else if (dtype == GBX_DTYPE_F16) {
        ((uint16_t *)p)[i] = to_f16(v);
    } else {
        uint32_t u;
        memcpy(&u, &v, 4);
        ((uint16_t *)p)[i] = (uint16_t)(u >> 16);
    }
}

/* |terms| of one output: sum over planes, groups and inputs of
 * |f s q x| + |f b xsum|, with x as given (float or dequantized int8). */
static double nested_abs_row(const gbx_plane *pl, int n, int i, const float *x, int I)
{
    double t = 0.0;
    for (int p = 0; p < n; ++p) {
        const int gs = pl[p].group_size, ng = I / gs;
        const uint8_t *row = (const uint8_t *)pl[p].codes + (size_t)i * I * pl[p].bits / 8;
        for (int g = 0; g < ng; ++g) {
            const size_t at = (size_t)i * ng + g;
            double dq = 0.0, xs = 0.0;
            for (int j = g * gs; j < (g + 1) * gs; ++j) {
                const int q = gbx_code_at(row, pl[p].bits, j);
                dq += fabs((double)q * x[j]);
                xs += x[j];
            }
            t += fabs(pl[p].factor) * (fabs(gbx_scale_at(pl[p].scales, at, pl[p].dtype)) * dq +
                                       fabs(gbx_scale_at(pl[p].biases, at, pl[p].dtype) * xs));
        }
    }
    return t;
}

/* gbx_nested_unpack against the sum written out here, bit for bit: per code
 * a rounded product q * (s * f) and a rounded sum with b * f (the volatile
 * keeps this compiler from fusing them where the target has FMA), the planes
 * added in order; on 1 and 3 threads, whole and for a block of rows. */
static void check_unpack(const gbx_plane *pl, int n, int O, int I, int label)
{
    float *want = malloc(sizeof(float) * (size_t)O * I), *got = malloc(sizeof(float) * (size_t)O * I);
    for (int i = 0; i < O; ++i)
        for (int p = 0; p < n; ++p) {
            const int gs = pl[p].group_size, ng = I / gs;
            const uint8_t *row = (const uint8_t *)pl[p].codes + (size_t)i * I * pl[p].bits / 8;
            for (int j = 0; j < I; ++j) {
                const size_t at = (size_t)i * ng + (size_t)(j / gs);
                const float s = gbx_scale_at(pl[p].scales, at, pl[p].dtype) * pl[p].factor;
                const float b = gbx_scale_at(pl[p].biases, at, pl[p].dtype) * pl[p].factor;
                volatile float t = (float)gbx_code_at(row, pl[p].bits, j) * s;
                const float v = t + b;
                float *w = want + (size_t)i * I + j;
                *w = p == 0 ? v : *w + v;
            }
        }
    const int r0 = O / 3, r1 = O - O / 4;
    for (int th = 1; th <= 3; th += 2) {
        memset(got, 0xFF, sizeof(float) * (size_t)O * I);
        if (gbx_nested_unpack(pl, n, got, 0, O, O, I, th) != GBX_OK ||
            gbx_nested_unpack(pl, n, got + (size_t)O * I - (size_t)(r1 - r0) * I, r0, r1, O, I, th) != GBX_OK) {
            report("nested-unpack-call-failed", label, O, I, pl[0].group_size, th, -1, 0, 0);
            continue;
        }
        /* the block overwrote the last r1 - r0 rows: check them against rows r0..r1 */
        for (size_t k = 0; k < (size_t)O * I; ++k, ++g_checks) {
            const size_t tail = (size_t)O * I - (size_t)(r1 - r0) * I;
            const float w = k < tail ? want[k] : want[(size_t)r0 * I + (k - tail)];
            if (memcmp(&got[k], &w, sizeof w) != 0)
                report("nested-unpack", label, O, I, pl[0].group_size, th, (int)(k / I), got[k], w);
        }
    }
    free(want), free(got);
}

/* A gear of two 4-bit planes of one scale dtype takes the pair kernel where the
 * family has one (x86): `got` (its intdot output on one thread) must be each
 * plane's own kernel (a call of that plane alone, factor 1) summed as
 * nested_rows sums them: bit for bit on exact data, else within the intdot
 * tolerance of the row's magnitudes `sabs` (the pair kernel sums a plane's
 * bias term into its lanes before the horizontal sum, the plane's kernel
 * after it).  x86 only: elsewhere the compiler may fuse nested_rows'
 * multiply-adds, which this sum does not. */
static void check_pair(const gbx_plane *pl, int n, const float *x, const float *got, int m, int O, int I, int label,
                       int exact, const double *sabs)
{
    if (!GBX_X86 || n != 2 || pl[0].bits != 4 || pl[1].bits != 4 || pl[0].dtype != pl[1].dtype)
        return;
    gbx_plane one[2] = {pl[0], pl[1]};
    one[0].factor = one[1].factor = 1.0f;
    float *y0 = malloc(sizeof(float) * (size_t)m * O), *y1 = malloc(sizeof(float) * (size_t)m * O);
    if (gbx_nested_gemv(one, 1, x, y0, m, O, I, GBX_PATH_INTDOT, 1) != GBX_OK ||
        gbx_nested_gemv(one + 1, 1, x, y1, m, O, I, GBX_PATH_INTDOT, 1) != GBX_OK)
        report("nested-pair-call-failed", label, O, I, pl[0].group_size, 1, -1, 0, 0);
    else
        for (size_t i = 0; i < (size_t)m * O; ++i, ++g_checks) {
            volatile float t0 = pl[0].factor * y0[i], t1 = pl[1].factor * y1[i];
            float acc = 0.0f;
            acc += t0;
            acc += t1;
            if (exact ? memcmp(&acc, &got[i], sizeof acc) != 0 : fabs((double)got[i] - acc) > 2e-5 * sabs[i] + 1e-30)
                report("nested-pair", label, O, I, pl[0].group_size, 1, (int)i, got[i], acc);
        }
    free(y0), free(y1);
}

/* One nested case: plan bits[0..n) with group sizes gss, scale dtypes, m activation rows.  Exact
 * data: integer x with max |x| = 127 per block (d_b = 1), power-of-two
 * scales and factors, small integer biases, and every partial sum an integer
 * below 2^24: all paths must then agree bit for bit. */
static void check_nested_case(const int *bits, const int *gss, const int *dtypes, int n, int O, int I, int m,
                              int exact)
{
    gbx_plane pl[GBX_MAX_PLANES];
    const int gs = gss[0]; /* reported */
    int label = 8; /* SUMMARY bits: 6 if any plane has 6 bits, else 4 if any has nibbles */
    for (int p = 0; p < n; ++p) {
        const int ng = I / gss[p];
        const size_t row_bytes = (size_t)I * bits[p] / 8, es = dtypes[p] == GBX_DTYPE_F32 ? 4 : 2;
        uint32_t *codes = malloc(row_bytes * O + 4);
        void *sc = malloc(es * O * ng), *bi = malloc(es * O * ng);
        for (size_t b = 0; b < row_bytes * O; ++b)
            ((uint8_t *)codes)[b] = (uint8_t)rnd();
        for (size_t k = 0; k < (size_t)O * ng; ++k) {
            store_scale(sc, k, dtypes[p], exact ? (float)(1 << rnd_int(0, 1)) * (rnd() & 1 ? 1.0f : 0.5f)
                                                : 0.001f + 0.01f * (rnd_unit() + 1.0f));
            store_scale(bi, k, dtypes[p], exact ? (float)rnd_int(-3, 3) : 0.05f * rnd_unit());
        }
        pl[p].codes = codes, pl[p].scales = sc, pl[p].biases = bi;
        pl[p].bits = bits[p], pl[p].group_size = gss[p], pl[p].dtype = dtypes[p];
        pl[p].factor = p == 0 ? 1.0f : (exact ? 0.5f : 1.0f / (float)(16 << (4 * p)));
        if (bits[p] == 6 || (bits[p] == 4 && label != 6))
            label = bits[p];
    }
    check_unpack(pl, n, O, I, label);
    float *x = malloc(sizeof(float) * (size_t)m * I);
    for (int j = 0; j < m * I; ++j) {
        if (exact)
            x[j] = (j % GBX_QK == 0) ? (rnd() & 1 ? 127.0f : -127.0f) : (float)rnd_int(-20, 20);
        else
            x[j] = rnd_unit() * (rnd() % 97 == 0 ? 30.0f : 1.0f);
    }
    const size_t ny = (size_t)m * O;
    float *yr = malloc(sizeof(float) * ny), *yir = malloc(sizeof(float) * ny);
    float *y = malloc(sizeof(float) * ny), *y1 = malloc(sizeof(float) * ny);
    double *absf = calloc(ny, sizeof(double)), *absi = calloc(ny, sizeof(double));
    float *xd = malloc(sizeof(float) * (size_t)I);
    int8_t *xq = malloc((size_t)I);
    float *d = malloc(sizeof(float) * (size_t)(I / GBX_QK));
    int32_t *sm = malloc(sizeof(int32_t) * (size_t)(I / GBX_QK));
    int exact_ok = exact;
    for (int k = 0; k < m; ++k) {
        gbx_quantize_act_ref(x + (size_t)k * I, I, xq, d, sm);
        for (int j = 0; j < I; ++j)
            xd[j] = d[j / GBX_QK] * xq[j];
        for (int i = 0; i < O; ++i) {
            absf[(size_t)k * O + i] = nested_abs_row(pl, n, i, x + (size_t)k * I, I);
            absi[(size_t)k * O + i] = nested_abs_row(pl, n, i, xd, I);
            if (absf[(size_t)k * O + i] >= 8388608.0)
                exact_ok = 0;
        }
    }
    if (exact && !exact_ok)
        goto done; /* sums too large to be exact: the random cases cover this size */
    if (gbx_nested_gemv(pl, n, x, yr, m, O, I, GBX_PATH_REF, 1) != GBX_OK ||
        gbx_nested_gemv(pl, n, x, yir, m, O, I, GBX_PATH_INTDOT_REF, 1) != GBX_OK) {
        report("nested-ref-call-failed", label, O, I, gs, 1, -1, 0, 0);
        goto done;
    }
    for (size_t i = 0; exact && i < ny; ++i, ++g_checks)
        if (yr[i] != yir[i])
            report("nested-exact-ref-vs-intdot-ref", label, O, I, gs, 1, (int)i, yir[i], yr[i]);
    static const int paths[3] = {GBX_PATH_AUTO, GBX_PATH_FLOAT, GBX_PATH_INTDOT};
    for (int pi = 0; pi < 3; ++pi) {
        const int path = paths[pi];
        const float *want = path == GBX_PATH_INTDOT ? yir : yr; /* AUTO is the float path */
        const double *sabs = path == GBX_PATH_INTDOT ? absi : absf;
        const char *name = path == GBX_PATH_INTDOT ? "nested-intdot" : "nested-float";
        for (int th = 1; th <= 3; ++th) {
            for (size_t i = 0; i < ny; ++i)
                y[i] = -1e30f;
            if (gbx_nested_gemv(pl, n, x, y, m, O, I, path, th) != GBX_OK) {
                report("nested-call-failed", label, O, I, gs, th, -1, 0, 0);
                continue;
            }
            for (size_t i = 0; i < ny; ++i, ++g_checks) {
                const double err = fabs((double)y[i] - want[i]);
                if (exact ? y[i] != want[i] : err > 2e-5 * sabs[i] + 1e-30)
                    report(name, label, O, I, gs, th, (int)i, y[i], want[i]);
            }
            if (th == 1)
                memcpy(y1, y, sizeof(float) * ny);
            else
                for (size_t i = 0; i < ny; ++i, ++g_checks)
                    if (y[i] != y1[i])
                        report("nested-thread-invariance", label, O, I, gs, th, (int)i, y[i], y1[i]);
        }
    }
    check_pair(pl, n, x, y1, m, O, I, label, exact, absi);
done:
    for (int p = 0; p < n; ++p)
        free((void *)pl[p].codes), free((void *)pl[p].scales), free((void *)pl[p].biases);
    free(x), free(yr), free(yir), free(y), free(y1), free(absf), free(absi), free(xd), free(xq), free(d), free(sm);
}

/* Every plan of the nested gears (and single planes: plain MLX 4/8-bit
 * layers), each dtype, per-plane group sizes, odd shapes, one and several
 * activation rows.  A plan: n, then (bits, group offset) per plane, the group
 * of plane p being gss[(g + offset) % 3] for the case's base group g. */
static void check_nested(int quick)
{
    static const int plans[][1 + 2 * GBX_MAX_PLANES] = {
        {1, 4, 0}, {1, 8, 0}, {1, 6, 0}, {2, 4, 0, 4, 0}, {3, 4, 0, 4, 2, 4, 2}, {3, 4, 0, 4, 0, 8, 0},
        {3, 4, 1, 4, 0, 6, 1}, {2, 8, 0, 4, 1}, {3, 8, 1, 4, 2, 4, 0}, {2, 6, 2, 8, 0}};
    static const int Is[] = {128, 384, 640, 1152, 4096};
    static const int Os[] = {1, 3, 17};
    static const int gss[] = {32, 64, 128};
    const int nI = (int)(sizeof Is / sizeof Is[0]) - (quick ? 1 : 0);
    for (size_t pl = 0; pl < sizeof plans / sizeof plans[0]; ++pl)
        for (int a = 0; a < nI; ++a)
            for (int g = 0; g < 3; ++g) {
                const int I = Is[a], n = plans[pl][0];
                int bits[GBX_MAX_PLANES], groups[GBX_MAX_PLANES], dtypes[GBX_MAX_PLANES], ok = 1;
                for (int p = 0; p < n; ++p) {
                    bits[p] = plans[pl][1 + 2 * p];
                    groups[p] = gss[(g + plans[pl][2 + 2 * p]) % 3];
                    dtypes[p] = rnd_int(0, 2);
                    ok &= I % groups[p] == 0;
                }
                if (!ok)
                    continue;
                const int O = Os[(a + g) % 3], m = (a + (int)pl) % 3 == 0 ? 3 : 1;
                check_nested_case(bits, groups, dtypes, n, O, I, m, 1);
                check_nested_case(bits, groups, dtypes, n, O, I, m, 0);
            }
    /* smaller K, each group size alike (the 4-bit tails past the last span) */
    static const int small[] = {32, 64, 96, 192, 320};
    for (size_t a = 0; a < sizeof small / sizeof small[0]; ++a)
        for (int g = 0; g < 3; ++g) {
            if (small[a] % gss[g])
                continue;
            const int bits[3] = {4, 4, 8}, groups[3] = {gss[g], gss[g], gss[g]}, dtypes[3] = {2, 1, 0};
            check_nested_case(bits, groups, dtypes, 3, 5, small[a], 1 + (int)(a & 1), 1);
            check_nested_case(bits, groups, dtypes, 3, 5, small[a], 1 + (int)(a & 1), 0);
            const int bits6[3] = {6, 4, 6};
            check_nested_case(bits6, groups, dtypes, 3, 5, small[a], 1 + (int)(a & 1), 1);
            check_nested_case(bits6, groups, dtypes, 3, 5, small[a], 1 + (int)(a & 1), 0);
        }
    /* enough rows for the pool to split; each scale dtype on the default plan */
    for (int dt = 0; dt < 3; ++dt) {
        const int bits[3] = {4, 4, 6}, groups[3] = {64, 32, 64}, dtypes[3] = {dt, dt, dt};
        check_nested_case(bits, groups, dtypes, 3, 301, 512, 1, 1);
        check_nested_case(bits, groups, dtypes, 3, 300, 256, 2, 0);
    }
}

static int check_nested_errors(void)
{
    uint32_t codes[64] = {0};
    uint16_t s[8] = {0};
    float x[128] = {0}, y[4];
    gbx_plane p = {codes, s, s, 4, 64, GBX_DTYPE_F16, 1.0f};
    int bad = 0;
    bad += gbx_nested_gemv(&p, 1, x, y, 1, 1, 64, GBX_PATH_FLOAT, 1) != GBX_OK;
    bad += gbx_nested_gemv(&p, 0, x, y, 1, 1, 64, GBX_PATH_FLOAT, 1) != GBX_E_PLANES;
    bad += gbx_nested_gemv(&p, 1, x, y, 1, 1, 96, GBX_PATH_FLOAT, 1) != GBX_E_GROUP;
    bad += gbx_nested_gemv(&p, 1, x, y, 0, 1, 64, GBX_PATH_FLOAT, 1) != GBX_E_SHAPE;
    bad += gbx_nested_gemv(&p, 1, x, y, 1, 1, 64, 9, 1) != GBX_E_PATH;
    bad += gbx_nested_gemv(&p, 1, NULL, y, 1, 1, 64, GBX_PATH_FLOAT, 1) != GBX_E_NULL;
    p.group_size = 48;
    bad += gbx_nested_gemv(&p, 1, x, y, 1, 1, 96, GBX_PATH_FLOAT, 1) != GBX_E_GROUP;
    p.group_size = 64, p.bits = 3;
    bad += gbx_nested_gemv(&p, 1, x, y, 1, 1, 64, GBX_PATH_FLOAT, 1) != GBX_E_PLANES;
    p.bits = 4, p.dtype = 7;
    bad += gbx_nested_gemv(&p, 1, x, y, 1, 1, 64, GBX_PATH_FLOAT, 1) != GBX_E_PLANES;
    p.dtype = GBX_DTYPE_F16, p.factor = 1.0f / 0.0f;
    bad += gbx_nested_gemv(&p, 1, x, y, 1, 1, 64, GBX_PATH_FLOAT, 1) != GBX_E_PLANES;
    g_checks += 10;
    if (bad)
        report("nested-errors", 0, 1, 64, 64, 1, -1, bad, 0);
    return bad;
}

/* --pool-stress SECONDS: back-to-back small exact products of random shapes,
 * every one split across 1-3 threads, so consecutive jobs have different
 * chunk counts.  Meant for a -DGEARBX_STRESS_POOL build, which stalls threads
 * inside the pool's hand-off windows (a job returning before all its chunks
 * are done shows up as a mismatch, or a crash under -fsanitize=address). */
static int pool_stress(double seconds)
{
    static const int gss[] = {0, 32, 64, 128};
    struct timespec t0, t;
    long cases = 0;
    gbx_set_min_work(1);
    clock_gettime(CLOCK_MONOTONIC, &t0);
    do {
        const int bits = rnd_int(0, 1) ? 4 : 8, O = rnd_int(1, 40), I = 2 * rnd_int(1, 160);
        const int gs = gss[rnd_int(0, 3)];
        check_case(bits, O, I, gs && I % gs == 0 ? gs : 0, 1);
        ++cases;
        clock_gettime(CLOCK_MONOTONIC, &t);
    } while (!g_fail && (double)(t.tv_sec - t0.tv_sec) + 1e-9 * (double)(t.tv_nsec - t0.tv_nsec) < seconds);
    gbx_set_min_work(0);
    if (g_fail) {
        printf("FAILED pool stress: %d of %d checks (%ld cases)\n", g_fail, g_checks, cases);
        return 1;
    }
    printf("OK %d checks (pool stress, %ld cases)\n", g_checks, cases);
    return 0;
}

int main(int argc, char **argv)
{
    const int quick = argc > 1 && strcmp(argv[1], "--quick") == 0;
    gbx_info_t info;
    gbx_get_info(&info);
    printf("isa float=%s intdot=%s dotprod_compiled=%d dotprod_cpu=%d avx2_cpu=%d nested_float=%s "
           "nested_intdot=%s\n",
           info.float_isa, info.intdot_isa, info.compiled_dotprod, info.cpu_dotprod, info.cpu_avx2,
           info.nested_float_isa, info.nested_intdot_isa);
    if (argc > 2 && strcmp(argv[1], "--pool-stress") == 0)
        return pool_stress(atof(argv[2]));

    static const int Is[] = {2, 30, 32, 34, 62, 64, 66, 96, 100, 128, 192, 256, 320, 1000, 4096};
    static const int Os[] = {1, 3, 17};
    static const int gss[] = {0, 32, 64, 128};
    const int nI = (int)(sizeof Is / sizeof Is[0]) - (quick ? 1 : 0);
    /* pass 0: default thread split; pass 1: every product split across
     * threads, even a 1x2 one; passes 2-3: the lesser x86 intdot kernels
     * (plain AVX2, AVX-VNNI) where the CPU would pick better ones */
    for (int pass = 0; pass < 4; ++pass) {
        gbx_set_min_work(pass ? 1 : 0);
        gbx_set_isa_limit(pass >= 2 ? pass - 1 : 0);
        for (int bits = 4; bits <= 8; bits += 4)
            for (int a = 0; a < nI; ++a)
                for (int o = 0; o < 3; ++o)
                    for (int g = 0; g < 4; ++g) {
                        const int I = Is[a], gs = gss[g];
                        if (gs && I % gs)
                            continue;
                        /* exact mode needs every partial sum below 2^24 */
                        const int exact_ok = (double)(bits == 8 ? 127 * 127 : 7 * 127) * I * 2 < 16777216.0;
                        if (exact_ok)
                            check_case(bits, Os[o], I, gs, 1);
                        check_case(bits, Os[o], I, gs, 0);
                    }
    }
    gbx_set_min_work(0);
    gbx_set_isa_limit(0);
    /* enough rows to make the pool split work across threads */
    check_case(4, 300, 512, 0, 1);
    check_case(4, 301, 512, 64, 0);
    check_case(8, 300, 256, 32, 0);
    for (int n = 1; n <= 200; n += 13)
        check_quantizer(n);
    check_quantizer(4096 + 7);
    /* nested planes: the default split, every product split, the lesser x86 kernels */
    for (int pass = 0; pass < 4; ++pass) {
        gbx_set_min_work(pass ? 1 : 0);
        gbx_set_isa_limit(pass >= 2 ? pass - 1 : 0);
        check_nested(quick);
    }
    gbx_set_min_work(0);
    gbx_set_isa_limit(0);
    check_nested_errors();

    if (g_fail) {
        for (int k = 0; k < MAX_KINDS && g_kinds[k].what; ++k)
            printf("SUMMARY %s bits=%d failures=%d\n", g_kinds[k].what, g_kinds[k].bits, g_kinds[k].count);
        printf("FAILED %d of %d checks\n", g_fail, g_checks);
        return 1;
    }
    printf("OK %d checks\n", g_checks);
    return 0;
}
