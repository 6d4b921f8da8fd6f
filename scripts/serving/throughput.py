"""Same-weights throughput, vLLM's CPU build vs our engine: prefill (B prompts of L random ids, one new
token) and decode (B prompts of 16 ids, N new tokens, less the same requests with one), for llama-small
and hybrid-1to7-small exported to the format vLLM serves. Both get 2 threads and up to 2048 tokens per
step; every timing is a median of 3 after a warm-up, under /tmp/bench.lock. Runs in our .venv.

    python scripts/serving/throughput.py --work DIR --vllm-python PY [--prefill 8x2048] [--decode 32x64]
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import random
import statistics
import subprocess
import time
from pathlib import Path

import torch

import hybrid
from hybrid import recipes

HERE = Path(__file__).resolve().parent
MODELS = {"llama-small": "llama", "hybrid-1to7-small": "granitemoehybrid"}  # recipe -> format vLLM serves
MAX_BATCH_TOKENS = 2048


def ours(model, prefill: tuple[int, int], decode: tuple[int, int], repeats: int) -> dict:
    rng = random.Random(0)
    vocab = model.config.vocab_size

    def ids(n):
        return [rng.randrange(vocab) for _ in range(n)]

    def timed(prompts, n_new):
        t0 = time.perf_counter()
        hybrid.generate(model, prompts, max_new_tokens=n_new, ignore_eos=True, max_seqs=max(len(prompts), 1),
                        max_batch_tokens=MAX_BATCH_TOKENS)
        return time.perf_counter() - t0

    (bp, lp), (bd, nd) = prefill, decode
    timed([ids(lp)], 1)
    pre = [timed([ids(lp) for _ in range(bp)], 1) for _ in range(repeats)]
    short = [ids(16) for _ in range(bd)]
    timed(short, 2)
    first = min(timed(short, 1) for _ in range(repeats))  # as run_vllm.py: the least, noise only lengthens it
    dec = [timed(short, nd) - first for _ in range(repeats)]
    return {"prefill_tok_s": [bp * lp / t for t in pre], "decode_tok_s": [bd * (nd - 1) / t for t in dec]}


def locked_json(cmd: list[str], out: Path, env: dict) -> dict:
    subprocess.run(["flock", "/tmp/bench.lock", *cmd], check=True, env={**os.environ, **env},
                   stdout=subprocess.DEVNULL, stderr=open(out.with_suffix(".log"), "w"))
    return json.loads(out.read_text())


def summary(xs: list[float]) -> str:
    return f"{statistics.median(xs):.0f} ({min(xs):.0f}-{max(xs):.0f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--vllm-python", required=True)
    ap.add_argument("--prefill", default="8x2048")
    ap.add_argument("--decode", default="32x64")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    args = ap.parse_args()
    torch.set_num_threads(2)
    prefill = tuple(int(x) for x in args.prefill.split("x"))
    decode = tuple(int(x) for x in args.decode.split("x"))
    args.work.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.models:
        torch.manual_seed(0)
        model = hybrid.HybridLM(recipes.get(name)).eval()
        folder = hybrid.save_pretrained(model, args.work / name, format=MODELS[name])
        out = args.work / f"{name}-vllm.json"
        theirs = locked_json([args.vllm_python, str(HERE / "run_vllm.py"), "bench", str(folder), str(out),
                              "--prefill", args.prefill, "--decode", args.decode, "--repeats", str(args.repeats)],
                             out, {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "4"})
        lock = open("/tmp/bench.lock", "w")  # our timing too runs alone, like every benchmark here
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            mine = ours(model, prefill, decode, args.repeats)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
        rows.append((name, MODELS[name], mine, theirs))
        (args.work / "throughput.json").write_text(json.dumps(
            [{"model": r[0], "format": r[1], "ours": r[2], "vllm": r[3]} for r in rows], indent=1) + "\n")
    print(f"prefill {args.prefill} tokens, decode {args.decode} (prompts x new tokens); tokens/s, median (min-max) "
          f"of {args.repeats}, 2 threads each")
    print("| model | export | ours prefill | vLLM prefill | vLLM/ours | ours decode | vLLM decode | vLLM/ours |")
    print("|---|---|---|---|---|---|---|---|")
    for name, fmt, mine, theirs in rows:
        rp = statistics.median(theirs["prefill_tok_s"]) / statistics.median(mine["prefill_tok_s"])
        rd = statistics.median(theirs["decode_tok_s"]) / statistics.median(mine["decode_tok_s"])
        print(f"| {name} | `{fmt}` | {summary(mine['prefill_tok_s'])} | {summary(theirs['prefill_tok_s'])} | "
              f"{rp:.2f}x | {summary(mine['decode_tok_s'])} | {summary(theirs['decode_tok_s'])} | {rd:.2f}x |")


if __name__ == "__main__":
    main()
