/* ---- int4 weight-only products (torchao's CPU Int4OpaqueTensor, aten's int4pack layout) ----------------------
   docs/notes/int4-cpu-layout.md: codes q in 0..15, qdata uint8 [N, K/2] in blocks of BN output rows, K-major, BN
   chosen by aten for the CPU it dispatched to (the caller passes it: kernels.projection.int4pack_block()):
   - BN = 32 (AVX2): the 16 bytes at block nb, input k hold rows nb*32 + i (low nibble) and nb*32 + 16 + i (high
     nibble), i < 16; a last block of 16 rows (N % 32 == 16) holds 8 bytes per k, rows 2j (low) and 2j + 1 (high).
   - BN = 64 (AVX512): the 32 bytes at block nb, input k hold rows nb*64 + i (low) and nb*64 + 32 + i (high),
     i < 32; the last N % 64 rows (16, 32 or 48) hold (N % 64) / 2 bytes per k, rows 2j (low) and 2j + 1 (high).
   scale_and_zero [K/G, N, 2] (fp32 or bf16: the model's dtype) per group of G inputs: w = (q - 8) * scale + zero.

   Per block and group the codes' dot products sum_k q x_k are accumulated in fp32 (one k's 16 or 32 bytes give
   32 or 64 rows' codes), then y += scale * that + (zero - 8 scale) * sum_k x_k: the group's dequantisation costs a
   few operations per row per group instead of one per weight. */
#include "native.h"
#include "products.h"


typedef int32_t i32x8 __attribute__((vector_size(32)));

/* the codes of one k of a 32-row block as fp32: rows 0-7, 8-15, 16-23, 24-31 */
static inline void nib32(const uint8_t *p, v8 *r0, v8 *r1, v8 *r2, v8 *r3) {
#ifdef __AVX2__
    /* each half of the 16 bytes zero-extended to 32-bit lanes straight from memory, then the low nibble masked
       and the high one shifted down: 2 widening loads, 4 integer ops, 4 conversions for 32 codes (splitting
       the nibbles first took 2 more shuffles and left the compiler too few registers for its accumulators) */
    const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)));
    const __m256i m = _mm256_set1_epi32(15);
    *r0 = (v8)_mm256_cvtepi32_ps(_mm256_and_si256(a, m));
    *r1 = (v8)_mm256_cvtepi32_ps(_mm256_and_si256(b, m));
    *r2 = (v8)_mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4));
    *r3 = (v8)_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
#else
    for (int i = 0; i < 8; ++i) {
        (*r0)[i] = (float)(p[i] & 15), (*r1)[i] = (float)(p[8 + i] & 15);
        (*r2)[i] = (float)(p[i] >> 4), (*r3)[i] = (float)(p[8 + i] >> 4);
    }
#endif
}

/* scale and zero of 8 consecutive rows (one group): 8 (scale, zero) pairs de-interleaved */
static inline void load_sz8(const void *sz, int sdt, int64_t i, v8 *s, v8 *z) {
    const v8 p0 = load_w8(sz, sdt, i), p1 = load_w8(sz, sdt, i + 8);
    const i32x8 ms = {0, 2, 4, 6, 8, 10, 12, 14}, mz = {1, 3, 5, 7, 9, 11, 13, 15};
    *s = __builtin_shuffle(p0, p1, ms);
    *z = __builtin_shuffle(p0, p1, mz);
}

/* one block's group codes (G inputs from k0) widened to fp32 into wb [G][32] in row order (a 16-row tail block
   fills lanes 0-15) */
static void int4_widen(const uint8_t *q, int nr, int64_t k0, int64_t G, float *wb) {
    if (nr == 32) {
        for (int64_t kk = 0; kk < G; ++kk) {
            v8 r0, r1, r2, r3;
            nib32(q + (k0 + kk) * 16, &r0, &r1, &r2, &r3);
            float *d = wb + kk * 32;
            *(v8u *)d = r0, *(v8u *)(d + 8) = r1, *(v8u *)(d + 16) = r2, *(v8u *)(d + 24) = r3;
        }
        return;
    }
    for (int64_t kk = 0; kk < G; ++kk) {
        const uint8_t *p = q + (k0 + kk) * 8;
        float *d = wb + kk * 32;
        for (int j = 0; j < 8; ++j) d[2 * j] = (float)(p[j] & 15), d[2 * j + 1] = (float)(p[j] >> 4);
    }
}

/* acc[b][r] = sum over the G widened weights wb of rows r < NV * 8 against input rows b0, b0 + 1 (NB of them) */
static inline __attribute__((always_inline)) void int4_dots(const float *wb, const float *x, int64_t K, int64_t k0,
                                                            int64_t G, int64_t b0, float acc[][32], const int NB,
                                                            const int NV) {
    v8 a[2][4] = {{{0}}};
    const float *x0 = x + b0 * K + k0, *x1 = x0 + K;
    for (int64_t kk = 0; kk < G; ++kk) {
        const float *w = wb + kk * 32;
        const float xa = x0[kk], xb = NB > 1 ? x1[kk] : 0.0f;
        for (int v = 0; v < NV; ++v) {
            const v8 wv = *(const v8u *)(w + 8 * v);
            a[0][v] += wv * xa;
            if (NB > 1) a[1][v] += wv * xb;
        }
    }
    for (int j = 0; j < NB; ++j)
        for (int v = 0; v < NV; ++v) *(v8u *)(acc[b0 + j] + 8 * v) = a[j][v];
}

/* a thread's widened group codes (int4_widen) */
static float *w4_scratch(int64_t n) {
    static _Thread_local float *buf = NULL;
    static _Thread_local int64_t cap = 0;
    return grow_scratch(&buf, &cap, n);
}

/* out[b][r] = 32-row block nb's row r (r < the returned 32 or 16 rows) of the dequantised W against input row b; -1
   when out of memory */
/* out[b][r] += scale * acc[b][r] + (zero - 8 scale) * sum_k x[b, k] for the rows row0 .. row0 + nr (nr a multiple of
   8) and group gi: one group's dequantisation applied to its dot products, once per row (acc rows acc_stride apart) */
static inline void int4_group_out(const Int4Mat *m, const Int4X *xs, int64_t gi, int64_t row0, int nr, const float *acc,
                                  int64_t acc_stride, float out[][64]) {
    const int64_t ng = m->K / m->G;
    for (int r = 0; r < nr; r += 8) {
        v8 s, z;
        load_sz8(m->sz, m->sdt, (gi * m->N + row0 + r) * 2, &s, &z);
        const v8 z8 = z - s * 8.0f; /* (q - 8) s + z = q s + (z - 8 s) */
        for (int64_t b = 0; b < xs->B; ++b) {
            v8 o = *(v8u *)(out[b] + r);
            o += s * *(const v8u *)(acc + b * acc_stride + r) + z8 * xs->xsum[b * ng + gi];
            *(v8u *)(out[b] + r) = o;
        }
    }
}

static int int4_block32(const Int4Mat *m, const Int4X *xs, int64_t nb, float out[][64]) {
    const int64_t K = m->K, G = m->G, ng = K / G, B = xs->B, row0 = nb * 32;
    const int nr = m->N - row0 >= 32 ? 32 : 16;
    const uint8_t *q = m->q + row0 * (K / 2);
    float acc[MAXB][32];
    float *wb = NULL;
    if (B > 1 || nr < 32) {
        wb = w4_scratch(G * 32);
        if (!wb) return -1;
    }
    for (int64_t b = 0; b < B; ++b)
        for (int r = 0; r < 32; ++r) out[b][r] = 0.0f;
    for (int64_t gi = 0; gi < ng; ++gi) {
        const int64_t k0 = gi * G;
        if (!wb) { /* one input row: straight from the codes; two inputs a step, each into its own 4 accumulators
                      of 8 rows, so 8 chains of FMAs hide the FMA latency (G is even) */
            const float *x = xs->x + k0;
            const uint8_t *p = q + k0 * 16;
            v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, c0 = {0}, c1 = {0}, c2 = {0}, c3 = {0};
            for (int64_t kk = 0; kk < G; kk += 2) {
                v8 r0, r1, r2, r3;
                nib32(p + kk * 16, &r0, &r1, &r2, &r3);
                const float xv = x[kk];
                a0 += r0 * xv, a1 += r1 * xv, a2 += r2 * xv, a3 += r3 * xv;
                nib32(p + kk * 16 + 16, &r0, &r1, &r2, &r3);
                const float xw = x[kk + 1];
                c0 += r0 * xw, c1 += r1 * xw, c2 += r2 * xw, c3 += r3 * xw;
            }
            *(v8u *)acc[0] = a0 + c0, *(v8u *)(acc[0] + 8) = a1 + c1, *(v8u *)(acc[0] + 16) = a2 + c2;
            *(v8u *)(acc[0] + 24) = a3 + c3;
        } else {
            int4_widen(q, nr, k0, G, wb);
            int64_t b = 0;
            if (nr == 32) {
                for (; b + 2 <= B; b += 2) int4_dots(wb, xs->x, K, k0, G, b, acc, 2, 4);
                if (b < B) int4_dots(wb, xs->x, K, k0, G, b, acc, 1, 4);
            } else {
                for (; b + 2 <= B; b += 2) int4_dots(wb, xs->x, K, k0, G, b, acc, 2, 2);
                if (b < B) int4_dots(wb, xs->x, K, k0, G, b, acc, 1, 2);
            }
        }
        int4_group_out(m, xs, gi, row0, nr, acc[0], sizeof acc[0] / sizeof(float), out);
    }
    return nr;
}

/* The 64-row layout (aten's AVX512 packing): one k of a block is 32 contiguous bytes, byte i holding rows i (low
   nibble) and 32 + i (high). With AVX-512 the 32 bytes, each 16-byte half zero-extended to 16 lanes, give the four
   16-row vectors of the block's 64 codes; with AVX2 the two halves go through nib32 (rows 0-7, 8-15, 32-39, 40-47
   and 16-23, 24-31, 48-55, 56-63). */
#ifdef __AVX512F__

/* the codes of one k of a 64-row block as fp32: rows 0-15, 16-31, 32-47, 48-63 */
static inline void nib64(const uint8_t *p, v16 *r0, v16 *r1, v16 *r2, v16 *r3) {
    const __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 16)));
    const __m512i m = _mm512_set1_epi32(15);
    *r0 = (v16)_mm512_cvtepi32_ps(_mm512_and_si512(a, m));
    *r1 = (v16)_mm512_cvtepi32_ps(_mm512_and_si512(b, m));
    *r2 = (v16)_mm512_cvtepi32_ps(_mm512_srli_epi32(a, 4));
    *r3 = (v16)_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
}
#define W4V 16 /* lanes of the widened product's vectors */
typedef v16 w4v;
typedef v16u w4vu;
#else
#define W4V 8
typedef v8 w4v;
typedef v8u w4vu;
#endif

/* one 64-row block's group codes (G inputs from k0) widened to fp32 into wb [G][64] in row order; a tail of nr < 64
   rows (pairwise: nr / 2 bytes per k) fills lanes 0..nr-1 and zeros the rest */
static void int4_widen64(const uint8_t *q, int nr, int64_t k0, int64_t G, float *wb) {
    if (nr == 64) {
        for (int64_t kk = 0; kk < G; ++kk) {
            const uint8_t *p = q + (k0 + kk) * 32;
            float *d = wb + kk * 64;
#ifdef __AVX512F__
            v16 r0, r1, r2, r3;
            nib64(p, &r0, &r1, &r2, &r3);
            *(v16u *)d = r0, *(v16u *)(d + 16) = r1, *(v16u *)(d + 32) = r2, *(v16u *)(d + 48) = r3;
#else
            v8 r0, r1, r2, r3;
            nib32(p, &r0, &r1, &r2, &r3);
            *(v8u *)d = r0, *(v8u *)(d + 8) = r1, *(v8u *)(d + 32) = r2, *(v8u *)(d + 40) = r3;
            nib32(p + 16, &r0, &r1, &r2, &r3);
            *(v8u *)(d + 16) = r0, *(v8u *)(d + 24) = r1, *(v8u *)(d + 48) = r2, *(v8u *)(d + 56) = r3;
#endif
        }
        return;
    }
    const int half = nr / 2;
    for (int64_t kk = 0; kk < G; ++kk) {
        const uint8_t *p = q + (k0 + kk) * half;
        float *d = wb + kk * 64;
        for (int j = 0; j < half; ++j) d[2 * j] = (float)(p[j] & 15), d[2 * j + 1] = (float)(p[j] >> 4);
        for (int r = nr; r < 64; ++r) d[r] = 0.0f;
    }
}

/* acc[b][c0 .. c0 + 4 W4V) = the G widened weights wb (columns c0..) against input rows b0, b0 + 1 (NB of them) */
static inline __attribute__((always_inline)) void int4_dots64(const float *wb, const float *x, int64_t K, int64_t k0,
                                                              int64_t G, int64_t b0, float acc[][64], const int NB,
                                                              const int c0) {
    w4v a[2][4] = {{{0}}};
    const float *x0 = x + b0 * K + k0, *x1 = x0 + K;
    for (int64_t kk = 0; kk < G; ++kk) {
        const float *w = wb + kk * 64 + c0;
        const float xa = x0[kk], xb = NB > 1 ? x1[kk] : 0.0f;
        for (int v = 0; v < 4; ++v) {
            const w4v wv = *(const w4vu *)(w + W4V * v);
            a[0][v] += wv * xa;
            if (NB > 1) a[1][v] += wv * xb;
        }
    }
    for (int j = 0; j < NB; ++j)
        for (int v = 0; v < 4; ++v) *(w4vu *)(acc[b0 + j] + c0 + W4V * v) = a[j][v];
}

#if defined(__AVX512BF16__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
#define INT4_BF16_PAIRS 1
/* bf16 inputs against a whole 64-row block on vdpbf16ps (AVX512-BF16): the 64 bytes of k and k + 1 (contiguous in the
   layout) permuted by two vpermt2b (AVX512-VBMI) into 16-bit lanes that pair each row's byte at k with its byte at
   k + 1 (rows 0-15 and 16-31), each nibble looked up as the bf16 of 0..15 (vpermw reads the low 5 bits of a lane
   and the table repeats 0..15, so the low nibble needs no mask and the high one a shift); then one vdpbf16ps per 16
   rows adds both k's products into fp32 lanes. The codes and the bf16 inputs are exact in bf16, their products
   exact in fp32: fp32 sums as the widening loop's, but 9 operations turn 128 codes into vdpbf16ps operands (4 of
   them) where widening takes 10 for 64 codes (and 4 FMAs): 2048x2048 on one Zen 4 core 200 -> 133 us. */
static const uint16_t I4_PAIR_IDX[32] __attribute__((aligned(64))) = {
    /* lane j: byte (j & 1) * 32 + j / 2 of the 64 (row j / 2 at k or k + 1) low, byte 64 (a zero) high */
    0x4000, 0x4020, 0x4001, 0x4021, 0x4002, 0x4022, 0x4003, 0x4023, 0x4004, 0x4024, 0x4005, 0x4025, 0x4006, 0x4026,
    0x4007, 0x4027, 0x4008, 0x4028, 0x4009, 0x4029, 0x400a, 0x402a, 0x400b, 0x402b, 0x400c, 0x402c, 0x400d, 0x402d,
    0x400e, 0x402e, 0x400f, 0x402f};
static const uint16_t I4_BF16[32] __attribute__((aligned(64))) = {
    /* bf16(i & 15) */
    0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0, 0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150,
    0x4160, 0x4170, 0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0, 0x4100, 0x4110, 0x4120, 0x4130,
    0x4140, 0x4150, 0x4160, 0x4170};

/* the codes of k and k + 1 (the 64 bytes at p) as bf16 pairs: lane i of r0 holds row i, r1 row 16 + i, r2 row 32 + i,
   r3 row 48 + i */
static inline __attribute__((always_inline)) void pairs64(const uint8_t *p, __m512i ia, __m512i ib, __m512i tab,
                                                          __m512i *r0, __m512i *r1, __m512i *r2, __m512i *r3) {
    const __m512i d = _mm512_loadu_si512((const void *)p), z = _mm512_setzero_si512();
    const __m512i a = _mm512_permutex2var_epi8(d, ia, z), b = _mm512_permutex2var_epi8(d, ib, z);
    *r0 = _mm512_permutexvar_epi16(a, tab);
    *r1 = _mm512_permutexvar_epi16(b, tab);
    *r2 = _mm512_permutexvar_epi16(_mm512_srli_epi16(a, 4), tab);
    *r3 = _mm512_permutexvar_epi16(_mm512_srli_epi16(b, 4), tab);
}

#define DP(acc, w, x) ((acc) = _mm512_dpbf16_ps((acc), (__m512bh)(w), (x)))

/* acc[b0 + j][0..64) = the group's codes (from p, G inputs) against input rows b0 + j < b0 + NB (their bf16 pairs
   xp, row stride K2); one input row: two k-pairs a step into 8 accumulators (vdpbf16ps' latency) */
static inline __attribute__((always_inline)) void int4_dots64_bf16(const uint8_t *p, const uint32_t *xp, int64_t K2,
                                                                   int64_t G, float acc[][64], int64_t b0,
                                                                   const int NB) {
    const __m512i ia = _mm512_load_si512((const void *)I4_PAIR_IDX), tab = _mm512_load_si512((const void *)I4_BF16);
    const __m512i ib = _mm512_add_epi16(ia, _mm512_set1_epi16(16));
    __m512 a[4][4], c[4];
    for (int j = 0; j < 4; ++j) {
        c[j] = _mm512_setzero_ps();
        for (int v = 0; v < 4; ++v) a[j][v] = _mm512_setzero_ps();
    }
    int64_t kk = 0;
    if (NB == 1)
        for (; kk + 4 <= G; kk += 4) {
            __m512i r0, r1, r2, r3;
            pairs64(p + kk * 32, ia, ib, tab, &r0, &r1, &r2, &r3);
            const __m512bh x0 = (__m512bh)_mm512_set1_epi32((int)xp[kk / 2]);
            DP(a[0][0], r0, x0), DP(a[0][1], r1, x0), DP(a[0][2], r2, x0), DP(a[0][3], r3, x0);
            pairs64(p + kk * 32 + 64, ia, ib, tab, &r0, &r1, &r2, &r3);
            const __m512bh x1 = (__m512bh)_mm512_set1_epi32((int)xp[kk / 2 + 1]);
            DP(c[0], r0, x1), DP(c[1], r1, x1), DP(c[2], r2, x1), DP(c[3], r3, x1);
        }
    for (; kk < G; kk += 2) {
        __m512i r0, r1, r2, r3;
        pairs64(p + kk * 32, ia, ib, tab, &r0, &r1, &r2, &r3);
        for (int j = 0; j < NB; ++j) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xp[j * K2 + kk / 2]);
            DP(a[j][0], r0, xv), DP(a[j][1], r1, xv), DP(a[j][2], r2, xv), DP(a[j][3], r3, xv);
        }
    }
    if (NB == 1)
        for (int v = 0; v < 4; ++v) a[0][v] = _mm512_add_ps(a[0][v], c[v]);
    for (int j = 0; j < NB; ++j)
        for (int v = 0; v < 4; ++v) _mm512_storeu_ps(acc[b0 + j] + 16 * v, a[j][v]);
}
#undef DP
#endif

/* out[b][r] = 64-row block nb's row r (r < the returned 64, 48, 32 or 16 rows) of the dequantised W against input
   row b; -1 when out of memory */
static int int4_block64(const Int4Mat *m, const Int4X *xs, int64_t nb, float out[][64]) {
    const int64_t K = m->K, G = m->G, ng = K / G, B = xs->B, row0 = nb * 64;
    const int nr = m->N - row0 >= 64 ? 64 : (int)(m->N - row0);
    const uint8_t *q = m->q + row0 * (K / 2);
    float acc[MAXB][64];
    float *wb = NULL;
#ifdef INT4_BF16_PAIRS
    const int pairs = xs->xp != NULL && nr == 64; /* bf16 inputs, a whole block: int4_dots64_bf16 */
#else
    const int pairs = 0;
#endif
    if ((B > 1 || nr < 64) && !pairs) {
        wb = w4_scratch(G * 64);
        if (!wb) return -1;
    }
    for (int64_t b = 0; b < B; ++b)
        for (int r = 0; r < 64; ++r) out[b][r] = 0.0f;
    for (int64_t gi = 0; gi < ng; ++gi) {
        const int64_t k0 = gi * G;
        if (pairs) {
#ifdef INT4_BF16_PAIRS
            /* up to 4 input rows at a time, the codes converted once for them */
            const uint8_t *p = q + k0 * 32;
            const uint32_t *xp = xs->xp + k0 / 2;
            const int64_t K2 = K / 2;
            int64_t b = 0;
            for (; b + 4 <= B; b += 4) int4_dots64_bf16(p, xp + b * K2, K2, G, acc, b, 4);
            if (B - b == 3) int4_dots64_bf16(p, xp + b * K2, K2, G, acc, b, 3);
            else if (B - b == 2) int4_dots64_bf16(p, xp + b * K2, K2, G, acc, b, 2);
            else if (B - b == 1) int4_dots64_bf16(p, xp + b * K2, K2, G, acc, b, 1);
#endif
        } else if (!wb) { /* one input row, a whole block: straight from the codes */
            const float *x = xs->x + k0;
            const uint8_t *p = q + k0 * 32;
#ifdef __AVX512F__
            /* two inputs a step, each into its own 4 accumulators of 16 rows: 8 chains of FMAs (G is even) */
            v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, c0 = {0}, c1 = {0}, c2 = {0}, c3 = {0};
            for (int64_t kk = 0; kk < G; kk += 2) {
                v16 r0, r1, r2, r3;
                nib64(p + kk * 32, &r0, &r1, &r2, &r3);
                const float xv = x[kk];
                a0 += r0 * xv, a1 += r1 * xv, a2 += r2 * xv, a3 += r3 * xv;
                nib64(p + kk * 32 + 32, &r0, &r1, &r2, &r3);
                const float xw = x[kk + 1];
                c0 += r0 * xw, c1 += r1 * xw, c2 += r2 * xw, c3 += r3 * xw;
            }
            *(v16u *)acc[0] = a0 + c0, *(v16u *)(acc[0] + 16) = a1 + c1, *(v16u *)(acc[0] + 32) = a2 + c2;
            *(v16u *)(acc[0] + 48) = a3 + c3;
#else
            /* one input a step into 8 accumulators of 8 rows: 8 chains of FMAs */
            v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};
            for (int64_t kk = 0; kk < G; ++kk) {
                v8 r0, r1, r2, r3;
                const float xv = x[kk];
                nib32(p + kk * 32, &r0, &r1, &r2, &r3); /* rows 0-7, 8-15, 32-39, 40-47 */
                a0 += r0 * xv, a1 += r1 * xv, a4 += r2 * xv, a5 += r3 * xv;
                nib32(p + kk * 32 + 16, &r0, &r1, &r2, &r3); /* rows 16-23, 24-31, 48-55, 56-63 */
                a2 += r0 * xv, a3 += r1 * xv, a6 += r2 * xv, a7 += r3 * xv;
            }
            float *o = acc[0];
            *(v8u *)o = a0, *(v8u *)(o + 8) = a1, *(v8u *)(o + 16) = a2, *(v8u *)(o + 24) = a3;
            *(v8u *)(o + 32) = a4, *(v8u *)(o + 40) = a5, *(v8u *)(o + 48) = a6, *(v8u *)(o + 56) = a7;
#endif
        } else {
            int4_widen64(q, nr, k0, G, wb);
            for (int c = 0; c < 64; c += 4 * W4V) {
                int64_t b = 0;
                for (; b + 2 <= B; b += 2) int4_dots64(wb, xs->x, K, k0, G, b, acc, 2, c);
                if (b < B) int4_dots64(wb, xs->x, K, k0, G, b, acc, 1, c);
            }
        }
        int4_group_out(m, xs, gi, row0, nr, acc[0], sizeof acc[0] / sizeof(float), out);
    }
    return nr;
}

/* out[b][r] = block nb's row r (r < the returned count) of the dequantised W against input row b, block nb of
   m->bn rows (the rows from nb * m->bn); -1 when out of memory */
int int4_block(const Int4Mat *m, const Int4X *xs, int64_t nb, float out[][64]) {
    return m->bn == 64 ? int4_block64(m, xs, nb, out) : int4_block32(m, xs, nb, out);
}

/* x [B, K] (fp32 or bf16) as fp32, then each group's sum, in this thread's scratch */
float *int4_load_x(const void *x, int xdt, int64_t B, int64_t K, int64_t G, Int4X *xs) {
    static _Thread_local float *buf = NULL;
    static _Thread_local int64_t cap = 0;
    const int64_t ng = K / G;
    float *xf = grow_scratch(&buf, &cap, B * K + B * ng + B * K / 2);
    if (!xf) return NULL;
    xs->xp = NULL;
#ifdef INT4_BF16_PAIRS
    if (xdt == DT_BF16) { /* the bf16 input as it is, two k a lane (K is even: a multiple of the even group) */
        uint32_t *xp = (uint32_t *)(xf + B * K + B * ng);
        memcpy(xp, x, (size_t)(B * K) * 2);
        xs->xp = xp;
    }
#endif
    for (int64_t i = 0; i < B * K; ++i) xf[i] = load_as_f32(x, xdt, i);
    float *sums = xf + B * K;
    for (int64_t b = 0; b < B; ++b)
        for (int64_t gi = 0; gi < ng; ++gi) {
            float s = 0.0f;
            for (int64_t k = 0; k < G; ++k) s += xf[b * K + gi * G + k];
            sums[b * ng + gi] = s;
        }
    xs->x = xf, xs->xsum = sums, xs->B = B;
    return xf;
}

int int4_shape_ok(int64_t B, int64_t N, int64_t K, int64_t G, int bn) {
    return B >= 1 && B <= MAXB && N >= 16 && N % 16 == 0 && G >= 2 && G % 2 == 0 && G <= 1024 && K >= G && K % G == 0
           && (bn == 32 || bn == 64);
}

/* blocks of bn rows a chunk of the pool takes (chunk_rows' ~1/64 of the matrix, at least 32 KB) */
int64_t int4_chunk_blocks(int64_t N, int64_t K, int bn) {
    const int64_t b = chunk_rows(N, K / 2) / bn;
    return b < 1 ? 1 : b;
}

typedef struct {
    Int4Mat m;
    Int4X xs;
    const void *bias, *res;
    void *y;
    int64_t blocks; /* per chunk */
    int bdt, ydt, act1;
} Int4Gemv;

static void int4_gemv_chunk(const void *job, int64_t chunk) {
    const Int4Gemv *g = job;
    const int bn = g->m.bn;
    const int64_t nblocks = (g->m.N + bn - 1) / bn, B = g->xs.B, N = g->m.N;
    const int64_t lo = chunk * g->blocks, hi = lo + g->blocks < nblocks ? lo + g->blocks : nblocks;
    float out[MAXB][64];
    for (int64_t nb = lo; nb < hi; ++nb) {
        const int nr = int4_block(&g->m, &g->xs, nb, out);
        if (nr < 0) continue; /* (out of memory for 2 KB-16 KB of scratch: the rows stay unwritten) */
        for (int r = 0; r < nr; ++r) {
            const int64_t n = nb * bn + r;
            const float bias = g->bias ? load_as_f32(g->bias, g->bdt, n) : 0.0f;
            for (int64_t b = 0; b < B; ++b) store_out(g->y, g->ydt, g->res, g->act1, b * N + n, out[b][r] + bias);
        }
    }
}

/* y[B, N] = act(x[B, K] W^T + bias[N]) + res[B, N] for int4 W (q, sz: see above; sdt its scale dtype; bn the
   layout's rows per block, 32 or 64) */
int gemv_int4_act(const uint8_t *q, const void *sz, int sdt, int64_t G, const void *bias, int bdt,
                         const void *x, int xdt, const void *res, void *y, int ydt, int64_t B, int64_t N, int64_t K,
                         int act1, int bn) {
    if (!int4_shape_ok(B, N, K, G, bn) || (sdt != DT_F32 && sdt != DT_BF16)) return -1;
    Int4Gemv g = {{q, sz, N, K, G, sdt, bn}, {0}, bias, res, y, int4_chunk_blocks(N, K, bn), bdt, ydt, act1};
    if (!int4_load_x(x, xdt, B, K, G, &g.xs)) return -1;
    const int64_t nblocks = (N + bn - 1) / bn;
    pool_run(int4_gemv_chunk, &g, (nblocks + g.blocks - 1) / g.blocks);
    return 0;
}

/* y[B, N] = x[B, K] W^T + bias[N] + res[B, N] for torchao's int4 weight-only W in bn-row blocks (32: AVX2's layout,
   64: AVX512's). Returns 0, or -1 for arguments it cannot take (N not a multiple of 16, K not of the group, more
   than 64 rows, a scale dtype other than fp32/bf16, another block size). */
int hl_gemv_int4(const uint8_t *q, const void *sz, int sdt, int64_t G, const void *bias, int bdt, const void *x,
                 int xdt, const void *res, void *y, int ydt, int64_t B, int64_t N, int64_t K, int bn) {
    return gemv_int4_act(q, sz, sdt, G, bias, bdt, x, xdt, res, y, ydt, B, N, K, 0, bn);
}

