/*
 * test_sparse_main.c -- self-test driver of the block-sparse kernels
 * (sparse.c): every fast path against its scalar oracle, over shapes, group
 * sizes, scale dtypes, kept sets and thread counts; and gbx_top_blocks
 * against a brute-force choice.  Prints the kernels' ISA line, one MISMATCH
 * line per failure and "OK <n> cases" at the end (exit 1 on a mismatch).
 * Built with the library's sources (gearbx_mlx/bindings/build.py SOURCES) for
 * the host and, cross-compiled, under qemu-aarch64 (tests/test_sparse_cpu.py).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gearbx_sparse.h"

static uint32_t rng_state = 12345u;

static uint32_t rnd(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 17;
    rng_state ^= rng_state << 5;
    return rng_state;
}

static float rndf(void) { return (float)(rnd() & 0xFFFFFF) / (float)0x800000 - 1.0f; } /* [-1, 1) */

/* A scale or bias in `dtype`: float32, or float16 / bfloat16 bits of a value near v. */
static void put_scale(void *p, size_t i, int dtype, float v)
{
    if (dtype == GBX_DTYPE_F32) {
        ((float *)p)[i] = v;
        return;
    }
    uint32_t u;
    memcpy(&u, &v, 4);
    if (dtype == GBX_DTYPE_BF16) {
        ((uint16_t *)p)[i] = (uint16_t)(u >> 16);
        return;
    }
    /* float16 of |v| in [2^-6, 2): exponent rebased, mantissa truncated */
    const float a = fabsf(v) < 0.015625f ? 0.015625f : fabsf(v);
    memcpy(&u, &a, 4);
    const uint16_t h = (uint16_t)((((u >> 23) & 0xFF) - 112) << 10 | ((u >> 13) & 0x3FF));
    ((uint16_t *)p)[i] = (uint16_t)(h | (v < 0 ? 0x8000 : 0));
}

static int check_case(int O, int I, int gs, int dtype, int nkept, int threads, int *cases)
{
    const int ng = I / gs;
    uint32_t *codes = malloc(sizeof(uint32_t) * (size_t)O * I / 8);
    void *scales = malloc(4 * (size_t)O * ng), *biases = malloc(4 * (size_t)O * ng);
    float *x = malloc(sizeof(float) * I), *y = malloc(sizeof(float) * O), *want = malloc(sizeof(float) * O);
    int32_t *blocks = malloc(sizeof(int32_t) * (ng + 1));
    for (size_t i = 0; i < (size_t)O * I / 8; ++i)
        codes[i] = rnd();
    for (size_t i = 0; i < (size_t)O * ng; ++i) {
        put_scale(scales, i, dtype, 0.01f + 0.02f * fabsf(rndf()));
        put_scale(biases, i, dtype, 0.1f * rndf());
    }
    for (int j = 0; j < I; ++j)
        x[j] = rndf() * (1.0f + (float)(j % 7));
    /* nkept groups: every step-th, from a random start */
    int n = 0;
    for (int g = (int)(rnd() % (unsigned)ng); n < nkept && g < ng; g += 1 + (int)(rnd() % 3))
        blocks[n++] = g;
    gbx_plane p = {codes, scales, biases, 4, gs, dtype, 1.0f};
    int bad = 0;
    const int paths[2][2] = {{GBX_PATH_FLOAT, GBX_PATH_REF}, {GBX_PATH_INTDOT, GBX_PATH_INTDOT_REF}};
    for (int k = 0; k < 2; ++k) {
        int rc = gbx_sparse_gemv(&p, x, blocks, n, want, O, I, paths[k][1], 1);
        rc |= gbx_sparse_gemv(&p, x, blocks, n, y, O, I, paths[k][0], threads);
        float err = 0.0f, mag = 1e-6f;
        for (int r = 0; r < O; ++r) {
            err = fmaxf(err, fabsf(y[r] - want[r]));
            mag = fmaxf(mag, fabsf(want[r]));
        }
        ++*cases;
        if (rc != GBX_OK || !(err <= 1e-4f * mag)) {
            printf("MISMATCH path %d O=%d I=%d gs=%d dtype=%d kept=%d threads=%d rc=%d err=%g mag=%g\n",
                   paths[k][0], O, I, gs, dtype, n, threads, rc, (double)err, (double)mag);
            bad = 1;
        }
    }
    free(codes), free(scales), free(biases), free(x), free(y), free(want), free(blocks);
    return bad;
}

static int check_top(int ng, int keep, int *cases)
{
    float *x = malloc(sizeof(float) * 64 * ng);
    int32_t *got = malloc(sizeof(int32_t) * (ng + 1));
    for (int j = 0; j < 64 * ng; ++j)
        x[j] = rndf();
    const int k = gbx_top_blocks(x, 64 * ng, 64, keep, got);
    int bad = k != (keep < ng ? keep : ng);
    /* every kept block outweighs every dropped one */
    float minkept = INFINITY, maxdrop = -INFINITY;
    for (int g = 0, i = 0; g < ng; ++g) {
        float m = 0.0f;
        for (int j = 0; j < 64; ++j)
            m += fabsf(x[64 * g + j]);
        if (i < k && got[i] == g)
            minkept = fminf(minkept, m), ++i;
        else
            maxdrop = fmaxf(maxdrop, m);
    }
    for (int i = 1; i < k; ++i)
        bad |= got[i] <= got[i - 1];
    bad |= k > 0 && k < ng && !(minkept >= maxdrop - 1e-4f);
    ++*cases;
    if (bad)
        printf("MISMATCH top_blocks ng=%d keep=%d got %d\n", ng, keep, k);
    free(x), free(got);
    return bad;
}

int main(void)
{
    gbx_info_t info;
    gbx_get_info(&info);
    printf("cpu features (the nested kernels' names): float %s intdot %s\n", info.nested_float_isa,
           info.nested_intdot_isa);
    static const int shapes[][2] = {{1, 64}, {17, 320}, {70, 1536}, {129, 640}, {576, 1536}, {33, 4864}};
    int bad = 0, cases = 0;
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; ++s)
        for (int gs = 64; gs <= 128; gs *= 2) {
            const int O = shapes[s][0], I = shapes[s][1];
            if (I % gs)
                continue;
            for (int dtype = 0; dtype < 3; ++dtype)
                for (int kept = 0; kept <= I / gs; kept += 1 + I / gs / 3)
                    bad |= check_case(O, I, gs, dtype, kept, 1 + (kept & 1), &cases);
        }
    for (int ng = 1; ng < 80; ng += 13)
        for (int keep = 0; keep <= ng + 1; keep += 1 + ng / 4)
            bad |= check_top(ng, keep, &cases);
    if (bad)
        return 1;
    printf("OK %d cases\n", cases);
    return 0;
}
