"""What keeping freed host memory (:mod:`hybrid.kernels.host_memory`) buys a prefill, in one process.

Each recipe's forward (last-position logits) runs at each length with glibc's own behaviour (mmap for large
blocks, freed memory handed back) and with freed memory kept, the two taking turns run by run so the machine's
load falls on both alike. Per mode: wall ms min / median / max, the process's user and system CPU seconds per
forward (system time is the kernel zero-filling fresh pages: it does not depend on the other processes' load as
wall time does), minor page faults, and the resident set after the forward.

    python -m hybrid.eval.host_memory_bench --recipe hybrid-1to7-small llama-small --lengths 2048 8192 --threads 2
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

import torch
from tqdm import tqdm

from ..kernels import host_memory
from ..model import HybridLM
from ..recipes import get as get_recipe
from ..report import format_table
from .prefill_bench import set_threads

MODES = {"glibc": False, "keep": True}


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _one(fn, keep: bool) -> dict:
    host_memory.keep_freed_memory(keep, respect_env=False)
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    fn()
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    return {"wall": wall, "user": r1.ru_utime - r0.ru_utime, "sys": r1.ru_stime - r0.ru_stime,
            "faults": r1.ru_minflt - r0.ru_minflt, "rss_mb": _rss_mb()}


def measure(model: HybridLM, length: int, repeats: int) -> dict[str, list[dict]]:
    """``repeats`` forwards of one ``length``-token prompt per mode, the modes taking turns (one untimed
    forward first); the process is left keeping freed memory off, as glibc has it."""
    ids = torch.randint(0, model.config.vocab_size, (1, length))
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    with torch.inference_mode():
        model(ids, logits_to_keep=1)
        for _ in range(repeats):
            for mode, keep in MODES.items():
                runs[mode].append(_one(lambda: model(ids, logits_to_keep=1), keep))
    host_memory.keep_freed_memory(False, respect_env=False)
    return runs


def summarise(name: str, length: int, runs: dict[str, list[dict]]) -> list[dict]:
    rows = []
    base = statistics.median(r["wall"] for r in runs["glibc"])
    for mode, rs in runs.items():
        walls = sorted(r["wall"] * 1e3 for r in rs)
        med = statistics.median(walls)
        rows.append({"model": name, "tokens": length, "mode": mode,
                     "wall ms min/med/max": f"{walls[0]:.0f} / {med:.0f} / {walls[-1]:.0f}",
                     "user s": round(statistics.median(r["user"] for r in rs), 2),
                     "sys s": round(statistics.median(r["sys"] for r in rs), 2),
                     "faults": int(statistics.median(r["faults"] for r in rs)),
                     "rss MB": round(max(r["rss_mb"] for r in rs)),
                     "speed-up": round(base * 1e3 / med, 3)})
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", nargs="+", default=["hybrid-1to7-small"])
    p.add_argument("--lengths", nargs="+", type=int, default=[2048])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    if (why := host_memory.available()) is not None:
        raise SystemExit(f"host_memory_bench: {why}")
    if args.repeats < 1 or any(n < 1 for n in args.lengths):
        raise SystemExit("host_memory_bench: --repeats and every --lengths value must be >= 1")
    threads = set_threads(args.threads)
    torch.manual_seed(0)
    rows = []
    for name in tqdm(args.recipe, desc="recipes"):
        model = HybridLM(get_recipe(name)).eval()
        for n in args.lengths:
            rows += summarise(name, n, measure(model, n, args.repeats))
    print(f"threads {threads}; speed-up = glibc's median wall / this mode's")
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": threads, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
