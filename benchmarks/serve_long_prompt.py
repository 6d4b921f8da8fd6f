"""Short requests against ``hybrid serve`` while a long prompt is prefilled (issue 44's goal), on 127.0.0.1.

    python -m benchmarks.serve long-prompt --recipe hybrid-1to7-small --long-tokens 100000 --shorts 20 \\
        --max-batch-tokens 256 --cache-bytes 2GiB --threads 2 --json docs/results/data/serve-long-prompt.json

A ``hybrid serve`` subprocess (a recipe's random weights, byte tokenizer) on a free port of 127.0.0.1; nothing
else is contacted. Prompts are token ids drawn from a seeded RNG; every request is a greedy stream with
``ignore_eos``, so each has exactly its ``max_tokens``. Three phases, one after the other:

1. *idle*: the ``--shorts`` short requests (``--short-tokens`` prompt ids, ``--max-tokens`` new), one at a time
   on the idle server: their time to first token (TTFT: request sent to first streamed token) alone;
2. *long alone*: the ``--long-tokens`` prompt alone (``max_tokens`` 1): its time to its one token;
3. *contended*: the long prompt again; 1 s after it the *probe* (one more short request), and the shorts
   spread evenly over the long prompt's time alone (the first 1.5 s in), each on its own connection.

The goals (issue 44): the probe's TTFT within 2 s; the shorts' p99 TTFT in phase 3 at most 3x their median
TTFT in phase 1; the long prompt's time in phase 3 at most 1.25x phase 2. The server's own TTFT histogram
(``hybrid_time_to_first_token_seconds`` in ``/metrics``) is read after each phase and its bucket counts for
phase 3 are printed beside the client's numbers.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from datetime import date

from tqdm import tqdm

from .serve import free_port, percentile, stop_server, stream_one, wait_healthy


def ttft(sample) -> float:
    return sample.first - sample.sent


def spread(values: list[float]) -> dict:
    """min / median / p99 / max in seconds, rounded for the table."""
    return {"min": round(min(values), 3), "median": round(statistics.median(values), 3),
            "p99": round(percentile(values, 99), 3), "max": round(max(values), 3)}


def server_ttft(host: str, port: int) -> dict[str, float]:
    """The server's TTFT histogram: ``{le: cumulative count}`` plus ``count`` and ``sum``."""
    from hybrid.server.metrics import parse_metrics

    conn = http.client.HTTPConnection(host, port, timeout=60)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    out = {}
    for key, value in parse_metrics(text).items():
        if key.startswith("hybrid_time_to_first_token_seconds_bucket"):
            out[key.split('le="')[1].rstrip('"}')] = value
        elif key in ("hybrid_time_to_first_token_seconds_count", "hybrid_time_to_first_token_seconds_sum"):
            out[key.rsplit("_", 1)[1]] = value
    return out


def run(args) -> dict:
    from hybrid import recipes

    vocab = recipes.get(args.recipe).vocab_size
    rng = random.Random(args.seed)
    long_prompt = [rng.randrange(vocab) for _ in range(args.long_tokens)]
    shorts = [[rng.randrange(vocab) for _ in range(args.short_tokens)] for _ in range(args.shorts + 1)]
    host, port = "127.0.0.1", free_port()
    cmd = [sys.executable, "-m", "hybrid.cli", "serve", "--recipe", args.recipe, "--host", host, "--port", str(port),
           "--dtype", args.dtype, "--cache-bytes", str(args.cache_bytes), "--max-seqs", str(args.max_seqs),
           "--max-batch-tokens", str(args.max_batch_tokens), "--threads", str(args.threads), "--log-level", "warning"]
    if args.long_prefill_tokens:
        cmd += ["--long-prefill-tokens", str(args.long_prefill_tokens)]
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})

    def body(prompt, max_tokens):
        return {"model": args.recipe, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}

    try:
        wait_healthy(host, port, proc)
        stream_one(host, port, body(shorts[0], args.max_tokens))  # warm-up: first-call costs
        stream_one(host, port, body(long_prompt[:2 * args.max_batch_tokens], 1))
        idle = [ttft(stream_one(host, port, body(p, args.max_tokens)))
                for p in tqdm(shorts[1:], desc="idle shorts", unit="req")]
        print(f"long prompt alone ({args.long_tokens} tokens) ...", flush=True)
        alone = stream_one(host, port, body(long_prompt, 1))
        long_alone = alone.last - alone.sent
        before = server_ttft(host, port)

        results: dict[str, object] = {}
        t0 = time.perf_counter()

        def send(key, prompt, max_tokens, at):
            time.sleep(max(0.0, t0 + at - time.perf_counter()))
            results[key] = stream_one(host, port, body(prompt, max_tokens))

        gap = long_alone / (args.shorts + 2)
        threads = [threading.Thread(target=send, args=("long", long_prompt, 1, 0.0)),
                   threading.Thread(target=send, args=("probe", shorts[0], args.max_tokens, 1.0))]
        threads += [threading.Thread(target=send, args=(k, p, args.max_tokens, 1.5 + k * gap))
                    for k, p in enumerate(shorts[1:])]
        for t in threads:
            t.start()
        for t in tqdm(threads, desc="contended", unit="req"):
            t.join()
        after = server_ttft(host, port)
    finally:
        stop_server(proc)

    contended = [ttft(results[k]) for k in range(args.shorts)]
    long_contended = results["long"].last - results["long"].sent
    probe = ttft(results["probe"])
    during_long = sum(results[k].first < results["long"].last for k in range(args.shorts))
    histogram = {le: after[le] - before.get(le, 0) for le in after}
    goals = {
        "probe TTFT <= 2 s": probe <= 2.0,
        "p99 contended TTFT <= 3x idle median": percentile(contended, 99) <= 3 * statistics.median(idle),
        "long prompt time <= 1.25x alone": long_contended <= 1.25 * long_alone,
    }
    return {"idle": spread(idle), "contended": spread(contended), "probe_ttft_s": round(probe, 3),
            "long_alone_s": round(long_alone, 2), "long_contended_s": round(long_contended, 2),
            "long_growth": round(long_contended / long_alone, 3), "shorts_first_token_during_long": during_long,
            "server_ttft_histogram_phase3": histogram, "goals": goals}


def rows_of(out: dict) -> list[dict]:
    rows = [{"what": f"short TTFT, {phase}", **{k: f"{v * 1e3:.0f} ms" for k, v in out[phase].items()}}
            for phase in ("idle", "contended")]
    rows.append({"what": "probe TTFT (sent 1 s after the long prompt)", "min": f"{out['probe_ttft_s'] * 1e3:.0f} ms"})
    rows.append({"what": "long prompt: alone / contended", "min": f"{out['long_alone_s']} s",
                 "median": f"{out['long_contended_s']} s", "p99": f"x{out['long_growth']}"})
    return rows


def main(argv: list[str] | None = None) -> None:
    from hybrid.cli.common import byte_size

    from .common import machine

    def machine_line(threads: int) -> str:
        m = machine()
        return (f"{m.get('cpu', 'CPU')}, {m.get('cores', '?')} cores shared with other jobs (noisy), "
                f"{threads} torch threads")

    p = argparse.ArgumentParser(prog="python -m benchmarks.serve long-prompt", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="hybrid-1to7-small")
    p.add_argument("--long-tokens", type=int, default=100_000)
    p.add_argument("--shorts", type=int, default=20, help="short requests in the idle and the contended phase")
    p.add_argument("--short-tokens", type=int, default=16, help="prompt ids of a short request")
    p.add_argument("--max-tokens", type=int, default=16, help="new tokens of a short request")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--cache-bytes", type=byte_size, default=2 * 2**30)
    p.add_argument("--max-seqs", type=int, default=32)
    p.add_argument("--max-batch-tokens", type=int, default=256)
    p.add_argument("--long-prefill-tokens", type=int, help="the server's --long-prefill-tokens (default: its own)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the record (docs/results/data/ format) here")
    args = p.parse_args(argv)
    out = run(args)
    setting = (f"{args.recipe} ({args.dtype}, random weights), {args.threads} threads, "
               f"--cache-bytes {args.cache_bytes}, --max-batch-tokens {args.max_batch_tokens}, "
               f"--max-seqs {args.max_seqs}; long prompt "
               f"{args.long_tokens} ids, {args.shorts} shorts of {args.short_tokens} ids + {args.max_tokens} new")
    print(f"\n# {setting}")
    for row in rows_of(out):
        print("  ".join(f"{k}: {v}" for k, v in row.items()))
    print(f"shorts whose first token came while the long prompt was still running: "
          f"{out['shorts_first_token_during_long']} of {args.shorts}")
    print("server TTFT histogram, contended phase (cumulative count per bucket, le in s): "
          + ", ".join(f"{le}: {int(v)}" for le, v in out["server_ttft_histogram_phase3"].items()
                      if le not in ("count", "sum")))
    for goal, met in out["goals"].items():
        print(f"goal {goal}: {'met' if met else 'NOT met'}")
    if args.json:
        record = {"title": "Short requests during a long prompt", "page": "serving", "order": -1,
                  "date": date.today().isoformat(), "machine": machine_line(args.threads),
                  "command": "python -m benchmarks.serve long-prompt " + " ".join(sys.argv[2:] if argv is None
                                                                                   else argv),
                  "context": setting, "columns": ["what", "min", "median", "p99", "max"], "rows": rows_of(out),
                  "notes": "Goals (issue 44): " + "; ".join(f"{goal}: {'met' if met else '**not met**'}"
                                                           for goal, met in out["goals"].items())
                           + f". Shorts whose first token came while the long prompt ran: "
                             f"{out['shorts_first_token_during_long']} of {args.shorts}.",
                  "result": out}
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
