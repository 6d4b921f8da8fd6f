/* ---- the pool ------------------------------------------------------------------------------------------ */
#include "native.h"

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
int P_stream = 1;

int hl_set_stream_prefetch(int on) {
    const int was = P_stream;
    P_stream = on ? 1 : 0;
    return was;
}

double now_us(void) {
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
double P_waited_us = 0.0;
int P_solo = 0;

void pool_run(chunk_fn fn, const void *job, int64_t nchunks) {
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

int pool_threads(void) { return P.nworkers + 1; }

void pool_hot(int on) { atomic_store_explicit(&P.hot, on, memory_order_relaxed); }

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


