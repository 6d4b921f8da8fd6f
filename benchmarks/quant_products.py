"""GB/s of the quantised decode products on SmolLM2-135M's layer shapes, one input row, against the CPU's streaming
read rate (``hl_stream_read`` on the same pool): which products are bound by the bytes and which by their
arithmetic.

    OMP_NUM_THREADS=2 flock /tmp/bench.lock taskset -c 0,1 python -m benchmarks.quant_products --threads 2

Each shape is timed over enough distinct copies of its weights that they do not fit in the L2 caches (they
stream from L3 or memory, as a decode step's ~60 products do), by the raw ctypes call; the call's own cost (the
same call on a 16x32 matrix) is taken off. Codes and scales are random: the products' speed does not depend on
the values. Shapes: SmolLM2's q/o (576x576), k/v (192x576), gate/up (1536x576), down (576x1536) and the tied head
(49152x576). Schemes: ``int8dq`` (int8 rows), ``8da4w`` (int4 groups of 32, int8 activations), ``int4wo`` (int4
in aten's 64-row int4pack layout, bf16 activations, groups of 64 or 128 as hybrid.quantize picks them),
``int8wo-head`` (the int4wo scheme's 8-bit head)."""

from __future__ import annotations

import argparse
import time

import torch

SHAPES = ((576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576))
SCHEMES = ("int8dq", "8da4w", "int4wo", "int8wo-head")
L2_BYTES = 8 << 20  # more than both cores' L2s together: the copies stream from L3


def _group_int4(K: int) -> int:
    return next(g for g in (128, 64, 32) if K % g == 0)


def operands(scheme: str, N: int, K: int, x_dtype: torch.dtype):
    """(weight tensors, call(lib, x, y, tensors)) for one product of ``scheme``."""
    from hybrid.kernels.native import DTYPE_CODES

    if scheme in ("int8dq", "8da4w"):
        kind = 0 if scheme == "int8dq" else 1
        w = torch.randint(-127, 128, (N, K), dtype=torch.int8) if kind == 0 else \
            torch.randint(0, 256, (N, K // 2), dtype=torch.uint8)
        ws = torch.rand(N) * 1e-2 if kind == 0 else torch.rand(N * (K // 32) + N) * 1e-2

        def call(lib, x, y, t):
            return lib.hl_gemv_q(kind, t[0].data_ptr(), t[1].data_ptr(), None, -1, x.data_ptr(),
                                 DTYPE_CODES[x.dtype], None, y.data_ptr(), DTYPE_CODES[x.dtype], 1, N, K)
        return (w, ws), call
    if scheme == "int4wo":
        G = _group_int4(K)
        q = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8)
        sz = (torch.rand(K // G, N, 2) * 1e-2).to(x_dtype)

        def call(lib, x, y, t):
            return lib.hl_gemv_int4(t[0].data_ptr(), t[1].data_ptr(), DTYPE_CODES[t[1].dtype], G, None, -1,
                                    x.data_ptr(), DTYPE_CODES[x.dtype], None, y.data_ptr(), DTYPE_CODES[x.dtype], 1,
                                    N, K, 64)
        return (q, sz), call
    w = torch.randint(-127, 128, (N, K), dtype=torch.int8)
    s = torch.rand(N) * 1e-2

    def call(lib, x, y, t):
        return lib.hl_gemv(t[0].data_ptr(), DTYPE_CODES[torch.int8], t[1].data_ptr(), None, -1, x.data_ptr(),
                           DTYPE_CODES[x.dtype], None, y.data_ptr(), DTYPE_CODES[x.dtype], 1, N, K)
    return (w, s), call


def time_product(lib, scheme: str, N: int, K: int, x_dtype: torch.dtype, reps: int) -> tuple[float, int]:
    """(seconds per product, bytes it reads), the best of 5 rounds over the distinct copies."""
    tensors, call = operands(scheme, N, K, x_dtype)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    copies = [tensors] + [tuple(t.clone() for t in tensors) for _ in range(max(0, L2_BYTES // nbytes))]
    x, y = torch.randn(1, K).to(x_dtype), torch.empty(1, N, dtype=x_dtype)
    for c in copies:
        if call(lib, x, y, c):
            raise RuntimeError(f"{scheme} {N}x{K}: the kernel refused the arguments")
    n = max(reps, len(copies))
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for i in range(n):
            call(lib, x, y, copies[i % len(copies)])
        best = min(best, (time.perf_counter() - t0) / n)
    return best, nbytes


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.quant_products", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=SCHEMES)
    ap.add_argument("--reps", type=int, default=400, help="products per timing round (at least the copies)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from hybrid.kernels.native import library

    lib = library()
    buf = torch.zeros(96 << 20, dtype=torch.uint8)  # 96 MB: an L3-sized stream, as a decode step's weights
    lib.hl_stream_read(buf.data_ptr(), buf.numel())
    stream = min(_stream_once(lib, buf) for _ in range(5))
    print(f"streaming read, {args.threads} threads, 96 MB: {buf.numel() / stream / 1e9:.1f} GB/s")
    # the call's own cost: a 16x32 product, nothing to stream
    overhead = {s: time_product(lib, s, 32, 64, torch.bfloat16 if s == "int4wo" else torch.float32, 2000)[0]
                for s in args.schemes}
    print(f"{'scheme':12} {'N x K':>12} {'us':>8} {'GB/s':>7}   (call overhead taken off: "
          + ", ".join(f"{s} {v * 1e6:.1f} us" for s, v in overhead.items()) + ")")
    for scheme in args.schemes:
        xdt = torch.bfloat16 if scheme == "int4wo" else torch.float32
        for N, K in SHAPES:
            if scheme == "int8wo-head" and N != 49152:
                continue
            sec, nbytes = time_product(lib, scheme, N, K, xdt, args.reps if N < 10000 else 40)
            sec -= overhead[scheme]
            print(f"{scheme:12} {f'{N}x{K}':>12} {sec * 1e6:8.1f} {nbytes / sec / 1e9:7.1f}")


def _stream_once(lib, buf) -> float:
    t0 = time.perf_counter()
    lib.hl_stream_read(buf.data_ptr(), buf.numel())
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
