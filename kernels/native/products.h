/* products.h: what the files that run products share (amx.c's hl_gemv, int4.c, int8_activation.c, sublayer.c's fused
   sub-layers, program.c): the blocked row products as static inline kernels (dot_rows, dot_rows16, the AMX tiles:
   each caller specialises them per weight dtype, as when the library was one translation unit), and one
   declaration of each product driver and shared argument struct called across files. */
#pragma once
#include "gemv.h"

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
#define AMX_MIN_ROWS 2 /* input rows from which a bf16 product takes the tile unit */
#endif

#pragma GCC visibility push(hidden)
/* amx.c */
#ifdef AMX_PATH
void amx_configure(void);
#endif
/* x as AMX B tiles in the calling thread's scratch, or NULL where the tile unit does not take the product */
const uint32_t *amx_pack_x(const void *x, int xdt, int wdt, int64_t B, int64_t K);
int64_t chunk_rows(int64_t N, int64_t row_bytes);
int gemv_act(const void *w, int wdt, const float *scale, const void *bias, int bdt, const void *x, int xdt,
             const void *res, void *y, int ydt, int64_t B, int64_t N, int64_t K, int act1);

/* int4.c */
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
int int4_block(const Int4Mat *m, const Int4X *xs, int64_t nb, float out[][64]);
float *int4_load_x(const void *x, int xdt, int64_t B, int64_t K, int64_t G, Int4X *xs);
int int4_shape_ok(int64_t B, int64_t N, int64_t K, int64_t G, int bn);
int64_t int4_chunk_blocks(int64_t N, int64_t K, int bn);
int gemv_int4_act(const uint8_t *q, const void *sz, int sdt, int64_t G, const void *bias, int bdt, const void *x,
                  int xdt, const void *res, void *y, int ydt, int64_t B, int64_t N, int64_t K, int act1, int bn);

/* int8_activation.c */
int gemv_q_act(int kind, const void *w, const float *ws, const void *bias, int bdt, const void *x, int xdt,
               const void *res, void *y, int ydt, int64_t B, int64_t N, int64_t K, int act1);

/* sublayer.c */
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
void qkv_rope_store(const QkvRope *j, int which, int64_t h, float acc[][512]);
#pragma GCC visibility pop

#ifdef AMX_PATH
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
#endif

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
