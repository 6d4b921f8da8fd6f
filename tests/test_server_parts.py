"""The server's parts on their own: chat templates from a checkpoint, the Prometheus text, the
``hybrid serve`` command line; and a checkpoint's template used end to end."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from server_helpers import post, running_server

import hybrid
from hybrid import recipes
from hybrid.cli import _byte_size, build_parser, main
from hybrid.server.chat_template import ChatTemplate, ChatTemplateError, load_chat_template
from hybrid.server.metrics import (
    E2E_BUCKETS,
    ITL_BUCKETS,
    TTFT_BUCKETS,
    EngineSnapshot,
    ServerMetrics,
    parse_metrics,
)

LLAMA_LIKE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}"
              "{{ raise_exception('no tools here') }}{% endif %}"
              "[{{ m['role'] | upper }}] {{ m['content'] }}{{ eos_token }}{% endfor %}"
              "{% if add_generation_prompt %}[ASSISTANT] {% endif %}")


def test_checkpoint_template_string_list_and_file(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": LLAMA_LIKE, "bos_token": "<s>", "eos_token": {"content": "</s>"}}))
    t = load_chat_template(tmp_path)
    assert not t.is_default and t.stop == ()
    assert t.render([{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}]}]) \
        == "<s>[USER] Hi!</s>[ASSISTANT] "
    with pytest.raises(ChatTemplateError, match="no tools here"):
        t.render([{"role": "tool", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="only text content parts"):
        t.render([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}))
    assert load_chat_template(tmp_path).render([]) == "D"
    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "chat_template.jinja").write_text("J{{ messages | length }}")
    assert load_chat_template(tmp_path).render([{"role": "user", "content": "a"}]) == "J1"
    assert load_chat_template(None).is_default
    with pytest.raises(ChatTemplateError, match="does not parse"):
        ChatTemplate("{% for %}")


def test_prometheus_text():
    registry = CollectorRegistry()
    c = Counter("x_total", "help text", ["reason"], registry=registry)
    c.labels("stop").inc(2)
    c.labels("length").inc()
    h = Histogram("lat_seconds", "latency", buckets=(0.1, 1.0), registry=registry)
    for v in (0.05, 0.5, 0.7, 3.0):
        h.observe(v)
    text = generate_latest(registry).decode()
    assert "# TYPE x_total counter" in text and "# TYPE lat_seconds histogram" in text
    m = parse_metrics(text)
    assert m['x_total{reason="stop"}'] == 2 and m['x_total{reason="length"}'] == 1
    assert [m[f'lat_seconds_bucket{{le="{b}"}}'] for b in ("0.1", "1.0", "+Inf")] == [1, 3, 4]  # cumulative
    assert m["lat_seconds_count"] == 4 and m["lat_seconds_sum"] == pytest.approx(4.25)


# every series /metrics exposed when it was written by hand: the switch to prometheus-client keeps them all
GAUGES = ["running", "waiting", "kv_blocks_total", "kv_blocks_in_use", "state_slots_total", "state_slots_in_use",
          "cache_bytes_total", "cache_bytes_in_use"]
COUNTERS = ["prompt_tokens_total", "generation_tokens_total", "requests_rejected_total", "engine_steps_total"]
HISTOGRAMS = {"time_to_first_token_seconds": TTFT_BUCKETS, "inter_token_latency_seconds": ITL_BUCKETS,
              "e2e_request_latency_seconds": E2E_BUCKETS}


def test_server_metrics_names_types_and_registries():
    a, b = ServerMetrics(), ServerMetrics()  # two servers in one process: separate registries, no clash
    a.prompt_tokens.inc(5)
    a.finished("stop")
    a.ttft.observe(0.003)
    a.snapshot = EngineSnapshot(running=2, kv_blocks_total=64, cache_bytes_in_use=4096)
    text = a.render()
    m, other = parse_metrics(text), parse_metrics(b.render())
    for g in GAUGES:
        assert f"# TYPE hybrid_{g} gauge" in text
    for c in COUNTERS + ["requests_finished_total"]:
        assert f"# TYPE hybrid_{c} counter" in text
    for name, buckets in HISTOGRAMS.items():
        assert f"# TYPE hybrid_{name} histogram" in text
        assert {k for k in m if k.startswith(f"hybrid_{name}_bucket")} == {
            f'hybrid_{name}_bucket{{le="{le}"}}' for le in [*map(repr, map(float, buckets)), "+Inf"]}
    assert "_created" not in text
    assert (m["hybrid_running"], m["hybrid_kv_blocks_total"], m["hybrid_cache_bytes_in_use"]) == (2, 64, 4096)
    assert m["hybrid_prompt_tokens_total"] == 5 and other["hybrid_prompt_tokens_total"] == 0
    assert m['hybrid_requests_finished_total{finish_reason="stop"}'] == 1
    assert m['hybrid_requests_finished_total{finish_reason="abort"}'] == 0  # every reason from the start
    assert m['hybrid_time_to_first_token_seconds_bucket{le="0.0025"}'] == 0
    assert m['hybrid_time_to_first_token_seconds_bucket{le="0.005"}'] == 1
    body, content_type = a.exposition("application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text") and body.endswith(b"# EOF\n")
    assert a.exposition(None)[1].startswith("text/plain; version=0.0.4")


def test_serve_command_line():
    assert _byte_size("256MiB") == 256 * 2**20 and _byte_size("2GiB") == 2 * 2**30 and _byte_size("1000") == 1000
    with pytest.raises(argparse.ArgumentTypeError, match="not a size"):
        _byte_size("lots")
    args = build_parser().parse_args(["serve", "--recipe", "llama-tiny", "--cache-bytes", "64MiB", "--compile"])
    assert (args.cache_bytes, args.compile, args.host, args.port) == (64 * 2**20, True, "127.0.0.1", 8000)
    with pytest.raises(SystemExit, match="exactly one of --model DIR or --recipe NAME"):
        main(["serve"])


def test_serve_builds_the_engine_with_the_cache_dtypes(monkeypatch):
    import hybrid.server as server
    built = {}
    monkeypatch.setattr(server, "create_app", lambda engine, *a, **k: built.setdefault("engine", engine))
    monkeypatch.setattr(server, "run", lambda *a, **k: None)
    main(["serve", "--recipe", "hybrid-1to7-tiny", "--cache-bytes", "16MiB", "--kv-dtype", "int8",
          "--state-dtype", "bfloat16", "--kv-pruning", "streaming:sinks=4,window=64"])
    report = built["engine"].cache.report()
    assert (report.kv_dtype, report.ssm_dtype) == ("int8", "bfloat16")
    assert "StreamingLLM" in report.kv_pruning


def test_chat_through_a_checkpoint_template(tmp_path):
    torch.manual_seed(0)
    model = hybrid.HybridLM(recipes.get("llama-tiny")).eval()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": LLAMA_LIKE, "bos_token": "<s>"}))
    template = load_chat_template(tmp_path)
    tok = hybrid.load_tokenizer(None)
    messages = [{"role": "user", "content": "Hello"}]
    prompt = template.render(messages)
    with running_server(model, chat_template=template) as (server, _, _):
        status, r = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 6, "temperature": 0})
        assert status == 200
        assert r["usage"]["prompt_tokens"] == len(tok.encode(prompt, add_special_tokens=False))
        assert r["choices"][0]["message"]["content"] == hybrid.generate(model, [prompt], max_new_tokens=6,
                                                                        tokenizer=tok)[0]
        status, r = post(server, "/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]})
        assert status == 400 and "no tools here" in r["error"]["message"] and r["error"]["param"] == "messages"
        status, info = post(server, "/tokenize", {"prompt": "ab", "add_special_tokens": False})
        assert status == 200 and info["tokens"] == [97, 98]
