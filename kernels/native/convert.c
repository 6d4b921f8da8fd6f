/* ---- conversions ---------------------------------------------------------------------------------------- */
static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40); /* NaN stays NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);                                         /* nearest, ties to even */
    return (uint16_t)(bits >> 16);
}

static inline float round_to(float v, int dt) { return dt == DT_BF16 ? bf16_to_f32(f32_to_bf16(v)) : v; }

static inline void store_as(void *p, int dt, int64_t i, float v) {
    if (dt == DT_BF16) ((uint16_t *)p)[i] = f32_to_bf16(v);
    else ((float *)p)[i] = v;
}

static inline float hsum(v8 v) {
    float s = 0.0f;
    for (int i = 0; i < 8; ++i) s += v[i];
    return s;
}

enum { ACT_SILU = 0, ACT_GELU = 1, ACT_GELU_TANH = 2, ACT_RELU = 3, ACT_RELU2 = 4 };

static inline float activate(float v, int act) {
    switch (act) {
    case ACT_SILU: return v / (1.0f + expf(-v));
    case ACT_GELU: return 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
    case ACT_GELU_TANH: return 0.5f * v * (1.0f + tanhf(0.79788456080286536f * (v + 0.044715f * v * v * v)));
    case ACT_RELU: return v > 0.0f ? v : 0.0f;
    default: return v > 0.0f ? v * v : 0.0f;
    }
}

#ifdef __AVX512F__
/* exp of 16 fp32 lanes: n = round(x log2 e), r = x - n ln 2 (two-part ln 2), a degree-6 polynomial (Cephes' expf
   coefficients), scaled by 2^n (vscalefps: overflow to inf, underflow through the denormals to 0); NaN stays NaN
   (an integer test: -ffast-math may drop a float one). At most 1.25 ulp from exp over every float whose exp is
   finite (libm's expf: 0.5). */
static inline __m512 exp16_ps(__m512 x0) {
    const __mmask16 nan = _mm512_cmpgt_epi32_mask(
        _mm512_and_si512(_mm512_castps_si512(x0), _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    const __m512 x = _mm512_max_ps(_mm512_min_ps(x0, _mm512_set1_ps(88.8f)), _mm512_set1_ps(-104.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_mask_mov_ps(_mm512_scalef_ps(p, n), nan, x0);
}

static inline __m512 silu16_ps(__m512 v) {
    return _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16_ps(_mm512_sub_ps(_mm512_setzero_ps(), v))));
}
#endif

/* SiLU in place over fp32 v[0..n), v = x * scale + bias first (the gated MLP's gate row). Where AVX-512 is, 16 lanes
   of exp16_ps (the last 1-15 masked: a value's bits never depend on where it fell): a batched step's libm expf
   calls were ~4 ns each, 0.14 of a 1.4 ms gated MLP product at 32 rows on the 2-vCPU Zen 4, and the conv and gated
   norm of a Mamba-2 layer were mostly expf. Only fp32 outputs take it: bf16 rounds libm's expf where torch's eager
   ops round (tests/test_native_decode.py: bf16 sub-layers bit-equal to eager); fp32 SiLU moves by <= ~3 ulp. */
static void silu_f32(float *v, int64_t n, float scale, float bias) {
    int64_t i = 0;
#ifdef __AVX512F__
    const __m512 sc = _mm512_set1_ps(scale), bi = _mm512_set1_ps(bias);
    for (; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        _mm512_mask_storeu_ps(v + i, m, silu16_ps(_mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, v + i), sc, bi)));
    }
#endif
    for (; i < n; ++i) {
        const float x = v[i] * scale + bias;
        v[i] = x / (1.0f + expf(-x));
    }
}

/* SiLU in place over fp32 v[0..n) for values about to be rounded to bf16, with libm's bits after that rounding: the
   16 lanes of silu16_ps, and libm's expf for a lane where the two could round apart. Two fp32 values a few ulp apart
   round to different bf16 only across a rounding midpoint (low 16 bits 0x8000), and silu16_ps stays within a few
   ulp of libm's x / (1 + expf(-x)) (exp16_ps's polynomial, then the same add and divide), so a lane whose low bits
   lie more than SILU_BF16_MARGIN ulp from 0x8000 rounds as libm's would; the rest (~0.2% of lanes), NaNs and
   |x| > 80 (where the clamps in exp16_ps part from libm's overflow) take libm's. The bf16 MLP's and Mamba conv's
   SiLU, whose results are rounded at once (torch's rounding points): a bf16 Mamba-2 conv step of 1280 channels went
   from 20 to 7 us with the conv's own vector path, most of it libm's expf before. */
#ifdef __AVX512F__
#define SILU_BF16_MARGIN 64
static void silu_bf16_exact(float *v, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        const __m512 x = _mm512_maskz_loadu_ps(m, v + i), r = silu16_ps(x);
        const __m512i lo = _mm512_and_si512(_mm512_castps_si512(r), _mm512_set1_epi32(0xffff));
        const __mmask16 near = _mm512_cmple_epu32_mask(_mm512_sub_epi32(lo, _mm512_set1_epi32(0x8000 - SILU_BF16_MARGIN)),
                                                       _mm512_set1_epi32(2 * SILU_BF16_MARGIN));
        const __mmask16 wild = _mm512_cmp_ps_mask(_mm512_abs_ps(x), _mm512_set1_ps(80.0f), _CMP_NLE_UQ);
        _mm512_mask_storeu_ps(v + i, m, r);
        for (__mmask16 k = (near | wild) & m; k; k &= k - 1) {
            const int l = __builtin_ctz(k);
            const float xl = x[l];
            v[i + l] = xl / (1.0f + expf(-xl));
        }
    }
}
#endif

