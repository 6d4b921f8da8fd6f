/* ---- int8-activation products: torchao's int8dq and 8da4w (hybrid.quantize) --------------------------------------
   Each input row is quantised to int8 once per product (into the caller's scratch), as torchao quantises it, and
   the weights meet it in integer dot products (llama.cpp's Q8_0 / Q4_0 arithmetic: _mm256_maddubs_epi16 +
   _mm256_madd_epi16, 32 weights in ~6 instructions where widening every code to fp32 took ~4x as many).

   int8dq (torchao's Int8Tensor with dynamic activations): weights int8 [N, K] with a fp32 scale per row (codes
   -128..127); each input row symmetric per row: s = max|x| / 127.5 (in x's dtype), q = clamp(rint(x * (1/s)),
   -128, 127). y = bf16?((float)(q . w) * s) * ws[n] + bias, torchao's int_scaled_matmul then its row-scale
   multiply: exact, the dot is an integer. The dot uses the sign trick maddubs(|w|, sign(q, w)): |w| <= 128 as an
   unsigned byte is exact, and with |q| <= 127 a pair sums to at most 2 * 128 * 127 = 32512 (no int16
   saturation). q = -128 happens (x = -max|x| gives -127.5, rounded to even: -128) and would overflow the sign
   flip: such codes go in as -127 and the row's dot subtracts their weights (q . w = q' . w - sum w[k], k over
   those positions: one or a few per row).

   8da4w (torchao's IntxUnpackedToInt8Tensor, int4 weights in symmetric groups of 32, int8 asymmetric per-token
   activations): the values -8..7 repacked once (hybrid.quantize.pack_8da4w) into nibbles, group g of row n at
   bytes (n * K/32 + g) * 16: byte j holds k = j (low nibble) and k = j + 16 (high), each stored + 8; fp32
   scales [N, K/32] per group followed by C [N], C[n] = sum_g ws_g * sum_k w_k (one buffer: one pointer). Each input row: s = (max(x, 0) - min(x, 0)) / 255,
   zp = -128 - rint(min(x, 0) / s) and q = clamp(rint(x * (1/s)) + zp, -128, 127), every op rounded to x's dtype
   as torch's are; u = q + 128 (0..255, unsigned) meets the signed int4 values in maddubs (pairs at most
   2 * 255 * 8 = 4080) and x . W = s * (sum_g ws_g * (u . w)_g - (128 + zp) * C[n]): the group products are
   integers, their scaled sum fp32 (torchao's F.linear on the dequantised tensors sums the same terms in
   another order). */
#include "native.h"
#include "products.h"


enum { QK_I8DQ = 0, QK_8DA4W = 1 };

/* the value v as computed: -ffast-math may otherwise reassociate a*b*c or contract a*b + c into an FMA, and the
   int8dq epilogue and the activations' quantisation must round where torch rounds */
static inline float exact(float v) {
#if defined(__x86_64__) || defined(__i386__)
    __asm__("" : "+x"(v));
#elif defined(__aarch64__)
    __asm__("" : "+w"(v));
#else
    volatile float t = v;
    v = t;
#endif
    return v;
}

typedef struct {
    int kind;
    const int8_t *w;    /* int8dq: codes [N, K] */
    const uint8_t *w4;  /* 8da4w: nibbles [N, K/2] (layout above) */
    const float *ws;    /* int8dq: row scales [N]; 8da4w: group scales [N, K/32] */
    const float *wsum;  /* 8da4w: C [N] (ws + N K/32) */
    int64_t N, K;
} QMat;

typedef struct {
    const int8_t *q;     /* int8dq: codes [B, K], -128 entered as -127; 8da4w: u = codes + 128 [B, K] */
    const float *s;      /* [B] */
    const int32_t *zp;   /* [B] (8da4w) */
    const int32_t *fix;  /* [B, K]: int8dq's positions of -128 codes, nfix[b] of them per row */
    const int64_t *nfix;
    const uint8_t *up;   /* 8da4w on AVX512-VNNI: u in blocks of four groups (w4_block_input), K/128 blocks a row */
    const int32_t *c8;   /* and each block's 16 lane corrections, [B, K/128, 16] */
    const int32_t *qsum; /* int8dq: [B] each row's sum of its entered codes (i8dq_dot's flipped-weight form) */
    int64_t B, K;
} QAct;

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define W4_VNNI 1
/* 8da4w with vpdpbusd takes four groups (128 k, 64 bytes of nibbles) a step. A 64-byte load of the nibbles
   masked (& 15) gives the four groups' first 16 values in k order, shifted (>> 4 & 15) their last 16, so the
   input is laid out to match: per block the four groups' codes k 0..15 (64 bytes), then their codes k 16..31.
   Lane l of a dpbusd then sums group l/4's products, and the nibbles' +8 comes off exactly by starting each lane
   at -8 times the sum of the codes it meets (c8): (u . n) - 8 sum u = u . (n - 8), no subtraction per weight. */
static void w4_block_input(const uint8_t *u, int64_t K, uint8_t *up, int32_t *c8) {
    /* a last block of fewer than four groups (K % 128: 1..3 groups) is padded with zero codes and zero lane
       corrections, its nibbles and scales loaded masked (w4_dots_vnni): its empty lanes sum to 0 */
    for (int64_t blk = 0; blk < (K + 127) / 128; ++blk) {
        const uint8_t *s = u + blk * 128;
        uint8_t *d = up + blk * 128;
        const int64_t ng = (K - blk * 128) / 32 < 4 ? (K - blk * 128) / 32 : 4;
        for (int j = 0; j < 4; ++j) {
            if (j < ng) {
                memcpy(d + j * 16, s + j * 32, 16);
                memcpy(d + 64 + j * 16, s + j * 32 + 16, 16);
            } else {
                memset(d + j * 16, 0, 16);
                memset(d + 64 + j * 16, 0, 16);
            }
        }
        for (int l = 0; l < 16; ++l) {
            int32_t t = 0;
            for (int i = 0; i < 4; ++i) t += d[l * 4 + i] + d[64 + l * 4 + i];
            c8[blk * 16 + l] = -8 * t;
        }
    }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define Q_VEC 1
/* 16 inputs from x (fp32 or bf16) as fp32, lanes past n (< 16) zero */
static inline __m512 q_load16(const void *x, int xdt, int64_t k, int64_t n) {
    const __mmask16 m = n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
    if (xdt == DT_BF16)
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, (const uint16_t *)x + k)), 16));
    return _mm512_maskz_loadu_ps(m, (const float *)x + k);
}

/* int8dq's per-row quantisation (q_load_x's scalar loop, vectorised): max|x| (a NaN ignored, as the scalar
   comparison does), then q = clamp(rint(x * inv), -128, 127) with rint = round to nearest even as rintf in the
   default rounding mode; products are single fp32 multiplies (no FMA to contract), so the codes equal the
   scalar loop's bit for bit. Returns max|x|; codes, -128 positions (entered as -127) and their sum as the
   scalar loop leaves them. */
static float i8dq_amax(const void *x, int xdt, int64_t K) {
    __m512 a = _mm512_setzero_ps();
    const __m512 abs = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    for (int64_t k = 0; k < K; k += 16)
        a = _mm512_max_ps(_mm512_and_ps(q_load16(x, xdt, k, K - k), abs), a); /* NaN lanes keep a */
    return _mm512_reduce_max_ps(a);
}

static void i8dq_codes(const void *x, int xdt, int64_t K, float inv, int8_t *q, int32_t *fix, int64_t *nfix,
                       int32_t *qsum) {
    const __m512 vi = _mm512_set1_ps(inv), lo = _mm512_set1_ps(-128.0f), hi = _mm512_set1_ps(127.0f),
                 lo1 = _mm512_set1_ps(-127.0f);
    __m512i sum = _mm512_setzero_si512();
    int64_t nf = 0;
    for (int64_t k = 0; k < K; k += 16) {
        const int64_t n = K - k;
        __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(q_load16(x, xdt, k, n), vi),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        r = _mm512_min_ps(_mm512_max_ps(r, lo), hi);
        __mmask16 m128 = _mm512_cmp_ps_mask(r, lo, _CMP_EQ_OQ);
        if (m128) { /* rare: x at -max|x| */
            while (m128) {
                fix[nf++] = (int32_t)(k + __builtin_ctz(m128));
                m128 &= m128 - 1;
            }
            r = _mm512_max_ps(r, lo1);
        }
        const __m512i c = _mm512_cvtps_epi32(r);
        sum = _mm512_add_epi32(sum, c);
        _mm512_mask_cvtepi32_storeu_epi8(q + k, n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1), c);
    }
    *nfix = nf, *qsum = _mm512_reduce_add_epi32(sum);
}

/* 8da4w's per-row quantisation for fp32 inputs (bf16 rounds each step to bf16: the scalar loop): min(x, 0) and
   max(x, 0), then u = clamp(rint(x * inv) + z, -128, 127) + 128, each step as the scalar loop rounds it */
static void w4_minmax(const float *x, int64_t K, float *mn, float *mx) {
    __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        const __m512 v = q_load16(x, DT_F32, k, K - k); /* zeroed lanes: min/max already include 0 */
        a = _mm512_min_ps(v, a), b = _mm512_max_ps(v, b);
    }
    *mn = _mm512_reduce_min_ps(a), *mx = _mm512_reduce_max_ps(b);
}

static void w4_codes(const float *x, int64_t K, float inv, float z, uint8_t *u) {
    const __m512 vi = _mm512_set1_ps(inv), vz = _mm512_set1_ps(z), lo = _mm512_set1_ps(-128.0f),
                 hi = _mm512_set1_ps(127.0f);
    const __m512i off = _mm512_set1_epi32(128);
    for (int64_t k = 0; k < K; k += 16) {
        const int64_t n = K - k;
        __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(q_load16(x, DT_F32, k, n), vi),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        r = _mm512_min_ps(_mm512_max_ps(_mm512_add_ps(r, vz), lo), hi);
        _mm512_mask_cvtepi32_storeu_epi8(u + k, n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1),
                                         _mm512_add_epi32(_mm512_cvtps_epi32(r), off));
    }
}
#endif

/* the scratch an op's quantised rows live in (the calling thread's; its workers read it) */
static int q_load_x(const void *x, int xdt, int64_t B, int64_t K, int kind, QAct *a) {
    static _Thread_local float *buf = NULL;
    static _Thread_local int64_t cap = 0;
    const int64_t qbytes = (B * K + 63) & ~(int64_t)63;
    /* fix's region: B K int32 for int8dq's -128 positions, or (8da4w with VNNI) the blocked codes padded to whole
       blocks, B (K + 96) bytes, then their corrections, B (K + 96) / 2 bytes: B (K + 64) int32 hold either */
    float *base = grow_scratch(&buf, &cap, qbytes / 4 + B * (K + 64) + 5 * B + 16);
    if (!base) return 0;
    int8_t *q = (int8_t *)base;
    int32_t *fix = (int32_t *)(base + qbytes / 4);
    float *s = (float *)(fix + B * (K + 64));
    int32_t *zp = (int32_t *)(s + B);
    int64_t *nfix = (int64_t *)(((uintptr_t)(zp + B) + 7) & ~(uintptr_t)7);
    int32_t *qsum = (int32_t *)(nfix + B);
    for (int64_t b = 0; b < B; ++b) {
        const int64_t off = b * K;
        int8_t *qb = q + off;
        const void *xr = xdt == DT_BF16 ? (const void *)((const uint16_t *)x + off) : (const void *)((const float *)x + off);
        (void)xr;
        if (kind == QK_I8DQ) { /* torchao: choose_qparams_affine(SYMMETRIC, eps = fp32 eps) + quantize_affine */
#ifdef Q_VEC
            const float amax = i8dq_amax(xr, xdt, K);
#else
            float amax = 0.0f;
            for (int64_t k = 0; k < K; ++k) {
                const float v = fabsf(load_as_f32(x, xdt, off + k));
                amax = v > amax ? v : amax;
            }
#endif
            float sc = round_to(exact(amax / exact(127.5f)), xdt); /* computed in x's dtype, kept as fp32 */
            if (sc < FLT_EPSILON) sc = round_to(FLT_EPSILON, xdt);
            const float inv = exact(1.0f / sc);
            int64_t nf = 0;
            int32_t sum = 0;
#ifdef Q_VEC
            i8dq_codes(xr, xdt, K, inv, qb, fix + off, &nf, &sum);
#else
            for (int64_t k = 0; k < K; ++k) {
                float r = rintf(exact(load_as_f32(x, xdt, off + k) * inv));
                r = r < -128.0f ? -128.0f : r > 127.0f ? 127.0f : r;
                if (r == -128.0f) fix[off + nf++] = (int32_t)k, r = -127.0f;
                qb[k] = (int8_t)r;
                sum += (int32_t)r;
            }
#endif
            s[b] = sc, zp[b] = 0, nfix[b] = nf, qsum[b] = sum;
        } else { /* torchao: choose_qparams_affine(ASYMMETRIC, scale in x's dtype, eps = its smallest normal) */
            float mn = 0.0f, mx = 0.0f;
#ifdef Q_VEC
            if (xdt == DT_F32) w4_minmax(xr, K, &mn, &mx);
            else
#endif
            for (int64_t k = 0; k < K; ++k) {
                const float v = load_as_f32(x, xdt, off + k);
                mn = v < mn ? v : mn;
                mx = v > mx ? v : mx;
            }
            float sc = round_to(exact(round_to(exact(mx - mn), xdt) / exact(255.0f)), xdt);
            if (sc < FLT_MIN) sc = FLT_MIN;
            float z = -128.0f - rintf(round_to(exact(mn / sc), xdt));
            z = z < -128.0f ? -128.0f : z > 127.0f ? 127.0f : z;
            const float inv = round_to(exact(1.0f / sc), xdt);
#ifdef Q_VEC
            if (xdt == DT_F32) w4_codes(xr, K, inv, z, (uint8_t *)qb);
            else
#endif
            for (int64_t k = 0; k < K; ++k) {
                float r = rintf(round_to(exact(load_as_f32(x, xdt, off + k) * inv), xdt)) + z;
                r = r < -128.0f ? -128.0f : r > 127.0f ? 127.0f : r;
                ((uint8_t *)qb)[k] = (uint8_t)((int)r + 128);
            }
            s[b] = sc, zp[b] = (int32_t)z, nfix[b] = 0, qsum[b] = 0;
        }
    }
    a->q = q, a->s = s, a->zp = zp, a->fix = fix, a->nfix = nfix, a->qsum = qsum, a->B = B, a->K = K;
    a->up = NULL, a->c8 = NULL;
#ifdef W4_VNNI
    if (kind != QK_I8DQ) { /* fix's region is free here: the blocked codes (B Kp bytes), then c8 (B Kp / 2 bytes) */
        const int64_t Kp = (K + 127) / 128 * 128;
        uint8_t *up = (uint8_t *)fix;
        int32_t *c8 = (int32_t *)(up + B * Kp);
        for (int64_t b = 0; b < B; ++b)
            w4_block_input((const uint8_t *)q + b * K, K, up + b * Kp, c8 + b * (Kp / 128) * 16);
        a->up = up, a->c8 = c8;
    }
#endif
    return 1;
}

#ifdef __AVX2__
static inline int32_t hsum_i32(__m256i v) {
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
    return _mm_cvtsi128_si32(t);
}

/* a 8da4w group's 32 nibbles as signed bytes -8..7, k order */
static inline __m256i nib_group(const uint8_t *p) {
    const __m128i t = _mm_loadu_si128((const __m128i *)p);
    const __m256i v = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(15));
    return _mm256_sub_epi8(v, _mm256_set1_epi8(8));
}
#endif

/* int8dq: the integer dot of weight row w with the codes q (-128 entered as -127; qsum: their sum over K) */
static inline int32_t i8dq_dot(const int8_t *w, const int8_t *q, int64_t K, int32_t qsum) {
    int64_t k = 0;
    int32_t dot = 0;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    /* vpdpbusd multiplies unsigned bytes by signed ones, 64 pairs an instruction: the weights flipped to unsigned
       (w ^ 0x80 = w + 128) meet the signed codes, w . q = (w + 128) . q - 128 sum q, sum q once per input row
       (q_load_x). One vpdpbusd and one xor per 64 weights; the K % 64 tail by masked loads (a zeroed w lane flips
       to 128, against a zeroed code: 0). Exact integers, the AVX2 path's result. */
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512i acc = _mm512_setzero_si512();
    for (; k + 64 <= K; k += 64) {
        STREAM_PREFETCH((const char *)(w + k), 1);
        acc = _mm512_dpbusd_epi32(acc, _mm512_xor_si512(_mm512_loadu_si512((const void *)(w + k)), flip),
                                  _mm512_loadu_si512((const void *)(q + k)));
    }
    if (k < K) {
        const __mmask64 m = ~0ULL >> (64 - (K - k));
        acc = _mm512_dpbusd_epi32(acc, _mm512_xor_si512(_mm512_maskz_loadu_epi8(m, w + k), flip),
                                  _mm512_maskz_loadu_epi8(m, q + k));
    }
    return _mm512_reduce_add_epi32(acc) - 128 * qsum;
#elif defined(__AVX2__)
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();
    for (; k + 64 <= K; k += 64) {
        /* the codes prefetched ahead, as the float products' weights */
        STREAM_PREFETCH((const char *)(w + k), 1);
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)(w + k)),
                      w1 = _mm256_loadu_si256((const __m256i *)(w + k + 32));
        const __m256i q0 = _mm256_loadu_si256((const __m256i *)(q + k)),
                      q1 = _mm256_loadu_si256((const __m256i *)(q + k + 32));
        a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w0),
                                                                        _mm256_sign_epi8(q0, w0)), ones));
        a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w1),
                                                                        _mm256_sign_epi8(q1, w1)), ones));
    }
    for (; k + 32 <= K; k += 32) {
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)(w + k)),
                      q0 = _mm256_loadu_si256((const __m256i *)(q + k));
        a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w0),
                                                                        _mm256_sign_epi8(q0, w0)), ones));
    }
    dot = hsum_i32(_mm256_add_epi32(a0, a1));
#endif
    (void)qsum;
    for (; k < K; ++k) dot += (int32_t)w[k] * q[k];
    return dot;
}

/* 8da4w: sum_g ws_g * (u . w)_g of one row against one input row u (codes + 128) */
static inline float w4_dot(const uint8_t *p, const float *ws, const uint8_t *u, int64_t ng) {
#ifdef __AVX2__
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 2 <= ng; g += 2) { /* two groups a step: two FMA chains */
        STREAM_PREFETCH((const char *)(p + g * 16), 1);
        const __m256i d0 = _mm256_madd_epi16(
            _mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i *)(u + g * 32)), nib_group(p + g * 16)), ones);
        const __m256i d1 = _mm256_madd_epi16(
            _mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i *)(u + g * 32 + 32)), nib_group(p + g * 16 + 16)),
            ones);
        a0 = _mm256_fmadd_ps(_mm256_set1_ps(ws[g]), _mm256_cvtepi32_ps(d0), a0);
        a1 = _mm256_fmadd_ps(_mm256_set1_ps(ws[g + 1]), _mm256_cvtepi32_ps(d1), a1);
    }
    for (; g < ng; ++g) {
        const __m256i d0 = _mm256_madd_epi16(
            _mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i *)(u + g * 32)), nib_group(p + g * 16)), ones);
        a0 = _mm256_fmadd_ps(_mm256_set1_ps(ws[g]), _mm256_cvtepi32_ps(d0), a0);
    }
    return hsum((v8)_mm256_add_ps(a0, a1));
#else
    float acc = 0.0f;
    for (int64_t g = 0; g < ng; ++g) {
        int32_t d = 0;
        for (int j = 0; j < 16; ++j) {
            const int8_t lo = (int8_t)((p[g * 16 + j] & 15) - 8), hi = (int8_t)((p[g * 16 + j] >> 4) - 8);
            d += lo * (int32_t)u[g * 32 + j] + hi * (int32_t)u[g * 32 + 16 + j];
        }
        acc += ws[g] * (float)d;
    }
    return acc;
#endif
}

#ifdef W4_VNNI
/* nr (1..4) 8da4w rows at p (row stride K/2 bytes; scales ws, stride ng) against input row b of a: the group-
   scaled dots sum_g ws_g (u . w)_g into d[r]; blocks of four groups by vpdpbusd (see w4_block_input), a last
   partial block (K % 128: 1..3 groups) too, its nibbles and scales loaded masked */
static inline __attribute__((always_inline)) void w4_dots_vnni(const uint8_t *p, const float *ws, const QAct *a,
                                                               int64_t b, const int nr, float d[4]) {
    const int64_t K = a->K, ng = K / 32, nblk = K / 128, Kp = (K + 127) / 128 * 128;
    const uint8_t *up = a->up + b * Kp;
    const int32_t *c8 = a->c8 + b * (Kp / 128) * 16;
    const __m512i m15 = _mm512_set1_epi8(15);
    const __m512i idx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    __m512 acc[4];
    for (int r = 0; r < nr; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t blk = 0; blk < nblk; ++blk) {
        const __m512i lo_u = _mm512_loadu_si512((const void *)(up + blk * 128)),
                      hi_u = _mm512_loadu_si512((const void *)(up + blk * 128 + 64)),
                      c = _mm512_loadu_si512((const void *)(c8 + blk * 16));
        for (int r = 0; r < nr; ++r) {
            const uint8_t *pr = p + r * (K / 2) + blk * 64;
            STREAM_PREFETCH(pr, 1);
            const __m512i t = _mm512_loadu_si512((const void *)pr);
            const __m512i lo = _mm512_and_si512(t, m15), hi = _mm512_and_si512(_mm512_srli_epi16(t, 4), m15);
            const __m512i dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(c, lo_u, lo), hi_u, hi);
            const __m512 sc = _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_loadu_ps(ws + r * ng + blk * 4)));
            acc[r] = _mm512_fmadd_ps(sc, _mm512_cvtepi32_ps(dot), acc[r]);
        }
    }
    const int64_t rest = ng - nblk * 4; /* groups in a last partial block: its nibbles and scales masked */
    if (rest) {
        const __mmask64 mb = ~0ULL >> (64 - 16 * rest);
        const __mmask8 ms = (__mmask8)((1u << rest) - 1);
        const __m512i lo_u = _mm512_loadu_si512((const void *)(up + nblk * 128)),
                      hi_u = _mm512_loadu_si512((const void *)(up + nblk * 128 + 64)),
                      c = _mm512_loadu_si512((const void *)(c8 + nblk * 16));
        for (int r = 0; r < nr; ++r) {
            const __m512i t = _mm512_maskz_loadu_epi8(mb, p + r * (K / 2) + nblk * 64);
            const __m512i lo = _mm512_and_si512(t, m15), hi = _mm512_and_si512(_mm512_srli_epi16(t, 4), m15);
            const __m512i dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(c, lo_u, lo), hi_u, hi);
            const __m512 sc = _mm512_permutexvar_ps(
                idx, _mm512_castps128_ps512(_mm_maskz_loadu_ps(ms, ws + r * ng + nblk * 4)));
            acc[r] = _mm512_fmadd_ps(sc, _mm512_cvtepi32_ps(dot), acc[r]);
        }
    }
    for (int r = 0; r < nr; ++r) d[r] = _mm512_reduce_add_ps(acc[r]);
}
#endif

/* 8da4w row n's output for input row b from its group-scaled dot d */
static inline float w4_out(const QMat *m, const QAct *a, int64_t n, int64_t b, float d) {
    return exact(a->s[b] * exact(d - (float)(128 + a->zp[b]) * m->wsum[n]));
}

/* out[b] = row n of W against input row b before the bias: int8dq torchao's bf16?(dot * s_b) * ws[n] (ydt: the
   output's dtype, where torchao rounds the first product), 8da4w s_b * (sum_g ... - (128 + zp_b) C[n]) */
/* int8dq row n's output for input row b from its integer dot over the entered codes: the -128 codes' weights taken
   off (they went in as -127), then torchao's scaling */
static inline float i8dq_out(const QMat *m, const QAct *a, int64_t n, int64_t b, int32_t dot, int ydt) {
    const int8_t *w = m->w + n * m->K;
    const int32_t *fx = a->fix + b * m->K;
    for (int64_t i = 0; i < a->nfix[b]; ++i) dot -= w[fx[i]];
    return exact(round_to(exact((float)dot * a->s[b]), ydt) * m->ws[n]);
}

static void q_row(const QMat *m, const QAct *a, int64_t n, int ydt, float *out) {
    const int64_t K = m->K;
    if (m->kind == QK_I8DQ) {
        for (int64_t b = 0; b < a->B; ++b) out[b] = i8dq_out(m, a, n, b, i8dq_dot(m->w + n * K, a->q + b * K, K, a->qsum[b]), ydt);
        return;
    }
    const int64_t ng = K / 32;
    for (int64_t b = 0; b < a->B; ++b) { /* (a batch re-reads the row's 16 KB or less from L1) */
#ifdef W4_VNNI
        float d[4];
        w4_dots_vnni(m->w4 + n * (K / 2), m->ws + n * ng, a, b, 1, d);
        out[b] = w4_out(m, a, n, b, d[0]);
#else
        out[b] = w4_out(m, a, n, b, w4_dot(m->w4 + n * (K / 2), m->ws + n * ng, (const uint8_t *)a->q + b * K, ng));
#endif
    }
}

/* Rows n..n+nr-1 (nr <= 4) of W against the input rows: out[r][b]. Four int8dq rows against one input row take one
   pass (the input's codes loaded and flipped once for the four, i8dq_dot's exact integer arithmetic); otherwise
   q_row each. */
static void q_rows(const QMat *m, const QAct *a, int64_t n, int64_t nr, int ydt, float out[4][MAXB]) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    if (m->kind == QK_I8DQ && a->B == 1 && nr == 4) { /* i8dq_dot's flipped weights, four rows a pass */
        const int64_t K = m->K;
        const int8_t *w = m->w + n * K, *q = a->q;
        const __m512i flip = _mm512_set1_epi8((char)0x80);
        __m512i acc[4];
        for (int r = 0; r < 4; ++r) acc[r] = _mm512_setzero_si512();
        int64_t k = 0;
        for (; k + 64 <= K; k += 64) {
            const __m512i u = _mm512_loadu_si512((const void *)(q + k));
            for (int r = 0; r < 4; ++r) {
                STREAM_PREFETCH((const char *)(w + r * K + k), 1);
                acc[r] = _mm512_dpbusd_epi32(
                    acc[r], _mm512_xor_si512(_mm512_loadu_si512((const void *)(w + r * K + k)), flip), u);
            }
        }
        if (k < K) {
            const __mmask64 mk = ~0ULL >> (64 - (K - k));
            const __m512i u = _mm512_maskz_loadu_epi8(mk, q + k);
            for (int r = 0; r < 4; ++r)
                acc[r] = _mm512_dpbusd_epi32(acc[r], _mm512_xor_si512(_mm512_maskz_loadu_epi8(mk, w + r * K + k), flip),
                                             u);
        }
        for (int r = 0; r < 4; ++r)
            out[r][0] = i8dq_out(m, a, n + r, 0, _mm512_reduce_add_epi32(acc[r]) - 128 * a->qsum[0], ydt);
        return;
    }
#endif
#ifdef W4_VNNI
    if (m->kind == QK_8DA4W && nr == 4) { /* four rows a pass for each input row (the rows re-read from L1) */
        const int64_t ng = m->K / 32;
        for (int64_t b = 0; b < a->B; ++b) {
            float d[4];
            w4_dots_vnni(m->w4 + n * (m->K / 2), m->ws + n * ng, a, b, 4, d);
            for (int r = 0; r < 4; ++r) out[r][b] = w4_out(m, a, n + r, b, d[r]);
        }
        return;
    }
#endif
    for (int64_t r = 0; r < nr; ++r) q_row(m, a, n + r, ydt, out[r]);
}

typedef struct {
    QMat m;
    QAct a;
    const void *bias, *res;
    void *y;
    int64_t rows;
    int bdt, ydt, act1;
} QGemv;

static void q_gemv_chunk(const void *job, int64_t chunk) {
    const QGemv *g = job;
    const int64_t N = g->m.N, lo = chunk * g->rows, hi = lo + g->rows < N ? lo + g->rows : N;
    float outs[4][MAXB];
    for (int64_t n = lo; n < hi; ++n) {
        if ((n - lo) % 4 == 0) q_rows(&g->m, &g->a, n, hi - n < 4 ? hi - n : 4, g->ydt, outs); /* 4 at a time */
        const float *out = outs[(n - lo) % 4];
        const float bias = g->bias ? load_as_f32(g->bias, g->bdt, n) : 0.0f;
        for (int64_t b = 0; b < g->a.B; ++b) store_out(g->y, g->ydt, g->res, g->act1, b * N + n, exact(out[b] + bias));
    }
}

static QMat q_mat(int kind, const void *w, const float *ws, int64_t N, int64_t K) {
    QMat m = {kind, NULL, NULL, ws, NULL, N, K};
    if (kind == QK_I8DQ) m.w = w;
    else m.w4 = w, m.wsum = ws + N * (K / 32);
    return m;
}

static int q_shape_ok(int kind, int64_t B, int64_t N, int64_t K) {
    return B >= 1 && B <= MAXB && N >= 1 && K >= 1 && (kind == QK_I8DQ || (kind == QK_8DA4W && K % 32 == 0));
}

static int64_t q_row_bytes(int kind, int64_t K) { return kind == QK_I8DQ ? K : K / 2 + K / 8; }

/* y[B, N] = act(x[B, K] W^T + bias[N]) + res[B, N] for an int8dq (codes, row scales) or 8da4w (nibbles, group
   scales then C) W; kind QK_*;
   act1: 0 none, else ACT_* + 1 */
int gemv_q_act(int kind, const void *w, const float *ws, const void *bias, int bdt, const void *x, int xdt,
                      const void *res, void *y, int ydt, int64_t B, int64_t N, int64_t K, int act1) {
    if (!q_shape_ok(kind, B, N, K)) return -1;
    QGemv g = {q_mat(kind, w, ws, N, K), {0}, bias, res, y, chunk_rows(N, q_row_bytes(kind, K)), bdt, ydt, act1};
    if (!q_load_x(x, xdt, B, K, kind, &g.a)) return -1;
    pool_run(q_gemv_chunk, &g, (N + g.rows - 1) / g.rows);
    return 0;
}

/* y[B, N] = x[B, K] W^T + bias[N] + res[B, N] for an int8dq / 8da4w W (see gemv_q_act). Returns 0, or -1 for
   arguments it cannot take (more than 64 rows, an 8da4w K not a multiple of 32). */
int hl_gemv_q(int kind, const void *w, const float *ws, const void *bias, int bdt, const void *x, int xdt,
              const void *res, void *y, int ydt, int64_t B, int64_t N, int64_t K) {
    return gemv_q_act(kind, w, ws, bias, bdt, x, xdt, res, y, ydt, B, N, K, 0);
}

/* attention's q/k/v with RoPE and the K/V write (hl_qkv_rope) for int8dq / 8da4w matrices: the input row is
   quantised once for the three (torchao quantises it once per product, each time the same) */
typedef struct {
    QkvRope r; /* shapes, biases (m[].bias), outputs, pools, RoPE */
    QMat qm[3];
    QAct a;
} QkvRopeQ;

static void qkv_rope_q_chunk(const void *job, int64_t head) {
    const QkvRopeQ *j = job;
    const QkvRope *r = &j->r;
    const int which = head < r->Hq ? 0 : head < r->Hq + r->Hkv ? 1 : 2;
    const int64_t h = which == 0 ? head : which == 1 ? head - r->Hq : head - r->Hq - r->Hkv;
    const Gemv *g = &r->m[which];
    float acc[MAXB][512], outs[4][MAXB];
    for (int64_t d = 0; d < r->D; ++d) {
        const int64_t n = h * r->D + d;
        if (d % 4 == 0) q_rows(&j->qm[which], &j->a, n, r->D - d < 4 ? r->D - d : 4, g->ydt, outs); /* 4 at a time */
        const float *out = outs[d % 4];
        const float bias = g->bias ? load_as_f32(g->bias, g->bdt, n) : 0.0f;
        for (int64_t b = 0; b < g->B; ++b) acc[b][d] = round_to(exact(out[b] + bias), g->ydt);
    }
    qkv_rope_store(r, which, h, acc);
}

int hl_qkv_rope_q(int kind, const void *wq, const float *sq, const void *bq, const void *wk, const float *sk,
                  const void *bk, const void *wv, const float *sv, const void *bv, int bdt, const void *x, int xdt, void *q_out, void *kpool, void *vpool, int pdt,
                  const int64_t *slots, const void *cos, const void *sin, int64_t rot, int64_t B, int64_t Hq,
                  int64_t Hkv, int64_t D, int64_t K) {
    if (!q_shape_ok(kind, B, Hq * D, K) || D > 512 || rot > D || rot % 2 || Hkv < 1) return -1;
    const void *w[3] = {wq, wk, wv};
    const float *s[3] = {sq, sk, sv};
    QkvRopeQ j = {{{{NULL, NULL, bq, NULL, q_out, NULL, Hq * D, K, B, D, DT_NONE, bdt, xdt, 0},
                    {NULL, NULL, bk, NULL, NULL, NULL, Hkv * D, K, B, D, DT_NONE, bdt, xdt, 0},
                    {NULL, NULL, bv, NULL, NULL, NULL, Hkv * D, K, B, D, DT_NONE, bdt, xdt, 0}},
                   kpool, vpool, slots, cos, sin, Hq, Hkv, D, rot, pdt},
                  {{0}}, {0}};
    for (int i = 0; i < 3; ++i)
        j.qm[i] = q_mat(kind, w[i], s[i], i == 0 ? Hq * D : Hkv * D, K);
    if (!q_load_x(x, xdt, B, K, kind, &j.a)) return -1;
    pool_run(qkv_rope_q_chunk, &j, Hq + 2 * Hkv);
    return 0;
}

/* the gated MLP's first half (hl_gated_up) for int8dq / 8da4w gate and up matrices: y = act(x Wg^T + bg) *
   (x Wu^T + bu), the input row quantised once for both */
typedef struct {
    QMat g, u;
    QAct a;
    const void *bg, *bu;
    void *y;
    int64_t rows;
    int bdt, ydt, act;
} GatedUpQ;

static void gated_up_q_chunk(const void *job, int64_t chunk) {
    const GatedUpQ *j = job;
    const int64_t N = j->g.N, lo = chunk * j->rows, hi = lo + j->rows < N ? lo + j->rows : N;
    float OG[4][MAXB], OU[4][MAXB];
    for (int64_t n = lo; n < hi; ++n) {
        if ((n - lo) % 4 == 0) { /* rows four at a time */
            const int64_t nr = hi - n < 4 ? hi - n : 4;
            q_rows(&j->g, &j->a, n, nr, j->ydt, OG);
            q_rows(&j->u, &j->a, n, nr, j->ydt, OU);
        }
        const float *og = OG[(n - lo) % 4], *ou = OU[(n - lo) % 4];
        const float bg = j->bg ? load_as_f32(j->bg, j->bdt, n) : 0.0f;
        const float bu = j->bu ? load_as_f32(j->bu, j->bdt, n) : 0.0f;
        for (int64_t b = 0; b < j->a.B; ++b) {
            const float a = round_to(activate(round_to(exact(og[b] + bg), j->ydt), j->act), j->ydt);
            store_as(j->y, j->ydt, b * N + n, a * round_to(exact(ou[b] + bu), j->ydt));
        }
    }
}

int hl_gated_up_q(int kind, const void *wg, const float *sg, const void *bg, const void *wu, const float *su,
                  const void *bu, int bdt, const void *x, int xdt, void *y, int act,
                  int64_t B, int64_t N, int64_t K) {
    if (!q_shape_ok(kind, B, N, K)) return -1;
    GatedUpQ j = {q_mat(kind, wg, sg, N, K), q_mat(kind, wu, su, N, K), {0}, bg, bu, y,
                  chunk_rows(N, 2 * q_row_bytes(kind, K)), bdt, xdt, act};
    if (!q_load_x(x, xdt, B, K, kind, &j.a)) return -1;
    pool_run(gated_up_q_chunk, &j, (N + j.rows - 1) / j.rows);
    return 0;
}
