"""``GraniteMoeHybridForCausalLM`` (IBM's Granite-4.0-H: Mamba-2 / attention, dense or MoE) <-> ``HybridLM``.

Why this format: it is the Mamba-2 hybrid that vLLM serves (vLLM 0.32 has no ``BambaForCausalLM``)
and llama.cpp converts (``granitehybrid``). A decoder layer is (Mamba-2 or attention) then a
feed-forward, each pre-normed with RMSNorm: two pattern symbols, like Bamba. The Mamba-2 mixer *is*
Bamba's (transformers builds ``BambaMixer``), so the ``mamba_*`` keys map as in :mod:`.bamba`.

The feed-forward is ``shared_mlp`` (a SwiGLU whose gate and up projections are fused into one
``input_linear``, gate first), plus, when ``num_local_experts > 0``, a mixture of experts
(``block_sparse_moe``) added to it in the same residual. So:

- ``num_local_experts == 0`` (dense): ``shared_mlp`` is the block MLP, our ``-``
  (``shared_intermediate_size`` = ``mlp.d_ff``);
- ``num_local_experts > 0`` and ``shared_intermediate_size == 0``: the experts alone are our ``E``
  (the router softmaxes the top-k logits, i.e. our ``normalize_top_k=True``). A shared expert next to
  the routed ones has no counterpart in our pattern (it would be a second MLP in the *same*
  residual) and is refused.

Granite's scalars must be neutral: ``embedding_multiplier``, ``residual_multiplier`` and
``logits_scaling`` 1, ``attention_multiplier`` ``head_dim ** -0.5`` (the softmax scale we use).
Attention rotates the whole head (``position_embedding_type="rope"``, transformers ignores a
``partial_rotary_factor`` here) or not at all (``None``); q/k/v/o share one bias flag.
"""

from __future__ import annotations

import math

import torch

from ..checkpoint import CheckpointError
from ..config import AttentionConfig, HybridConfig, MLPConfig, MoEConfig
from . import Converter, register
from .bamba import mamba2_export_problems, mamba2_from_hf, mamba2_to_hf
from .common import EXPORT_MAX_POSITIONS, refuse
from .hf_hybrid import (
    attention_mismatches,
    decoder_pair_rules,
    decoder_pairs,
    no_attention,
    require,
    with_defaults,
)
from .rename import Chunk, Rule, Table

ARCH = "GraniteMoeHybridForCausalLM"
# GraniteMoeHybridConfig's defaults (transformers 5.x) for keys a config.json may leave out.
DEFAULTS = dict(
    vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=None, hidden_act="silu", initializer_range=0.02, rms_norm_eps=1e-6,
    tie_word_embeddings=False, rope_parameters=None, attention_bias=False, embedding_multiplier=1.0,
    logits_scaling=1.0, residual_multiplier=1.0, attention_multiplier=1.0, num_local_experts=8,
    num_experts_per_tok=2, shared_intermediate_size=1024, position_embedding_type=None, layer_types=None,
    mamba_n_heads=128, mamba_n_groups=1, mamba_d_state=256, mamba_d_head="auto", mamba_d_conv=4, mamba_expand=2,
    mamba_chunk_size=256, mamba_conv_bias=True, mamba_proj_bias=False, time_step_limit=(0.0, math.inf),
)
# layer_types values: transformers 5 writes linear_attention / full_attention, hub checkpoints mamba / attention
LAYER_SYMBOL = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*"}
# what we write: the hub's names. llama.cpp's converter finds attention layers by ``== "attention"``,
# and transformers 5 maps mamba/attention to its own linear_attention/full_attention when it reads them.
SYMBOL_LAYER = {"M": "mamba", "*": "attention"}
NEUTRAL = ("embedding_multiplier", "residual_multiplier", "logits_scaling")


def layer_symbols(hf: dict) -> str:
    types = hf["layer_types"] or ["linear_attention"] * hf["num_hidden_layers"]
    if len(types) != hf["num_hidden_layers"]:
        raise CheckpointError(f"{ARCH}: layer_types has {len(types)} entries for num_hidden_layers = "
                              f"{hf['num_hidden_layers']}")
    bad = [(i, t) for i, t in enumerate(types) if t not in LAYER_SYMBOL]
    if bad:
        raise refuse(ARCH, f"layer {bad[0][0]} of type {bad[0][1]!r} (known: {sorted(LAYER_SYMBOL)})")
    return "".join(LAYER_SYMBOL[t] for t in types)


def rope_theta_of(hf: dict) -> tuple[float, float]:
    """(rope_theta, rotary_fraction): full RoPE for position_embedding_type "rope", none for None."""
    kind = hf["position_embedding_type"]
    if kind is None:
        return 10000.0, 0.0
    if kind != "rope":
        raise refuse(ARCH, f"position_embedding_type={kind!r} (only 'rope' or None)")
    if hf.get("rope_scaling"):
        raise refuse(ARCH, f"rope_scaling={hf['rope_scaling']!r} (only plain RoPE)")
    rp = hf["rope_parameters"] or {}
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if rope_type != "default":
        raise refuse(ARCH, f"rope_parameters.rope_type={rope_type!r} (only 'default')")
    extra = sorted(set(rp) - {"rope_type", "type", "rope_theta", "partial_rotary_factor"})
    if extra:
        raise refuse(ARCH, f"rope_parameters keys {extra}")
    if float(rp.get("partial_rotary_factor", 1.0)) != 1.0:
        raise refuse(ARCH, f"partial_rotary_factor={rp['partial_rotary_factor']} (transformers' GraniteMoeHybrid "
                           "rotates the whole head whatever it says; the intended model is ambiguous)")
    return float(rp.get("rope_theta", hf.get("rope_theta", 10000.0))), 1.0


def config_from_hf(raw: dict) -> HybridConfig:
    hf = with_defaults(raw, DEFAULTS)
    require(ARCH, hf, "hidden_act", "silu")  # also the Mamba conv activation
    for key in NEUTRAL:
        if float(hf[key]) != 1.0:
            raise refuse(ARCH, f"{key}={hf[key]} (only 1.0: our model has no such scale)")
    d, n_heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or d // n_heads
    if not math.isclose(float(hf["attention_multiplier"]), head_dim ** -0.5, rel_tol=1e-6):
        raise refuse(ARCH, f"attention_multiplier={hf['attention_multiplier']} (only head_dim ** -0.5 = "
                           f"{head_dim ** -0.5:.6g}, the usual softmax scale)")
    if hf.get("sliding_window"):
        raise refuse(ARCH, f"sliding_window={hf['sliding_window']} (GraniteMoeHybrid attention is full)")
    mixers = layer_symbols(hf)
    n_exp, shared = hf["num_local_experts"] or 0, hf["shared_intermediate_size"]
    if n_exp > 0 and shared:
        raise refuse(ARCH, f"experts (num_local_experts={n_exp}) next to a shared expert (shared_intermediate_size="
                           f"{shared}) in one residual")
    if n_exp == 0 and not shared:
        raise refuse(ARCH, "a model with neither experts nor a shared MLP (num_local_experts=0, "
                           "shared_intermediate_size=0)")
    ffn = "E" if n_exp > 0 else "-"
    theta, rotary = rope_theta_of(hf)
    bias = bool(hf["attention_bias"])
    return HybridConfig(
        vocab_size=hf["vocab_size"], d_model=d, pattern="".join(s + ffn for s in mixers),
        attention=AttentionConfig(n_heads=n_heads, n_kv_heads=hf["num_key_value_heads"] or n_heads,
                                  head_dim=head_dim, rope_theta=theta, rotary_fraction=rotary,
                                  qkv_bias=bias, out_bias=bias) if "*" in mixers else AttentionConfig(),
        mamba2=mamba2_from_hf(ARCH, hf),
        mlp=MLPConfig(d_ff=shared, activation="silu", gated=True, bias=False) if ffn == "-" else MLPConfig(),
        moe=MoEConfig(n_experts=n_exp, top_k=hf["num_experts_per_tok"], d_ff=hf["intermediate_size"],
                      activation="silu", gated=True, normalize_top_k=True) if ffn == "E" else MoEConfig(),
        norm_eps=float(hf["rms_norm_eps"]), tie_embeddings=bool(hf["tie_word_embeddings"]),
        initializer_range=float(hf["initializer_range"]),
    )


_FFN, _DENSE, _MOE = "layers.{2i+1}.mixer", "model.layers.{i}.shared_mlp", "model.layers.{i}.block_sparse_moe"
# The shared MLP and the experts are fused gate-first (``input_linear``), the router is ``router.layer``: the
# hub's layout (what transformers, vLLM and llama.cpp all load). transformers 5's in-memory names for the
# experts (``experts.gate_up_proj`` ...) are read too. An absent shared expert (shared_intermediate_size 0)
# is saved by transformers as empty tensors, dropped here.
TABLE = Table(ARCH, tied_head=("lm_head.weight", "model.embed_tokens.weight"), rules=(
    Rule("embed.weight", "model.embed_tokens.weight"), Rule("norm_f.weight", "model.norm.weight"),
    Rule("lm_head.weight", "lm_head.weight"),
    *decoder_pair_rules("post_attention_layernorm"),
    Rule((f"{_FFN}.gate_proj.weight", f"{_FFN}.up_proj.weight"), f"{_DENSE}.input_linear.weight", op=Chunk(2, 0),
         drop_empty=True),
    Rule(f"{_FFN}.down_proj.weight", f"{_DENSE}.output_linear.weight", drop_empty=True),
    Rule((f"{_FFN}.gate_proj", f"{_FFN}.up_proj"), f"{_MOE}.input_linear.weight", op=Chunk(2, 1)),  # [E, 2F, D]
    Rule((f"{_FFN}.gate_proj", f"{_FFN}.up_proj"), f"{_MOE}.experts.gate_up_proj", op=Chunk(2, 1), export=False),
    Rule(f"{_FFN}.down_proj", f"{_MOE}.output_linear.weight"),
    Rule(f"{_FFN}.down_proj", f"{_MOE}.experts.down_proj", export=False),
    Rule(f"{_FFN}.router.weight", f"{_MOE}.router.layer.weight"),
    Rule(f"{_FFN}.router.weight", f"{_MOE}.router.weight", export=False),
))


def state_from_hf(state: dict, hf: dict, cfg: HybridConfig) -> dict:
    return TABLE.from_hf(state, cfg)


def export_refusal(cfg: HybridConfig) -> str | None:
    pairs, why = decoder_pairs(cfg, "M*", "-E")
    problems = ([why] if why else []) + no_attention(cfg, "GraniteMoeHybrid")
    ffns = {f for _, f in pairs}
    if ffns == {"-", "E"}:
        problems.append("some blocks have a dense MLP (-) and others experts (E); GraniteMoeHybrid has experts in "
                        "every layer or in none")
    if "*" in cfg.pattern:
        a = cfg.attention
        problems += attention_mismatches(cfg, rotary_fraction=None, bias=None)
        if a.rotary_fraction not in (0.0, 1.0):
            problems.append(f"attention.rotary_fraction is {a.rotary_fraction}; GraniteMoeHybrid rotates the whole "
                            "head (1.0) or not at all (0.0)")
        if a.rope_scaling is not None:
            problems.append(f"attention.rope_scaling={a.rope_scaling}; GraniteMoeHybrid has plain RoPE only")
        if a.head_dim * a.n_heads != cfg.d_model:
            problems.append(f"attention.head_dim ({a.head_dim}) x n_heads ({a.n_heads}) != d_model ({cfg.d_model}); "
                            "vLLM's GraniteMoeHybrid derives head_dim as hidden_size / num_attention_heads")
    problems += mamba2_export_problems(cfg, "GraniteMoeHybrid")
    if "-" in cfg.pattern and (not cfg.mlp.gated or cfg.mlp.activation != "silu" or cfg.mlp.bias):
        problems.append(f"the MLP is {'gated' if cfg.mlp.gated else 'plain'} {cfg.mlp.activation}"
                        f"{' with biases' if cfg.mlp.bias else ''}; GraniteMoeHybrid's is a bias-free SwiGLU "
                        "(hidden_act is also the Mamba conv activation)")
    if "E" in cfg.pattern:
        e = cfg.moe
        if not e.gated or e.activation != "silu":
            problems.append(f"the experts are {'gated' if e.gated else 'plain'} {e.activation}; GraniteMoeHybrid's "
                            "are SwiGLU")
        if not e.normalize_top_k:
            problems.append("moe.normalize_top_k=False; GraniteMoeHybrid's router softmaxes the top-k logits "
                            "(weights sum to 1), so only normalize_top_k=True maps")
    return "; ".join(problems) or None


def config_to_hf(cfg: HybridConfig) -> dict:
    a, n_layers = cfg.attention, len(cfg.pattern) // 2
    experts = "E" in cfg.pattern
    rope = a.rotary_fraction == 1.0
    return {
        "architectures": [ARCH], "model_type": "granitemoehybrid", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model, "num_hidden_layers": n_layers, "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
        "max_position_embeddings": EXPORT_MAX_POSITIONS,
        "initializer_range": cfg.initializer_range,
        "layer_types": [SYMBOL_LAYER[cfg.pattern[2 * i]] for i in range(n_layers)],
        "num_attention_heads": a.n_heads, "num_key_value_heads": a.n_kv_heads, "head_dim": a.head_dim,
        "attention_bias": a.qkv_bias, "attention_multiplier": a.head_dim ** -0.5,
        "position_embedding_type": "rope" if rope else None,
        "rope_parameters": {"rope_type": "default", "rope_theta": a.rope_theta},
        "embedding_multiplier": 1.0, "residual_multiplier": 1.0, "logits_scaling": 1.0,
        "num_local_experts": cfg.moe.n_experts if experts else 0,
        # dense: 0, not a leftover top-k (llama.cpp's loader asserts experts used <= experts)
        "num_experts_per_tok": cfg.moe.top_k if experts else 0,
        "intermediate_size": cfg.moe.d_ff if experts else cfg.mlp.d_ff,
        "shared_intermediate_size": 0 if experts else cfg.mlp.d_ff,
        **mamba2_to_hf(cfg),
    }


def state_to_hf(state: dict[str, torch.Tensor], cfg: HybridConfig) -> dict[str, torch.Tensor]:
    """Our tensors under the hub's names (what transformers, vLLM and llama.cpp all load)."""
    return TABLE.to_hf(state, cfg)


register(Converter(name="granitemoehybrid", architectures=(ARCH,), config_from_hf=config_from_hf,
                   state_from_hf=state_from_hf, export_refusal=export_refusal, config_to_hf=config_to_hf,
                   state_to_hf=state_to_hf))
