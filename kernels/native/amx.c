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

