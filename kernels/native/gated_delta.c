/* ---- Gated DeltaNet step ---------------------------------------------------------------------------------- */
#include "native.h"
#include "gemv.h"

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
    GdnStep j = {state, slots, q, k, v, g, beta, y, qs, vs, gs, H, Hk, K, V, scale, sdt, xdt, Bsz, pool_threads()};
    pool_run(gdn_step_chunk, &j, Bsz * H);
    return 0;
}

