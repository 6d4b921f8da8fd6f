"""Per-call cost of the native ops' Python layers at decode sizes, one token: the raw ctypes call (arguments
prepared), the custom op (torch.ops.hybrid.*: the dispatcher, the argument check, the output's allocation, the
ctypes call), and the whole dispatch path a layer takes (kernels.ssd_step: the per-call check, then the op); with
``--old FILE`` (a copy of an earlier kernels/native/ops.py, e.g. ``git show HEAD~1:kernels/native/ops.py``) also
that file's path (its supports check, then its ctypes wrapper), loaded into the same process so the numbers are
comparable. Prints min / median / max ns per call; run it alone (one thread, under flock /tmp/bench.lock).

    git show 9f7ebc7:kernels/native/ops.py > /tmp/old_ops.py
    OMP_NUM_THREADS=1 flock /tmp/bench.lock python -m benchmarks.native_op_overhead --old /tmp/old_ops.py
"""

from __future__ import annotations

import argparse
import importlib.util
import time

import torch


def _time(fn, calls: int, repeats: int) -> tuple[float, float, float]:
    """ns per call: each sample the mean of ``calls`` calls; min / median / max of ``repeats`` samples."""
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter_ns() - t0) / calls)
    samples.sort()
    return samples[0], samples[len(samples) // 2], samples[-1]


def _ssd_inputs(n=1, H=16, P=64, N=128, G=1):
    """mamba2-d512's step: d_inner 1024 as 16 heads of 64, d_state 128, one group."""
    xBC = torch.randn(n, H * P + 2 * G * N)
    x = xBC[:, :H * P].view(n, H, P)
    B = xBC[:, H * P:H * P + G * N].view(n, G, N)
    C = xBC[:, H * P + G * N:].view(n, G, N)
    return torch.zeros(n, H, P, N), x, torch.rand(n, H), -torch.rand(H), B, C, torch.randn(H)


def _conv_inputs(n=1, channels=1024 + 256, K=4):
    return torch.zeros(n, channels, K - 1), torch.randn(n, channels), torch.randn(channels, K), torch.randn(channels)


def _load_old(path: str):
    spec = importlib.util.spec_from_file_location("hybrid.kernels.native._old_ops", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", help="an earlier kernels/native/ops.py to time beside the current one")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from hybrid.kernels import conv1d, native, projection, ssd
    from hybrid.kernels.native import DTYPE_CODES
    from hybrid.kernels.native import ops as new

    old = _load_old(args.old) if args.old else None
    lib = native.library()
    state, x, dt, A, B, C, D = _ssd_inputs()
    y = torch.empty(x.shape)
    n, H, P = x.shape
    raw_ssd = (state.data_ptr(), 0, None, x.data_ptr(), 0, x.stride(0), dt.data_ptr(), dt.stride(0), A.data_ptr(),
               B.data_ptr(), B.stride(0), C.data_ptr(), C.stride(0), D.data_ptr(), DTYPE_CODES[D.dtype], y.data_ptr(),
               n, H, P, B.shape[2], B.shape[1])
    cstate, cx, cw, cb = _conv_inputs()
    cy = torch.empty(cx.shape)
    raw_conv = (cstate.data_ptr(), 0, None, cx.data_ptr(), 0, cx.stride(0), cw.data_ptr(), 0, cb.data_ptr(), 0, 1,
                cy.data_ptr(), 1, cx.shape[1], cw.shape[1])
    lx, lw = torch.randn(1, 576), torch.randn(576, 576)  # SmolLM2-135M's q_proj, one row

    def linear_old_wrapper():  # what kernels/projection.py's _linear_native did before the op: allocate, call
        y = torch.empty(1, 576)
        lib.hl_gemv(lw.data_ptr(), 0, None, None, -1, lx.data_ptr(), 0, None, y.data_ptr(), 0, 1, 576, 576)
        return y

    op_ssd, op_conv = torch.ops.hybrid.ssd_step.default, torch.ops.hybrid.conv_step.default
    rows = {
        "ssd_step raw ctypes": lambda: lib.hl_ssd_step(*raw_ssd),
        "ssd_step custom op": lambda: op_ssd(state, x, dt, A, B, C, D, None),
        "ssd_step dispatch (kernels.ssd_step)": lambda: ssd.ssd_step(state, x, dt, A, B, C, D=D),
        "conv_step raw ctypes": lambda: lib.hl_conv_step(*raw_conv),
        "conv_step custom op": lambda: op_conv(cstate, cx, cw, cb, "silu", None),
        "conv_step dispatch (kernels.causal_conv1d_step)": lambda: conv1d.causal_conv1d_step(cstate, cx, cw, cb,
                                                                                              activation="silu"),
        "linear old wrapper (output + raw ctypes)": linear_old_wrapper,
        "linear custom op": lambda: torch.ops.hybrid.linear.default(lx, lw, None, None, None),
        "linear dispatch (kernels.linear)": lambda: projection.linear(lx, lw),
    }
    if old is not None:
        def old_ssd():
            assert old.supports_ssd_step(state, x, dt, A, B, C, D=D) is None
            old.ssd_step(state, x, dt, A, B, C, D=D)

        def old_conv():
            assert old.supports_conv_step(cstate, cx, cw, cb, activation="silu") is None
            old.conv_step(cstate, cx, cw, cb, activation="silu")

        def new_ssd():  # the same two calls the dispatch's checked wrapper makes, without the dispatch lookup
            assert new.supports_ssd_step(state, x, dt, A, B, C, D=D) is None
            new.ssd_step(state, x, dt, A, B, C, D=D)

        def new_conv():
            assert new.supports_conv_step(cstate, cx, cw, cb, activation="silu") is None
            new.conv_step(cstate, cx, cw, cb, activation="silu")

        def new_ssd_kernel():  # what the dispatch's checked wrapper calls now: supports (the op's check), kernel
            assert new.supports_ssd_step(state, x, dt, A, B, C, D=D) is None
            new.ssd_step.after_supports(state, x, dt, A, B, C, D=D)

        def new_conv_kernel():
            assert new.supports_conv_step(cstate, cx, cw, cb, activation="silu") is None
            new.conv_step.after_supports(cstate, cx, cw, cb, activation="silu")

        rows |= {"ssd_step old supports + ctypes wrapper": old_ssd, "ssd_step new supports + custom op": new_ssd,
                 "ssd_step new supports + kernel (dispatch)": new_ssd_kernel,
                 "conv_step old supports + ctypes wrapper": old_conv, "conv_step new supports + custom op": new_conv,
                 "conv_step new supports + kernel (dispatch)": new_conv_kernel}
    from hybrid.kernels.native import products
    rows["check_linear alone (what the linear dispatch added)"] = lambda: products.check_linear(lx, lw)
    with torch.inference_mode():
        for fn in rows.values():  # warm up every path before timing any
            fn()
        print(f"{'ns per call (1 thread)':<52}{'min':>9}{'median':>9}{'max':>9}")
        for name, fn in rows.items():
            lo, med, hi = _time(fn, args.calls, args.repeats)
            print(f"{name:<52}{lo:9.0f}{med:9.0f}{hi:9.0f}")


if __name__ == "__main__":
    main()
