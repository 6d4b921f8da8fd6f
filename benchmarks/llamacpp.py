"""Prefill speed against llama.cpp on the same weights: our forward and our engine against ``llama-bench``.

For each model (``llama`` / ``mamba2`` / ``bamba``: the ``*-d512`` recipes, d_model 512 x 8 blocks, vocab
32000, fp32) this builds the model with seeded random weights, exports it (``save_pretrained(format=...)``),
converts the folder to an fp32 GGUF with llama.cpp's own converter (``scripts/serving/gguf_convert.py``:
``convert_hf_to_gguf``'s model classes, a token-free vocabulary so ids pass through) and checks that the two
compute the same thing — greedy continuations of three prompts through our engine and through libllama
(``scripts/serving/check.py``'s check, ``llama_greedy``) must be identical token for token, with the
embedding and head scaled up as that check does so next-token logits are far apart and an arithmetic
difference shows. A model that fails the check is not timed: a speed comparison of different models is
worthless.

Then, under the benchmark lock (``flock(2)`` on ``/tmp/bench.lock``, the lock ``flock(1)`` takes) and with
the same thread count on both sides, at each prompt length it takes turns: our forward
(``model(ids, logits_to_keep=1)``: the last position's logits, what a prompt needs), a prompt through
``hybrid.Engine`` (chunks of ``--chunk`` tokens, as the engine prefills long prompts), then one
``llama-bench -p L -n 0 -r 1`` (its defaults otherwise: batch 2048, micro-batch 512, f16 KV cache, flash
attention auto; it runs its own warm-up before the timed run and times prompt processing only, the model
load apart), repeated ``--repeats`` times so a change in the machine's load falls on all three alike.
It prints one table (min / median / max tokens/s on each side, the ratio of medians ours / llama.cpp, and
whether the issue's goal, >= 1x for Mamba-2 and the hybrid, is met) and writes it as JSON with a bar chart.

    python -m benchmarks.llamacpp --llama-cpp /work/scratch/llama.cpp \\
        --llama-bench /work/scratch/llama-bench-build/bin/llama-bench --lengths 2048 8192 --threads 2

The llama.cpp tree comes from ``--llama-cpp DIR`` or ``$LLAMA_CPP_DIR`` and is never downloaded
(``scripts/check_serving.sh`` fetches and builds one); ``llama-bench`` from ``--llama-bench`` / ``$LLAMA_BENCH``
or the tree's ``build/bin``; ``llama_greedy`` from ``--llama-greedy`` or the tree's ``build/bin`` (where
check_serving.sh compiles it). Without a tree the benchmark is skipped with a message.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

import torch
from hybrid.eval.timing import engine_prefill_fn, set_threads
from hybrid.kernels import host_memory
from hybrid.recipes import get as get_recipe
from tqdm import tqdm

from hybrid.model import HybridLM
from hybrid.pretrained import save_pretrained

# name -> (recipe, export format llama.cpp converts): the three models (Llama GQA 8/2, Mamba-2, a
# Bamba-like 7:1 hybrid with RoPE attention, which llama.cpp rotates only in Bamba checkpoints)
MODELS = {"llama": ("llama-d512", "llama"), "mamba2": ("mamba2-d512", "mamba2"),
          "bamba": ("hybrid-1to7-d512", "bamba")}
# the models the goal (ours >= llama.cpp, forward and engine) is stated for
GOAL_MODELS = ("mamba2", "bamba")
GOAL_RATIO = 1.0
PATHS = ("forward", "engine")
SERVING = Path(__file__).resolve().parents[1] / "scripts" / "serving"
LLAMA_BENCH_TIMEOUT_S = 1800


class Skip(Exception):
    """No llama.cpp tree was named: the benchmark cannot run here (not an error)."""


# ---- finding llama.cpp ------------------------------------------------------------------------------

def find_llama_cpp(arg: str | None) -> Path:
    """The llama.cpp source tree: ``arg`` or ``$LLAMA_CPP_DIR``. :class:`Skip` when neither is given;
    SystemExit when the named folder is not a llama.cpp tree."""
    given = arg or os.environ.get("LLAMA_CPP_DIR")
    if not given:
        raise Skip("no llama.cpp tree given: pass --llama-cpp DIR or set LLAMA_CPP_DIR to a llama.cpp source tree "
                   "(scripts/check_serving.sh fetches and builds one under $SCRATCH/llama.cpp); nothing downloaded")
    tree = Path(given)
    if not (tree / "convert_hf_to_gguf.py").is_file():
        raise SystemExit(f"{tree} is not a llama.cpp source tree (no convert_hf_to_gguf.py in it): pass --llama-cpp "
                         "DIR / LLAMA_CPP_DIR naming the folder that holds convert_hf_to_gguf.py and gguf-py/")
    return tree


def find_tool(tree: Path, name: str, arg: str | None, env: str | None, build_hint: str) -> Path:
    """A built llama.cpp executable: ``arg``, else ``$env``, else ``tree/build/bin/name``; SystemExit with
    ``build_hint`` when it is not there."""
    given = arg or (os.environ.get(env) if env else None)
    path = Path(given) if given else tree / "build" / "bin" / name
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise SystemExit(f"no {name} executable at {path}: {build_hint}")
    return path


def bench_build_hint(tree: Path) -> str:
    return (f"build it (nice -n 19 cmake -S {tree} -B {tree}/build-bench -DCMAKE_BUILD_TYPE=Release "
            "-DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TOOLS=ON && nice -n 19 cmake --build "
            f"{tree}/build-bench --target llama-bench -j2) and pass --llama-bench PATH or set LLAMA_BENCH")


# ---- llama-bench's output -----------------------------------------------------------------------------

def parse_llama_bench(text: str) -> dict[int, list[float]]:
    """Seconds of every timed prompt-processing run in ``llama-bench -o json`` output, by prompt length
    (tests with generated tokens, ``n_gen`` > 0, are left out: they time decode)."""
    try:
        tests = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"llama-bench did not print JSON (run it with -o json): {e}; output began "
                         f"{text[:200]!r}") from e
    out: dict[int, list[float]] = {}
    for t in tests:
        if t.get("n_gen", 0) == 0 and t.get("n_prompt", 0) > 0:
            out.setdefault(int(t["n_prompt"]), []).extend(ns / 1e9 for ns in t["samples_ns"])
    if not out:
        raise ValueError("llama-bench's JSON holds no prompt-processing test (n_prompt > 0, n_gen 0)")
    return out


def llama_bench_settings(text: str) -> dict:
    """The settings llama-bench ran with (the same in every test of one call): what the table states."""
    keys = ("build_commit", "cpu_info", "model_type", "n_batch", "n_ubatch", "n_threads", "type_k", "type_v",
            "flash_attn", "repack")
    first = json.loads(text)[0]
    return {k: first.get(k) for k in keys}


def llama_bench_cmd(llama_bench: Path, gguf: Path, seq_len: int, threads: int) -> list[str]:
    return [str(llama_bench), "-m", str(gguf), "-p", str(seq_len), "-n", "0", "-t", str(threads), "-r", "1",
            "-o", "json"]


def run_llama_bench(cmd: list[str]) -> str:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=LLAMA_BENCH_TIMEOUT_S)
    if res.returncode != 0:
        tail = "\n".join(res.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"llama-bench failed (exit {res.returncode}): {' '.join(cmd)}\n{tail}")
    return res.stdout


# ---- the comparison -------------------------------------------------------------------------------------

def tokens_per_s(seq_len: int, seconds: list[float]) -> dict:
    """min / median / max tokens/s of runs of a ``seq_len``-token prompt (min from the slowest run)."""
    rates = sorted(seq_len / s for s in seconds)
    return {"min": round(rates[0], 1), "median": round(statistics.median(rates), 1), "max": round(rates[-1], 1),
            "runs": len(rates)}


def comparison_row(model: str, seq_len: int, seconds: dict[str, list[float]]) -> dict:
    """One table row: tokens/s of our forward, our engine and llama.cpp, the ratio of each of ours to
    llama.cpp (medians), and whether the goal holds (None for a model the goal is not stated for)."""
    row: dict = {"model": model, "seq_len": seq_len}
    for side in (*PATHS, "llama.cpp"):
        if side in seconds:
            row[side] = tokens_per_s(seq_len, seconds[side])
    theirs = row["llama.cpp"]["median"]
    for path in PATHS:
        if path in row:
            row[f"{path}_ratio"] = round(row[path]["median"] / theirs, 3)
    ratios = [row[f"{p}_ratio"] for p in PATHS if f"{p}_ratio" in row]
    row["goal"] = f">= {GOAL_RATIO:g}x" if model in GOAL_MODELS else None
    row["met"] = all(r >= GOAL_RATIO for r in ratios) if model in GOAL_MODELS else None
    return row


def _rate(r: dict | None) -> str:
    return "—" if r is None else f"{r['median']:.0f} ({r['min']:.0f}-{r['max']:.0f})"


def markdown(rows: list[dict]) -> str:
    out = ["| model | tokens | ours forward tok/s | ours engine tok/s | llama.cpp tok/s | forward / llama.cpp | "
           "engine / llama.cpp | goal >= 1x |",
           "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        met = "—" if r["met"] is None else ("met" if r["met"] else "**not met**")
        ratios = [f"{r[f'{p}_ratio']:.2f}x" if f"{p}_ratio" in r else "—" for p in PATHS]
        out.append(f"| {r['model']} | {r['seq_len']} | {_rate(r.get('forward'))} | {_rate(r.get('engine'))} | "
                   f"{_rate(r.get('llama.cpp'))} | {ratios[0]} | {ratios[1]} | {met} |")
    return "\n".join(out)


def plot(rows: list[dict], path: Path, title: str) -> Path:
    """Grouped bars, one group per (model, length): median tokens/s of our forward, our engine and
    llama.cpp, whiskers from the slowest to the fastest run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sides = [(s, lbl) for s, lbl in (("forward", "ours: forward"), ("engine", "ours: engine"),
                                     ("llama.cpp", "llama.cpp (llama-bench)")) if any(s in r for r in rows)]
    width = 0.8 / len(sides)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(rows)), 4.5))
    for i, (side, label) in enumerate(sides):
        xs, med, lo, hi = [], [], [], []
        for j, r in enumerate(rows):
            if side in r:
                xs.append(j + (i - (len(sides) - 1) / 2) * width)
                m = r[side]
                med.append(m["median"])
                lo.append(m["median"] - m["min"])
                hi.append(m["max"] - m["median"])
        ax.bar(xs, med, width, yerr=[lo, hi], capsize=3, label=label)
    ax.set_xticks(range(len(rows)), [f"{r['model']}\n{r['seq_len']} tokens" for r in rows])
    ax.set_ylabel("prefill tokens/s (median; whiskers min-max)")
    ax.set_xlabel("model, prompt length")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_report(rows: list[dict], settings: dict, out_dir: Path) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    js = out_dir / "llamacpp_bench.json"
    js.write_text(json.dumps({"settings": settings, "rows": rows}, indent=1) + "\n")
    title = (f"Prefill, {settings.get('dtype', 'float32')}, {settings.get('threads')} threads: hybrid-lm vs "
             "llama.cpp, same weights")
    return js, plot(rows, out_dir / "llamacpp_bench.png", title)


# ---- one model: build, export, convert, check ------------------------------------------------------------

def _serving_modules():
    """scripts/serving's check (greedy tokens against libllama) and families (the model scaling it uses)."""
    if not (SERVING / "check.py").is_file():
        raise SystemExit(f"scripts/serving not found at {SERVING}: run from a source checkout (pip install -e .)")
    if str(SERVING) not in sys.path:
        sys.path.insert(0, str(SERVING))
    import check
    import families
    return check, families


def prepare(name: str, tree: Path, llama_greedy: Path, work: Path, seed: int = 0,
            dtype: torch.dtype = torch.float32) -> tuple[HybridLM, Path, dict]:
    """Our model, its GGUF, and the same-model check: greedy tokens ours vs llama.cpp's, in fp32. For
    ``dtype`` bf16 the checked fp32 weights are then rounded to bf16 on both sides (our ``model.to(bf16)``, the
    converter's ``--outtype bf16``) and the same greedy check runs again; it is reported, not required, since
    the two round their activations differently (fp32 identity says the graphs are the same)."""
    check, families = _serving_modules()
    recipe, fmt = MODELS[name]
    cfg = get_recipe(recipe)
    model = families.build(families.Family(name, recipe, cfg, {"llama.cpp": fmt}), seed=seed)
    mdir = work / name
    export = mdir / f"export-{fmt}"
    save_pretrained(model, export, format=fmt)
    ids = check.prompts(cfg.vocab_size, seed)
    import hybrid
    ours = hybrid.generate(model, ids, max_new_tokens=check.N_NEW, ignore_eos=True)
    args = SimpleNamespace(llama_cpp=tree, llama_greedy=llama_greedy)
    res = check.llama_cpp_row(args, export, ids, mdir)  # converts to mdir/model-f32.gguf, then greedy tokens
    same = bool(res.get("serves")) and res.get("tokens") == ours
    verdict = {"recipe": recipe, "format": fmt, "prompt_lengths": list(check.PROMPT_LENGTHS), "new_tokens": check.N_NEW,
               "tokens_identical": same, "error": res.get("error"),
               "divergence": check.first_divergence(ours, res["tokens"]) if res.get("serves") else None}
    if dtype == torch.float32 or not same:  # a model that fails the fp32 check is not timed at all
        return model, mdir / "model-f32.gguf", verdict
    model = model.to(dtype)
    res16 = check.llama_cpp_row(args, export, ids, mdir, outtype="bf16")  # converts to mdir/model-bf16.gguf
    if not res16.get("serves"):
        raise RuntimeError(f"the bf16 GGUF of {export} does not run in llama.cpp: {res16.get('error')}")
    ours16 = hybrid.generate(model, ids, max_new_tokens=check.N_NEW, ignore_eos=True)
    verdict["bf16_tokens_identical"] = res16["tokens"] == ours16
    verdict["bf16_divergence"] = check.first_divergence(ours16, res16["tokens"])
    return model, mdir / "model-bf16.gguf", verdict


# ---- timing ----------------------------------------------------------------------------------------

def take_turns(fns: dict[str, Callable[[], float]], warmup: dict[str, int], repeats: int,
               progress: bool = True, desc: str = "") -> dict[str, list[float]]:
    """Seconds of ``repeats`` runs of each fn (each returns the seconds it measured), the fns taking turns
    run by run after ``warmup[name]`` untimed runs of each."""
    for name, fn in fns.items():
        for _ in range(warmup.get(name, 0)):
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in tqdm(range(repeats), desc=desc, unit="turn", disable=not progress, leave=False):
        for k, fn in fns.items():
            times[k].append(fn())
    return times


def _timed(fn: Callable[[], object]) -> Callable[[], float]:
    def run() -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    return run


def time_model(model: HybridLM, gguf: Path, llama_bench: Path, seq_len: int, *, threads: int, repeats: int,
               warmup: int, chunk: int, paths: tuple[str, ...], settings: dict, progress: bool) -> dict:
    ids = torch.randint(0, model.config.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(seq_len))

    @torch.inference_mode()
    def forward() -> None:
        model(ids, logits_to_keep=1)

    cmd = llama_bench_cmd(llama_bench, gguf, seq_len, threads)

    def llama_cpp() -> float:
        text = run_llama_bench(cmd)
        settings.setdefault("llama_bench", llama_bench_settings(text))
        return parse_llama_bench(text)[seq_len][0]

    fns: dict[str, Callable[[], float]] = {}
    if "forward" in paths:
        fns["forward"] = _timed(forward)
    if "engine" in paths:
        fns["engine"] = _timed(engine_prefill_fn(model, seq_len, chunk=chunk))
    fns["llama.cpp"] = llama_cpp
    # llama-bench runs its own warm-up inside every call, so only ours get warm-up turns here
    return take_turns(fns, {p: warmup for p in PATHS}, repeats, progress, desc=f"{seq_len} tokens")


def _load() -> list[float] | None:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def run(names: list[str], lengths: list[int], *, tree: Path, llama_bench: Path, llama_greedy: Path, work: Path,
        threads: int, repeats: int, warmup: int, chunk: int, paths: tuple[str, ...], lock: str | None,
        progress: bool = True, dtype: torch.dtype = torch.float32) -> tuple[list[dict], dict]:
    from hybrid.eval.tradeoff import timing_lock

    threads = set_threads(threads)
    settings: dict = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "threads": threads,
                      "dtype": str(dtype).removeprefix("torch."), "repeats": repeats, "warmup": warmup,
                      "engine_chunk": chunk,
                      "lengths": lengths, "cpu": platform.processor() or platform.machine(),
                      "torch": torch.__version__, "llama_cpp_tree": str(tree), "llama_bench_path": str(llama_bench),
                      "lock": lock, "checks": {}}
    prepared = {}
    for name in tqdm(names, desc="export, convert, check", disable=not progress):
        model, gguf, verdict = prepare(name, tree, llama_greedy, work, dtype=dtype)
        settings["checks"][name] = verdict
        if verdict["tokens_identical"]:
            prepared[name] = (model, gguf)
        else:
            print(f"{name}: not timed — llama.cpp's GGUF does not compute what our model does "
                  f"({verdict['divergence'] or verdict['error']})", file=sys.stderr)
    rows = []
    with timing_lock(lock, settings, progress):
        settings["load_before"] = _load()
        for name, (model, gguf) in prepared.items():
            for L in sorted(lengths):
                secs = time_model(model, gguf, llama_bench, L, threads=threads, repeats=repeats, warmup=warmup,
                                  chunk=chunk, paths=paths, settings=settings, progress=progress)
                rows.append({**comparison_row(name, L, secs), "seconds": {k: [round(s, 4) for s in v]
                                                                          for k, v in secs.items()}})
        settings["load_after"] = _load()
    return rows, settings


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp", help="llama.cpp source tree (default: $LLAMA_CPP_DIR)")
    ap.add_argument("--llama-bench", help="llama-bench executable (default: $LLAMA_BENCH, then TREE/build/bin)")
    ap.add_argument("--llama-greedy", help="llama_greedy executable (default: TREE/build/bin/llama_greedy, where "
                                           "scripts/check_serving.sh compiles it)")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--lengths", nargs="+", type=int, default=[2048, 8192])
    ap.add_argument("--threads", type=int, default=2, help="torch threads and llama-bench -t (the same on both sides)")
    ap.add_argument("--repeats", type=int, default=3, help="timed turns per side")
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs of each of ours first")
    ap.add_argument("--chunk", type=int, default=2048, help="the engine's max_batch_tokens (prefill chunk)")
    ap.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    ap.add_argument("--work", type=Path, default=Path(os.environ.get("SCRATCH", "/tmp")) / "llamacpp-bench",
                    help="exports and GGUFs (~200 MB per model)")
    ap.add_argument("--output", type=Path, help="folder for llamacpp_bench.json / .png (default: --work)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="weights and activations on both sides (bf16: our model.to(bf16), a bf16 GGUF), after the "
                         "fp32 same-model check")
    ap.add_argument("--lock", default="/tmp/bench.lock", help="flock file held while timing ('' for none)")
    ap.add_argument("--no-progress", dest="progress", action="store_false")
    args = ap.parse_args(argv)
    host_memory.keep_freed_memory()  # as interop_bench: our side reuses freed large blocks (llama.cpp plans its own)
    if min(args.lengths) < 1 or args.repeats < 1 or args.warmup < 0 or args.chunk < 1:
        ap.error("--lengths, --repeats and --chunk must be >= 1 and --warmup >= 0")
    try:
        tree = find_llama_cpp(args.llama_cpp)
    except Skip as s:
        print(f"llamacpp_bench skipped: {s}", file=sys.stderr)
        return 0
    llama_bench = find_tool(tree, "llama-bench", args.llama_bench, "LLAMA_BENCH", bench_build_hint(tree))
    llama_greedy = find_tool(tree, "llama_greedy", args.llama_greedy, None,
                             "compile it as scripts/check_serving.sh does (g++ scripts/serving/llama_greedy.cpp "
                             "against libllama) and pass --llama-greedy PATH")
    rows, settings = run(args.models, args.lengths, tree=tree, llama_bench=llama_bench, llama_greedy=llama_greedy,
                         work=args.work, threads=args.threads, repeats=args.repeats, warmup=args.warmup,
                         chunk=args.chunk, paths=tuple(args.paths), lock=args.lock or None, progress=args.progress,
                         dtype=getattr(torch, args.dtype))
    print(f"# prefill tokens/s, {args.dtype}, {settings['threads']} threads both sides, median (min-max) of "
          f"{args.repeats} interleaved turns; engine in chunks of {args.chunk}; "
          f"llama-bench {settings.get('llama_bench')}")
    for name, v in settings["checks"].items():
        print(f"# {name} ({v['recipe']} as {v['format']}): greedy tokens identical to llama.cpp's: "
              f"{v['tokens_identical']}" + ("" if v["tokens_identical"] else f" — {v['divergence'] or v['error']}")
              + ("" if "bf16_tokens_identical" not in v else
                 f"; in bf16: {v['bf16_tokens_identical']}" + (f" ({v['bf16_divergence']})" if v["bf16_divergence"]
                                                               else "")))
    print(markdown(rows))
    js, png = write_report(rows, settings, args.output or args.work)
    print(f"wrote {js} and {png}")
    return 0 if all(v["tokens_identical"] for v in settings["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
