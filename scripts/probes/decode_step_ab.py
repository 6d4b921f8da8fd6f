"""A/B of the native kernels on whole engine decode steps, in one process: the library built from a git revision's
kernels/native sources (A, default HEAD) against the working tree's (B), the same engine and program switching
between them every few steps, so a noisy host's drift falls on both alike. Prints each side's step min / median /
max (ms) per recipe, the per-round ratio of medians, and how many programs each side ran on the calling thread alone
(program.c's contention fallback: a side that tripped it times one thread for the next few programs).

    flock /tmp/bench.lock .venv/bin/python -m scripts.probes.decode_step_ab --recipes llama-small hybrid-1to7-small \\
        --batch 32 --context 16 --rounds 8 --steps 6
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import time

import torch
from hybrid.eval.decode_timing import decode_engine
from hybrid.kernels import native

from hybrid import recipes
from hybrid.layers import fused_decode
from hybrid.model import HybridLM

FILES = ("decode.c", "linear_attention.c", "program.c")


def rev_source(rev: str) -> str:
    return "\n".join(subprocess.run(["git", "show", f"{rev}:kernels/native/{f}"], capture_output=True, text=True,
                                    check=True).stdout for f in FILES)


def load(name: str, source: str, threads: int):
    lib, why = native.build(name, source, native.FLAGS, ("-lm", "-lpthread"))
    if lib is None:
        raise SystemExit(why)
    lib = native._declare(lib)
    lib.hl_program_solo_runs.restype = ctypes.c_int64
    lib.hl_set_threads(threads, native.SPIN)
    return lib


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipes", nargs="+", default=["llama-small", "hybrid-1to7-small"])
    ap.add_argument("--base", default="HEAD")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    libs = {"A": load("hybrid_decode_ab_base", rev_source(args.base), args.threads),
            "B": load("hybrid_decode", native.source(), args.threads)}
    for name in args.recipes:
        torch.manual_seed(0)
        model = HybridLM(recipes.get(name)).eval().to(getattr(torch, args.dtype))
        engine = decode_engine(model, args.batch, args.context, steps=args.rounds * (args.steps + 1) * 2 + 4,
                               compile=False, warmup=2)
        prog = fused_decode.whole_program(model, engine.runner.cache)
        times = {k: [] for k in libs}
        solo0 = {k: lib.hl_program_solo_runs() for k, lib in libs.items()}
        ratios = []
        for _ in range(args.rounds):
            med = {}
            for key, lib in libs.items():
                native._library = lambda lib=lib: (lib, None)  # what native.library() hands the program
                lib.hl_set_stream_prefetch(int(prog.stream))
                engine.step()  # untimed: the other library's pool and caches settle
                ts = []
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    engine.step()
                    ts.append((time.perf_counter() - t0) * 1e3)
                times[key] += ts
                med[key] = statistics.median(ts)
            ratios.append(med["A"] / med["B"])
        print(f"\n## {name} {args.dtype}, batch {args.batch}, context {args.context}: A = {args.base}, "
              "B = working tree")
        for key, ts in times.items():
            print(f"  {key}: step ms min/med/max {min(ts):.2f} / {statistics.median(ts):.2f} / {max(ts):.2f}  "
                  f"(programs run on one thread, contention: {libs[key].hl_program_solo_runs() - solo0[key]})")
        print("  A/B per round: " + " ".join(f"{r:.3f}" for r in ratios)
              + f"  (median {statistics.median(ratios):.3f})", flush=True)
        del engine


if __name__ == "__main__":
    main()
