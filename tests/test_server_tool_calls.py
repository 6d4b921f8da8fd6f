"""Tool calls in chat output parsed into OpenAI's ``tool_calls`` (``hybrid serve --tool-call-parser``): the parsers
(hermes, llama3_json) on whole and chunked text, and the server end to end — whole and streamed responses, and
the official ``openai`` client reading them — with a model made to say a fixed text."""

from __future__ import annotations

import http.client
import json
import logging
import random

import pytest
import torch
from server_helpers import post, running_server, sse_events

import hybrid
from hybrid import recipes
from hybrid.server import ChatTemplate, tool_parsers
from hybrid.server.tool_parsers import ToolCall, get, parse_tool_calls

HERMES = get("hermes")
LLAMA = get("llama3_json")
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "the weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "time", "parameters": {"type": "object"}}}]


# the shape of Qwen2.5's template: the tools in the system turn, the assistant's calls as <tool_call> JSON
QWEN_LIKE = (
    "{% if tools %}<|im_start|>system\nTools:\n{% for t in tools %}{{ t['function'] | tojson }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>\n"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}\n</tool_call>"
    "{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def call(name: str, args: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


def streamed(fmt, text: str, sizes, names=None) -> list:
    """``text`` fed in chunks of the given sizes (cycled), then finished: the pieces, in order."""
    stream, pieces, at, k = fmt.stream(names), [], 0, 0
    while at < len(text):
        n = sizes[k % len(sizes)]
        pieces += stream.feed(text[at:at + n])
        at, k = at + n, k + 1
    return pieces + stream.finish()


def summary(pieces) -> tuple[str, list[tuple[str, str]]]:
    return ("".join(p for p in pieces if isinstance(p, str)),
            [(p.name, p.arguments) for p in pieces if isinstance(p, ToolCall)])


# ---- the parsers ---------------------------------------------------------------------------------------
def test_hermes_one_call():
    content, calls = parse_tool_calls(HERMES, call("weather", {"city": "Oslo"}))
    assert content is None and len(calls) == 1
    c = calls[0]
    assert (c.name, json.loads(c.arguments)) == ("weather", {"city": "Oslo"})
    assert c.id.startswith("call_") and len(c.id) == len("call_") + 24
    assert c.openai() == {"id": c.id, "type": "function",
                          "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}


def test_hermes_two_calls_and_the_text_around_them():
    text = f"Let me look.\n{call('weather', {'city': 'Oslo'})}\n{call('time', {})}\nBack soon."
    content, calls = parse_tool_calls(HERMES, text)
    assert content == "Let me look.\nBack soon."  # whitespace at the calls dropped; text on both sides kept apart
    assert [(c.name, c.arguments) for c in calls] == [("weather", '{"city": "Oslo"}'), ("time", "{}")]
    assert calls[0].id != calls[1].id
    # non-ASCII arguments stay as they are (ensure_ascii=False, as vLLM), and text right before a call
    content, calls = parse_tool_calls(HERMES, 'Sure: <tool_call>{"name": "weather", "arguments": {"city": "Zürich"}}'
                                              "</tool_call>")
    assert content == "Sure:" and calls[0].arguments == '{"city": "Zürich"}'


def test_hermes_output_without_a_call_is_returned_unchanged():
    for text in ("", "Plain answer.\n\n", "  a < b and c > d  ", "<tool_call", "mention </tool_call> only"):
        assert parse_tool_calls(HERMES, text) == (text, [])


def test_hermes_malformed_call_stays_content_and_is_logged(caplog):
    text = 'Trying <tool_call>{"name": "weather", "arguments": {city: Oslo}}</tool_call> again'
    with caplog.at_level(logging.WARNING, logger="hybrid.server"):
        assert parse_tool_calls(HERMES, text) == (text, [])
    assert "malformed" in caplog.text and "returned as content" in caplog.text
    for bad in ('<tool_call>{"arguments": {}}</tool_call>',  # no name
                '<tool_call>{"name": "weather", "arguments": [1, 2]}</tool_call>',  # arguments not an object
                '<tool_call>["weather"]</tool_call>'):
        assert parse_tool_calls(HERMES, bad) == (bad, [])
    # one bad call among good ones: the good ones are calls, the bad one content
    content, calls = parse_tool_calls(HERMES, f"{call('time', {})}<tool_call>oops</tool_call>")
    assert content == "<tool_call>oops</tool_call>" and [c.name for c in calls] == ["time"]


def test_hermes_arguments_given_as_a_json_string_or_left_out():
    text = '<tool_call>{"name": "weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>'
    assert parse_tool_calls(HERMES, text)[1][0].arguments == '{"city": "Oslo"}'
    assert parse_tool_calls(HERMES, '<tool_call>{"name": "time"}</tool_call>')[1][0].arguments == "{}"


def test_hermes_unknown_name_is_a_call_as_in_vllm_and_is_logged(caplog):
    with caplog.at_level(logging.WARNING, logger="hybrid.server"):
        content, calls = parse_tool_calls(HERMES, call("launch", {"what": "rocket"}), ["weather", "time"])
    assert content is None and [c.name for c in calls] == ["launch"]
    assert "'launch'" in caplog.text and "did not offer" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hybrid.server"):
        parse_tool_calls(HERMES, call("weather", {}), ["weather", "time"])
    assert caplog.text == ""


def test_hermes_call_without_its_closing_tag():
    # the model stopped (EOS) before </tool_call>: a complete JSON object still counts, as in vLLM
    content, calls = parse_tool_calls(HERMES, 'Ok <tool_call>\n{"name": "time", "arguments": {}}\n')
    assert content == "Ok" and [c.name for c in calls] == ["time"]
    cut = 'Ok <tool_call>\n{"name": "time", "argum'  # cut off by max_tokens: the text as it stands
    assert parse_tool_calls(HERMES, cut) == (cut, [])


OUTPUTS = [
    f"Let me look.\n{call('weather', {'city': 'Oslo'})}\n{call('time', {})}\nBack soon.",
    f"{call('weather', {'city': 'Zürich'})}",
    "a <tool_ca and <tool_call>{bad}</tool_call> < tool_call > done",
    f"x <tool_call{call('time', {})}",
    "Plain answer with a < sign and </tool_call> at the end <",
    "  \n",
]


@pytest.mark.parametrize("text", OUTPUTS)
def test_stream_in_any_chunks_equals_the_whole_and_never_leaks_a_tag(text):
    whole = parse_tool_calls(HERMES, text)
    rng = random.Random(0)
    chunkings = [[1], [2], [3], [5], [len(text) or 1]] + [[rng.randint(1, 7) for _ in range(20)] for _ in range(20)]
    for sizes in chunkings:
        pieces = streamed(HERMES, text, sizes)
        expected = ((whole[0] or "") if whole[1] else text, [(c.name, c.arguments) for c in whole[1]])
        assert summary(pieces) == expected, sizes
        if whole[1] and "<tool_call>{bad}" not in text:
            assert all("tool_call>" not in p for p in pieces if isinstance(p, str)), pieces


def test_partial_tag_across_chunks_is_held_back_then_released():
    stream = HERMES.stream()
    assert stream.feed("Checking <tool_") == ["Checking"]  # the space waits for what follows; the tag start too
    assert stream.feed("call>\n{\"name\": \"time\", ") == []
    out = stream.feed('"arguments": {}}\n</tool_call>')
    assert [(p.name, p.arguments) for p in out] == [("time", "{}")] and stream.calls == 1
    assert stream.finish() == []
    stream = HERMES.stream()
    assert stream.feed("a <tool") == ["a"]
    assert stream.feed("box> b") == [" <toolbox> b"]  # not a tag after all: all of it is content


def test_llama3_json():
    content, calls = parse_tool_calls(LLAMA, '{"name": "weather", "parameters": {"city": "Oslo"}}')
    assert content is None and [(c.name, c.arguments) for c in calls] == [("weather", '{"city": "Oslo"}')]
    two = ' <|python_tag|>{"name": "time", "parameters": {}}; {"name": "weather", "arguments": {"city": "Rome"}}'
    assert [(c.name, c.arguments) for c in parse_tool_calls(LLAMA, two)[1]] == [
        ("time", "{}"), ("weather", '{"city": "Rome"}')]
    for text in ('It is {"name": "x"}', '{"answer": 42}', '{"name": "time", "parameters": {}} and more', "{"):
        assert parse_tool_calls(LLAMA, text) == (text, [])
    assert parse_tool_calls(LLAMA, '{"name": "t", "parameters": {}, "arguments": {}}')[1] == []  # which one?
    for sizes in ([1], [2], [3], [9]):
        assert summary(streamed(LLAMA, two, sizes)) == ("", [("time", "{}"), ("weather", '{"city": "Rome"}')])
        assert summary(streamed(LLAMA, "Hello {x}", sizes)) == ("Hello {x}", [])


def test_registry_names_and_unknown_name():
    assert tool_parsers.names() == ["hermes", "llama3_json"]
    with pytest.raises(ValueError, match="unknown tool call parser 'qwen'; known: hermes, llama3_json"):
        get("qwen")


def test_serve_flag_help_names_every_parser_and_refuses_an_unknown_one(capsys):
    from hybrid.cli import build_parser, main

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    help_text = " ".join(serve.format_help().split())
    assert "--tool-call-parser NAME" in help_text
    assert all(name in help_text for name in tool_parsers.names())
    assert build_parser().parse_args(["serve", "--recipe", "llama-tiny"]).tool_call_parser is None
    with pytest.raises(SystemExit) as e:
        main(["serve", "--recipe", "llama-tiny", "--tool-call-parser", "qwen"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'qwen'" in err and "hermes, llama3_json" in err, err


# ---- the server, with a model made to say a fixed text -------------------------------------------------
SAID = f"Let me check.\n{call('weather', {'city': 'Oslo'})}\n{call('time', {'zone': 'CET'})}"


def say(engine, text: str) -> None:
    """Make ``engine`` sample ``text`` (byte tokens), then EOS, whatever the model's logits say: the engine's
    own sampler is replaced, so scheduling, detokenisation, stop handling and streaming all run for real."""
    ids = list(text.encode())
    eos = engine.tokenizer.eos_token_id

    def sample(logits, params, seeds, counters, contexts):
        return [ids[c] if c < len(ids) else eos for c in counters]
    engine.runner.sample = sample
    engine.runner.can_run_steps = lambda: False  # greedy steps would take their argmax in C, past this sampler


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return hybrid.HybridLM(recipes.get("llama-tiny")).eval()


@pytest.fixture
def served(model):
    with running_server(model, tool_call_parser="hermes", chat_template=ChatTemplate(QWEN_LIKE)) as (
            server, _, engine):
        say(engine, SAID)
        yield server


def ask(**kw) -> dict:
    return {"messages": [{"role": "user", "content": "Weather and time in Oslo?"}], "tools": TOOLS,
            "max_tokens": 200, "temperature": 0, **kw}


def test_whole_response_has_tool_calls(served):
    status, r = post(served, "/v1/chat/completions", ask())
    assert status == 200, r
    choice = r["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["role"] == "assistant" and message["content"] == "Let me check."
    calls = message["tool_calls"]
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("function", "weather", {"city": "Oslo"}), ("function", "time", {"zone": "CET"})]
    assert all(isinstance(c["function"]["arguments"], str) and c["id"].startswith("call_") for c in calls)
    assert r["usage"]["completion_tokens"] == len(SAID.encode())
    # tool_choice none, or no tools offered: the text as the model said it
    for body in (ask(tool_choice="none"), {**ask(), "tools": None}):
        status, r = post(served, "/v1/chat/completions", body)
        assert status == 200 and r["choices"][0]["message"] == {"role": "assistant", "content": SAID}
        assert r["choices"][0]["finish_reason"] == "stop"


def test_server_without_the_flag_keeps_text(model):
    with running_server(model) as (server, _, engine):
        say(engine, SAID)
        status, r = post(server, "/v1/chat/completions", ask())
        assert status == 200 and r["choices"][0]["message"] == {"role": "assistant", "content": SAID}


def test_malformed_call_is_content(model, caplog):
    said = 'Hm <tool_call>{"name": weather}</tool_call>'
    with running_server(model, tool_call_parser="hermes") as (server, _, engine), \
            caplog.at_level(logging.WARNING, logger="hybrid.server"):
        say(engine, said)
        status, r = post(server, "/v1/chat/completions", ask())
        assert status == 200, r
        assert r["choices"][0]["message"] == {"role": "assistant", "content": said}
        assert r["choices"][0]["finish_reason"] == "stop"
    assert "malformed" in caplog.text


def stream_chunks(server, body) -> list[dict]:
    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", body=json.dumps({**body, "stream": True}),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    events = sse_events(resp)
    conn.close()
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_streamed_response_has_tool_call_deltas(served):
    chunks = stream_chunks(served, ask())
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    content = "".join(d.get("content") or "" for d in deltas)
    assert content == "Let me check."
    assert not any("tool_call" in (d.get("content") or "") for d in deltas)
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    # per call: index, id, type and name (arguments empty) first, then the arguments
    assert [set(tc) for tc in calls] == [{"index", "id", "type", "function"}, {"index", "function"}] * 2
    assert [tc["index"] for tc in calls] == [0, 0, 1, 1]
    assert [calls[0]["function"], calls[2]["function"]] == [{"name": "weather", "arguments": ""},
                                                             {"name": "time", "arguments": ""}]
    assert json.loads(calls[1]["function"]["arguments"]) == {"city": "Oslo"}
    assert json.loads(calls[3]["function"]["arguments"]) == {"zone": "CET"}
    assert calls[0]["id"] != calls[2]["id"] and calls[0]["id"].startswith("call_")
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert reasons[-1] == "tool_calls" and set(reasons[:-1]) == {None}
    assert chunks[-1]["usage"]["completion_tokens"] == len(SAID.encode())
    # the content deltas come before the calls, as the text did
    first_call = next(i for i, d in enumerate(deltas) if d.get("tool_calls"))
    assert "".join(d.get("content") or "" for d in deltas[:first_call]) == "Let me check."


def test_streamed_n_choices_each_parsed(served):
    chunks = stream_chunks(served, ask(n=2, seed=1))
    for i in range(2):
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert "".join(d.get("content") or "" for d in deltas) == "Let me check."
        assert [tc["index"] for d in deltas for tc in d.get("tool_calls", [])] == [0, 0, 1, 1]


def test_the_openai_client_reads_the_tool_calls(served):
    openai = pytest.importorskip("openai")
    from openai.types.chat import ChatCompletionMessageToolCall

    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Weather and time in Oslo?"}]
    r = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=200, temperature=0)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and message.content == "Let me check."
    assert all(isinstance(c, ChatCompletionMessageToolCall) for c in message.tool_calls)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("weather", {"city": "Oslo"}), ("time", {"zone": "CET"})]
    # the client's stream helper accumulates the deltas into the same message
    with client.chat.completions.stream(model="tiny", messages=messages, tools=TOOLS, max_tokens=200,
                                        temperature=0) as stream:
        final = stream.get_final_completion()
    streamed_message = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls" and streamed_message.content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in streamed_message.tool_calls] == [
        ("weather", {"city": "Oslo"}), ("time", {"zone": "CET"})]
    # and the assistant turn goes back in the next request (its arguments reach the template parsed)
    follow = [*messages, message.model_dump(exclude_none=True),
              {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "12 C"}]
    r = client.chat.completions.create(model="tiny", messages=follow, tools=TOOLS, max_tokens=200)
    assert r.choices[0].finish_reason == "tool_calls"
    prompt = ChatTemplate(QWEN_LIKE).render(follow, tools=TOOLS)
    assert '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in prompt
    assert r.usage.prompt_tokens == len(hybrid.load_tokenizer(None).encode(prompt, add_special_tokens=False))
