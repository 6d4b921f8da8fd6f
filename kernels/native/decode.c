/* The decode step's matrix-vector products (and the fused Mamba state steps) on a CPU, at the memory
   bandwidth: a decode step reads every weight once for a handful of input rows, so its speed is the rate
   at which the cores can stream the weights in, and nothing else may stand in the way.

   Threads: a small pool of our own (pthreads), not OpenMP. Work is cut into chunks of rows that threads claim
   from one atomic ticket, the calling thread among them, and a call returns when every chunk is done. A
   worker that is not running when a call arrives (another process holds its core) simply claims nothing:
   the caller does its share, so a busy machine costs throughput, never a wait for a descheduled thread at
   a barrier — the failure mode of fork/join on two cores, where one other process turned a 14 ms eager
   step into 143 ms. Workers spin a short while after a call (the next product of a step follows within
   microseconds), then sleep on a futex.

   Weights are row-major [N, K] (nn.Linear's layout): fp32, bf16 (widened to fp32 in registers), or int8
   with one fp32 scale per row (torchao's int8 weight-only layout). Inputs x are [B, K] rows (fp32 or bf16),
   accumulation is fp32, outputs [B, N] fp32 or bf16 (rounded to nearest even), an optional bias and an
   optional residual added in the same pass. */

#define _GNU_SOURCE
#include <linux/futex.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define MAXT 64
#define MAXB 16 /* input rows a product takes at once (a larger batch goes through torch's GEMM) */

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));
typedef uint16_t u16x8u __attribute__((vector_size(16), aligned(2)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef int8_t i8x8u __attribute__((vector_size(8), aligned(1)));

/* ---- the pool ------------------------------------------------------------------------------------------ */
typedef void (*chunk_fn)(const void *job, int64_t chunk);

typedef struct {
    chunk_fn fn;
    const void *job;
    int64_t nchunks;
    _Atomic int64_t done;
} Task;

static struct {
    int nworkers;
    pthread_t threads[MAXT];
    /* (generation << 32) | next chunk: a worker claims a chunk with a compare-and-swap that fails once the
       generation moved on, so a late worker never runs a chunk of a finished call */
    _Atomic uint64_t ticket;
    Task tasks[2]; /* generation g's task lives in tasks[g & 1]; the caller rewrites a slot two calls later */
    _Atomic uint32_t wake_seq;
    _Atomic int sleepers;
    _Atomic int quit;
    int64_t spin;
} P;

static pthread_mutex_t P_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t P_run = PTHREAD_MUTEX_INITIALIZER;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static void run_chunks(uint64_t gen) {
    Task *t = &P.tasks[gen & 1];
    for (;;) {
        uint64_t v = atomic_load_explicit(&P.ticket, memory_order_acquire);
        if ((v >> 32) != (gen & 0xffffffffu)) return;
        int64_t c = (int64_t)(v & 0xffffffffu);
        if (c >= t->nchunks) return;
        if (!atomic_compare_exchange_weak_explicit(&P.ticket, &v, v + 1, memory_order_acq_rel,
                                                   memory_order_relaxed))
            continue;
        t->fn(t->job, c);
        atomic_fetch_add_explicit(&t->done, 1, memory_order_release);
    }
}

static void *worker(void *arg) {
    (void)arg;
    uint64_t seen = atomic_load(&P.ticket) >> 32;
    while (!atomic_load_explicit(&P.quit, memory_order_relaxed)) {
        uint64_t gen = atomic_load_explicit(&P.ticket, memory_order_acquire) >> 32;
        if (gen != seen) {
            seen = gen;
            run_chunks(gen);
            continue;
        }
        int64_t i = 0;
        for (; i < P.spin; ++i) {
            cpu_relax();
            if ((atomic_load_explicit(&P.ticket, memory_order_acquire) >> 32) != seen) break;
        }
        if (i < P.spin) continue;
        uint32_t seq = atomic_load(&P.wake_seq);
        atomic_fetch_add(&P.sleepers, 1);
        if ((atomic_load(&P.ticket) >> 32) == seen && !atomic_load(&P.quit))
            syscall(SYS_futex, &P.wake_seq, FUTEX_WAIT_PRIVATE, seq, NULL, NULL, 0);
        atomic_fetch_sub(&P.sleepers, 1);
    }
    return NULL;
}

static void pool_stop(void) {
    atomic_store(&P.quit, 1);
    atomic_fetch_add(&P.wake_seq, 1);
    syscall(SYS_futex, &P.wake_seq, FUTEX_WAKE_PRIVATE, MAXT, NULL, NULL, 0);
    for (int i = 0; i < P.nworkers; ++i) pthread_join(P.threads[i], NULL);
    P.nworkers = 0;
    atomic_store(&P.quit, 0);
}

/* Threads for the calls that follow (the caller counts as one). Returns the number in use. */
int hl_set_threads(int n, int64_t spin) {
    pthread_mutex_lock(&P_lock);
    pthread_mutex_lock(&P_run);
    if (n < 1) n = 1;
    if (n > MAXT) n = MAXT;
    P.spin = spin;
    if (n - 1 != P.nworkers) {
        pool_stop();
        for (int i = 0; i < n - 1; ++i) {
            if (pthread_create(&P.threads[P.nworkers], NULL, worker, NULL) != 0) break;
            P.nworkers++;
        }
    }
    int used = P.nworkers + 1;
    pthread_mutex_unlock(&P_run);
    pthread_mutex_unlock(&P_lock);
    return used;
}

/* One call at a time uses the pool; a second thread calling meanwhile (two engines in two threads) runs its
   chunks itself rather than wait. */
static void pool_run(chunk_fn fn, const void *job, int64_t nchunks) {
    if (P.nworkers == 0 || nchunks == 1 || pthread_mutex_trylock(&P_run) != 0) {
        for (int64_t c = 0; c < nchunks; ++c) fn(job, c);
        return;
    }
    uint64_t gen = (atomic_load_explicit(&P.ticket, memory_order_relaxed) >> 32) + 1;
    Task *t = &P.tasks[gen & 1];
    t->fn = fn;
    t->job = job;
    t->nchunks = nchunks;
    atomic_store_explicit(&t->done, 0, memory_order_relaxed);
    atomic_store_explicit(&P.ticket, (gen & 0xffffffffu) << 32, memory_order_release);
    atomic_fetch_add(&P.wake_seq, 1);
    if (atomic_load(&P.sleepers) > 0) syscall(SYS_futex, &P.wake_seq, FUTEX_WAKE_PRIVATE, MAXT, NULL, NULL, 0);
    run_chunks(gen);
    while (atomic_load_explicit(&t->done, memory_order_acquire) < nchunks) cpu_relax();
    pthread_mutex_unlock(&P_run);
}

/* ---- conversions ---------------------------------------------------------------------------------------- */
static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40); /* NaN stays NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);                                         /* nearest, ties to even */
    return (uint16_t)(bits >> 16);
}

static inline float hsum(v8 v) {
    float s = 0.0f;
    for (int i = 0; i < 8; ++i) s += v[i];
    return s;
}

/* ---- matrix-vector products ------------------------------------------------------------------------------ */
enum { DT_F32 = 0, DT_BF16 = 1, DT_I8 = 2, DT_NONE = -1 };

typedef struct {
    const void *w;      /* [N, K] */
    const float *scale; /* [N] for int8 weights */
    const void *bias;   /* [N] or NULL */
    const void *res;    /* [B, N] residual added to the output, or NULL */
    void *y;            /* [B, N] */
    const float *x;     /* [B, K] fp32 (converted once by the caller) */
    int64_t N, K, B, rows;
    int wdt, bdt, ydt;
} Gemv;

static inline float load_as_f32(const void *p, int dt, int64_t i) {
    return dt == DT_BF16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* Four rows at once against every input row: each weight is read from memory once, the four rows' tiles
   stay in L1 for the B passes. */
#define ROWS 4
static inline void dot_rows(const Gemv *g, int64_t n0, int nr, float out[ROWS][MAXB]) {
    const int64_t K = g->K, K8 = K & ~(int64_t)7;
    for (int64_t b = 0; b < g->B; ++b) {
        const float *x = g->x + b * K;
        v8 acc[ROWS] = {{0}};
        for (int64_t k = 0; k < K8; k += 8) {
            v8 xv = *(const v8u *)(x + k);
            for (int r = 0; r < ROWS; ++r) {
                if (r >= nr) break;
                v8 w;
                if (g->wdt == DT_F32) {
                    w = *(const v8u *)((const float *)g->w + (n0 + r) * K + k);
                } else if (g->wdt == DT_BF16) {
                    u32x8 wi = __builtin_convertvector(*(const u16x8u *)((const uint16_t *)g->w + (n0 + r) * K + k),
                                                       u32x8) << 16;
                    memcpy(&w, &wi, sizeof w);
                } else {
                    w = __builtin_convertvector(*(const i8x8u *)((const int8_t *)g->w + (n0 + r) * K + k), v8);
                }
                acc[r] += w * xv;
            }
        }
        for (int r = 0; r < nr; ++r) {
            float s = hsum(acc[r]);
            for (int64_t k = K8; k < K; ++k) {
                float w = g->wdt == DT_I8 ? (float)((const int8_t *)g->w)[(n0 + r) * K + k]
                                          : load_as_f32(g->w, g->wdt, (n0 + r) * K + k);
                s += w * x[k];
            }
            out[r][b] = s;
        }
    }
}

static void gemv_chunk(const void *job, int64_t chunk) {
    const Gemv *g = job;
    const int64_t lo = chunk * g->rows, hi = lo + g->rows < g->N ? lo + g->rows : g->N;
    float out[ROWS][MAXB];
    for (int64_t n0 = lo; n0 < hi; n0 += ROWS) {
        const int nr = hi - n0 < ROWS ? (int)(hi - n0) : ROWS;
        dot_rows(g, n0, nr, out);
        for (int r = 0; r < nr; ++r) {
            const int64_t n = n0 + r;
            const float sc = g->wdt == DT_I8 ? g->scale[n] : 1.0f;
            const float bias = g->bias ? load_as_f32(g->bias, g->bdt, n) : 0.0f;
            for (int64_t b = 0; b < g->B; ++b) {
                float v = out[r][b] * sc + bias;
                if (g->res) v += load_as_f32(g->res, g->ydt, b * g->N + n);
                if (g->ydt == DT_BF16) ((uint16_t *)g->y)[b * g->N + n] = f32_to_bf16(v);
                else ((float *)g->y)[b * g->N + n] = v;
            }
        }
    }
}

static float *x_scratch(int64_t n) {
    static _Thread_local float *buf = NULL;
    static _Thread_local int64_t cap = 0;
    if (n > cap) {
        free(buf);
        buf = aligned_alloc(64, ((n * 4 + 63) / 64) * 64);
        cap = buf ? n : 0;
    }
    return buf;
}

/* y[B, N] = x[B, K] W[N, K]^T (* scale[N]) + bias[N] + res[B, N]. Returns 0, or -1 for arguments it cannot
   take (the Python side checks them first). */
int hl_gemv(const void *w, int wdt, const float *scale, const void *bias, int bdt, const void *x, int xdt,
            const void *res, void *y, int ydt, int64_t B, int64_t N, int64_t K) {
    if (B < 1 || B > MAXB || N < 1 || K < 1) return -1;
    float *xf = x_scratch(B * K);
    if (!xf) return -1;
    for (int64_t i = 0; i < B * K; ++i) xf[i] = load_as_f32(x, xdt, i);
    const int64_t wsize = wdt == DT_F32 ? 4 : wdt == DT_BF16 ? 2 : 1;
    /* ~32 KB of weights a chunk: enough chunks that two threads share the work evenly and a stalled one
       holds back little, few enough that claiming them costs nothing */
    int64_t rows = (32768 / (K * wsize)) & ~(int64_t)(ROWS - 1);
    if (rows < ROWS) rows = ROWS;
    Gemv g = {w, scale, bias, res, y, xf, N, K, B, rows, wdt, bdt, ydt};
    pool_run(gemv_chunk, &g, (N + rows - 1) / rows);
    return 0;
}
