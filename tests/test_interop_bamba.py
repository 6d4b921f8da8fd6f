"""BambaForCausalLM <-> HybridLM: logits and greedy tokens against transformers, export, refusals."""

import dataclasses

import pytest
import torch
from hf_parity import assert_export_round_trip, assert_parity, build_hf, edited_checkpoint
from safetensors.torch import load_file, save_file

import hybrid
from hybrid import CheckpointError

transformers = pytest.importorskip("transformers")
from transformers import BambaConfig, BambaForCausalLM  # noqa: E402

VOCAB = 128
CONFIGS = {
    # GQA, n_groups 2, attention in the middle, untied, partial RoPE 0.5 (Bamba's default), head_dim != hidden/heads
    "gqa-groups2": dict(num_hidden_layers=4, attn_layer_indices=[1], num_attention_heads=4, num_key_value_heads=2,
                        head_dim=12,
                        mamba_n_heads=8, mamba_n_groups=2, tie_word_embeddings=False),
    # MHA, n_groups 1, attention first and last, tied, biases, full RoPE, a dt limit, a chunk shorter than L
    "mha-tied-bias": dict(num_hidden_layers=3, attn_layer_indices=[0, 2], num_attention_heads=4,
                          num_key_value_heads=4, mamba_n_heads=4, mamba_n_groups=1, tie_word_embeddings=True,
                          attention_bias=True, mlp_bias=True, mamba_proj_bias=True,
                          rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 1.0},
                          time_step_limit=(0.01, 0.5), mamba_chunk_size=8),
}


def hf_config(**kw) -> BambaConfig:
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, mamba_d_state=8, mamba_d_conv=4,
                mamba_expand=2, mamba_chunk_size=16, rms_norm_eps=1e-5, pad_token_id=0)
    return BambaConfig(**{**base, **kw})


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"bamba-{request.param}")
    hf_model = build_hf(BambaForCausalLM, hf_config(**CONFIGS[request.param]), path)
    return hf_model, hybrid.from_pretrained(path), path


def test_config_maps_exactly(pair):
    hf_model, ours, _ = pair
    c, cfg = hf_model.config, ours.config
    expected = "".join("*-" if i in c.attn_layer_indices else "M-" for i in range(c.num_hidden_layers))
    assert cfg.pattern == expected
    assert cfg.attention.rotary_fraction == c.rope_parameters["partial_rotary_factor"]
    assert cfg.mamba2.n_groups == cfg.mamba2.norm_groups == c.mamba_n_groups
    assert cfg.mamba2.dt_limit == tuple(c.time_step_limit)
    assert cfg.tie_embeddings == c.tie_word_embeddings


def test_logits_and_greedy_match_transformers(pair):
    hf_model, ours, _ = pair
    assert_parity(hf_model, ours, VOCAB)


def test_export_round_trip(pair, tmp_path):
    _, ours, _ = pair
    assert_export_round_trip(ours, "bamba", BambaForCausalLM, tmp_path, VOCAB)


def test_export_refuses_what_bamba_cannot_represent(tmp_path):
    base = hybrid.HybridConfig(vocab_size=VOCAB, d_model=32, pattern="M-*-",
                               mamba2=hybrid.Mamba2Config(head_dim=16, d_state=8),
                               attention=hybrid.AttentionConfig(n_heads=4, rotary_fraction=0.5))
    cases = {
        "M*--": "must alternate",
        "m-*-": "must alternate",
        "MEM-": "must alternate",
    }
    for pattern, msg in cases.items():
        with pytest.raises(CheckpointError, match=msg):
            model = hybrid.HybridLM(dataclasses.replace(base, pattern=pattern))
            hybrid.save_pretrained(model, tmp_path / "x", format="bamba")
    variants = [
        (dict(mlp=hybrid.MLPConfig(activation="relu2", gated=False)), "SwiGLU"),
        (dict(attention=hybrid.AttentionConfig(n_heads=4, rotary_fraction=0.0)), "no RoPE"),
        (dict(attention=hybrid.AttentionConfig(n_heads=4, sliding_window=8)), "sliding_window"),
        (dict(attention=hybrid.AttentionConfig(n_heads=4, qkv_bias=True)), "one bias flag"),
        (dict(mamba2=hybrid.Mamba2Config(head_dim=16, d_state=8, n_groups=2, norm_groups=1)), "norm_groups"),
        (dict(mamba2=hybrid.Mamba2Config(head_dim=16, d_state=8, d_inner=48)), "mamba_expand"),
        (dict(pattern="M-M-"), "no attention layer"),
    ]
    for change, msg in variants:
        with pytest.raises(CheckpointError, match=msg):
            hybrid.save_pretrained(hybrid.HybridLM(dataclasses.replace(base, **change)), tmp_path / "y", format="bamba")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


@pytest.mark.parametrize("change, msg", [
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}), "rope_type='linear'"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(rope_scaling={"type": "dynamic", "factor": 2.0}), "rope_scaling"),
    (dict(sliding_window=16), "sliding_window"),
])
def test_unsupported_options_are_refused_by_name(pair, tmp_path, change, msg):
    _, _, path = pair
    with pytest.raises(CheckpointError, match=msg):
        hybrid.from_pretrained(edited_checkpoint(path, tmp_path, lambda cfg: cfg.update(change)))


def test_missing_and_misshaped_tensors_are_named(pair, tmp_path):
    _, _, path = pair
    state = load_file(str(path / "model.safetensors"))
    i = min(int(k.split(".")[2]) for k in state if k.endswith(".mamba.dt_bias"))
    del state[f"model.layers.{i}.mamba.dt_bias"]
    state["model.layers.0.feed_forward.up_proj.weight"] = torch.zeros(3, 32)
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(CheckpointError) as err:
        hybrid.from_pretrained(tmp_path)
    assert f"missing tensors (1): layers.{2 * i}.mixer.dt_bias" in str(err.value)
    assert "layers.1.mixer.up_proj.weight: checkpoint (3, 32) vs model (48, 32)" in str(err.value)


def test_hybrid_recipe_exports_exactly(tmp_path):
    """A model built here (full RoPE, GQA, attention in the last of 8 blocks) goes to Bamba and back."""
    from hybrid import recipes
    model = hybrid.HybridLM(recipes.get("hybrid-1to7-tiny")).eval()
    assert_export_round_trip(model, "bamba", BambaForCausalLM, tmp_path, model.config.vocab_size)
