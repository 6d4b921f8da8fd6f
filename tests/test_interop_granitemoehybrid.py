"""GraniteMoeHybridForCausalLM <-> HybridLM: logits and greedy tokens against transformers (dense and MoE
configs), export round trips, the same weights as Bamba, ``format="hf"``'s choice, and refusals."""

import dataclasses

import pytest
import torch
from conftest import rel_err
from hf_parity import assert_export_round_trip, assert_parity, build_hf, edited_checkpoint
from interop_helpers import LOGIT_TOL, hf_logits

import hybrid
from hybrid import CheckpointError
from hybrid.interop import pick_hf_format

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    BambaForCausalLM,
    GraniteMoeHybridConfig,
    GraniteMoeHybridForCausalLM,
)

VOCAB = 128
HEAD_DIM = 8  # hidden 32 / 4 heads
CONFIGS = {
    # dense (no experts: shared_mlp is the block MLP), GQA, groups 2, RoPE, attention in the middle, untied
    "dense-gqa-rope": dict(num_hidden_layers=4, layer_types=["linear_attention", "full_attention",
                                                             "linear_attention", "linear_attention"],
                           num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=8, mamba_n_groups=2,
                           num_local_experts=0, shared_intermediate_size=48, position_embedding_type="rope",
                           rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
    # dense, MHA, no RoPE (Granite-4.0-H's choice), attention first and last, tied, biases, a dt limit
    "dense-nope-tied-bias": dict(num_hidden_layers=3, layer_types=["full_attention", "linear_attention",
                                                                   "full_attention"],
                                 num_attention_heads=4, num_key_value_heads=4, mamba_n_heads=4, mamba_n_groups=1,
                                 num_local_experts=0, shared_intermediate_size=40, position_embedding_type=None,
                                 tie_word_embeddings=True, attention_bias=True, mamba_proj_bias=True,
                                 time_step_limit=(0.01, 0.5), mamba_chunk_size=8),
    # experts only (no shared expert: our E), top-2 of 4
    "moe": dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], num_attention_heads=4,
                num_key_value_heads=2, mamba_n_heads=8, mamba_n_groups=1, num_local_experts=4, num_experts_per_tok=2,
                intermediate_size=24, shared_intermediate_size=0, position_embedding_type="rope"),
}


def hf_config(**kw) -> GraniteMoeHybridConfig:
    base = dict(vocab_size=VOCAB, hidden_size=32, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
                mamba_chunk_size=16, rms_norm_eps=1e-5, pad_token_id=0, attention_multiplier=HEAD_DIM ** -0.5)
    return GraniteMoeHybridConfig(**{**base, **kw})


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"granite-{request.param}")
    hf_model = build_hf(GraniteMoeHybridForCausalLM, hf_config(**CONFIGS[request.param]), path)
    return hf_model, hybrid.from_pretrained(path), path


@pytest.fixture(scope="module")
def dense_folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("granite-refusals")
    build_hf(GraniteMoeHybridForCausalLM, hf_config(**CONFIGS["dense-gqa-rope"]), path)
    return path


def test_config_maps_exactly(pair):
    hf_model, ours, _ = pair
    c, cfg = hf_model.config, ours.config
    ffn = "E" if c.num_local_experts else "-"
    assert cfg.pattern == "".join(("M" if t == "linear_attention" else "*") + ffn for t in c.layer_types)
    assert cfg.attention.rotary_fraction == (1.0 if c.position_embedding_type == "rope" else 0.0)
    assert cfg.mamba2.n_groups == cfg.mamba2.norm_groups == c.mamba_n_groups
    assert cfg.mamba2.dt_limit == tuple(c.time_step_limit)
    assert cfg.tie_embeddings == c.tie_word_embeddings
    if ffn == "-":
        assert cfg.mlp.d_ff == c.shared_intermediate_size and cfg.mlp.gated
    else:
        assert (cfg.moe.n_experts, cfg.moe.top_k, cfg.moe.d_ff) == (c.num_local_experts, c.num_experts_per_tok,
                                                                    c.intermediate_size)
        assert cfg.moe.normalize_top_k


def test_logits_and_greedy_match_transformers(pair):
    hf_model, ours, _ = pair
    assert_parity(hf_model, ours, VOCAB)


def test_export_round_trip(pair, tmp_path):
    _, ours, _ = pair
    assert_export_round_trip(ours, "granitemoehybrid", GraniteMoeHybridForCausalLM, tmp_path, VOCAB)


def test_export_writes_the_hub_tensor_names(pair, tmp_path):
    """vLLM and llama.cpp read the hub layout (fused ``input_linear``, ``router.layer``), not transformers 5's
    in-memory names; and a dense export has no expert tensors at all."""
    from safetensors.torch import load_file
    _, ours, _ = pair
    names = set(load_file(str(hybrid.save_pretrained(ours, tmp_path / "g", format="granitemoehybrid")
                              / "model.safetensors")))
    experts = "E" in ours.config.pattern
    assert ("model.layers.0.block_sparse_moe.input_linear.weight" in names) == experts
    assert ("model.layers.0.block_sparse_moe.router.layer.weight" in names) == experts
    assert ("model.layers.0.shared_mlp.input_linear.weight" in names) == (not experts)
    assert ("lm_head.weight" in names) == (not ours.config.tie_embeddings)
    assert not any("experts." in n or "gate_proj" in n for n in names)


def test_bamba_weights_export_as_granite_with_the_same_logits(tmp_path):
    """Every Bamba-style hybrid we build serves as GraniteMoeHybrid: transformers' Granite on the exported
    folder gives the logits transformers' Bamba gives on the Bamba export of the same model."""
    from hybrid import recipes
    cfg = dataclasses.replace(recipes.get("hybrid-1to7-tiny"), vocab_size=VOCAB)
    model = hybrid.HybridLM(cfg).eval()
    hybrid.save_pretrained(model, tmp_path / "bamba", format="bamba")
    assert pick_hf_format(cfg) == "granitemoehybrid"
    hybrid.save_pretrained(model, tmp_path / "granite", format="hf")
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
    kw = dict(attn_implementation="eager", dtype=torch.float32)
    bamba = hf_logits(BambaForCausalLM.from_pretrained(tmp_path / "bamba", **kw).eval(), ids)
    granite = hf_logits(GraniteMoeHybridForCausalLM.from_pretrained(tmp_path / "granite", **kw).eval(), ids)
    assert rel_err(granite, bamba) < LOGIT_TOL
    with torch.no_grad():
        assert rel_err(model(ids), granite) < LOGIT_TOL


def test_export_refuses_what_granite_cannot_represent(tmp_path):
    base = hybrid.HybridConfig(vocab_size=VOCAB, d_model=32, pattern="M-*-",
                               mamba2=hybrid.Mamba2Config(head_dim=16, d_state=8),
                               attention=hybrid.AttentionConfig(n_heads=4))
    variants = [
        (dict(pattern="M*--"), "must alternate"),
        (dict(pattern="m-*-"), "must alternate"),
        (dict(pattern="MEM-*-"), "dense MLP"),
        (dict(mlp=hybrid.MLPConfig(activation="relu2", gated=False)), "SwiGLU"),
        (dict(mlp=hybrid.MLPConfig(bias=True)), "with biases"),
        (dict(attention=hybrid.AttentionConfig(n_heads=4, rotary_fraction=0.5)), "whole head"),
        (dict(attention=hybrid.AttentionConfig(n_heads=4, sliding_window=8)), "sliding_window"),
        (dict(attention=hybrid.AttentionConfig(n_heads=4, qkv_bias=True)), "one bias flag"),
        (dict(attention=hybrid.AttentionConfig(n_heads=4, rope_scaling={"rope_type": "linear", "factor": 2.0})),
         "plain RoPE"),
        (dict(mamba2=hybrid.Mamba2Config(head_dim=16, d_state=8, n_groups=2, norm_groups=1)), "norm_groups"),
        (dict(mamba2=hybrid.Mamba2Config(head_dim=16, d_state=8, d_inner=48)), "mamba_expand"),
        (dict(pattern="M-M-"), "no attention layer"),
        (dict(attention=hybrid.AttentionConfig(n_heads=4, head_dim=16)), "hidden_size / num_attention_heads"),
        (dict(pattern="ME*E", moe=hybrid.MoEConfig(n_experts=4, normalize_top_k=False)), "normalize_top_k"),
        (dict(pattern="ME*E", moe=hybrid.MoEConfig(n_experts=4, normalize_top_k=True, activation="gelu")),
         "SwiGLU"),
    ]
    for change, msg in variants:
        with pytest.raises(CheckpointError, match=msg):
            hybrid.save_pretrained(hybrid.HybridLM(dataclasses.replace(base, **change)), tmp_path / "y",
                                   format="granitemoehybrid")
    assert not (tmp_path / "y").exists()


@pytest.mark.parametrize("change, msg", [
    (dict(embedding_multiplier=12.0), "embedding_multiplier=12.0"),
    (dict(residual_multiplier=0.22), "residual_multiplier=0.22"),
    (dict(logits_scaling=6.0), "logits_scaling=6.0"),
    (dict(attention_multiplier=0.0078125), "attention_multiplier"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(position_embedding_type="alibi"), "position_embedding_type='alibi'"),
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}), "rope_type='linear'"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
     "partial_rotary_factor"),
    (dict(num_local_experts=4, shared_intermediate_size=16), "shared expert"),
    (dict(layer_types=["linear_attention", "sliding_attention", "linear_attention", "linear_attention"]),
     "sliding_attention"),
    (dict(layer_types=["linear_attention"]), "layer_types has 1 entries"),
])
def test_unsupported_options_are_refused_by_name(dense_folder, tmp_path, change, msg):
    with pytest.raises(CheckpointError, match=msg):
        hybrid.from_pretrained(edited_checkpoint(dense_folder, tmp_path, lambda cfg: cfg.update(change)))
