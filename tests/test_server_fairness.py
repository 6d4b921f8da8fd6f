"""``hybrid serve`` under a long prompt (issue 44): a short request sent while a long prompt is being prefilled
finishes before the long one's first token, its time to first token lands in the /metrics histogram, prompts
over the server's limits get an OpenAI-style 400 naming the limit and its flag, and ``priority`` is accepted."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from server_helpers import idle_and_empty, metrics, paced, post, running_server, wait_until

import hybrid
from hybrid import recipes


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return hybrid.HybridLM(recipes.get("hybrid-1to7-tiny")).eval()


def test_a_short_request_is_not_held_up_by_a_long_prefill(model):
    # 3000-token prompt, 64 tokens a step, each step paced to >= 10 ms: ~47 steps (>0.5 s) of prefill
    with running_server(model, num_blocks=512, max_batch_tokens=64) as (server, _, engine), paced(engine, 0.01):
        done: dict[str, float] = {}

        def send(key, body):
            status, reply = post(server, "/v1/completions", body)
            assert status == 200, reply
            done[key] = time.perf_counter()
            done[key + "_tokens"] = reply["usage"]["completion_tokens"]

        long = threading.Thread(target=send, args=("long", {"prompt": list(range(1, 256)) * 12, "max_tokens": 1,
                                                            "temperature": 0, "ignore_eos": True}))
        long_sent = time.perf_counter()
        long.start()
        wait_until(lambda: metrics(server)["hybrid_running"] == 1)  # the long prompt is being prefilled
        before = metrics(server)["hybrid_time_to_first_token_seconds_count"]
        sent = time.perf_counter()
        send("short", {"prompt": "hello", "max_tokens": 3, "temperature": 0, "ignore_eos": True, "priority": 0})
        long.join(60)
        assert done["short_tokens"] == 3 and done["long_tokens"] == 1
        assert done["short"] < done["long"], "the short request waited for the long prompt"
        m = metrics(server)
        assert m["hybrid_time_to_first_token_seconds_count"] == before + 2
        assert m["hybrid_request_queue_time_seconds_count"] == before + 2  # (before: both histograms counted 0)
        # the short request took ~4 steps (the one in flight, its prefill beside a chunk, 2 decodes), the long ~47:
        # a bound relative to the long one's time holds on a loaded machine too
        assert done["short"] - sent < (done["long"] - long_sent) / 3
        wait_until(lambda: idle_and_empty(server))


def test_ttft_and_queue_time_histograms_are_exported_before_any_request(model):
    with running_server(model) as (server, _, _):
        m = metrics(server)
        assert m["hybrid_time_to_first_token_seconds_count"] == 0
        assert 'hybrid_time_to_first_token_seconds_bucket{le="+Inf"}' in m
        post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2})
        m = metrics(server)
        assert m["hybrid_time_to_first_token_seconds_count"] == 1
        assert m['hybrid_time_to_first_token_seconds_bucket{le="+Inf"}'] == 1
        assert m["hybrid_request_queue_time_seconds_count"] == 1
        assert m["hybrid_request_queue_time_seconds_sum"] <= m["hybrid_time_to_first_token_seconds_sum"]


def test_prompts_over_the_limits_get_a_400_naming_the_limit(model):
    options = {"max_model_len": 200, "max_prompt_tokens": 120}
    with running_server(model, engine_options=options) as (server, _, _):
        status, reply = post(server, "/v1/completions", {"prompt": "x" * 121, "max_tokens": 1})
        assert status == 400, reply
        err = reply["error"]
        assert "121 tokens" in err["message"] and "limit of 120 prompt tokens" in err["message"]
        assert "--max-prompt-tokens" in err["message"]
        assert err["param"] == "prompt" and err["code"] == "context_length_exceeded"
        status, reply = post(server, "/v1/chat/completions",
                             {"messages": [{"role": "user", "content": "y" * 200}], "max_tokens": 1})
        assert status == 400 and "--max-prompt-tokens" in reply["error"]["message"]
        assert reply["error"]["param"] == "messages"
        status, reply = post(server, "/v1/completions", {"prompt": "x" * 100, "max_tokens": 101})
        assert status == 400 and reply["error"]["param"] == "max_tokens"
        assert "maximum context length is 200 tokens (hybrid serve --max-model-len)" in reply["error"]["message"]
        assert "100 in the prompt + 101 max_tokens" in reply["error"]["message"]
        # at the limits: served; a chat without max_tokens gets what the context leaves (not the 256 default)
        status, reply = post(server, "/v1/completions", {"prompt": "x" * 120, "max_tokens": 80, "ignore_eos": True,
                                                         "temperature": 0})
        assert status == 200 and reply["usage"] == {"prompt_tokens": 120, "completion_tokens": 80,
                                                    "total_tokens": 200}
        status, reply = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "z" * 40}],
                                                              "ignore_eos": True, "temperature": 0})
        assert status == 200, reply
        assert reply["usage"]["total_tokens"] == 200 and reply["choices"][0]["finish_reason"] == "length"
        assert metrics(server)["hybrid_requests_rejected_total"] == 3


def test_priority_is_accepted_and_does_not_change_outputs(model):
    with running_server(model) as (server, _, _):
        body = {"prompt": "same prompt", "max_tokens": 6, "temperature": 0}
        _, plain = post(server, "/v1/completions", body)
        _, urgent = post(server, "/v1/completions", {**body, "priority": -5})
        _, lazy = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                        "max_tokens": 2, "priority": 7})
        assert plain["choices"][0]["text"] == urgent["choices"][0]["text"]
        assert lazy["usage"]["completion_tokens"] <= 2
