/* The decode step's matrix-vector products (and the fused Mamba state steps) on a CPU, at the memory
   bandwidth: a decode step reads every weight once for a handful of input rows, so its speed is the rate
   at which the cores can stream the weights in, and nothing else may stand in the way.

   Threads: a small pool of our own (pthreads), not OpenMP. Work is cut into chunks of rows, the chunks into one run
   of consecutive chunks a thread; each thread claims from its run with an atomic counter, then from the others',
   the calling thread among them, and a call returns when every chunk is done. A
   worker that is not running when a call arrives (another process holds its core) simply claims nothing:
   the caller does its share, so a busy machine costs throughput, never a wait for a descheduled thread at
   a barrier — the failure mode of fork/join on two cores, where one other process turned a 14 ms eager
   step into 143 ms. Workers spin a short while after a call (the next product of a step follows within
   microseconds), then sleep on a futex.

   Weights are row-major [N, K] (nn.Linear's layout): fp32, bf16 (widened to fp32 in registers), or int8
   with one fp32 scale per row (torchao's int8 weight-only layout); or torchao's CPU int4 weight-only codes in
   aten's blocked int4pack layout with per-group scales and zeros (hl_gemv_int4, see its section). Inputs x are [B, K] rows (fp32 or bf16),
   accumulation is fp32, outputs [B, N] fp32 or bf16 (rounded to nearest even), an optional bias and an
   optional residual added in the same pass. */

#define _GNU_SOURCE
#ifdef __linux__
#include <linux/futex.h>
#endif
#include <fcntl.h>
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/syscall.h>
#include <unistd.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define MAXT 64
#define MAXB 64 /* input rows a product takes at once (a larger batch goes through torch's GEMM) */

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
    int64_t nchunks, nseg;
    _Atomic int64_t done;
} Task;

#define MAXSEG 16

static struct {
    int nworkers;
    pthread_t threads[MAXT];
    /* generation << 32: a new generation tells the workers a call is out */
    _Atomic uint64_t ticket;
    /* the call's chunks in nseg runs, one a thread: (generation << 32) | the run's next chunk, each on its own line;
       a worker claims a chunk with a compare-and-swap that fails once the generation moved on, so a late worker
       never runs a chunk of a finished call */
    struct {
        _Atomic uint64_t next;
        char pad[56];
    } seg[MAXSEG];
    Task tasks[2]; /* generation g's task lives in tasks[g & 1]; the caller rewrites a slot two calls later */
    _Atomic uint32_t wake_seq;
    _Atomic int sleepers;
    _Atomic int quit;
    _Atomic int hot; /* a decode program is running: workers spin on between its products, never sleep */
    int64_t spin;
} P;

/* A worker's sleep until wake_seq moves on from seq, and the wake-up of every sleeper: a futex on Linux. Elsewhere
   (no futex) the sleep is a yield of the core: the callers re-check their condition around it, so only the idle
   worker's CPU use differs. */
static void seq_wait(_Atomic uint32_t *addr, uint32_t seq) {
#ifdef __linux__
    syscall(SYS_futex, addr, FUTEX_WAIT_PRIVATE, seq, NULL, NULL, 0);
#else
    if (atomic_load(addr) == seq) sched_yield();
#endif
}

static void seq_wake_all(_Atomic uint32_t *addr) {
#ifdef __linux__
    syscall(SYS_futex, addr, FUTEX_WAKE_PRIVATE, MAXT, NULL, NULL, 0);
#else
    (void)addr;
#endif
}

static pthread_mutex_t P_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t P_run = PTHREAD_MUTEX_INITIALIZER;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Chunks are claimed in runs: the call's chunks cut into nseg runs of consecutive chunks (one a thread), thread t
   claiming from run t in order, then from the others (a worker that is slow or descheduled leaves its run to the
   rest). Why runs, not one ticket: with one ticket two threads took alternate chunks, so each thread's reads
   jumped over the other's chunk every 32 KB and the hardware's stream prefetchers started over at each; in a run a
   thread reads one forward stream (llama-d512's bf16 products: see the commit). */
static inline int64_t seg_lo(int64_t nchunks, int64_t nseg, int64_t s) { return s * nchunks / nseg; }

static void run_chunks(uint64_t gen, int tid) {
    Task *t = &P.tasks[gen & 1];
    int64_t mine = 0; /* chunks this thread ran: added to t->done once, not per chunk (a contended line) */
    const int64_t nseg = t->nseg, nchunks = t->nchunks;
    for (int64_t i = 0; i < nseg && nseg <= MAXSEG; ++i) {
        const int64_t sg = (tid + i) % nseg, hi = seg_lo(nchunks, nseg, sg + 1);
        for (;;) {
            uint64_t v = atomic_load_explicit(&P.seg[sg].next, memory_order_acquire);
            if ((v >> 32) != (gen & 0xffffffffu)) goto out; /* a later call's (this one is done) */
            const int64_t c = (int64_t)(v & 0xffffffffu);
            if (c >= hi) break;
            if (!atomic_compare_exchange_weak_explicit(&P.seg[sg].next, &v, v + 1, memory_order_acq_rel,
                                                       memory_order_relaxed))
                continue;
            t->fn(t->job, c);
            ++mine;
        }
    }
out:
    if (mine) atomic_fetch_add_explicit(&t->done, mine, memory_order_release);
}

/* Whether the products prefetch their weights ahead (1, the default: STREAM_PREFETCH below) or leave them to the
   caches (0): set per model by hl_set_stream_prefetch. Weights that stream from DRAM every step are best fetched
   ahead; weights that fit in the L3 stay there between steps only if nothing evicts them (llama-d512 bf16 on a Xeon
   with a 300 MiB L3: 6.5 ms with the then non-temporal prefetch, 5.2 with a plain T0 prefetch, 3.4-4.5 ms with
   none). */
static int P_stream = 1;

int hl_set_stream_prefetch(int on) {
    const int was = P_stream;
    P_stream = on ? 1 : 0;
    return was;
}

/* STREAM_PREFETCH(p, lines): the `lines` 64-byte weight lines from p + PF_AHEAD into L2 (prefetcht1), where p is what
   a loop step reads now: every line the loop will read (a 128-byte bf16 step names two), 4 KB ahead — far enough
   for DRAM's latency at the bandwidth two cores draw, and past the rest of a 4-row pass (the next group of four
   512-wide bf16 rows starts 4 KB on). On a 2-vCPU Zen 4 (32 MiB L3) this took llama-d512's decode program from
   5.2-5.6 to 3.5-3.8 ms in bf16, 7.7 to 6.0 in fp32, 2.7-3.4 to 1.4-1.8 in int8dq (three A/B rounds each in one
   process) against the earlier non-temporal prefetch of one line a step 1 KB ahead (half a bf16 step's lines, a
   quarter of the next rows', and none for fp32), which had measured faster than no prefetch on a Zen 3 VM. */
#define PF_AHEAD 4096
#define STREAM_PREFETCH(ptr, lines) do { \
        if (P_stream) \
            for (int pf_ = 0; pf_ < (lines); ++pf_) \
                _mm_prefetch((const char *)(ptr) + PF_AHEAD + 64 * pf_, _MM_HINT_T1); \
    } while (0)

static double now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec * 1e-3;
}

static void *worker(void *arg) {
    const int tid = (int)(intptr_t)arg;
    uint64_t seen = atomic_load(&P.ticket) >> 32;
    while (!atomic_load_explicit(&P.quit, memory_order_relaxed)) {
        uint64_t gen = atomic_load_explicit(&P.ticket, memory_order_acquire) >> 32;
        if (gen != seen) {
            seen = gen;
            run_chunks(gen, tid);
            continue;
        }
        /* spin for P.spin microseconds of wall time (a count of pause instructions would not do: their
           latency differs tenfold between CPU generations), then sleep */
        const double until = now_us() + (double)P.spin;
        int woke = 0;
        for (int64_t i = 0;; ++i) {
            cpu_relax();
            if ((atomic_load_explicit(&P.ticket, memory_order_acquire) >> 32) != seen) {
                woke = 1;
                break;
            }
            if ((i & 63) == 63 && !atomic_load_explicit(&P.hot, memory_order_relaxed) && now_us() > until) break;
        }
        if (woke) continue;
        uint32_t seq = atomic_load(&P.wake_seq);
        atomic_fetch_add(&P.sleepers, 1);
        if ((atomic_load(&P.ticket) >> 32) == seen && !atomic_load(&P.quit))
            seq_wait(&P.wake_seq, seq);
        atomic_fetch_sub(&P.sleepers, 1);
    }
    return NULL;
}

static void pool_stop(void) {
    atomic_store(&P.quit, 1);
    atomic_fetch_add(&P.wake_seq, 1);
    seq_wake_all(&P.wake_seq);
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
            if (pthread_create(&P.threads[P.nworkers], NULL, worker, (void *)(intptr_t)(P.nworkers + 1)) != 0) break;
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
/* A decode program's waits for descheduled workers (program.c's run_program reads and resets them): microseconds
   the caller spent, its own chunks done, waiting for chunks a worker had claimed; and whether the program runs
   its ops on the caller alone (P_solo: set while another process keeps taking a worker's core). */
static double P_waited_us = 0.0;
static int P_solo = 0;

static void pool_run(chunk_fn fn, const void *job, int64_t nchunks) {
    if (P.nworkers == 0 || nchunks == 1 || P_solo || pthread_mutex_trylock(&P_run) != 0) {
        for (int64_t c = 0; c < nchunks; ++c) fn(job, c);
        return;
    }
    uint64_t gen = (atomic_load_explicit(&P.ticket, memory_order_relaxed) >> 32) + 1;
    Task *t = &P.tasks[gen & 1];
    t->fn = fn;
    t->job = job;
    t->nchunks = nchunks;
    atomic_store_explicit(&t->done, 0, memory_order_relaxed);
    int64_t nseg = P.nworkers + 1 < nchunks ? P.nworkers + 1 : nchunks;
    if (nseg > MAXSEG) nseg = MAXSEG;
    t->nseg = nseg;
    /* every run a thread could look at gets this generation (a run this call has not: empty), so a worker still on
       an earlier call, reading a task slot since rewritten, finds no chunk to claim */
    const int64_t runs = P.nworkers + 1 < MAXSEG ? P.nworkers + 1 : MAXSEG;
    for (int64_t sg = 0; sg < runs; ++sg)
        atomic_store_explicit(&P.seg[sg].next, ((gen & 0xffffffffu) << 32) |
                                                   (sg < nseg ? (uint64_t)seg_lo(nchunks, nseg, sg) : 0xffffffffu),
                              memory_order_relaxed);
    atomic_store_explicit(&P.ticket, (gen & 0xffffffffu) << 32, memory_order_release);
    atomic_fetch_add(&P.wake_seq, 1);
    if (atomic_load(&P.sleepers) > 0) seq_wake_all(&P.wake_seq);
    run_chunks(gen, 0);
    if (atomic_load_explicit(&t->done, memory_order_acquire) < nchunks) {
        const double w0 = now_us();
        while (atomic_load_explicit(&t->done, memory_order_acquire) < nchunks) cpu_relax();
        P_waited_us += now_us() - w0;
    }
    pthread_mutex_unlock(&P_run);
}

/* ---- the machine's read bandwidth ------------------------------------------------------------------------------
   A streaming read the way the products read their weights (the pool's threads, each a run of 256 KB chunks, wide
   vector loads, the hardware prefetchers left alone): a second probe of what the decode floor divides a step's bytes
   by, beside torch's sum. On the 2-vCPU Zen 4 VM neither was consistently the faster (taking turns: this 25-28 GB/s,
   torch's 28-41), both drifted between 24 and 40 GB/s within an hour, and llama.cpp's bf16 decode read its weights
   at up to 38 GB/s: the benchmark takes the larger of the two. */
typedef struct {
    const char *buf;
    int64_t bytes;
    _Atomic int64_t sink;
} StreamRead;

#define STREAM_CHUNK (256 * 1024)

static void stream_read_chunk(const void *job, int64_t c) {
    const StreamRead *j = job;
    const int64_t lo = c * STREAM_CHUNK, hi = lo + STREAM_CHUNK < j->bytes ? lo + STREAM_CHUNK : j->bytes;
    int64_t acc = 0;
#if defined(__AVX512F__)
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    int64_t i = lo;
    for (; i + 256 <= hi; i += 256) {
        a0 = _mm512_xor_si512(a0, _mm512_loadu_si512((const void *)(j->buf + i)));
        a1 = _mm512_xor_si512(a1, _mm512_loadu_si512((const void *)(j->buf + i + 64)));
        a2 = _mm512_xor_si512(a2, _mm512_loadu_si512((const void *)(j->buf + i + 128)));
        a3 = _mm512_xor_si512(a3, _mm512_loadu_si512((const void *)(j->buf + i + 192)));
    }
    int64_t lanes[8];
    _mm512_storeu_si512((void *)lanes, _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3)));
    for (int l = 0; l < 8; ++l) acc ^= lanes[l];
#elif defined(__AVX2__)
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    int64_t i = lo;
    for (; i + 128 <= hi; i += 128) {
        a0 = _mm256_xor_si256(a0, _mm256_loadu_si256((const __m256i *)(j->buf + i)));
        a1 = _mm256_xor_si256(a1, _mm256_loadu_si256((const __m256i *)(j->buf + i + 32)));
        a2 = _mm256_xor_si256(a2, _mm256_loadu_si256((const __m256i *)(j->buf + i + 64)));
        a3 = _mm256_xor_si256(a3, _mm256_loadu_si256((const __m256i *)(j->buf + i + 96)));
    }
    int64_t lanes[4];
    _mm256_storeu_si256((__m256i *)lanes, _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3)));
    acc = lanes[0] ^ lanes[1] ^ lanes[2] ^ lanes[3];
#else
    int64_t i = lo;
#endif
    for (; i + 8 <= hi; i += 8) {
        int64_t v;
        memcpy(&v, j->buf + i, 8);
        acc ^= v;
    }
    atomic_fetch_xor_explicit((_Atomic int64_t *)&j->sink, acc, memory_order_relaxed);
}

/* Reads buf[0..bytes) once on the pool (bytes a multiple of 8); returns the XOR of its 8-byte words (so the loads are
   not dropped, and a test can check every word was read once) */
int64_t hl_stream_read(const void *buf, int64_t bytes) {
    StreamRead j = {buf, bytes, 0};
    pool_run(stream_read_chunk, &j, (bytes + STREAM_CHUNK - 1) / STREAM_CHUNK);
    return atomic_load(&j.sink);
}

enum { DT_F32 = 0, DT_BF16 = 1, DT_I8 = 2, DT_NONE = -1 };

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

static inline float round_to(float v, int dt) { return dt == DT_BF16 ? bf16_to_f32(f32_to_bf16(v)) : v; }

static inline void store_as(void *p, int dt, int64_t i, float v) {
    if (dt == DT_BF16) ((uint16_t *)p)[i] = f32_to_bf16(v);
    else ((float *)p)[i] = v;
}

static inline float hsum(v8 v) {
    float s = 0.0f;
    for (int i = 0; i < 8; ++i) s += v[i];
    return s;
}

enum { ACT_SILU = 0, ACT_GELU = 1, ACT_GELU_TANH = 2, ACT_RELU = 3, ACT_RELU2 = 4 };

static inline float activate(float v, int act) {
    switch (act) {
    case ACT_SILU: return v / (1.0f + expf(-v));
    case ACT_GELU: return 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
    case ACT_GELU_TANH: return 0.5f * v * (1.0f + tanhf(0.79788456080286536f * (v + 0.044715f * v * v * v)));
    case ACT_RELU: return v > 0.0f ? v : 0.0f;
    default: return v > 0.0f ? v * v : 0.0f;
    }
}

#ifdef __AVX512F__
/* exp of 16 fp32 lanes: n = round(x log2 e), r = x - n ln 2 (two-part ln 2), a degree-6 polynomial (Cephes' expf
   coefficients), scaled by 2^n (vscalefps: overflow to inf, underflow through the denormals to 0); NaN stays NaN
   (an integer test: -ffast-math may drop a float one). At most 1.25 ulp from exp over every float whose exp is
   finite (libm's expf: 0.5). */
static inline __m512 exp16_ps(__m512 x0) {
    const __mmask16 nan = _mm512_cmpgt_epi32_mask(
        _mm512_and_si512(_mm512_castps_si512(x0), _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    const __m512 x = _mm512_max_ps(_mm512_min_ps(x0, _mm512_set1_ps(88.8f)), _mm512_set1_ps(-104.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_mask_mov_ps(_mm512_scalef_ps(p, n), nan, x0);
}

static inline __m512 silu16_ps(__m512 v) {
    return _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16_ps(_mm512_sub_ps(_mm512_setzero_ps(), v))));
}
#endif

/* SiLU in place over fp32 v[0..n), v = x * scale + bias first (the gated MLP's gate row). Where AVX-512 is, 16 lanes
   of exp16_ps (the last 1-15 masked: a value's bits never depend on where it fell): a batched step's libm expf
   calls were ~4 ns each, 0.14 of a 1.4 ms gated MLP product at 32 rows on the 2-vCPU Zen 4, and the conv and gated
   norm of a Mamba-2 layer were mostly expf. Only fp32 outputs take it: bf16 rounds libm's expf where torch's eager
   ops round (tests/test_native_decode.py: bf16 sub-layers bit-equal to eager); fp32 SiLU moves by <= ~3 ulp. */
static void silu_f32(float *v, int64_t n, float scale, float bias) {
    int64_t i = 0;
#ifdef __AVX512F__
    const __m512 sc = _mm512_set1_ps(scale), bi = _mm512_set1_ps(bias);
    for (; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        _mm512_mask_storeu_ps(v + i, m, silu16_ps(_mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, v + i), sc, bi)));
    }
#endif
    for (; i < n; ++i) {
        const float x = v[i] * scale + bias;
        v[i] = x / (1.0f + expf(-x));
    }
}

/* SiLU in place over fp32 v[0..n) for values about to be rounded to bf16, with libm's bits after that rounding: the
   16 lanes of silu16_ps, and libm's expf for a lane where the two could round apart. Two fp32 values a few ulp apart
   round to different bf16 only across a rounding midpoint (low 16 bits 0x8000), and silu16_ps stays within a few
   ulp of libm's x / (1 + expf(-x)) (exp16_ps's polynomial, then the same add and divide), so a lane whose low bits
   lie more than SILU_BF16_MARGIN ulp from 0x8000 rounds as libm's would; the rest (~0.2% of lanes), NaNs and
   |x| > 80 (where the clamps in exp16_ps part from libm's overflow) take libm's. The bf16 MLP's and Mamba conv's
   SiLU, whose results are rounded at once (torch's rounding points): a bf16 Mamba-2 conv step of 1280 channels went
   from 20 to 7 us with the conv's own vector path, most of it libm's expf before. */
#ifdef __AVX512F__
#define SILU_BF16_MARGIN 64
static void silu_bf16_exact(float *v, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        const __m512 x = _mm512_maskz_loadu_ps(m, v + i), r = silu16_ps(x);
        const __m512i lo = _mm512_and_si512(_mm512_castps_si512(r), _mm512_set1_epi32(0xffff));
        const __mmask16 near = _mm512_cmple_epu32_mask(_mm512_sub_epi32(lo, _mm512_set1_epi32(0x8000 - SILU_BF16_MARGIN)),
                                                       _mm512_set1_epi32(2 * SILU_BF16_MARGIN));
        const __mmask16 wild = _mm512_cmp_ps_mask(_mm512_abs_ps(x), _mm512_set1_ps(80.0f), _CMP_NLE_UQ);
        _mm512_mask_storeu_ps(v + i, m, r);
        for (__mmask16 k = (near | wild) & m; k; k &= k - 1) {
            const int l = __builtin_ctz(k);
            const float xl = x[l];
            v[i + l] = xl / (1.0f + expf(-xl));
        }
    }
}
#endif

/* ---- matrix-vector products ------------------------------------------------------------------------------ */

typedef struct {
    const void *w;      /* [N, K] */
    const float *scale; /* [N] for int8 weights */
    const void *bias;   /* [N] or NULL */
    const void *res;    /* [B, N] residual added to the output, or NULL */
    void *y;            /* [B, N] */
    const float *x;     /* [B, K] fp32 (converted once by the caller) */
    int64_t N, K, B, rows;
    int wdt, bdt, ydt;
    int act1; /* 0: none, else an ACT_* + 1 applied to x W^T (* scale) + bias (a plain MLP's up projection) */
    const uint16_t *xb; /* [B, K] the caller's bf16 x where dot_row takes it as bf16 (bf16_x), else NULL */
    const uint32_t *xt; /* x as AMX B tiles (amx_pack_x) where the batch takes the AMX path, else NULL */
} Gemv;

static inline float load_as_f32(const void *p, int dt, int64_t i) {
    return dt == DT_BF16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* A product's output i: the activation (act1 - 1; 0: none) of the value rounded to ydt, then the residual added to
   the rounded value (bf16: torch's two ops, each rounded), stored. */
static inline void store_out(void *y, int ydt, const void *res, int act1, int64_t i, float v) {
    if (act1) v = activate(round_to(v, ydt), act1 - 1);
    if (res) v = round_to(v, ydt) + load_as_f32(res, ydt, i);
    store_as(y, ydt, i, v);
}

/* The weights of a row, 8 at a time, as fp32 vectors: one definition per storage dtype so every inner loop is
   specialised at compile time (a dtype switch inside the loop cost a third of the bandwidth). */
static inline v8 load_w8(const void *w, int wdt, int64_t i) {
#ifdef __AVX2__
    /* the intrinsics: GCC's generic vector conversions of 8-bit and 16-bit lanes came out as scalar code */
    if (wdt == DT_F32) return (v8)_mm256_loadu_ps((const float *)w + i);
    if (wdt == DT_BF16)
        return (v8)_mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + i))), 16));
    return (v8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)w + i))));
#else
    v8 out;
    if (wdt == DT_F32) {
        out = *(const v8u *)((const float *)w + i);
    } else if (wdt == DT_BF16) {
        u32x8 wi = __builtin_convertvector(*(const u16x8u *)((const uint16_t *)w + i), u32x8) << 16;
        memcpy(&out, &wi, sizeof out);
    } else {
        out = __builtin_convertvector(*(const i8x8u *)((const int8_t *)w + i), v8);
    }
    return out;
#endif
}

static inline float load_w1(const void *w, int wdt, int64_t i) {
    return wdt == DT_I8 ? (float)((const int8_t *)w)[i] : load_as_f32(w, wdt, i);
}

/* Eight values at once, the scalar helpers' bits (round_to, store_as): the small per-step ops (the norms) over whole
   vectors, where one value at a time they took ~4 ns each (an RMSNorm of 512 values 1.9 us, a gated one of 1024
   6 us: serial next to the products, whose other thread waits meanwhile). */
static inline u32x8 bf16_bits8(v8 v) { /* f32_to_bf16 in each lane, in the low 16 bits */
    u32x8 b;
    memcpy(&b, &v, sizeof b);
    const u32x8 nan = (b & 0x7fffffffu) > 0x7f800000u; /* all ones where NaN */
    return (nan & ((b >> 16) | 0x40u)) | (~nan & ((b + 0x7fffu + ((b >> 16) & 1u)) >> 16));
}

static inline v8 round8_to(v8 v, int dt) {
    if (dt != DT_BF16) return v;
    const u32x8 b = bf16_bits8(v) << 16;
    memcpy(&v, &b, sizeof v);
    return v;
}

static inline void store8_as(void *p, int dt, int64_t i, v8 v) {
    if (dt == DT_BF16) *(u16x8u *)((uint16_t *)p + i) = __builtin_convertvector(bf16_bits8(v), u16x8u);
    else *(v8u *)((float *)p + i) = v;
}

#ifdef __AVX512F__
/* f32_to_bf16 in 16 integer lanes (the low 16 bits of each): under -ffast-math GCC folds a float x != x to false */
static inline __m512i bf16_bits16(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v), hi = _mm512_srli_epi32(bits, 16);
    const __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_and_si512(hi, _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7fff))),
        16);
    const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    return _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
}
#endif

#ifdef __AVX2__
static inline __m256 bf16x8_load(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* nearest-even rounding of 8 floats to bf16 (f32_to_bf16's, NaN kept a NaN), stored */
static inline void bf16x8_store(uint16_t *p, __m256 v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    const __m256i qnan = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
    r = _mm256_blendv_epi8(r, qnan, nan);
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128((__m128i *)p, packed);
}
#endif

/* sum of x[i]^2 over d fp32 or bf16 values, in double (each square exact there) as the scalar loop it replaces, in
   eight double lanes summed in a fixed order (which lane a value falls in depends on its index alone) */
typedef double v4d __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));
static double sumsq_f64(const void *x, int dt, int64_t d) {
    v4d a0 = {0}, a1 = {0};
    int64_t i = 0;
    for (; i + 8 <= d; i += 8) {
        const v8 v = load_w8(x, dt, i);
        const v4f lo = {v[0], v[1], v[2], v[3]}, hi = {v[4], v[5], v[6], v[7]};
        const v4d dl = __builtin_convertvector(lo, v4d), dh = __builtin_convertvector(hi, v4d);
        a0 += dl * dl, a1 += dh * dh;
    }
    const v4d a = a0 + a1;
    double ss = (a[0] + a[1]) + (a[2] + a[3]);
    for (; i < d; ++i) {
        const double v = load_as_f32(x, dt, i);
        ss += v * v;
    }
    return ss;
}

/* A thread's scratch of at least n floats (*buf / *cap: that thread's own), grown when too small; NULL when
   out of memory. */
static float *grow_scratch(float **buf, int64_t *cap, int64_t n) {
    if (n > *cap) {
        free(*buf);
        *buf = aligned_alloc(64, ((n * 4 + 63) / 64) * 64);
        *cap = *buf ? n : 0;
    }
    return *buf;
}

/* the input rows converted to fp32 (load_x) */
static float *x_scratch(int64_t n) {
    static _Thread_local float *buf = NULL;
    static _Thread_local int64_t cap = 0;
    return grow_scratch(&buf, &cap, n);
}

#ifdef __AVX2__
/* bf16 weights 16 at a time: one 256-bit load, each bf16 moved into the high half of a zeroed 32-bit lane by
   an unpack (one instruction per 8 weights, where widening 8 at a time took a load, a zero-extend and a shift:
   ~8% more bandwidth measured on the 2-vCPU Zen machine). The unpacks take lanes in the order 0-3, 8-11 (lo)
   and 4-7, 12-15 (hi), so the input x is stored permuted to match (permute_for_bf16). */
#define BF16_UNPACK 1
static inline void bf16x16(const uint16_t *p, v8 *lo, v8 *hi) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)p), z = _mm256_setzero_si256();
    *lo = (v8)_mm256_castsi256_ps(_mm256_unpacklo_epi16(z, v));
    *hi = (v8)_mm256_castsi256_ps(_mm256_unpackhi_epi16(z, v));
}
#endif

/* x [B, K] (fp32) reordered in blocks of 16 for bf16x16: 0-3, 8-11, 4-7, 12-15; the tail past the last full
   block stays in order. */
static void permute_for_bf16(float *x, int64_t B, int64_t K) {
#ifdef BF16_UNPACK
    const int64_t K16 = K & ~(int64_t)15;
    for (int64_t b = 0; b < B; ++b)
        for (int64_t k = 0; k < K16; k += 16) {
            float *p = x + b * K + k, t[4];
            memcpy(t, p + 4, sizeof t);
            memcpy(p + 4, p + 8, sizeof t);
            memcpy(p + 8, t, sizeof t);
        }
#else
    (void)x, (void)B, (void)K;
#endif
}

/* x converted to fp32 into this thread's scratch, in the order the weights' dot products take it */
static float *load_x(const void *x, int xdt, int64_t B, int64_t K, int wdt) {
    float *xf = x_scratch(B * K);
    if (!xf) return NULL;
    for (int64_t i = 0; i < B * K; ++i) xf[i] = load_as_f32(x, xdt, i);
    if (wdt == DT_BF16) permute_for_bf16(xf, B, K);
    return xf;
}

#ifdef __AVX512BF16__
/* the masks of a bf16 row's last 1-63 values over two 32-lane loads (masked-off lanes read nothing and are zero) */
static inline void tail_masks32(int64_t rem, __mmask32 *m0, __mmask32 *m1) {
    *m0 = rem >= 32 ? 0xFFFFFFFFu : (__mmask32)((1ull << rem) - 1);
    *m1 = rem <= 32 ? 0 : (__mmask32)((1ull << (rem - 32)) - 1);
}
#endif

/* One row against B input rows: 4 independent accumulators per input row over 32 weights, so the loads of
   the row stream without waiting on the adds; every weight read from memory once. */
static inline __attribute__((always_inline)) void dot_row(const Gemv *g, int64_t n, float *out, const int wdt) {
    const int64_t K = g->K, K32 = K & ~(int64_t)31, K8 = K & ~(int64_t)7;
    const int64_t B = g->B;
    const int64_t off = n * K;
#ifdef __AVX512BF16__
    /* bf16 weights against bf16 inputs: vdpbf16ps multiplies 32 bf16 pairs and adds them into 16 fp32 lanes in
       one instruction. A bf16 x bf16 product is exact in fp32, so each lane is a chain of correctly rounded adds,
       as the widening loop below is (only the order of the sums differs, and denormals flush to zero). Where
       this CPU has it the widening loop's unpacks and FMAs were the limit (bf16 llama-d512 step 9.1 ms, 0.42 of
       the read floor, on the 2-vCPU Xeon with AMX). */
    if (wdt == DT_BF16 && g->xb) {
        const uint16_t *w = (const uint16_t *)g->w + off;
        const int64_t K64 = K & ~(int64_t)63;
        for (int64_t b = 0; b < B; ++b) {
            const uint16_t *x = g->xb + b * K;
            __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
            int64_t k = 0;
            /* no STREAM_PREFETCH here: with the weights on 2 MiB pages (kernels/host_memory.py) the hardware's
               own prefetchers kept ahead of this loop and the software ones only cost it: llama-d512's bf16 step
               against the prefetching library, 24 alternating rounds of 16 steps (2-vCPU Zen 4), median ratio
               1.064 (20 of 24 rounds faster). The fp32 loop keeps them: without, the same test read 0.890. */
            for (; k < K64; k += 64) {
                a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512((const void *)(w + k)),
                                      (__m512bh)_mm512_loadu_si512((const void *)(x + k)));
                a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512((const void *)(w + k + 32)),
                                      (__m512bh)_mm512_loadu_si512((const void *)(x + k + 32)));
            }
            if (k < K) { /* the last 1-63 */
                __mmask32 m0, m1;
                tail_masks32(K - k, &m0, &m1);
                a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_maskz_loadu_epi16(m0, w + k),
                                      (__m512bh)_mm512_maskz_loadu_epi16(m0, x + k));
                a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_maskz_loadu_epi16(m1, w + k + 32),
                                      (__m512bh)_mm512_maskz_loadu_epi16(m1, x + k + 32));
            }
            out[b] = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
        }
        return;
    }
#endif
#ifdef BF16_UNPACK
    if (wdt == DT_BF16) {
        const uint16_t *w = (const uint16_t *)g->w + off;
        const int64_t K16 = K & ~(int64_t)15;
        for (int64_t b = 0; b < B; ++b) {
            const float *x = g->x + b * K;
            v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, l0, h0, l1, h1;
            int64_t k = 0;
            for (; k < K32; k += 32) {
                /* (a non-temporal prefetch 1 KB ahead here took a bf16 llama-d512 step 5.1 -> 4.2 ms on a Zen 3 VM,
                   median of 3 A/B runs; the same for its fp32 weights measured slower, 6.5 -> 7.6 ms, so the AVX2
                   fp32 loop has none. The 4 KB L2 prefetch that replaced it is measured on Zen 4 only.) */
                STREAM_PREFETCH((const char *)(w + k), 1);
                bf16x16(w + k, &l0, &h0);
                bf16x16(w + k + 16, &l1, &h1);
                a0 += l0 * *(const v8u *)(x + k);
                a1 += h0 * *(const v8u *)(x + k + 8);
                a2 += l1 * *(const v8u *)(x + k + 16);
                a3 += h1 * *(const v8u *)(x + k + 24);
            }
            for (; k < K16; k += 16) {
                bf16x16(w + k, &l0, &h0);
                a0 += l0 * *(const v8u *)(x + k);
                a1 += h0 * *(const v8u *)(x + k + 8);
            }
            float s = hsum(a0 + a1 + a2 + a3);
            for (; k < K; ++k) s += bf16_to_f32(w[k]) * x[k];
            out[b] = s;
        }
        return;
    }
#endif
#ifdef __AVX512F__
    /* fp32 weights, 64 a step in four 512-bit accumulators (the AVX2 loop below reached 17-33 GB/s on a Xeon whose
       L3 holds the weights, torch's oneDNN GEMV 33-59): every input row against the row, re-read from L1 */
    if (wdt == DT_F32) {
        const float *w = (const float *)g->w + off;
        const int64_t K64 = K & ~(int64_t)63, K16 = K & ~(int64_t)15;
        for (int64_t b = 0; b < B; ++b) {
            const float *x = g->x + b * K;
            __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(),
                   a3 = _mm512_setzero_ps();
            int64_t k = 0;
            for (; k < K64; k += 64) {
                if (b == 0) STREAM_PREFETCH((const char *)(w + k), 4);
                a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k), _mm512_loadu_ps(x + k), a0);
                a1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k + 16), _mm512_loadu_ps(x + k + 16), a1);
                a2 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k + 32), _mm512_loadu_ps(x + k + 32), a2);
                a3 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k + 48), _mm512_loadu_ps(x + k + 48), a3);
            }
            for (; k < K16; k += 16) a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k), _mm512_loadu_ps(x + k), a0);
            if (k < K) {
                const __mmask16 m = (__mmask16)((1u << (K - k)) - 1);
                a1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, w + k), _mm512_maskz_loadu_ps(m, x + k), a1);
            }
            out[b] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
        }
        return;
    }
#endif
    if (B == 1) {
        const float *x = g->x;
        v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        int64_t k = 0;
        for (; k < K32; k += 32) {
            a0 += load_w8(g->w, wdt, off + k) * *(const v8u *)(x + k);
            a1 += load_w8(g->w, wdt, off + k + 8) * *(const v8u *)(x + k + 8);
            a2 += load_w8(g->w, wdt, off + k + 16) * *(const v8u *)(x + k + 16);
            a3 += load_w8(g->w, wdt, off + k + 24) * *(const v8u *)(x + k + 24);
        }
        for (; k < K8; k += 8) a0 += load_w8(g->w, wdt, off + k) * *(const v8u *)(x + k);
        float s = hsum(a0 + a1 + a2 + a3);
        for (; k < K; ++k) s += load_w1(g->w, wdt, off + k) * x[k];
        out[0] = s;
        return;
    }
    /* several input rows: the weight row (at most K * 4 bytes) is read from memory once, then from L1 */
    for (int64_t b = 0; b < B; ++b) {
        const float *x = g->x + b * K;
        v8 a0 = {0}, a1 = {0};
        int64_t k = 0;
        for (; k + 16 <= K8; k += 16) {
            a0 += load_w8(g->w, wdt, off + k) * *(const v8u *)(x + k);
            a1 += load_w8(g->w, wdt, off + k + 8) * *(const v8u *)(x + k + 8);
        }
        for (; k < K8; k += 8) a0 += load_w8(g->w, wdt, off + k) * *(const v8u *)(x + k);
        float s = hsum(a0 + a1);
        for (; k < K; ++k) s += load_w1(g->w, wdt, off + k) * x[k];
        out[b] = s;
    }
}

/* Several input rows (a batched decode step): past a few rows the product is compute-bound, and one weight row
   against each input row in turn does one FMA per two loads. Here 4 weight rows (widened to fp32 once, into
   this thread's scratch, for bf16 / int8) meet 3 input rows at a time: 12 accumulators, 7 loads per 12 FMAs. */
#define MULTI_ROWS 4 /* from this many input rows on */

/* The caller's x for the vdpbf16ps loops (dot_row, dot4_bf16, block4_bf16: every batch size), or NULL: only on a
   CPU with AVX512-BF16, only bf16 weights against bf16 inputs (fp32 ones would be rounded) */
static inline const uint16_t *bf16_x(const void *x, int xdt, int wdt, int64_t B, int64_t K) {
#ifdef __AVX512BF16__
    if (wdt == DT_BF16 && xdt == DT_BF16 && K >= 64) return (const uint16_t *)x;
#endif
    (void)x, (void)xdt, (void)wdt, (void)B, (void)K;
    return NULL;
}

/* a block of weight rows widened to fp32 (dot_rows) */
static float *w_scratch(int64_t n) {
    static _Thread_local float *buf = NULL;
    static _Thread_local int64_t cap = 0;
    return grow_scratch(&buf, &cap, n);
}

/* weight row n as fp32, in the order the (permuted, for bf16) x takes it */
static const float *row_f32(const Gemv *g, int64_t n, float *dst, const int wdt) {
    const int64_t K = g->K;
    if (wdt == DT_F32) return (const float *)g->w + n * K;
    int64_t k = 0;
    if (wdt == DT_BF16) {
        const uint16_t *w = (const uint16_t *)g->w + n * K;
#ifdef BF16_UNPACK
        for (; k + 16 <= K; k += 16) {
            v8 lo, hi;
            bf16x16(w + k, &lo, &hi);
            *(v8u *)(dst + k) = lo;
            *(v8u *)(dst + k + 8) = hi;
        }
#endif
        for (; k < K; ++k) dst[k] = bf16_to_f32(w[k]);
    } else {
        const int8_t *w = (const int8_t *)g->w + n * K;
        for (; k + 8 <= K; k += 8) *(v8u *)(dst + k) = load_w8(w, DT_I8, k);
        for (; k < K; ++k) dst[k] = (float)w[k];
    }
    return dst;
}

/* An 8-float vector held in a register at this point (an empty asm: the compiler cannot fold its load into the
   instructions that use it). Only where a ymm register can hold it (AVX): elsewhere (plain x86-64, other
   architectures) the "x" constraint is impossible and the library failed to build at all. */
#ifdef __AVX__
#define PIN_V8(v) __asm__("" : "+x"(v))
#else
#define PIN_V8(v) ((void)0)
#endif

static inline __attribute__((always_inline)) void block_4xNB(const float *const *w, const float *x, int64_t K,
                                                             float out[4][MAXB], int64_t b0, const int NB) {
    v8 a[4][3] = {{{0}}};
    const int64_t K8 = K & ~(int64_t)7;
    int64_t k = 0;
    for (; k < K8; k += 8) {
        v8 xv[3];
        for (int j = 0; j < NB; ++j) {
            xv[j] = *(const v8u *)(x + (b0 + j) * K + k);
            PIN_V8(xv[j]);
        }
        for (int r = 0; r < 4; ++r) {
            /* the empty asms keep wv and the xv in registers (as block8_f32_nb's wv): GCC 12 folded wv's load into
               each of the NB FMAs (15 loads per 12 FMAs where 7 do), and with wv alone pinned, the xv's */
            v8 wv = *(const v8u *)(w[r] + k);
            PIN_V8(wv);
            for (int j = 0; j < NB; ++j) a[r][j] += wv * xv[j];
        }
    }
    for (int r = 0; r < 4; ++r)
        for (int j = 0; j < NB; ++j) {
            float sum = hsum(a[r][j]);
            for (int64_t t = k; t < K; ++t) sum += w[r][t] * x[(b0 + j) * K + t];
            out[r][b0 + j] = sum;
        }
}

#ifdef __AVX512F__
/* out[r][b] = the sum of v[r]'s 16 lanes, for 4 rows at once, each in _mm512_reduce_add_ps's order (256-bit halves,
   128-bit halves, then (0 + 2) + (1 + 3)): a row's bits as dot_row's */
static inline void hsum4_ps(const __m512 v[4], float out[4][MAXB], int64_t b) {
    __m128 t[4];
    for (int r = 0; r < 4; ++r) {
        const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v[r]),
                                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v[r]), 1)));
        t[r] = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    }
    const __m128 s01 = _mm_add_ps(_mm_shuffle_ps(t[0], t[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm_shuffle_ps(t[0], t[1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m128 s23 = _mm_add_ps(_mm_shuffle_ps(t[2], t[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm_shuffle_ps(t[2], t[3], _MM_SHUFFLE(3, 2, 3, 2)));
    float res[4];
    _mm_storeu_ps(res, _mm_add_ps(_mm_shuffle_ps(s01, s23, _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm_shuffle_ps(s01, s23, _MM_SHUFFLE(3, 1, 3, 1))));
    for (int r = 0; r < 4; ++r) out[r][b] = res[r];
}
#endif

#ifdef __AVX512F__
/* out[0..8) = the sums of v[0..8)'s 16 lanes, by one fixed tree for the eight (256-bit halves of row pairs, then
   128-bit quarters, then within 128-bit lanes): 17 shuffles and 8 adds where hsum4_ps twice took ~60 ops */
static inline __m256 hsum8_ps(const __m512 v[8]) {
    __m512 t[4], q[2];
    for (int i = 0; i < 4; ++i) /* [v0.q0 + v0.q2, v0.q1 + v0.q3, v1.q0 + v1.q2, v1.q1 + v1.q3] for v[2i], v[2i+1] */
        t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 2; ++i) /* 128-bit lane l: row 4i + l's four partial sums */
        q[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    /* lane l: [row l (0 + 2), row l (1 + 3), row l + 4 (0 + 2), row l + 4 (1 + 3)] */
    const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(q[0], q[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_ps(q[0], q[1], _MM_SHUFFLE(3, 2, 3, 2)));
    /* lane l: [row l, row l + 4, (the same twice)] */
    const __m512 f = _mm512_add_ps(_mm512_shuffle_ps(z, z, _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_ps(z, z, _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_castps512_ps256(
        _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0), f));
}

/* fp32 weights against several fp32 input rows on AVX-512 (a batched decode step, compute-bound): 8 weight rows
   against NB (1..3, a constant: the 24 accumulators stay in registers, of the 32) input rows, 16 lanes a step, the
   NB input vectors loaded once for the 8 rows and each weight vector once for the NB input rows (11 loads per 24
   FMAs). fp32 accumulation over K in each lane, then hsum8_ps's tree: the sums of input row b0 + j land in
   outT[b0 + j][0..8) (transposed: the caller's epilogue takes a row's 16 outputs as one vector). A row's bits do not
   depend on the batch or on the block it fell in; they differ from the one-row path's (another order of sums). pf
   (or NULL): pf_len bytes of the weights to come, one 64-byte line a step prefetched into L2 (rows16_f32). */
static inline __attribute__((always_inline)) void block8_f32_nb(const float *const *w, const float *x, int64_t K,
                                                                float *outT, int64_t b0, const int NB,
                                                                const char *pf, int64_t pf_len) {
    const int64_t K16 = K & ~(int64_t)15;
    const float *xr = x + b0 * K;
    __m512 a[3][8];
    for (int r = 0; r < 8; ++r)
        for (int j = 0; j < NB; ++j) a[j][r] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k < K16; k += 16) {
        __m512 xv[3];
        for (int j = 0; j < NB; ++j) xv[j] = _mm512_loadu_ps(xr + j * K + k);
        if (pf && 4 * k < pf_len) _mm_prefetch(pf + 4 * k, _MM_HINT_T1);
        for (int r = 0; r < 8; ++r) {
            /* the empty asm keeps wv in a register: without it GCC 12 folded the load into each of the NB FMAs
               (27 loads per 24 FMAs, not 11); fp32 2048x768 at 32 rows, 2 threads, L3-resident weights: median
               121 -> 147 GFLOP/s, alternating in one process */
            __m512 wv = _mm512_loadu_ps(w[r] + k);
            __asm__("" : "+v"(wv));
            for (int j = 0; j < NB; ++j) a[j][r] = _mm512_fmadd_ps(wv, xv[j], a[j][r]);
        }
    }
    if (k < K) {
        const __mmask16 m = (__mmask16)((1u << (K - k)) - 1);
        __m512 xv[3];
        for (int j = 0; j < NB; ++j) xv[j] = _mm512_maskz_loadu_ps(m, xr + j * K + k);
        for (int r = 0; r < 8; ++r) {
            const __m512 wv = _mm512_maskz_loadu_ps(m, w[r] + k);
            for (int j = 0; j < NB; ++j) a[j][r] = _mm512_fmadd_ps(wv, xv[j], a[j][r]);
        }
    }
    for (int j = 0; j < NB; ++j) _mm256_storeu_ps(outT + (b0 + j) * 16, hsum8_ps(a[j]));
}

/* 8 fp32 weight rows against input rows b0..b0+nb-1 (nb 1..3) */
static inline void block8_f32(const float *const *w, const float *x, int64_t K, float *outT, int64_t b0, int nb,
                              const char *pf, int64_t pf_len) {
    if (nb == 3) block8_f32_nb(w, x, K, outT, b0, 3, pf, pf_len);
    else if (nb == 2) block8_f32_nb(w, x, K, outT, b0, 2, pf, pf_len);
    else block8_f32_nb(w, x, K, outT, b0, 1, pf, pf_len);
}

/* rows n0..n0+nr-1 (nr <= 16) of an fp32 W against all B input rows into outT[b][0..nr): eight rows at a time (a
   short last block repeats its last row; its sums are dropped) against the input rows in blocks of at most 3, as
   even as they split (2 + 2 for 4). The eight weight rows (8 K floats: 24 KB at K 768) stay in L1 while the input
   rows stream past them from L2; with the loops the other way round (the 16 rows against one block of input rows
   at a time) fp32 2048x768 at 64 rows took 1.96 ms, this order with 4-row blocks 1.69, with 8-row blocks 1.67
   (Zen 4, 2 threads; the old 4x3 8-lane block 3.4 ms).
   Weights that stream from memory (P_stream): while eight rows meet the input blocks, the next eight rows (the
   next 8 K floats of W) are prefetched into L2, a slice per input block, one line a step; the first pass over
   eight rows otherwise waited on their lines (fp32 3352x768 at 32 rows, 1 thread, weights from DRAM: median
   57.8 -> 64.3 GFLOP/s; 32000x768 55.9 -> 64.4, alternating in one process).
   Transposed outputs (F32_BATCHED's epilogues store an input row's 16 outputs as one vector): against hsum4_ps into
   [row][b] and scalar stores down the columns of y, 32 rows, alternating in one process: 1 thread, 3352x768 from
   DRAM median 77.6 -> 85.6 GFLOP/s, 32000x768 78.5 -> 87.3, 256x768 from L2 88 -> 100; 2 threads, 2048x768 119 ->
   138, 32000x768 149 -> 163; the batch-32 step 49.2 -> 45.4 ms (llama-small), 47.9 -> 44.7 (hybrid-1to7-small). */
static inline void rows16_f32(const Gemv *g, int64_t n0, int nr, float outT[MAXB][16]) {
    const int64_t K = g->K, B = g->B, nblk = (B + 2) / 3;
    const float *w[16];
    for (int r = 0; r < 16; ++r) w[r] = (const float *)g->w + (n0 + (r < nr ? r : nr - 1)) * K;
    const char *wend = (const char *)((const float *)g->w + g->N * K);
    const int64_t per = (8 * K * 4 + nblk - 1) / nblk; /* bytes of the next rows to prefetch per input block */
    for (int r = 0; r < nr; r += 8) {
        const char *next = (const char *)(w[r] + 8 * K);
        for (int64_t i = 0, b0 = 0; i < nblk; ++i) {
            const int nb = (int)((B - b0) / (nblk - i) + ((B - b0) % (nblk - i) != 0));
            const char *pf = next + i * per, *pe = pf + per < wend ? pf + per : wend;
            block8_f32(w + r, g->x, K, &outT[0][r], b0, nb, P_stream && pf < pe ? pf : NULL, pe - pf);
            b0 += nb;
        }
    }
}

/* 16 values p[i..i+16) of dtype dt as fp32 (lanes past m zero) */
static inline __m512 load16_f32(const void *p, int dt, int64_t i, __mmask16 m) {
    if (dt == DT_F32) return _mm512_maskz_loadu_ps(m, (const float *)p + i);
#ifdef __AVX512BW__
    if (dt == DT_BF16) /* (a bf16 value widens exactly: its bits are the fp32's top half) */
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, (const uint16_t *)p + i)), 16));
#endif
    float t[16] = {0};
    for (int l = 0; l < 16; ++l)
        if (m >> l & 1) t[l] = load_as_f32(p, dt, i + l);
    return _mm512_loadu_ps(t);
}

static inline __mmask16 mask16(int64_t n) {
    return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
}
#define F32_BATCHED(g, wdt) ((wdt) == DT_F32 && (g)->B >= MULTI_ROWS)
#else
#define F32_BATCHED(g, wdt) 0
#endif

#ifdef __AVX512BF16__
/* dot_row's vdpbf16ps loop for 4 rows against one bf16 input row: the input read once for the four, and the four
   horizontal sums done together. Each row's sums run in dot_row's order (its two accumulators, then
   _mm512_reduce_add_ps's tree: 256-bit halves, 128-bit halves, (0 + 2) + (1 + 3)), so a row's bits do not depend
   on whether it fell in a block of four. */
static inline void dot4_bf16(const Gemv *g, int64_t n0, float out[4][MAXB]) {
    const int64_t K = g->K, K64 = K & ~(int64_t)63;
    const uint16_t *x = g->xb, *w[4];
    for (int r = 0; r < 4; ++r) w[r] = (const uint16_t *)g->w + (n0 + r) * K;
    __m512 a[4][2];
    for (int r = 0; r < 4; ++r) a[r][0] = a[r][1] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k < K64; k += 64) {
        const __m512bh x0 = (__m512bh)_mm512_loadu_si512((const void *)(x + k)),
                       x1 = (__m512bh)_mm512_loadu_si512((const void *)(x + k + 32));
        for (int r = 0; r < 4; ++r) {
            STREAM_PREFETCH((const char *)(w[r] + k), 2);
            a[r][0] = _mm512_dpbf16_ps(a[r][0], (__m512bh)_mm512_loadu_si512((const void *)(w[r] + k)), x0);
            a[r][1] = _mm512_dpbf16_ps(a[r][1], (__m512bh)_mm512_loadu_si512((const void *)(w[r] + k + 32)), x1);
        }
    }
    if (k < K) {
        __mmask32 m0, m1;
        tail_masks32(K - k, &m0, &m1);
        const __m512bh x0 = (__m512bh)_mm512_maskz_loadu_epi16(m0, x + k),
                       x1 = (__m512bh)_mm512_maskz_loadu_epi16(m1, x + k + 32);
        for (int r = 0; r < 4; ++r) {
            a[r][0] = _mm512_dpbf16_ps(a[r][0], (__m512bh)_mm512_maskz_loadu_epi16(m0, w[r] + k), x0);
            a[r][1] = _mm512_dpbf16_ps(a[r][1], (__m512bh)_mm512_maskz_loadu_epi16(m1, w[r] + k + 32), x1);
        }
    }
    const __m512 v[4] = {_mm512_add_ps(a[0][0], a[0][1]), _mm512_add_ps(a[1][0], a[1][1]),
                         _mm512_add_ps(a[2][0], a[2][1]), _mm512_add_ps(a[3][0], a[3][1])};
    hsum4_ps(v, out, 0);
}

/* 4 bf16 weight rows against NB (1 or 2, a constant: the accumulators stay in registers) bf16 input rows from b:
   each (row, input row) pair keeps dot_row's two accumulators and its order, so a row's bits are dot_row's
   whatever the batch, and the weight vectors load once per NB input rows */
static inline __attribute__((always_inline)) void block4_bf16_nb(const Gemv *g, const uint16_t *const *w,
                                                                 int64_t b, float out[4][MAXB], const int NB) {
    const int64_t K = g->K, K64 = K & ~(int64_t)63;
    __m512 a[4][2][2];
    for (int r = 0; r < 4; ++r)
        for (int j = 0; j < NB; ++j) a[r][j][0] = a[r][j][1] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K64; k += 64) {
        __m512bh x[2][2];
        for (int j = 0; j < NB; ++j) {
            x[j][0] = (__m512bh)_mm512_loadu_si512((const void *)(g->xb + (b + j) * K + k));
            x[j][1] = (__m512bh)_mm512_loadu_si512((const void *)(g->xb + (b + j) * K + k + 32));
        }
        for (int r = 0; r < 4; ++r) {
            if (b == 0) STREAM_PREFETCH((const char *)(w[r] + k), 2);
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512((const void *)(w[r] + k)),
                           w1 = (__m512bh)_mm512_loadu_si512((const void *)(w[r] + k + 32));
            for (int j = 0; j < NB; ++j) {
                a[r][j][0] = _mm512_dpbf16_ps(a[r][j][0], w0, x[j][0]);
                a[r][j][1] = _mm512_dpbf16_ps(a[r][j][1], w1, x[j][1]);
            }
        }
    }
    if (K64 < K) {
        __mmask32 m0, m1;
        tail_masks32(K - K64, &m0, &m1);
        for (int r = 0; r < 4; ++r) {
            const __m512bh w0 = (__m512bh)_mm512_maskz_loadu_epi16(m0, w[r] + K64),
                           w1 = (__m512bh)_mm512_maskz_loadu_epi16(m1, w[r] + K64 + 32);
            for (int j = 0; j < NB; ++j) {
                const uint16_t *xj = g->xb + (b + j) * K + K64;
                a[r][j][0] = _mm512_dpbf16_ps(a[r][j][0], w0, (__m512bh)_mm512_maskz_loadu_epi16(m0, xj));
                a[r][j][1] = _mm512_dpbf16_ps(a[r][j][1], w1, (__m512bh)_mm512_maskz_loadu_epi16(m1, xj + 32));
            }
        }
    }
    for (int j = 0; j < NB; ++j) {
        __m512 v[4];
        for (int r = 0; r < 4; ++r) v[r] = _mm512_add_ps(a[r][j][0], a[r][j][1]);
        hsum4_ps(v, out, b + j);
    }
}

/* 4 bf16 weight rows against every bf16 input row, two at a time (16 accumulators, 6 loads per 16 vdpbf16ps).
   The batched decode step was compute-bound in the widening block path below: bf16 llama-d512 at 32 sequences,
   43 ms a step. */
static inline void block4_bf16(const Gemv *g, int64_t n0, float out[4][MAXB]) {
    const uint16_t *w[4];
    for (int r = 0; r < 4; ++r) w[r] = (const uint16_t *)g->w + (n0 + r) * g->K;
    int64_t b = 0;
    for (; b + 2 <= g->B; b += 2) block4_bf16_nb(g, w, b, out, 2);
    if (b < g->B) block4_bf16_nb(g, w, b, out, 1);
}
#endif

#ifdef __AVX512F__
/* dot_row's fp32 AVX-512 loop for 4 rows against one input row (its four accumulators per row and their order) */
static inline void dot4_f32(const Gemv *g, int64_t n0, float out[4][MAXB]) {
    const int64_t K = g->K, K64 = K & ~(int64_t)63, K16 = K & ~(int64_t)15;
    const float *x = g->x, *w[4];
    for (int r = 0; r < 4; ++r) w[r] = (const float *)g->w + (n0 + r) * K;
    __m512 a[4][4];
    for (int r = 0; r < 4; ++r) a[r][0] = a[r][1] = a[r][2] = a[r][3] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k < K64; k += 64) {
        for (int r = 0; r < 4; ++r) STREAM_PREFETCH((const char *)(w[r] + k), 4);
        for (int j = 0; j < 4; ++j) {
            const __m512 xv = _mm512_loadu_ps(x + k + 16 * j);
            for (int r = 0; r < 4; ++r) a[r][j] = _mm512_fmadd_ps(_mm512_loadu_ps(w[r] + k + 16 * j), xv, a[r][j]);
        }
    }
    for (; k < K16; k += 16) {
        const __m512 xv = _mm512_loadu_ps(x + k);
        for (int r = 0; r < 4; ++r) a[r][0] = _mm512_fmadd_ps(_mm512_loadu_ps(w[r] + k), xv, a[r][0]);
    }
    if (k < K) {
        const __mmask16 m = (__mmask16)((1u << (K - k)) - 1);
        const __m512 xv = _mm512_maskz_loadu_ps(m, x + k);
        for (int r = 0; r < 4; ++r) a[r][1] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, w[r] + k), xv, a[r][1]);
    }
    __m512 v[4];
    for (int r = 0; r < 4; ++r) v[r] = _mm512_add_ps(_mm512_add_ps(a[r][0], a[r][1]), _mm512_add_ps(a[r][2], a[r][3]));
    hsum4_ps(v, out, 0);
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__x86_64__) && \
    defined(__linux__) /* the tile state is granted through Linux's arch_prctl */
/* ---- AMX (a batched bf16 step) ---------------------------------------------------------------------------------
   Past one input row a bf16 product is compute-bound, and vdpbf16ps reached ~100 GFLOP/s on the 2-vCPU Xeon while
   oneDNN's AMX GEMM ran 4-5x faster (bf16 llama-d512 at 32 sequences: 29 of a 34 ms program in products). The
   tile unit multiplies a [16, 32] block of weight rows (A: straight from the row-major weight, no repacking) by a
   [32, 16] block of the batch (B: the input rows in the tile unit's pair layout, packed once per op by
   amx_pack_x), into a [16, 16] fp32 tile per 16 input rows. fp32 accumulation, in the tile unit's order (the
   bits differ from the one-row path's by fp32 rounding), denormals flushed as vdpbf16ps does. Linux hands out the
   tile state on request (arch_prctl); where it refuses, or HYBRID_NO_AMX is set, the vdpbf16ps path runs. */
#define AMX_PATH 1
#include <sys/syscall.h>
#define AMX_MIN_ROWS 2 /* input rows from which a bf16 product takes the tile unit */

static int amx_usable(void) {
    static _Atomic int state = -1; /* -1 unknown, 0 no, 1 yes */
    int s = atomic_load(&state);
    if (s < 0) {
        const char *off = getenv("HYBRID_NO_AMX");
        s = (off && *off && *off != '0') ? 0 : syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                                         18 /* XFEATURE_XTILEDATA */) == 0;
        atomic_store(&state, s);
    }
    return s;
}

/* this thread's tile configuration: tmm0 A [16 rows, 64 B], tmm1 / tmm6 B [16, 64 B], tmm2..5 C [16, 64 B]. Loaded
   at the start of every chunk that uses the tiles: torch's own AMX kernels configure (and release) the tiles of
   the thread they run on between our calls. */
static void amx_configure(void) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } __attribute__((packed)) cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 7; ++t) cfg.colsb[t] = 64; /* (a tile not used must be all zero) */
    for (int t = 0; t < 7; ++t) cfg.rows[t] = 16;
    _tile_loadconfig(&cfg);
}

/* x [B, K] bf16 as B tiles: tile (kb, mb) is 16 rows (k pairs kb*32 + 2i, +1) of 16 dwords (input rows mb*16 + m,
   zero past B), 1 KB each, kb-major. NULL unless the AMX path takes this product (bf16 x and weights, K % 32 == 0,
   AMX_MIN_ROWS..64 rows, the tiles granted). The calling thread's scratch, read by its workers during the op. */
static const uint32_t *amx_pack_x(const void *x, int xdt, int wdt, int64_t B, int64_t K) {
    if (wdt != DT_BF16 || xdt != DT_BF16 || K % 32 || B < AMX_MIN_ROWS || B > MAXB || !amx_usable()) return NULL;
    static _Thread_local float *buf = NULL;
    static _Thread_local int64_t cap = 0;
    const int64_t nkb = K / 32, nmb = (B + 15) / 16;
    uint32_t *t = (uint32_t *)grow_scratch(&buf, &cap, nkb * nmb * 256);
    if (!t) return NULL;
    const uint32_t *xr = (const uint32_t *)x; /* a row's k pairs as dwords: K / 2 of them */
    for (int64_t kb = 0; kb < nkb; ++kb)
        for (int64_t mb = 0; mb < nmb; ++mb) {
            uint32_t *tile = t + (kb * nmb + mb) * 256;
            for (int64_t i = 0; i < 16; ++i)
                for (int64_t m = 0; m < 16; ++m) {
                    const int64_t b = mb * 16 + m;
                    tile[i * 16 + m] = b < B ? xr[b * (K / 2) + kb * 16 + i] : 0u;
                }
        }
    return t;
}

/* out[r][b] = row n0 + r (r < 16) of a bf16 W against every input row b, by the tile unit */
static inline void amx_rows16(const Gemv *g, int64_t n0, float out[16][MAXB]) {
    const int64_t K = g->K, nkb = K / 32, nmb = (g->B + 15) / 16;
    const uint16_t *w = (const uint16_t *)g->w + n0 * K;
    const uint32_t *xt = g->xt;
    _tile_zero(2);
    if (nmb > 1) _tile_zero(3);
    if (nmb > 2) _tile_zero(4);
    if (nmb > 3) _tile_zero(5);
    for (int64_t kb = 0; kb < nkb; ++kb) {
        _tile_loadd(0, w + kb * 32, K * 2);
        const uint32_t *t = xt + kb * nmb * 256;
        _tile_loadd(1, t, 64);
        _tile_dpbf16ps(2, 0, 1);
        if (nmb > 1) {
            _tile_loadd(6, t + 256, 64);
            _tile_dpbf16ps(3, 0, 6);
        }
        if (nmb > 2) {
            _tile_loadd(1, t + 512, 64);
            _tile_dpbf16ps(4, 0, 1);
        }
        if (nmb > 3) {
            _tile_loadd(6, t + 768, 64);
            _tile_dpbf16ps(5, 0, 6);
        }
    }
    _tile_stored(2, &out[0][0], MAXB * 4);
    if (nmb > 1) _tile_stored(3, &out[0][16], MAXB * 4);
    if (nmb > 2) _tile_stored(4, &out[0][32], MAXB * 4);
    if (nmb > 3) _tile_stored(5, &out[0][48], MAXB * 4);
}
#define AMX_BEGIN(g) do { if ((g)->xt) amx_configure(); } while (0)
#else
#define AMX_BEGIN(g) do { } while (0)
static inline const uint32_t *amx_pack_x(const void *x, int xdt, int wdt, int64_t B, int64_t K) {
    (void)x, (void)xdt, (void)wdt, (void)B, (void)K;
    return NULL;
}
#endif

/* The instruction paths this build takes (bits: 1 AVX2, 2 AVX-512, 4 AVX512-BF16 vdpbf16ps, 8 AVX512-VNNI
   vpdpbusd, 16 the AMX tile unit, compiled and granted): what `hybrid doctor` reports */
int hl_cpu_paths(void) {
    int bits = 0;
#ifdef __AVX2__
    bits |= 1;
#endif
#ifdef __AVX512F__
    bits |= 2;
#endif
#ifdef __AVX512BF16__
    bits |= 4;
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    bits |= 8;
#endif
#ifdef AMX_PATH
    if (amx_usable()) bits |= 16;
#endif
    return bits;
}

/* out[r][b] = row n0 + r (r < nr <= 4) of W against input row b, for all B input rows */
static inline __attribute__((always_inline)) void dot_rows(const Gemv *g, int64_t n0, int nr, float out[4][MAXB],
                                                           const int wdt) {
#ifdef __AVX512BF16__
    /* One input row: while the weights stream from memory (P_stream), one weight row after another, so each thread
       reads one sequential stream, which the hardware prefetchers follow (with STREAM_PREFETCH ahead of it): four
       rows a pass are four streams 1-2 KB apart at K 512, which they did not (llama-d512's program on a 2-vCPU
       Zen 4, three A/B rounds in one process: bf16 3.6-3.9 -> 2.8-3.4 ms, fp32 6.0-6.8 -> 5.4-5.8). Weights the
       cache holds take four rows a pass (the input read once for four, their sums together: faster on a Xeon whose
       L3 holds the model). The bits are the same either way. */
    if (wdt == DT_BF16 && g->xb) { /* every batch: dot_row's bits for each row */
        if (nr == 4 && g->B == 1 && !P_stream) dot4_bf16(g, n0, out);
        else if (nr == 4 && g->B > 1) block4_bf16(g, n0, out);
        else
            for (int r = 0; r < nr; ++r) dot_row(g, n0 + r, out[r], wdt);
        return;
    }
#endif
#ifdef __AVX512F__
    if (wdt == DT_F32 && g->B == 1 && nr == 4 && !P_stream) {
        dot4_f32(g, n0, out);
        return;
    }
#endif
    if (g->B < MULTI_ROWS) {
        for (int r = 0; r < nr; ++r) dot_row(g, n0 + r, out[r], wdt);
        return;
    }
    const int64_t K = g->K;
    float *buf = wdt == DT_F32 ? NULL : w_scratch(4 * K);
    if (wdt != DT_F32 && !buf) { /* no memory for the widened rows: one row at a time */
        for (int r = 0; r < nr; ++r) dot_row(g, n0 + r, out[r], wdt);
        return;
    }
    const float *w[4];
    for (int r = 0; r < 4; ++r) /* a short block repeats its last row (its sums are dropped) */
        w[r] = row_f32(g, n0 + (r < nr ? r : nr - 1), buf ? buf + r * K : NULL, wdt);
    int64_t b = 0;
    for (; b + 3 <= g->B; b += 3) block_4xNB(w, g->x, K, out, b, 3);
    if (g->B - b == 2) block_4xNB(w, g->x, K, out, b, 2);
    else if (g->B - b == 1) block_4xNB(w, g->x, K, out, b, 1);
}

/* rows n0..n0+nr-1 (nr <= 16) against every input row: 16 at a time by the tile unit where it takes the op, else
   dot_rows four at a time (fp32 weights against several input rows on AVX-512, F32_BATCHED, take rows16_f32 in
   each caller instead: its outputs come transposed) */
static inline __attribute__((always_inline)) void dot_rows16(const Gemv *g, int64_t n0, int nr, float out[16][MAXB],
                                                             const int wdt) {
#ifdef AMX_PATH
    if (wdt == DT_BF16 && g->xt && nr == 16) {
        amx_rows16(g, n0, out);
        return;
    }
#endif
    for (int r = 0; r < nr; r += 4) dot_rows(g, n0 + r, nr - r < 4 ? nr - r : 4, (float(*)[MAXB])out[r], wdt);
}

#ifdef __AVX512F__
/* gemv_rows for F32_BATCHED: 16 rows' outputs of an input row as one vector (bias, SiLU, residual, store), where
   the output is fp32 and the activation none or SiLU; else gemv_rows' scalar steps from the transposed outputs */
static void gemv_rows_f32(const Gemv *g, int64_t lo, int64_t hi) {
    float outT[MAXB][16];
    const int vec = g->ydt == DT_F32 && (!g->act1 || g->act1 - 1 == ACT_SILU);
    for (int64_t n0 = lo; n0 < hi; n0 += 16) {
        const int nr = hi - n0 < 16 ? (int)(hi - n0) : 16;
        const __mmask16 m = mask16(nr);
        rows16_f32(g, n0, nr, outT);
        const __m512 bias = g->bias ? load16_f32(g->bias, g->bdt, n0, m) : _mm512_setzero_ps();
        for (int64_t b = 0; b < g->B; ++b) {
            if (vec) {
                __m512 v = _mm512_add_ps(_mm512_loadu_ps(outT[b]), bias);
                if (g->act1) v = silu16_ps(v);
                if (g->res) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, (const float *)g->res + b * g->N + n0));
                _mm512_mask_storeu_ps((float *)g->y + b * g->N + n0, m, v);
                continue;
            }
            for (int64_t n = n0; n < n0 + nr; ++n) {
                store_out(g->y, g->ydt, g->res, g->act1, b * g->N + n,
                          outT[b][n - n0] + (g->bias ? load_as_f32(g->bias, g->bdt, n) : 0.0f));
            }
        }
    }
}
#endif

/* One input row while the weights stream from memory (P_stream), no tile unit: dot_rows would take such rows one at
   a time anyway (dot_row), so the products (gemv_rows), the gated MLP up-projection and q/k/v take each row
   straight to its output, not through a 16-row block: the same bits; llama-d512's product shapes in one process on
   the 2-vCPU Zen 4, 12 alternating rounds: bf16 28.9 -> 31.4 GB/s (in L3: 91 -> 106), fp32 30.6 -> 31.8 (in L3:
   103 -> 112); the MLP and q/k/v on whole bf16 steps: llama-d512 1.083, hybrid-1to7-d512 1.038. */
static inline int one_row_streaming(const Gemv *g) { return g->B == 1 && P_stream && !g->xt; }

/* row n's sum as the product's value: times its int8 row scale, plus its bias */
static inline float row_value(const Gemv *g, int64_t n, float sum) {
    return sum * (g->wdt == DT_I8 ? g->scale[n] : 1.0f) + (g->bias ? load_as_f32(g->bias, g->bdt, n) : 0.0f);
}

static inline __attribute__((always_inline)) void gemv_rows(const Gemv *g, int64_t lo, int64_t hi, const int wdt) {
#ifdef __AVX512F__
    if (F32_BATCHED(g, wdt)) {
        gemv_rows_f32(g, lo, hi);
        return;
    }
#endif
    if (one_row_streaming(g)) {
        for (int64_t n = lo; n < hi; ++n) {
            float out;
            dot_row(g, n, &out, wdt);
            store_out(g->y, g->ydt, g->res, g->act1, n, row_value(g, n, out));
        }
        return;
    }
    float outs[16][MAXB];
    for (int64_t n0 = lo; n0 < hi; n0 += 16)
    for (int64_t n = n0, nr = hi - n0 < 16 ? hi - n0 : 16; n < n0 + nr; ++n) {
        if (n == n0) dot_rows16(g, n0, (int)nr, outs, wdt);
        const float *out = outs[n - n0];
        const float sc = wdt == DT_I8 ? g->scale[n] : 1.0f;
        const float bias = g->bias ? load_as_f32(g->bias, g->bdt, n) : 0.0f;
        for (int64_t b = 0; b < g->B; ++b) store_out(g->y, g->ydt, g->res, g->act1, b * g->N + n, out[b] * sc + bias);
    }
}

static void gemv_chunk(const void *job, int64_t chunk) {
    const Gemv *g = job;
    AMX_BEGIN(g);
    const int64_t lo = chunk * g->rows, hi = lo + g->rows < g->N ? lo + g->rows : g->N;
    if (g->wdt == DT_F32) gemv_rows(g, lo, hi, DT_F32);
    else if (g->wdt == DT_BF16) gemv_rows(g, lo, hi, DT_BF16);
    else gemv_rows(g, lo, hi, DT_I8);
}


/* Rows of a weight matrix one chunk of the pool takes: ~1/64 of the matrix, at least 32 KB. Enough chunks that
   the threads share the work evenly and a stalled one holds back little; few enough that claiming them (an
   atomic on a line the threads share) costs nothing (32 KB chunks of a 64 MB LM head: 2000 claims, a fifth of
   its bandwidth). */
static int64_t chunk_rows(int64_t N, int64_t row_bytes) {
    int64_t bytes = N * row_bytes / 64;
    if (bytes < 32768) bytes = 32768;
    int64_t rows = bytes / row_bytes;
    return (rows + 15) & ~(int64_t)15; /* whole 16-row blocks (the tile unit's) */
}

/* y[B, N] = act(x[B, K] W[N, K]^T (* scale[N]) + bias[N]) + res[B, N] (act1: 0 none, else ACT_* + 1). */
static int gemv_act(const void *w, int wdt, const float *scale, const void *bias, int bdt, const void *x, int xdt,
                    const void *res, void *y, int ydt, int64_t B, int64_t N, int64_t K, int act1) {
    if (B < 1 || B > MAXB || N < 1 || K < 1) return -1;
    float *xf = load_x(x, xdt, B, K, wdt);
    if (!xf) return -1;
    const int64_t wsize = wdt == DT_F32 ? 4 : wdt == DT_BF16 ? 2 : 1;
    const int64_t rows = chunk_rows(N, K * wsize);
    Gemv g = {w, scale, bias, res, y, xf, N, K, B, rows, wdt, bdt, ydt, act1, bf16_x(x, xdt, wdt, B, K),
              amx_pack_x(x, xdt, wdt, B, K)};
    pool_run(gemv_chunk, &g, (N + rows - 1) / rows);
    return 0;
}

/* y[B, N] = x[B, K] W[N, K]^T (* scale[N]) + bias[N] + res[B, N]. Returns 0, or -1 for arguments it cannot
   take (the Python side checks them first). */
int hl_gemv(const void *w, int wdt, const float *scale, const void *bias, int bdt, const void *x, int xdt,
            const void *res, void *y, int ydt, int64_t B, int64_t N, int64_t K) {
    return gemv_act(w, wdt, scale, bias, bdt, x, xdt, res, y, ydt, B, N, K, 0);
}

/* ---- int4 weight-only products (torchao's CPU Int4OpaqueTensor, aten's int4pack layout) ----------------------
   docs/notes/int4-cpu-layout.md: codes q in 0..15, qdata uint8 [N, K/2] in blocks of BN output rows, K-major, BN
   chosen by aten for the CPU it dispatched to (the caller passes it: kernels.projection.int4pack_block()):
   - BN = 32 (AVX2): the 16 bytes at block nb, input k hold rows nb*32 + i (low nibble) and nb*32 + 16 + i (high
     nibble), i < 16; a last block of 16 rows (N % 32 == 16) holds 8 bytes per k, rows 2j (low) and 2j + 1 (high).
   - BN = 64 (AVX512): the 32 bytes at block nb, input k hold rows nb*64 + i (low) and nb*64 + 32 + i (high),
     i < 32; the last N % 64 rows (16, 32 or 48) hold (N % 64) / 2 bytes per k, rows 2j (low) and 2j + 1 (high).
   scale_and_zero [K/G, N, 2] (fp32 or bf16: the model's dtype) per group of G inputs: w = (q - 8) * scale + zero.

   Per block and group the codes' dot products sum_k q x_k are accumulated in fp32 (one k's 16 or 32 bytes give
   32 or 64 rows' codes), then y += scale * that + (zero - 8 scale) * sum_k x_k: the group's dequantisation costs a
   few operations per row per group instead of one per weight. */

typedef struct {
    const uint8_t *q; /* qdata [N, K/2] */
    const void *sz;   /* scale_and_zero [K/G, N, 2] */
    int64_t N, K, G;
    int sdt;
    int bn; /* rows per block of the layout: 32 or 64 */
} Int4Mat;

typedef struct {
    const float *x;    /* [B, K] fp32 */
    const float *xsum; /* [B, K/G] each group's sum of x */
    int64_t B;
    const uint32_t *xp; /* [B, K/2] bf16 x as (k, k + 1) pairs for the 64-row vdpbf16ps loop, else NULL */
} Int4X;

typedef int32_t i32x8 __attribute__((vector_size(32)));

/* the codes of one k of a 32-row block as fp32: rows 0-7, 8-15, 16-23, 24-31 */
static inline void nib32(const uint8_t *p, v8 *r0, v8 *r1, v8 *r2, v8 *r3) {
#ifdef __AVX2__
    /* each half of the 16 bytes zero-extended to 32-bit lanes straight from memory, then the low nibble masked
       and the high one shifted down: 2 widening loads, 4 integer ops, 4 conversions for 32 codes (splitting
       the nibbles first took 2 more shuffles and left the compiler too few registers for its accumulators) */
    const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)));
    const __m256i m = _mm256_set1_epi32(15);
    *r0 = (v8)_mm256_cvtepi32_ps(_mm256_and_si256(a, m));
    *r1 = (v8)_mm256_cvtepi32_ps(_mm256_and_si256(b, m));
    *r2 = (v8)_mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4));
    *r3 = (v8)_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
#else
    for (int i = 0; i < 8; ++i) {
        (*r0)[i] = (float)(p[i] & 15), (*r1)[i] = (float)(p[8 + i] & 15);
        (*r2)[i] = (float)(p[i] >> 4), (*r3)[i] = (float)(p[8 + i] >> 4);
    }
#endif
}

/* scale and zero of 8 consecutive rows (one group): 8 (scale, zero) pairs de-interleaved */
static inline void load_sz8(const void *sz, int sdt, int64_t i, v8 *s, v8 *z) {
    const v8 p0 = load_w8(sz, sdt, i), p1 = load_w8(sz, sdt, i + 8);
    const i32x8 ms = {0, 2, 4, 6, 8, 10, 12, 14}, mz = {1, 3, 5, 7, 9, 11, 13, 15};
    *s = __builtin_shuffle(p0, p1, ms);
    *z = __builtin_shuffle(p0, p1, mz);
}

/* one block's group codes (G inputs from k0) widened to fp32 into wb [G][32] in row order (a 16-row tail block
   fills lanes 0-15) */
static void int4_widen(const uint8_t *q, int nr, int64_t k0, int64_t G, float *wb) {
    if (nr == 32) {
        for (int64_t kk = 0; kk < G; ++kk) {
            v8 r0, r1, r2, r3;
            nib32(q + (k0 + kk) * 16, &r0, &r1, &r2, &r3);
            float *d = wb + kk * 32;
            *(v8u *)d = r0, *(v8u *)(d + 8) = r1, *(v8u *)(d + 16) = r2, *(v8u *)(d + 24) = r3;
        }
        return;
    }
    for (int64_t kk = 0; kk < G; ++kk) {
        const uint8_t *p = q + (k0 + kk) * 8;
        float *d = wb + kk * 32;
        for (int j = 0; j < 8; ++j) d[2 * j] = (float)(p[j] & 15), d[2 * j + 1] = (float)(p[j] >> 4);
    }
}

/* acc[b][r] = sum over the G widened weights wb of rows r < NV * 8 against input rows b0, b0 + 1 (NB of them) */
static inline __attribute__((always_inline)) void int4_dots(const float *wb, const float *x, int64_t K, int64_t k0,
                                                            int64_t G, int64_t b0, float acc[][32], const int NB,
                                                            const int NV) {
    v8 a[2][4] = {{{0}}};
    const float *x0 = x + b0 * K + k0, *x1 = x0 + K;
    for (int64_t kk = 0; kk < G; ++kk) {
        const float *w = wb + kk * 32;
        const float xa = x0[kk], xb = NB > 1 ? x1[kk] : 0.0f;
        for (int v = 0; v < NV; ++v) {
            const v8 wv = *(const v8u *)(w + 8 * v);
            a[0][v] += wv * xa;
            if (NB > 1) a[1][v] += wv * xb;
        }
    }
    for (int j = 0; j < NB; ++j)
        for (int v = 0; v < NV; ++v) *(v8u *)(acc[b0 + j] + 8 * v) = a[j][v];
}

/* a thread's widened group codes (int4_widen) */
static float *w4_scratch(int64_t n) {
    static _Thread_local float *buf = NULL;
    static _Thread_local int64_t cap = 0;
    return grow_scratch(&buf, &cap, n);
}

/* out[b][r] = 32-row block nb's row r (r < the returned 32 or 16 rows) of the dequantised W against input row b; -1
   when out of memory */
/* out[b][r] += scale * acc[b][r] + (zero - 8 scale) * sum_k x[b, k] for the rows row0 .. row0 + nr (nr a multiple of
   8) and group gi: one group's dequantisation applied to its dot products, once per row (acc rows acc_stride apart) */
static inline void int4_group_out(const Int4Mat *m, const Int4X *xs, int64_t gi, int64_t row0, int nr, const float *acc,
                                  int64_t acc_stride, float out[][64]) {
    const int64_t ng = m->K / m->G;
    for (int r = 0; r < nr; r += 8) {
        v8 s, z;
        load_sz8(m->sz, m->sdt, (gi * m->N + row0 + r) * 2, &s, &z);
        const v8 z8 = z - s * 8.0f; /* (q - 8) s + z = q s + (z - 8 s) */
        for (int64_t b = 0; b < xs->B; ++b) {
            v8 o = *(v8u *)(out[b] + r);
            o += s * *(const v8u *)(acc + b * acc_stride + r) + z8 * xs->xsum[b * ng + gi];
            *(v8u *)(out[b] + r) = o;
        }
    }
}

static int int4_block32(const Int4Mat *m, const Int4X *xs, int64_t nb, float out[][64]) {
    const int64_t K = m->K, G = m->G, ng = K / G, B = xs->B, row0 = nb * 32;
    const int nr = m->N - row0 >= 32 ? 32 : 16;
    const uint8_t *q = m->q + row0 * (K / 2);
    float acc[MAXB][32];
    float *wb = NULL;
    if (B > 1 || nr < 32) {
        wb = w4_scratch(G * 32);
        if (!wb) return -1;
    }
    for (int64_t b = 0; b < B; ++b)
        for (int r = 0; r < 32; ++r) out[b][r] = 0.0f;
    for (int64_t gi = 0; gi < ng; ++gi) {
        const int64_t k0 = gi * G;
        if (!wb) { /* one input row: straight from the codes; two inputs a step, each into its own 4 accumulators
                      of 8 rows, so 8 chains of FMAs hide the FMA latency (G is even) */
            const float *x = xs->x + k0;
            const uint8_t *p = q + k0 * 16;
            v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, c0 = {0}, c1 = {0}, c2 = {0}, c3 = {0};
            for (int64_t kk = 0; kk < G; kk += 2) {
                v8 r0, r1, r2, r3;
                nib32(p + kk * 16, &r0, &r1, &r2, &r3);
                const float xv = x[kk];
                a0 += r0 * xv, a1 += r1 * xv, a2 += r2 * xv, a3 += r3 * xv;
                nib32(p + kk * 16 + 16, &r0, &r1, &r2, &r3);
                const float xw = x[kk + 1];
                c0 += r0 * xw, c1 += r1 * xw, c2 += r2 * xw, c3 += r3 * xw;
            }
            *(v8u *)acc[0] = a0 + c0, *(v8u *)(acc[0] + 8) = a1 + c1, *(v8u *)(acc[0] + 16) = a2 + c2;
            *(v8u *)(acc[0] + 24) = a3 + c3;
        } else {
            int4_widen(q, nr, k0, G, wb);
            int64_t b = 0;
            if (nr == 32) {
                for (; b + 2 <= B; b += 2) int4_dots(wb, xs->x, K, k0, G, b, acc, 2, 4);
                if (b < B) int4_dots(wb, xs->x, K, k0, G, b, acc, 1, 4);
            } else {
                for (; b + 2 <= B; b += 2) int4_dots(wb, xs->x, K, k0, G, b, acc, 2, 2);
                if (b < B) int4_dots(wb, xs->x, K, k0, G, b, acc, 1, 2);
            }
        }
        int4_group_out(m, xs, gi, row0, nr, acc[0], sizeof acc[0] / sizeof(float), out);
    }
    return nr;
}

/* The 64-row layout (aten's AVX512 packing): one k of a block is 32 contiguous bytes, byte i holding rows i (low
   nibble) and 32 + i (high). With AVX-512 the 32 bytes, each 16-byte half zero-extended to 16 lanes, give the four
   16-row vectors of the block's 64 codes; with AVX2 the two halves go through nib32 (rows 0-7, 8-15, 32-39, 40-47
   and 16-23, 24-31, 48-55, 56-63). */
#ifdef __AVX512F__
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));

/* the codes of one k of a 64-row block as fp32: rows 0-15, 16-31, 32-47, 48-63 */
static inline void nib64(const uint8_t *p, v16 *r0, v16 *r1, v16 *r2, v16 *r3) {
    const __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 16)));
    const __m512i m = _mm512_set1_epi32(15);
    *r0 = (v16)_mm512_cvtepi32_ps(_mm512_and_si512(a, m));
    *r1 = (v16)_mm512_cvtepi32_ps(_mm512_and_si512(b, m));
    *r2 = (v16)_mm512_cvtepi32_ps(_mm512_srli_epi32(a, 4));
    *r3 = (v16)_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
}
#define W4V 16 /* lanes of the widened product's vectors */
typedef v16 w4v;
typedef v16u w4vu;
#else
#define W4V 8
typedef v8 w4v;
typedef v8u w4vu;
#endif

/* one 64-row block's group codes (G inputs from k0) widened to fp32 into wb [G][64] in row order; a tail of nr < 64
   rows (pairwise: nr / 2 bytes per k) fills lanes 0..nr-1 and zeros the rest */
static void int4_widen64(const uint8_t *q, int nr, int64_t k0, int64_t G, float *wb) {
    if (nr == 64) {
        for (int64_t kk = 0; kk < G; ++kk) {
            const uint8_t *p = q + (k0 + kk) * 32;
            float *d = wb + kk * 64;
#ifdef __AVX512F__
            v16 r0, r1, r2, r3;
            nib64(p, &r0, &r1, &r2, &r3);
            *(v16u *)d = r0, *(v16u *)(d + 16) = r1, *(v16u *)(d + 32) = r2, *(v16u *)(d + 48) = r3;
#else
            v8 r0, r1, r2, r3;
            nib32(p, &r0, &r1, &r2, &r3);
            *(v8u *)d = r0, *(v8u *)(d + 8) = r1, *(v8u *)(d + 32) = r2, *(v8u *)(d + 40) = r3;
            nib32(p + 16, &r0, &r1, &r2, &r3);
            *(v8u *)(d + 16) = r0, *(v8u *)(d + 24) = r1, *(v8u *)(d + 48) = r2, *(v8u *)(d + 56) = r3;
#endif
        }
        return;
    }
    const int half = nr / 2;
    for (int64_t kk = 0; kk < G; ++kk) {
        const uint8_t *p = q + (k0 + kk) * half;
        float *d = wb + kk * 64;
        for (int j = 0; j < half; ++j) d[2 * j] = (float)(p[j] & 15), d[2 * j + 1] = (float)(p[j] >> 4);
        for (int r = nr; r < 64; ++r) d[r] = 0.0f;
    }
}

/* acc[b][c0 .. c0 + 4 W4V) = the G widened weights wb (columns c0..) against input rows b0, b0 + 1 (NB of them) */
static inline __attribute__((always_inline)) void int4_dots64(const float *wb, const float *x, int64_t K, int64_t k0,
                                                              int64_t G, int64_t b0, float acc[][64], const int NB,
                                                              const int c0) {
    w4v a[2][4] = {{{0}}};
    const float *x0 = x + b0 * K + k0, *x1 = x0 + K;
    for (int64_t kk = 0; kk < G; ++kk) {
        const float *w = wb + kk * 64 + c0;
        const float xa = x0[kk], xb = NB > 1 ? x1[kk] : 0.0f;
        for (int v = 0; v < 4; ++v) {
            const w4v wv = *(const w4vu *)(w + W4V * v);
            a[0][v] += wv * xa;
            if (NB > 1) a[1][v] += wv * xb;
        }
    }
    for (int j = 0; j < NB; ++j)
        for (int v = 0; v < 4; ++v) *(w4vu *)(acc[b0 + j] + c0 + W4V * v) = a[j][v];
}

#if defined(__AVX512BF16__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
#define INT4_BF16_PAIRS 1
/* bf16 inputs against a whole 64-row block on vdpbf16ps (AVX512-BF16): the 64 bytes of k and k + 1 (contiguous in the
   layout) permuted by two vpermt2b (AVX512-VBMI) into 16-bit lanes that pair each row's byte at k with its byte at
   k + 1 (rows 0-15 and 16-31), each nibble looked up as the bf16 of 0..15 (vpermw reads the low 5 bits of a lane
   and the table repeats 0..15, so the low nibble needs no mask and the high one a shift); then one vdpbf16ps per 16
   rows adds both k's products into fp32 lanes. The codes and the bf16 inputs are exact in bf16, their products
   exact in fp32: fp32 sums as the widening loop's, but 9 operations turn 128 codes into vdpbf16ps operands (4 of
   them) where widening takes 10 for 64 codes (and 4 FMAs): 2048x2048 on one Zen 4 core 200 -> 133 us. */
static const uint16_t I4_PAIR_IDX[32] __attribute__((aligned(64))) = {
    /* lane j: byte (j & 1) * 32 + j / 2 of the 64 (row j / 2 at k or k + 1) low, byte 64 (a zero) high */
    0x4000, 0x4020, 0x4001, 0x4021, 0x4002, 0x4022, 0x4003, 0x4023, 0x4004, 0x4024, 0x4005, 0x4025, 0x4006, 0x4026,
    0x4007, 0x4027, 0x4008, 0x4028, 0x4009, 0x4029, 0x400a, 0x402a, 0x400b, 0x402b, 0x400c, 0x402c, 0x400d, 0x402d,
    0x400e, 0x402e, 0x400f, 0x402f};
static const uint16_t I4_BF16[32] __attribute__((aligned(64))) = {
    /* bf16(i & 15) */
    0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0, 0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150,
    0x4160, 0x4170, 0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0, 0x4100, 0x4110, 0x4120, 0x4130,
    0x4140, 0x4150, 0x4160, 0x4170};

/* the codes of k and k + 1 (the 64 bytes at p) as bf16 pairs: lane i of r0 holds row i, r1 row 16 + i, r2 row 32 + i,
   r3 row 48 + i */
static inline __attribute__((always_inline)) void pairs64(const uint8_t *p, __m512i ia, __m512i ib, __m512i tab,
                                                          __m512i *r0, __m512i *r1, __m512i *r2, __m512i *r3) {
    const __m512i d = _mm512_loadu_si512((const void *)p), z = _mm512_setzero_si512();
    const __m512i a = _mm512_permutex2var_epi8(d, ia, z), b = _mm512_permutex2var_epi8(d, ib, z);
    *r0 = _mm512_permutexvar_epi16(a, tab);
    *r1 = _mm512_permutexvar_epi16(b, tab);
    *r2 = _mm512_permutexvar_epi16(_mm512_srli_epi16(a, 4), tab);
    *r3 = _mm512_permutexvar_epi16(_mm512_srli_epi16(b, 4), tab);
}

#define DP(acc, w, x) ((acc) = _mm512_dpbf16_ps((acc), (__m512bh)(w), (x)))

/* acc[b0 + j][0..64) = the group's codes (from p, G inputs) against input rows b0 + j < b0 + NB (their bf16 pairs
   xp, row stride K2); one input row: two k-pairs a step into 8 accumulators (vdpbf16ps' latency) */
static inline __attribute__((always_inline)) void int4_dots64_bf16(const uint8_t *p, const uint32_t *xp, int64_t K2,
                                                                   int64_t G, float acc[][64], int64_t b0,
                                                                   const int NB) {
    const __m512i ia = _mm512_load_si512((const void *)I4_PAIR_IDX), tab = _mm512_load_si512((const void *)I4_BF16);
    const __m512i ib = _mm512_add_epi16(ia, _mm512_set1_epi16(16));
    __m512 a[4][4], c[4];
    for (int j = 0; j < 4; ++j) {
        c[j] = _mm512_setzero_ps();
        for (int v = 0; v < 4; ++v) a[j][v] = _mm512_setzero_ps();
    }
    int64_t kk = 0;
    if (NB == 1)
        for (; kk + 4 <= G; kk += 4) {
            __m512i r0, r1, r2, r3;
            pairs64(p + kk * 32, ia, ib, tab, &r0, &r1, &r2, &r3);
            const __m512bh x0 = (__m512bh)_mm512_set1_epi32((int)xp[kk / 2]);
            DP(a[0][0], r0, x0), DP(a[0][1], r1, x0), DP(a[0][2], r2, x0), DP(a[0][3], r3, x0);
            pairs64(p + kk * 32 + 64, ia, ib, tab, &r0, &r1, &r2, &r3);
            const __m512bh x1 = (__m512bh)_mm512_set1_epi32((int)xp[kk / 2 + 1]);
            DP(c[0], r0, x1), DP(c[1], r1, x1), DP(c[2], r2, x1), DP(c[3], r3, x1);
        }
    for (; kk < G; kk += 2) {
        __m512i r0, r1, r2, r3;
        pairs64(p + kk * 32, ia, ib, tab, &r0, &r1, &r2, &r3);
        for (int j = 0; j < NB; ++j) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xp[j * K2 + kk / 2]);
            DP(a[j][0], r0, xv), DP(a[j][1], r1, xv), DP(a[j][2], r2, xv), DP(a[j][3], r3, xv);
        }
    }
    if (NB == 1)
        for (int v = 0; v < 4; ++v) a[0][v] = _mm512_add_ps(a[0][v], c[v]);
    for (int j = 0; j < NB; ++j)
        for (int v = 0; v < 4; ++v) _mm512_storeu_ps(acc[b0 + j] + 16 * v, a[j][v]);
}
#undef DP
#endif

/* out[b][r] = 64-row block nb's row r (r < the returned 64, 48, 32 or 16 rows) of the dequantised W against input
   row b; -1 when out of memory */
static int int4_block64(const Int4Mat *m, const Int4X *xs, int64_t nb, float out[][64]) {
    const int64_t K = m->K, G = m->G, ng = K / G, B = xs->B, row0 = nb * 64;
    const int nr = m->N - row0 >= 64 ? 64 : (int)(m->N - row0);
    const uint8_t *q = m->q + row0 * (K / 2);
    float acc[MAXB][64];
    float *wb = NULL;
#ifdef INT4_BF16_PAIRS
    const int pairs = xs->xp != NULL && nr == 64; /* bf16 inputs, a whole block: int4_dots64_bf16 */
#else
    const int pairs = 0;
#endif
    if ((B > 1 || nr < 64) && !pairs) {
        wb = w4_scratch(G * 64);
        if (!wb) return -1;
    }
    for (int64_t b = 0; b < B; ++b)
        for (int r = 0; r < 64; ++r) out[b][r] = 0.0f;
    for (int64_t gi = 0; gi < ng; ++gi) {
        const int64_t k0 = gi * G;
        if (pairs) {
#ifdef INT4_BF16_PAIRS
            /* up to 4 input rows at a time, the codes converted once for them */
            const uint8_t *p = q + k0 * 32;
            const uint32_t *xp = xs->xp + k0 / 2;
            const int64_t K2 = K / 2;
            int64_t b = 0;
            for (; b + 4 <= B; b += 4) int4_dots64_bf16(p, xp + b * K2, K2, G, acc, b, 4);
            if (B - b == 3) int4_dots64_bf16(p, xp + b * K2, K2, G, acc, b, 3);
            else if (B - b == 2) int4_dots64_bf16(p, xp + b * K2, K2, G, acc, b, 2);
            else if (B - b == 1) int4_dots64_bf16(p, xp + b * K2, K2, G, acc, b, 1);
#endif
        } else if (!wb) { /* one input row, a whole block: straight from the codes */
            const float *x = xs->x + k0;
            const uint8_t *p = q + k0 * 32;
#ifdef __AVX512F__
            /* two inputs a step, each into its own 4 accumulators of 16 rows: 8 chains of FMAs (G is even) */
            v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, c0 = {0}, c1 = {0}, c2 = {0}, c3 = {0};
            for (int64_t kk = 0; kk < G; kk += 2) {
                v16 r0, r1, r2, r3;
                nib64(p + kk * 32, &r0, &r1, &r2, &r3);
                const float xv = x[kk];
                a0 += r0 * xv, a1 += r1 * xv, a2 += r2 * xv, a3 += r3 * xv;
                nib64(p + kk * 32 + 32, &r0, &r1, &r2, &r3);
                const float xw = x[kk + 1];
                c0 += r0 * xw, c1 += r1 * xw, c2 += r2 * xw, c3 += r3 * xw;
            }
            *(v16u *)acc[0] = a0 + c0, *(v16u *)(acc[0] + 16) = a1 + c1, *(v16u *)(acc[0] + 32) = a2 + c2;
            *(v16u *)(acc[0] + 48) = a3 + c3;
#else
            /* one input a step into 8 accumulators of 8 rows: 8 chains of FMAs */
            v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};
            for (int64_t kk = 0; kk < G; ++kk) {
                v8 r0, r1, r2, r3;
                const float xv = x[kk];
                nib32(p + kk * 32, &r0, &r1, &r2, &r3); /* rows 0-7, 8-15, 32-39, 40-47 */
                a0 += r0 * xv, a1 += r1 * xv, a4 += r2 * xv, a5 += r3 * xv;
                nib32(p + kk * 32 + 16, &r0, &r1, &r2, &r3); /* rows 16-23, 24-31, 48-55, 56-63 */
                a2 += r0 * xv, a3 += r1 * xv, a6 += r2 * xv, a7 += r3 * xv;
            }
            float *o = acc[0];
            *(v8u *)o = a0, *(v8u *)(o + 8) = a1, *(v8u *)(o + 16) = a2, *(v8u *)(o + 24) = a3;
            *(v8u *)(o + 32) = a4, *(v8u *)(o + 40) = a5, *(v8u *)(o + 48) = a6, *(v8u *)(o + 56) = a7;
#endif
        } else {
            int4_widen64(q, nr, k0, G, wb);
            for (int c = 0; c < 64; c += 4 * W4V) {
                int64_t b = 0;
                for (; b + 2 <= B; b += 2) int4_dots64(wb, xs->x, K, k0, G, b, acc, 2, c);
                if (b < B) int4_dots64(wb, xs->x, K, k0, G, b, acc, 1, c);
            }
        }
        int4_group_out(m, xs, gi, row0, nr, acc[0], sizeof acc[0] / sizeof(float), out);
    }
    return nr;
}

/* out[b][r] = block nb's row r (r < the returned count) of the dequantised W against input row b, block nb of
   m->bn rows (the rows from nb * m->bn); -1 when out of memory */
static int int4_block(const Int4Mat *m, const Int4X *xs, int64_t nb, float out[][64]) {
    return m->bn == 64 ? int4_block64(m, xs, nb, out) : int4_block32(m, xs, nb, out);
}

/* x [B, K] (fp32 or bf16) as fp32, then each group's sum, in this thread's scratch */
static float *int4_load_x(const void *x, int xdt, int64_t B, int64_t K, int64_t G, Int4X *xs) {
    static _Thread_local float *buf = NULL;
    static _Thread_local int64_t cap = 0;
    const int64_t ng = K / G;
    float *xf = grow_scratch(&buf, &cap, B * K + B * ng + B * K / 2);
    if (!xf) return NULL;
    xs->xp = NULL;
#ifdef INT4_BF16_PAIRS
    if (xdt == DT_BF16) { /* the bf16 input as it is, two k a lane (K is even: a multiple of the even group) */
        uint32_t *xp = (uint32_t *)(xf + B * K + B * ng);
        memcpy(xp, x, (size_t)(B * K) * 2);
        xs->xp = xp;
    }
#endif
    for (int64_t i = 0; i < B * K; ++i) xf[i] = load_as_f32(x, xdt, i);
    float *sums = xf + B * K;
    for (int64_t b = 0; b < B; ++b)
        for (int64_t gi = 0; gi < ng; ++gi) {
            float s = 0.0f;
            for (int64_t k = 0; k < G; ++k) s += xf[b * K + gi * G + k];
            sums[b * ng + gi] = s;
        }
    xs->x = xf, xs->xsum = sums, xs->B = B;
    return xf;
}

static int int4_shape_ok(int64_t B, int64_t N, int64_t K, int64_t G, int bn) {
    return B >= 1 && B <= MAXB && N >= 16 && N % 16 == 0 && G >= 2 && G % 2 == 0 && G <= 1024 && K >= G && K % G == 0
           && (bn == 32 || bn == 64);
}

/* blocks of bn rows a chunk of the pool takes (chunk_rows' ~1/64 of the matrix, at least 32 KB) */
static int64_t int4_chunk_blocks(int64_t N, int64_t K, int bn) {
    const int64_t b = chunk_rows(N, K / 2) / bn;
    return b < 1 ? 1 : b;
}

typedef struct {
    Int4Mat m;
    Int4X xs;
    const void *bias, *res;
    void *y;
    int64_t blocks; /* per chunk */
    int bdt, ydt, act1;
} Int4Gemv;

static void int4_gemv_chunk(const void *job, int64_t chunk) {
    const Int4Gemv *g = job;
    const int bn = g->m.bn;
    const int64_t nblocks = (g->m.N + bn - 1) / bn, B = g->xs.B, N = g->m.N;
    const int64_t lo = chunk * g->blocks, hi = lo + g->blocks < nblocks ? lo + g->blocks : nblocks;
    float out[MAXB][64];
    for (int64_t nb = lo; nb < hi; ++nb) {
        const int nr = int4_block(&g->m, &g->xs, nb, out);
        if (nr < 0) continue; /* (out of memory for 2 KB-16 KB of scratch: the rows stay unwritten) */
        for (int r = 0; r < nr; ++r) {
            const int64_t n = nb * bn + r;
            const float bias = g->bias ? load_as_f32(g->bias, g->bdt, n) : 0.0f;
            for (int64_t b = 0; b < B; ++b) store_out(g->y, g->ydt, g->res, g->act1, b * N + n, out[b][r] + bias);
        }
    }
}

/* y[B, N] = act(x[B, K] W^T + bias[N]) + res[B, N] for int4 W (q, sz: see above; sdt its scale dtype; bn the
   layout's rows per block, 32 or 64) */
static int gemv_int4_act(const uint8_t *q, const void *sz, int sdt, int64_t G, const void *bias, int bdt,
                         const void *x, int xdt, const void *res, void *y, int ydt, int64_t B, int64_t N, int64_t K,
                         int act1, int bn) {
    if (!int4_shape_ok(B, N, K, G, bn) || (sdt != DT_F32 && sdt != DT_BF16)) return -1;
    Int4Gemv g = {{q, sz, N, K, G, sdt, bn}, {0}, bias, res, y, int4_chunk_blocks(N, K, bn), bdt, ydt, act1};
    if (!int4_load_x(x, xdt, B, K, G, &g.xs)) return -1;
    const int64_t nblocks = (N + bn - 1) / bn;
    pool_run(int4_gemv_chunk, &g, (nblocks + g.blocks - 1) / g.blocks);
    return 0;
}

/* y[B, N] = x[B, K] W^T + bias[N] + res[B, N] for torchao's int4 weight-only W in bn-row blocks (32: AVX2's layout,
   64: AVX512's). Returns 0, or -1 for arguments it cannot take (N not a multiple of 16, K not of the group, more
   than 64 rows, a scale dtype other than fp32/bf16, another block size). */
int hl_gemv_int4(const uint8_t *q, const void *sz, int sdt, int64_t G, const void *bias, int bdt, const void *x,
                 int xdt, const void *res, void *y, int ydt, int64_t B, int64_t N, int64_t K, int bn) {
    return gemv_int4_act(q, sz, sdt, G, bias, bdt, x, xdt, res, y, ydt, B, N, K, 0, bn);
}

/* ---- Mamba-2 SSD step -------------------------------------------------------------------------------------- */
/* One token per sequence: per (sequence b, head h) the state rows s[p][:] (P x N, fp32 or bf16 storage) become
   s * exp(dt A) + dt x[p] B, and y[p] = s . C + D x[p] — ssd_step_ref's arithmetic in one pass over the state
   (the torch path makes three). The heads of a group share B and C. */
typedef struct {
    void *state;
    const int64_t *slots;
    const void *x, *B, *C, *Dp;
    const float *dt, *A;
    void *y;
    int64_t xs, bs, cs, dts; /* batch strides in elements */
    int64_t H, P, N, G;
    int sdt, xdt, ddt;
} SsdStep;

static void ssd_step_chunk(const void *job, int64_t item) {
    const SsdStep *j = job;
    const int64_t b = item / j->H, h = item % j->H, g = h / (j->H / j->G), N = j->N, P = j->P;
    const int64_t row = j->slots ? j->slots[b] : b;
    float Bv[512], Cv[512], tmp[512];
    for (int64_t n = 0; n < N; ++n) {
        Bv[n] = load_as_f32(j->B, j->xdt, b * j->bs + g * N + n);
        Cv[n] = load_as_f32(j->C, j->xdt, b * j->cs + g * N + n);
    }
    const float dt = j->dt[b * j->dts + h];
    const float dA = expf(dt * j->A[h]);
    const float Dh = j->Dp ? load_as_f32(j->Dp, j->ddt, h) : 0.0f;
    const int64_t base = ((row * j->H + h) * P) * N;
    for (int64_t p = 0; p < P; ++p) {
        const float xp = load_as_f32(j->x, j->xdt, b * j->xs + h * P + p);
        const float u = dt * xp;
        /* the state row's dot with C in 16 lanes (two chains of 8), summed in a fixed order: the build keeps
           source order (no -funsafe-math-optimizations), so a scalar += here is one 128-long dependent chain,
           and the state step ran at a quarter of the L3's rate */
        v8 a0 = {0}, a1 = {0};
        int64_t n = 0;
        if (j->sdt == DT_F32) {
            float *s = (float *)j->state + base + p * N;
            for (; n + 16 <= N; n += 16) {
                const v8 v0 = *(const v8u *)(s + n) * dA + u * *(const v8u *)(Bv + n);
                const v8 v1 = *(const v8u *)(s + n + 8) * dA + u * *(const v8u *)(Bv + n + 8);
                *(v8u *)(s + n) = v0, *(v8u *)(s + n + 8) = v1;
                a0 += v0 * *(const v8u *)(Cv + n), a1 += v1 * *(const v8u *)(Cv + n + 8);
            }
            for (int64_t i = n; i < N; ++i) tmp[i] = s[i] = s[i] * dA + u * Bv[i];
        } else {
            uint16_t *s = (uint16_t *)j->state + base + p * N;
            for (int64_t i = 0; i < N; ++i) tmp[i] = bf16_to_f32(s[i]) * dA + u * Bv[i];
            for (int64_t i = 0; i < N; ++i) s[i] = f32_to_bf16(tmp[i]);
            for (; n + 16 <= N; n += 16)
                a0 += *(const v8u *)(tmp + n) * *(const v8u *)(Cv + n),
                a1 += *(const v8u *)(tmp + n + 8) * *(const v8u *)(Cv + n + 8);
        }
        float acc = hsum(a0 + a1);
        for (; n < N; ++n) acc += tmp[n] * Cv[n];
        const float out = acc + Dh * xp;
        const int64_t o = (b * j->H + h) * P + p;
        if (j->xdt == DT_BF16) ((uint16_t *)j->y)[o] = f32_to_bf16(out);
        else ((float *)j->y)[o] = out;
    }
}

int hl_ssd_step(void *state, int sdt, const int64_t *slots, const void *x, int xdt, int64_t xs, const float *dt,
                int64_t dts, const float *A, const void *B, int64_t bs, const void *C, int64_t cs, const void *Dp,
                int ddt, void *y, int64_t Bsz, int64_t H, int64_t P, int64_t N, int64_t G) {
    if (N > 512 || G < 1 || H % G) return -1;
    SsdStep j = {state, slots, x, B, C, Dp, dt, A, y, xs, bs, cs, dts, H, P, N, G, sdt, xdt, ddt};
    pool_run(ssd_step_chunk, &j, Bsz * H);
    return 0;
}

/* ---- Gated DeltaNet step ---------------------------------------------------------------------------------- */
/* One token per sequence: per (sequence b, value head h; key head h / (H / Hk)) the state S [K, V] (fp32 or
   bf16 storage) becomes a S + k delta^T with a = exp(g), delta = beta (v - a S^T k), and o = S'^T q scale —
   gated_delta_step_ref's arithmetic in two passes over the state (one read for S^T k, one update that also
   accumulates the output); a bf16 state is rounded once, on the store.
   Columns are independent, so the state goes through in column tiles whose d = S^T k and o stay in registers
   across all K rows (AVX-512: 128 columns, d and o in 16 zmm; else 32 columns in 8 of AVX2's 16 ymm, the tile's
   rows then in L1 for the second pass). With d and o in arrays, each 16 columns of a row cost a load and a store
   of d (pass 1) or of o (pass 2) besides the state's: 221 against 155 us at batch 8 on the Zen 4 (2 threads). */
typedef struct {
    void *state;
    const int64_t *slots;
    const void *q, *k, *v;
    const float *g, *beta;
    void *y;
    int64_t qs, vs, gs; /* batch strides in elements (q and k share one) */
    int64_t H, Hk, K, V;
    float scale;
    int sdt, xdt;
    int64_t Bsz;
    int nt; /* the pool's threads (spread_item) */
} GdnStep;

#ifdef __AVX512F__
#define GDN_LANES 16
#define GDN_TILE 8 /* vectors of a column tile */
typedef v16 gdn_v;
typedef v16u gdn_vu;
#else
#define GDN_LANES 8
#define GDN_TILE 4
typedef v8 gdn_v;
typedef v8u gdn_vu;
#endif

static inline __attribute__((always_inline)) gdn_v gdn_load(const void *s, int sdt, int64_t i) {
    if (sdt == DT_F32) return *(const gdn_vu *)((const float *)s + i);
#ifdef __AVX512F__
    return (gdn_v)_mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)s + i))), 16));
#else
    return load_w8(s, DT_BF16, i);
#endif
}

/* f32_to_bf16's rounding (nearest even, a NaN stays a NaN) in integer lanes, as f32_to_bf16 does: under
   -ffast-math GCC folds a float x != x to false. With AVX512-BF16, vcvtneps2bf16 rounds the same way (NaN
   included) but flushes denormals to zero, so it takes the vectors without a denormal: 155 against 117 us at
   batch 8 with a bf16 state (Zen 4, 2 threads, a probe of the step alone). */
static inline __attribute__((always_inline)) void gdn_store(void *s, int sdt, int64_t i, gdn_v v) {
    if (sdt == DT_F32) {
        *(gdn_vu *)((float *)s + i) = v;
        return;
    }
    uint16_t *p = (uint16_t *)s + i;
#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
    if (!_mm512_fpclass_ps_mask((__m512)v, 0x20)) { /* no denormal lane */
        _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh((__m512)v));
        return;
    }
#endif
#ifdef __AVX512F__
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(bf16_bits16((__m512)v)));
#elif defined(__AVX2__)
    bf16x8_store(p, (__m256)v);
#else
    for (int l = 0; l < GDN_LANES; ++l) p[l] = f32_to_bf16(v[l]);
#endif
}

/* columns c0 .. c0 + nv * GDN_LANES - 1 of one head's state (row i at s + i * V): d and o in registers; nv is a
   constant where the tile is full, so the unrolled loops keep them there */
static inline __attribute__((always_inline)) void gdn_tile(void *s, int sdt, int64_t K, int64_t V, int64_t c0, int nv,
                                                          const float *kv, const float *qv, const float *vv, float a,
                                                          float bt, float *o_out) {
    gdn_v d[GDN_TILE], o[GDN_TILE];
    for (int t = 0; t < GDN_TILE; ++t) d[t] = (gdn_v){0}, o[t] = (gdn_v){0};
    for (int64_t i = 0; i < K; ++i) { /* d = S^T k */
        const float ki = kv[i];
        for (int t = 0; t < GDN_TILE; ++t)
            if (t < nv) d[t] += gdn_load(s, sdt, i * V + c0 + t * GDN_LANES) * ki;
    }
    for (int t = 0; t < GDN_TILE; ++t)
        if (t < nv) d[t] = bt * (*(const gdn_vu *)(vv + c0 + t * GDN_LANES) - a * d[t]);
    for (int64_t i = 0; i < K; ++i) { /* S = a S + k d^T, o += S^T q */
        const float ki = kv[i], qi = qv[i];
        for (int t = 0; t < GDN_TILE; ++t)
            if (t < nv) {
                const int64_t at = i * V + c0 + t * GDN_LANES;
                const gdn_v n = gdn_load(s, sdt, at) * a + ki * d[t];
                gdn_store(s, sdt, at, n);
                o[t] += n * qi;
            }
    }
    for (int t = 0; t < GDN_TILE; ++t)
        if (t < nv) *(gdn_vu *)(o_out + c0 + t * GDN_LANES) = o[t];
}

/* a whole head: full tiles, a part tile, then the columns past the last full vector one at a time */
static inline __attribute__((always_inline)) void gdn_head(void *s, int sdt, int64_t K, int64_t V, const float *kv,
                                                          const float *qv, const float *vv, float a, float bt,
                                                          float *o) {
    const int64_t W = GDN_TILE * GDN_LANES;
    int64_t c0 = 0;
    for (; c0 + W <= V; c0 += W) gdn_tile(s, sdt, K, V, c0, GDN_TILE, kv, qv, vv, a, bt, o);
    const int rest = (int)((V - c0) / GDN_LANES);
    if (rest) gdn_tile(s, sdt, K, V, c0, rest, kv, qv, vv, a, bt, o), c0 += rest * GDN_LANES;
    for (int64_t c = c0; c < V; ++c) {
        float d = 0.0f, oc = 0.0f;
        for (int64_t i = 0; i < K; ++i) d += load_as_f32(s, sdt, i * V + c) * kv[i];
        d = bt * (vv[c] - a * d);
        for (int64_t i = 0; i < K; ++i) {
            const float n = load_as_f32(s, sdt, i * V + c) * a + kv[i] * d;
            store_as(s, sdt, i * V + c, n);
            oc += n * qv[i];
        }
        o[c] = oc;
    }
}

/* The item a chunk c of n takes where nt threads claim them: consecutive chunks (the ones the threads run at the
   same time) far apart, each thread then walking its own run of neighbouring items (c = r + nt m: residue r's
   items in order, after the lower residues'). */
static inline int64_t spread_item(int64_t c, int64_t n, int nt) {
    if (nt < 2 || n < 2 * nt) return c;
    const int64_t r = c % nt;
    int64_t first = 0;
    for (int64_t q = 0; q < r; ++q) first += (n - q + nt - 1) / nt;
    return first + c / nt;
}

static void gdn_step_chunk(const void *job, int64_t chunk) {
    const GdnStep *j = job;
    /* two threads on neighbouring heads cost 30%: 121-125 against 82-90 us at batch 8 (Zen 4, fp32, in a probe
       of this step alone), with the same arithmetic per head */
    const int64_t item = spread_item(chunk, j->Bsz * j->H, j->nt);
    const int64_t b = item / j->H, h = item % j->H, hk = h / (j->H / j->Hk), K = j->K, V = j->V;
    const int64_t row = j->slots ? j->slots[b] : b;
    float qv[512], kv[512], vv[512], o[512];
    for (int64_t i = 0; i < K; ++i) {
        qv[i] = load_as_f32(j->q, j->xdt, b * j->qs + hk * K + i) * j->scale;
        kv[i] = load_as_f32(j->k, j->xdt, b * j->qs + hk * K + i);
    }
    for (int64_t c = 0; c < V; ++c) vv[c] = load_as_f32(j->v, j->xdt, b * j->vs + h * V + c);
    const float a = expf(j->g[b * j->gs + h]), bt = j->beta[b * j->gs + h];
    const int64_t base = (row * j->H + h) * K * V;
    if (j->sdt == DT_F32) gdn_head((float *)j->state + base, DT_F32, K, V, kv, qv, vv, a, bt, o);
    else gdn_head((uint16_t *)j->state + base, DT_BF16, K, V, kv, qv, vv, a, bt, o);
    const int64_t out = (b * j->H + h) * V;
    for (int64_t c = 0; c < V; ++c) {
        if (j->xdt == DT_BF16) ((uint16_t *)j->y)[out + c] = f32_to_bf16(o[c]);
        else ((float *)j->y)[out + c] = o[c];
    }
}

int hl_gdn_step(void *state, int sdt, const int64_t *slots, const void *q, const void *k, int64_t qs, const void *v,
                int xdt, int64_t vs, const float *g, const float *beta, int64_t gs, float scale, void *y, int64_t Bsz,
                int64_t H, int64_t Hk, int64_t K, int64_t V) {
    if (K > 512 || V > 512 || Hk < 1 || H % Hk) return -1;
    GdnStep j = {state, slots, q, k, v, g, beta, y, qs, vs, gs, H, Hk, K, V, scale, sdt, xdt, Bsz, P.nworkers + 1};
    pool_run(gdn_step_chunk, &j, Bsz * H);
    return 0;
}

/* ---- causal conv1d step ------------------------------------------------------------------------------------ */
/* state [S, C, K-1] shifted by one token per sequence: the window is the state then x (rounded to the state's
   dtype first, as the reference concatenates them), y = window . w + bias, SiLU optional. */
typedef struct {
    void *state;
    const int64_t *slots;
    const void *x, *w, *bias;
    void *y;
    int64_t xs, C, K;
    int sdt, xdt, wdt, bdt, silu;
} ConvStep;

#define CONV_BLOCK 256 /* channels a chunk takes: a one-sequence step is still split across the threads */

#ifdef __AVX512F__
/* conv_step_chunk's width-4 conv (Mamba-2's) for channels c..c+n (n <= 16) of input row b, 16 lanes, into the sums
   out[0..n): the channels' 3 state values and 4 weights de-interleaved by permutes, a chain of FMAs from the bias
   over state 0..2 then x (the scalar loop's order; where GCC fused its products differently a sum moves by an
   ulp), the shifted state interleaved back (the same bits). Storage fp32 or (with AVX512-BW's 16-bit masked loads)
   bf16, each dtype fixed at compile time; a bf16 value widens exactly, and the state stored back holds only bf16
   values (its own and x rounded to the state's dtype), so it narrows exactly. A batch-32 hybrid-1to7-small step's
   conv took 223 us a layer in the scalar loop (32 x 1792 channels) on the 2-vCPU Zen 4; a bf16 conv of 1280
   channels through ops.conv_step (~4 us of it the Python call) 11.1 us in the eight-channel gathers, 6.9 here. */
static inline __attribute__((always_inline)) void conv_st16(void *p, int dt, int64_t i, __mmask16 m, __m512 v) {
#ifdef __AVX512BW__
    if (dt == DT_BF16) {
        _mm256_mask_storeu_epi16((uint16_t *)p + i, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
        return;
    }
#endif
    _mm512_mask_storeu_ps((float *)p + i, m, v);
}

static inline __attribute__((always_inline)) void conv4_x16(const ConvStep *j, int64_t b, int64_t row, int64_t c,
                                                             int64_t n, float *out, const int sdt, const int xdt,
                                                             const int wdt, const int bdt) {
    const int64_t s0 = (row * j->C + c) * 3, w0 = c * 4;
    const int64_t n3 = 3 * n, n4 = 4 * n;
    const __m512 S0 = load16_f32(j->state, sdt, s0, mask16(n3)), S1 = load16_f32(j->state, sdt, s0 + 16, mask16(n3 - 16)),
                 S2 = load16_f32(j->state, sdt, s0 + 32, mask16(n3 - 32));
    __m512 s[3], wk[4];
    for (int k = 0; k < 3; ++k) { /* s[k][i] = st[3i + k]: from S0 | S1 below 32, from S2 above (the low 4 bits) */
        const __m512i idx = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,
                                                                                  11, 12, 13, 14, 15),
                                                                _mm512_set1_epi32(3)), _mm512_set1_epi32(k));
        const __mmask16 hi = _mm512_cmpge_epi32_mask(idx, _mm512_set1_epi32(32));
        s[k] = _mm512_mask_permutexvar_ps(_mm512_permutex2var_ps(S0, idx, S1), hi, idx, S2);
    }
    const __m512 W0 = load16_f32(j->w, wdt, w0, mask16(n4)), W1 = load16_f32(j->w, wdt, w0 + 16, mask16(n4 - 16)),
                 W2 = load16_f32(j->w, wdt, w0 + 32, mask16(n4 - 32)), W3 = load16_f32(j->w, wdt, w0 + 48, mask16(n4 - 48));
    for (int k = 0; k < 4; ++k) { /* wk[k][i] = w[4i + k]: W0 | W1 for i < 8, W2 | W3 above */
        const __m512i idx = _mm512_add_epi32(_mm512_slli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,
                                                                                 11, 12, 13, 14, 15), 2),
                                             _mm512_set1_epi32(k));
        wk[k] = _mm512_mask_blend_ps((__mmask16)0xFF00, _mm512_permutex2var_ps(W0, idx, W1),
                                     _mm512_permutex2var_ps(W2, idx, W3));
    }
    const __mmask16 m = mask16(n);
    __m512 x = load16_f32(j->x, xdt, b * j->xs + c, m);
    if (sdt == DT_BF16 && xdt != DT_BF16) /* x as the state will hold it: rounded to bf16 */
        x = _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits16(x), 16));
    __m512 acc = j->bias ? load16_f32(j->bias, bdt, c, m) : _mm512_setzero_ps();
    for (int k = 0; k < 3; ++k) acc = _mm512_fmadd_ps(s[k], wk[k], acc);
    acc = _mm512_fmadd_ps(x, wk[3], acc);
    _mm512_mask_storeu_ps(out, m, acc);
    const __m512 src[3] = {s[1], s[2], x}; /* the new state: st[3i + k] = src[k][i] */
    /* position p = 16 o + l of the three output vectors: lane p / 3 of src[p % 3] (src[1]'s as index + 16, src[2]'s
       by the second permute, its lanes in from_x) */
    static const int32_t ti[3][16] = {{0, 16, 0, 1, 17, 1, 2, 18, 2, 3, 19, 3, 4, 20, 4, 5},
                                      {21, 5, 6, 22, 6, 7, 23, 7, 8, 24, 8, 9, 25, 9, 10, 26},
                                      {10, 11, 27, 11, 12, 28, 12, 13, 29, 13, 14, 30, 14, 15, 31, 15}};
    static const __mmask16 from_x[3] = {0x4924, 0x2492, 0x9249};
    for (int o = 0; o < 3; ++o) {
        const __m512i idx = _mm512_loadu_si512(ti[o]);
        const __m512 v = _mm512_mask_permutexvar_ps(_mm512_permutex2var_ps(src[0], idx, src[1]), from_x[o], idx, src[2]);
        conv_st16(j->state, sdt, s0 + 16 * o, mask16(n3 - 16 * o), v);
    }
}

/* conv4_x16 over channels c0..c1 for the dtype combinations it is compiled for; 0 where it takes none of them */
static int conv4_block(const ConvStep *j, int64_t b, int64_t row, int64_t c0, int64_t c1, float *sums) {
#define CONV4_CASE(S, X, W, B)                                                                                      \
    if (j->sdt == S && j->xdt == X && j->wdt == W && (!j->bias || j->bdt == B)) {                                  \
        for (int64_t c = c0; c < c1; c += 16)                                                                      \
            conv4_x16(j, b, row, c, c1 - c < 16 ? c1 - c : 16, sums + (c - c0), S, X, W, B);                      \
        return 1;                                                                                                   \
    }
    CONV4_CASE(DT_F32, DT_F32, DT_F32, DT_F32)
#ifdef __AVX512BW__
    CONV4_CASE(DT_BF16, DT_BF16, DT_BF16, DT_BF16)
    CONV4_CASE(DT_BF16, DT_F32, DT_F32, DT_F32)
    CONV4_CASE(DT_F32, DT_BF16, DT_BF16, DT_BF16)
#endif
#undef CONV4_CASE
    return 0;
}
#endif

/* conv_step_chunk's sums for channels c..c+8 of input row b, any storage dtypes (width K <= 9), into out[0..8):
   per channel the scalar loop's FMA chain from the bias over the state then x (the same bits), eight channels a
   vector (the interleaved state and weights gathered a value at a time); the state shifted and x appended */
static inline __attribute__((always_inline)) void conv_sums8_as(const ConvStep *j, int64_t b, int64_t row, int64_t c,
                                                                 float *out, const int sdt, const int wdt) {
    const int64_t K = j->K, K1 = K - 1, s0 = (row * j->C + c) * K1;
    v8 acc = {0};
    if (j->bias) acc = load_w8(j->bias, j->bdt, c);
    for (int64_t k = 0; k < K1; ++k) {
        v8 sv, wv;
        for (int i = 0; i < 8; ++i)
            sv[i] = load_as_f32(j->state, sdt, s0 + i * K1 + k), wv[i] = load_as_f32(j->w, wdt, (c + i) * K + k);
        acc += sv * wv;
    }
    const v8 x = round8_to(load_w8(j->x, j->xdt, b * j->xs + c), sdt);
    v8 wl;
    for (int i = 0; i < 8; ++i) wl[i] = load_as_f32(j->w, wdt, (c + i) * K + K1);
    acc += x * wl;
    *(v8u *)out = acc;
    if (K1 < 1) return;
    for (int i = 0; i < 8; ++i) { /* the state's stored values move down a place as they are (the same bits) */
        const int64_t r = s0 + i * K1;
        for (int64_t k = 0; k + 1 < K1; ++k) {
            if (sdt == DT_BF16) ((uint16_t *)j->state)[r + k] = ((const uint16_t *)j->state)[r + k + 1];
            else ((float *)j->state)[r + k] = ((const float *)j->state)[r + k + 1];
        }
        store_as(j->state, sdt, r + K1 - 1, x[i]);
    }
}

/* conv_sums8_as with the storage dtypes fixed at compile time (the gathers then straight loads, no dtype tests) */
static void conv_sums8(const ConvStep *j, int64_t b, int64_t row, int64_t c, float *out) {
    if (j->sdt == DT_BF16 && j->wdt == DT_BF16) conv_sums8_as(j, b, row, c, out, DT_BF16, DT_BF16);
    else if (j->sdt == DT_BF16) conv_sums8_as(j, b, row, c, out, DT_BF16, DT_F32);
    else if (j->wdt == DT_BF16) conv_sums8_as(j, b, row, c, out, DT_F32, DT_BF16);
    else conv_sums8_as(j, b, row, c, out, DT_F32, DT_F32);
}

static void conv_step_chunk(const void *job, int64_t item) {
    const ConvStep *j = job;
    const int64_t nblk = (j->C + CONV_BLOCK - 1) / CONV_BLOCK, b = item / nblk, c0 = (item % nblk) * CONV_BLOCK;
    const int64_t c1 = c0 + CONV_BLOCK < j->C ? c0 + CONV_BLOCK : j->C;
    const int64_t row = j->slots ? j->slots[b] : b, K1 = j->K - 1;
    /* the block's sums (the state shifted on the way), then SiLU over them at once, then the outputs */
    float sums[CONV_BLOCK];
    int64_t c = c0;
#ifdef __AVX512F__
    if (j->K == 4 && conv4_block(j, b, row, c0, c1, sums)) c = c1;
#endif
    for (; c + 8 <= c1 && K1 <= 8; c += 8) conv_sums8(j, b, row, c, sums + (c - c0));
    for (; c < c1; ++c) {
        const int64_t s0 = (row * j->C + c) * K1;
        float xin = load_as_f32(j->x, j->xdt, b * j->xs + c);
        if (j->sdt == DT_BF16) xin = bf16_to_f32(f32_to_bf16(xin));
        float acc = j->bias ? load_as_f32(j->bias, j->bdt, c) : 0.0f;
        for (int64_t k = 0; k < K1; ++k) {
            const float v = load_as_f32(j->state, j->sdt, s0 + k);
            acc += v * load_as_f32(j->w, j->wdt, c * j->K + k);
            if (k > 0) store_as(j->state, j->sdt, s0 + k - 1, v);
        }
        acc += xin * load_as_f32(j->w, j->wdt, c * j->K + K1);
        if (K1 > 0) store_as(j->state, j->sdt, s0 + K1 - 1, xin);
        sums[c - c0] = acc;
    }
    const int64_t n = c1 - c0;
    if (j->silu) {
#ifdef __AVX512F__
        if (j->xdt == DT_BF16) silu_bf16_exact(sums, n); /* rounded to bf16 next: libm's bits */
        else silu_f32(sums, n, 1.0f, 0.0f);
#else
        if (j->xdt == DT_F32) silu_f32(sums, n, 1.0f, 0.0f);
        else
            for (int64_t i = 0; i < n; ++i) sums[i] = sums[i] / (1.0f + expf(-sums[i]));
#endif
    }
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) store8_as(j->y, j->xdt, b * j->C + c0 + i, *(const v8u *)(sums + i));
    for (; i < n; ++i) store_as(j->y, j->xdt, b * j->C + c0 + i, sums[i]);
}

int hl_conv_step(void *state, int sdt, const int64_t *slots, const void *x, int xdt, int64_t xs, const void *w,
                 int wdt, const void *bias, int bdt, int silu, void *y, int64_t Bsz, int64_t C, int64_t K) {
    if (K < 1) return -1;
    ConvStep j = {state, slots, x, w, bias, y, xs, C, K, sdt, xdt, wdt, bdt, silu};
    pool_run(conv_step_chunk, &j, Bsz * ((C + CONV_BLOCK - 1) / CONV_BLOCK));
    return 0;
}

/* ---- paged decode attention ------------------------------------------------------------------------------- */
/* One query token per sequence over its paged K/V (fp32 or bf16 pools [NB, BS, Hkv, D]). A work item is one
   (sequence, KV head, span of PAGED_SPAN visible keys): the group's rep query heads score the span's keys in one
   pass over K (each key row widened once for all rep heads), then one pass over V sums the weighted values:
   each cached byte is read once, straight from its page (no gathered copy). A sequence of one span writes its
   output directly; a longer one (flash-decoding) leaves each span's max, sum and unnormalised values, and a
   second pass combines the spans in order (exp(m_s - max) rescales). The split depends on the lengths only,
   never on the thread count, so every call on the same inputs gives the same bits. With AVX-512 the scores are
   16 keys at a time (one zmm of partial products per key and head, summed across lanes by a transpose tree)
   and V is accumulated in register tiles of up to 4 heads x 64 lanes; elsewhere 8-lane dots and D-wide loops.
   The softmax's exponentials are libm's expf, one per score. */
#define PAGED_SPAN 256

typedef struct {
    const void *q, *k, *v;
    const int32_t *lens, *tables;
    void *out;
    int64_t tstride, Hq, Hkv, D, BS, window, Dp;
    float scale;
    int qdt, kvdt;
    const int64_t *start; /* [Bsz + 1]: the first item of each sequence (Hkv * its span count items) */
    float *part;          /* per item: m[rep], l[rep], acc[rep * Dp]; NULL when every sequence is one span */
    int64_t Bsz;
} PagedDecode;

static float *score_scratch(int64_t n) {
    static _Thread_local float *buf = NULL;
    static _Thread_local int64_t cap = 0;
    if (n > cap) {
        free(buf);
        int64_t want = n > 2 * cap ? n : 2 * cap;
        buf = aligned_alloc(64, ((want * 4 + 63) / 64) * 64);
        cap = buf ? want : 0;
    }
    return buf;
}

static inline int64_t paged_spans(const PagedDecode *j, int64_t b, int64_t *first) {
    const int64_t len = j->lens[b];
    *first = j->window > 0 && len > j->window ? len - j->window : 0;
    const int64_t n = len - *first;
    return n > PAGED_SPAN ? (n + PAGED_SPAN - 1) / PAGED_SPAN : 1;
}

static inline float dot_kv(const float *q, const void *kv, int kvdt, int64_t off, int64_t D) {
    v8 acc = {0};
    int64_t d = 0;
    if (kvdt == DT_F32) {
        const float *k = (const float *)kv + off;
        for (; d + 8 <= D; d += 8) acc += *(const v8u *)(q + d) * *(const v8u *)(k + d);
        float s = hsum(acc);
        for (; d < D; ++d) s += q[d] * k[d];
        return s;
    }
    const uint16_t *k = (const uint16_t *)kv + off;
    for (; d + 8 <= D; d += 8) acc += *(const v8u *)(q + d) * load_w8(k, DT_BF16, d);
    float s = hsum(acc);
    for (; d < D; ++d) s += q[d] * bf16_to_f32(k[d]);
    return s;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PAGED_AVX512 1
#define PD_INLINE static inline __attribute__((always_inline))

/* 16 fp32 of a K/V row from element off (lanes off the mask read as 0) */
PD_INLINE __m512 pd_load16(const void *base, int kvdt, int64_t off, __mmask16 mk) {
    if (kvdt == DT_F32) return _mm512_maskz_loadu_ps(mk, (const float *)base + off);
    const __m256i h = _mm256_maskz_loadu_epi16(mk, (const uint16_t *)base + off);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* lane i of the result = the sum of the 16 lanes of a[i] */
PD_INLINE __m512 pd_reduce16(const float *a) {
    __m512 t[8], u[4], w[2];
    for (int i = 0; i < 8; ++i) {
        const __m512 x = _mm512_load_ps(a + 32 * i), y = _mm512_load_ps(a + 32 * i + 16);
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
    }
    for (int i = 0; i < 4; ++i) {
        const __m512d x = _mm512_castps_pd(t[2 * i]), y = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; ++i)
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* heads r0..r0+RG of up to 16 keys (offs): their per-key partial products into tmp[RG][16][16], then the
   scores into s[r * cnt + i0 ..] */
PD_INLINE void pd_scores(int kvdt, int RG, const void *k, const float *qf, int64_t Dp, int64_t r0, const int64_t *offs,
                         int nk, __mmask16 tail, float *tmp, float *s, int64_t cnt, int64_t i0) {
    const int64_t NC = Dp / 16;
    for (int kk = 0; kk < nk; ++kk) {
        __m512 a[8];
        for (int r = 0; r < RG; ++r) a[r] = _mm512_setzero_ps();
        for (int64_t c = 0; c < NC; ++c) {
            const __m512 kc = pd_load16(k, kvdt, offs[kk] + 16 * c, c == NC - 1 ? tail : (__mmask16)0xffff);
            for (int r = 0; r < RG; ++r) a[r] = _mm512_fmadd_ps(_mm512_load_ps(qf + (r0 + r) * Dp + 16 * c), kc, a[r]);
        }
        for (int r = 0; r < RG; ++r) _mm512_store_ps(tmp + (r * 16 + kk) * 16, a[r]);
    }
    for (int kk = nk; kk < 16; ++kk)
        for (int r = 0; r < RG; ++r) _mm512_store_ps(tmp + (r * 16 + kk) * 16, _mm512_setzero_ps());
    const __mmask16 out = (__mmask16)((1u << nk) - 1);
    for (int r = 0; r < RG; ++r) _mm512_mask_storeu_ps(s + (r0 + r) * cnt + i0, out, pd_reduce16(tmp + r * 256));
}

/* acc[r][c0 * 16 ..] = sum over the span's keys of w[r][i] * V[i][c0 * 16 ..] for heads r0..r0+RG, CG chunks */
PD_INLINE void pd_values(int kvdt, int RG, int CG, const void *v, const float *w, int64_t cnt, int64_t r0, int64_t c0,
                         int64_t NC, __mmask16 tail, const int64_t *offs, float *acc, int64_t Dp) {
    __m512 a[4][4];
    __mmask16 mk[4];
    for (int c = 0; c < CG; ++c) mk[c] = c0 + c == NC - 1 ? tail : (__mmask16)0xffff;
    for (int r = 0; r < RG; ++r)
        for (int c = 0; c < CG; ++c) a[r][c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < cnt; ++i) {
        __m512 vc[4];
        for (int c = 0; c < CG; ++c) vc[c] = pd_load16(v, kvdt, offs[i] + 16 * (c0 + c), mk[c]);
        for (int r = 0; r < RG; ++r) {
            const __m512 wr = _mm512_set1_ps(w[(r0 + r) * cnt + i]);
            for (int c = 0; c < CG; ++c) a[r][c] = _mm512_fmadd_ps(wr, vc[c], a[r][c]);
        }
    }
    for (int r = 0; r < RG; ++r)
        for (int c = 0; c < CG; ++c) _mm512_storeu_ps(acc + (r0 + r) * Dp + 16 * (c0 + c), a[r][c]);
}

static void pd_scores_any(int kvdt, const void *k, const float *qf, int64_t Dp, int64_t rep, const int64_t *offs,
                          int nk, __mmask16 tail, float *tmp, float *s, int64_t cnt, int64_t i0) {
    for (int64_t r0 = 0; r0 < rep;) {
        const int64_t left = rep - r0;
#define PD_S(RG)                                                                                                     \
    do {                                                                                                             \
        if (kvdt == DT_F32) pd_scores(DT_F32, RG, k, qf, Dp, r0, offs, nk, tail, tmp, s, cnt, i0);                   \
        else pd_scores(DT_BF16, RG, k, qf, Dp, r0, offs, nk, tail, tmp, s, cnt, i0);                                 \
        r0 += RG;                                                                                                    \
    } while (0)
        if (left >= 8) PD_S(8);
        else if (left >= 4) PD_S(4);
        else if (left >= 2) PD_S(2);
        else PD_S(1);
#undef PD_S
    }
}

static void pd_values_any(int kvdt, const void *v, const float *w, int64_t cnt, int64_t rep, int64_t NC,
                          __mmask16 tail, const int64_t *offs, float *acc, int64_t Dp) {
    for (int64_t r0 = 0; r0 < rep;) {
        const int RG = rep - r0 >= 4 ? 4 : rep - r0 >= 2 ? 2 : 1;
        for (int64_t c0 = 0; c0 < NC;) {
            const int CG = NC - c0 >= 4 ? 4 : NC - c0 >= 2 ? 2 : 1;
#define PD_V(R, C)                                                                                                   \
    if (RG == R && CG == C) {                                                                                        \
        if (kvdt == DT_F32) pd_values(DT_F32, R, C, v, w, cnt, r0, c0, NC, tail, offs, acc, Dp);                     \
        else pd_values(DT_BF16, R, C, v, w, cnt, r0, c0, NC, tail, offs, acc, Dp);                                   \
    }
            PD_V(4, 4) PD_V(4, 2) PD_V(4, 1) PD_V(2, 4) PD_V(2, 2) PD_V(2, 1) PD_V(1, 4) PD_V(1, 2) PD_V(1, 1)
#undef PD_V
            c0 += CG;
        }
        r0 += RG;
    }
}
#endif

/* keys [lo, hi) of sequence b, KV head h: m[r] (their max score), l[r] (sum of exp(score - m)) and
   acc[r * Dp ..] (the exp-weighted sum of their values, not yet divided by l) */
static void paged_span(const PagedDecode *j, int64_t b, int64_t h, int64_t lo, int64_t hi, float *m, float *l,
                       float *acc) {
    const int64_t Hkv = j->Hkv, D = j->D, Dp = j->Dp, BS = j->BS, rep = j->Hq / Hkv;
    const int64_t cnt = hi - lo;
    const int32_t *table = j->tables + b * j->tstride;
    /* scores [rep][cnt], the scaled queries [rep][Dp] (zero padded), key offsets [cnt], 16x16 x 8 partials */
    float *s = score_scratch(rep * cnt + rep * Dp + 2 * cnt + 8 * 256 + 32);
    float *qf = (float *)(((uintptr_t)(s + rep * cnt) + 63) & ~(uintptr_t)63);
    float *tmp = qf + rep * Dp;
    int64_t *offs = (int64_t *)(tmp + 8 * 256);
    for (int64_t r = 0; r < rep; ++r)
        for (int64_t d = 0; d < Dp; ++d)
            qf[r * Dp + d] = d < D ? load_as_f32(j->q, j->qdt, (b * j->Hq + h * rep + r) * D + d) * j->scale : 0.0f;
    for (int64_t p = lo; p < hi; ++p) offs[p - lo] = (((int64_t)table[p / BS] * BS + p % BS) * Hkv + h) * D;
#ifdef PAGED_AVX512
    const int64_t NC = Dp / 16;
    const __mmask16 tail = (__mmask16)(D % 16 ? (1u << (D % 16)) - 1 : 0xffffu);
    for (int64_t i = 0; i < cnt; i += 16) {
        const int nk = cnt - i < 16 ? (int)(cnt - i) : 16;
        pd_scores_any(j->kvdt, j->k, qf, Dp, rep, offs + i, nk, tail, tmp, s, cnt, i);
    }
#else
    for (int64_t i = 0; i < cnt; ++i)
        for (int64_t r = 0; r < rep; ++r) s[r * cnt + i] = dot_kv(qf + r * Dp, j->k, j->kvdt, offs[i], D);
#endif
    for (int64_t r = 0; r < rep; ++r) {
        float *sr = s + r * cnt;
        float mx = -FLT_MAX; /* not -inf: -ffast-math assumes none */
        for (int64_t i = 0; i < cnt; ++i) mx = sr[i] > mx ? sr[i] : mx;
        float t = 0.0f;
        for (int64_t i = 0; i < cnt; ++i) {
            sr[i] = expf(sr[i] - mx);
            t += sr[i];
        }
        m[r] = mx, l[r] = t;
    }
#ifdef PAGED_AVX512
    pd_values_any(j->kvdt, j->v, s, cnt, rep, NC, tail, offs, acc, Dp);
#else
    for (int64_t r = 0; r < rep; ++r)
        for (int64_t d = 0; d < D; ++d) acc[r * Dp + d] = 0.0f;
    for (int64_t i = 0; i < cnt; ++i) {
        const int64_t off = offs[i];
        for (int64_t r = 0; r < rep; ++r) {
            const float w = s[r * cnt + i];
            float *a = acc + r * Dp;
            if (j->kvdt == DT_F32) {
                const float *vv = (const float *)j->v + off;
                for (int64_t d = 0; d < D; ++d) a[d] += w * vv[d];
            } else {
                const uint16_t *vv = (const uint16_t *)j->v + off;
                for (int64_t d = 0; d < D; ++d) a[d] += w * bf16_to_f32(vv[d]);
            }
        }
    }
#endif
}

static void paged_write(const PagedDecode *j, int64_t b, int64_t h, const float *acc, const float *l) {
    const int64_t D = j->D, Dp = j->Dp, rep = j->Hq / j->Hkv;
    for (int64_t r = 0; r < rep; ++r) {
        const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        const int64_t o = (b * j->Hq + h * rep + r) * D;
        for (int64_t d = 0; d < D; ++d) {
            const float val = acc[r * Dp + d] * inv;
            if (j->qdt == DT_BF16) ((uint16_t *)j->out)[o + d] = f32_to_bf16(val);
            else ((float *)j->out)[o + d] = val;
        }
    }
}

static inline int64_t paged_part_floats(const PagedDecode *j) { return (j->Hq / j->Hkv) * (2 + j->Dp); }

static void paged_decode_chunk(const void *job, int64_t item) {
    const PagedDecode *j = job;
    int64_t lo = 0, hi = j->Bsz; /* the sequence: start[b] <= item < start[b + 1] */
    while (hi - lo > 1) {
        const int64_t mid = (lo + hi) / 2;
        if (j->start[mid] <= item) lo = mid;
        else hi = mid;
    }
    const int64_t b = lo, rep = j->Hq / j->Hkv;
    int64_t first;
    const int64_t ns = paged_spans(j, b, &first), len = j->lens[b];
    const int64_t h = (item - j->start[b]) / ns, sp = (item - j->start[b]) % ns;
    const int64_t k0 = first + sp * PAGED_SPAN, k1 = k0 + PAGED_SPAN < len ? k0 + PAGED_SPAN : len;
    if (ns == 1) {
        static _Thread_local float *own = NULL; /* not score_scratch: paged_span's scores live there */
        static _Thread_local int64_t cap = 0;
        const int64_t need = paged_part_floats(j);
        if (need > cap) {
            free(own);
            own = aligned_alloc(64, ((need * 4 + 63) / 64) * 64);
            cap = own ? need : 0;
        }
        paged_span(j, b, h, k0, k1 > k0 ? k1 : k0, own, own + rep, own + 2 * rep);
        paged_write(j, b, h, own + 2 * rep, own + rep);
        return;
    }
    float *p = j->part + item * paged_part_floats(j);
    paged_span(j, b, h, k0, k1, p, p + rep, p + 2 * rep);
}

/* the spans of (sequence, KV head) item / Hkv, item % Hkv, combined in order */
static void paged_combine_chunk(const void *job, int64_t item) {
    const PagedDecode *j = job;
    const int64_t b = item / j->Hkv, h = item % j->Hkv, rep = j->Hq / j->Hkv, Dp = j->Dp;
    int64_t first;
    const int64_t ns = paged_spans(j, b, &first);
    if (ns == 1) return;
    const int64_t pf = paged_part_floats(j);
    const float *p0 = j->part + (j->start[b] + h * ns) * pf;
    float *acc = score_scratch(rep * (Dp + 1));
    float *l = acc + rep * Dp;
    for (int64_t r = 0; r < rep; ++r) {
        float mx = -FLT_MAX;
        for (int64_t s = 0; s < ns; ++s) mx = p0[s * pf + r] > mx ? p0[s * pf + r] : mx;
        float t = 0.0f;
        for (int64_t d = 0; d < Dp; ++d) acc[r * Dp + d] = 0.0f;
        for (int64_t s = 0; s < ns; ++s) {
            const float *p = p0 + s * pf;
            const float f = expf(p[r] - mx);
            t += f * p[rep + r];
            const float *a = p + 2 * rep + r * Dp;
            for (int64_t d = 0; d < Dp; ++d) acc[r * Dp + d] += f * a[d];
        }
        l[r] = t;
    }
    paged_write(j, b, h, acc, l);
}

int hl_paged_decode(const void *q, int qdt, const void *k, const void *v, int kvdt, const int32_t *lens,
                    const int32_t *tables, int64_t tstride, void *out, int64_t Bsz, int64_t Hq, int64_t Hkv,
                    int64_t D, int64_t BS, int64_t window, float scale) {
    if (Hkv < 1 || Hq % Hkv || Hq / Hkv > 64) return -1;
    if (Bsz < 1) return 0;
#ifdef PAGED_AVX512
    const int64_t Dp = (D + 15) / 16 * 16;
#else
    const int64_t Dp = D;
#endif
    static _Thread_local int64_t *start = NULL;
    static _Thread_local int64_t scap = 0;
    static _Thread_local float *part = NULL;
    static _Thread_local int64_t pcap = 0;
    if (Bsz + 1 > scap) {
        free(start);
        start = malloc((Bsz + 1) * sizeof *start);
        scap = start ? Bsz + 1 : 0;
        if (!start) return -1;
    }
    PagedDecode j = {q, k, v, lens, tables, out, tstride, Hq, Hkv, D, BS, window, Dp, scale, qdt, kvdt, start, NULL,
                     Bsz};
    int64_t first, split = 0;
    start[0] = 0;
    for (int64_t b = 0; b < Bsz; ++b) {
        const int64_t ns = paged_spans(&j, b, &first);
        split |= ns > 1;
        start[b + 1] = start[b] + Hkv * ns;
    }
    if (split) {
        const int64_t need = start[Bsz] * paged_part_floats(&j);
        if (need > pcap) {
            free(part);
            const int64_t want = need > 2 * pcap ? need : 2 * pcap;
            part = aligned_alloc(64, ((want * 4 + 63) / 64) * 64);
            pcap = part ? want : 0;
            if (!part) return -1;
        }
        j.part = part;
    }
    pool_run(paged_decode_chunk, &j, start[Bsz]);
    if (split) pool_run(paged_combine_chunk, &j, Bsz * Hkv);
    return 0;
}

/* ---- the pieces of a fused decode sub-layer ---------------------------------------------------------------- */
/* Each mirrors the rounding points of the torch layers it replaces (for bf16: every torch op rounds its
   output), so the fused step computes what the eager layers compute. */

/* RMSNorm (hybrid.layers.norm.RMSNorm): y = bf16?(x / rms(x)) * w, the norm in fp32. */
typedef struct {
    const void *x, *w;
    void *y;
    float eps;
    int64_t d;
    int xdt, wdt;
} RmsNorm;

static void rmsnorm_row(const void *job, int64_t b) {
    const RmsNorm *j = job;
    const int64_t d = j->d;
    const int xdt = j->xdt, wdt = j->wdt;
    const void *x = (const char *)j->x + b * d * (xdt == DT_BF16 ? 2 : 4);
    void *y = (char *)j->y + b * d * (xdt == DT_BF16 ? 2 : 4);
    const float inv = 1.0f / sqrtf((float)(sumsq_f64(x, xdt, d) / d) + j->eps);
    int64_t i = 0;
    for (; i + 8 <= d; i += 8)
        store8_as(y, xdt, i, round8_to(load_w8(x, xdt, i) * inv, xdt) * load_w8(j->w, wdt, i));
    for (; i < d; ++i) store_as(y, xdt, i, round_to(load_as_f32(x, xdt, i) * inv, xdt) * load_as_f32(j->w, wdt, i));
}

/* y = x / rms(x) * w per row (a batch's rows on the pool) */
void hl_rmsnorm(const void *x, int xdt, const void *w, int wdt, float eps, void *y, int64_t B, int64_t d) {
    RmsNorm j = {x, w, y, eps, d, xdt, wdt};
    if (B == 1) rmsnorm_row(&j, 0);
    else pool_run(rmsnorm_row, &j, B);
}

/* The gated MLP's first half (hybrid.layers.mlp.MLP): y = act(x Wg^T + bg) * (x Wu^T + bu), both matrices in
   one pass of the pool (each row pair read once). */
typedef struct {
    Gemv g, u;
    int act;
} GatedUp;

#ifdef __AVX512F__
/* gated_up_chunk for F32_BATCHED: an input row's 16 gates and ups as vectors where the output is fp32 and the
   activation SiLU (silu16_ps: silu_f32's bits); else the scalar steps from the transposed outputs */
static void gated_up_f32(const GatedUp *j, int64_t lo, int64_t hi) {
    const Gemv *g = &j->g, *u = &j->u;
    float OG[MAXB][16], OU[MAXB][16];
    const int vec = g->ydt == DT_F32 && j->act == ACT_SILU;
    for (int64_t n0 = lo; n0 < hi; n0 += 16) {
        const int nr = hi - n0 < 16 ? (int)(hi - n0) : 16;
        const __mmask16 m = mask16(nr);
        rows16_f32(g, n0, nr, OG);
        rows16_f32(u, n0, nr, OU);
        const __m512 bg = g->bias ? load16_f32(g->bias, g->bdt, n0, m) : _mm512_setzero_ps();
        const __m512 bu = u->bias ? load16_f32(u->bias, u->bdt, n0, m) : _mm512_setzero_ps();
        for (int64_t b = 0; b < g->B; ++b) {
            if (vec) {
                const __m512 a = silu16_ps(_mm512_add_ps(_mm512_loadu_ps(OG[b]), bg));
                _mm512_mask_storeu_ps((float *)g->y + b * g->N + n0, m,
                                      _mm512_mul_ps(a, _mm512_add_ps(_mm512_loadu_ps(OU[b]), bu)));
                continue;
            }
            for (int64_t n = n0; n < n0 + nr; ++n) {
                const float bgn = g->bias ? load_as_f32(g->bias, g->bdt, n) : 0.0f;
                const float bun = u->bias ? load_as_f32(u->bias, u->bdt, n) : 0.0f;
                const float a = round_to(activate(round_to(OG[b][n - n0] + bgn, g->ydt), j->act), g->ydt);
                store_as(g->y, g->ydt, b * g->N + n, a * round_to(OU[b][n - n0] + bun, g->ydt));
            }
        }
    }
}
#endif

static void gated_up_chunk(const void *job, int64_t chunk) {
    const GatedUp *j = job;
    const Gemv *g = &j->g, *u = &j->u;
    const int64_t lo = chunk * g->rows, hi = lo + g->rows < g->N ? lo + g->rows : g->N;
#ifdef __AVX512F__
    if (F32_BATCHED(g, g->wdt)) {
        gated_up_f32(j, lo, hi);
        return;
    }
#endif
    float OG[16][MAXB], OU[16][MAXB];
    const int vsilu = g->ydt == DT_F32 && j->act == ACT_SILU;
    AMX_BEGIN(g);
    if (one_row_streaming(g) && !vsilu) { /* (an fp32 SiLU keeps the blocks: silu_f32 takes 16 lanes at a time) */
#ifdef __AVX512F__
        if (j->act == ACT_SILU && g->ydt == DT_BF16) { /* 16 rows' gates, then their SiLU at once (libm's bits) */
            float gv[16], uv[16];
            for (int64_t n0 = lo; n0 < hi; n0 += 16) {
                const int nr = hi - n0 < 16 ? (int)(hi - n0) : 16;
                for (int r = 0; r < nr; ++r) {
                    float og, ou;
                    dot_row(g, n0 + r, &og, g->wdt);
                    dot_row(u, n0 + r, &ou, g->wdt);
                    gv[r] = round_to(row_value(g, n0 + r, og), DT_BF16);
                    uv[r] = round_to(row_value(u, n0 + r, ou), DT_BF16);
                }
                silu_bf16_exact(gv, nr);
                for (int r = 0; r < nr; ++r) store_as(g->y, DT_BF16, n0 + r, round_to(gv[r], DT_BF16) * uv[r]);
            }
            return;
        }
#endif
        for (int64_t n = lo; n < hi; ++n) {
            float og, ou;
            dot_row(g, n, &og, g->wdt);
            dot_row(u, n, &ou, g->wdt);
            const float a = round_to(activate(round_to(row_value(g, n, og), g->ydt), j->act), g->ydt);
            store_as(g->y, g->ydt, n, a * round_to(row_value(u, n, ou), g->ydt));
        }
        return;
    }
    for (int64_t n0 = lo; n0 < hi; n0 += 16)
    for (int64_t n = n0, nr = hi - n0 < 16 ? hi - n0 : 16; n < n0 + nr; ++n) {
        const float sg = g->wdt == DT_I8 ? g->scale[n] : 1.0f, su = u->wdt == DT_I8 ? u->scale[n] : 1.0f;
        const float bg = g->bias ? load_as_f32(g->bias, g->bdt, n) : 0.0f;
        const float bu = u->bias ? load_as_f32(u->bias, u->bdt, n) : 0.0f;
        if (n == n0) {
            if (g->wdt == DT_F32) dot_rows16(g, n0, (int)nr, OG, DT_F32), dot_rows16(u, n0, (int)nr, OU, DT_F32);
            else if (g->wdt == DT_BF16)
                dot_rows16(g, n0, (int)nr, OG, DT_BF16), dot_rows16(u, n0, (int)nr, OU, DT_BF16);
            else dot_rows16(g, n0, (int)nr, OG, DT_I8), dot_rows16(u, n0, (int)nr, OU, DT_I8);
            if (vsilu) /* each gate row's activations at once (silu_f32): OG then holds them */
                for (int64_t r = 0; r < nr; ++r)
                    silu_f32(OG[r], g->B, g->wdt == DT_I8 ? g->scale[n0 + r] : 1.0f,
                             g->bias ? load_as_f32(g->bias, g->bdt, n0 + r) : 0.0f);
        }
        const float *og = OG[n - n0], *ou = OU[n - n0];
        for (int64_t b = 0; b < g->B; ++b) {
            const float a = vsilu ? og[b] : round_to(activate(round_to(og[b] * sg + bg, g->ydt), j->act), g->ydt);
            store_as(g->y, g->ydt, b * g->N + n, a * round_to(ou[b] * su + bu, g->ydt));
        }
    }
}

int hl_gated_up(const void *wg, const float *sg, const void *bg, const void *wu, const float *su, const void *bu,
                int wdt, int bdt, const void *x, int xdt, void *y, int act, int64_t B, int64_t N, int64_t K) {
    if (B < 1 || B > MAXB) return -1;
    float *xf = load_x(x, xdt, B, K, wdt);
    if (!xf) return -1;
    const int64_t wsize = wdt == DT_F32 ? 4 : wdt == DT_BF16 ? 2 : 1;
    const int64_t rows = chunk_rows(N, 2 * K * wsize);
    const uint16_t *xb = bf16_x(x, xdt, wdt, B, K);
    const uint32_t *xt = amx_pack_x(x, xdt, wdt, B, K);
    GatedUp j = {{wg, sg, bg, NULL, y, xf, N, K, B, rows, wdt, bdt, xdt, 0, xb, xt},
                 {wu, su, bu, NULL, y, xf, N, K, B, rows, wdt, bdt, xdt, 0, xb, xt}, act};
    pool_run(gated_up_chunk, &j, (N + rows - 1) / rows);
    return 0;
}

/* Attention's projections (hybrid.layers.attention.Attention.qkv + write_kv): q, k, v from one pass of the pool
   over the three matrices, a chunk per head; RoPE (rotate-half, the first rot channels of each head) on q and
   k with the step's cos/sin [B, rot] (in the model's dtype); q to q_out [B, Hq, D], k and v straight into
   their slots of the K/V pools [NB * BS, Hkv, D] (fp32 or bf16). */
typedef struct {
    Gemv m[3];
    void *kpool, *vpool;
    const int64_t *slots;
    const void *cos, *sin;
    int64_t Hq, Hkv, D, rot;
    int pdt;
    int int4;          /* the matrices are int4 (q4, xs4; m[] keeps their biases, outputs and shapes) */
    Int4Mat q4[3];
    Int4X xs4;
} QkvRope;

/* RoPE on a q or k head's values acc[b][0..D) (rotate-half, the first rot channels, the step's cos/sin), then the
   head stored: q into q_out, k and v into their K/V pool slots (which: 0 q, 1 k, 2 v) */
static void qkv_rope_store(const QkvRope *j, int which, int64_t h, float acc[][512]) {
    const Gemv *g = &j->m[which];
    const int64_t D = j->D, rot = j->rot, half = rot / 2, B = g->B;
    const int ydt = g->ydt;
    for (int64_t b = 0; b < B; ++b) {
        float *v = acc[b];
        if (which < 2 && rot) {
            float tmp[512];
            for (int64_t d = 0; d < rot; ++d) {
                const float c = load_as_f32(j->cos, ydt, b * rot + d), s = load_as_f32(j->sin, ydt, b * rot + d);
                const float r = d < half ? -v[d + half] : v[d - half];
                tmp[d] = round_to(round_to(v[d] * c, ydt) + round_to(r * s, ydt), ydt);
            }
            for (int64_t d = 0; d < rot; ++d) v[d] = tmp[d];
        }
        if (which == 0) {
            for (int64_t d = 0; d < D; ++d) store_as(g->y, ydt, (b * j->Hq + h) * D + d, v[d]);
        } else {
            void *pool = which == 1 ? j->kpool : j->vpool;
            const int64_t base = (j->slots[b] * j->Hkv + h) * D;
            for (int64_t d = 0; d < D; ++d) store_as(pool, j->pdt, base + d, v[d]);
        }
    }
}

static void qkv_rope_chunk(const void *job, int64_t head) {
    const QkvRope *j = job;
    const int which = head < j->Hq ? 0 : head < j->Hq + j->Hkv ? 1 : 2;
    const int64_t h = which == 0 ? head : which == 1 ? head - j->Hq : head - j->Hq - j->Hkv;
    const Gemv *g = &j->m[which];
    const int64_t D = j->D, B = g->B;
    float acc[MAXB][512], outs[16][MAXB];
    AMX_BEGIN(g);
    if (j->int4) { /* the bn-row blocks the head's rows fall in (D % 16 == 0; a block that holds rows of two or
                      more heads, D % bn != 0, is computed for each) */
        float out4[MAXB][64];
        const int bn = j->q4[which].bn;
        for (int64_t nb = h * D / bn; nb * bn < h * D + D; ++nb) {
            const int nr = int4_block(&j->q4[which], &j->xs4, nb, out4);
            for (int r = 0; r < nr; ++r) {
                const int64_t n = nb * bn + r, d = n - h * D;
                if (d < 0 || d >= D) continue;
                const float bias = g->bias ? load_as_f32(g->bias, g->bdt, n) : 0.0f;
                for (int64_t b = 0; b < B; ++b) acc[b][d] = round_to(out4[b][r] + bias, g->ydt);
            }
        }
    }
#ifdef __AVX512F__
    if (!j->int4 && F32_BATCHED(g, g->wdt)) { /* the head's rows 16 at a time, transposed: acc[b] as vectors */
        float outT[MAXB][16];
        for (int64_t d0 = 0; d0 < D; d0 += 16) {
            const int nr = D - d0 < 16 ? (int)(D - d0) : 16;
            const __mmask16 m = mask16(nr);
            rows16_f32(g, h * D + d0, nr, outT);
            const __m512 bias = g->bias ? load16_f32(g->bias, g->bdt, h * D + d0, m) : _mm512_setzero_ps();
            for (int64_t b = 0; b < B; ++b) {
                if (g->ydt == DT_F32) {
                    _mm512_mask_storeu_ps(acc[b] + d0, m, _mm512_add_ps(_mm512_loadu_ps(outT[b]), bias));
                    continue;
                }
                for (int c = 0; c < nr; ++c)
                    acc[b][d0 + c] = round_to(
                        outT[b][c] + (g->bias ? load_as_f32(g->bias, g->bdt, h * D + d0 + c) : 0.0f), g->ydt);
            }
        }
        qkv_rope_store(j, which, h, acc);
        return;
    }
#endif
    if (!j->int4 && one_row_streaming(g)) {
        for (int64_t d = 0; d < D; ++d) {
            float out;
            dot_row(g, h * D + d, &out, g->wdt);
            acc[0][d] = round_to(row_value(g, h * D + d, out), g->ydt);
        }
        qkv_rope_store(j, which, h, acc);
        return;
    }
    for (int64_t d = 0; d < D && !j->int4; ++d) {
        const int64_t n = h * D + d;
        if (d % 16 == 0) {
            const int nr = D - d < 16 ? (int)(D - d) : 16;
            if (g->wdt == DT_F32) dot_rows16(g, n, nr, outs, DT_F32);
            else if (g->wdt == DT_BF16) dot_rows16(g, n, nr, outs, DT_BF16);
            else dot_rows16(g, n, nr, outs, DT_I8);
        }
        const float *out = outs[d % 16];
        const float sc = g->wdt == DT_I8 ? g->scale[n] : 1.0f;
        const float bias = g->bias ? load_as_f32(g->bias, g->bdt, n) : 0.0f;
        for (int64_t b = 0; b < B; ++b) acc[b][d] = round_to(out[b] * sc + bias, g->ydt);
    }
    qkv_rope_store(j, which, h, acc);
}

int hl_qkv_rope(const void *wq, const void *bq, const void *wk, const void *bk, const void *wv, const void *bv,
                const float *sq, const float *sk, const float *sv, int wdt, int bdt, const void *x, int xdt, void *q_out, void *kpool, void *vpool, int pdt,
                const int64_t *slots, const void *cos, const void *sin, int64_t rot, int64_t B, int64_t Hq,
                int64_t Hkv, int64_t D, int64_t K) {
    if (B < 1 || B > MAXB || D > 512 || rot > D || rot % 2) return -1;
    float *xf = load_x(x, xdt, B, K, wdt);
    if (!xf) return -1;
    const uint16_t *xb = bf16_x(x, xdt, wdt, B, K);
    const uint32_t *xt = amx_pack_x(x, xdt, wdt, B, K);
    QkvRope j = {{{wq, sq, bq, NULL, q_out, xf, Hq * D, K, B, D, wdt, bdt, xdt, 0, xb, xt},
                  {wk, sk, bk, NULL, NULL, xf, Hkv * D, K, B, D, wdt, bdt, xdt, 0, xb, xt},
                  {wv, sv, bv, NULL, NULL, xf, Hkv * D, K, B, D, wdt, bdt, xdt, 0, xb, xt}},
                 kpool, vpool, slots, cos, sin, Hq, Hkv, D, rot, pdt};
    pool_run(qkv_rope_chunk, &j, Hq + 2 * Hkv);
    return 0;
}

/* hl_qkv_rope for int4 q/k/v weights (one group size, scale dtype and block size bn for the three; head_dim a
   multiple of 16, the int4pack layout's granularity) */
int hl_qkv_rope_int4(const uint8_t *qq, const void *szq, const void *bq, const uint8_t *qk, const void *szk,
                     const void *bk, const uint8_t *qv, const void *szv, const void *bv, int sdt, int64_t G, int bdt,
                     const void *x, int xdt, void *q_out, void *kpool, void *vpool, int pdt, const int64_t *slots,
                     const void *cos, const void *sin, int64_t rot, int64_t B, int64_t Hq, int64_t Hkv, int64_t D,
                     int64_t K, int bn) {
    if (D > 512 || D % 16 || rot > D || rot % 2 || !int4_shape_ok(B, Hkv * D, K, G, bn) || Hq < 1
        || (sdt != DT_F32 && sdt != DT_BF16))
        return -1;
    QkvRope j = {{{NULL, NULL, bq, NULL, q_out, NULL, Hq * D, K, B, D, DT_NONE, bdt, xdt, 0},
                  {NULL, NULL, bk, NULL, NULL, NULL, Hkv * D, K, B, D, DT_NONE, bdt, xdt, 0},
                  {NULL, NULL, bv, NULL, NULL, NULL, Hkv * D, K, B, D, DT_NONE, bdt, xdt, 0}},
                 kpool, vpool, slots, cos, sin, Hq, Hkv, D, rot, pdt, 1,
                 {{qq, szq, Hq * D, K, G, sdt, bn}, {qk, szk, Hkv * D, K, G, sdt, bn}, {qv, szv, Hkv * D, K, G, sdt, bn}},
                 {0}};
    if (!int4_load_x(x, xdt, B, K, G, &j.xs4)) return -1;
    pool_run(qkv_rope_chunk, &j, Hq + 2 * Hkv);
    return 0;
}

/* hl_gated_up for int4 gate/up weights: y = act(x Wg^T + bg) * (x Wu^T + bu), a chunk of blocks (32 or 64 rows,
   the layout's) of both matrices at a time, the rounding points of gated_up_chunk */
typedef struct {
    Int4Mat g, u;
    Int4X xs;
    const void *bg, *bu;
    void *y;
    int64_t blocks;
    int bdt, ydt, act;
} GatedUp4;

static void gated_up4_chunk(const void *job, int64_t chunk) {
    const GatedUp4 *j = job;
    const int bn = j->g.bn;
    const int64_t N = j->g.N, nblocks = (N + bn - 1) / bn, B = j->xs.B;
    const int64_t lo = chunk * j->blocks, hi = lo + j->blocks < nblocks ? lo + j->blocks : nblocks;
    float OG[MAXB][64], OU[MAXB][64];
    for (int64_t nb = lo; nb < hi; ++nb) {
        const int nr = int4_block(&j->g, &j->xs, nb, OG);
        if (nr < 0 || int4_block(&j->u, &j->xs, nb, OU) < 0) continue;
        for (int r = 0; r < nr; ++r) {
            const int64_t n = nb * bn + r;
            const float bg = j->bg ? load_as_f32(j->bg, j->bdt, n) : 0.0f;
            const float bu = j->bu ? load_as_f32(j->bu, j->bdt, n) : 0.0f;
            for (int64_t b = 0; b < B; ++b) {
                const float a = round_to(activate(round_to(OG[b][r] + bg, j->ydt), j->act), j->ydt);
                store_as(j->y, j->ydt, b * N + n, a * round_to(OU[b][r] + bu, j->ydt));
            }
        }
    }
}

int hl_gated_up_int4(const uint8_t *qg, const void *szg, const void *bg, const uint8_t *qu, const void *szu,
                     const void *bu, int sdt, int64_t G, int bdt, const void *x, int xdt, void *y, int act, int64_t B,
                     int64_t N, int64_t K, int bn) {
    if (!int4_shape_ok(B, N, K, G, bn) || (sdt != DT_F32 && sdt != DT_BF16)) return -1;
    const int64_t blocks = (int4_chunk_blocks(N, K, bn) + 1) / 2; /* two matrices a block */
    GatedUp4 j = {{qg, szg, N, K, G, sdt, bn}, {qu, szu, N, K, G, sdt, bn}, {0}, bg, bu, y, blocks < 1 ? 1 : blocks,
                  bdt, xdt, act};
    if (!int4_load_x(x, xdt, B, K, G, &j.xs)) return -1;
    pool_run(gated_up4_chunk, &j, ((N + bn - 1) / bn + j.blocks - 1) / j.blocks);
    return 0;
}

/* Mamba-2's gated RMSNorm (hybrid.layers.norm.GatedRMSNorm) over groups of the d_inner channels, y [B, d]
   from y and the gate z (z's rows with stride zs): norm(y * silu(z)) or, norm_before_gate, norm(y) * silu(z);
   all in fp32, rounded once at the end. */
typedef struct {
    const void *y, *z, *w;
    void *out;
    float eps;
    int64_t zs, groups, d;
    int dt, wdt, norm_before_gate;
} GatedRmsNorm;

static void gated_rmsnorm_row(const void *job, int64_t b) {
    const GatedRmsNorm *j = job;
    const void *y = j->y, *z = j->z, *w = j->w;
    void *out = j->out;
    const float eps = j->eps;
    const int64_t zs = j->zs, d = j->d, gs = d / j->groups;
    const int dt = j->dt, wdt = j->wdt, norm_before_gate = j->norm_before_gate;
    const int64_t es = dt == DT_BF16 ? 2 : 4;
    float gate[8192], buf[8192];
    for (int64_t g0 = 0; g0 < d; g0 += gs) {
        const void *zg = (const char *)z + (b * zs + g0) * es, *yg = (const char *)y + (b * d + g0) * es;
        void *og = (char *)out + (b * d + g0) * es;
        const void *wg = (const char *)w + g0 * (wdt == DT_BF16 ? 2 : 4);
        /* the gates: silu_f32's 16 lanes where AVX-512 is (bf16 as fp32 alike: this norm's value is rounded once,
           at the end, after the group's sum, so no rounding point of torch's is kept by libm's expf here), else
           libm's */
        for (int64_t i = 0; i < gs; ++i) gate[i] = load_as_f32(zg, dt, i);
#ifdef __AVX512F__
        silu_f32(gate, gs, 1.0f, 0.0f);
#else
        if (dt == DT_F32) silu_f32(gate, gs, 1.0f, 0.0f);
        else
            for (int64_t i = 0; i < gs; ++i) gate[i] = gate[i] / (1.0f + expf(-gate[i]));
#endif
        /* buf: what is normalised (y * gate, or y) */
        int64_t i = 0;
        for (; i + 8 <= gs; i += 8) {
            const v8 yv = load_w8(yg, dt, i);
            *(v8u *)(buf + i) = norm_before_gate ? yv : *(const v8u *)(gate + i) * yv;
        }
        for (; i < gs; ++i) buf[i] = norm_before_gate ? load_as_f32(yg, dt, i) : gate[i] * load_as_f32(yg, dt, i);
        const float inv = 1.0f / sqrtf((float)(sumsq_f64(buf, DT_F32, gs) / gs) + eps);
        for (i = 0; i + 8 <= gs; i += 8) {
            const v8 v = *(const v8u *)(buf + i), wv = load_w8(wg, wdt, i);
            store8_as(og, dt, i, norm_before_gate ? v * inv * wv * *(const v8u *)(gate + i) : v * inv * wv);
        }
        for (; i < gs; ++i)
            store_as(og, dt, i, norm_before_gate ? buf[i] * inv * load_as_f32(wg, wdt, i) * gate[i]
                                                 : buf[i] * inv * load_as_f32(wg, wdt, i));
    }
}

/* Mamba-2's gated RMSNorm per row (a batch's rows on the pool) */
void hl_gated_rmsnorm(const void *y, const void *z, int64_t zs, int dt, const void *w, int wdt, float eps,
                      int64_t groups, int norm_before_gate, void *out, int64_t B, int64_t d) {
    GatedRmsNorm j = {y, z, w, out, eps, zs, groups, d, dt, wdt, norm_before_gate};
    if (B == 1) gated_rmsnorm_row(&j, 0);
    else pool_run(gated_rmsnorm_row, &j, B);
}

/* Mamba-2's dt and A (hybrid.layers.mamba2.Mamba2.dt_A) for a decode step: dt [B, H] = softplus(dt_raw +
   dt_bias) (torch's softplus: x above 20 kept as it is), clamped to [lo, hi] with clamp; A [H] =
   -exp(A_log). fp32 out. */
void hl_mamba2_dt(const void *dt_raw, int xdt, int64_t dts, const void *dt_bias, int bdt, const void *A_log, int adt,
                  float lo, float hi, int clamp, float *dt_out, float *A_out, int64_t B, int64_t H) {
    for (int64_t h = 0; h < H; ++h) A_out[h] = -expf(load_as_f32(A_log, adt, h));
    for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < H; ++h) {
            const float v = load_as_f32(dt_raw, xdt, b * dts + h) + load_as_f32(dt_bias, bdt, h);
            float sp = v > 20.0f ? v : log1pf(expf(v));
            if (clamp) sp = sp < lo ? lo : sp > hi ? hi : sp;
            dt_out[b * H + h] = sp;
        }
}

/* ---- int8-activation products: torchao's int8dq and 8da4w (hybrid.quantize) --------------------------------------
   Each input row is quantised to int8 once per product (into the caller's scratch), as torchao quantises it, and
   the weights meet it in integer dot products (llama.cpp's Q8_0 / Q4_0 arithmetic: _mm256_maddubs_epi16 +
   _mm256_madd_epi16, 32 weights in ~6 instructions where widening every code to fp32 took ~4x as many).

   int8dq (torchao's Int8Tensor with dynamic activations): weights int8 [N, K] with a fp32 scale per row (codes
   -128..127); each input row symmetric per row: s = max|x| / 127.5 (in x's dtype), q = clamp(rint(x * (1/s)),
   -128, 127). y = bf16?((float)(q . w) * s) * ws[n] + bias, torchao's int_scaled_matmul then its row-scale
   multiply: exact, the dot is an integer. The dot uses the sign trick maddubs(|w|, sign(q, w)): |w| <= 128 as an
   unsigned byte is exact, and with |q| <= 127 a pair sums to at most 2 * 128 * 127 = 32512 (no int16
   saturation). q = -128 happens (x = -max|x| gives -127.5, rounded to even: -128) and would overflow the sign
   flip: such codes go in as -127 and the row's dot subtracts their weights (q . w = q' . w - sum w[k], k over
   those positions: one or a few per row).

   8da4w (torchao's IntxUnpackedToInt8Tensor, int4 weights in symmetric groups of 32, int8 asymmetric per-token
   activations): the values -8..7 repacked once (hybrid.quantize.pack_8da4w) into nibbles, group g of row n at
   bytes (n * K/32 + g) * 16: byte j holds k = j (low nibble) and k = j + 16 (high), each stored + 8; fp32
   scales [N, K/32] per group followed by C [N], C[n] = sum_g ws_g * sum_k w_k (one buffer: one pointer). Each input row: s = (max(x, 0) - min(x, 0)) / 255,
   zp = -128 - rint(min(x, 0) / s) and q = clamp(rint(x * (1/s)) + zp, -128, 127), every op rounded to x's dtype
   as torch's are; u = q + 128 (0..255, unsigned) meets the signed int4 values in maddubs (pairs at most
   2 * 255 * 8 = 4080) and x . W = s * (sum_g ws_g * (u . w)_g - (128 + zp) * C[n]): the group products are
   integers, their scaled sum fp32 (torchao's F.linear on the dequantised tensors sums the same terms in
   another order). */

enum { QK_I8DQ = 0, QK_8DA4W = 1 };

/* the value v as computed: -ffast-math may otherwise reassociate a*b*c or contract a*b + c into an FMA, and the
   int8dq epilogue and the activations' quantisation must round where torch rounds */
static inline float exact(float v) {
#if defined(__x86_64__) || defined(__i386__)
    __asm__("" : "+x"(v));
#elif defined(__aarch64__)
    __asm__("" : "+w"(v));
#else
    volatile float t = v;
    v = t;
#endif
    return v;
}

typedef struct {
    int kind;
    const int8_t *w;    /* int8dq: codes [N, K] */
    const uint8_t *w4;  /* 8da4w: nibbles [N, K/2] (layout above) */
    const float *ws;    /* int8dq: row scales [N]; 8da4w: group scales [N, K/32] */
    const float *wsum;  /* 8da4w: C [N] (ws + N K/32) */
    int64_t N, K;
} QMat;

typedef struct {
    const int8_t *q;     /* int8dq: codes [B, K], -128 entered as -127; 8da4w: u = codes + 128 [B, K] */
    const float *s;      /* [B] */
    const int32_t *zp;   /* [B] (8da4w) */
    const int32_t *fix;  /* [B, K]: int8dq's positions of -128 codes, nfix[b] of them per row */
    const int64_t *nfix;
    const uint8_t *up;   /* 8da4w on AVX512-VNNI: u in blocks of four groups (w4_block_input), K/128 blocks a row */
    const int32_t *c8;   /* and each block's 16 lane corrections, [B, K/128, 16] */
    int64_t B, K;
} QAct;

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define W4_VNNI 1
/* 8da4w with vpdpbusd takes four groups (128 k, 64 bytes of nibbles) a step. A 64-byte load of the nibbles
   masked (& 15) gives the four groups' first 16 values in k order, shifted (>> 4 & 15) their last 16, so the
   input is laid out to match: per block the four groups' codes k 0..15 (64 bytes), then their codes k 16..31.
   Lane l of a dpbusd then sums group l/4's products, and the nibbles' +8 comes off exactly by starting each lane
   at -8 times the sum of the codes it meets (c8): (u . n) - 8 sum u = u . (n - 8), no subtraction per weight. */
static void w4_block_input(const uint8_t *u, int64_t K, uint8_t *up, int32_t *c8) {
    for (int64_t blk = 0; blk < K / 128; ++blk) {
        const uint8_t *s = u + blk * 128;
        uint8_t *d = up + blk * 128;
        for (int j = 0; j < 4; ++j) {
            memcpy(d + j * 16, s + j * 32, 16);
            memcpy(d + 64 + j * 16, s + j * 32 + 16, 16);
        }
        for (int l = 0; l < 16; ++l) {
            int32_t t = 0;
            for (int i = 0; i < 4; ++i) t += d[l * 4 + i] + d[64 + l * 4 + i];
            c8[blk * 16 + l] = -8 * t;
        }
    }
}
#endif

/* the scratch an op's quantised rows live in (the calling thread's; its workers read it) */
static int q_load_x(const void *x, int xdt, int64_t B, int64_t K, int kind, QAct *a) {
    static _Thread_local float *buf = NULL;
    static _Thread_local int64_t cap = 0;
    const int64_t qbytes = (B * K + 63) & ~(int64_t)63;
    float *base = grow_scratch(&buf, &cap, qbytes / 4 + B * K + 4 * B + 16);
    if (!base) return 0;
    int8_t *q = (int8_t *)base;
    int32_t *fix = (int32_t *)(base + qbytes / 4);
    float *s = (float *)(fix + B * K);
    int32_t *zp = (int32_t *)(s + B);
    int64_t *nfix = (int64_t *)(((uintptr_t)(zp + B) + 7) & ~(uintptr_t)7);
    for (int64_t b = 0; b < B; ++b) {
        const int64_t off = b * K;
        int8_t *qb = q + off;
        if (kind == QK_I8DQ) { /* torchao: choose_qparams_affine(SYMMETRIC, eps = fp32 eps) + quantize_affine */
            float amax = 0.0f;
            for (int64_t k = 0; k < K; ++k) {
                const float v = fabsf(load_as_f32(x, xdt, off + k));
                amax = v > amax ? v : amax;
            }
            float sc = round_to(exact(amax / exact(127.5f)), xdt); /* computed in x's dtype, kept as fp32 */
            if (sc < FLT_EPSILON) sc = round_to(FLT_EPSILON, xdt);
            const float inv = exact(1.0f / sc);
            int64_t nf = 0;
            for (int64_t k = 0; k < K; ++k) {
                float r = rintf(exact(load_as_f32(x, xdt, off + k) * inv));
                r = r < -128.0f ? -128.0f : r > 127.0f ? 127.0f : r;
                if (r == -128.0f) fix[off + nf++] = (int32_t)k, r = -127.0f;
                qb[k] = (int8_t)r;
            }
            s[b] = sc, zp[b] = 0, nfix[b] = nf;
        } else { /* torchao: choose_qparams_affine(ASYMMETRIC, scale in x's dtype, eps = its smallest normal) */
            float mn = 0.0f, mx = 0.0f;
            for (int64_t k = 0; k < K; ++k) {
                const float v = load_as_f32(x, xdt, off + k);
                mn = v < mn ? v : mn;
                mx = v > mx ? v : mx;
            }
            float sc = round_to(exact(round_to(exact(mx - mn), xdt) / exact(255.0f)), xdt);
            if (sc < FLT_MIN) sc = FLT_MIN;
            float z = -128.0f - rintf(round_to(exact(mn / sc), xdt));
            z = z < -128.0f ? -128.0f : z > 127.0f ? 127.0f : z;
            const float inv = round_to(exact(1.0f / sc), xdt);
            for (int64_t k = 0; k < K; ++k) {
                float r = rintf(round_to(exact(load_as_f32(x, xdt, off + k) * inv), xdt)) + z;
                r = r < -128.0f ? -128.0f : r > 127.0f ? 127.0f : r;
                ((uint8_t *)qb)[k] = (uint8_t)((int)r + 128);
            }
            s[b] = sc, zp[b] = (int32_t)z, nfix[b] = 0;
        }
    }
    a->q = q, a->s = s, a->zp = zp, a->fix = fix, a->nfix = nfix, a->B = B, a->K = K;
    a->up = NULL, a->c8 = NULL;
#ifdef W4_VNNI
    if (kind != QK_I8DQ) { /* fix's B K int32 are free here: the blocked codes (B K bytes), then c8 (B K / 2 bytes) */
        uint8_t *up = (uint8_t *)fix;
        int32_t *c8 = (int32_t *)(up + B * K);
        for (int64_t b = 0; b < B; ++b)
            w4_block_input((const uint8_t *)q + b * K, K, up + b * K, c8 + b * (K / 128) * 16);
        a->up = up, a->c8 = c8;
    }
#endif
    return 1;
}

#ifdef __AVX2__
static inline int32_t hsum_i32(__m256i v) {
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
    return _mm_cvtsi128_si32(t);
}

/* a 8da4w group's 32 nibbles as signed bytes -8..7, k order */
static inline __m256i nib_group(const uint8_t *p) {
    const __m128i t = _mm_loadu_si128((const __m128i *)p);
    const __m256i v = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(15));
    return _mm256_sub_epi8(v, _mm256_set1_epi8(8));
}
#endif

/* int8dq: the integer dot of weight row w with the codes q (-128 entered as -127) */
static inline int32_t i8dq_dot(const int8_t *w, const int8_t *q, int64_t K) {
    int64_t k = 0;
    int32_t dot = 0;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    /* vpdpbusd multiplies unsigned bytes by signed ones, 64 pairs an instruction (the AVX2 sign trick takes three
       instructions per 32): q . w = (q + 128) . w - 128 sum w, with q + 128 = q ^ 0x80 as an unsigned byte and
       sum w from a second vpdpbusd against ones. Exact integers, the AVX2 path's result. */
    const __m512i flip = _mm512_set1_epi8((char)0x80), ones = _mm512_set1_epi8(1);
    __m512i acc = _mm512_setzero_si512(), sum = _mm512_setzero_si512();
    for (; k + 64 <= K; k += 64) {
        STREAM_PREFETCH((const char *)(w + k), 1);
        const __m512i wv = _mm512_loadu_si512((const void *)(w + k));
        acc = _mm512_dpbusd_epi32(acc, _mm512_xor_si512(_mm512_loadu_si512((const void *)(q + k)), flip), wv);
        sum = _mm512_dpbusd_epi32(sum, ones, wv);
    }
    dot = _mm512_reduce_add_epi32(_mm512_sub_epi32(acc, _mm512_slli_epi32(sum, 7))); /* one reduction, not two */
#elif defined(__AVX2__)
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();
    for (; k + 64 <= K; k += 64) {
        /* the codes prefetched ahead, as the float products' weights */
        STREAM_PREFETCH((const char *)(w + k), 1);
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)(w + k)),
                      w1 = _mm256_loadu_si256((const __m256i *)(w + k + 32));
        const __m256i q0 = _mm256_loadu_si256((const __m256i *)(q + k)),
                      q1 = _mm256_loadu_si256((const __m256i *)(q + k + 32));
        a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w0),
                                                                        _mm256_sign_epi8(q0, w0)), ones));
        a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w1),
                                                                        _mm256_sign_epi8(q1, w1)), ones));
    }
    for (; k + 32 <= K; k += 32) {
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)(w + k)),
                      q0 = _mm256_loadu_si256((const __m256i *)(q + k));
        a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w0),
                                                                        _mm256_sign_epi8(q0, w0)), ones));
    }
    dot = hsum_i32(_mm256_add_epi32(a0, a1));
#endif
    for (; k < K; ++k) dot += (int32_t)w[k] * q[k];
    return dot;
}

/* 8da4w: sum_g ws_g * (u . w)_g of one row against one input row u (codes + 128) */
static inline float w4_dot(const uint8_t *p, const float *ws, const uint8_t *u, int64_t ng) {
#ifdef __AVX2__
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 2 <= ng; g += 2) { /* two groups a step: two FMA chains */
        STREAM_PREFETCH((const char *)(p + g * 16), 1);
        const __m256i d0 = _mm256_madd_epi16(
            _mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i *)(u + g * 32)), nib_group(p + g * 16)), ones);
        const __m256i d1 = _mm256_madd_epi16(
            _mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i *)(u + g * 32 + 32)), nib_group(p + g * 16 + 16)),
            ones);
        a0 = _mm256_fmadd_ps(_mm256_set1_ps(ws[g]), _mm256_cvtepi32_ps(d0), a0);
        a1 = _mm256_fmadd_ps(_mm256_set1_ps(ws[g + 1]), _mm256_cvtepi32_ps(d1), a1);
    }
    for (; g < ng; ++g) {
        const __m256i d0 = _mm256_madd_epi16(
            _mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i *)(u + g * 32)), nib_group(p + g * 16)), ones);
        a0 = _mm256_fmadd_ps(_mm256_set1_ps(ws[g]), _mm256_cvtepi32_ps(d0), a0);
    }
    return hsum((v8)_mm256_add_ps(a0, a1));
#else
    float acc = 0.0f;
    for (int64_t g = 0; g < ng; ++g) {
        int32_t d = 0;
        for (int j = 0; j < 16; ++j) {
            const int8_t lo = (int8_t)((p[g * 16 + j] & 15) - 8), hi = (int8_t)((p[g * 16 + j] >> 4) - 8);
            d += lo * (int32_t)u[g * 32 + j] + hi * (int32_t)u[g * 32 + 16 + j];
        }
        acc += ws[g] * (float)d;
    }
    return acc;
#endif
}

#ifdef W4_VNNI
/* nr (1..4) 8da4w rows at p (row stride K/2 bytes; scales ws, stride ng) against input row b of a: the group-
   scaled dots sum_g ws_g (u . w)_g into d[r]; whole blocks of four groups by vpdpbusd (see w4_block_input), the
   groups after the last whole block by w4_dot */
static inline __attribute__((always_inline)) void w4_dots_vnni(const uint8_t *p, const float *ws, const QAct *a,
                                                               int64_t b, const int nr, float d[4]) {
    const int64_t K = a->K, ng = K / 32, nblk = K / 128;
    const uint8_t *up = a->up + b * K;
    const int32_t *c8 = a->c8 + b * nblk * 16;
    const __m512i m15 = _mm512_set1_epi8(15);
    const __m512i idx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    __m512 acc[4];
    for (int r = 0; r < nr; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t blk = 0; blk < nblk; ++blk) {
        const __m512i lo_u = _mm512_loadu_si512((const void *)(up + blk * 128)),
                      hi_u = _mm512_loadu_si512((const void *)(up + blk * 128 + 64)),
                      c = _mm512_loadu_si512((const void *)(c8 + blk * 16));
        for (int r = 0; r < nr; ++r) {
            const uint8_t *pr = p + r * (K / 2) + blk * 64;
            STREAM_PREFETCH(pr, 1);
            const __m512i t = _mm512_loadu_si512((const void *)pr);
            const __m512i lo = _mm512_and_si512(t, m15), hi = _mm512_and_si512(_mm512_srli_epi16(t, 4), m15);
            const __m512i dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(c, lo_u, lo), hi_u, hi);
            const __m512 sc = _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_loadu_ps(ws + r * ng + blk * 4)));
            acc[r] = _mm512_fmadd_ps(sc, _mm512_cvtepi32_ps(dot), acc[r]);
        }
    }
    const int64_t g0 = nblk * 4;
    for (int r = 0; r < nr; ++r) {
        d[r] = _mm512_reduce_add_ps(acc[r]);
        if (g0 < ng)
            d[r] += w4_dot(p + r * (K / 2) + g0 * 16, ws + r * ng + g0, (const uint8_t *)a->q + b * K + g0 * 32,
                           ng - g0);
    }
}
#endif

/* 8da4w row n's output for input row b from its group-scaled dot d */
static inline float w4_out(const QMat *m, const QAct *a, int64_t n, int64_t b, float d) {
    return exact(a->s[b] * exact(d - (float)(128 + a->zp[b]) * m->wsum[n]));
}

/* out[b] = row n of W against input row b before the bias: int8dq torchao's bf16?(dot * s_b) * ws[n] (ydt: the
   output's dtype, where torchao rounds the first product), 8da4w s_b * (sum_g ... - (128 + zp_b) C[n]) */
/* int8dq row n's output for input row b from its integer dot over the entered codes: the -128 codes' weights taken
   off (they went in as -127), then torchao's scaling */
static inline float i8dq_out(const QMat *m, const QAct *a, int64_t n, int64_t b, int32_t dot, int ydt) {
    const int8_t *w = m->w + n * m->K;
    const int32_t *fx = a->fix + b * m->K;
    for (int64_t i = 0; i < a->nfix[b]; ++i) dot -= w[fx[i]];
    return exact(round_to(exact((float)dot * a->s[b]), ydt) * m->ws[n]);
}

static void q_row(const QMat *m, const QAct *a, int64_t n, int ydt, float *out) {
    const int64_t K = m->K;
    if (m->kind == QK_I8DQ) {
        for (int64_t b = 0; b < a->B; ++b) out[b] = i8dq_out(m, a, n, b, i8dq_dot(m->w + n * K, a->q + b * K, K), ydt);
        return;
    }
    const int64_t ng = K / 32;
    for (int64_t b = 0; b < a->B; ++b) { /* (a batch re-reads the row's 16 KB or less from L1) */
#ifdef W4_VNNI
        float d[4];
        w4_dots_vnni(m->w4 + n * (K / 2), m->ws + n * ng, a, b, 1, d);
        out[b] = w4_out(m, a, n, b, d[0]);
#else
        out[b] = w4_out(m, a, n, b, w4_dot(m->w4 + n * (K / 2), m->ws + n * ng, (const uint8_t *)a->q + b * K, ng));
#endif
    }
}

/* Rows n..n+nr-1 (nr <= 4) of W against the input rows: out[r][b]. Four int8dq rows against one input row take one
   pass (the input's codes loaded and flipped once for the four, i8dq_dot's exact integer arithmetic); otherwise
   q_row each. */
static void q_rows(const QMat *m, const QAct *a, int64_t n, int64_t nr, int ydt, float out[4][MAXB]) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    if (m->kind == QK_I8DQ && a->B == 1 && nr == 4) {
        const int64_t K = m->K;
        const int8_t *w = m->w + n * K, *q = a->q;
        const __m512i flip = _mm512_set1_epi8((char)0x80), ones = _mm512_set1_epi8(1);
        __m512i acc[4], sum[4];
        for (int r = 0; r < 4; ++r) acc[r] = sum[r] = _mm512_setzero_si512();
        int64_t k = 0;
        for (; k + 64 <= K; k += 64) {
            const __m512i u = _mm512_xor_si512(_mm512_loadu_si512((const void *)(q + k)), flip);
            for (int r = 0; r < 4; ++r) {
                STREAM_PREFETCH((const char *)(w + r * K + k), 1);
                const __m512i wv = _mm512_loadu_si512((const void *)(w + r * K + k));
                acc[r] = _mm512_dpbusd_epi32(acc[r], u, wv);
                sum[r] = _mm512_dpbusd_epi32(sum[r], ones, wv);
            }
        }
        for (int r = 0; r < 4; ++r) {
            const int8_t *wr = w + r * K;
            int32_t dot = _mm512_reduce_add_epi32(_mm512_sub_epi32(acc[r], _mm512_slli_epi32(sum[r], 7)));
            for (int64_t t = k; t < K; ++t) dot += (int32_t)wr[t] * q[t];
            out[r][0] = i8dq_out(m, a, n + r, 0, dot, ydt);
        }
        return;
    }
#endif
#ifdef W4_VNNI
    if (m->kind == QK_8DA4W && nr == 4) { /* four rows a pass for each input row (the rows re-read from L1) */
        const int64_t ng = m->K / 32;
        for (int64_t b = 0; b < a->B; ++b) {
            float d[4];
            w4_dots_vnni(m->w4 + n * (m->K / 2), m->ws + n * ng, a, b, 4, d);
            for (int r = 0; r < 4; ++r) out[r][b] = w4_out(m, a, n + r, b, d[r]);
        }
        return;
    }
#endif
    for (int64_t r = 0; r < nr; ++r) q_row(m, a, n + r, ydt, out[r]);
}

typedef struct {
    QMat m;
    QAct a;
    const void *bias, *res;
    void *y;
    int64_t rows;
    int bdt, ydt, act1;
} QGemv;

static void q_gemv_chunk(const void *job, int64_t chunk) {
    const QGemv *g = job;
    const int64_t N = g->m.N, lo = chunk * g->rows, hi = lo + g->rows < N ? lo + g->rows : N;
    float outs[4][MAXB];
    for (int64_t n = lo; n < hi; ++n) {
        if ((n - lo) % 4 == 0) q_rows(&g->m, &g->a, n, hi - n < 4 ? hi - n : 4, g->ydt, outs); /* 4 at a time */
        const float *out = outs[(n - lo) % 4];
        const float bias = g->bias ? load_as_f32(g->bias, g->bdt, n) : 0.0f;
        for (int64_t b = 0; b < g->a.B; ++b) store_out(g->y, g->ydt, g->res, g->act1, b * N + n, exact(out[b] + bias));
    }
}

static QMat q_mat(int kind, const void *w, const float *ws, int64_t N, int64_t K) {
    QMat m = {kind, NULL, NULL, ws, NULL, N, K};
    if (kind == QK_I8DQ) m.w = w;
    else m.w4 = w, m.wsum = ws + N * (K / 32);
    return m;
}

static int q_shape_ok(int kind, int64_t B, int64_t N, int64_t K) {
    return B >= 1 && B <= MAXB && N >= 1 && K >= 1 && (kind == QK_I8DQ || (kind == QK_8DA4W && K % 32 == 0));
}

static int64_t q_row_bytes(int kind, int64_t K) { return kind == QK_I8DQ ? K : K / 2 + K / 8; }

/* y[B, N] = act(x[B, K] W^T + bias[N]) + res[B, N] for an int8dq (codes, row scales) or 8da4w (nibbles, group
   scales then C) W; kind QK_*;
   act1: 0 none, else ACT_* + 1 */
static int gemv_q_act(int kind, const void *w, const float *ws, const void *bias, int bdt, const void *x, int xdt,
                      const void *res, void *y, int ydt, int64_t B, int64_t N, int64_t K, int act1) {
    if (!q_shape_ok(kind, B, N, K)) return -1;
    QGemv g = {q_mat(kind, w, ws, N, K), {0}, bias, res, y, chunk_rows(N, q_row_bytes(kind, K)), bdt, ydt, act1};
    if (!q_load_x(x, xdt, B, K, kind, &g.a)) return -1;
    pool_run(q_gemv_chunk, &g, (N + g.rows - 1) / g.rows);
    return 0;
}

/* y[B, N] = x[B, K] W^T + bias[N] + res[B, N] for an int8dq / 8da4w W (see gemv_q_act). Returns 0, or -1 for
   arguments it cannot take (more than 64 rows, an 8da4w K not a multiple of 32). */
int hl_gemv_q(int kind, const void *w, const float *ws, const void *bias, int bdt, const void *x, int xdt,
              const void *res, void *y, int ydt, int64_t B, int64_t N, int64_t K) {
    return gemv_q_act(kind, w, ws, bias, bdt, x, xdt, res, y, ydt, B, N, K, 0);
}

/* attention's q/k/v with RoPE and the K/V write (hl_qkv_rope) for int8dq / 8da4w matrices: the input row is
   quantised once for the three (torchao quantises it once per product, each time the same) */
typedef struct {
    QkvRope r; /* shapes, biases (m[].bias), outputs, pools, RoPE */
    QMat qm[3];
    QAct a;
} QkvRopeQ;

static void qkv_rope_q_chunk(const void *job, int64_t head) {
    const QkvRopeQ *j = job;
    const QkvRope *r = &j->r;
    const int which = head < r->Hq ? 0 : head < r->Hq + r->Hkv ? 1 : 2;
    const int64_t h = which == 0 ? head : which == 1 ? head - r->Hq : head - r->Hq - r->Hkv;
    const Gemv *g = &r->m[which];
    float acc[MAXB][512], outs[4][MAXB];
    for (int64_t d = 0; d < r->D; ++d) {
        const int64_t n = h * r->D + d;
        if (d % 4 == 0) q_rows(&j->qm[which], &j->a, n, r->D - d < 4 ? r->D - d : 4, g->ydt, outs); /* 4 at a time */
        const float *out = outs[d % 4];
        const float bias = g->bias ? load_as_f32(g->bias, g->bdt, n) : 0.0f;
        for (int64_t b = 0; b < g->B; ++b) acc[b][d] = round_to(exact(out[b] + bias), g->ydt);
    }
    qkv_rope_store(r, which, h, acc);
}

int hl_qkv_rope_q(int kind, const void *wq, const float *sq, const void *bq, const void *wk, const float *sk,
                  const void *bk, const void *wv, const float *sv, const void *bv, int bdt, const void *x, int xdt, void *q_out, void *kpool, void *vpool, int pdt,
                  const int64_t *slots, const void *cos, const void *sin, int64_t rot, int64_t B, int64_t Hq,
                  int64_t Hkv, int64_t D, int64_t K) {
    if (!q_shape_ok(kind, B, Hq * D, K) || D > 512 || rot > D || rot % 2 || Hkv < 1) return -1;
    const void *w[3] = {wq, wk, wv};
    const float *s[3] = {sq, sk, sv};
    QkvRopeQ j = {{{{NULL, NULL, bq, NULL, q_out, NULL, Hq * D, K, B, D, DT_NONE, bdt, xdt, 0},
                    {NULL, NULL, bk, NULL, NULL, NULL, Hkv * D, K, B, D, DT_NONE, bdt, xdt, 0},
                    {NULL, NULL, bv, NULL, NULL, NULL, Hkv * D, K, B, D, DT_NONE, bdt, xdt, 0}},
                   kpool, vpool, slots, cos, sin, Hq, Hkv, D, rot, pdt},
                  {{0}}, {0}};
    for (int i = 0; i < 3; ++i)
        j.qm[i] = q_mat(kind, w[i], s[i], i == 0 ? Hq * D : Hkv * D, K);
    if (!q_load_x(x, xdt, B, K, kind, &j.a)) return -1;
    pool_run(qkv_rope_q_chunk, &j, Hq + 2 * Hkv);
    return 0;
}

/* the gated MLP's first half (hl_gated_up) for int8dq / 8da4w gate and up matrices: y = act(x Wg^T + bg) *
   (x Wu^T + bu), the input row quantised once for both */
typedef struct {
    QMat g, u;
    QAct a;
    const void *bg, *bu;
    void *y;
    int64_t rows;
    int bdt, ydt, act;
} GatedUpQ;

static void gated_up_q_chunk(const void *job, int64_t chunk) {
    const GatedUpQ *j = job;
    const int64_t N = j->g.N, lo = chunk * j->rows, hi = lo + j->rows < N ? lo + j->rows : N;
    float OG[4][MAXB], OU[4][MAXB];
    for (int64_t n = lo; n < hi; ++n) {
        if ((n - lo) % 4 == 0) { /* rows four at a time */
            const int64_t nr = hi - n < 4 ? hi - n : 4;
            q_rows(&j->g, &j->a, n, nr, j->ydt, OG);
            q_rows(&j->u, &j->a, n, nr, j->ydt, OU);
        }
        const float *og = OG[(n - lo) % 4], *ou = OU[(n - lo) % 4];
        const float bg = j->bg ? load_as_f32(j->bg, j->bdt, n) : 0.0f;
        const float bu = j->bu ? load_as_f32(j->bu, j->bdt, n) : 0.0f;
        for (int64_t b = 0; b < j->a.B; ++b) {
            const float a = round_to(activate(round_to(exact(og[b] + bg), j->ydt), j->act), j->ydt);
            store_as(j->y, j->ydt, b * N + n, a * round_to(exact(ou[b] + bu), j->ydt));
        }
    }
}

int hl_gated_up_q(int kind, const void *wg, const float *sg, const void *bg, const void *wu, const float *su,
                  const void *bu, int bdt, const void *x, int xdt, void *y, int act,
                  int64_t B, int64_t N, int64_t K) {
    if (!q_shape_ok(kind, B, N, K)) return -1;
    GatedUpQ j = {q_mat(kind, wg, sg, N, K), q_mat(kind, wu, su, N, K), {0}, bg, bu, y,
                  chunk_rows(N, 2 * q_row_bytes(kind, K)), bdt, xdt, act};
    if (!q_load_x(x, xdt, B, K, kind, &j.a)) return -1;
    pool_run(gated_up_q_chunk, &j, (N + j.rows - 1) / j.rows);
    return 0;
}
