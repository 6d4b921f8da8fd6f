"""Prefill of long prompts (32K, 64K tokens) through the engine: speed and peak memory, each in a fresh process.
(Plain-forward prefill sweeps at shorter lengths are ``hybrid bench``.)

A prompt longer than one forward should hold is prefilled by :class:`hybrid.Engine` in chunks of ``--chunk``
tokens (its ``max_batch_tokens``): the Mamba layers' temporaries are sized by the chunk and their states stay
constant, the attention K/V cache grows by its bytes per token (from the specs). This runs each (recipe,
length) in its own process, so the peak resident memory it reports (``ru_maxrss``) belongs to that prompt
alone, and sets it beside what the model and the cache must hold:

    peak RSS  ~=  process baseline (torch, the weights)  +  cache (specs)  +  the prefill's working set

    python -m benchmarks.prefill --lengths 32768 65536 --output out/long_prompts

The table's ``work MB`` column (peak minus baseline minus cache) is the prefill's own working set: bounded
memory would keep it flat from 32K to 64K. It is not flat where attention layers run: a chunk on top of a
long cache gathers that sequence's K/V history and SDPA takes a dense [chunk, context] mask, temporaries
that grow with the context (measured: see the README's long-prompt table). ``--forward`` times one
``model(ids)`` forward instead (where it fits). JSON rows and a PNG plot (peak memory against prompt length,
one line per recipe) go to ``--output``.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
from hybrid.eval.timing import engine_prefill_fn, set_threads
from hybrid.kernels import host_memory
from hybrid.recipes import get as get_recipe
from tqdm import tqdm

from hybrid.model import HybridLM
from hybrid.report import format_table

from .common import REPO, add_threads

RECIPES = ["hybrid-1to7-small", "jamba-small", "jamba-moe-small", "nemotronh-small", "samba-small"]


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def measure(recipe: str, seq_len: int, *, chunk: int, dtype: torch.dtype, forward: bool) -> dict:
    """One prompt in this process (call it in a fresh one): seconds, tokens/s, and memory in MB."""
    torch.manual_seed(0)
    model = HybridLM(get_recipe(recipe)).to(dtype).eval()
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    cache = model.cache_spec().bytes_per_sequence(seq_len) / 2**20  # a sliding window holds only its tokens
    with torch.inference_mode():
        if forward:
            ids = torch.randint(0, model.config.vocab_size, (1, seq_len))
            model(ids[:, :256], logits_to_keep=1)  # one-time setup at a short length

            def run() -> None:
                model(ids, logits_to_keep=1)
        else:
            engine_prefill_fn(model, 256, chunk=chunk)()  # one-time setup at a short length
            run = engine_prefill_fn(model, seq_len, chunk=chunk)
        base = _rss_mb()
        t0 = time.perf_counter()
        run()
        seconds = time.perf_counter() - t0
    peak = _rss_mb()
    return {"recipe": recipe, "seq_len": seq_len, "path": "forward" if forward else f"engine, chunks of {chunk}",
            "dtype": str(dtype).removeprefix("torch."), "seconds": round(seconds, 2),
            "tokens_per_s": round(seq_len / seconds, 1), "weights_MB": round(weights),
            "cache_MB": round(cache, 1), "baseline_MB": round(base), "peak_rss_MB": round(peak),
            "work_MB": round(peak - base - cache)}


def _child(args) -> int:
    set_threads(args.threads)
    host_memory.keep_freed_memory()  # the CLI's and the benchmarks' setting: the peak is the high-water mark
    row = measure(args.child[0], int(args.child[1]), chunk=args.chunk, dtype=getattr(torch, args.dtype),
                  forward=args.forward)
    row["threads"] = torch.get_num_threads()
    print(json.dumps(row))
    return 0


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for recipe in dict.fromkeys(r["recipe"] for r in rows):
        rs = sorted((r for r in rows if r["recipe"] == recipe), key=lambda r: r["seq_len"])
        xs = [r["seq_len"] / 1024 for r in rs]
        line, = ax.plot(xs, [r["peak_rss_MB"] for r in rs], marker="o", label=f"{recipe}: peak RSS")
        ax.plot(xs, [r["baseline_MB"] + r["cache_MB"] for r in rs], ls="--", color=line.get_color(),
                label=f"{recipe}: baseline + cache")
    ax.set_xlabel("prompt length (K tokens)")
    ax.set_ylabel("memory (MB)")
    ax.set_title(f"Long prompts: peak memory per prompt\n({rows[0]['path']}, {rows[0]['dtype']})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", nargs="+", default=RECIPES)
    ap.add_argument("--lengths", type=int, nargs="+", default=[32768, 65536])
    ap.add_argument("--chunk", type=int, default=2048, help="the engine's max_batch_tokens (prefill chunk)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    add_threads(ap, 0)
    ap.add_argument("--forward", action="store_true", help="one model(ids) forward instead of the engine")
    ap.add_argument("--output", type=Path, default=None, help="folder for long_prompts.json / .png")
    ap.add_argument("--child", nargs=2, metavar=("RECIPE", "LENGTH"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return _child(args)
    if min(args.lengths) < 1 or args.chunk < 1:
        ap.error("--lengths and --chunk must be >= 1")
    for r in args.recipe:
        get_recipe(r)  # unknown names fail here, listing the known ones, before any process starts
    rows = []
    todo = [(r, L) for r in args.recipe for L in sorted(args.lengths)]
    for recipe, L in tqdm(todo, desc="long prompts", unit="prompt"):
        cmd = [sys.executable, "-m", "benchmarks.prefill", "--child", recipe, str(L), "--chunk",
               str(args.chunk), "--dtype", args.dtype, "--threads", str(args.threads)]
        res = subprocess.run(cmd + (["--forward"] if args.forward else []), capture_output=True, text=True,
                             cwd=REPO)  # the child imports benchmarks from the repo root
        if res.returncode != 0:
            print(f"# {recipe} at {L}: failed: {res.stderr.strip()[-400:]}", file=sys.stderr)
            continue
        rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
    if not rows:
        return 1
    print(f"# one prompt per process, {rows[0]['threads']} threads, {args.dtype}, {rows[0]['path']}; MB = MiB; "
          "cache = K/V and states from the specs; work = peak - baseline - cache")
    print(format_table([{k: v for k, v in r.items() if k not in ("path", "dtype", "threads")} for r in rows]))
    if args.output:
        args.output.mkdir(parents=True, exist_ok=True)
        (args.output / "long_prompts.json").write_text(json.dumps(rows, indent=1) + "\n")
        plot(rows, args.output / "long_prompts.png")
        print(f"wrote {args.output}/long_prompts.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
