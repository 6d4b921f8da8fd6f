/* ---- Mamba-1 selective scan (prefill) ---------------------------------------------------------------------- */
#include "native.h"
#include "gemv.h"

/* h_t = e^{dt_t A} h_{t-1} + dt_t x_t B_t, y_t = C_t . h_t + D x_t over whole sequences: selective_scan_ref's
   arithmetic, in fp32. Eager torch makes it out of whole-block passes over [T, D, N] work tensors, streaming 12+
   bytes per state element per token through memory; this loop walks a block of SCAN_CB channels through all of a
   sequence's tokens with their [N, SCAN_CB] states in L1, the channels as the vector lanes: per token and state
   one vector exp, two multiply-adds and the accumulation of C_t into the output; x, dt, B, C are read once.
   A work item is one (sequence, channel block) pair, so packed (varlen) batches and many sequences spread over
   the pool as one long sequence's channel blocks do; each channel's arithmetic does not depend on which thread
   runs it. (Until it moved here this loop was a second library inside kernels/cpu_scan.py, compiled at first
   use with its own thread pool.) */

#define SCAN_CB 16   /* channels per block: one AVX-512 register of fp32 lanes (two AVX2 ones) */
#define SCAN_NMAX 64 /* the largest d_state (Mamba-1 models use 16): the block's state lives on the stack */
/* lanes per vector: a block is SCAN_PARTS vectors. GCC lowers generic vectors wider than the ISA's registers
   piece by piece, but their comparisons lane by lane: 64-byte vectors on AVX2 ran 6x slower than this loop. */
#ifdef __AVX512F__
#define SCAN_W 16
#else
#define SCAN_W 8
#endif
#define SCAN_PARTS (SCAN_CB / SCAN_W)

typedef float scan_f32 __attribute__((vector_size(SCAN_W * 4)));
typedef float scan_f32u __attribute__((vector_size(SCAN_W * 4), aligned(4)));
typedef int32_t scan_i32 __attribute__((vector_size(SCAN_W * 4)));
typedef uint32_t scan_u32 __attribute__((vector_size(SCAN_W * 4)));
typedef uint16_t scan_u16u __attribute__((vector_size(SCAN_W * 2), aligned(2)));
#define SCAN_SPLAT(c) ((scan_f32){0} + (float)(c))

/* e^x for x <= 0, lane-wise. x = (i + f) / log2(e) with i an integer and |f| <= 1/2; 2^f from its Taylor series
   to degree 7 (relative error < 1e-8, below fp32's rounding); 2^i written into the exponent bits. i is rounded
   to nearest even by adding and subtracting 1.5 * 2^23 (exact for |t| < 2^22; the build keeps the two apart: no
   -fassociative-math). Below -87 (under fp32's smallest normal) the result is 0: the reference's exp gives a
   value that vanishes against anything it is added to. (libm's expf called per lane spilled the registers around
   every call: 36 against 27 ms for a D 1536, N 16 scan at 2K.) */
static inline __attribute__((always_inline)) scan_f32 scan_exp_nonpos(scan_f32 x) {
    const scan_f32 t0 = x * 1.44269504088896341f;
    const scan_i32 low = t0 < SCAN_SPLAT(-126.0f);
    const scan_f32 t = (scan_f32)((low & (scan_i32)SCAN_SPLAT(-126.0f)) | (~low & (scan_i32)t0));
    const scan_f32 magic = SCAN_SPLAT(12582912.0f);
    const scan_f32 i = (t + magic) - magic;
    const scan_f32 f = (t - i) * 0.69314718055994531f;
    scan_f32 p = SCAN_SPLAT(1.0f / 5040.0f);
    p = p * f + 1.0f / 720.0f;
    p = p * f + 1.0f / 120.0f;
    p = p * f + 1.0f / 24.0f;
    p = p * f + 1.0f / 6.0f;
    p = p * f + 0.5f;
    p = p * f + 1.0f;
    p = p * f + 1.0f;
    const scan_i32 bits = (__builtin_convertvector(i, scan_i32) + 127) << 23;
    const scan_i32 under = x < SCAN_SPLAT(-87.0f);
    return (scan_f32)(~under & (scan_i32)(p * (scan_f32)bits));
}

/* SCAN_W consecutive values from p[i] (fp32 or bf16) as one vector, zeros past the first n (n < SCAN_W: lane by
   lane). Whole vectors load as vectors: lanes filled one by one and then read as a vector stall on store
   forwarding, which cost a third of the loop's time. */
static inline __attribute__((always_inline)) scan_f32 scan_load(const void *p, int dt, int64_t i, int n) {
    if (n >= SCAN_W) {
        if (dt == DT_BF16)
            return (scan_f32)(__builtin_convertvector(*(const scan_u16u *)((const uint16_t *)p + i), scan_u32) << 16);
        return *(const scan_f32u *)((const float *)p + i);
    }
    scan_f32 v = {0};
    for (int c = 0; c < n; ++c) v[c] = load_as_f32(p, dt, i + c);
    return v;
}

/* The vector's first min(n, SCAN_W) lanes into p[i..] as fp32 or bf16 (rounded to nearest even as f32_to_bf16
   does, a NaN kept a NaN). */
static inline __attribute__((always_inline)) void scan_store(void *p, int dt, int64_t i, int n, scan_f32 v) {
    if (n >= SCAN_W && dt == DT_BF16) {
        const scan_u32 bits = (scan_u32)v;
        const scan_u32 nan = (scan_u32)((bits & 0x7fffffffu) > 0x7f800000u);
        const scan_u32 rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
        *(scan_u16u *)((uint16_t *)p + i) =
            __builtin_convertvector((nan & ((bits >> 16) | 0x40u)) | (~nan & rounded), scan_u16u);
    } else if (n >= SCAN_W) {
        *(scan_f32u *)((float *)p + i) = v;
    } else {
        for (int c = 0; c < n; ++c) store_as(p, dt, i + c, v[c]);
    }
}

typedef struct {
    const void *x, *dt, *B, *C; /* x, dt [T, D]; B, C [T, N]; rows at the strides below */
    const float *A, *Dskip;     /* A [D, N] contiguous fp32; Dskip [D] fp32 or NULL */
    float *h;                   /* [nseq, D, N] fp32: the entering states, left as the final ones */
    void *y;                    /* [T, D] in ydt */
    const int64_t *cu;          /* [nseq + 1] token offsets of the sequences */
    int64_t ldx, ldt, ldb, ldc, ldy;
    int64_t D, N, nblk;
    int xdt, dtdt, bdt, cdt, ydt;
} Scan;

static void scan_chunk(const void *job, int64_t item) {
    const Scan *j = job;
    const int64_t s = item / j->nblk, c0 = (item % j->nblk) * SCAN_CB, N = j->N, D = j->D;
    const int nc = D - c0 < SCAN_CB ? (int)(D - c0) : SCAN_CB;
    float *h = j->h + s * D * N;
    scan_f32 hs[SCAN_NMAX][SCAN_PARTS], Ab[SCAN_NMAX][SCAN_PARTS], dskip[SCAN_PARTS];
    for (int k = 0; k < SCAN_PARTS; ++k) {
        dskip[k] = (scan_f32){0};
        for (int64_t n = 0; n < N; ++n) hs[n][k] = (scan_f32){0}, Ab[n][k] = (scan_f32){0};
    }
    for (int c = 0; c < nc; ++c) {
        for (int64_t n = 0; n < N; ++n)
            hs[n][c / SCAN_W][c % SCAN_W] = h[(c0 + c) * N + n], Ab[n][c / SCAN_W][c % SCAN_W] = j->A[(c0 + c) * N + n];
        if (j->Dskip) dskip[c / SCAN_W][c % SCAN_W] = j->Dskip[c0 + c];
    }
    for (int64_t t = j->cu[s]; t < j->cu[s + 1]; ++t) {
        /* lanes past nc: x and dt 0, so e^0 = 1 keeps their zero state */
        scan_f32 xt[SCAN_PARTS], delta[SCAN_PARTS], u[SCAN_PARTS], acc[SCAN_PARTS];
        for (int k = 0; k < SCAN_PARTS; ++k) {
            xt[k] = scan_load(j->x, j->xdt, t * j->ldx + c0 + k * SCAN_W, nc - k * SCAN_W);
            delta[k] = scan_load(j->dt, j->dtdt, t * j->ldt + c0 + k * SCAN_W, nc - k * SCAN_W);
            u[k] = delta[k] * xt[k];
            acc[k] = (scan_f32){0};
        }
        /* B_t and C_t widened once per token; the states' dot with C_t in two chains (even and odd n), summed
           once: one chain of N dependent adds bounded the loop */
        float bt[SCAN_NMAX], ct[SCAN_NMAX];
        for (int64_t n = 0; n < N; ++n)
            bt[n] = load_as_f32(j->B, j->bdt, t * j->ldb + n), ct[n] = load_as_f32(j->C, j->cdt, t * j->ldc + n);
        scan_f32 acc2[SCAN_PARTS];
        for (int k = 0; k < SCAN_PARTS; ++k) acc2[k] = (scan_f32){0};
        int64_t n = 0;
        for (; n + 2 <= N; n += 2)
            for (int k = 0; k < SCAN_PARTS; ++k) {
                const scan_f32 s0 = scan_exp_nonpos(delta[k] * Ab[n][k]) * hs[n][k] + u[k] * bt[n];
                const scan_f32 s1 = scan_exp_nonpos(delta[k] * Ab[n + 1][k]) * hs[n + 1][k] + u[k] * bt[n + 1];
                hs[n][k] = s0, hs[n + 1][k] = s1;
                acc[k] += s0 * ct[n], acc2[k] += s1 * ct[n + 1];
            }
        for (; n < N; ++n)
            for (int k = 0; k < SCAN_PARTS; ++k) {
                const scan_f32 st = scan_exp_nonpos(delta[k] * Ab[n][k]) * hs[n][k] + u[k] * bt[n];
                hs[n][k] = st;
                acc[k] += st * ct[n];
            }
        for (int k = 0; k < SCAN_PARTS; ++k)
            scan_store(j->y, j->ydt, t * j->ldy + c0 + k * SCAN_W, nc - k * SCAN_W,
                       (acc[k] + acc2[k]) + dskip[k] * xt[k]);
    }
    for (int c = 0; c < nc; ++c)
        for (int64_t n = 0; n < N; ++n) h[(c0 + c) * N + n] = hs[n][c / SCAN_W][c % SCAN_W];
}

/* Every sequence s of a packed batch (tokens [cu[s], cu[s+1]) of x, dt, B, C, y) from its state h[s]; -1 where
   d_state is outside 1..SCAN_NMAX (kernels/native/ops.py checks the arguments before the call). */
int hl_selective_scan(const void *x, int xdt, int64_t ldx, const void *dt, int dtdt, int64_t ldt, const float *A,
                      const void *B, int bdt, int64_t ldb, const void *C, int cdt, int64_t ldc, const float *Dskip,
                      float *h, void *y, int ydt, int64_t ldy, const int64_t *cu, int64_t nseq, int64_t D,
                      int64_t N) {
    if (N < 1 || N > SCAN_NMAX) return -1;
    const int64_t nblk = (D + SCAN_CB - 1) / SCAN_CB;
    Scan j = {x, dt, B, C, A, Dskip, h, y, cu, ldx, ldt, ldb, ldc, ldy, D, N, nblk, xdt, dtdt, bdt, cdt, ydt};
    if (nblk > 0 && nseq > 0) pool_run(scan_chunk, &j, nseq * nblk);
    return 0;
}
