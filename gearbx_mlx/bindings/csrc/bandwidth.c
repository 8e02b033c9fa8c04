/*
 * bandwidth.c -- the read-bandwidth probe: the roofline the GEMV kernels are
 * measured against (scripts/bench_cpu.py, scripts/bench_nested_kernels.py).
 * It reads through the same pool and row split as a GEMV; the x86 reader is
 * in arch/x86/packed.c.
 */
#include "internal.h"

static void read_rows_scalar(const gbx_ctx *c, int r0, int r1)
{
    for (int r = r0; r < r1; ++r) {
        const uint8_t *p = c->w + (size_t)r * c->row_bytes;
        uint64_t s0 = 0, s1 = 0;
        size_t k = 0;
        for (; k + 16 <= c->row_bytes; k += 16) {
            uint64_t a, b;
            memcpy(&a, p + k, 8), memcpy(&b, p + k + 8, 8);
            s0 += a, s1 += b;
        }
        for (; k < c->row_bytes; ++k)
            s0 += p[k];
        c->sums[r] = s0 + s1;
    }
}


uint64_t gbx_read_bandwidth(const void *buf, size_t bytes, int nthreads)
{
    /* rows of 64 KiB so the pool splits the buffer like a weight matrix */
    const size_t row = 65536;
    const int rows = (int)(bytes / row);
    if (!buf || rows < 1)
        return 0;
    gbx_cpu_init();
    uint64_t *sums = calloc((size_t)rows, sizeof(uint64_t));
    if (!sums)
        return 0;
    gbx_ctx c;
    memset(&c, 0, sizeof c);
    c.w = (const uint8_t *)buf;
    c.row_bytes = row;
    c.sums = sums;
    gbx_rows_fn fn = read_rows_scalar;
#if GBX_X86
    if (gbx_cpu.avx2)
        fn = gbx_read_rows_avx2;
#endif
    int parts = nthreads > 0 ? nthreads : gbx_get_threads();
    if (parts > rows)
        parts = rows;
    gbx_run_rows(fn, &c, rows, parts, row);
    uint64_t s = 0;
    for (int r = 0; r < rows; ++r)
        s += sums[r];
    free(sums);
    return s;
}
