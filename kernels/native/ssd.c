/* ---- Mamba-2 SSD step -------------------------------------------------------------------------------------- */
#include "native.h"
#include "gemv.h"

/* One token per sequence: per (sequence b, head h) the state rows s[p][:] (P x N, fp32 or bf16 storage) become
   s * exp(dt A) + dt x[p] B, and y[p] = s . C + D x[p] — ssd_step_ref's arithmetic in one pass over the state
   (the torch path makes three). The heads of a group share B and C. */
typedef struct {
    void *state;
    const int64_t *slots;
    const void *x, *B, *C, *Dp;
    const float *dt, *A;
    void *y;
    int64_t xs, bs, cs, dts; /* batch strides in elements */
    int64_t H, P, N, G;
    int sdt, xdt, ddt;
} SsdStep;

static void ssd_step_chunk(const void *job, int64_t item) {
    const SsdStep *j = job;
    const int64_t b = item / j->H, h = item % j->H, g = h / (j->H / j->G), N = j->N, P = j->P;
    const int64_t row = j->slots ? j->slots[b] : b;
    float Bv[512], Cv[512], tmp[512];
    for (int64_t n = 0; n < N; ++n) {
        Bv[n] = load_as_f32(j->B, j->xdt, b * j->bs + g * N + n);
        Cv[n] = load_as_f32(j->C, j->xdt, b * j->cs + g * N + n);
    }
    const float dt = j->dt[b * j->dts + h];
    const float dA = expf(dt * j->A[h]);
    const float Dh = j->Dp ? load_as_f32(j->Dp, j->ddt, h) : 0.0f;
    const int64_t base = ((row * j->H + h) * P) * N;
    for (int64_t p = 0; p < P; ++p) {
        const float xp = load_as_f32(j->x, j->xdt, b * j->xs + h * P + p);
        const float u = dt * xp;
        /* the state row's dot with C in 16 lanes (two chains of 8), summed in a fixed order: the build keeps
           source order (no -funsafe-math-optimizations), so a scalar += here is one 128-long dependent chain,
           and the state step ran at a quarter of the L3's rate */
        v8 a0 = {0}, a1 = {0};
        int64_t n = 0;
        if (j->sdt == DT_F32) {
            float *s = (float *)j->state + base + p * N;
            for (; n + 16 <= N; n += 16) {
                const v8 v0 = *(const v8u *)(s + n) * dA + u * *(const v8u *)(Bv + n);
                const v8 v1 = *(const v8u *)(s + n + 8) * dA + u * *(const v8u *)(Bv + n + 8);
                *(v8u *)(s + n) = v0, *(v8u *)(s + n + 8) = v1;
                a0 += v0 * *(const v8u *)(Cv + n), a1 += v1 * *(const v8u *)(Cv + n + 8);
            }
            for (int64_t i = n; i < N; ++i) tmp[i] = s[i] = s[i] * dA + u * Bv[i];
        } else {
            uint16_t *s = (uint16_t *)j->state + base + p * N;
            for (int64_t i = 0; i < N; ++i) tmp[i] = bf16_to_f32(s[i]) * dA + u * Bv[i];
            for (int64_t i = 0; i < N; ++i) s[i] = f32_to_bf16(tmp[i]);
            for (; n + 16 <= N; n += 16)
                a0 += *(const v8u *)(tmp + n) * *(const v8u *)(Cv + n),
                a1 += *(const v8u *)(tmp + n + 8) * *(const v8u *)(Cv + n + 8);
        }
        float acc = hsum(a0 + a1);
        for (; n < N; ++n) acc += tmp[n] * Cv[n];
        const float out = acc + Dh * xp;
        const int64_t o = (b * j->H + h) * P + p;
        if (j->xdt == DT_BF16) ((uint16_t *)j->y)[o] = f32_to_bf16(out);
        else ((float *)j->y)[o] = out;
    }
}

int hl_ssd_step(void *state, int sdt, const int64_t *slots, const void *x, int xdt, int64_t xs, const float *dt,
                int64_t dts, const float *A, const void *B, int64_t bs, const void *C, int64_t cs, const void *Dp,
                int ddt, void *y, int64_t Bsz, int64_t H, int64_t P, int64_t N, int64_t G) {
    if (N > 512 || G < 1 || H % G) return -1;
    SsdStep j = {state, slots, x, B, C, Dp, dt, A, y, xs, bs, cs, dts, H, P, N, G, sdt, xdt, ddt};
    pool_run(ssd_step_chunk, &j, Bsz * H);
    return 0;
}

