"""Prefill or decode speed of two (or more) checkouts of this library, side by side on one machine: did a change
that should not alter behaviour (a refactor, a move) leave the speed where it was?

    python -m benchmarks.before_after --trees /path/to/before /path/to/after --rounds 4 --repeats 5
    python -m benchmarks.before_after --trees BEFORE AFTER --decode --batches 1 32 --dtypes float32 bfloat16 \
        --recipes llama-d512 mamba2-d512 hybrid-1to7-d512 /path/to/smollm2-folder

``--decode`` times whole engine decode steps instead: per model, dtype and batch size, ``B`` prompts of
``--context`` random tokens are prefilled (untimed, with a few untimed decode steps after), then each of
``--steps`` decode steps of all ``B`` rows is timed alone (``engine.step()``, the engine's own choice of decode
program; greedy). A ``--recipes`` entry holding a ``/`` is a checkpoint folder (``hybrid.from_pretrained``). The
engine is built with keyword settings every tree takes (``cache_bytes``, ``max_seqs``, ``max_batch_tokens``).

Each tree runs with its own interpreter (``TREE/.venv/bin/python`` unless ``--python`` names them) and ``-P``
(the tree's own ``hybrid`` is imported, never this one's); the trees take turns, round after round, so a slow
spell of a shared machine lands on both. Every run is a child process timing ``model(ids, logits_to_keep=1)``
at ``--length`` tokens for each recipe (fp32, seed-0 weights, ``--threads`` threads), a warm-up first. Each
child takes ``--lock`` (flock) so that no other cooperating benchmark runs beside it. The table gives tokens/s
per tree (median, min, max over rounds x repeats) and each tree's median and best over the first tree's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

from tqdm import tqdm

CHILD = r"""
import json, sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
import hybrid
from hybrid import recipes
L, reps, names = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
out = {}
for name in names:
    torch.manual_seed(0)
    model = hybrid.HybridLM(recipes.get(name)).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, L))
    with torch.inference_mode():
        model(ids, logits_to_keep=1)
        ts = []
        for _ in range(reps):
            t = time.perf_counter(); model(ids, logits_to_keep=1); ts.append(time.perf_counter() - t)
    out[name] = [L / t for t in ts]
print(json.dumps({"file": hybrid.__file__, "tok_s": out}))
"""

DECODE_CHILD = r"""
import json, sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
import hybrid
from hybrid import recipes
ctx, steps, dtypes, batches, names = (int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split(","),
                                      [int(b) for b in sys.argv[5].split(",")], sys.argv[6:])
out = {}
for name in names:
    torch.manual_seed(0)
    base = hybrid.from_pretrained(name) if "/" in name else hybrid.HybridLM(recipes.get(name))
    for dt in dtypes:
        model = base.to(getattr(torch, dt)).eval()
        for B in batches:
            engine = hybrid.Engine(model, cache_bytes=1 << 30, max_seqs=B, max_batch_tokens=4096)
            g = torch.Generator().manual_seed(1)
            warm = -(-B * ctx // 4096) + 4  # prefill steps, then untimed decode steps
            for _ in range(B):
                ids = torch.randint(0, model.config.vocab_size, (ctx,), generator=g).tolist()
                engine.add_request(ids, hybrid.SamplingParams(max_new_tokens=warm + steps + 2, ignore_eos=True))
            with torch.inference_mode():
                for _ in range(warm):
                    engine.step()
                ts = []
                for _ in range(steps):
                    t = time.perf_counter(); engine.step(); ts.append(time.perf_counter() - t)
            out[f"{name.rstrip('/').rpartition('/')[2]} {dt} b{B}"] = [B / t for t in ts]
    del base
print(json.dumps({"file": hybrid.__file__, "tok_s": out}))
"""


def run_tree(python: str, tree: Path, args) -> dict:
    """One child's tokens/s per recipe, checked to come from ``tree``'s own ``hybrid``."""
    if args.decode:
        cmd = [python, "-P", "-c", DECODE_CHILD, str(args.threads), str(args.context), str(args.steps),
               ",".join(args.dtypes), ",".join(map(str, args.batches)), *args.recipes]
    else:
        cmd = [python, "-P", "-c", CHILD, str(args.threads), str(args.length), str(args.repeats), *args.recipes]
    if args.lock:
        cmd = ["flock", args.lock, *cmd]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd="/", timeout=3600,
                         env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": str(args.threads)})
    if res.returncode != 0:
        raise SystemExit(f"{tree}: the timing child failed:\n{res.stderr[-1500:]}")
    result = json.loads(res.stdout.strip().splitlines()[-1])
    if not Path(result["file"]).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"{tree}: its interpreter {python} imports hybrid from {result['file']}, not from the tree: "
                         "give each tree's own venv with --python")
    return result["tok_s"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.before_after", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", nargs="+", type=Path, required=True, help="checkouts; the first is the reference")
    ap.add_argument("--python", nargs="*", default=None, help="each tree's interpreter (default TREE/.venv/bin/python)")
    ap.add_argument("--recipes", nargs="+", default=["llama-small", "mamba2-small", "hybrid-1to7-small"])
    ap.add_argument("--length", type=int, default=2048, help="prompt tokens")
    ap.add_argument("--repeats", type=int, default=5, help="timed forwards per child")
    ap.add_argument("--rounds", type=int, default=4, help="turns each tree takes")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode", action="store_true", help="time engine decode steps instead of prefill")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32], help="decode: sequences a step")
    ap.add_argument("--dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16"], help="decode")
    ap.add_argument("--context", type=int, default=128, help="decode: prompt tokens per sequence")
    ap.add_argument("--steps", type=int, default=32, help="decode: timed steps per child and row")
    ap.add_argument("--lock", default="/tmp/cpu.lock", help="flock file each child holds ('' for none)")
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    pythons = args.python or [str(t / ".venv" / "bin" / "python") for t in args.trees]
    if len(pythons) != len(args.trees):
        raise SystemExit(f"--python names {len(pythons)} interpreters for {len(args.trees)} trees")
    for t, py in zip(args.trees, pythons, strict=True):
        if not Path(py).is_file():
            raise SystemExit(f"{t}: no interpreter at {py} (set the tree up, or pass --python)")
    rates: dict[tuple[int, str], list[float]] = {}
    for _ in tqdm(range(args.rounds), desc="rounds", unit="round"):
        for i, (t, py) in enumerate(zip(args.trees, pythons, strict=True)):  # by position: a tree may come twice
            for r, xs in run_tree(py, t, args).items():
                rates.setdefault((i, r), []).extend(xs)
    rows = []
    for r in dict.fromkeys(name for _, name in rates):
        ref = rates[(0, r)]
        for i, t in enumerate(args.trees):
            xs = rates[(i, r)]
            rows.append({"model": r, "tree": str(t), "tok/s_med": round(statistics.median(xs), 1),
                         "min": round(min(xs), 1), "max": round(max(xs), 1),
                         "med/ref": round(statistics.median(xs) / statistics.median(ref), 3),
                         "best/ref": round(max(xs) / max(ref), 3)})
    from hybrid.report import format_table

    if args.decode:
        what = (f"decode steps at {args.context}-token prompts, batches {args.batches}, {args.threads} threads; "
                f"{args.rounds} rounds x {args.steps} steps per tree (tok/s = rows / step time)")
    else:
        what = (f"prefill {args.length} tokens, fp32, {args.threads} threads; {args.rounds} rounds x {args.repeats} "
                "repeats")
    print(what + " per tree\n" + format_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"date": datetime.now(timezone.utc).isoformat(timespec="minutes"),
                                               "command": " ".join(sys.argv), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
