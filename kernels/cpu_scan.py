"""The Mamba-1 selective scan as a compiled C loop on a CPU: what the torch path runs in inference when a C
compiler is at hand (built once per machine, cached), else the torch token steps.

The recurrence h_t = e^{dt_t A} h_{t-1} + dt_t x_t B_t, y_t = C_t . h_t + D x_t touches a [D, N] state per
token. Eager torch has to make it out of whole-block passes — e^{dt A} over [T, D, N], the inputs dt x B over
[T, D, N], one in-place multiply-add per token, then a batched mat-vec with C — so it streams 12+ bytes per
state element per token through memory and pays one Python op per token per layer (mamba1-small in bf16 at
2K: the scan was 76% of the forward, 1.97 s of 2.6 s, its exps alone 0.64 s). This loop walks a block of 16
channels through all tokens with their [N, 16] states in L1, the 16 channels as the vector lanes: per token
and state one vector exp, two fused multiply-adds and the accumulation of C_t into the output, and x, dt, B,
C read once. Channels are split across threads (each call releases the GIL); the arithmetic is the
reference's, in fp32.

Built with the system C compiler (``cc``, else ``gcc``) as ``-O3 -march=native -ffast-math`` into
``$HYBRID_CACHE_DIR`` (default ``~/.cache/hybrid-lm``), keyed by the source, the flags, the CPU's features
and the compiler's version; ``HYBRID_NATIVE_SCAN=0`` turns it off. Any failure to build or load leaves
:func:`available` saying why (``hybrid doctor`` shows it) and the torch path in charge.
"""

from __future__ import annotations

import ctypes
import functools
import os
from concurrent.futures import ThreadPoolExecutor

import torch

from .native.build import build

ENV = "HYBRID_NATIVE_SCAN"
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp-simd", "-fPIC", "-shared"]
_CHANNEL_BLOCK = 16  # channels whose states a thread walks through the tokens together

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>

#define CB 16   /* channels per block: one AVX-512 register of fp32 lanes (two AVX2 ones) */
#define NMAX 64

/* e^x for x <= 0, in-line so the compiler vectorises it across the channel lanes (the first version, with
   the states as lanes and libmvec's expf called per vector, spilled registers around every call: 36 against
   27 ms for a D 1536, N 16 scan at 2K). x = (i + f) / log2(e) with i an integer and
   |f| <= 1/2; 2^f from its Taylor series to degree 7 (relative error < 1e-8, below fp32's rounding);
   2^i written into the exponent bits. Below -87 (under fp32's smallest normal) the result is 0, as the
   reference's exp would give a value that vanishes against anything it is added to. */
static inline float exp_nonpos(float x) {
    const float t = x * 1.44269504088896341f;
    const float i = nearbyintf(t < -126.0f ? -126.0f : t);
    const float f = (t - i) * 0.69314718055994531f;
    float p = 1.0f / 5040.0f;
    p = p * f + 1.0f / 720.0f;
    p = p * f + 1.0f / 120.0f;
    p = p * f + 1.0f / 24.0f;
    p = p * f + 1.0f / 6.0f;
    p = p * f + 0.5f;
    p = p * f + 1.0f;
    p = p * f + 1.0f;
    int32_t bits = ((int32_t)i + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x < -87.0f ? 0.0f : p * scale;
}

/* One block of CB channels through all L tokens; the block's state hs[n][c] stays in L1. Lanes: channels. */
static void scan_block(int64_t L, int64_t N, const float *x, int64_t ldx, const float *dt, int64_t ldt,
                       const float A[NMAX][CB], const float *B, int64_t ldb, const float *C, int64_t ldc,
                       const float *dskip, float hs[NMAX][CB], float *y, int64_t ldy, int64_t nc) {
    for (int64_t t = 0; t < L; ++t) {
        float delta[CB], u[CB], acc[CB], xt[CB];
        for (int c = 0; c < CB; ++c) {
            xt[c] = c < nc ? x[t * ldx + c] : 0.0f;
            delta[c] = c < nc ? dt[t * ldt + c] : 0.0f;
            u[c] = delta[c] * xt[c];
            acc[c] = 0.0f;
        }
        const float *Bt = B + t * ldb, *Ct = C + t * ldc;
        for (int64_t n = 0; n < N; ++n) {
            const float b = Bt[n], cc = Ct[n];
#pragma omp simd
            for (int c = 0; c < CB; ++c) {
                float s = exp_nonpos(delta[c] * A[n][c]) * hs[n][c] + u[c] * b;
                hs[n][c] = s;
                acc[c] += s * cc;
            }
        }
        for (int c = 0; c < nc; ++c) y[t * ldy + c] = acc[c] + dskip[c] * xt[c];
    }
}

/* Channels [d0, d1) of one sequence. x, dt: [L, D] with row strides ldx, ldt; A: [D, N]; B, C: [L, N] with
   row strides ldb, ldc; Dskip: [D] (zeros for none); h: [D, N], the entering state, left as the final one;
   y: [L, D] with row stride ldy. */
void selective_scan_f32(int64_t L, int64_t N, int64_t d0, int64_t d1,
                        const float *x, int64_t ldx, const float *dt, int64_t ldt, const float *A,
                        const float *B, int64_t ldb, const float *C, int64_t ldc, const float *Dskip,
                        float *h, float *y, int64_t ldy) {
    float hs[NMAX][CB], Ab[NMAX][CB];
    for (int64_t c0 = d0; c0 < d1; c0 += CB) {
        int64_t nc = d1 - c0 < CB ? d1 - c0 : CB;
        for (int64_t n = 0; n < N; ++n)
            for (int c = 0; c < CB; ++c) {
                hs[n][c] = c < nc ? h[(c0 + c) * N + n] : 0.0f;
                Ab[n][c] = c < nc ? A[(c0 + c) * N + n] : 0.0f;
            }
        scan_block(L, N, x + c0, ldx, dt + c0, ldt, (const float (*)[CB])Ab, B, ldb, C, ldc, Dskip + c0, hs,
                   y + c0, ldy, nc);
        for (int64_t n = 0; n < N; ++n)
            for (int c = 0; c < nc; ++c) h[(c0 + c) * N + n] = hs[n][c];
    }
}
"""
NMAX = 64  # the C loop's largest d_state (Mamba-1 models use 16)


def _disabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off")


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str | None]:
    """(the loaded library, None), or (None, why not)."""
    if _disabled():
        return None, f"{ENV}=0"
    lib, why = build("selective_scan", _SOURCE, tuple(_FLAGS))
    if lib is None:
        return None, why
    fn = lib.selective_scan_f32
    fn.restype = None
    fn.argtypes = [ctypes.c_int64] * 4 + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                          ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                          ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                          ctypes.c_int64]
    return lib, None


def available() -> str | None:
    """None when the compiled scan can run here, else why not."""
    return _library()[1]


@functools.cache
def _pool(workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hybrid-scan")


def _ranges(Dm: int, parts: int) -> list[tuple[int, int]]:
    """[0, Dm) cut into ``parts`` ranges of whole channel blocks (the last may be short)."""
    blocks = -(-Dm // _CHANNEL_BLOCK)
    per = -(-blocks // parts)
    return [(i * per * _CHANNEL_BLOCK, min(Dm, (i + 1) * per * _CHANNEL_BLOCK))
            for i in range(parts) if i * per * _CHANNEL_BLOCK < Dm]


def supports(x: torch.Tensor, A: torch.Tensor) -> str | None:
    """None when :func:`selective_scan_cpu` takes these inputs, else why not."""
    if x.device.type != "cpu":
        return "tensors are not on the CPU"
    if A.shape[1] > NMAX:
        return f"d_state {A.shape[1]} > {NMAX}"
    return available()


def selective_scan_cpu(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                       D: torch.Tensor | None, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x, dt [b, L, D], A [D, N], B/C [b, L, N], D [D] or None, h [b, D, N] (the entering state, fp32) ->
    (y [b, L, D] fp32, the final state). Inference only (no autograd)."""
    lib, why = _library()
    if lib is None:
        raise RuntimeError(f"the compiled selective scan is unavailable: {why}")
    b, L, Dm = x.shape
    N = A.shape[1]
    x, dt, B, C = (t.float().contiguous() for t in (x, dt, B, C))
    A = A.float().contiguous()
    Dskip = torch.zeros(Dm) if D is None else D.float().contiguous()
    h = h.float().contiguous().clone()
    y = torch.empty(b, L, Dm, dtype=torch.float32, device=x.device)
    ranges = _ranges(Dm, max(1, torch.get_num_threads()))
    for i in range(b):
        args = (x[i].data_ptr(), Dm, dt[i].data_ptr(), Dm, A.data_ptr(), B[i].data_ptr(), N, C[i].data_ptr(), N,
                Dskip.data_ptr(), h[i].data_ptr(), y[i].data_ptr(), Dm)
        calls = [functools.partial(lib.selective_scan_f32, L, N, d0, d1, *args) for d0, d1 in ranges]
        futures = [_pool(len(calls) - 1).submit(c) for c in calls[1:]] if len(calls) > 1 else []
        calls[0]()  # this thread takes the first range
        for f in futures:
            f.result()
    return y, h
