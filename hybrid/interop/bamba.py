"""``BambaForCausalLM`` (IBM's Mamba-2 / attention hybrid) <-> ``HybridLM``.

A Bamba decoder layer is (Mamba-2 or attention) then a SwiGLU MLP, each pre-normed with RMSNorm:
two pattern symbols, ``M-`` or ``*-``, attention where ``attn_layer_indices`` says. Attention has
partial RoPE (``partial_rotary_factor``, 0.5 unless stated: transformers hard-codes that default),
one bias flag for q/k/v/o. The Mamba-2 mixer is mamba_ssm's layout; its gated RMSNorm
(``BambaRMSNormGated``) gates before normalising and normalises in ``mamba_n_groups`` groups
(group size ``d_inner / n_groups``), which is our ``norm_groups = n_groups``. ``hidden_act`` is both
the MLP activation and the Mamba conv activation, so only ``silu`` maps exactly.
"""

from __future__ import annotations

import math

import torch

from ..config import AttentionConfig, HybridConfig, Mamba2Config, MLPConfig
from . import Converter, register
from .common import EXPORT_MAX_POSITIONS, float_to_hf, hf_float, refuse
from .hf_hybrid import (
    TIED_HEAD,
    TOP_LEVEL,
    attention_mismatches,
    decoder_pair_rules,
    decoder_pairs,
    no_attention,
    require,
    with_defaults,
)
from .rename import Rule, Table

ARCH = "BambaForCausalLM"
# BambaConfig's defaults (transformers 5.x) for keys a config.json may leave out.
DEFAULTS = dict(
    vocab_size=128000, tie_word_embeddings=False, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=None, hidden_act="silu", rms_norm_eps=1e-5,
    attn_layer_indices=None, mamba_n_heads=128, mamba_d_head="auto", mamba_n_groups=1, mamba_d_state=256,
    mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256, mamba_conv_bias=True, mamba_proj_bias=False,
    time_step_limit=(0.0, math.inf), rope_parameters=None, attention_bias=False, mlp_bias=False,
    initializer_range=0.02,
)
DEFAULT_PARTIAL_ROTARY = 0.5  # BambaConfig.__post_init__ forces this when rope_parameters does not say


def rope_of(hf: dict) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor), refusing any RoPE variant other than the default."""
    if hf.get("rope_scaling"):
        raise refuse(ARCH, f"rope_scaling={hf['rope_scaling']!r} (only plain RoPE)")
    rp = hf.get("rope_parameters") or {}
    kind = rp.get("rope_type", rp.get("type", "default"))
    if kind != "default":
        raise refuse(ARCH, f"rope_parameters.rope_type={kind!r} (only 'default')")
    extra = sorted(set(rp) - {"rope_type", "type", "rope_theta", "partial_rotary_factor"})
    if extra:
        raise refuse(ARCH, f"rope_parameters keys {extra}")
    theta = float(rp.get("rope_theta", hf.get("rope_theta", 10000.0)))
    return theta, float(rp.get("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY))


def mamba2_from_hf(arch: str, hf: dict) -> Mamba2Config:
    """The Mamba-2 mixer of a config with Bamba's ``mamba_*`` keys (Bamba, GraniteMoeHybrid: the same
    ``BambaMixer`` in transformers). ``hf`` has the class defaults filled in."""
    d_inner = int(hf["mamba_expand"] * hf["hidden_size"])
    m_heads = hf["mamba_n_heads"]
    m_head_dim = d_inner // m_heads if hf["mamba_d_head"] == "auto" else hf["mamba_d_head"]
    if m_heads * m_head_dim != d_inner:
        raise refuse(arch, f"mamba_n_heads ({m_heads}) x mamba_d_head ({m_head_dim}) != mamba_expand x hidden_size "
                           f"({d_inner})")
    lo, hi = (hf_float(v) for v in (hf["time_step_limit"] or (0.0, math.inf)))
    return Mamba2Config(d_state=hf["mamba_d_state"], d_conv=hf["mamba_d_conv"], d_inner=d_inner,
                        head_dim=m_head_dim, n_groups=hf["mamba_n_groups"], chunk_size=hf["mamba_chunk_size"],
                        dt_limit=(lo, hi), conv_bias=bool(hf["mamba_conv_bias"]),
                        proj_bias=bool(hf["mamba_proj_bias"]), norm_before_gate=False,
                        norm_groups=hf["mamba_n_groups"])


def mamba2_export_problems(cfg: HybridConfig, arch: str) -> list[str]:
    """Why ``cfg.mamba2`` cannot be written as Bamba's mixer (empty: it can)."""
    if "M" not in cfg.pattern:
        return []
    m, problems = cfg.mamba2, []
    if m.d_inner % cfg.d_model:
        problems.append(f"mamba2.d_inner ({m.d_inner}) is not an integer multiple of d_model ({cfg.d_model}); "
                        f"{arch} sizes it as mamba_expand x hidden_size")
    if m.norm_groups != m.n_groups:
        problems.append(f"mamba2.norm_groups ({m.norm_groups}) != n_groups ({m.n_groups}); {arch}'s gated "
                        "RMSNorm normalises in n_groups groups")
    if m.norm_before_gate:
        problems.append(f"mamba2.norm_before_gate=True; {arch} gates before normalising")
    return problems


def mamba2_to_hf(cfg: HybridConfig) -> dict:
    m = cfg.mamba2
    return {
        "mamba_n_heads": m.n_heads, "mamba_d_head": m.head_dim, "mamba_n_groups": m.n_groups,
        "mamba_d_state": m.d_state, "mamba_d_conv": m.d_conv, "mamba_expand": m.d_inner // cfg.d_model,
        "mamba_chunk_size": m.chunk_size, "mamba_conv_bias": m.conv_bias, "mamba_proj_bias": m.proj_bias,
        "time_step_limit": [float_to_hf(v) for v in m.dt_limit],
    }


def config_from_hf(raw: dict) -> HybridConfig:
    hf = with_defaults(raw, DEFAULTS)
    require(ARCH, hf, "hidden_act", "silu")  # also the Mamba conv activation
    if hf.get("sliding_window"):
        raise refuse(ARCH, f"sliding_window={hf['sliding_window']} (Bamba attention is full)")
    d, n_layers, n_heads = hf["hidden_size"], hf["num_hidden_layers"], hf["num_attention_heads"]
    attn_idx = set(hf["attn_layer_indices"] or [])
    bad = sorted(i for i in attn_idx if not 0 <= i < n_layers)
    if bad:
        raise refuse(ARCH, f"attn_layer_indices {bad} are outside the {n_layers} layers")
    theta, partial = rope_of(hf)
    bias = bool(hf["attention_bias"])
    return HybridConfig(
        vocab_size=hf["vocab_size"], d_model=d,
        pattern="".join("*-" if i in attn_idx else "M-" for i in range(n_layers)),
        attention=AttentionConfig(n_heads=n_heads, n_kv_heads=hf["num_key_value_heads"] or n_heads,
                                  head_dim=hf.get("head_dim") or d // n_heads, rope_theta=theta,
                                  rotary_fraction=partial, qkv_bias=bias, out_bias=bias),
        mamba2=mamba2_from_hf(ARCH, hf),
        mlp=MLPConfig(d_ff=hf["intermediate_size"], activation="silu", gated=True, bias=bool(hf["mlp_bias"])),
        norm_eps=float(hf["rms_norm_eps"]), tie_embeddings=bool(hf["tie_word_embeddings"]),
        initializer_range=float(hf["initializer_range"]),
    )


# the SwiGLU MLP's gate/up/down_proj are named as ours
TABLE = Table(ARCH, tied_head=TIED_HEAD, rules=(
    *TOP_LEVEL, *decoder_pair_rules("pre_ff_layernorm"),
    Rule("layers.{2i+1}.mixer.{rest}", "model.layers.{i}.feed_forward.{rest}"),
))


def state_from_hf(state: dict, hf: dict, cfg: HybridConfig) -> dict:
    return TABLE.from_hf(state, cfg)


def export_refusal(cfg: HybridConfig) -> str | None:
    pairs, why = decoder_pairs(cfg, "M*", "-")
    problems = ([why] if why else []) + no_attention(cfg, "Bamba")
    if "*" in cfg.pattern:
        problems += attention_mismatches(cfg, rotary_fraction=None, bias=None)
        if cfg.attention.rotary_fraction == 0.0:
            problems.append("attention has no RoPE; Bamba always rotates (partial_rotary_factor > 0)")
    problems += mamba2_export_problems(cfg, "Bamba")
    if "-" in cfg.pattern and (not cfg.mlp.gated or cfg.mlp.activation != "silu"):
        problems.append(f"the MLP is {'gated' if cfg.mlp.gated else 'plain'} {cfg.mlp.activation}; Bamba's is "
                        "SwiGLU (gated silu, hidden_act is also the Mamba conv activation)")
    return "; ".join(problems) or None


def config_to_hf(cfg: HybridConfig) -> dict:
    a, n_layers = cfg.attention, len(cfg.pattern) // 2
    return {
        "architectures": [ARCH], "model_type": "bamba", "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "intermediate_size": cfg.mlp.d_ff, "num_hidden_layers": n_layers, "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
        "max_position_embeddings": EXPORT_MAX_POSITIONS,
        "initializer_range": cfg.initializer_range,
        "attn_layer_indices": [i for i in range(n_layers) if cfg.pattern[2 * i] == "*"],
        "num_attention_heads": a.n_heads, "num_key_value_heads": a.n_kv_heads, "head_dim": a.head_dim,
        "attention_bias": a.qkv_bias,
        "rope_parameters": {"rope_type": "default", "rope_theta": a.rope_theta,
                            "partial_rotary_factor": a.rotary_fraction},
        "mlp_bias": cfg.mlp.bias, **mamba2_to_hf(cfg),
    }


def state_to_hf(state: dict[str, torch.Tensor], cfg: HybridConfig) -> dict[str, torch.Tensor]:
    return TABLE.to_hf(state, cfg)


register(Converter(name="bamba", architectures=(ARCH,), config_from_hf=config_from_hf, state_from_hf=state_from_hf,
                   export_refusal=export_refusal, config_to_hf=config_to_hf, state_to_hf=state_to_hf))
