"""Qwen3NextForCausalLM <-> HybridLM: logits and greedy tokens against transformers, cached decode against our
full forward, export round trip, refusals."""

import dataclasses

import pytest
import torch
from conftest import rel_err
from hf_parity import assert_export_round_trip, assert_parity, build_hf, edited_checkpoint
from interop_helpers import LOGIT_TOL, forward_greedy, hf_logits, ours_greedy

import hybrid
from hybrid import CheckpointError

transformers = pytest.importorskip("transformers")
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM  # noqa: E402

VOCAB = 128
CONFIGS = {
    # dense MLPs (num_experts 0), 3:1 layout, GQA, 2 key heads serving 4 value heads, head_v_dim != head_k_dim,
    # default partial RoPE (0.25)
    "dense-3to1": dict(num_hidden_layers=4, num_experts=0, linear_num_key_heads=2, linear_num_value_heads=4,
                       linear_key_head_dim=8, linear_value_head_dim=6),
    # experts with a shared expert on all but layer 1, top-2 unnormalised, attention at 1 and 4, tied, biases,
    # partial RoPE 0.5, one key head for 3 value heads, a 3-tap conv
    "moe-mixed": dict(num_hidden_layers=5, layer_types=["linear_attention", "full_attention", "linear_attention",
                                                        "linear_attention", "full_attention"],
                      num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, moe_intermediate_size=16,
                      shared_expert_intermediate_size=24, mlp_only_layers=[1], tie_word_embeddings=True,
                      attention_bias=True, linear_num_key_heads=1, linear_num_value_heads=3, linear_key_head_dim=8,
                      linear_value_head_dim=8, linear_conv_kernel_dim=3,
                      rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5}),
}


def hf_config(**kw) -> Qwen3NextConfig:
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, rms_norm_eps=1e-6, pad_token_id=0)
    return Qwen3NextConfig(**{**base, **kw})


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"qwen3next-{request.param}")
    hf_model = build_hf(Qwen3NextForCausalLM, hf_config(**CONFIGS[request.param]), path)
    return hf_model, hybrid.from_pretrained(path), path


def test_config_maps_exactly(pair):
    hf_model, ours, _ = pair
    c, cfg = hf_model.config, ours.config
    mixers = ["G" if t == "linear_attention" else "*" for t in c.layer_types]
    assert cfg.pattern[::2] == "".join(mixers)
    assert cfg.norm_offset == 1.0
    assert cfg.attention.output_gate and cfg.attention.qk_norm
    assert cfg.attention.rotary_fraction == c.rope_parameters["partial_rotary_factor"]
    g = cfg.gated_deltanet
    assert (g.n_heads, g.n_k_heads, g.head_k_dim, g.head_v_dim, g.d_conv) == (
        c.linear_num_value_heads, c.linear_num_key_heads, c.linear_key_head_dim, c.linear_value_head_dim,
        c.linear_conv_kernel_dim)
    if c.num_experts:
        assert cfg.pattern[1::2] == "".join("-" if i in c.mlp_only_layers else "E" for i in range(len(mixers)))
        assert cfg.moe.shared_d_ff == c.shared_expert_intermediate_size and cfg.moe.shared_gate
    assert cfg.tie_embeddings == c.tie_word_embeddings


def test_logits_and_greedy_match_transformers(pair):
    hf_model, ours, _ = pair
    assert_parity(hf_model, ours, VOCAB)


def test_logits_match_across_chunk_boundaries(pair):
    """Longer than the 64-token chunk of both chunked delta-rule forms."""
    hf_model, ours, _ = pair
    ids = torch.randint(0, VOCAB, (1, 150), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        err = rel_err(ours(ids), hf_logits(hf_model, ids))
    assert err < LOGIT_TOL, f"logits differ: {err:.2e}"


def test_engine_decode_equals_full_forward(pair):
    """The engine (paged KV, conv/recurrent state slots, chunked prefill, one-token steps) gives the tokens of
    our full forward re-run per token."""
    _, ours, _ = pair
    prompt = torch.randint(0, VOCAB, (2, 19), generator=torch.Generator().manual_seed(3))
    assert torch.equal(ours_greedy(ours, prompt), forward_greedy(ours, prompt))
    engine = hybrid.Engine(ours, num_blocks=32, block_size=4, max_batch_tokens=8)  # prompts chunked over steps
    rids = [engine.add_request(p, hybrid.SamplingParams(max_new_tokens=8)) for p in prompt.tolist()]
    engine.run()
    for rid, p in zip(rids, prompt, strict=True):
        assert engine.requests[rid].output == forward_greedy(ours, p[None], 8)[0].tolist()


def test_export_round_trip(pair, tmp_path):
    _, ours, _ = pair
    assert_export_round_trip(ours, "qwen3_next", Qwen3NextForCausalLM, tmp_path, VOCAB)
    assert hybrid.interop.pick_hf_format(ours.config) == "qwen3_next"


def test_recipe_with_qwen3_next_features_exports(tmp_path):
    """Our own qwen3next-like model, given Qwen3-Next's norms and gated attention, goes to transformers and back."""
    from hybrid import recipes
    cfg = recipes.get("qwen3next-like-tiny")
    a = cfg.attention
    # the format has no chunk size (transformers chunks by 64, as our default)
    gdn = dataclasses.replace(cfg.gated_deltanet, chunk_size=64)
    cfg = dataclasses.replace(cfg, norm_offset=1.0, gated_deltanet=gdn,
                              attention=dataclasses.replace(
        a, output_gate=True, qk_norm=True, rotary_fraction=0.25 if a.head_dim % 8 == 0 else 0.5))
    torch.manual_seed(0)
    model = hybrid.HybridLM(cfg).eval()
    with torch.no_grad():  # norms start at 0 (scale 1): give them information
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    assert_export_round_trip(model, "qwen3_next", Qwen3NextForCausalLM, tmp_path, cfg.vocab_size)


def test_export_refuses_what_qwen3_next_cannot_represent(pair, tmp_path):
    _, ours, _ = pair
    cfg = ours.config
    variants = [
        (dict(norm_offset=0.0), "norm_offset"),
        (dict(attention=dataclasses.replace(cfg.attention, output_gate=False)), "output_gate"),
        (dict(pattern="M-" + cfg.pattern[2:]), "must alternate"),
        (dict(pattern="".join("G" if s == "*" else s for s in cfg.pattern)), "no attention layer"),
    ]
    for change, msg in variants:
        with pytest.raises(CheckpointError, match=msg):
            hybrid.save_pretrained(hybrid.HybridLM(dataclasses.replace(cfg, **change)), tmp_path / "x",
                                   format="qwen3_next")
    # formats that predate the options refuse them rather than drop them
    with pytest.raises(CheckpointError, match="norm_offset"):
        hybrid.save_pretrained(ours, tmp_path / "y", format="bamba")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


@pytest.mark.parametrize("change, msg", [
    (dict(quantization_config={"quant_method": "fp8"}), "quantization_config"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(use_sliding_window=True), "use_sliding_window"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}), "'yarn'"),
    (dict(linear_num_key_heads=2, linear_num_value_heads=3), "linear_num_value_heads"),
    (dict(layer_types=["sliding_attention"] * 5), "sliding_attention"),
])
def test_unsupported_options_are_refused_by_name(pair, tmp_path, change, msg):
    _, _, path = pair
    with pytest.raises(CheckpointError, match=msg):
        hybrid.from_pretrained(edited_checkpoint(path, tmp_path, lambda cfg: cfg.update(change)))
