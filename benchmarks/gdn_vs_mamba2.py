"""Gated DeltaNet against Mamba-2 on this CPU, in one process: the prefill FLOP-efficiency of ``gdn-small``
against ``mamba2-small`` (issue 27's goal: >= 0.8x, fp32 and bf16) and the one-token decode step of the two
mixers' state-update ops at equal state bytes (goal: GDN within 1.5x of Mamba-2).

    python -m benchmarks.gdn_vs_mamba2 --lengths 2048 8192 --dtypes fp32 bf16 --threads 2
    python -m benchmarks.gdn_vs_mamba2 --lengths 32768 --dtypes fp32 --long-from 16384 --decode-batches

Lengths from ``--long-from`` on take ``--long-repeats`` repeats after ``--long-warmup`` warm-up turns (default
1 and 0: a 32K fp32 prefill of either model takes over a minute on 2 cores, bf16 several times that where the
CPU has no native bf16).

Prefill: ``model(ids, logits_to_keep=1)`` timed as ``hybrid bench`` does (min / median / max), GFLOP/s against
each model's declared ``flops_per_token`` (every layer class declares its own). The two models take turns
repeat by repeat, so a change in the machine's load falls on both. Decode: ``kernels.gated_delta_step`` on a
``[n, 12, 128, 128]`` state against ``kernels.ssd_step`` on ``[n, 24, 64, 128]`` (the small recipes' shapes,
the same fp32 bytes), each through dispatch (whichever backend it picks here).
"""

from __future__ import annotations

import argparse
import statistics

import torch
from hybrid.eval.timing import prefill_flops
from hybrid.kernels import host_memory
from hybrid.recipes import get as get_recipe

from hybrid import kernels
from hybrid.model import HybridLM

from .common import add_json, add_threads, cpu_flags, interleaved_seconds, record, set_threads

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@torch.inference_mode()
def prefill_rows(lengths: list[int], dtypes: list[str], repeats: int, *, long_from: int | None = None,
                 long_repeats: int = 1, long_warmup: int = 0) -> list[dict]:
    rows = []
    for dname in dtypes:
        models = {}
        for name in ("gdn-small", "mamba2-small"):
            torch.manual_seed(0)
            models[name] = HybridLM(get_recipe(name)).to(DTYPES[dname]).eval()
        for L in lengths:
            ids = torch.randint(0, 1000, (1, L))
            fns = {n: (lambda m=m, ids=ids: m(ids, logits_to_keep=1)) for n, m in models.items()}
            long = long_from is not None and L >= long_from
            times = interleaved_seconds(fns, warmup=long_warmup if long else 1,
                                        repeats=long_repeats if long else repeats)
            gfs = {}
            for n, ts in times.items():
                flops = prefill_flops(models[n], L, 1, "last")
                med = statistics.median(ts)
                gfs[n] = flops / med / 1e9
                rows.append({"kind": "prefill", "model": n, "dtype": dname, "seq_len": L,
                             "min_s": round(min(ts), 4), "median_s": round(med, 4), "max_s": round(max(ts), 4),
                             "tokens_per_s": round(L / med, 1), "GFLOP/s": round(gfs[n], 2)})
            rows.append({"kind": "prefill_ratio", "dtype": dname, "seq_len": L,
                         "gdn/mamba2 GFLOP/s": round(gfs["gdn-small"] / gfs["mamba2-small"], 3)})
            print(*rows[-3:], sep="\n", flush=True)
    return rows


def _step_fns(n: int, inner: int) -> dict:
    """The two step ops at the small recipes' shapes for a batch of n, each run ``inner`` times a call."""
    torch.manual_seed(0)
    H, Hk, K, V = 12, 6, 128, 128
    gstate = torch.randn(n, H, K, V) * 0.1
    q = torch.nn.functional.normalize(torch.randn(n, Hk, K), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(n, Hk, K), dim=-1)
    v, g, beta = torch.randn(n, H, V), -torch.rand(n, H) * 0.1, torch.rand(n, H)
    mh, P, N = 24, 64, 128
    mstate = torch.randn(n, mh, P, N) * 0.1
    x, dt, A = torch.randn(n, mh, P), torch.rand(n, mh) * 0.1, -torch.rand(mh)
    B, C, D = torch.randn(n, 1, N), torch.randn(n, 1, N), torch.randn(mh)

    def gdn():
        for _ in range(inner):
            kernels.gated_delta_step(gstate, q, k, v, g, beta)

    def mamba():
        for _ in range(inner):
            kernels.ssd_step(mstate, x, dt, A, B, C, D=D)

    return {"gdn": gdn, "mamba2": mamba, "state_MB": gstate.numel() * 4 / 2**20}


@torch.inference_mode()
def decode_rows(batches: list[int], repeats: int, inner: int = 50) -> list[dict]:
    rows = []
    for n in batches:
        fns = _step_fns(n, inner)
        state_mb = fns.pop("state_MB")
        times = interleaved_seconds(fns, warmup=2, repeats=repeats)
        us = {k: [t / inner * 1e6 for t in ts] for k, ts in times.items()}
        row = {"kind": "decode_step", "batch": n, "state_MB": round(state_mb, 2)}
        for k, ts in us.items():
            row[f"{k}_us(min/med/max)"] = f"{min(ts):.1f}/{statistics.median(ts):.1f}/{max(ts):.1f}"
        row["gdn/mamba2"] = round(statistics.median(us["gdn"]) / statistics.median(us["mamba2"]), 3)
        print(row, flush=True)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768])
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--long-from", type=int, default=16384,
                   help="prefill lengths from this one on take --long-repeats / --long-warmup instead")
    p.add_argument("--long-repeats", type=int, default=1)
    p.add_argument("--long-warmup", type=int, default=0)
    p.add_argument("--decode-batches", type=int, nargs="*", default=[1, 8])
    p.add_argument("--no-prefill", action="store_true", help="only the decode step")
    add_threads(p, 2)
    add_json(p)
    args = p.parse_args(argv)
    threads = set_threads(args.threads)
    host_memory.keep_freed_memory()  # the CLI's and the other benchmarks' setting: large temporaries reuse memory
    print(f"threads={threads} cpu_flags={' '.join(cpu_flags())} torch={torch.__version__}", flush=True)
    rows = decode_rows(args.decode_batches, args.repeats) if args.decode_batches else []
    if not args.no_prefill:
        rows += prefill_rows(args.lengths, args.dtypes, args.repeats, long_from=args.long_from,
                             long_repeats=args.long_repeats, long_warmup=args.long_warmup)
    record(args.json, "gdn_vs_mamba2", rows, threads=threads)


if __name__ == "__main__":
    main()
