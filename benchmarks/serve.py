"""Bounded load test of ``hybrid serve`` on 127.0.0.1, and the same workload on the Python engine.

    python -m benchmarks.serve --recipes hybrid-1to7-small llama-small --clients 1 8 32 \\
        --prompt-len 128 --max-tokens 32 --duration 20 --threads 2

For each recipe a ``hybrid serve`` subprocess is started on a free port of 127.0.0.1 (nothing else
is ever contacted). For each client count, that many closed-loop clients (threads) each send a
streaming completion (a fresh random prompt of ``--prompt-len`` token ids, ``max_tokens`` fixed,
``ignore_eos`` so every response has that length), wait for it to end and send the next, until
``--duration`` seconds have passed; requests still in flight then are finished and counted. Then
the same workload runs through :class:`~hybrid.Engine` directly (the same cache and batch
settings, requests added as earlier ones finish), which shows what HTTP, JSON and SSE cost.

Per client count: requests/s, generated tokens/s, p50/p99 time to first token (request sent to
first streamed chunk) and p50/p99 inter-token latency, measured per request as
``(last token time - first token time) / (tokens - 1)`` (the server sends a chunk per engine step,
so this is the mean gap between a request's chunks; the same definition is used on the engine).

``python -m benchmarks.serve long-prompt ...`` is the other scenario: short requests while a long prompt is
prefilled (see :mod:`benchmarks.serve_long_prompt`).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from tqdm import tqdm


@dataclass
class Sample:
    """One finished request: when it was sent, its first and last token times, its token count."""

    sent: float
    first: float
    last: float
    tokens: int


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation; nan for no values."""
    if not values:
        return float("nan")
    v = sorted(values)
    k = (len(v) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def summarize(samples: list[Sample], wall: float) -> dict:
    ttft = [s.first - s.sent for s in samples]
    itl = [(s.last - s.first) / (s.tokens - 1) for s in samples if s.tokens > 1]
    return {"requests": len(samples), "seconds": round(wall, 2), "req/s": round(len(samples) / wall, 3),
            "gen_tok/s": round(sum(s.tokens for s in samples) / wall, 1),
            "ttft_p50_ms": round(percentile(ttft, 50) * 1e3, 1), "ttft_p99_ms": round(percentile(ttft, 99) * 1e3, 1),
            "itl_p50_ms": round(percentile(itl, 50) * 1e3, 2), "itl_p99_ms": round(percentile(itl, 99) * 1e3, 2)}


def random_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


# ---- over HTTP ---------------------------------------------------------------------------------------
def stream_one(host: str, port: int, body: dict) -> Sample:
    """One streaming completion; times measured at the client."""
    conn = http.client.HTTPConnection(host, port, timeout=600)
    sent = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"the server answered {resp.status}: {resp.read()[:500]!r}")
    first = last = None
    tokens = 0
    while True:
        line = resp.readline()
        if not line:
            break
        if not line.startswith(b"data: "):
            continue
        payload = line[6:].strip()
        if payload == b"[DONE]":
            break
        chunk = json.loads(payload)
        now = time.perf_counter()
        if chunk["choices"]:  # a chunk per step that made a token (its text may be held back)
            first = first or now
            last = now
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
    conn.close()
    return Sample(sent, first if first is not None else last or sent, last or sent, tokens)


def http_load(host: str, port: int, model: str, clients: int, prompt_len: int, max_tokens: int, vocab: int,
              duration: float, seed: int) -> dict:
    samples: list[Sample] = []
    lock = threading.Lock()
    stop_at = time.perf_counter() + duration
    errors: list[BaseException] = []

    def client(k: int) -> None:
        rng = random.Random(seed * 1000 + k)
        try:
            while time.perf_counter() < stop_at:
                body = {"model": model, "prompt": random_prompt(rng, prompt_len, vocab), "max_tokens": max_tokens,
                        "temperature": 0, "ignore_eos": True, "stream": True}
                s = stream_one(host, port, body)
                with lock:
                    samples.append(s)
        except BaseException as e:  # noqa: BLE001 - reported after the run
            errors.append(e)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return summarize(samples, time.perf_counter() - t0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_server(proc: subprocess.Popen) -> None:
    """Stop a ``hybrid serve`` process as Ctrl-C does (it drains), killing it if it is still up after 60 s."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def wait_healthy(host: str, port: int, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"hybrid serve exited with {proc.returncode} before it listened")
        try:
            conn = http.client.HTTPConnection(host, port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"hybrid serve did not answer /health within {timeout} s")


# ---- the Python engine directly ----------------------------------------------------------------------
def engine_load(engine, clients: int, prompt_len: int, max_tokens: int, vocab: int, duration: float,
                seed: int) -> dict:
    """The same closed loop on ``engine`` in this process: ``clients`` requests in flight, a new one
    added as soon as one finishes, until ``duration`` has passed. It runs in a worker thread, as the
    server's engine loop does: on a busy machine OpenMP runs a process's main thread measurably
    slower than a worker thread, which would otherwise show up as a (negative) HTTP overhead."""
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(
        _engine_closed_loop(engine, clients, prompt_len, max_tokens, vocab, duration, seed)))
    worker.start()
    worker.join()
    return result


def _engine_closed_loop(engine, clients: int, prompt_len: int, max_tokens: int, vocab: int, duration: float,
                        seed: int) -> dict:
    from hybrid.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    rngs = [random.Random(seed * 1000 + k) for k in range(clients)]
    live: dict[int, tuple[int, Sample]] = {}  # request id -> (client, its sample so far)
    samples: list[Sample] = []
    t0 = time.perf_counter()
    stop_at = t0 + duration

    def add(k: int) -> None:
        rid = engine.add_request(random_prompt(rngs[k], prompt_len, vocab), params)
        live[rid] = (k, Sample(time.perf_counter(), 0.0, 0.0, 0))

    for k in range(clients):
        add(k)
    while live:
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            k, s = live[out.request_id]
            if out.new_token_ids:
                s.first = s.first or now
                s.last = now
                s.tokens += len(out.new_token_ids)
            if out.finished:
                engine.forget(out.request_id)
                del live[out.request_id]
                samples.append(s)
                if now < stop_at:
                    add(k)
    return summarize(samples, time.perf_counter() - t0)


# ---- driver ------------------------------------------------------------------------------------------
def bench_recipe(name: str, args) -> list[dict]:
    import torch

    from hybrid import recipes
    from hybrid.engine import Engine
    from hybrid.engine.config import EngineConfig
    from hybrid.model import HybridLM
    from hybrid.tokenizer import load_tokenizer

    vocab = recipes.get(name).vocab_size
    rows = []
    host, port = "127.0.0.1", free_port()
    cmd = [sys.executable, "-m", "hybrid.cli", "serve", "--recipe", name, "--host", host, "--port", str(port),
           "--dtype", args.dtype, "--cache-bytes", str(args.cache_bytes), "--max-seqs", str(args.max_seqs),
           "--max-batch-tokens", str(args.max_batch_tokens), "--threads", str(args.threads),
           "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    try:
        wait_healthy(host, port, proc)
        stream_one(host, port, {"model": name, "prompt": random_prompt(random.Random(999), args.prompt_len, vocab),
                                "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True})  # warm-up
        for c in tqdm(args.clients, desc=f"{name} over HTTP", unit="level"):
            rows.append({"recipe": name, "path": "http", "clients": c,
                         **http_load(host, port, name, c, args.prompt_len, args.max_tokens, vocab, args.duration,
                                     seed=c)})
    finally:
        stop_server(proc)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = HybridLM(recipes.get(name)).to(getattr(torch, args.dtype)).eval()
    engine = Engine(model, EngineConfig(cache_bytes=args.cache_bytes, max_seqs=args.max_seqs,
                                        max_batch_tokens=args.max_batch_tokens), tokenizer=load_tokenizer(None))
    engine_load(engine, 1, args.prompt_len, 4, vocab, 0.0, seed=999)  # warm-up
    for c in tqdm(args.clients, desc=f"{name} in-process engine", unit="level"):
        rows.append({"recipe": name, "path": "engine", "clients": c,
                     **engine_load(engine, c, args.prompt_len, args.max_tokens, vocab, args.duration, seed=c)})
    return rows


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["long-prompt"]:  # short requests during a long prefill: benchmarks/serve_long_prompt.py
        from .serve_long_prompt import main as long_prompt
        return long_prompt(argv[1:])
    from hybrid.eval.tables import markdown, write_rows

    from hybrid.cli import _byte_size

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipes", nargs="+", default=["hybrid-1to7-small", "llama-small"])
    p.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--duration", type=float, default=20.0, help="seconds of new requests per client count")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the server and of the engine run")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--cache-bytes", type=_byte_size, default=2**30)
    p.add_argument("--max-seqs", type=int, default=32)
    p.add_argument("--max-batch-tokens", type=int, default=512)
    p.add_argument("--output", help="also write the rows to this .json or .csv file")
    args = p.parse_args(argv)
    rows = []
    for name in args.recipes:
        rows += bench_recipe(name, args)
        print(markdown([r for r in rows if r["recipe"] == name]), flush=True)
    print(f"\n# {args.prompt_len}-token prompts, {args.max_tokens} generated tokens, {args.duration:g} s per "
          f"level, {args.threads} torch threads, {args.dtype}, max_seqs {args.max_seqs}, "
          f"max_batch_tokens {args.max_batch_tokens}")
    print(markdown(rows))
    if args.output:
        print(f"wrote {write_rows(rows, args.output, **vars(args))}")


if __name__ == "__main__":
    main()
