"""Where a batched decode step's time goes: the whole-step native program's per-op times (program.c's times
array), summed per op kind and, for the products, per shape [N, K]; beside the engine's whole step() time (the
rest is Python: scheduling, the kept inputs, argmax, output).

    python -m scripts.probes.decode_step_split --recipes llama-small hybrid-1to7-small --batch 32 --context 16

Per-op times add a clock read per op and end each op's time where the caller finishes (a worker's last chunk
included: every op waits for its chunks)."""

from __future__ import annotations

import argparse
import collections
import ctypes
import statistics
import time

import torch
from hybrid.eval.decode_timing import decode_engine

from hybrid import recipes
from hybrid.layers import fused_decode
from hybrid.model import HybridLM

KINDS = {0: "rmsnorm", 1: "gemv", 2: "gated_up", 3: "qkv_rope", 4: "paged_attn", 5: "conv", 6: "mamba2_dt",
         7: "ssd_state_step", 8: "gated_rmsnorm", 9: "gemv_int4", 10: "gated_up_int4", 11: "qkv_rope_int4",
         12: "gemv_q", 13: "qkv_rope_q", 14: "gated_up_q", 16: "gdn", 17: "head_norm", 18: "gla"}


def label(op) -> str:
    k = KINDS.get(op.kind, str(op.kind))
    if op.kind == 1:
        return f"gemv [{op.i[4]}, {op.i[5]}]"
    if op.kind == 2:
        return f"gated_up [2x{op.i[4]}, {op.i[5]}]"
    if op.kind == 3:
        return f"qkv_rope [{(op.i[5] + 2 * op.i[6]) * op.i[7]}, {op.i[8]}]"
    return k


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipes", nargs="+", default=["llama-small", "hybrid-1to7-small"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=16)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for name in args.recipes:
        torch.manual_seed(0)
        model = HybridLM(recipes.get(name)).eval().to(getattr(torch, args.dtype))
        wbytes = torch.finfo(getattr(torch, args.dtype)).bits // 8
        engine = decode_engine(model, args.batch, args.context, steps=2 * args.steps + 4, compile=False, warmup=3)
        prog = fused_decode.whole_program(model, engine.runner.cache)
        ops = prog.whole
        n = len(ops.array)
        # untimed steps first (whole step() only), then the same count with per-op times
        plain = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            engine.step()
            plain.append((time.perf_counter() - t0) * 1e3)
        ops.times = (ctypes.c_double * n)()
        timed = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            engine.step()
            timed.append((time.perf_counter() - t0) * 1e3)
        per = [t / 1e3 / args.steps for t in ops.times]
        ops.times = None
        groups = collections.defaultdict(lambda: [0.0, 0])
        kinds = collections.defaultdict(float)
        for op, t in zip(ops.array, per, strict=True):
            groups[label(op)][0] += t
            groups[label(op)][1] += 1
            kinds[KINDS.get(op.kind, str(op.kind))] += t
        prog_ms = sum(per)
        step_med = statistics.median(timed)
        print(f"\n## {name}, batch {args.batch}, context {args.context}: step() min/med/max "
              f"{min(plain):.2f} / {statistics.median(plain):.2f} / {max(plain):.2f} ms untimed, "
              f"{min(timed):.2f} / {step_med:.2f} / {max(timed):.2f} with op times; program (sum of ops, mean) "
              f"{prog_ms:.2f} ms; outside the program {statistics.mean(timed) - prog_ms:.2f} ms")
        for k, t in sorted(kinds.items(), key=lambda kv: -kv[1]):
            print(f"  {k:16s} {t:8.2f} ms  {100 * t / prog_ms:5.1f}%")
        print("  by op/shape:")
        for g, (t, c) in sorted(groups.items(), key=lambda kv: -kv[1][0]):
            rate = ""
            if g.startswith(("gemv [", "gated_up [")):  # the weight bytes this shape reads a step, per second
                n, k = (int(v) for v in g[g.index("[") + 1:-1].replace("2x", "").split(", "))
                rate = f"  {(2 if g.startswith('gated') else 1) * n * k * wbytes * c / t / 1e6:6.1f} GB/s"
            print(f"    {g:40s} x{c:3d} {t:8.2f} ms  {t / c * 1e3:8.1f} us each{rate}")
        del engine


if __name__ == "__main__":
    main()
