/* ---- the products' driver: hl_gemv, the AMX tile unit's setup (the shared row kernels are products.h's) ---- */
#include "native.h"
#include "products.h"

#ifdef AMX_PATH

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
void amx_configure(void) {
    /* A constant in memory, not a local filled in before the call: GCC 12's _tile_loadconfig tells the compiler its
       asm reads 8 bytes of the configuration, so the stores of a local's colsb / rows were dead to it, and once
       this function was compiled apart from its callers (its own translation unit) they were dropped: the tiles
       were configured with no rows and the first tilezero faulted (SIGILL). (a tile not used must be all zero) */
    static const struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } __attribute__((packed, aligned(64))) cfg = {
        .palette = 1, .colsb = {64, 64, 64, 64, 64, 64, 64}, .rows = {16, 16, 16, 16, 16, 16, 16}};
    _tile_loadconfig(&cfg);
}

/* x [B, K] bf16 as B tiles: tile (kb, mb) is 16 rows (k pairs kb*32 + 2i, +1) of 16 dwords (input rows mb*16 + m,
   zero past B), 1 KB each, kb-major. NULL unless the AMX path takes this product (bf16 x and weights, K % 32 == 0,
   AMX_MIN_ROWS..64 rows, the tiles granted). The calling thread's scratch, read by its workers during the op. */
const uint32_t *amx_pack_x(const void *x, int xdt, int wdt, int64_t B, int64_t K) {
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

#else
const uint32_t *amx_pack_x(const void *x, int xdt, int wdt, int64_t B, int64_t K) {
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

/* output n of every input row b: out[b] * sc + bias, then store_out. A function of its own (noinline): inlined into
   gemv_chunk beside its three dtype copies of gemv_rows, GCC's register allocation there decides whether this loop
   keeps its index in a register, and once it did not (a store to the stack and a reload each output: the AMX bf16
   product of 32 rows x 2048 x 512 ran 1.9x slower when amx.c became its own translation unit). */
static __attribute__((noinline)) void store_column(const Gemv *g, int64_t n, const float *out, float sc, float bias) {
    void *y = g->y;
    const void *res = g->res;
    const int ydt = g->ydt, act1 = g->act1;
    const int64_t N = g->N, B = g->B;
    for (int64_t b = 0; b < B; ++b) store_out(y, ydt, res, act1, b * N + n, out[b] * sc + bias);
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
        store_column(g, n, out, sc, bias);
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
int64_t chunk_rows(int64_t N, int64_t row_bytes) {
    int64_t bytes = N * row_bytes / 64;
    if (bytes < 32768) bytes = 32768;
    int64_t rows = bytes / row_bytes;
    return (rows + 15) & ~(int64_t)15; /* whole 16-row blocks (the tile unit's) */
}

/* y[B, N] = act(x[B, K] W[N, K]^T (* scale[N]) + bias[N]) + res[B, N] (act1: 0 none, else ACT_* + 1). */
int gemv_act(const void *w, int wdt, const float *scale, const void *bias, int bdt, const void *x, int xdt,
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

