"""``hybrid serve`` through the real ``openai`` client and raw HTTP: outputs equal ``hybrid.generate``,
32 concurrent clients equal each request alone, metrics add up, disconnects free their cache at once,
the cache is empty whenever the server is idle."""

from __future__ import annotations

import http.client
import json
import random
import socket
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
from server_helpers import idle_and_empty, metrics, paced, post, running_server, sse_events, wait_until

import hybrid
from hybrid import recipes
from hybrid.server.chat_template import DEFAULT_STOP, ChatTemplate

NAME = "hybrid-1to7-tiny"


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return hybrid.HybridLM(recipes.get(NAME)).eval()  # Mamba-2 layers and attention: both caches in use


@pytest.fixture(scope="module")
def tok():
    return hybrid.load_tokenizer(None)


@pytest.fixture(scope="module")
def served(model):
    with running_server(model, name=NAME) as (server, app, engine):
        yield server, app


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0].url + "/v1", api_key="unused", max_retries=0, timeout=60)


def alone(model, tok, prompt: str, **kw) -> str:
    return hybrid.generate(model, [prompt], tokenizer=tok, **kw)[0]


def test_completion_greedy_equals_generate(model, tok, client):
    r = client.completions.create(model=NAME, prompt="The quick brown fox", max_tokens=12, temperature=0)
    assert r.choices[0].text == alone(model, tok, "The quick brown fox", max_new_tokens=12)
    assert r.choices[0].finish_reason == "length" and r.object == "text_completion"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (19, 12, 31)
    # token ids as the prompt: the same tokens, the same continuation
    again = client.completions.create(model=NAME, prompt=tok.encode("The quick brown fox"), max_tokens=12,
                                      temperature=0)
    assert again.choices[0].text == r.choices[0].text
    assert client.models.list().data[0].id == NAME


def test_completion_stream_equals_whole(model, tok, client, served):
    whole = alone(model, tok, "Once upon", max_new_tokens=10, temperature=0.9, top_k=50, seed=7)
    chunks = list(client.completions.create(model=NAME, prompt="Once upon", max_tokens=10, temperature=0.9,
                                            extra_body={"top_k": 50}, seed=7, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].usage.completion_tokens == 10
    # the raw stream: OpenAI's chunk objects, then data: [DONE]
    conn = http.client.HTTPConnection(served[0].host, served[0].port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "Once upon", "max_tokens": 10, "temperature": 0.9,
                                                        "top_k": 50, "seed": 7, "stream": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
    events = sse_events(resp)
    assert events[-1] == "[DONE]"
    bodies = [json.loads(e) for e in events[:-1]]
    assert all(b["object"] == "text_completion" for b in bodies)
    assert "".join(b["choices"][0]["text"] for b in bodies) == whole


def test_n_choices_with_a_seed_are_seed_and_seed_plus_one(model, tok, client):
    r = client.completions.create(model=NAME, prompt="abc", max_tokens=8, temperature=1.0, top_p=0.95, n=2, seed=11)
    got = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    assert got == [alone(model, tok, "abc", max_new_tokens=8, temperature=1.0, top_p=0.95, seed=s) for s in (11, 12)]
    assert r.usage.prompt_tokens == 3 and r.usage.completion_tokens == 16
    # a list of prompts times n: choice index = prompt * n + j
    r = client.completions.create(model=NAME, prompt=["ab", "xyz"], max_tokens=4, temperature=0, n=2)
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    assert texts == [alone(model, tok, p, max_new_tokens=4) for p in ("ab", "ab", "xyz", "xyz")]


def test_chat_uses_chatml_by_default_and_streams(model, tok, client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    prompt = ChatTemplate().render(messages)
    assert prompt == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n" \
                     "<|im_start|>assistant\n"
    want = alone(model, tok, prompt, max_new_tokens=9, stop=list(DEFAULT_STOP))
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=9, temperature=0)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(tok.encode(prompt))
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=9, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_echo_with_logprobs_scores_the_prompt(model, tok, client):
    ids = tok.encode("hello world")
    r = client.completions.create(model=NAME, prompt=ids, max_tokens=1, temperature=0, logprobs=2, echo=True)
    lp = r.choices[0].logprobs
    whole = ids + hybrid.generate(model, [ids], max_new_tokens=1)[0]
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([whole]))[0].float(), -1)
    assert len(lp.token_logprobs) == len(whole) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for p in range(1, len(whole)):
        assert lp.token_logprobs[p] == pytest.approx(float(ref[p - 1, whole[p]]), abs=1e-4)
        assert max(lp.top_logprobs[p].values()) == pytest.approx(float(ref[p - 1].max()), abs=1e-4)
    assert r.choices[0].text.startswith("hello world")
    # without echo: the generated tokens' own log-probabilities (completions and chat)
    gen = client.completions.create(model=NAME, prompt=ids, max_tokens=5, temperature=0, logprobs=3)
    out = hybrid.generate(model, [ids], max_new_tokens=5)[0]
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids + out]))[0].float(), -1)
    assert gen.choices[0].logprobs.token_logprobs == pytest.approx(
        [float(ref[len(ids) + k - 1, t]) for k, t in enumerate(out)], abs=1e-4)
    # greedy: each token is the best of its alternatives (which share keys when ids decode alike, e.g. to U+FFFD)
    assert all(max(t.values()) == pytest.approx(v, abs=1e-5) for t, v in
               zip(gen.choices[0].logprobs.top_logprobs, gen.choices[0].logprobs.token_logprobs, strict=True))
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob, abs=1e-5) for c in content)  # greedy
    # max_tokens=0 with echo: the prompt and its scores only, no engine request
    r0 = client.completions.create(model=NAME, prompt=ids, max_tokens=0, logprobs=0, echo=True)
    assert r0.choices[0].text == "hello world" and r0.usage.completion_tokens == 0
    assert r0.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs[:-1], abs=1e-5)


def test_32_concurrent_clients_equal_each_request_alone(model, tok, client, served):
    server, app = served
    rng = random.Random(0)
    jobs = []
    for i in range(32):
        prompt = "".join(rng.choice("abcdefghij klmnop") for _ in range(rng.randint(3, 60)))
        kw = dict(max_tokens=rng.randint(2, 20), temperature=0.0)
        if i % 3 == 0:
            kw.update(temperature=0.8, top_p=0.9, seed=100 + i)
        jobs.append((prompt, kw, i % 2 == 0))
    before = metrics(server)

    def run(job):
        prompt, kw, stream = job
        if stream:
            chunks = list(client.completions.create(model=NAME, prompt=prompt, stream=True, **kw))
            return "".join(c.choices[0].text for c in chunks), chunks[-1].usage
        r = client.completions.create(model=NAME, prompt=prompt, **kw)
        return r.choices[0].text, r.usage

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(run, jobs))
    for (prompt, kw, _), (text, use) in zip(jobs, results, strict=True):
        want = alone(model, tok, prompt, max_new_tokens=kw["max_tokens"], temperature=kw["temperature"],
                     top_p=kw.get("top_p", 1.0), seed=kw.get("seed"))
        assert text == want
        assert use.prompt_tokens == len(tok.encode(prompt)) and use.completion_tokens == kw["max_tokens"]
    wait_until(lambda: idle_and_empty(server))
    after = metrics(server)

    def delta(key):
        return after.get(key, 0) - before.get(key, 0)
    generated = sum(u.completion_tokens for _, u in results)
    assert delta("hybrid_prompt_tokens_total") == sum(u.prompt_tokens for _, u in results)
    assert delta("hybrid_generation_tokens_total") == generated
    assert delta('hybrid_requests_finished_total{finish_reason="length"}') == 32
    assert delta("hybrid_time_to_first_token_seconds_count") == 32
    assert delta("hybrid_inter_token_latency_seconds_count") == generated - 32
    assert delta("hybrid_e2e_request_latency_seconds_count") == 32
    assert delta("hybrid_engine_steps_total") < generated / 2  # requests shared steps (continuous batching)
    assert app.state.loop.call(lambda e: e.cache.report().bytes_in_use).result() == 0


def test_a_dropped_stream_frees_its_cache_within_one_step(served):
    server, app = served
    # 5 ms a step: 3000 tokens take 15 s, so the request is surely caught mid-flight
    with paced(app.state.loop.engine, 0.005):
        before = metrics(server)
        sock = socket.create_connection((server.host, server.port))
        body = json.dumps({"prompt": "a long story", "max_tokens": 3000, "temperature": 0, "stream": True}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        received = b""
        while received.count(b"data: ") < 3:  # a few tokens have streamed: the request holds blocks and a slot
            received += sock.recv(4096)
        assert metrics(server)["hybrid_state_slots_in_use"] == 1
        sock.close()
        wait_until(lambda: idle_and_empty(server))
        after = metrics(server)
        finished = 'hybrid_requests_finished_total{finish_reason="abort"}'
        assert after.get(finished, 0) - before.get(finished, 0) == 1
        assert after["hybrid_generation_tokens_total"] - before["hybrid_generation_tokens_total"] < 3000
        record = app.state.loop.stats.aborts[-1]
        assert record.step_applied - record.step_asked <= 1  # freed before the engine's next step


def test_a_client_that_leaves_a_whole_response_is_aborted(served):
    server, app = served
    # 5 ms a step: 3000 tokens take 15 s, so the request is surely caught mid-flight
    with paced(app.state.loop.engine, 0.005):
        before = metrics(server)
        sock = socket.create_connection((server.host, server.port))
        body = json.dumps({"prompt": "patience", "max_tokens": 3000, "temperature": 0}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        wait_until(lambda: metrics(server)["hybrid_state_slots_in_use"] == 1)
        sock.close()
        wait_until(lambda: idle_and_empty(server), timeout=5)
        after = metrics(server)
        finished = 'hybrid_requests_finished_total{finish_reason="abort"}'
        assert after.get(finished, 0) - before.get(finished, 0) == 1
        assert after["hybrid_generation_tokens_total"] - before["hybrid_generation_tokens_total"] < 3000


BAD = [
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, "model 'gpt-4' is not served here", "model"),
    ("/v1/completions", {"prompt": ""}, "prompt is empty", "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt is empty", "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 999]}, "token id 999 is out of range", "prompt"),
    ("/v1/completions", {"prompt": "x" * 100, "max_tokens": 5000}, "maximum context length is 4097 tokens",
     "max_tokens"),
    ("/v1/completions", {"prompt": "x", "priority": "high"}, "priority: Input should be a valid integer", "priority"),
    ("/v1/completions", {"prompt": "x", "temperature": -0.5}, "temperature must be >= 0", "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p must be in (0, 1]", "top_p"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, "top_p must be in (0, 1]", "top_p"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n must be >= 1", "n"),
    ("/v1/completions", {"prompt": "x", "n": 1000}, "n must be <= 128", "n"),
    ("/v1/completions", {"prompt": "x", "seed": 2**64}, "seed must be a signed 64-bit integer", "seed"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, "max_tokens must be >= 0", "max_tokens"),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, "logprobs must be in [0, 20]", "logprobs"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop strings must be non-empty", "stop"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 0.5}, "presence_penalty is not supported",
     "presence_penalty"),
    ("/v1/completions", {"max_tokens": 3}, "prompt: Field required", "prompt"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature: Input should be a valid number",
     "temperature"),
    ("/v1/chat/completions", {"messages": []}, "messages: List should have at least 1 item", "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 0}, "n must be >= 1", "n"),
]


@pytest.mark.parametrize("path,body,message,param", BAD, ids=[m for _, _, m, _ in BAD])
def test_bad_requests_get_400_with_the_field_and_limit(served, path, body, message, param):
    server, _ = served
    status, reply = post(server, path, body)
    assert status == 400, reply
    assert message in reply["error"]["message"] and reply["error"]["param"] == param
    assert reply["error"]["type"] == "invalid_request_error"
    status, ok = post(server, "/v1/completions", {"prompt": "still there?", "max_tokens": 2})
    assert status == 200 and ok["usage"]["completion_tokens"] == 2
    wait_until(lambda: idle_and_empty(server))


def test_malformed_and_oversized_bodies(model):
    with running_server(model, max_body_bytes=4096) as (server, _, _):
        status, reply = post(server, "/v1/completions", None, raw=b'{"prompt": "x", ')
        assert status == 400 and "not valid JSON" in reply["error"]["message"]
        status, reply = post(server, "/v1/completions", None, raw=b'[1, 2]')
        assert status == 400 and "must be a JSON object" in reply["error"]["message"]
        big = json.dumps({"prompt": "x" * 10000}).encode()
        status, reply = post(server, "/v1/completions", None, raw=big)
        assert status == 413 and "over this server's limit of 4096 bytes" in reply["error"]["message"]
        # chunked (no Content-Length): refused as soon as it passes the limit
        conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
        conn.request("POST", "/v1/completions", body=iter([big[:3000], big[3000:]]),
                     headers={"Content-Type": "application/json"}, encode_chunked=True)
        resp = conn.getresponse()
        assert resp.status == 413 and "more than 4096 bytes" in json.loads(resp.read())["error"]["message"]
        status, ok = post(server, "/v1/completions", {"prompt": "fine", "max_tokens": 1})
        assert status == 200
        assert idle_and_empty(server)


def test_shutdown_finishes_short_requests_and_aborts_long_ones(model):
    # paced at 20 ms a step: the short request needs ~0.6 s and surely ends in the 2 s grace window,
    # the long one ~80 s and surely does not (unpaced, 4000 tokens can take under 2 s)
    with running_server(model, shutdown_timeout=1.0) as (server, app, engine), paced(engine, 0.02):
        def stream(max_tokens):
            conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
            conn.request("POST", "/v1/completions", json.dumps({"prompt": "go", "max_tokens": max_tokens,
                                                                "temperature": 0, "stream": True}),
                         {"Content-Type": "application/json"})
            return conn.getresponse()
        long_resp = stream(4000)
        short_resp = stream(30)
        wait_until(lambda: metrics(server)["hybrid_running"] == 2)
        server.stop()
        short_events = sse_events(short_resp)
        assert json.loads(short_events[-2])["choices"][0]["finish_reason"] == "length"
        try:
            long_text = long_resp.read().decode()
        except http.client.IncompleteRead as cut:
            long_text = cut.partial.decode()  # cut off mid-stream: an abort at shutdown, as a client sees it
        assert long_text.count("data: ") > 0 and '"finish_reason": "' not in long_text  # streamed, never finished
    assert not app.state.loop.alive
    assert not engine.has_unfinished() and engine.cache.report().bytes_in_use == 0 and not engine.requests
