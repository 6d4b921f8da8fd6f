/* ---- conversions: the SiLU passes (the inline conversions and activations are simd.h's) ----------------- */
#include "native.h"

/* SiLU in place over fp32 v[0..n), v = x * scale + bias first (the gated MLP's gate row). Where AVX-512 is, 16 lanes
   of exp16_ps (the last 1-15 masked: a value's bits never depend on where it fell): a batched step's libm expf
   calls were ~4 ns each, 0.14 of a 1.4 ms gated MLP product at 32 rows on the 2-vCPU Zen 4, and the conv and gated
   norm of a Mamba-2 layer were mostly expf. Only fp32 outputs take it: bf16 rounds libm's expf where torch's eager
   ops round (tests/test_native_decode.py: bf16 sub-layers bit-equal to eager); fp32 SiLU moves by <= ~3 ulp. */
void silu_f32(float *v, int64_t n, float scale, float bias) {
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
void silu_bf16_exact(float *v, int64_t n) {
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

