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

#define MAXT 64
#define MAXB 64 /* input rows a product takes at once (a larger batch goes through torch's GEMM) */

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));
typedef uint16_t u16x8u __attribute__((vector_size(16), aligned(2)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef int8_t i8x8u __attribute__((vector_size(8), aligned(1)));

