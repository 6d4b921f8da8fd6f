/* ---- causal conv1d step ------------------------------------------------------------------------------------ */
#include "native.h"
#include "gemv.h"

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

