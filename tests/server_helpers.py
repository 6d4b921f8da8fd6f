"""Start a tiny model's server on 127.0.0.1 (a free port) for the server tests; raw HTTP helpers."""

from __future__ import annotations

import contextlib
import http.client
import json
import time

import hybrid
from hybrid.server import ServerSettings, create_app
from hybrid.server.metrics import parse_metrics
from hybrid.server.runner import ServerThread


@contextlib.contextmanager
def running_server(model, *, name="tiny", num_blocks=256, max_seqs=16, max_batch_tokens=256, chat_template=None,
                   tokenizer=None, engine_options=None, **settings):
    tok = tokenizer or hybrid.load_tokenizer(None)
    engine = hybrid.Engine(model, num_blocks=num_blocks, block_size=16, max_seqs=max_seqs,
                           max_batch_tokens=max_batch_tokens, tokenizer=tok, **(engine_options or {}))
    app = create_app(engine, tok, ServerSettings(model_name=name, **settings), chat_template)
    server = ServerThread(app, shutdown_timeout=2.0).start()
    try:
        yield server, app, engine
    finally:
        server.stop()


@contextlib.contextmanager
def paced(engine, seconds: float):
    """Each engine step first sleeps ``seconds``. A test that must catch a request mid-flight (a
    client leaving, a shutdown) paces the engine: the tiny model decodes ~2000 tokens a second on
    a fast CPU, quicker than a test can look at it."""
    step = engine.step

    def paced_step():
        time.sleep(seconds)
        return step()
    engine.step = paced_step
    try:
        yield engine
    finally:
        del engine.step


def post(server, path: str, body, *, raw: bytes | None = None, headers: dict | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    data = raw if raw is not None else json.dumps(body).encode()
    conn.request("POST", path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    status, text = resp.status, resp.read().decode()
    conn.close()
    return status, json.loads(text)


def get(server, path: str) -> tuple[int, str]:
    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    conn.request("GET", path)
    resp = conn.getresponse()
    status, text = resp.status, resp.read().decode()
    conn.close()
    return status, text


def metrics(server) -> dict[str, float]:
    status, text = get(server, "/metrics")
    assert status == 200
    return parse_metrics(text)


def sse_events(resp) -> list[str]:
    """Every ``data:`` payload of a server-sent-event response, in order (``[DONE]`` included)."""
    out = []
    for line in resp.read().decode().split("\n"):
        if line.startswith("data: "):
            out.append(line[len("data: "):])
    return out


def wait_until(predicate, timeout: float = 10.0, every: float = 0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"condition not met within {timeout} s")


def idle_and_empty(server) -> bool:
    m = metrics(server)
    return (m["hybrid_running"] == m["hybrid_waiting"] == m["hybrid_kv_blocks_in_use"]
            == m["hybrid_state_slots_in_use"] == m["hybrid_cache_bytes_in_use"] == 0)
