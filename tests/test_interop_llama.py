"""Llama / Qwen2 / Mistral checkpoints written by transformers load with matching logits and greedy tokens."""

import dataclasses
import json

import pytest
import torch
from interop_helpers import assert_matches_hf, randomize_, write_word_tokenizer

import hybrid

transformers = pytest.importorskip("transformers")

V = 199
BASE = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=128)

CASES = {
    "llama-gqa": ("LlamaConfig", "LlamaForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2)),
    "llama-mha-tied-bias-gelu": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
        hidden_act="gelu_pytorch_tanh", rms_norm_eps=1e-5)),
    "llama-head_dim-llama3-rope": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=1, head_dim=24,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    "llama-linear-rope": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2,
        rope_parameters={"rope_type": "linear", "rope_theta": 1000.0, "factor": 2.5})),
    "qwen2-gqa": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2)),
    "qwen2-mha-tied": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_attention_heads=2, num_key_value_heads=2,
                                                             tie_word_embeddings=True)),
    "mistral-window": ("MistralConfig", "MistralForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2,
                                                                 sliding_window=6)),
    "mistral-mha-nowindow": ("MistralConfig", "MistralForCausalLM", dict(num_attention_heads=4, num_key_value_heads=4,
                                                                       sliding_window=None, head_dim=8)),
    "qwen2-all-layers-window": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=5, max_window_layers=0)),
}


def build_hf(case: str, **extra):
    cfg_cls, model_cls, kw = CASES[case]
    cfg = getattr(transformers, cfg_cls)(**BASE, **kw, **extra)
    cfg._attn_implementation = "eager"
    return randomize_(getattr(transformers, model_cls)(cfg)).float().eval()


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_and_greedy_match_transformers(case, tmp_path):
    ref = build_hf(case)
    ref.save_pretrained(tmp_path)
    ours = hybrid.from_pretrained(tmp_path)
    assert ours.config.pattern == "*-" * BASE["num_hidden_layers"]
    assert_matches_hf(ours, ref, V, length=20)


def test_window_is_exercised(tmp_path):
    """The Mistral window (6) is shorter than the test sequence: dropping it changes the logits."""
    ref = build_hf("mistral-window")
    ref.save_pretrained(tmp_path)
    ours = hybrid.from_pretrained(tmp_path)
    assert ours.config.attention.sliding_window == 6
    ids = torch.randint(0, V, (1, 20))
    with torch.no_grad():
        windowed = ours(ids)
        for layer in ours.layers:
            if layer.kind == "attention":
                layer.mixer.cfg = dataclasses.replace(layer.mixer.cfg, sliding_window=None)
        full = ours(ids)
    assert not torch.allclose(windowed[:, 6:], full[:, 6:])
    assert torch.allclose(windowed[:, :6], full[:, :6], atol=1e-6)


def test_rope_scaling_config_round_trip_and_validation(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    cfg = hybrid.HybridConfig(vocab_size=64, d_model=32, pattern="*-",
                              attention=hybrid.AttentionConfig(n_heads=4, rope_scaling=scaling))
    assert hybrid.HybridConfig.from_json(cfg.to_json()) == cfg
    model = hybrid.HybridLM(cfg).eval()
    hybrid.save_pretrained(model, tmp_path)
    ids = torch.randint(0, 64, (1, 9))
    with torch.no_grad():
        assert torch.equal(hybrid.from_pretrained(tmp_path)(ids), model(ids))
    for bad, msg in (({"rope_type": "yarn", "factor": 2.0}, "rope_type in"),
                     ({"rope_type": "linear"}, "needs exactly the keys"),
                     ({**scaling, "low_freq_factor": 5.0}, "high_freq_factor > low_freq_factor")):
        with pytest.raises(hybrid.ConfigError, match=msg):
            hybrid.HybridConfig(vocab_size=64, d_model=32, pattern="*-",
                                attention=hybrid.AttentionConfig(n_heads=4, rope_scaling=bad))


def test_sharded_checkpoint(tmp_path):
    ref = build_hf("llama-gqa")
    ref.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert_matches_hf(hybrid.from_pretrained(tmp_path), ref, V, greedy="forward")


def test_transformers4_style_rope_config(tmp_path):
    """Checkpoints written before transformers 5 keep rope_theta and rope_scaling at the top level."""
    ref = build_hf("llama-head_dim-llama3-rope")
    ref.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params.pop("rope_theta")
    cfg["rope_scaling"] = params
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ours = hybrid.from_pretrained(tmp_path)
    assert ours.config.attention.rope_theta == 500000.0
    assert ours.config.attention.rope_scaling["rope_type"] == "llama3"
    assert_matches_hf(ours, ref, V, greedy="forward")


def test_checkpoint_tokenizer_is_attached(tmp_path):
    build_hf("llama-gqa").save_pretrained(tmp_path)
    assert hybrid.from_pretrained(tmp_path).tokenizer is None  # a folder without one
    write_word_tokenizer(tmp_path, ["<s>", "</s>", "<unk>", "hello", "world", "hybrid"])
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    # transformers wrote Llama's default ids (1, 2) here; the generation config's ids win, so make them agree
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": [1, 5]}))
    model = hybrid.from_pretrained(tmp_path)
    assert model.tokenizer.encode("hello hybrid world", add_special_tokens=False) == [3, 5, 4]
    assert (model.tokenizer.bos_token_id, model.tokenizer.eos_token_ids) == (0, (1, 5))
    assert model.tokenizer.decode([3, 4]) == "hello world"
