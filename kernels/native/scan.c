/* ---- Mamba-1 selective scan (prefill) ---------------------------------------------------------------------- */
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

typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
#define SCAN_SPLAT(c) ((f32x16){0} + (float)(c))

/* e^x for x <= 0, lane-wise. x = (i + f) / log2(e) with i an integer and |f| <= 1/2; 2^f from its Taylor series
   to degree 7 (relative error < 1e-8, below fp32's rounding); 2^i written into the exponent bits. i is rounded
   to nearest even by adding and subtracting 1.5 * 2^23 (exact for |t| < 2^22; the build keeps the two apart: no
   -fassociative-math). Below -87 (under fp32's smallest normal) the result is 0: the reference's exp gives a
   value that vanishes against anything it is added to. (libm's expf called per lane spilled the registers around
   every call: 36 against 27 ms for a D 1536, N 16 scan at 2K.) */
static inline __attribute__((always_inline)) f32x16 scan_exp_nonpos(f32x16 x) {
    const f32x16 t0 = x * 1.44269504088896341f;
    const i32x16 low = t0 < SCAN_SPLAT(-126.0f);
    const f32x16 t = (f32x16)((low & (i32x16)SCAN_SPLAT(-126.0f)) | (~low & (i32x16)t0));
    const f32x16 magic = SCAN_SPLAT(12582912.0f);
    const f32x16 i = (t + magic) - magic;
    const f32x16 f = (t - i) * 0.69314718055994531f;
    f32x16 p = SCAN_SPLAT(1.0f / 5040.0f);
    p = p * f + 1.0f / 720.0f;
    p = p * f + 1.0f / 120.0f;
    p = p * f + 1.0f / 24.0f;
    p = p * f + 1.0f / 6.0f;
    p = p * f + 0.5f;
    p = p * f + 1.0f;
    p = p * f + 1.0f;
    const i32x16 bits = (__builtin_convertvector(i, i32x16) + 127) << 23;
    const i32x16 under = x < SCAN_SPLAT(-87.0f);
    return (f32x16)(~under & (i32x16)(p * (f32x16)bits));
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
    f32x16 hs[SCAN_NMAX], Ab[SCAN_NMAX], dskip = {0};
    for (int64_t n = 0; n < N; ++n) {
        hs[n] = (f32x16){0}, Ab[n] = (f32x16){0};
        for (int c = 0; c < nc; ++c) hs[n][c] = h[(c0 + c) * N + n], Ab[n][c] = j->A[(c0 + c) * N + n];
    }
    if (j->Dskip)
        for (int c = 0; c < nc; ++c) dskip[c] = j->Dskip[c0 + c];
    for (int64_t t = j->cu[s]; t < j->cu[s + 1]; ++t) {
        f32x16 xt = {0}, delta = {0}, acc = {0}; /* lanes past nc: dt 0, so e^0 = 1 keeps their zero state */
        for (int c = 0; c < nc; ++c) {
            xt[c] = load_as_f32(j->x, j->xdt, t * j->ldx + c0 + c);
            delta[c] = load_as_f32(j->dt, j->dtdt, t * j->ldt + c0 + c);
        }
        const f32x16 u = delta * xt;
        for (int64_t n = 0; n < N; ++n) {
            const float b = load_as_f32(j->B, j->bdt, t * j->ldb + n), cc = load_as_f32(j->C, j->cdt, t * j->ldc + n);
            const f32x16 st = scan_exp_nonpos(delta * Ab[n]) * hs[n] + u * b;
            hs[n] = st;
            acc += st * cc;
        }
        const f32x16 out = acc + dskip * xt;
        for (int c = 0; c < nc; ++c) store_as(j->y, j->ydt, t * j->ldy + c0 + c, out[c]);
    }
    for (int64_t n = 0; n < N; ++n)
        for (int c = 0; c < nc; ++c) h[(c0 + c) * N + n] = hs[n][c];
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
