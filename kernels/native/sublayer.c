/* ---- the pieces of a fused decode sub-layer ---------------------------------------------------------------- */
#include "native.h"
#include "products.h"

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


/* RoPE on a q or k head's values acc[b][0..D) (rotate-half, the first rot channels, the step's cos/sin), then the
   head stored: q into q_out, k and v into their K/V pool slots (which: 0 q, 1 k, 2 v) */
void qkv_rope_store(const QkvRope *j, int which, int64_t h, float acc[][512]) {
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

