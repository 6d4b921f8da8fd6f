"""Chat templates rendered by the checkpoint's own transformers tokenizer (``apply_chat_template``): the same
text transformers gives, with ``tools`` and the tokenizer's special tokens; tool calls' JSON arguments parsed;
bad tools and templates answered with a 400 naming the field."""

from __future__ import annotations

import json

import pytest
import torch
from server_helpers import post, running_server

import hybrid
from hybrid import recipes
from hybrid.server.chat_template import ChatTemplateError, TokenizerChatTemplate, load_chat_template

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

TEMPLATE = ("{{ bos_token }}{% if tools %}[TOOLS]{% for t in tools %}{{ t['function']['name'] }};{% endfor %}"
            "[/TOOLS]{% endif %}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
            "{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c['function']['name'] }}"
            "({{ c['function']['arguments']['city'] }}){% endfor %}{% endif %}{{ eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]


@pytest.fixture
def folder(tmp_path):
    """A byte-level BPE tokenizer with BOS/EOS specials and the template, written by transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin|>", eos_token="<|end|>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(tmp_path)
    return tmp_path


def test_tokenizer_renders_exactly_what_transformers_renders(folder):
    from transformers import PreTrainedTokenizerFast

    t = load_chat_template(folder)
    assert isinstance(t, TokenizerChatTemplate) and not t.is_default and t.source == TEMPLATE
    ref = PreTrainedTokenizerFast.from_pretrained(str(folder))
    messages = [{"role": "user", "content": "Rain in Oslo?"}]
    got = t.render(messages, tools=TOOLS)
    assert got == ref.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert got == "<|begin|>[TOOLS]weather;[/TOOLS]<user>Rain in Oslo?<|end|><assistant>"
    # an assistant tool call with OpenAI's JSON-string arguments reaches the template as a dict
    call = [{"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]
    text = t.render([*messages, {"role": "assistant", "content": None, "tool_calls": call}], tools=TOOLS)
    assert "CALL weather(Oslo)" in text
    with pytest.raises(ChatTemplateError, match="arguments are not JSON"):
        t.render([{"role": "assistant", "tool_calls": [{"function": {"name": "w", "arguments": "{oops"}}]}])


def test_server_passes_tools_to_the_tokenizer_template(folder):
    torch.manual_seed(0)
    model = hybrid.HybridLM(recipes.get("llama-tiny")).eval()
    template = load_chat_template(folder)
    tok = hybrid.load_tokenizer(None)  # the model's own ids; the template's text is what is measured
    messages = [{"role": "user", "content": "Rain?"}]
    with running_server(model, chat_template=template) as (server, _, _):
        status, r = post(server, "/v1/chat/completions",
                         {"messages": messages, "tools": TOOLS, "max_tokens": 2, "temperature": 0})
        assert status == 200, r
        prompt = template.render(messages, tools=TOOLS)
        assert "[TOOLS]weather;" in prompt
        assert r["usage"]["prompt_tokens"] == len(tok.encode(prompt, add_special_tokens=False))
        status, r = post(server, "/v1/chat/completions", {"messages": messages, "tools": TOOLS,
                                                           "tool_choice": "none", "max_tokens": 2})
        assert status == 200 and r["usage"]["prompt_tokens"] == len(
            tok.encode(template.render(messages), add_special_tokens=False))
        status, r = post(server, "/v1/chat/completions", {"messages": messages, "tools": [{"type": "x"}]})
        assert status == 400 and r["error"]["param"] == "tools"
        status, r = post(server, "/v1/chat/completions", {"messages": messages, "tools": TOOLS,
                                                           "tool_choice": "required"})
        assert status == 400 and r["error"]["param"] == "tool_choice"


def test_folder_without_tokenizer_json_keeps_our_renderer(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "X{{ messages | length }}"}))
    t = load_chat_template(tmp_path)
    assert not isinstance(t, TokenizerChatTemplate) and t.render([{"role": "user", "content": "a"}]) == "X1"
