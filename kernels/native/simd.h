/* simd.h: the conversions and activations every family uses, static inline (each call site inlines them, as when the
   library was one translation unit): bf16 <-> fp32 with torch's rounding, the dtype-coded load/store of one value,
   a horizontal sum, the MLP activations, and the AVX-512 exp / SiLU of 16 lanes. Included by native.h. */

#pragma once

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
