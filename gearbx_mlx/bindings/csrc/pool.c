/*
 * pool.c -- the worker threads that split a product's rows.
 *
 * Rows are cut into chunks that the caller and the workers claim one at a
 * time (gbx_run_rows); gbx_pool_parts decides how many threads a product is
 * worth.  Built without threads (GEARBX_NO_THREADS, or Windows) every call
 * runs on the caller.
 */
#include "internal.h"

#ifndef GEARBX_NO_THREADS
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>
#include <unistd.h>
#endif


/* Below this many weights per thread, the hand-off costs more than it saves. */
#define GBX_MIN_WEIGHTS_PER_THREAD (1 << 16)
static int g_min_work = GBX_MIN_WEIGHTS_PER_THREAD;

/* ------------------------------------------------------------------------ */
/* Worker pool.  Rows are cut into chunks that the caller and the workers   */
/* claim one at a time, so a worker the OS has not scheduled yet delays     */
/* nobody: the caller takes its chunks (a static split made every product   */
/* wait for the slowest thread, a whole time slice on a busy 2-CPU VM).     */
/* Workers spin a little (decode calls come back-to-back), then sleep.      */
/* ------------------------------------------------------------------------ */

static int g_threads; /* 0 until set: online CPUs */

static int online_cpus(void)
{
#ifndef GEARBX_NO_THREADS
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    if (n < 1)
        n = 1;
    return n > GBX_MAX_THREADS ? GBX_MAX_THREADS : (int)n;
#else
    return 1;
#endif
}

int gbx_set_threads(int n)
{
    if (n <= 0)
        n = online_cpus();
    if (n > GBX_MAX_THREADS)
        n = GBX_MAX_THREADS;
#ifdef GEARBX_NO_THREADS
    n = 1;
#endif
    g_threads = n;
    return n;
}

int gbx_set_min_work(int weights_per_thread)
{
    const int old = g_min_work;
    g_min_work = weights_per_thread > 0 ? weights_per_thread : GBX_MIN_WEIGHTS_PER_THREAD;
    return old;
}

int gbx_get_threads(void)
{
    if (g_threads <= 0)
        gbx_set_threads(0);
    return g_threads;
}

int gbx_pool_parts(int nthreads, long long weights, int rows)
{
    int parts = nthreads > 0 ? nthreads : gbx_get_threads();
    const long long work = weights / g_min_work;
    if (parts > GBX_MAX_THREADS)
        parts = GBX_MAX_THREADS;
    if (parts > work)
        parts = work < 1 ? 1 : (int)work;
    if (parts > rows)
        parts = rows;
    return parts < 1 ? 1 : parts;
}

#ifndef GEARBX_NO_THREADS

static struct {
    pthread_mutex_t owner; /* one call uses the pool at a time */
    pthread_mutex_t mtx;   /* with cv: sleeping workers */
    pthread_cond_t cv;
    int nworkers;
    unsigned gen;          /* owner only: generation of the last job */
    /* (generation << 32) | next unclaimed chunk.  A claim is a CAS on both,
     * so a late worker can never take a chunk of a job it did not read.
     * Before the next job's fields are written the chunk part is set to
     * GBX_CLOSED (see gbx_run_rows), so no claim of the old job can succeed
     * against the new job's nchunks. */
    _Atomic uint64_t state;
    atomic_int done;       /* chunks finished in the current job */
    atomic_int parts;      /* threads the current job wants (workers id < parts join) */
    atomic_int sleepers;
    atomic_long spin_ns;   /* how long workers spin after the current job before they sleep */
    /* the job: written by the owner before the generation is published, and
     * stable while any chunk is unfinished */
    gbx_rows_fn fn;
    const gbx_ctx *ctx;
    int rows, chunk_rows;
    atomic_int nchunks; /* also read before a claim, to stop early */
    /* generation a worker starts from, set before it is created */
    unsigned start_gen[GBX_MAX_THREADS];
} g_pool = {.owner = PTHREAD_MUTEX_INITIALIZER, .mtx = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static void cpu_relax(void)
{
#if GBX_X86
    _mm_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long)ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static unsigned state_gen(uint64_t st) { return (unsigned)(st >> 32); }

/* chunk index of a finished job: not below any nchunks */
#define GBX_CLOSED 0x7FFFFFFFu

/* -DGEARBX_STRESS_POOL (test builds only: test_main.c --pool-stress)
 * sleeps inside the windows where a late worker meets the next job, so that a
 * hand-off race shows up in seconds instead of once in a loaded CI run. */
#ifdef GEARBX_STRESS_POOL
static _Thread_local int g_stress_worker; /* set by worker_main */
#define GBX_STRESS_PAUSE(cond, us) ((cond) ? (void)usleep(us) : (void)0)
#else
#define GBX_STRESS_PAUSE(cond, us) ((void)0)
#endif

/* Claim and run chunks of job `gen` until none is left. */
static void run_chunks(unsigned gen)
{
    for (;;) {
        uint64_t st = atomic_load_explicit(&g_pool.state, memory_order_acquire);
        /* test builds: a thread about to find the job drained stalls here */
        GBX_STRESS_PAUSE(g_stress_worker && (int)(uint32_t)st >= atomic_load(&g_pool.nchunks), 100);
        if (state_gen(st) != gen || (int)(uint32_t)st >= atomic_load_explicit(&g_pool.nchunks, memory_order_acquire))
            return;
        if (!atomic_compare_exchange_weak_explicit(&g_pool.state, &st, st + 1, memory_order_acq_rel,
                                                   memory_order_acquire))
            continue;
        /* chunk k of job gen is ours and unfinished: the job fields are stable */
        const int k = (int)(uint32_t)st;
        GBX_STRESS_PAUSE(1, 20); /* test builds: a thread holding a chunk is descheduled */
        const int r0 = k * g_pool.chunk_rows;
        const int r1 = r0 + g_pool.chunk_rows < g_pool.rows ? r0 + g_pool.chunk_rows : g_pool.rows;
        g_pool.fn(g_pool.ctx, r0, r1);
        atomic_fetch_add_explicit(&g_pool.done, 1, memory_order_release);
    }
}

static void *worker_main(void *arg)
{
    const int id = (int)(size_t)arg;
#ifdef GEARBX_STRESS_POOL
    g_stress_worker = 1;
#endif
    unsigned seen = g_pool.start_gen[id];
    for (;;) {
        unsigned g = state_gen(atomic_load_explicit(&g_pool.state, memory_order_acquire));
        if (g == seen) {
            const long t0 = now_ns(), spin = atomic_load_explicit(&g_pool.spin_ns, memory_order_relaxed);
            for (int i = 1; spin > 0 && (g = state_gen(atomic_load_explicit(&g_pool.state, memory_order_acquire))) == seen; ++i) {
                cpu_relax();
                if ((i & 255) == 0 && now_ns() - t0 > spin)
                    break;
            }
            if (g == seen) {
                pthread_mutex_lock(&g_pool.mtx);
                atomic_fetch_add(&g_pool.sleepers, 1);
                while ((g = state_gen(atomic_load(&g_pool.state))) == seen)
                    pthread_cond_wait(&g_pool.cv, &g_pool.mtx);
                atomic_fetch_sub(&g_pool.sleepers, 1);
                pthread_mutex_unlock(&g_pool.mtx);
            }
        }
        seen = g;
        if (id < atomic_load_explicit(&g_pool.parts, memory_order_relaxed))
            run_chunks(g);
    }
    return NULL;
}

/* after fork() only the calling thread exists: forget the workers */
static void pool_atfork_child(void)
{
    pthread_mutex_init(&g_pool.owner, NULL);
    pthread_mutex_init(&g_pool.mtx, NULL);
    pthread_cond_init(&g_pool.cv, NULL);
    g_pool.nworkers = 0;
    atomic_store(&g_pool.sleepers, 0);
}
static pthread_once_t g_atfork_once = PTHREAD_ONCE_INIT;
static void register_atfork(void) { pthread_atfork(NULL, NULL, pool_atfork_child); }

/* Called with g_pool.owner held. */
static int pool_grow(int nworkers)
{
    pthread_once(&g_atfork_once, register_atfork);
    while (g_pool.nworkers < nworkers) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        g_pool.start_gen[g_pool.nworkers + 1] = g_pool.gen;
        const int rc = pthread_create(&t, &attr, worker_main, (void *)(size_t)(g_pool.nworkers + 1));
        pthread_attr_destroy(&attr);
        if (rc != 0)
            return GBX_E_THREADS;
        g_pool.nworkers++;
    }
    return GBX_OK;
}

/* Fewest weights per chunk.  A claim costs one CAS (tens of ns), but each
 * chunk restarts a thread's read streams (codes, scales, biases of every
 * plane) where the hardware prefetchers must pick them up again: at 2^15 the
 * mid gear's two planes (28 rows a chunk at 576 inputs) read a 49152x576
 * matrix more slowly on two threads than on one, at 2^17 at 86% of the
 * measured read bandwidth (scripts/bench_nested_kernels.py, docs/BENCHMARKS.md). */
#define GBX_CHUNK_WEIGHTS (1 << 17)

int gbx_run_rows(gbx_rows_fn fn, const gbx_ctx *c, int rows, int parts, size_t row_weights)
{
    return gbx_run_rows_spin(fn, c, rows, parts, row_weights, GBX_POOL_SPIN_NS);
}

int gbx_run_rows_spin(gbx_rows_fn fn, const gbx_ctx *c, int rows, int parts, size_t row_weights, long spin_ns)
{
    /* A second caller (another Python thread) computes on its own thread
     * instead of waiting for the pool. */
    if (parts <= 1 || pthread_mutex_trylock(&g_pool.owner) != 0) {
        fn(c, 0, rows);
        return GBX_OK;
    }
    pool_grow(parts - 1); /* on failure: run with the workers there are */
    if (parts > g_pool.nworkers + 1)
        parts = g_pool.nworkers + 1;
    if (parts <= 1) {
        pthread_mutex_unlock(&g_pool.owner);
        fn(c, 0, rows);
        return GBX_OK;
    }
    int chunk = (int)(GBX_CHUNK_WEIGHTS / (row_weights ? row_weights : 1));
    const int fair = (rows + 4 * parts - 1) / (4 * parts); /* at least ~4 chunks per thread */
    if (chunk > fair)
        chunk = fair;
    if (chunk < 1)
        chunk = 1;
    /* Close the previous job before its fields change.  Its state is still
     * (gen, nchunks_old), and a late worker (woken for it, descheduled, back
     * after it finished) may have read that state and be about to read
     * nchunks: seeing the new, larger count, its CAS on the unchanged state
     * would succeed and it would run a chunk of *this* job and add to `done`
     * (bumped after the reset below), so this call could return while a real
     * chunk is still running on a worker: results missing, and the worker
     * reading x/w/y/act after the caller freed them (segfault).  After this
     * store every CAS of the old job fails, and a worker that sees the new
     * nchunks (acquire) also sees this store. */
    atomic_store(&g_pool.state, ((uint64_t)g_pool.gen << 32) | GBX_CLOSED);
    g_pool.fn = fn;
    g_pool.ctx = c;
    g_pool.rows = rows;
    g_pool.chunk_rows = chunk;
    const int nchunks = (rows + chunk - 1) / chunk;
    atomic_store_explicit(&g_pool.nchunks, nchunks, memory_order_release);
    atomic_store(&g_pool.parts, parts);
    atomic_store(&g_pool.done, 0);
    atomic_store_explicit(&g_pool.spin_ns, spin_ns, memory_order_relaxed);
    GBX_STRESS_PAUSE(1, 200); /* test builds: job written, not yet published */
    const unsigned gen = ++g_pool.gen;
    atomic_store(&g_pool.state, (uint64_t)gen << 32); /* seq_cst: pairs with the sleepers check */
    if (atomic_load(&g_pool.sleepers) > 0) {
        pthread_mutex_lock(&g_pool.mtx);
        pthread_cond_broadcast(&g_pool.cv);
        pthread_mutex_unlock(&g_pool.mtx);
    }
    run_chunks(gen);
    /* only chunks already claimed by a running worker are left */
    for (int i = 1; atomic_load_explicit(&g_pool.done, memory_order_acquire) < nchunks; ++i) {
        cpu_relax();
        if ((i & 1023) == 0)
            sched_yield();
    }
    pthread_mutex_unlock(&g_pool.owner);
    return GBX_OK;
}

#else /* GEARBX_NO_THREADS */

int gbx_run_rows_spin(gbx_rows_fn fn, const gbx_ctx *c, int rows, int parts, size_t row_weights, long spin_ns)
{
    (void)spin_ns;
    return gbx_run_rows(fn, c, rows, parts, row_weights);
}

int gbx_run_rows(gbx_rows_fn fn, const gbx_ctx *c, int rows, int parts, size_t row_weights)
{
    (void)parts, (void)row_weights;
    fn(c, 0, rows);
    return GBX_OK;
}

#endif

