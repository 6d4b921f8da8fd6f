"""Batched decode products on this CPU: the native product (kernels/native/decode.c hl_gemv, through
kernels.projection._linear_native) against torch's F.linear (oneDNN) for B = 8, 16, 32, 64 input rows, fp32 and bf16
(x and weight in the same dtype), N x K = 2048x768, 768x2048, 32000x768, 2 threads. The native calls run inside
kernels.native.owns_threads() (the pool holds both threads, as in a decode step), torch's outside it (its own two
OpenMP threads). Each call timed alone: min / median / max of RUNS calls, GFLOP/s (2 B N K flops) at the median
and min, and |native - linear_ref|/max|ref|.
Run under the machine's benchmark lock:
  flock /tmp/bench.lock .venv/bin/python -P scripts/probes/batched_products_timing.py [float32|bfloat16 ...]"""
import functools
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from hybrid.kernels import native, projection

RUNS = 15
DTYPES = [getattr(torch, d) for d in (sys.argv[1:] or ["float32", "bfloat16"])]
SHAPES = ((2048, 768), (768, 2048), (32000, 768))
BATCHES = (8, 16, 32, 64)
torch.set_num_threads(2)


def timed(fn, runs=RUNS):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts), statistics.median(ts), max(ts)


def line(tag, flops, t):
    lo, med, hi = t
    return (f"{tag:6s} min {lo * 1e3:7.3f} med {med * 1e3:7.3f} max {hi * 1e3:7.3f} ms  "
            f"{flops / med / 1e9:6.1f} GFLOP/s (best {flops / lo / 1e9:6.1f})")


print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, {RUNS} runs each")
g = torch.Generator().manual_seed(0)
for dtype in DTYPES:
    for N, K in SHAPES:
        w = (torch.randn(N, K, generator=g) / K**0.5).to(dtype)
        for B in BATCHES:
            x = torch.randn(B, K, generator=g).to(dtype)
            flops = 2 * B * N * K
            ref = projection.linear_ref(x, w).float()
            with native.owns_threads():
                native.library()
                y = projection._linear_native(x, w)
                err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                tn = timed(functools.partial(projection._linear_native, x, w))
            tt = timed(functools.partial(F.linear, x, w))
            print(f"{str(dtype)[6:]:8s} {N:5d}x{K:<4d} B={B:2d}  {line('native', flops, tn)} | "
                  f"{line('torch', flops, tt)}"
                  f"  ratio {tt[1] / tn[1]:4.2f}  err {err:.1e}", flush=True)
