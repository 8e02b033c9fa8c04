/*
 * dispatch.c -- CPU features, kernel choice and the entry points of the
 * packed GEMV (gearbx_cpu.h).
 *
 * Kernel families, chosen per call from what the CPU reports (run-time
 * checks, so one binary serves old and new CPUs alike):
 *   x86-64   arch/x86: float AVX2+FMA; intdot 256-bit vpdpbusd (AVX512-VNNI+VL
 *            or AVX-VNNI) where present, else AVX2 vpmaddubsw.
 *   AArch64  arch/arm: float NEON; intdot vdotq_s32 where the CPU has
 *            dotprod, else vmull_s8/vpadalq_s16.
 *   other    the scalar tails from element 0 (below).
 * Oracles: ref.c.  Threads: pool.c.  Self-test: test_main.c.
 */
#include "internal.h"

#ifndef GEARBX_NO_THREADS
#include <pthread.h>
#endif
#if GBX_X86
#include <cpuid.h>
#endif

/* ------------------------------------------------------------------------ */
/* Kernels of a CPU without SIMD: the scalar tails from element 0           */
/* ------------------------------------------------------------------------ */

static void rows_float_scalar(const gbx_ctx *c, int r0, int r1, int bits)
{
    for (int r = r0; r < r1; ++r)
        c->y[r] = tail_float(c, c->w + (size_t)r * c->row_bytes, c->s + (size_t)r * c->ng, bits, 0);
}
static void q4_float_scalar(const gbx_ctx *c, int r0, int r1) { rows_float_scalar(c, r0, r1, 4); }
static void q8_float_scalar(const gbx_ctx *c, int r0, int r1) { rows_float_scalar(c, r0, r1, 8); }

static void rows_intdot_scalar(const gbx_ctx *c, int r0, int r1, int bits)
{
    for (int r = r0; r < r1; ++r)
        c->y[r] = tail_intdot(c, c->w + (size_t)r * c->row_bytes, c->s + (size_t)r * c->ng, bits, 0);
}
static void q4_intdot_scalar(const gbx_ctx *c, int r0, int r1) { rows_intdot_scalar(c, r0, r1, 4); }
static void q8_intdot_scalar(const gbx_ctx *c, int r0, int r1) { rows_intdot_scalar(c, r0, r1, 8); }

/* ------------------------------------------------------------------------ */
/* Run-time CPU features and kernel choice                                  */
/* ------------------------------------------------------------------------ */

gbx_cpu_features gbx_cpu;

static void detect_cpu(void)
{
#if defined(GEARBX_FORCE_SCALAR)
    return; /* test builds: the scalar kernels, on any x86 CPU */
#endif
#if GBX_X86
    __builtin_cpu_init();
    /* libgcc/compiler-rt also check that the OS saves the YMM registers */
    gbx_cpu.avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    {
        /* F16C (CPUID.1:ECX bit 29): not every compiler's __builtin_cpu_supports
         * knows the name.  Every AVX2 CPU seen so far has it; checked anyway. */
        unsigned a, b, c, d;
        gbx_cpu.f16c = gbx_cpu.avx2 && __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 29));
    }
#if GBX_VNNI512
    gbx_cpu.vnni512 = gbx_cpu.avx2 && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");
    gbx_cpu.avx512f = gbx_cpu.avx2 && __builtin_cpu_supports("avx512f");
#endif
#if GBX_AVXVNNI
    gbx_cpu.avxvnni = gbx_cpu.avx2 && __builtin_cpu_supports("avxvnni");
#endif
#endif
#if GBX_DOTPROD
#if defined(__APPLE__)
    gbx_cpu.dotprod = 1; /* every arm64 Mac (M1 on) has it */
#elif defined(__linux__) && defined(HWCAP_ASIMDDP)
    gbx_cpu.dotprod = (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
#else
    gbx_cpu.dotprod = 1; /* built for dotprod and no way to ask: trust the build */
#endif
#endif
}

#ifndef GEARBX_NO_THREADS
static pthread_once_t g_cpu_once = PTHREAD_ONCE_INIT;
void gbx_cpu_init(void) { pthread_once(&g_cpu_once, detect_cpu); }
#else
static int g_cpu_done;
void gbx_cpu_init(void)
{
    if (!g_cpu_done)
        detect_cpu(), g_cpu_done = 1;
}
#endif

typedef struct {
    const char *name;
    gbx_rows_fn q4, q8;
} gbx_kernels;

/* tests and benchmarks reach the lesser kernels on a CPU that has more */
int gbx_isa_limit;
int gbx_set_isa_limit(int level)
{
    const int old = gbx_isa_limit;
    gbx_isa_limit = level == 1 || level == 2 ? level : 0;
    return old;
}

static gbx_kernels pick_float(void)
{
#if GBX_X86
    if (gbx_cpu.avx2)
        return (gbx_kernels){"avx2", gbx_q4_float_avx2, gbx_q8_float_avx2};
#endif
#if GBX_NEON
    return (gbx_kernels){"neon", gbx_q4_float_neon, gbx_q8_float_neon};
#endif
    return (gbx_kernels){"scalar", q4_float_scalar, q8_float_scalar};
}

static gbx_kernels pick_intdot(void)
{
#if GBX_VNNI512
    if (gbx_cpu.vnni512 && gbx_isa_limit == 0)
        return (gbx_kernels){"avx512vnni", gbx_q4_intdot_vnni512, gbx_q8_intdot_vnni512};
#endif
#if GBX_AVXVNNI
    if (gbx_cpu.avxvnni && gbx_isa_limit != 1)
        return (gbx_kernels){"avxvnni", gbx_q4_intdot_avxvnni, gbx_q8_intdot_avxvnni};
#endif
#if GBX_X86
    if (gbx_cpu.avx2)
        return (gbx_kernels){"avx2", gbx_q4_intdot_avx2, gbx_q8_intdot_avx2};
#endif
#if GBX_DOTPROD
    if (gbx_cpu.dotprod)
        return (gbx_kernels){"neon-dotprod", gbx_q4_intdot_dotprod, gbx_q8_intdot_dotprod};
#endif
#if GBX_NEON
    return (gbx_kernels){"neon", gbx_q4_intdot_neon, gbx_q8_intdot_neon};
#endif
    return (gbx_kernels){"scalar", q4_intdot_scalar, q8_intdot_scalar};
}

void gbx_quantize_act(const float *x, int n, int8_t *qs, float *d, int32_t *sum)
{
    gbx_cpu_init();
    const int nfull = n / GBX_QK;
    int done = 0;
#if GBX_X86
    if (gbx_cpu.avx2)
        gbx_quantize_blocks_avx2(x, nfull, qs, d, sum), done = nfull;
#endif
#if GBX_NEON
    gbx_quantize_blocks_neon(x, nfull, qs, d, sum), done = nfull;
#endif
    /* partial last block (and everything on a scalar CPU): the oracle itself */
    if (done * GBX_QK < n)
        gbx_quantize_act_ref(x + (size_t)done * GBX_QK, n - done * GBX_QK, qs + (size_t)done * GBX_QK, d + done,
                             sum + done);
}

/* ------------------------------------------------------------------------ */
/* Per-call activation buffers (one allocation, 64-byte aligned parts)      */
/* ------------------------------------------------------------------------ */

static size_t align64(size_t n) { return (n + 63) & ~(size_t)63; }

/* int4 float kernels: x in split order, span by span */
gbx_span_f32 *gbx_build_split_f32(const float *x, int n, void **mem)
{
    const int nspans = n / GBX_SPAN;
    *mem = malloc(align64(sizeof(gbx_span_f32) * (size_t)nspans) + 64);
    if (!*mem)
        return NULL;
    gbx_span_f32 *xf = (gbx_span_f32 *)align64((size_t)*mem);
    for (int p = 0; p < nspans; ++p)
        for (int k = 0; k < GBX_SPAN / 2; ++k) {
            xf[p].even[k] = x[(size_t)p * GBX_SPAN + 2 * k];
            xf[p].odd[k] = x[(size_t)p * GBX_SPAN + 2 * k + 1];
        }
    return xf;
}

int gbx_build_act(const float *x, int n, int bits, gbx_act_q8 *a, void **mem)
{
    a->n = n;
    a->nblocks = (n + GBX_QK - 1) / GBX_QK;
    a->nspans = bits == 4 ? n / GBX_SPAN : 0;
    const size_t nb = (size_t)a->nblocks, ns = (size_t)a->nspans;
    const size_t o_qs = 0, o_d = align64(o_qs + (size_t)n), o_sum = align64(o_d + 4 * nb),
                 o_split = align64(o_sum + 4 * nb), o_sd = align64(o_split + sizeof(gbx_span_q8) * ns),
                 o_nb = align64(o_sd + 32 * ns), o_corr = align64(o_nb + 32 * ns), total = align64(o_corr + 32 * ns);
    *mem = malloc(total + 64);
    if (!*mem)
        return GBX_E_NOMEM;
    char *base = (char *)align64((size_t)*mem);
    a->qs = (int8_t *)(base + o_qs);
    a->d = (float *)(base + o_d);
    a->sum = (int32_t *)(base + o_sum);
    a->split = (gbx_span_q8 *)(base + o_split);
    a->span_d = (float *)(base + o_sd);
    a->span_nbias = (int32_t *)(base + o_nb);
    a->span_corr = (float *)(base + o_corr);
    gbx_quantize_act(x, n, a->qs, a->d, a->sum);
    float total_corr = 0.0f;
    for (size_t p = 0; p < ns; ++p) {
        const int8_t *q = a->qs + p * GBX_SPAN;
        gbx_span_q8 *sp = a->split + p;
        for (int k = 0; k < GBX_SPAN / 2; ++k) {
            sp->even[k] = q[2 * k];
            sp->odd[k] = q[2 * k + 1];
        }
        for (int l = 0; l < 8; ++l) {
            int32_t t = 0;
            for (int k = 4 * l; k < 4 * l + 4; ++k)
                t += sp->even[k] + sp->odd[k];
            const float dl = a->d[2 * p + (l >> 2)];
            a->span_d[8 * p + l] = dl;
            a->span_nbias[8 * p + l] = -GBX_INT4_OFFSET * t;
            a->span_corr[8 * p + l] = dl * (float)(GBX_INT4_OFFSET * t);
            total_corr += a->span_corr[8 * p + l];
        }
    }
    a->corr_total = total_corr;
    return GBX_OK;
}

/* ------------------------------------------------------------------------ */
/* Public entry points                                                      */
/* ------------------------------------------------------------------------ */

int gbx_check_args(int out_features, int in_features, int bits, int group_size, int path)
{
    if (bits != 4 && bits != 8)
        return GBX_E_BITS;
    if (in_features < 1 || out_features < 0 || (bits == 4 && (in_features & 1)))
        return GBX_E_SHAPE;
    if (group_size != 0 && group_size != 32 && group_size != 64 && group_size != 128)
        return GBX_E_GROUP;
    if (group_size != 0 && in_features % group_size != 0)
        return GBX_E_GROUP;
    if (path < GBX_PATH_AUTO || path > GBX_PATH_INTDOT_REF)
        return GBX_E_PATH;
    return GBX_OK;
}

static int log2_int(int v)
{
    int k = 0;
    while ((1 << k) < v)
        ++k;
    return k;
}

int gbx_gemv(const void *w, const float *scales, const float *x, float *y, int out_features, int in_features,
             int bits, int group_size, int path, int nthreads)
{
    int rc = gbx_check_args(out_features, in_features, bits, group_size, path);
    if (rc != GBX_OK)
        return rc;
    if (out_features == 0)
        return GBX_OK;
    if (!w || !scales || !x || !y)
        return GBX_E_NULL;
    gbx_cpu_init();
    if (path == GBX_PATH_REF) {
        gbx_gemv_float_ref(w, scales, x, y, out_features, in_features, bits, group_size);
        return GBX_OK;
    }
    if (path == GBX_PATH_INTDOT_REF)
        return gbx_gemv_intdot_ref(w, scales, x, y, out_features, in_features, bits, group_size);

    gbx_ctx c;
    memset(&c, 0, sizeof c);
    c.w = (const uint8_t *)w;
    c.row_bytes = bits == 4 ? (size_t)in_features / 2 : (size_t)in_features;
    c.s = scales;
    c.ng = group_size ? in_features / group_size : 1;
    c.I = in_features;
    c.gs = group_size ? group_size : in_features;
    c.gshift = group_size ? log2_int(group_size / GBX_QK) : 30; /* per row: every block in group 0 */
    c.x = x;
    c.y = y;

    void *mem = NULL;
    gbx_act_q8 act;
    gbx_rows_fn fn;
    if (path == GBX_PATH_FLOAT) {
        const gbx_kernels k = pick_float();
        fn = bits == 4 ? k.q4 : k.q8;
        if (bits == 4) {
            c.xf = gbx_build_split_f32(x, in_features, &mem);
            if (!c.xf)
                return GBX_E_NOMEM;
        }
    } else { /* AUTO, INTDOT */
        const gbx_kernels k = pick_intdot();
        fn = bits == 4 ? k.q4 : k.q8;
        rc = gbx_build_act(x, in_features, bits, &act, &mem);
        if (rc != GBX_OK)
            return rc;
        c.a = &act;
    }

    const int parts = gbx_pool_parts(nthreads, (long long)out_features * in_features, out_features);
    rc = gbx_run_rows(fn, &c, out_features, parts, (size_t)in_features);
    free(mem);
    return rc;
}

void gbx_get_info(gbx_info_t *info)
{
    gbx_cpu_init();
    memset(info, 0, sizeof *info);
    info->abi_version = GBX_ABI_VERSION;
    info->compiled_avx2 = GBX_X86;
    info->compiled_neon = GBX_NEON;
    info->compiled_dotprod = GBX_DOTPROD;
    info->cpu_avx2 = gbx_cpu.avx2;
    info->cpu_vnni = gbx_cpu.vnni512 || gbx_cpu.avxvnni;
    info->cpu_dotprod = gbx_cpu.dotprod;
    info->threads = gbx_get_threads();
    info->max_threads = GBX_MAX_THREADS;
    info->float_isa = pick_float().name;
    info->intdot_isa = pick_intdot().name;
    gbx_nested_isa_names(&info->nested_float_isa, &info->nested_intdot_isa);
}

const char *gbx_strerror(int code)
{
    switch (code) {
    case GBX_OK: return "ok";
    case GBX_E_BITS: return "bits must be 4 or 8";
    case GBX_E_GROUP: return "group_size must be None/0 (packed only), 32, 64 or 128 and divide in_features";
    case GBX_E_SHAPE: return "bad shape: in_features >= 1 (even for int4), out_features >= 0";
    case GBX_E_PATH: return "unknown kernel path";
    case GBX_E_NOMEM: return "out of memory for the activation buffers";
    case GBX_E_NULL: return "a buffer pointer is NULL";
    case GBX_E_THREADS: return "could not start a worker thread";
    case GBX_E_PLANES:
        return "a gear reads 1 to 3 planes of 4 or 8 bits, float32/float16/bfloat16 scales and a finite factor";
    default: return "unknown gearbx error";
    }
}
