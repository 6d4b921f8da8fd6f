/* ---- matrix-vector products ------------------------------------------------------------------------------ */
/* gemv.h: the products' row kernels and the dtype-coded load / store helpers of every family, all static inline:
   each file that runs products (amx.c, int4.c, int8_activation.c, sublayer.c) or loads weights (the state steps,
   conv, attention) inlines them, as when the library was one translation unit. A file's scratch buffers
   (x_scratch, w_scratch: thread-local) are its own. */
#pragma once
#include "native.h"

typedef struct {
    const void *w;      /* [N, K] */
    const float *scale; /* [N] for int8 weights */
    const void *bias;   /* [N] or NULL */
    const void *res;    /* [B, N] residual added to the output, or NULL */
    void *y;            /* [B, N] */
    const float *x;     /* [B, K] fp32 (converted once by the caller) */
    int64_t N, K, B, rows;
    int wdt, bdt, ydt;
    int act1; /* 0: none, else an ACT_* + 1 applied to x W^T (* scale) + bias (a plain MLP's up projection) */
    const uint16_t *xb; /* [B, K] the caller's bf16 x where dot_row takes it as bf16 (bf16_x), else NULL */
    const uint32_t *xt; /* x as AMX B tiles (amx_pack_x) where the batch takes the AMX path, else NULL */
} Gemv;

static inline float load_as_f32(const void *p, int dt, int64_t i) {
    return dt == DT_BF16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* A product's output i: the activation (act1 - 1; 0: none) of the value rounded to ydt, then the residual added to
   the rounded value (bf16: torch's two ops, each rounded), stored. */
static inline void store_out(void *y, int ydt, const void *res, int act1, int64_t i, float v) {
    if (act1) v = activate(round_to(v, ydt), act1 - 1);
    if (res) v = round_to(v, ydt) + load_as_f32(res, ydt, i);
    store_as(y, ydt, i, v);
}

/* The weights of a row, 8 at a time, as fp32 vectors: one definition per storage dtype so every inner loop is
   specialised at compile time (a dtype switch inside the loop cost a third of the bandwidth). */
static inline v8 load_w8(const void *w, int wdt, int64_t i) {
#ifdef __AVX2__
    /* the intrinsics: GCC's generic vector conversions of 8-bit and 16-bit lanes came out as scalar code */
    if (wdt == DT_F32) return (v8)_mm256_loadu_ps((const float *)w + i);
    if (wdt == DT_BF16)
        return (v8)_mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + i))), 16));
    return (v8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)w + i))));
#else
    v8 out;
    if (wdt == DT_F32) {
        out = *(const v8u *)((const float *)w + i);
    } else if (wdt == DT_BF16) {
        u32x8 wi = __builtin_convertvector(*(const u16x8u *)((const uint16_t *)w + i), u32x8) << 16;
        memcpy(&out, &wi, sizeof out);
    } else {
        out = __builtin_convertvector(*(const i8x8u *)((const int8_t *)w + i), v8);
    }
    return out;
#endif
}

static inline float load_w1(const void *w, int wdt, int64_t i) {
    return wdt == DT_I8 ? (float)((const int8_t *)w)[i] : load_as_f32(w, wdt, i);
}

/* Eight values at once, the scalar helpers' bits (round_to, store_as): the small per-step ops (the norms) over whole
   vectors, where one value at a time they took ~4 ns each (an RMSNorm of 512 values 1.9 us, a gated one of 1024
   6 us: serial next to the products, whose other thread waits meanwhile). */
static inline u32x8 bf16_bits8(v8 v) { /* f32_to_bf16 in each lane, in the low 16 bits */
    u32x8 b;
    memcpy(&b, &v, sizeof b);
    const u32x8 nan = (b & 0x7fffffffu) > 0x7f800000u; /* all ones where NaN */
    return (nan & ((b >> 16) | 0x40u)) | (~nan & ((b + 0x7fffu + ((b >> 16) & 1u)) >> 16));
}

static inline v8 round8_to(v8 v, int dt) {
    if (dt != DT_BF16) return v;
    const u32x8 b = bf16_bits8(v) << 16;
    memcpy(&v, &b, sizeof v);
    return v;
}

static inline void store8_as(void *p, int dt, int64_t i, v8 v) {
    if (dt == DT_BF16) *(u16x8u *)((uint16_t *)p + i) = __builtin_convertvector(bf16_bits8(v), u16x8u);
    else *(v8u *)((float *)p + i) = v;
}

#ifdef __AVX512F__
/* f32_to_bf16 in 16 integer lanes (the low 16 bits of each): under -ffast-math GCC folds a float x != x to false */
static inline __m512i bf16_bits16(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v), hi = _mm512_srli_epi32(bits, 16);
    const __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_and_si512(hi, _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7fff))),
        16);
    const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    return _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
}
#endif

#ifdef __AVX2__
static inline __m256 bf16x8_load(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* nearest-even rounding of 8 floats to bf16 (f32_to_bf16's, NaN kept a NaN), stored */
static inline void bf16x8_store(uint16_t *p, __m256 v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    const __m256i qnan = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
    r = _mm256_blendv_epi8(r, qnan, nan);
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128((__m128i *)p, packed);
}
#endif

/* sum of x[i]^2 over d fp32 or bf16 values, in double (each square exact there) as the scalar loop it replaces, in
   eight double lanes summed in a fixed order (which lane a value falls in depends on its index alone) */
typedef double v4d __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));
static inline double sumsq_f64(const void *x, int dt, int64_t d) {
    v4d a0 = {0}, a1 = {0};
    int64_t i = 0;
    for (; i + 8 <= d; i += 8) {
        const v8 v = load_w8(x, dt, i);
        const v4f lo = {v[0], v[1], v[2], v[3]}, hi = {v[4], v[5], v[6], v[7]};
        const v4d dl = __builtin_convertvector(lo, v4d), dh = __builtin_convertvector(hi, v4d);
        a0 += dl * dl, a1 += dh * dh;
    }
    const v4d a = a0 + a1;
    double ss = (a[0] + a[1]) + (a[2] + a[3]);
    for (; i < d; ++i) {
        const double v = load_as_f32(x, dt, i);
        ss += v * v;
    }
    return ss;
}

/* A thread's scratch of at least n floats (*buf / *cap: that thread's own), grown when too small; NULL when
   out of memory. */
static inline float *grow_scratch(float **buf, int64_t *cap, int64_t n) {
    if (n > *cap) {
        free(*buf);
        *buf = aligned_alloc(64, ((n * 4 + 63) / 64) * 64);
        *cap = *buf ? n : 0;
    }
    return *buf;
}

/* the input rows converted to fp32 (load_x) */
static inline float *x_scratch(int64_t n) {
    static _Thread_local float *buf = NULL;
    static _Thread_local int64_t cap = 0;
    return grow_scratch(&buf, &cap, n);
}

#ifdef __AVX2__
/* bf16 weights 16 at a time: one 256-bit load, each bf16 moved into the high half of a zeroed 32-bit lane by
   an unpack (one instruction per 8 weights, where widening 8 at a time took a load, a zero-extend and a shift:
   ~8% more bandwidth measured on the 2-vCPU Zen machine). The unpacks take lanes in the order 0-3, 8-11 (lo)
   and 4-7, 12-15 (hi), so the input x is stored permuted to match (permute_for_bf16). */
#define BF16_UNPACK 1
static inline void bf16x16(const uint16_t *p, v8 *lo, v8 *hi) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)p), z = _mm256_setzero_si256();
    *lo = (v8)_mm256_castsi256_ps(_mm256_unpacklo_epi16(z, v));
    *hi = (v8)_mm256_castsi256_ps(_mm256_unpackhi_epi16(z, v));
}
#endif

/* x [B, K] (fp32) reordered in blocks of 16 for bf16x16: 0-3, 8-11, 4-7, 12-15; the tail past the last full
   block stays in order. */
static inline void permute_for_bf16(float *x, int64_t B, int64_t K) {
#ifdef BF16_UNPACK
    const int64_t K16 = K & ~(int64_t)15;
    for (int64_t b = 0; b < B; ++b)
        for (int64_t k = 0; k < K16; k += 16) {
            float *p = x + b * K + k, t[4];
            memcpy(t, p + 4, sizeof t);
            memcpy(p + 4, p + 8, sizeof t);
            memcpy(p + 8, t, sizeof t);
        }
#else
    (void)x, (void)B, (void)K;
#endif
}

/* x converted to fp32 into this thread's scratch, in the order the weights' dot products take it */
static inline float *load_x(const void *x, int xdt, int64_t B, int64_t K, int wdt) {
    float *xf = x_scratch(B * K);
    if (!xf) return NULL;
    for (int64_t i = 0; i < B * K; ++i) xf[i] = load_as_f32(x, xdt, i);
    if (wdt == DT_BF16) permute_for_bf16(xf, B, K);
    return xf;
}

#ifdef __AVX512BF16__
/* the masks of a bf16 row's last 1-63 values over two 32-lane loads (masked-off lanes read nothing and are zero) */
static inline void tail_masks32(int64_t rem, __mmask32 *m0, __mmask32 *m1) {
    *m0 = rem >= 32 ? 0xFFFFFFFFu : (__mmask32)((1ull << rem) - 1);
    *m1 = rem <= 32 ? 0 : (__mmask32)((1ull << (rem - 32)) - 1);
}
#endif

/* One row against B input rows: 4 independent accumulators per input row over 32 weights, so the loads of
   the row stream without waiting on the adds; every weight read from memory once. */
static inline __attribute__((always_inline)) void dot_row(const Gemv *g, int64_t n, float *out, const int wdt) {
    const int64_t K = g->K, K32 = K & ~(int64_t)31, K8 = K & ~(int64_t)7;
    const int64_t B = g->B;
    const int64_t off = n * K;
#ifdef __AVX512BF16__
    /* bf16 weights against bf16 inputs: vdpbf16ps multiplies 32 bf16 pairs and adds them into 16 fp32 lanes in
       one instruction. A bf16 x bf16 product is exact in fp32, so each lane is a chain of correctly rounded adds,
       as the widening loop below is (only the order of the sums differs, and denormals flush to zero). Where
       this CPU has it the widening loop's unpacks and FMAs were the limit (bf16 llama-d512 step 9.1 ms, 0.42 of
       the read floor, on the 2-vCPU Xeon with AMX). */
    if (wdt == DT_BF16 && g->xb) {
        const uint16_t *w = (const uint16_t *)g->w + off;
        const int64_t K64 = K & ~(int64_t)63;
        for (int64_t b = 0; b < B; ++b) {
            const uint16_t *x = g->xb + b * K;
            __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
            int64_t k = 0;
            /* no STREAM_PREFETCH here: with the weights on 2 MiB pages (kernels/host_memory.py) the hardware's
               own prefetchers kept ahead of this loop and the software ones only cost it: llama-d512's bf16 step
               against the prefetching library, 24 alternating rounds of 16 steps (2-vCPU Zen 4), median ratio
               1.064 (20 of 24 rounds faster). The fp32 loop keeps them: without, the same test read 0.890. */
            for (; k < K64; k += 64) {
                a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512((const void *)(w + k)),
                                      (__m512bh)_mm512_loadu_si512((const void *)(x + k)));
                a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512((const void *)(w + k + 32)),
                                      (__m512bh)_mm512_loadu_si512((const void *)(x + k + 32)));
            }
            if (k < K) { /* the last 1-63 */
                __mmask32 m0, m1;
                tail_masks32(K - k, &m0, &m1);
                a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_maskz_loadu_epi16(m0, w + k),
                                      (__m512bh)_mm512_maskz_loadu_epi16(m0, x + k));
                a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_maskz_loadu_epi16(m1, w + k + 32),
                                      (__m512bh)_mm512_maskz_loadu_epi16(m1, x + k + 32));
            }
            out[b] = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
        }
        return;
    }
#endif
#ifdef BF16_UNPACK
    if (wdt == DT_BF16) {
        const uint16_t *w = (const uint16_t *)g->w + off;
        const int64_t K16 = K & ~(int64_t)15;
        for (int64_t b = 0; b < B; ++b) {
            const float *x = g->x + b * K;
            v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, l0, h0, l1, h1;
            int64_t k = 0;
            for (; k < K32; k += 32) {
                /* (a non-temporal prefetch 1 KB ahead here took a bf16 llama-d512 step 5.1 -> 4.2 ms on a Zen 3 VM,
                   median of 3 A/B runs; the same for its fp32 weights measured slower, 6.5 -> 7.6 ms, so the AVX2
                   fp32 loop has none. The 4 KB L2 prefetch that replaced it is measured on Zen 4 only.) */
                STREAM_PREFETCH((const char *)(w + k), 1);
                bf16x16(w + k, &l0, &h0);
                bf16x16(w + k + 16, &l1, &h1);
                a0 += l0 * *(const v8u *)(x + k);
                a1 += h0 * *(const v8u *)(x + k + 8);
                a2 += l1 * *(const v8u *)(x + k + 16);
                a3 += h1 * *(const v8u *)(x + k + 24);
            }
            for (; k < K16; k += 16) {
                bf16x16(w + k, &l0, &h0);
                a0 += l0 * *(const v8u *)(x + k);
                a1 += h0 * *(const v8u *)(x + k + 8);
            }
            float s = hsum(a0 + a1 + a2 + a3);
            for (; k < K; ++k) s += bf16_to_f32(w[k]) * x[k];
            out[b] = s;
        }
        return;
    }
#endif
#ifdef __AVX512F__
    /* fp32 weights, 64 a step in four 512-bit accumulators (the AVX2 loop below reached 17-33 GB/s on a Xeon whose
       L3 holds the weights, torch's oneDNN GEMV 33-59): every input row against the row, re-read from L1 */
    if (wdt == DT_F32) {
        const float *w = (const float *)g->w + off;
        const int64_t K64 = K & ~(int64_t)63, K16 = K & ~(int64_t)15;
        for (int64_t b = 0; b < B; ++b) {
            const float *x = g->x + b * K;
            __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(),
                   a3 = _mm512_setzero_ps();
            int64_t k = 0;
            for (; k < K64; k += 64) {
                if (b == 0) STREAM_PREFETCH((const char *)(w + k), 4);
                a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k), _mm512_loadu_ps(x + k), a0);
                a1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k + 16), _mm512_loadu_ps(x + k + 16), a1);
                a2 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k + 32), _mm512_loadu_ps(x + k + 32), a2);
                a3 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k + 48), _mm512_loadu_ps(x + k + 48), a3);
            }
            for (; k < K16; k += 16) a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k), _mm512_loadu_ps(x + k), a0);
            if (k < K) {
                const __mmask16 m = (__mmask16)((1u << (K - k)) - 1);
                a1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, w + k), _mm512_maskz_loadu_ps(m, x + k), a1);
            }
            out[b] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
        }
        return;
    }
#endif
    if (B == 1) {
        const float *x = g->x;
        v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        int64_t k = 0;
        for (; k < K32; k += 32) {
            a0 += load_w8(g->w, wdt, off + k) * *(const v8u *)(x + k);
            a1 += load_w8(g->w, wdt, off + k + 8) * *(const v8u *)(x + k + 8);
            a2 += load_w8(g->w, wdt, off + k + 16) * *(const v8u *)(x + k + 16);
            a3 += load_w8(g->w, wdt, off + k + 24) * *(const v8u *)(x + k + 24);
        }
        for (; k < K8; k += 8) a0 += load_w8(g->w, wdt, off + k) * *(const v8u *)(x + k);
        float s = hsum(a0 + a1 + a2 + a3);
        for (; k < K; ++k) s += load_w1(g->w, wdt, off + k) * x[k];
        out[0] = s;
        return;
    }
    /* several input rows: the weight row (at most K * 4 bytes) is read from memory once, then from L1 */
    for (int64_t b = 0; b < B; ++b) {
        const float *x = g->x + b * K;
        v8 a0 = {0}, a1 = {0};
        int64_t k = 0;
        for (; k + 16 <= K8; k += 16) {
            a0 += load_w8(g->w, wdt, off + k) * *(const v8u *)(x + k);
            a1 += load_w8(g->w, wdt, off + k + 8) * *(const v8u *)(x + k + 8);
        }
        for (; k < K8; k += 8) a0 += load_w8(g->w, wdt, off + k) * *(const v8u *)(x + k);
        float s = hsum(a0 + a1);
        for (; k < K; ++k) s += load_w1(g->w, wdt, off + k) * x[k];
        out[b] = s;
    }
}

/* Several input rows (a batched decode step): past a few rows the product is compute-bound, and one weight row
   against each input row in turn does one FMA per two loads. Here 4 weight rows (widened to fp32 once, into
   this thread's scratch, for bf16 / int8) meet 3 input rows at a time: 12 accumulators, 7 loads per 12 FMAs. */
#define MULTI_ROWS 4 /* from this many input rows on */

/* The caller's x for the vdpbf16ps loops (dot_row, dot4_bf16, block4_bf16: every batch size), or NULL: only on a
   CPU with AVX512-BF16, only bf16 weights against bf16 inputs (fp32 ones would be rounded) */
static inline const uint16_t *bf16_x(const void *x, int xdt, int wdt, int64_t B, int64_t K) {
#ifdef __AVX512BF16__
    if (wdt == DT_BF16 && xdt == DT_BF16 && K >= 64) return (const uint16_t *)x;
#endif
    (void)x, (void)xdt, (void)wdt, (void)B, (void)K;
    return NULL;
}

/* a block of weight rows widened to fp32 (dot_rows) */
static inline float *w_scratch(int64_t n) {
    static _Thread_local float *buf = NULL;
    static _Thread_local int64_t cap = 0;
    return grow_scratch(&buf, &cap, n);
}

/* weight row n as fp32, in the order the (permuted, for bf16) x takes it */
static inline const float *row_f32(const Gemv *g, int64_t n, float *dst, const int wdt) {
    const int64_t K = g->K;
    if (wdt == DT_F32) return (const float *)g->w + n * K;
    int64_t k = 0;
    if (wdt == DT_BF16) {
        const uint16_t *w = (const uint16_t *)g->w + n * K;
#ifdef BF16_UNPACK
        for (; k + 16 <= K; k += 16) {
            v8 lo, hi;
            bf16x16(w + k, &lo, &hi);
            *(v8u *)(dst + k) = lo;
            *(v8u *)(dst + k + 8) = hi;
        }
#endif
        for (; k < K; ++k) dst[k] = bf16_to_f32(w[k]);
    } else {
        const int8_t *w = (const int8_t *)g->w + n * K;
        for (; k + 8 <= K; k += 8) *(v8u *)(dst + k) = load_w8(w, DT_I8, k);
        for (; k < K; ++k) dst[k] = (float)w[k];
    }
    return dst;
}

/* An 8-float vector held in a register at this point (an empty asm: the compiler cannot fold its load into the
   instructions that use it). Only where a ymm register can hold it (AVX): elsewhere (plain x86-64, other
   architectures) the "x" constraint is impossible and the library failed to build at all. */
#ifdef __AVX__
#define PIN_V8(v) __asm__("" : "+x"(v))
#else
#define PIN_V8(v) ((void)0)
#endif

static inline __attribute__((always_inline)) void block_4xNB(const float *const *w, const float *x, int64_t K,
                                                             float out[4][MAXB], int64_t b0, const int NB) {
    v8 a[4][3] = {{{0}}};
    const int64_t K8 = K & ~(int64_t)7;
    int64_t k = 0;
    for (; k < K8; k += 8) {
        v8 xv[3];
        for (int j = 0; j < NB; ++j) {
            xv[j] = *(const v8u *)(x + (b0 + j) * K + k);
            PIN_V8(xv[j]);
        }
        for (int r = 0; r < 4; ++r) {
            /* the empty asms keep wv and the xv in registers (as block8_f32_nb's wv): GCC 12 folded wv's load into
               each of the NB FMAs (15 loads per 12 FMAs where 7 do), and with wv alone pinned, the xv's */
            v8 wv = *(const v8u *)(w[r] + k);
            PIN_V8(wv);
            for (int j = 0; j < NB; ++j) a[r][j] += wv * xv[j];
        }
    }
    for (int r = 0; r < 4; ++r)
        for (int j = 0; j < NB; ++j) {
            float sum = hsum(a[r][j]);
            for (int64_t t = k; t < K; ++t) sum += w[r][t] * x[(b0 + j) * K + t];
            out[r][b0 + j] = sum;
        }
}

#ifdef __AVX512F__
/* out[r][b] = the sum of v[r]'s 16 lanes, for 4 rows at once, each in _mm512_reduce_add_ps's order (256-bit halves,
   128-bit halves, then (0 + 2) + (1 + 3)): a row's bits as dot_row's */
static inline void hsum4_ps(const __m512 v[4], float out[4][MAXB], int64_t b) {
    __m128 t[4];
    for (int r = 0; r < 4; ++r) {
        const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v[r]),
                                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v[r]), 1)));
        t[r] = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    }
    const __m128 s01 = _mm_add_ps(_mm_shuffle_ps(t[0], t[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm_shuffle_ps(t[0], t[1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m128 s23 = _mm_add_ps(_mm_shuffle_ps(t[2], t[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm_shuffle_ps(t[2], t[3], _MM_SHUFFLE(3, 2, 3, 2)));
    float res[4];
    _mm_storeu_ps(res, _mm_add_ps(_mm_shuffle_ps(s01, s23, _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm_shuffle_ps(s01, s23, _MM_SHUFFLE(3, 1, 3, 1))));
    for (int r = 0; r < 4; ++r) out[r][b] = res[r];
}
#endif

#ifdef __AVX512F__
/* out[0..8) = the sums of v[0..8)'s 16 lanes, by one fixed tree for the eight (256-bit halves of row pairs, then
   128-bit quarters, then within 128-bit lanes): 17 shuffles and 8 adds where hsum4_ps twice took ~60 ops */
static inline __m256 hsum8_ps(const __m512 v[8]) {
    __m512 t[4], q[2];
    for (int i = 0; i < 4; ++i) /* [v0.q0 + v0.q2, v0.q1 + v0.q3, v1.q0 + v1.q2, v1.q1 + v1.q3] for v[2i], v[2i+1] */
        t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 2; ++i) /* 128-bit lane l: row 4i + l's four partial sums */
        q[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    /* lane l: [row l (0 + 2), row l (1 + 3), row l + 4 (0 + 2), row l + 4 (1 + 3)] */
    const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(q[0], q[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_ps(q[0], q[1], _MM_SHUFFLE(3, 2, 3, 2)));
    /* lane l: [row l, row l + 4, (the same twice)] */
    const __m512 f = _mm512_add_ps(_mm512_shuffle_ps(z, z, _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_ps(z, z, _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_castps512_ps256(
        _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0), f));
}

/* fp32 weights against several fp32 input rows on AVX-512 (a batched decode step, compute-bound): 8 weight rows
   against NB (1..3, a constant: the 24 accumulators stay in registers, of the 32) input rows, 16 lanes a step, the
   NB input vectors loaded once for the 8 rows and each weight vector once for the NB input rows (11 loads per 24
   FMAs). fp32 accumulation over K in each lane, then hsum8_ps's tree: the sums of input row b0 + j land in
   outT[b0 + j][0..8) (transposed: the caller's epilogue takes a row's 16 outputs as one vector). A row's bits do not
   depend on the batch or on the block it fell in; they differ from the one-row path's (another order of sums). pf
   (or NULL): pf_len bytes of the weights to come, one 64-byte line a step prefetched into L2 (rows16_f32). */
static inline __attribute__((always_inline)) void block8_f32_nb(const float *const *w, const float *x, int64_t K,
                                                                float *outT, int64_t b0, const int NB,
                                                                const char *pf, int64_t pf_len) {
    const int64_t K16 = K & ~(int64_t)15;
    const float *xr = x + b0 * K;
    __m512 a[3][8];
    for (int r = 0; r < 8; ++r)
        for (int j = 0; j < NB; ++j) a[j][r] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k < K16; k += 16) {
        __m512 xv[3];
        for (int j = 0; j < NB; ++j) xv[j] = _mm512_loadu_ps(xr + j * K + k);
        if (pf && 4 * k < pf_len) _mm_prefetch(pf + 4 * k, _MM_HINT_T1);
        for (int r = 0; r < 8; ++r) {
            /* the empty asm keeps wv in a register: without it GCC 12 folded the load into each of the NB FMAs
               (27 loads per 24 FMAs, not 11); fp32 2048x768 at 32 rows, 2 threads, L3-resident weights: median
               121 -> 147 GFLOP/s, alternating in one process */
            __m512 wv = _mm512_loadu_ps(w[r] + k);
            __asm__("" : "+v"(wv));
            for (int j = 0; j < NB; ++j) a[j][r] = _mm512_fmadd_ps(wv, xv[j], a[j][r]);
        }
    }
    if (k < K) {
        const __mmask16 m = (__mmask16)((1u << (K - k)) - 1);
        __m512 xv[3];
        for (int j = 0; j < NB; ++j) xv[j] = _mm512_maskz_loadu_ps(m, xr + j * K + k);
        for (int r = 0; r < 8; ++r) {
            const __m512 wv = _mm512_maskz_loadu_ps(m, w[r] + k);
            for (int j = 0; j < NB; ++j) a[j][r] = _mm512_fmadd_ps(wv, xv[j], a[j][r]);
        }
    }
    for (int j = 0; j < NB; ++j) _mm256_storeu_ps(outT + (b0 + j) * 16, hsum8_ps(a[j]));
}

/* 8 fp32 weight rows against input rows b0..b0+nb-1 (nb 1..3) */
static inline void block8_f32(const float *const *w, const float *x, int64_t K, float *outT, int64_t b0, int nb,
                              const char *pf, int64_t pf_len) {
    if (nb == 3) block8_f32_nb(w, x, K, outT, b0, 3, pf, pf_len);
    else if (nb == 2) block8_f32_nb(w, x, K, outT, b0, 2, pf, pf_len);
    else block8_f32_nb(w, x, K, outT, b0, 1, pf, pf_len);
}

/* rows n0..n0+nr-1 (nr <= 16) of an fp32 W against all B input rows into outT[b][0..nr): eight rows at a time (a
   short last block repeats its last row; its sums are dropped) against the input rows in blocks of at most 3, as
   even as they split (2 + 2 for 4). The eight weight rows (8 K floats: 24 KB at K 768) stay in L1 while the input
   rows stream past them from L2; with the loops the other way round (the 16 rows against one block of input rows
   at a time) fp32 2048x768 at 64 rows took 1.96 ms, this order with 4-row blocks 1.69, with 8-row blocks 1.67
   (Zen 4, 2 threads; the old 4x3 8-lane block 3.4 ms).
   Weights that stream from memory (P_stream): while eight rows meet the input blocks, the next eight rows (the
   next 8 K floats of W) are prefetched into L2, a slice per input block, one line a step; the first pass over
   eight rows otherwise waited on their lines (fp32 3352x768 at 32 rows, 1 thread, weights from DRAM: median
   57.8 -> 64.3 GFLOP/s; 32000x768 55.9 -> 64.4, alternating in one process).
   Transposed outputs (F32_BATCHED's epilogues store an input row's 16 outputs as one vector): against hsum4_ps into
   [row][b] and scalar stores down the columns of y, 32 rows, alternating in one process: 1 thread, 3352x768 from
   DRAM median 77.6 -> 85.6 GFLOP/s, 32000x768 78.5 -> 87.3, 256x768 from L2 88 -> 100; 2 threads, 2048x768 119 ->
   138, 32000x768 149 -> 163; the batch-32 step 49.2 -> 45.4 ms (llama-small), 47.9 -> 44.7 (hybrid-1to7-small). */
static inline void rows16_f32(const Gemv *g, int64_t n0, int nr, float outT[MAXB][16]) {
    const int64_t K = g->K, B = g->B, nblk = (B + 2) / 3;
    const float *w[16];
    for (int r = 0; r < 16; ++r) w[r] = (const float *)g->w + (n0 + (r < nr ? r : nr - 1)) * K;
    const char *wend = (const char *)((const float *)g->w + g->N * K);
    const int64_t per = (8 * K * 4 + nblk - 1) / nblk; /* bytes of the next rows to prefetch per input block */
    for (int r = 0; r < nr; r += 8) {
        const char *next = (const char *)(w[r] + 8 * K);
        for (int64_t i = 0, b0 = 0; i < nblk; ++i) {
            const int nb = (int)((B - b0) / (nblk - i) + ((B - b0) % (nblk - i) != 0));
            const char *pf = next + i * per, *pe = pf + per < wend ? pf + per : wend;
            block8_f32(w + r, g->x, K, &outT[0][r], b0, nb, P_stream && pf < pe ? pf : NULL, pe - pf);
            b0 += nb;
        }
    }
}

/* 16 values p[i..i+16) of dtype dt as fp32 (lanes past m zero) */
static inline __m512 load16_f32(const void *p, int dt, int64_t i, __mmask16 m) {
    if (dt == DT_F32) return _mm512_maskz_loadu_ps(m, (const float *)p + i);
#ifdef __AVX512BW__
    if (dt == DT_BF16) /* (a bf16 value widens exactly: its bits are the fp32's top half) */
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, (const uint16_t *)p + i)), 16));
#endif
    float t[16] = {0};
    for (int l = 0; l < 16; ++l)
        if (m >> l & 1) t[l] = load_as_f32(p, dt, i + l);
    return _mm512_loadu_ps(t);
}

static inline __mmask16 mask16(int64_t n) {
    return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
}
#define F32_BATCHED(g, wdt) ((wdt) == DT_F32 && (g)->B >= MULTI_ROWS)
#else
#define F32_BATCHED(g, wdt) 0
#endif

#ifdef __AVX512BF16__
/* dot_row's vdpbf16ps loop for 4 rows against one bf16 input row: the input read once for the four, and the four
   horizontal sums done together. Each row's sums run in dot_row's order (its two accumulators, then
   _mm512_reduce_add_ps's tree: 256-bit halves, 128-bit halves, (0 + 2) + (1 + 3)), so a row's bits do not depend
   on whether it fell in a block of four. */
static inline void dot4_bf16(const Gemv *g, int64_t n0, float out[4][MAXB]) {
    const int64_t K = g->K, K64 = K & ~(int64_t)63;
    const uint16_t *x = g->xb, *w[4];
    for (int r = 0; r < 4; ++r) w[r] = (const uint16_t *)g->w + (n0 + r) * K;
    __m512 a[4][2];
    for (int r = 0; r < 4; ++r) a[r][0] = a[r][1] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k < K64; k += 64) {
        const __m512bh x0 = (__m512bh)_mm512_loadu_si512((const void *)(x + k)),
                       x1 = (__m512bh)_mm512_loadu_si512((const void *)(x + k + 32));
        for (int r = 0; r < 4; ++r) {
            STREAM_PREFETCH((const char *)(w[r] + k), 2);
            a[r][0] = _mm512_dpbf16_ps(a[r][0], (__m512bh)_mm512_loadu_si512((const void *)(w[r] + k)), x0);
            a[r][1] = _mm512_dpbf16_ps(a[r][1], (__m512bh)_mm512_loadu_si512((const void *)(w[r] + k + 32)), x1);
        }
    }
    if (k < K) {
        __mmask32 m0, m1;
        tail_masks32(K - k, &m0, &m1);
        const __m512bh x0 = (__m512bh)_mm512_maskz_loadu_epi16(m0, x + k),
                       x1 = (__m512bh)_mm512_maskz_loadu_epi16(m1, x + k + 32);
        for (int r = 0; r < 4; ++r) {
            a[r][0] = _mm512_dpbf16_ps(a[r][0], (__m512bh)_mm512_maskz_loadu_epi16(m0, w[r] + k), x0);
            a[r][1] = _mm512_dpbf16_ps(a[r][1], (__m512bh)_mm512_maskz_loadu_epi16(m1, w[r] + k + 32), x1);
        }
    }
    const __m512 v[4] = {_mm512_add_ps(a[0][0], a[0][1]), _mm512_add_ps(a[1][0], a[1][1]),
                         _mm512_add_ps(a[2][0], a[2][1]), _mm512_add_ps(a[3][0], a[3][1])};
    hsum4_ps(v, out, 0);
}

/* 4 bf16 weight rows against NB (1 or 2, a constant: the accumulators stay in registers) bf16 input rows from b:
   each (row, input row) pair keeps dot_row's two accumulators and its order, so a row's bits are dot_row's
   whatever the batch, and the weight vectors load once per NB input rows */
static inline __attribute__((always_inline)) void block4_bf16_nb(const Gemv *g, const uint16_t *const *w,
                                                                 int64_t b, float out[4][MAXB], const int NB) {
    const int64_t K = g->K, K64 = K & ~(int64_t)63;
    __m512 a[4][2][2];
    for (int r = 0; r < 4; ++r)
        for (int j = 0; j < NB; ++j) a[r][j][0] = a[r][j][1] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K64; k += 64) {
        __m512bh x[2][2];
        for (int j = 0; j < NB; ++j) {
            x[j][0] = (__m512bh)_mm512_loadu_si512((const void *)(g->xb + (b + j) * K + k));
            x[j][1] = (__m512bh)_mm512_loadu_si512((const void *)(g->xb + (b + j) * K + k + 32));
        }
        for (int r = 0; r < 4; ++r) {
            if (b == 0) STREAM_PREFETCH((const char *)(w[r] + k), 2);
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512((const void *)(w[r] + k)),
                           w1 = (__m512bh)_mm512_loadu_si512((const void *)(w[r] + k + 32));
            for (int j = 0; j < NB; ++j) {
                a[r][j][0] = _mm512_dpbf16_ps(a[r][j][0], w0, x[j][0]);
                a[r][j][1] = _mm512_dpbf16_ps(a[r][j][1], w1, x[j][1]);
            }
        }
    }
    if (K64 < K) {
        __mmask32 m0, m1;
        tail_masks32(K - K64, &m0, &m1);
        for (int r = 0; r < 4; ++r) {
            const __m512bh w0 = (__m512bh)_mm512_maskz_loadu_epi16(m0, w[r] + K64),
                           w1 = (__m512bh)_mm512_maskz_loadu_epi16(m1, w[r] + K64 + 32);
            for (int j = 0; j < NB; ++j) {
                const uint16_t *xj = g->xb + (b + j) * K + K64;
                a[r][j][0] = _mm512_dpbf16_ps(a[r][j][0], w0, (__m512bh)_mm512_maskz_loadu_epi16(m0, xj));
                a[r][j][1] = _mm512_dpbf16_ps(a[r][j][1], w1, (__m512bh)_mm512_maskz_loadu_epi16(m1, xj + 32));
            }
        }
    }
    for (int j = 0; j < NB; ++j) {
        __m512 v[4];
        for (int r = 0; r < 4; ++r) v[r] = _mm512_add_ps(a[r][j][0], a[r][j][1]);
        hsum4_ps(v, out, b + j);
    }
}

/* 4 bf16 weight rows against every bf16 input row, two at a time (16 accumulators, 6 loads per 16 vdpbf16ps).
   The batched decode step was compute-bound in the widening block path below: bf16 llama-d512 at 32 sequences,
   43 ms a step. */
static inline void block4_bf16(const Gemv *g, int64_t n0, float out[4][MAXB]) {
    const uint16_t *w[4];
    for (int r = 0; r < 4; ++r) w[r] = (const uint16_t *)g->w + (n0 + r) * g->K;
    int64_t b = 0;
    for (; b + 2 <= g->B; b += 2) block4_bf16_nb(g, w, b, out, 2);
    if (b < g->B) block4_bf16_nb(g, w, b, out, 1);
}
#endif

#ifdef __AVX512F__
/* dot_row's fp32 AVX-512 loop for 4 rows against one input row (its four accumulators per row and their order) */
static inline void dot4_f32(const Gemv *g, int64_t n0, float out[4][MAXB]) {
    const int64_t K = g->K, K64 = K & ~(int64_t)63, K16 = K & ~(int64_t)15;
    const float *x = g->x, *w[4];
    for (int r = 0; r < 4; ++r) w[r] = (const float *)g->w + (n0 + r) * K;
    __m512 a[4][4];
    for (int r = 0; r < 4; ++r) a[r][0] = a[r][1] = a[r][2] = a[r][3] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k < K64; k += 64) {
        for (int r = 0; r < 4; ++r) STREAM_PREFETCH((const char *)(w[r] + k), 4);
        for (int j = 0; j < 4; ++j) {
            const __m512 xv = _mm512_loadu_ps(x + k + 16 * j);
            for (int r = 0; r < 4; ++r) a[r][j] = _mm512_fmadd_ps(_mm512_loadu_ps(w[r] + k + 16 * j), xv, a[r][j]);
        }
    }
    for (; k < K16; k += 16) {
        const __m512 xv = _mm512_loadu_ps(x + k);
        for (int r = 0; r < 4; ++r) a[r][0] = _mm512_fmadd_ps(_mm512_loadu_ps(w[r] + k), xv, a[r][0]);
    }
    if (k < K) {
        const __mmask16 m = (__mmask16)((1u << (K - k)) - 1);
        const __m512 xv = _mm512_maskz_loadu_ps(m, x + k);
        for (int r = 0; r < 4; ++r) a[r][1] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, w[r] + k), xv, a[r][1]);
    }
    __m512 v[4];
    for (int r = 0; r < 4; ++r) v[r] = _mm512_add_ps(_mm512_add_ps(a[r][0], a[r][1]), _mm512_add_ps(a[r][2], a[r][3]));
    hsum4_ps(v, out, 0);
}
#endif
