/* The linear-attention mixers' decode ops (Gated DeltaNet, hybrid/layers/gated_deltanet.py; GLA,
   hybrid/layers/gla.py) for the decode program (program.c's OP_GDN, OP_HEAD_NORM, OP_GLA): each mirrors the
   rounding points of the eager layer's torch ops, so the program computes the eager layer's bits.

   Compiled after decode.c, in its translation unit: the thread pool, the dtype helpers, hl_gdn_step and the
   product kernel (gemv_act) are decode.c's. */
#include "native.h"
#include "products.h"


/* ---- Gated DeltaNet: the one-token step after the conv --------------------------------------------------- */
/* The pieces are also the eager layer's decode ops (kernels/gated_delta.py's l2norm_heads and gates dispatch
   here on a CPU), so the program and the eager step compute the same bits: torch's exp / log1p (Sleef's) and
   sums (its own order) differ from libm's in the last fp32 bit now and then, and a state carries that on. */

/* x rows [B, heads, K] (row stride xs, heads K apart) L2-normalised per head in fp32 (kernels.gated_delta.l2norm:
   x / sqrt(sum x^2 + eps)), rounded to the dtype into y (row stride ys). */
void hl_l2norm_heads(const void *x, int64_t xs, int xdt, void *y, int64_t ys, int64_t B, int64_t heads, int64_t K,
                     float eps) {
    for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < heads; ++h) {
            const int64_t src = b * xs + h * K, dst = b * ys + h * K;
            double ss = 0.0;
            for (int64_t i = 0; i < K; ++i) {
                const float v = load_as_f32(x, xdt, src + i);
                ss += (double)v * v;
            }
            const float inv = 1.0f / sqrtf((float)ss + eps);
            for (int64_t i = 0; i < K; ++i) store_as(y, xdt, dst + i, load_as_f32(x, xdt, src + i) * inv);
        }
}

static inline float softplus1(float v) { return v > 20.0f ? v : log1pf(expf(v)); } /* torch's, threshold 20 */

/* GatedDeltaNet.gates: g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b), fp32 [B, H], from b and a rows
   (strides bs, as) of the model dtype. */
void hl_gdn_gates(const void *bb, int64_t bs, const void *aa, int64_t as, int xdt, const void *A_log, int adt,
                  const void *dt_bias, int bdt, float *g, float *beta, int64_t B, int64_t H) {
    for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < H; ++h) {
            const float bv = load_as_f32(bb, xdt, b * bs + h), av = load_as_f32(aa, xdt, b * as + h);
            const float A = -expf(load_as_f32(A_log, adt, h));
            g[b * H + h] = A * softplus1(av + load_as_f32(dt_bias, bdt, h));
            beta[b * H + h] = 1.0f / (1.0f + expf(-bv));
        }
}

/* The program's op: from the conv's output rows qkv [B, 2 Hk K + H V] (row stride qkv_s) and the in-projection's
   b | a rows (stride ba_s): q and k normalised into qk [B, 2 Hk K], the gates into g / beta [B, H], then
   hl_gdn_step on the rows' state slots -> y [B, H, V]. */
int hl_gdn_decode(void *state, int sdt, const int64_t *slots, const void *qkv, int xdt, int64_t qkv_s,
                  const void *ba, int64_t ba_s, const void *A_log, int adt, const void *dt_bias, int bdt, void *qk,
                  float *g, float *beta, void *y, int64_t B, int64_t H, int64_t Hk, int64_t K, int64_t V, float eps,
                  float scale) {
    if (K > 512 || V > 512 || Hk < 1 || H % Hk) return -1;
    const int64_t w = 2 * Hk * K, esz = xdt == DT_BF16 ? 2 : 4;
    hl_l2norm_heads(qkv, qkv_s, xdt, qk, w, B, Hk, K, eps);
    hl_l2norm_heads((const char *)qkv + Hk * K * esz, qkv_s, xdt, (char *)qk + Hk * K * esz, w, B, Hk, K, eps);
    hl_gdn_gates(ba, ba_s, (const char *)ba + H * esz, ba_s, xdt, A_log, adt, dt_bias, bdt, g, beta, B, H);
    return hl_gdn_step(state, sdt, slots, qk, (const char *)qk + Hk * K * esz, w, (const char *)qkv + w * esz, xdt,
                       qkv_s, g, beta, H, scale, y, B, H, Hk, K, V);
}

/* ---- per-head output norm ----------------------------------------------------------------------------- */
/* y [B, H V] (row stride ys) normalised per head over its V values with one [V] weight shared by the heads.
   gated: GatedRMSNorm(V, norm_before_gate=True) with the gate z (row stride zs): y / rms(y) * w * silu(z) in
   fp32, rounded once; else RMSNorm(V): y / rms(y) rounded to the dtype, then times w (rounded again). */
void hl_head_rmsnorm(const void *y, int64_t ys, const void *z, int64_t zs, int dt, const void *w, int wdt, float eps,
                     int gated, void *out, int64_t B, int64_t H, int64_t V) {
    for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < H; ++h) {
            const int64_t yo = b * ys + h * V, oo = (b * H + h) * V;
            double ss = 0.0;
            for (int64_t i = 0; i < V; ++i) {
                const float v = load_as_f32(y, dt, yo + i);
                ss += (double)v * v;
            }
            const float inv = 1.0f / sqrtf((float)(ss / V) + eps);
            for (int64_t i = 0; i < V; ++i) {
                const float yv = load_as_f32(y, dt, yo + i), wv = load_as_f32(w, wdt, i);
                if (gated) {
                    const float zv = load_as_f32(z, dt, b * zs + h * V + i);
                    store_as(out, dt, oo + i, yv * inv * wv * (zv / (1.0f + expf(-zv))));
                } else {
                    store_as(out, dt, oo + i, round_to(yv * inv, dt) * wv);
                }
            }
        }
}

/* ---- GLA step ----------------------------------------------------------------------------------------- */
/* One token per sequence (kernels.gla.gla_step_ref's arithmetic): per (sequence b, head h; key/value/decay head
   h / (H / Hkv)) the state S [K, V] (fp32 or bf16 storage, rows slots[b] of a pool) becomes diag(exp(g)) S +
   k v^T and o = S'^T q scale, in one pass over the state; a bf16 state is rounded once, on the store. q at
   b qs + h K, k at b ks + hk K, v at b vs + hk V (model dtype), g fp32 at b gs + hk K; y [B, H, V]. */
typedef struct {
    void *state;
    const int64_t *slots;
    const void *q, *k, *v;
    const float *g;
    void *y;
    int64_t qs, ks, vs, gs, H, Hkv, K, V;
    float scale;
    int sdt, xdt;
} GlaStep;


static void gla_step_chunk(const void *job, int64_t item) {
    const GlaStep *j = job;
    const int64_t b = item / j->H, h = item % j->H, hk = h / (j->H / j->Hkv), K = j->K, V = j->V;
    const int64_t row = j->slots ? j->slots[b] : b;
    float vv[512], o[512];
    for (int64_t c = 0; c < V; ++c) vv[c] = load_as_f32(j->v, j->xdt, b * j->vs + hk * V + c), o[c] = 0.0f;
    const int64_t base = (row * j->H + h) * K * V;
    for (int64_t i = 0; i < K; ++i) {
        const float a = expf(j->g[b * j->gs + hk * K + i]);
        const float ki = load_as_f32(j->k, j->xdt, b * j->ks + hk * K + i);
        const float qi = load_as_f32(j->q, j->xdt, b * j->qs + h * K + i) * j->scale;
        int64_t c = 0;
        if (j->sdt == DT_F32) {
            float *s = (float *)j->state + base + i * V;
#ifdef __AVX2__
            const __m256 av = _mm256_set1_ps(a), kv = _mm256_set1_ps(ki), qv = _mm256_set1_ps(qi);
            for (; c + 8 <= V; c += 8) {
                const __m256 n = _mm256_fmadd_ps(kv, _mm256_loadu_ps(vv + c), _mm256_mul_ps(_mm256_loadu_ps(s + c), av));
                _mm256_storeu_ps(s + c, n);
                _mm256_storeu_ps(o + c, _mm256_fmadd_ps(n, qv, _mm256_loadu_ps(o + c)));
            }
#endif
            for (; c < V; ++c) {
                const float n = s[c] * a + ki * vv[c];
                s[c] = n;
                o[c] += n * qi;
            }
        } else {
            uint16_t *s = (uint16_t *)j->state + base + i * V;
#ifdef __AVX2__
            const __m256 av = _mm256_set1_ps(a), kv = _mm256_set1_ps(ki), qv = _mm256_set1_ps(qi);
            for (; c + 8 <= V; c += 8) {
                const __m256 n = _mm256_fmadd_ps(kv, _mm256_loadu_ps(vv + c), _mm256_mul_ps(bf16x8_load(s + c), av));
                bf16x8_store(s + c, n);
                _mm256_storeu_ps(o + c, _mm256_fmadd_ps(n, qv, _mm256_loadu_ps(o + c)));
            }
#endif
            for (; c < V; ++c) {
                const float n = bf16_to_f32(s[c]) * a + ki * vv[c];
                s[c] = f32_to_bf16(n);
                o[c] += n * qi;
            }
        }
    }
    const int64_t out = (b * j->H + h) * V;
    for (int64_t c = 0; c < V; ++c) store_as(j->y, j->xdt, out + c, o[c]);
}

int hl_gla_step(void *state, int sdt, const int64_t *slots, const void *q, int64_t qs, const void *k, int64_t ks,
                const void *v, int64_t vs, int xdt, const float *g, int64_t gs, float scale, void *y, int64_t B,
                int64_t H, int64_t Hkv, int64_t K, int64_t V) {
    if (V > 512 || Hkv < 1 || H % Hkv || K < 1) return -1;
    GlaStep j = {state, slots, q, k, v, g, y, qs, ks, vs, gs, H, Hkv, K, V, scale, sdt, xdt};
    pool_run(gla_step_chunk, &j, B * H);
    return 0;
}

/* GLA's log decay (kernels.gla.decay, the eager layer's op on a CPU too): g = logsigmoid(x) / normalizer in fp32
   (torch's min(x, 0) - log1p(exp(-|x|))), clamped from below at clamp_min when clamp; x [n] in the model dtype. */
void hl_gla_decay(const void *x, int xdt, float *g, int64_t n, float normalizer, float clamp_min, int clamp) {
    for (int64_t i = 0; i < n; ++i) {
        const float v = load_as_f32(x, xdt, i);
        const float d = ((v < 0.0f ? v : 0.0f) - log1pf(expf(-fabsf(v)))) / normalizer;
        g[i] = clamp && d < clamp_min ? clamp_min : d;
    }
}

/* GLA's decode after the conv (or straight from the in-projection without one): the decay gate's up-projection
   gk = low W^T + bias (low copied to contiguous rows first: the product kernel eager's Linear takes for them),
   the log decay (hl_gla_decay), then hl_gla_step over q | k | v of qkv (row stride qkv_s) -> y [B, H, V]. */
int hl_gla_decode(void *state, int sdt, const int64_t *slots, const void *qkv, int xdt, int64_t qkv_s, const void *low,
                  int64_t low_s, void *low_buf, const void *w, const float *wscale, int wdt, const void *bias, int bdt,
                  void *gk, float *g, void *y, int64_t B, int64_t R, int64_t H, int64_t Hkv, int64_t K, int64_t V,
                  float normalizer, float clamp_min, int clamp) {
    const int64_t esz = xdt == DT_BF16 ? 2 : 4, G = Hkv * K;
    for (int64_t b = 0; b < B; ++b) memcpy((char *)low_buf + b * R * esz, (const char *)low + b * low_s * esz, R * esz);
    if (gemv_act(w, wdt, wscale, bias, bdt, low_buf, xdt, NULL, gk, xdt, B, G, R, 0)) return -1;
    hl_gla_decay(gk, xdt, g, B * G, normalizer, clamp_min, clamp);
    const int64_t kq = H * K;
    return hl_gla_step(state, sdt, slots, qkv, qkv_s, (const char *)qkv + kq * esz, qkv_s,
                       (const char *)qkv + (kq + G) * esz, qkv_s, xdt, g, G, (float)(1.0 / sqrt((double)K)), y, B, H,
                       Hkv, K, V); /* Python's K ** -0.5, as eager's gla_step takes it */
}

/* ---- Gated DeltaNet prefill: the UT transform's forward substitution ---------------------------------------- */
/* kernels/gated_delta.py's chunked form solves, per chunk and value head, (I + A) X' = X with A [C, C] strictly
   lower (beta K K^T * decay; the diagonal and above are not read) for X = [beta V | beta K exp(c)] [C, W], in
   place. torch's batched triangular solve ran at a fraction of the matmul speed, and its explicit inverse plus a
   [C, C] x [C, W] product (the path this replaces) does twice the FLOPs at ~64 GFLOP/s; forward substitution
   does C^2 W / 2 multiply-adds, and the 64 columns a pass takes ([C, 64] fp32: 16 KB at C = 64) stay in L1.
   Row i is X_i - sum_{j < i} A_ij X'_j, summed in j order (one fused multiply-add per term). */
typedef struct {
    const float *A;
    float *X;
    int64_t C, W;
} UtSolve;

static void ut_solve_scalar(const float *A, float *X, int64_t C, int64_t W, int64_t c0, int64_t c1) {
    for (int64_t i = 1; i < C; ++i)
        for (int64_t j = 0; j < i; ++j) {
            const float a = A[i * C + j];
            for (int64_t c = c0; c < c1; ++c) X[i * W + c] = fmaf(-a, X[j * W + c], X[i * W + c]);
        }
}

#ifdef __AVX512F__
/* columns c0..c0+63 of one system: rows in blocks of 4 (16 accumulators of 16 lanes), each block first takes the
   rows above it, then solves its own 4 x 4 triangle */
static void ut_solve_cols64(const float *A, float *X, int64_t C, int64_t W, int64_t c0) {
    int64_t i0 = 0;
    for (; i0 + 4 <= C; i0 += 4) {
        __m512 acc[4][4];
        for (int r = 0; r < 4; ++r)
            for (int q = 0; q < 4; ++q) acc[r][q] = _mm512_loadu_ps(X + (i0 + r) * W + c0 + 16 * q);
        for (int64_t j = 0; j < i0; ++j) {
            const float *xj = X + j * W + c0;
            const __m512 x0 = _mm512_loadu_ps(xj), x1 = _mm512_loadu_ps(xj + 16), x2 = _mm512_loadu_ps(xj + 32),
                         x3 = _mm512_loadu_ps(xj + 48);
            for (int r = 0; r < 4; ++r) {
                const __m512 a = _mm512_set1_ps(A[(i0 + r) * C + j]);
                acc[r][0] = _mm512_fnmadd_ps(a, x0, acc[r][0]);
                acc[r][1] = _mm512_fnmadd_ps(a, x1, acc[r][1]);
                acc[r][2] = _mm512_fnmadd_ps(a, x2, acc[r][2]);
                acc[r][3] = _mm512_fnmadd_ps(a, x3, acc[r][3]);
            }
        }
        for (int r = 1; r < 4; ++r)
            for (int s = 0; s < r; ++s) {
                const __m512 a = _mm512_set1_ps(A[(i0 + r) * C + i0 + s]);
                for (int q = 0; q < 4; ++q) acc[r][q] = _mm512_fnmadd_ps(a, acc[s][q], acc[r][q]);
            }
        for (int r = 0; r < 4; ++r)
            for (int q = 0; q < 4; ++q) _mm512_storeu_ps(X + (i0 + r) * W + c0 + 16 * q, acc[r][q]);
    }
    for (; i0 < C; ++i0) /* the last C % 4 rows, one at a time */
        for (int q = 0; q < 4; ++q) {
            __m512 acc = _mm512_loadu_ps(X + i0 * W + c0 + 16 * q);
            for (int64_t j = 0; j < i0; ++j)
                acc = _mm512_fnmadd_ps(_mm512_set1_ps(A[i0 * C + j]), _mm512_loadu_ps(X + j * W + c0 + 16 * q), acc);
            _mm512_storeu_ps(X + i0 * W + c0 + 16 * q, acc);
        }
}
#endif

static void ut_solve_chunk(const void *job, int64_t s) {
    const UtSolve *j = job;
    const float *A = j->A + s * j->C * j->C;
    float *X = j->X + s * j->C * j->W;
    int64_t c0 = 0;
#ifdef __AVX512F__
    for (; c0 + 64 <= j->W; c0 += 64) ut_solve_cols64(A, X, j->C, j->W, c0);
#endif
    if (c0 < j->W) ut_solve_scalar(A, X, j->C, j->W, c0, j->W);
}

/* count systems: A [count, C, C], X [count, C, W] (both contiguous fp32), X overwritten by the solutions; one
   system a pool chunk */
void hl_gdn_ut_solve(const float *A, float *X, int64_t count, int64_t C, int64_t W) {
    UtSolve j = {A, X, C, W};
    pool_run(ut_solve_chunk, &j, count);
}

/* ---- Gated DeltaNet prefill: a chunk's operands for the walk ---------------------------------------------- */
/* kernels/gated_delta.py's _block_inference between the products K K^T, Q K^T (torch's batched matmuls) and the
   walk, for one chunk and key head and the value heads it serves, in one pass while they are in cache (torch took
   ~7 elementwise passes over [n, H, C, C] and [n, H, C, K] tensors, ~13% of a bf16 layer): with c the running log
   decay and G_ij = exp(clamp(c_i - c_j, -80, 0)) below the diagonal,
     the UT system A = strictly_lower(K K^T * G) * beta_i (on the stack) and U = beta V, W = K beta e^c solved
     through it (ut_solve_chunk's forward substitution), attn = lower(Q K^T * G), qe = Q e^c, kend = K e^(c_C - c).
   Layouts (contiguous fp32): q, k [n, Hk, C, K] (q scaled), kk, qk [n, Hk, C, C], c, beta [n, H, C], v
   [n, H, C, V] (overwritten by U), W, qe, kend [n, H, C, K], attn [n, H, C, C]; H = Hk * rep (b folded into the
   heads). */
typedef struct {
    const float *q, *k, *kk, *qk, *c, *beta;
    float *v, *W, *qe, *kend, *attn;
    int64_t Hk, rep, C, K, V;
} GdnPrep;

/* row i of G: out[j] = exp(clamp(c_i - c_j, -80, 0)) for j <= i (the caller masks) */
static void gdn_decay_row(const float *c, int64_t i, float *out) {
    int64_t j = 0;
#ifdef __AVX512F__
    const __m512 ci = _mm512_set1_ps(c[i]);
    for (; j + 16 <= i + 1; j += 16) {
        __m512 d = _mm512_sub_ps(ci, _mm512_loadu_ps(c + j));
        d = _mm512_min_ps(_mm512_max_ps(d, _mm512_set1_ps(-80.0f)), _mm512_setzero_ps());
        _mm512_storeu_ps(out + j, exp16_ps(d));
    }
#endif
    for (; j <= i; ++j) {
        float d = c[i] - c[j];
        d = d < -80.0f ? -80.0f : d > 0.0f ? 0.0f : d;
        out[j] = expf(d);
    }
}

/* y[x] = a[x] * s for x < n (y may be a). Explicit vectors: GCC kept the plain loops scalar, the rows of six
   arrays possibly aliasing, and the pass took 3 of its 4.5 ms (a 1024-token block of gdn-small's heads). */
static inline void gdn_scale_row(float *y, const float *a, float s, int64_t n) {
    int64_t x = 0;
#ifdef __AVX512F__
    const __m512 sv = _mm512_set1_ps(s);
    for (; x + 16 <= n; x += 16) _mm512_storeu_ps(y + x, _mm512_mul_ps(_mm512_loadu_ps(a + x), sv));
#endif
    for (; x < n; ++x) y[x] = a[x] * s;
}

/* y[x] = a[x] * b[x] * s for x < n, then zeros up to m ((a * b) * s: torch's order of the UT system's products) */
static inline void gdn_mul_row(float *y, const float *a, const float *b, float s, int64_t n, int64_t m) {
    int64_t x = 0;
#ifdef __AVX512F__
    const __m512 sv = _mm512_set1_ps(s);
    for (; x + 16 <= n; x += 16)
        _mm512_storeu_ps(y + x, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(a + x), _mm512_loadu_ps(b + x)), sv));
#endif
    for (; x < n; ++x) y[x] = a[x] * b[x] * s;
    for (; x < m; ++x) y[x] = 0.0f;
}

static void gdn_prep_chunk(const void *job, int64_t t) {
    const GdnPrep *j = job;
    const int64_t C = j->C, K = j->K, V = j->V, rep = j->rep, H = j->Hk * rep;
    const int64_t chunk = t / j->Hk, hk = t % j->Hk;
    const float *q = j->q + t * C * K, *k = j->k + t * C * K, *kk = j->kk + t * C * C, *qk = j->qk + t * C * C;
    float A[C * C], G[C], ec[C], eb[C];
    for (int64_t r = 0; r < rep; ++r) {
        const int64_t h = chunk * H + hk * rep + r;
        const float *c = j->c + h * C, *beta = j->beta + h * C;
        float *v = j->v + h * C * V, *W = j->W + h * C * K, *qe = j->qe + h * C * K, *kend = j->kend + h * C * K,
              *attn = j->attn + h * C * C;
        for (int64_t i = 0; i < C; ++i) {
            ec[i] = expf(c[i]);
            eb[i] = expf(c[C - 1] - c[i]);
        }
        for (int64_t i = 0; i < C; ++i) {
            gdn_decay_row(c, i, G);
            gdn_mul_row(A + i * C, kk + i * C, G, beta[i], i, i); /* strictly lower: the solve reads no more */
            gdn_mul_row(attn + i * C, G, qk + i * C, 1.0f, i + 1, C);
            gdn_scale_row(v + i * V, v + i * V, beta[i], V);
            gdn_scale_row(W + i * K, k + i * K, beta[i] * ec[i], K);
            gdn_scale_row(qe + i * K, q + i * K, ec[i], K);
            gdn_scale_row(kend + i * K, k + i * K, eb[i], K);
        }
        UtSolve us = {A, v, C, V};
        ut_solve_chunk(&us, 0);
        us.X = W;
        us.W = K;
        ut_solve_chunk(&us, 0);
    }
}

int hl_gdn_chunk_prep(const float *q, const float *k, const float *kk, const float *qk, const float *c,
                      const float *beta, float *v, float *W, float *qe, float *kend, float *attn, int64_t n,
                      int64_t Hk, int64_t rep, int64_t C, int64_t K, int64_t V) {
    if (C > 128 || C < 1) return -1; /* the UT system lives on the stack */
    GdnPrep j = {q, k, kk, qk, c, beta, v, W, qe, kend, attn, Hk, rep, C, K, V};
    pool_run(gdn_prep_chunk, &j, n * Hk);
    return 0;
}
