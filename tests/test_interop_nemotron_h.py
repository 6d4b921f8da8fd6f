"""NemotronHForCausalLM <-> HybridLM: logits and greedy tokens against transformers, export, refusals."""

import dataclasses
import json

import pytest
import torch
from hf_parity import assert_export_round_trip, assert_parity, build_hf, edited_checkpoint
from safetensors.torch import load_file, save_file

import hybrid
from hybrid import CheckpointError

transformers = pytest.importorskip("transformers")
from transformers import NemotronHConfig, NemotronHForCausalLM  # noqa: E402

VOCAB = 160
CONFIGS = {
    # GQA, n_groups 2, attention after the first Mamba, squared-ReLU MLP, untied
    "gqa-groups2": dict(layers_block_type=["linear_attention", "mlp", "full_attention", "mlp", "linear_attention",
                                           "mlp"],
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, n_groups=2, mamba_num_heads=8,
                        tie_word_embeddings=False),
    # MHA, n_groups 1, attention first, "tied" (transformers' NemotronH ignores the flag), head_dim != hidden/heads,
    # biases on Mamba/MLP, relu MLP,
    # a Mamba width that is not expand x hidden, a chunk shorter than the sequence
    "mha-tied": dict(layers_block_type=["full_attention", "linear_attention", "mlp", "linear_attention"],
                     num_attention_heads=2, num_key_value_heads=2, head_dim=12, n_groups=1, mamba_num_heads=6,
                     tie_word_embeddings=True, use_bias=True, mlp_bias=True, mlp_hidden_act="relu", chunk_size=8),
}


def hf_config(**kw) -> NemotronHConfig:
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, ssm_state_size=8, mamba_head_dim=8,
                conv_kernel=4, chunk_size=16, layer_norm_epsilon=1e-5, pad_token_id=0)
    return NemotronHConfig(**{**base, **kw})


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"nemotron_h-{request.param}")
    hf_model = build_hf(NemotronHForCausalLM, hf_config(**CONFIGS[request.param]), path)
    return hf_model, hybrid.from_pretrained(path), path


def test_config_maps_exactly(pair):
    hf_model, ours, _ = pair
    c, cfg = hf_model.config, ours.config
    assert cfg.pattern == c.hybrid_override_pattern  # single sub-layers map 1:1
    assert cfg.attention.rotary_fraction == 0.0 and cfg.attention.head_dim == c.head_dim
    assert not cfg.mlp.gated
    assert cfg.mamba2.d_inner == c.mamba_num_heads * c.mamba_head_dim
    assert cfg.mamba2.n_groups == cfg.mamba2.norm_groups == c.n_groups
    assert cfg.mamba2.dt_limit == (c.time_step_min, float("inf"))
    # transformers' NemotronH never ties, whatever tie_word_embeddings says: a head of its own stays untied
    assert not cfg.tie_embeddings


def test_logits_and_greedy_match_transformers(pair):
    hf_model, ours, _ = pair
    assert_parity(hf_model, ours, VOCAB)


def test_export_round_trip(pair, tmp_path):
    _, ours, _ = pair
    assert_export_round_trip(ours, "nemotron_h", NemotronHForCausalLM, tmp_path, VOCAB)


def test_tied_model_exports_with_the_head_as_a_copy(tmp_path):
    """A tied model (e.g. the nemotronh-small recipe) exports: the flag for vLLM, lm_head as a copy of
    the embedding for transformers (which never ties); transformers matches, and it reads back tied."""
    from hybrid import recipes
    cfg = dataclasses.replace(recipes.get("nemotronh-tiny"), vocab_size=VOCAB, tie_embeddings=True)
    model = hybrid.HybridLM(cfg).eval()
    assert_export_round_trip(model, "nemotron_h", NemotronHForCausalLM, tmp_path, VOCAB)
    state = load_file(str(tmp_path / "export-nemotron_h" / "model.safetensors"))
    assert torch.equal(state["lm_head.weight"], state["backbone.embeddings.weight"])
    hybrid.save_pretrained(model, tmp_path / "hf", format="hf")  # nemotron_h is the format="hf" pick
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["NemotronHForCausalLM"]
    assert hybrid.from_pretrained(tmp_path / "hf").config.tie_embeddings


def test_old_style_pattern_string_loads(pair, tmp_path):
    hf_model, ours, path = pair

    def old_style(cfg):
        cfg["hybrid_override_pattern"] = hf_model.config.hybrid_override_pattern
        del cfg["layers_block_type"]

    assert hybrid.from_pretrained(edited_checkpoint(path, tmp_path, old_style)).config == ours.config


def test_export_refuses_what_nemotron_h_cannot_represent(tmp_path):
    base = hybrid.HybridConfig(vocab_size=VOCAB, d_model=32, pattern="M*-",
                               mamba2=hybrid.Mamba2Config(head_dim=16, d_state=8),
                               attention=hybrid.AttentionConfig(n_heads=4, rotary_fraction=0.0),
                               mlp=hybrid.MLPConfig(activation="relu2", gated=False))
    variants = [
        (dict(attention=hybrid.AttentionConfig(n_heads=4)), "no RoPE"),
        (dict(mlp=hybrid.MLPConfig()), "MLP is gated"),
        (dict(pattern="m*-"), "Mamba-1"),
        (dict(pattern="M-M"), "no attention layer"),
        (dict(pattern="ME"), "mixture-of-experts"),
        (dict(attention=hybrid.AttentionConfig(n_heads=4, rotary_fraction=0.0, qkv_bias=True)), "biases"),
        (dict(mamba2=hybrid.Mamba2Config(head_dim=16, d_state=8, dt_limit=(0.0, 1.0))), "upper bound"),
        (dict(mamba2=hybrid.Mamba2Config(head_dim=16, d_state=8, norm_before_gate=True)), "norm_before_gate"),
    ]
    for change, msg in variants:
        with pytest.raises(CheckpointError, match=msg):
            model = hybrid.HybridLM(dataclasses.replace(base, **change))
            hybrid.save_pretrained(model, tmp_path / "x", format="nemotron_h")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("change, msg", [
    (dict(layers_block_type=["linear_attention", "moe", "full_attention", "mlp"]), "'moe' layer"),
    (dict(mamba_hidden_act="gelu"), "mamba_hidden_act='gelu'"),
    (dict(mlp_hidden_act="tanh"), "mlp_hidden_act='tanh'"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(sliding_window=8), "sliding_window"),
])
def test_unsupported_options_are_refused_by_name(pair, tmp_path, change, msg):
    _, _, path = pair
    with pytest.raises(CheckpointError, match=msg):
        hybrid.from_pretrained(edited_checkpoint(path, tmp_path, lambda cfg: cfg.update(change)))


def test_missing_and_misshaped_tensors_are_named(pair, tmp_path):
    _, _, path = pair
    state = load_file(str(path / "model.safetensors"))
    a_log = next(k for k in state if k.endswith("mixer.A_log"))
    del state[a_log]
    state["backbone.norm_f.weight"] = torch.zeros(31)
    state["mtp.layers.0.norm.weight"] = torch.zeros(32)  # skipped, as transformers skips it
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(CheckpointError) as err:
        hybrid.from_pretrained(tmp_path)
    msg = str(err.value)
    assert f"missing tensors (1): {a_log.removeprefix('backbone.')}" in msg
    assert "norm_f.weight: checkpoint (31,) vs model (32,)" in msg
    assert "unexpected" not in msg


def test_nemotronh_recipe_exports_exactly(tmp_path):
    """A model built here (dt unclamped: time_step_min 0) goes to NemotronH and back."""
    from hybrid import recipes
    model = hybrid.HybridLM(recipes.get("nemotronh-tiny")).eval()
    assert_export_round_trip(model, "nemotron_h", NemotronHForCausalLM, tmp_path, model.config.vocab_size)


def test_model_prefix_loads_like_backbone_prefix(pair, tmp_path):
    """transformers names the trunk ``model.`` in memory and ``backbone.`` on disk; both load."""
    _, ours, path = pair
    state = {k.replace("backbone.", "model.", 1): v for k, v in load_file(str(path / "model.safetensors")).items()}
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    again = hybrid.from_pretrained(tmp_path)
    for k, v in ours.state_dict().items():
        assert torch.equal(v, again.state_dict()[k]), k
