"""``JambaForCausalLM`` (AI21's Mamba-1 / attention / mixture-of-experts hybrid) <-> ``HybridLM``.

A Jamba decoder layer is a mixer (Mamba-1, or attention where ``i % attn_layer_period ==
attn_layer_offset``) then a feed-forward (a mixture of experts where ``i % expert_layer_period ==
expert_layer_offset`` and ``num_experts > 1``, else a SwiGLU MLP), each pre-normed with RMSNorm:
two pattern symbols, ``m-``, ``mE``, ``*-`` or ``*E``. The Mamba-1 mixer has RMSNorms on dt, B and
C (our ``inner_norms``); attention has no RoPE and no biases. The router is a bias-free linear
layer, softmax over all experts in fp32, top ``num_experts_per_tok`` kept without renormalising.
``hidden_act`` is the MLP/expert activation and the Mamba conv activation, so only ``silu`` maps
exactly. Experts are read either per expert (``experts.{e}.gate_proj.weight``, the hub layout,
which is also what transformers saves and what we export) or fused (``experts.gate_up_proj``).
"""

from __future__ import annotations

import math

import torch

from ..config import AttentionConfig, HybridConfig, Mamba1Config, MLPConfig, MoEConfig
from . import Converter, register
from .common import EXPORT_MAX_POSITIONS, refuse
from .hf_hybrid import (
    TIED_HEAD,
    TOP_LEVEL,
    attention_mismatches,
    decoder_pair_rules,
    decoder_pairs,
    no_attention,
    periodic,
    require,
    with_defaults,
)
from .rename import Chunk, Rule, Stack, Table

ARCH = "JambaForCausalLM"
# JambaConfig's defaults (transformers 5.x) for keys a config.json may leave out.
DEFAULTS = dict(
    vocab_size=65536, tie_word_embeddings=False, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, hidden_act="silu", rms_norm_eps=1e-6, num_experts_per_tok=2,
    num_experts=16, expert_layer_period=2, expert_layer_offset=1, attn_layer_period=8, attn_layer_offset=4,
    mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank="auto", mamba_conv_bias=True,
    mamba_proj_bias=False, initializer_range=0.02,
)
MAMBA_NAMES = {"dt_layernorm": "dt_norm", "b_layernorm": "B_norm", "c_layernorm": "C_norm"}
EXPERT_MATS = ("gate_proj", "up_proj", "down_proj")


def config_from_hf(raw: dict) -> HybridConfig:
    hf = with_defaults(raw, DEFAULTS)
    require(ARCH, hf, "hidden_act", "silu")  # also the Mamba conv activation
    if hf.get("sliding_window"):
        raise refuse(ARCH, f"sliding_window={hf['sliding_window']} (Jamba attention is full)")
    d, n_layers, n_heads = hf["hidden_size"], hf["num_hidden_layers"], hf["num_attention_heads"]
    n_exp = hf["num_experts"]
    for what in ("attn", "expert"):
        period, offset = hf[f"{what}_layer_period"], hf[f"{what}_layer_offset"]
        if not 0 <= offset < period:
            raise refuse(ARCH, f"{what}_layer_offset ({offset}) must be in [0, {what}_layer_period = {period})")
    pattern = ""
    for i in range(n_layers):
        pattern += "*" if i % hf["attn_layer_period"] == hf["attn_layer_offset"] else "m"
        is_moe = n_exp > 1 and i % hf["expert_layer_period"] == hf["expert_layer_offset"]
        pattern += "E" if is_moe else "-"
    dt_rank = math.ceil(d / 16) if hf["mamba_dt_rank"] == "auto" else hf["mamba_dt_rank"]
    return HybridConfig(
        vocab_size=hf["vocab_size"], d_model=d, pattern=pattern,
        attention=AttentionConfig(n_heads=n_heads, n_kv_heads=hf["num_key_value_heads"] or n_heads,
                                  head_dim=hf.get("head_dim") or d // n_heads, rotary_fraction=0.0),
        mamba1=Mamba1Config(d_state=hf["mamba_d_state"], d_conv=hf["mamba_d_conv"], expand=hf["mamba_expand"],
                            d_inner=hf["mamba_expand"] * d, dt_rank=dt_rank, conv_bias=bool(hf["mamba_conv_bias"]),
                            proj_bias=bool(hf["mamba_proj_bias"]), inner_norms=True),
        # a section the pattern does not use (no dense MLP, or no experts) keeps its defaults
        mlp=MLPConfig(d_ff=hf["intermediate_size"], activation="silu", gated=True, bias=False)
        if "-" in pattern else MLPConfig(),
        moe=MoEConfig(n_experts=n_exp, top_k=hf["num_experts_per_tok"], d_ff=hf["intermediate_size"],
                      activation="silu", gated=True, normalize_top_k=False) if "E" in pattern else MoEConfig(),
        norm_eps=float(hf["rms_norm_eps"]), tie_embeddings=bool(hf["tie_word_embeddings"]),
        initializer_range=float(hf["initializer_range"]),
    )


_FFN, _HF = "layers.{2i+1}.mixer", "model.layers.{i}.feed_forward"
# The hub stores one tensor per expert (``experts.{e}.gate_proj.weight``), stacked into ours [E, F, D];
# transformers 5's fused in-memory layout (``experts.gate_up_proj`` [E, 2F, D], gate rows first) is read too.
# Dense MLPs and the router are named as ours.
TABLE = Table(ARCH, tied_head=TIED_HEAD, rules=(
    *TOP_LEVEL, *decoder_pair_rules("pre_ff_layernorm", mamba_names=MAMBA_NAMES),
    *(Rule(f"{_FFN}.{mat}", f"{_HF}.experts.{{e}}.{mat}.weight", kinds="E",
           op=Stack("e", count=lambda cfg: cfg.moe.n_experts)) for mat in EXPERT_MATS),
    Rule((f"{_FFN}.gate_proj", f"{_FFN}.up_proj"), f"{_HF}.experts.gate_up_proj", op=Chunk(2, 1), export=False),
    Rule(f"{_FFN}.down_proj", f"{_HF}.experts.down_proj", export=False),
    Rule(f"{_FFN}.{{rest}}", f"{_HF}.{{rest}}"),
))


def state_from_hf(state: dict, hf: dict, cfg: HybridConfig) -> dict:
    return TABLE.from_hf(state, cfg)


def export_refusal(cfg: HybridConfig) -> str | None:
    pairs, why = decoder_pairs(cfg, "m*", "-E")
    if why:
        return why
    problems = no_attention(cfg, "Jamba")
    for what, sym, flags in (("attention", "*", [m == "*" for m, _ in pairs]),
                             ("mixture-of-experts", "E", [f == "E" for _, f in pairs])):
        if periodic(flags) is None:
            where = [i for i, f in enumerate(flags) if f]
            problems.append(f"the {what} layers ({sym}) sit at decoder layers {where}, which is not "
                            f"'every period-th layer from an offset' as Jamba's config states them")
    if "*" in cfg.pattern:
        problems += attention_mismatches(cfg, rotary_fraction=0.0, bias=False)
    if "m" in cfg.pattern:
        m = cfg.mamba1
        if not m.inner_norms:
            problems.append("mamba1.inner_norms=False; Jamba's Mamba layers normalise dt, B and C")
        if m.d_inner % cfg.d_model:
            problems.append(f"mamba1.d_inner ({m.d_inner}) is not an integer multiple of d_model ({cfg.d_model}); "
                            "Jamba sizes it as mamba_expand x hidden_size")
    ffns = [(cfg.mlp, "MLP")] * ("-" in cfg.pattern) + [(cfg.moe, "experts' MLP")] * ("E" in cfg.pattern)
    for sub, name in ffns:
        if not sub.gated or sub.activation != "silu" or getattr(sub, "bias", False):
            problems.append(f"the {name} is not a bias-free SwiGLU; Jamba's is (hidden_act is also the Mamba conv "
                            "activation)")
    if "-" in cfg.pattern and "E" in cfg.pattern and cfg.mlp.d_ff != cfg.moe.d_ff:
        problems.append(f"mlp.d_ff ({cfg.mlp.d_ff}) != moe.d_ff ({cfg.moe.d_ff}); Jamba's MLPs and experts share "
                        "intermediate_size")
    if "E" in cfg.pattern and cfg.moe.n_experts == 1:
        problems.append("moe.n_experts=1; Jamba reads num_experts=1 as a dense MLP (use '-' instead of 'E')")
    if "E" in cfg.pattern and cfg.moe.normalize_top_k:
        problems.append("moe.normalize_top_k=True; Jamba keeps the top-k router probabilities unnormalised")
    return "; ".join(problems) or None


def config_to_hf(cfg: HybridConfig) -> dict:
    a, m = cfg.attention, cfg.mamba1
    pairs = [(cfg.pattern[i], cfg.pattern[i + 1]) for i in range(0, len(cfg.pattern), 2)]
    attn_period, attn_offset = periodic([s == "*" for s, _ in pairs])
    has_moe = any(f == "E" for _, f in pairs)
    exp_period, exp_offset = periodic([f == "E" for _, f in pairs]) if has_moe else (1, 0)
    return {
        "architectures": [ARCH], "model_type": "jamba", "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "num_hidden_layers": len(pairs), "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings, "initializer_range": cfg.initializer_range,
        "max_position_embeddings": EXPORT_MAX_POSITIONS,
        "intermediate_size": cfg.moe.d_ff if "-" not in cfg.pattern else cfg.mlp.d_ff,
        "attn_layer_period": attn_period, "attn_layer_offset": attn_offset,
        "num_attention_heads": a.n_heads, "num_key_value_heads": a.n_kv_heads, "head_dim": a.head_dim,
        "num_experts": cfg.moe.n_experts if has_moe else 1, "num_experts_per_tok": cfg.moe.top_k if has_moe else 1,
        "expert_layer_period": exp_period, "expert_layer_offset": exp_offset,
        "mamba_d_state": m.d_state, "mamba_d_conv": m.d_conv, "mamba_expand": m.d_inner // cfg.d_model,
        "mamba_dt_rank": m.dt_rank, "mamba_conv_bias": m.conv_bias, "mamba_proj_bias": m.proj_bias,
    }


def state_to_hf(state: dict[str, torch.Tensor], cfg: HybridConfig) -> dict[str, torch.Tensor]:
    return TABLE.to_hf(state, cfg)


register(Converter(name="jamba", architectures=(ARCH,), config_from_hf=config_from_hf, state_from_hf=state_from_hf,
                   export_refusal=export_refusal, config_to_hf=config_to_hf, state_to_hf=state_to_hf))
