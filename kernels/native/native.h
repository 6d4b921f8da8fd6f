/* The decode step's matrix-vector products (and the fused Mamba state steps) on a CPU, at the memory
   bandwidth: a decode step reads every weight once for a handful of input rows, so its speed is the rate
   at which the cores can stream the weights in, and nothing else may stand in the way.

   Threads: a small pool of our own (pthreads), not OpenMP. Work is cut into chunks of rows, the chunks into one run
   of consecutive chunks a thread; each thread claims from its run with an atomic counter, then from the others',
   the calling thread among them, and a call returns when every chunk is done. A
   worker that is not running when a call arrives (another process holds its core) simply claims nothing:
   the caller does its share, so a busy machine costs throughput, never a wait for a descheduled thread at
   a barrier — the failure mode of fork/join on two cores, where one other process turned a 14 ms eager
   step into 143 ms. Workers spin a short while after a call (the next product of a step follows within
   microseconds), then sleep on a futex.

   Weights are row-major [N, K] (nn.Linear's layout): fp32, bf16 (widened to fp32 in registers), or int8
   with one fp32 scale per row (torchao's int8 weight-only layout); or torchao's CPU int4 weight-only codes in
   aten's blocked int4pack layout with per-group scales and zeros (hl_gemv_int4, see its section). Inputs x are [B, K] rows (fp32 or bf16),
   accumulation is fp32, outputs [B, N] fp32 or bf16 (rounded to nearest even), an optional bias and an
   optional residual added in the same pass. */

/* native.h: what every file of the library shares, included first by each (kernels/native/variants.py compiles
   each .c on its own and links them): the system includes, the dtype codes, the vector types, the thread pool's
   interface and one declaration of every function called from another file. Visibility: the library is compiled
   with -fvisibility=hidden and everything declared here is hidden too (the pragma below: a call across files stays
   a direct call, no PLT or GOT), except the entry points marked HL_API, the set Python's ctypes declares
   (kernels/native/__init__.py _declare; tests/test_native_build.py checks the two agree). Small hot helpers shared
   across files are static inline in simd.h (conversions, activations), gemv.h (the products' row kernels and the
   load/store helpers of every family) and products.h (the blocked row products the fused sub-layers share). */

#pragma once

#define _GNU_SOURCE
#ifdef __linux__
#include <linux/futex.h>
#endif
#include <fcntl.h>
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/syscall.h>
#include <unistd.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif


#define HL_API __attribute__((visibility("default")))
#pragma GCC visibility push(hidden)

#define MAXT 64
#define MAXB 64 /* input rows a product takes at once (a larger batch goes through torch's GEMM) */

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));
typedef uint16_t u16x8u __attribute__((vector_size(16), aligned(2)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef int8_t i8x8u __attribute__((vector_size(8), aligned(1)));
#ifdef __AVX512F__
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));
#endif

/* a tensor's element type, as Python passes it (kernels/native/__init__.py DTYPE_CODES) */
enum { DT_F32 = 0, DT_BF16 = 1, DT_I8 = 2, DT_NONE = -1 };

/* ---- the thread pool (pool.c) ------------------------------------------------------------------------------- */
typedef void (*chunk_fn)(const void *job, int64_t chunk);
/* fn(job, c) for every c in [0, nchunks), on the pool's threads and the caller's; returns when all are done */
void pool_run(chunk_fn fn, const void *job, int64_t nchunks);
int pool_threads(void);     /* the threads a call runs on: the workers and the caller */
void pool_hot(int on);      /* a decode program runs: the workers spin between its ops, never sleep */
double now_us(void);        /* CLOCK_MONOTONIC in microseconds */
extern int P_stream;        /* the weights stream from memory: the products prefetch ahead (hl_set_stream_prefetch) */
extern int P_solo;          /* the decode program runs its ops on the caller alone (program.c) */
extern double P_waited_us;  /* the caller's waits for descheduled workers since program.c reset it */

/* STREAM_PREFETCH(p, lines): the `lines` 64-byte weight lines from p + PF_AHEAD into L2 (prefetcht1), where p is what
   a loop step reads now: every line the loop will read (a 128-byte bf16 step names two), 4 KB ahead — far enough
   for DRAM's latency at the bandwidth two cores draw, and past the rest of a 4-row pass (the next group of four
   512-wide bf16 rows starts 4 KB on). On a 2-vCPU Zen 4 (32 MiB L3) this took llama-d512's decode program from
   5.2-5.6 to 3.5-3.8 ms in bf16, 7.7 to 6.0 in fp32, 2.7-3.4 to 1.4-1.8 in int8dq (three A/B rounds each in one
   process) against the earlier non-temporal prefetch of one line a step 1 KB ahead (half a bf16 step's lines, a
   quarter of the next rows', and none for fp32), which had measured faster than no prefetch on a Zen 3 VM. */
#define PF_AHEAD 4096
#define STREAM_PREFETCH(ptr, lines) do { \
        if (P_stream) \
            for (int pf_ = 0; pf_ < (lines); ++pf_) \
                _mm_prefetch((const char *)(ptr) + PF_AHEAD + 64 * pf_, _MM_HINT_T1); \
    } while (0)

/* ---- the decode program's argument structs (program.c; hybrid/decode/builder.py mirrors them) --------------- */
typedef struct HlOp HlOp;
typedef struct HlStep HlStep;

/* ---- the library's functions by file: HL_API the entry points Python loads, the rest called across files --- */
/* pool.c */
HL_API int hl_set_stream_prefetch(int on);
HL_API int hl_set_threads(int n, int64_t spin);
HL_API int64_t hl_stream_read(const void *buf, int64_t bytes);
/* amx.c */
HL_API int hl_cpu_paths(void);
HL_API int hl_gemv(const void *w, int wdt, const float *scale, const void *bias, int bdt, const void *x, int xdt,
    const void *res, void *y, int ydt, int64_t B, int64_t N, int64_t K);
/* int4.c */
HL_API int hl_gemv_int4(const uint8_t *q, const void *sz, int sdt, int64_t G, const void *bias, int bdt, const void
    *x, int xdt, const void *res, void *y, int ydt, int64_t B, int64_t N, int64_t K, int bn);
/* int8_activation.c */
HL_API int hl_gemv_q(int kind, const void *w, const float *ws, const void *bias, int bdt, const void *x, int xdt,
    const void *res, void *y, int ydt, int64_t B, int64_t N, int64_t K);
int hl_qkv_rope_q(int kind, const void *wq, const float *sq, const void *bq, const void *wk, const float *sk, const
    void *bk, const void *wv, const float *sv, const void *bv, int bdt, const void *x, int xdt, void *q_out, void
    *kpool, void *vpool, int pdt, const int64_t *slots, const void *cos, const void *sin, int64_t rot, int64_t B,
    int64_t Hq, int64_t Hkv, int64_t D, int64_t K);
int hl_gated_up_q(int kind, const void *wg, const float *sg, const void *bg, const void *wu, const float *su, const
    void *bu, int bdt, const void *x, int xdt, void *y, int act, int64_t B, int64_t N, int64_t K);
/* ssd.c */
HL_API int hl_ssd_step(void *state, int sdt, const int64_t *slots, const void *x, int xdt, int64_t xs, const float
    *dt, int64_t dts, const float *A, const void *B, int64_t bs, const void *C, int64_t cs, const void *Dp, int ddt,
    void *y, int64_t Bsz, int64_t H, int64_t P, int64_t N, int64_t G);
/* scan.c */
HL_API int hl_selective_scan(const void *x, int xdt, int64_t ldx, const void *dt, int dtdt, int64_t ldt, const float
    *A, const void *B, int bdt, int64_t ldb, const void *C, int cdt, int64_t ldc, const float *Dskip, float *h, void
    *y, int ydt, int64_t ldy, const int64_t *cu, int64_t nseq, int64_t D, int64_t N);
/* gated_delta.c */
HL_API int hl_gdn_step(void *state, int sdt, const int64_t *slots, const void *q, const void *k, int64_t qs, const
    void *v, int xdt, int64_t vs, const float *g, const float *beta, int64_t gs, float scale, void *y, int64_t Bsz,
    int64_t H, int64_t Hk, int64_t K, int64_t V);
/* conv.c */
HL_API int hl_conv_step(void *state, int sdt, const int64_t *slots, const void *x, int xdt, int64_t xs, const void *w,
    int wdt, const void *bias, int bdt, int silu, void *y, int64_t Bsz, int64_t C, int64_t K);
/* attention.c */
HL_API int hl_paged_decode(const void *q, int qdt, const void *k, const void *v, int kvdt, const int32_t *lens, const
    int32_t *tables, int64_t tstride, void *out, int64_t Bsz, int64_t Hq, int64_t Hkv, int64_t D, int64_t BS, int64_t
    window, float scale);
/* sublayer.c */
HL_API void hl_rmsnorm(const void *x, int xdt, const void *w, int wdt, float eps, void *y, int64_t B, int64_t d);
HL_API int hl_gated_up(const void *wg, const float *sg, const void *bg, const void *wu, const float *su, const void
    *bu, int wdt, int bdt, const void *x, int xdt, void *y, int act, int64_t B, int64_t N, int64_t K);
HL_API int hl_qkv_rope(const void *wq, const void *bq, const void *wk, const void *bk, const void *wv, const void *bv,
    const float *sq, const float *sk, const float *sv, int wdt, int bdt, const void *x, int xdt, void *q_out, void
    *kpool, void *vpool, int pdt, const int64_t *slots, const void *cos, const void *sin, int64_t rot, int64_t B,
    int64_t Hq, int64_t Hkv, int64_t D, int64_t K);
int hl_qkv_rope_int4(const uint8_t *qq, const void *szq, const void *bq, const uint8_t *qk, const void *szk, const
    void *bk, const uint8_t *qv, const void *szv, const void *bv, int sdt, int64_t G, int bdt, const void *x, int xdt,
    void *q_out, void *kpool, void *vpool, int pdt, const int64_t *slots, const void *cos, const void *sin, int64_t
    rot, int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t K, int bn);
int hl_gated_up_int4(const uint8_t *qg, const void *szg, const void *bg, const uint8_t *qu, const void *szu, const
    void *bu, int sdt, int64_t G, int bdt, const void *x, int xdt, void *y, int act, int64_t B, int64_t N, int64_t K,
    int bn);
HL_API void hl_gated_rmsnorm(const void *y, const void *z, int64_t zs, int dt, const void *w, int wdt, float eps,
    int64_t groups, int norm_before_gate, void *out, int64_t B, int64_t d);
HL_API void hl_mamba2_dt(const void *dt_raw, int xdt, int64_t dts, const void *dt_bias, int bdt, const void *A_log,
    int adt, float lo, float hi, int clamp, float *dt_out, float *A_out, int64_t B, int64_t H);
/* linear_attention.c */
HL_API void hl_l2norm_heads(const void *x, int64_t xs, int xdt, void *y, int64_t ys, int64_t B, int64_t heads, int64_t
    K, float eps);
HL_API void hl_gdn_gates(const void *bb, int64_t bs, const void *aa, int64_t as, int xdt, const void *A_log, int adt,
    const void *dt_bias, int bdt, float *g, float *beta, int64_t B, int64_t H);
int hl_gdn_decode(void *state, int sdt, const int64_t *slots, const void *qkv, int xdt, int64_t qkv_s, const void *ba,
    int64_t ba_s, const void *A_log, int adt, const void *dt_bias, int bdt, void *qk, float *g, float *beta, void *y,
    int64_t B, int64_t H, int64_t Hk, int64_t K, int64_t V, float eps, float scale);
void hl_head_rmsnorm(const void *y, int64_t ys, const void *z, int64_t zs, int dt, const void *w, int wdt, float eps,
    int gated, void *out, int64_t B, int64_t H, int64_t V);
HL_API int hl_gla_step(void *state, int sdt, const int64_t *slots, const void *q, int64_t qs, const void *k, int64_t
    ks, const void *v, int64_t vs, int xdt, const float *g, int64_t gs, float scale, void *y, int64_t B, int64_t H,
    int64_t Hkv, int64_t K, int64_t V);
HL_API void hl_gla_decay(const void *x, int xdt, float *g, int64_t n, float normalizer, float clamp_min, int clamp);
int hl_gla_decode(void *state, int sdt, const int64_t *slots, const void *qkv, int xdt, int64_t qkv_s, const void
    *low, int64_t low_s, void *low_buf, const void *w, const float *wscale, int wdt, const void *bias, int bdt, void
    *gk, float *g, void *y, int64_t B, int64_t R, int64_t H, int64_t Hkv, int64_t K, int64_t V, float normalizer,
    float clamp_min, int clamp);
HL_API void hl_gdn_ut_solve(const float *A, float *X, int64_t count, int64_t C, int64_t W);
HL_API int hl_gdn_chunk_prep(const float *q, const float *k, const float *kk, const float *qk, const float *c, const
    float *beta, float *v, float *W, float *qe, float *kend, float *attn, int64_t n, int64_t Hk, int64_t rep, int64_t
    C, int64_t K, int64_t V);
/* program.c */
HL_API int64_t hl_program_solo_runs(void);
HL_API int64_t hl_program_run(const HlOp *ops, int64_t nops, const HlStep *st, double *times);
HL_API int64_t hl_program_steps(const HlOp *ops, int64_t nops, HlStep *st, double *times, int64_t steps, int64_t
    block_size, const void *logits, int ldt, int64_t V, int64_t *ids);
HL_API int64_t hl_program_abi(void);
HL_API void hl_argmax(const void *x, int dt, int64_t rows, int64_t V, int64_t *out);

/* convert.c */
void silu_f32(float *v, int64_t n, float scale, float bias);
#ifdef __AVX512F__
void silu_bf16_exact(float *v, int64_t n);
#endif

#pragma GCC visibility pop

#include "simd.h"
