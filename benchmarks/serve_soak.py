"""Soak ``hybrid serve`` on 127.0.0.1: many clients for a bounded time, mixing short greedy requests, long
prompts, streams dropped mid-way and garbage bodies; every answer is checked.

    python -m benchmarks.serve_soak --recipe hybrid-1to7-tiny --clients 40 --duration 300

A ``hybrid serve`` subprocess (random weights, byte tokenizer) on a free port; nothing else is contacted. First
each of ``--references`` short prompts is sent alone to the idle server (greedy, ``ignore_eos``): its output is
that prompt's reference. Then ``--clients`` threads, each in a closed loop until ``--duration`` seconds have
passed, draw one of:

- *short* (most): a reference prompt, streamed or whole; its text must equal the reference exactly (greedy
  in a busy batch equals the request alone);
- *long*: a ``--long-tokens`` prompt, 4 new tokens; it must finish with ``length`` and 4 tokens;
- *drop*: a stream closed after its first chunk (the server must free it);
- *garbage*: malformed JSON, a wrong type, a bad value, a prompt over ``--max-prompt-tokens``: each must get a
  400 with OpenAI's error object.

Anything else — a 5xx, a timeout, a short output that differs, a missing ``[DONE]`` — is a *failure*, listed at the
end. After the clients stop, the server must be idle with an empty cache (``/metrics``), and its resident memory
(``/proc/PID/status`` ``VmRSS``, sampled every few seconds) is reported from the first sample after the
references to the last: flat means no growth beyond noise.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import subprocess
import sys
import threading
import time
from collections import Counter

from .serve import free_port, stop_server, wait_healthy

GARBAGE = [
    (b'{"prompt": "x", ', "not valid JSON"),
    (b'{"prompt": "x", "temperature": "hot"}', "temperature"),
    (b'{"prompt": "x", "max_tokens": -1}', "max_tokens must be >= 0"),
    (b'{"prompt": [1, 2, 99999]}', "out of range"),
    (b'[1, 2, 3]', "must be a JSON object"),
]


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


class Soak:
    def __init__(self, host: str, port: int, model: str, args):
        self.host, self.port, self.model, self.args = host, port, model, args
        self.counts: Counter = Counter()
        self.failures: list[str] = []
        self.lock = threading.Lock()

    def conn(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=self.args.timeout)

    def post(self, body: bytes) -> tuple[int, bytes]:
        c = self.conn()
        c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        r = c.getresponse()
        out = r.status, r.read()
        c.close()
        return out

    def body(self, prompt, max_tokens: int, stream: bool) -> bytes:
        return json.dumps({"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                           "ignore_eos": True, "stream": stream}).encode()

    def complete(self, prompt, max_tokens: int, stream: bool) -> tuple[str, str, int]:
        """(text, finish_reason, completion tokens) of a whole or streamed greedy completion; raises on anything
        but a well-formed answer."""
        if not stream:
            status, raw = self.post(self.body(prompt, max_tokens, False))
            if status != 200:
                raise RuntimeError(f"status {status}: {raw[:200]!r}")
            reply = json.loads(raw)
            choice = reply["choices"][0]
            return choice["text"], choice["finish_reason"], reply["usage"]["completion_tokens"]
        c = self.conn()
        c.request("POST", "/v1/completions", self.body(prompt, max_tokens, True), {"Content-Type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            raise RuntimeError(f"stream status {r.status}: {r.read()[:200]!r}")
        text, reason, tokens, done = "", None, 0, False
        for line in r:
            if not line.startswith(b"data: "):
                continue
            payload = line[6:].strip()
            if payload == b"[DONE]":
                done = True
                break
            chunk = json.loads(payload)
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            for choice in chunk["choices"]:
                text += choice.get("text") or ""
                reason = choice.get("finish_reason") or reason
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
        c.close()
        if not done:
            raise RuntimeError("the stream ended without [DONE]")
        return text, reason, tokens

    def record(self, kind: str, failure: str | None = None) -> None:
        with self.lock:
            self.counts[kind] += 1
            if failure is not None:
                self.failures.append(f"{kind}: {failure}")

    def one(self, rng: random.Random, references: list[tuple[list[int], str]], long_prompt: list[int]) -> None:
        a = self.args
        roll = rng.random()
        try:
            if roll < a.long_share:
                text, reason, tokens = self.complete(long_prompt, 4, stream=rng.random() < 0.5)
                ok = reason == "length" and tokens == 4
                self.record("long", None if ok else f"finish {reason}, {tokens} tokens")
            elif roll < a.long_share + a.drop_share:
                c = self.conn()
                c.request("POST", "/v1/completions", self.body(rng.choice(references)[0], 64, True),
                          {"Content-Type": "application/json"})
                r = c.getresponse()
                first = r.readline()
                c.close()  # gone after the first line: the server must abort and free it
                self.record("drop", None if r.status == 200 and first else f"status {r.status}")
            elif roll < a.long_share + a.drop_share + a.garbage_share:
                raw, needle = rng.choice(GARBAGE + [(self.body([1] * (a.max_prompt_tokens + 1), 1, False),
                                                     "--max-prompt-tokens")])
                status, reply = self.post(raw)
                message = json.loads(reply).get("error", {}).get("message", "") if reply else ""
                ok = status == 400 and needle in message
                self.record("garbage", None if ok else f"status {status}: {reply[:200]!r}")
            else:
                prompt, expected = rng.choice(references)
                text, reason, _ = self.complete(prompt, a.short_tokens, stream=rng.random() < 0.5)
                self.record("short", None if text == expected and reason == "length"
                            else f"output differs from the request alone: {text!r} vs {expected!r}")
        except Exception as e:  # noqa: BLE001 - every failure is counted and listed
            self.record("error", f"{type(e).__name__}: {e}")


def main(argv: list[str] | None = None) -> int:
    from hybrid import recipes
    from hybrid.server.metrics import parse_metrics

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="hybrid-1to7-tiny")
    p.add_argument("--clients", type=int, default=40)
    p.add_argument("--duration", type=float, default=300.0, help="seconds of new requests (at most 3600)")
    p.add_argument("--references", type=int, default=8, help="distinct short prompts")
    p.add_argument("--short-tokens", type=int, default=24)
    p.add_argument("--long-tokens", type=int, default=8000)
    p.add_argument("--long-share", type=float, default=0.05)
    p.add_argument("--drop-share", type=float, default=0.15)
    p.add_argument("--garbage-share", type=float, default=0.15)
    p.add_argument("--max-prompt-tokens", type=int, default=16000)
    p.add_argument("--max-batch-tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a client waits for one answer")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not 0 < args.duration <= 3600 or not 0 < args.clients <= 256:
        p.error("--duration must be in (0, 3600] and --clients in (0, 256]: the soak is bounded")
    vocab = recipes.get(args.recipe).vocab_size
    rng = random.Random(args.seed)
    host, port = "127.0.0.1", free_port()
    cmd = [sys.executable, "-m", "hybrid.cli", "serve", "--recipe", args.recipe, "--host", host, "--port", str(port),
           "--cache-bytes", "512MiB", "--max-seqs", "64", "--max-batch-tokens", str(args.max_batch_tokens),
           "--max-prompt-tokens", str(args.max_prompt_tokens), "--threads", str(args.threads),
           "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    soak = Soak(host, port, args.recipe, args)
    rss: list[tuple[float, int]] = []
    try:
        wait_healthy(host, port, proc)
        prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(8, 200))] for _ in range(args.references)]
        references = [(pr, soak.complete(pr, args.short_tokens, stream=False)[0]) for pr in prompts]
        long_prompt = [rng.randrange(vocab) for _ in range(args.long_tokens)]
        soak.complete(long_prompt, 4, stream=False)  # warm-up of the long path
        t0 = time.perf_counter()
        stop_at = t0 + args.duration

        def client(k: int) -> None:
            crng = random.Random(args.seed * 1000 + k)
            while time.perf_counter() < stop_at:
                soak.one(crng, references, long_prompt)

        threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(args.clients)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            rss.append((time.perf_counter() - t0, rss_kib(proc.pid)))
            print(f"\r{time.perf_counter() - t0:6.0f} s  {dict(soak.counts)}  failures {len(soak.failures)}  "
                  f"RSS {rss[-1][1] / 1024:.0f} MiB", end="", flush=True)
            time.sleep(5)
        for t in threads:
            t.join()
        print()
        deadline = time.monotonic() + 30
        while True:  # drops are aborted within a step; the cache must be empty once the server is idle
            c = http.client.HTTPConnection(host, port, timeout=30)
            c.request("GET", "/metrics")
            m = parse_metrics(c.getresponse().read().decode())
            c.close()
            idle = m["hybrid_running"] == m["hybrid_waiting"] == m["hybrid_kv_blocks_in_use"] == 0
            if idle or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        rss.append((time.perf_counter() - t0, rss_kib(proc.pid)))
    finally:
        stop_server(proc)
    print(f"requests: {dict(soak.counts)}; failures: {len(soak.failures)}")
    for f in soak.failures[:20]:
        print("  " + f)
    print(f"idle with an empty cache afterwards: {idle}")
    print(f"server RSS: first {rss[0][1] / 1024:.0f} MiB, max {max(r for _, r in rss) / 1024:.0f} MiB, "
          f"last {rss[-1][1] / 1024:.0f} MiB over {rss[-1][0]:.0f} s")
    return 0 if not soak.failures and idle else 1


if __name__ == "__main__":
    sys.exit(main())
