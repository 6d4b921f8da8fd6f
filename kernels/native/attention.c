/* ---- paged decode attention ------------------------------------------------------------------------------- */
#include "native.h"
#include "gemv.h"

/* One query token per sequence over its paged K/V (fp32 or bf16 pools [NB, BS, Hkv, D]). A work item is one
   (sequence, KV head, span of PAGED_SPAN visible keys): the group's rep query heads score the span's keys in one
   pass over K (each key row widened once for all rep heads), then one pass over V sums the weighted values:
   each cached byte is read once, straight from its page (no gathered copy). A sequence of one span writes its
   output directly; a longer one (flash-decoding) leaves each span's max, sum and unnormalised values, and a
   second pass combines the spans in order (exp(m_s - max) rescales). The split depends on the lengths only,
   never on the thread count, so every call on the same inputs gives the same bits. With AVX-512 the scores are
   16 keys at a time (one zmm of partial products per key and head, summed across lanes by a transpose tree)
   and V is accumulated in register tiles of up to 4 heads x 64 lanes; elsewhere 8-lane dots and D-wide loops.
   The softmax's exponentials are libm's expf, one per score. */
#define PAGED_SPAN 256

typedef struct {
    const void *q, *k, *v;
    const int32_t *lens, *tables;
    void *out;
    int64_t tstride, Hq, Hkv, D, BS, window, Dp;
    float scale;
    int qdt, kvdt;
    const int64_t *start; /* [Bsz + 1]: the first item of each sequence (Hkv * its span count items) */
    float *part;          /* per item: m[rep], l[rep], acc[rep * Dp]; NULL when every sequence is one span */
    int64_t Bsz;
} PagedDecode;

static float *score_scratch(int64_t n) {
    static _Thread_local float *buf = NULL;
    static _Thread_local int64_t cap = 0;
    if (n > cap) {
        free(buf);
        int64_t want = n > 2 * cap ? n : 2 * cap;
        buf = aligned_alloc(64, ((want * 4 + 63) / 64) * 64);
        cap = buf ? want : 0;
    }
    return buf;
}

static inline int64_t paged_spans(const PagedDecode *j, int64_t b, int64_t *first) {
    const int64_t len = j->lens[b];
    *first = j->window > 0 && len > j->window ? len - j->window : 0;
    const int64_t n = len - *first;
    return n > PAGED_SPAN ? (n + PAGED_SPAN - 1) / PAGED_SPAN : 1;
}

static inline float dot_kv(const float *q, const void *kv, int kvdt, int64_t off, int64_t D) {
    v8 acc = {0};
    int64_t d = 0;
    if (kvdt == DT_F32) {
        const float *k = (const float *)kv + off;
        for (; d + 8 <= D; d += 8) acc += *(const v8u *)(q + d) * *(const v8u *)(k + d);
        float s = hsum(acc);
        for (; d < D; ++d) s += q[d] * k[d];
        return s;
    }
    const uint16_t *k = (const uint16_t *)kv + off;
    for (; d + 8 <= D; d += 8) acc += *(const v8u *)(q + d) * load_w8(k, DT_BF16, d);
    float s = hsum(acc);
    for (; d < D; ++d) s += q[d] * bf16_to_f32(k[d]);
    return s;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PAGED_AVX512 1
#define PD_INLINE static inline __attribute__((always_inline))

/* 16 fp32 of a K/V row from element off (lanes off the mask read as 0) */
PD_INLINE __m512 pd_load16(const void *base, int kvdt, int64_t off, __mmask16 mk) {
    if (kvdt == DT_F32) return _mm512_maskz_loadu_ps(mk, (const float *)base + off);
    const __m256i h = _mm256_maskz_loadu_epi16(mk, (const uint16_t *)base + off);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* lane i of the result = the sum of the 16 lanes of a[i] */
PD_INLINE __m512 pd_reduce16(const float *a) {
    __m512 t[8], u[4], w[2];
    for (int i = 0; i < 8; ++i) {
        const __m512 x = _mm512_load_ps(a + 32 * i), y = _mm512_load_ps(a + 32 * i + 16);
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
    }
    for (int i = 0; i < 4; ++i) {
        const __m512d x = _mm512_castps_pd(t[2 * i]), y = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; ++i)
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* heads r0..r0+RG of up to 16 keys (offs): their per-key partial products into tmp[RG][16][16], then the
   scores into s[r * cnt + i0 ..] */
PD_INLINE void pd_scores(int kvdt, int RG, const void *k, const float *qf, int64_t Dp, int64_t r0, const int64_t *offs,
                         int nk, __mmask16 tail, float *tmp, float *s, int64_t cnt, int64_t i0) {
    const int64_t NC = Dp / 16;
    for (int kk = 0; kk < nk; ++kk) {
        __m512 a[8];
        for (int r = 0; r < RG; ++r) a[r] = _mm512_setzero_ps();
        for (int64_t c = 0; c < NC; ++c) {
            const __m512 kc = pd_load16(k, kvdt, offs[kk] + 16 * c, c == NC - 1 ? tail : (__mmask16)0xffff);
            for (int r = 0; r < RG; ++r) a[r] = _mm512_fmadd_ps(_mm512_load_ps(qf + (r0 + r) * Dp + 16 * c), kc, a[r]);
        }
        for (int r = 0; r < RG; ++r) _mm512_store_ps(tmp + (r * 16 + kk) * 16, a[r]);
    }
    for (int kk = nk; kk < 16; ++kk)
        for (int r = 0; r < RG; ++r) _mm512_store_ps(tmp + (r * 16 + kk) * 16, _mm512_setzero_ps());
    const __mmask16 out = (__mmask16)((1u << nk) - 1);
    for (int r = 0; r < RG; ++r) _mm512_mask_storeu_ps(s + (r0 + r) * cnt + i0, out, pd_reduce16(tmp + r * 256));
}

/* acc[r][c0 * 16 ..] = sum over the span's keys of w[r][i] * V[i][c0 * 16 ..] for heads r0..r0+RG, CG chunks */
PD_INLINE void pd_values(int kvdt, int RG, int CG, const void *v, const float *w, int64_t cnt, int64_t r0, int64_t c0,
                         int64_t NC, __mmask16 tail, const int64_t *offs, float *acc, int64_t Dp) {
    __m512 a[4][4];
    __mmask16 mk[4];
    for (int c = 0; c < CG; ++c) mk[c] = c0 + c == NC - 1 ? tail : (__mmask16)0xffff;
    for (int r = 0; r < RG; ++r)
        for (int c = 0; c < CG; ++c) a[r][c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < cnt; ++i) {
        __m512 vc[4];
        for (int c = 0; c < CG; ++c) vc[c] = pd_load16(v, kvdt, offs[i] + 16 * (c0 + c), mk[c]);
        for (int r = 0; r < RG; ++r) {
            const __m512 wr = _mm512_set1_ps(w[(r0 + r) * cnt + i]);
            for (int c = 0; c < CG; ++c) a[r][c] = _mm512_fmadd_ps(wr, vc[c], a[r][c]);
        }
    }
    for (int r = 0; r < RG; ++r)
        for (int c = 0; c < CG; ++c) _mm512_storeu_ps(acc + (r0 + r) * Dp + 16 * (c0 + c), a[r][c]);
}

static void pd_scores_any(int kvdt, const void *k, const float *qf, int64_t Dp, int64_t rep, const int64_t *offs,
                          int nk, __mmask16 tail, float *tmp, float *s, int64_t cnt, int64_t i0) {
    for (int64_t r0 = 0; r0 < rep;) {
        const int64_t left = rep - r0;
#define PD_S(RG)                                                                                                     \
    do {                                                                                                             \
        if (kvdt == DT_F32) pd_scores(DT_F32, RG, k, qf, Dp, r0, offs, nk, tail, tmp, s, cnt, i0);                   \
        else pd_scores(DT_BF16, RG, k, qf, Dp, r0, offs, nk, tail, tmp, s, cnt, i0);                                 \
        r0 += RG;                                                                                                    \
    } while (0)
        if (left >= 8) PD_S(8);
        else if (left >= 4) PD_S(4);
        else if (left >= 2) PD_S(2);
        else PD_S(1);
#undef PD_S
    }
}

static void pd_values_any(int kvdt, const void *v, const float *w, int64_t cnt, int64_t rep, int64_t NC,
                          __mmask16 tail, const int64_t *offs, float *acc, int64_t Dp) {
    for (int64_t r0 = 0; r0 < rep;) {
        const int RG = rep - r0 >= 4 ? 4 : rep - r0 >= 2 ? 2 : 1;
        for (int64_t c0 = 0; c0 < NC;) {
            const int CG = NC - c0 >= 4 ? 4 : NC - c0 >= 2 ? 2 : 1;
#define PD_V(R, C)                                                                                                   \
    if (RG == R && CG == C) {                                                                                        \
        if (kvdt == DT_F32) pd_values(DT_F32, R, C, v, w, cnt, r0, c0, NC, tail, offs, acc, Dp);                     \
        else pd_values(DT_BF16, R, C, v, w, cnt, r0, c0, NC, tail, offs, acc, Dp);                                   \
    }
            PD_V(4, 4) PD_V(4, 2) PD_V(4, 1) PD_V(2, 4) PD_V(2, 2) PD_V(2, 1) PD_V(1, 4) PD_V(1, 2) PD_V(1, 1)
#undef PD_V
            c0 += CG;
        }
        r0 += RG;
    }
}
#endif

/* keys [lo, hi) of sequence b, KV head h: m[r] (their max score), l[r] (sum of exp(score - m)) and
   acc[r * Dp ..] (the exp-weighted sum of their values, not yet divided by l) */
static void paged_span(const PagedDecode *j, int64_t b, int64_t h, int64_t lo, int64_t hi, float *m, float *l,
                       float *acc) {
    const int64_t Hkv = j->Hkv, D = j->D, Dp = j->Dp, BS = j->BS, rep = j->Hq / Hkv;
    const int64_t cnt = hi - lo;
    const int32_t *table = j->tables + b * j->tstride;
    /* scores [rep][cnt], the scaled queries [rep][Dp] (zero padded), key offsets [cnt], 16x16 x 8 partials */
    float *s = score_scratch(rep * cnt + rep * Dp + 2 * cnt + 8 * 256 + 32);
    float *qf = (float *)(((uintptr_t)(s + rep * cnt) + 63) & ~(uintptr_t)63);
    float *tmp = qf + rep * Dp;
    int64_t *offs = (int64_t *)(tmp + 8 * 256);
    for (int64_t r = 0; r < rep; ++r)
        for (int64_t d = 0; d < Dp; ++d)
            qf[r * Dp + d] = d < D ? load_as_f32(j->q, j->qdt, (b * j->Hq + h * rep + r) * D + d) * j->scale : 0.0f;
    for (int64_t p = lo; p < hi; ++p) offs[p - lo] = (((int64_t)table[p / BS] * BS + p % BS) * Hkv + h) * D;
#ifdef PAGED_AVX512
    const int64_t NC = Dp / 16;
    const __mmask16 tail = (__mmask16)(D % 16 ? (1u << (D % 16)) - 1 : 0xffffu);
    for (int64_t i = 0; i < cnt; i += 16) {
        const int nk = cnt - i < 16 ? (int)(cnt - i) : 16;
        pd_scores_any(j->kvdt, j->k, qf, Dp, rep, offs + i, nk, tail, tmp, s, cnt, i);
    }
#else
    for (int64_t i = 0; i < cnt; ++i)
        for (int64_t r = 0; r < rep; ++r) s[r * cnt + i] = dot_kv(qf + r * Dp, j->k, j->kvdt, offs[i], D);
#endif
    for (int64_t r = 0; r < rep; ++r) {
        float *sr = s + r * cnt;
        float mx = -FLT_MAX; /* not -inf: -ffast-math assumes none */
        for (int64_t i = 0; i < cnt; ++i) mx = sr[i] > mx ? sr[i] : mx;
        float t = 0.0f;
        for (int64_t i = 0; i < cnt; ++i) {
            sr[i] = expf(sr[i] - mx);
            t += sr[i];
        }
        m[r] = mx, l[r] = t;
    }
#ifdef PAGED_AVX512
    pd_values_any(j->kvdt, j->v, s, cnt, rep, NC, tail, offs, acc, Dp);
#else
    for (int64_t r = 0; r < rep; ++r)
        for (int64_t d = 0; d < D; ++d) acc[r * Dp + d] = 0.0f;
    for (int64_t i = 0; i < cnt; ++i) {
        const int64_t off = offs[i];
        for (int64_t r = 0; r < rep; ++r) {
            const float w = s[r * cnt + i];
            float *a = acc + r * Dp;
            if (j->kvdt == DT_F32) {
                const float *vv = (const float *)j->v + off;
                for (int64_t d = 0; d < D; ++d) a[d] += w * vv[d];
            } else {
                const uint16_t *vv = (const uint16_t *)j->v + off;
                for (int64_t d = 0; d < D; ++d) a[d] += w * bf16_to_f32(vv[d]);
            }
        }
    }
#endif
}

static void paged_write(const PagedDecode *j, int64_t b, int64_t h, const float *acc, const float *l) {
    const int64_t D = j->D, Dp = j->Dp, rep = j->Hq / j->Hkv;
    for (int64_t r = 0; r < rep; ++r) {
        const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        const int64_t o = (b * j->Hq + h * rep + r) * D;
        for (int64_t d = 0; d < D; ++d) {
            const float val = acc[r * Dp + d] * inv;
            if (j->qdt == DT_BF16) ((uint16_t *)j->out)[o + d] = f32_to_bf16(val);
            else ((float *)j->out)[o + d] = val;
        }
    }
}

static inline int64_t paged_part_floats(const PagedDecode *j) { return (j->Hq / j->Hkv) * (2 + j->Dp); }

static void paged_decode_chunk(const void *job, int64_t item) {
    const PagedDecode *j = job;
    int64_t lo = 0, hi = j->Bsz; /* the sequence: start[b] <= item < start[b + 1] */
    while (hi - lo > 1) {
        const int64_t mid = (lo + hi) / 2;
        if (j->start[mid] <= item) lo = mid;
        else hi = mid;
    }
    const int64_t b = lo, rep = j->Hq / j->Hkv;
    int64_t first;
    const int64_t ns = paged_spans(j, b, &first), len = j->lens[b];
    const int64_t h = (item - j->start[b]) / ns, sp = (item - j->start[b]) % ns;
    const int64_t k0 = first + sp * PAGED_SPAN, k1 = k0 + PAGED_SPAN < len ? k0 + PAGED_SPAN : len;
    if (ns == 1) {
        static _Thread_local float *own = NULL; /* not score_scratch: paged_span's scores live there */
        static _Thread_local int64_t cap = 0;
        const int64_t need = paged_part_floats(j);
        if (need > cap) {
            free(own);
            own = aligned_alloc(64, ((need * 4 + 63) / 64) * 64);
            cap = own ? need : 0;
        }
        paged_span(j, b, h, k0, k1 > k0 ? k1 : k0, own, own + rep, own + 2 * rep);
        paged_write(j, b, h, own + 2 * rep, own + rep);
        return;
    }
    float *p = j->part + item * paged_part_floats(j);
    paged_span(j, b, h, k0, k1, p, p + rep, p + 2 * rep);
}

/* the spans of (sequence, KV head) item / Hkv, item % Hkv, combined in order */
static void paged_combine_chunk(const void *job, int64_t item) {
    const PagedDecode *j = job;
    const int64_t b = item / j->Hkv, h = item % j->Hkv, rep = j->Hq / j->Hkv, Dp = j->Dp;
    int64_t first;
    const int64_t ns = paged_spans(j, b, &first);
    if (ns == 1) return;
    const int64_t pf = paged_part_floats(j);
    const float *p0 = j->part + (j->start[b] + h * ns) * pf;
    float *acc = score_scratch(rep * (Dp + 1));
    float *l = acc + rep * Dp;
    for (int64_t r = 0; r < rep; ++r) {
        float mx = -FLT_MAX;
        for (int64_t s = 0; s < ns; ++s) mx = p0[s * pf + r] > mx ? p0[s * pf + r] : mx;
        float t = 0.0f;
        for (int64_t d = 0; d < Dp; ++d) acc[r * Dp + d] = 0.0f;
        for (int64_t s = 0; s < ns; ++s) {
            const float *p = p0 + s * pf;
            const float f = expf(p[r] - mx);
            t += f * p[rep + r];
            const float *a = p + 2 * rep + r * Dp;
            for (int64_t d = 0; d < Dp; ++d) acc[r * Dp + d] += f * a[d];
        }
        l[r] = t;
    }
    paged_write(j, b, h, acc, l);
}

int hl_paged_decode(const void *q, int qdt, const void *k, const void *v, int kvdt, const int32_t *lens,
                    const int32_t *tables, int64_t tstride, void *out, int64_t Bsz, int64_t Hq, int64_t Hkv,
                    int64_t D, int64_t BS, int64_t window, float scale) {
    if (Hkv < 1 || Hq % Hkv || Hq / Hkv > 64) return -1;
    if (Bsz < 1) return 0;
#ifdef PAGED_AVX512
    const int64_t Dp = (D + 15) / 16 * 16;
#else
    const int64_t Dp = D;
#endif
    static _Thread_local int64_t *start = NULL;
    static _Thread_local int64_t scap = 0;
    static _Thread_local float *part = NULL;
    static _Thread_local int64_t pcap = 0;
    if (Bsz + 1 > scap) {
        free(start);
        start = malloc((Bsz + 1) * sizeof *start);
        scap = start ? Bsz + 1 : 0;
        if (!start) return -1;
    }
    PagedDecode j = {q, k, v, lens, tables, out, tstride, Hq, Hkv, D, BS, window, Dp, scale, qdt, kvdt, start, NULL,
                     Bsz};
    int64_t first, split = 0;
    start[0] = 0;
    for (int64_t b = 0; b < Bsz; ++b) {
        const int64_t ns = paged_spans(&j, b, &first);
        split |= ns > 1;
        start[b + 1] = start[b] + Hkv * ns;
    }
    if (split) {
        const int64_t need = start[Bsz] * paged_part_floats(&j);
        if (need > pcap) {
            free(part);
            const int64_t want = need > 2 * pcap ? need : 2 * pcap;
            part = aligned_alloc(64, ((want * 4 + 63) / 64) * 64);
            pcap = part ? want : 0;
            if (!part) return -1;
        }
        j.part = part;
    }
    pool_run(paged_decode_chunk, &j, start[Bsz]);
    if (split) pool_run(paged_combine_chunk, &j, Bsz * Hkv);
    return 0;
}

