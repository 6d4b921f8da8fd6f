"""JambaForCausalLM <-> HybridLM: logits and greedy tokens against transformers (Mamba-1 with dt/B/C
norms, attention without RoPE, top-k routed experts), export, refusals."""

import dataclasses
import json

import pytest
import torch
from hf_parity import assert_export_round_trip, assert_parity, build_hf, edited_checkpoint
from safetensors.torch import load_file, save_file

import hybrid
from hybrid import CheckpointError

transformers = pytest.importorskip("transformers")
from transformers import JambaConfig, JambaForCausalLM  # noqa: E402

VOCAB = 120
CONFIGS = {
    # GQA, experts in every other layer (top-2 of 4), attention in layer 1 of each pair, untied, head_dim 16
    "gqa-moe": dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, attn_layer_period=2,
                    attn_layer_offset=1, num_experts=4, num_experts_per_tok=2, expert_layer_period=2,
                    expert_layer_offset=1, tie_word_embeddings=False),
    # MHA, dense (num_experts=1), attention first of three, tied, explicit dt_rank, biases in the Mamba projections
    "mha-dense-tied": dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, attn_layer_period=3,
                           attn_layer_offset=0, num_experts=1, tie_word_embeddings=True, mamba_dt_rank=6,
                           mamba_proj_bias=True),
    # experts on every layer, top-1 of 3, attention at layer 2 of 3
    "moe-everywhere": dict(num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, attn_layer_period=3,
                           attn_layer_offset=2, num_experts=3, num_experts_per_tok=1, expert_layer_period=1,
                           expert_layer_offset=0, tie_word_embeddings=False),
}


def hf_config(**kw) -> JambaConfig:
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, mamba_d_state=8, mamba_d_conv=4,
                mamba_expand=2, rms_norm_eps=1e-6, pad_token_id=0)
    return JambaConfig(**{**base, **kw})


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"jamba-{request.param}")
    hf_model = build_hf(JambaForCausalLM, hf_config(**CONFIGS[request.param]), path)
    return hf_model, hybrid.from_pretrained(path), path


def test_config_maps_exactly(pair):
    hf_model, ours, _ = pair
    c, cfg = hf_model.config, ours.config
    mixers = "".join("*" if t == "attention" else "m" for t in c.layers_block_type)
    ffns = "".join("E" if n > 1 else "-" for n in c.layers_num_experts)
    assert cfg.pattern == "".join(m + f for m, f in zip(mixers, ffns, strict=True))
    assert cfg.mamba1.inner_norms and cfg.attention.rotary_fraction == 0.0
    assert cfg.moe.top_k == c.num_experts_per_tok and not cfg.moe.normalize_top_k
    assert cfg.tie_embeddings == c.tie_word_embeddings


def test_logits_and_greedy_match_transformers(pair):
    hf_model, ours, _ = pair
    assert_parity(hf_model, ours, VOCAB)


def test_export_round_trip(pair, tmp_path):
    _, ours, _ = pair
    assert_export_round_trip(ours, "jamba", JambaForCausalLM, tmp_path, VOCAB)


@pytest.mark.parametrize("pair", ["gqa-moe", "moe-everywhere"], indirect=True)
def test_fused_expert_layout_loads_identically(pair, tmp_path):
    """transformers' in-memory layout (experts.gate_up_proj [E, 2F, D], experts.down_proj [E, D, F])."""
    hf_model, ours, path = pair
    assert "E" in ours.config.pattern
    state = load_file(str(path / "model.safetensors"))
    fused = {k: v for k, v in state.items() if ".experts." not in k}
    for name, p in hf_model.named_parameters():
        if ".experts." in name:
            fused[name] = p.detach().clone()
    save_file(fused, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    again = hybrid.from_pretrained(tmp_path)
    for k, v in ours.state_dict().items():
        assert torch.equal(v, again.state_dict()[k]), k


def test_export_refuses_what_jamba_cannot_represent(tmp_path):
    base = hybrid.HybridConfig(vocab_size=VOCAB, d_model=32, pattern="m-*E",
                               mamba1=hybrid.Mamba1Config(d_state=8, inner_norms=True),
                               attention=hybrid.AttentionConfig(n_heads=4, rotary_fraction=0.0),
                               mlp=hybrid.MLPConfig(d_ff=40), moe=hybrid.MoEConfig(n_experts=4, top_k=2, d_ff=40))
    variants = [
        (dict(pattern="M-*E"), "must alternate"),
        (dict(pattern="m-*E*-m-"), "attention layers"),  # attention at decoder layers 1 and 2
        (dict(pattern="mEmEm-mE"), "mixture-of-experts layers"),
        (dict(attention=hybrid.AttentionConfig(n_heads=4)), "no RoPE"),
        (dict(mamba1=hybrid.Mamba1Config(d_state=8)), "inner_norms"),
        (dict(moe=hybrid.MoEConfig(n_experts=4, top_k=2, d_ff=40, normalize_top_k=True)), "unnormalised"),
        (dict(moe=hybrid.MoEConfig(n_experts=4, top_k=2, d_ff=48)), "share"),
        (dict(mlp=hybrid.MLPConfig(d_ff=40, activation="gelu")), "SwiGLU"),
        (dict(moe=hybrid.MoEConfig(n_experts=1, top_k=1, d_ff=40)), "dense MLP"),
    ]
    for change, msg in variants:
        with pytest.raises(CheckpointError, match=msg):
            hybrid.save_pretrained(hybrid.HybridLM(dataclasses.replace(base, **change)), tmp_path / "x", format="jamba")
    assert not (tmp_path / "x").exists()


def test_native_model_exports_with_periodic_layers(tmp_path):
    """A model built here (not loaded): periods and offsets are found from the pattern."""
    cfg = hybrid.HybridConfig(vocab_size=VOCAB, d_model=32, pattern="m-mE*-mEm-mE",
                              attention=hybrid.AttentionConfig(n_heads=4, n_kv_heads=1, rotary_fraction=0.0),
                              mamba1=hybrid.Mamba1Config(d_state=8, inner_norms=True), mlp=hybrid.MLPConfig(d_ff=40),
                              moe=hybrid.MoEConfig(n_experts=3, top_k=2, d_ff=40))
    ours = hybrid.HybridLM(cfg).eval()
    assert_export_round_trip(ours, "jamba", JambaForCausalLM, tmp_path, VOCAB)
    hf_cfg = json.loads((tmp_path / "export-jamba" / "config.json").read_text())
    assert (hf_cfg["attn_layer_period"], hf_cfg["attn_layer_offset"]) == (4, 2)  # smallest period that fits
    assert (hf_cfg["expert_layer_period"], hf_cfg["expert_layer_offset"]) == (2, 1)


def test_model_without_attention_is_refused_for_transformers(tmp_path):
    cfg = hybrid.HybridConfig(vocab_size=VOCAB, d_model=32, pattern="m-mE",
                              mamba1=hybrid.Mamba1Config(d_state=8, inner_norms=True), mlp=hybrid.MLPConfig(d_ff=40),
                              moe=hybrid.MoEConfig(n_experts=2, top_k=1, d_ff=40))
    with pytest.raises(CheckpointError, match="no attention layer.*transformers' Jamba"):
        hybrid.save_pretrained(hybrid.HybridLM(cfg), tmp_path, format="jamba")


@pytest.mark.parametrize("change, msg", [
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(sliding_window=8), "sliding_window"),
    (dict(attn_layer_offset=5, attn_layer_period=2), "attn_layer_offset"),
])
def test_unsupported_options_are_refused_by_name(pair, tmp_path, change, msg):
    _, _, path = pair
    with pytest.raises(CheckpointError, match=msg):
        hybrid.from_pretrained(edited_checkpoint(path, tmp_path, lambda cfg: cfg.update(change)))


def test_missing_expert_and_misshaped_tensor_are_named(pair, tmp_path):
    _, ours, path = pair
    state = load_file(str(path / "model.safetensors"))
    i = min(int(k.split(".")[2]) for k in state if k.endswith(".mamba.x_proj.weight"))
    state[f"model.layers.{i}.mamba.x_proj.weight"] = torch.zeros(5, 64)
    if "E" in ours.config.pattern:
        victim = next(k for k in sorted(state) if k.endswith("experts.1.up_proj.weight"))
        del state[victim]
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    expect = (r"missing experts \[1\]" if "E" in ours.config.pattern
              else rf"layers\.{2 * i}\.mixer\.x_proj\.weight: checkpoint \(5, 64\) vs model "
                   rf"\({ours.config.mamba1.dt_rank + 16}, 64\)")
    with pytest.raises(CheckpointError, match=expect):
        hybrid.from_pretrained(tmp_path)


def test_jamba_moe_recipe_exports_exactly(tmp_path):
    from hybrid import recipes
    model = hybrid.HybridLM(recipes.get("jamba-moe-tiny")).eval()
    assert_export_round_trip(model, "jamba", JambaForCausalLM, tmp_path, model.config.vocab_size)


def test_more_experts_per_token_than_experts_is_refused(pair, tmp_path):
    _, ours, path = pair

    def too_many_per_token(cfg):
        if cfg["num_experts"] == 1:
            cfg["num_experts"] = 2  # make the experts live so their top-k is checked
        cfg["num_experts_per_tok"] = cfg["num_experts"] + 1

    with pytest.raises(hybrid.ConfigError, match="moe.top_k must be in"):
        hybrid.from_pretrained(edited_checkpoint(path, tmp_path, too_many_per_token))

