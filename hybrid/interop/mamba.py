"""transformers' ``MambaForCausalLM`` (Mamba-1) and ``Mamba2ForCausalLM`` <-> ``HybridLM`` with pattern
``"m" * n`` / ``"M" * n``.

An HF Mamba block is (norm, mixer): one of our sub-layers, and the mixer parameters already carry
mamba_ssm's names (in_proj, conv1d, x_proj, dt_proj, dt_bias, A_log, D, norm, out_proj), so only the
prefixes change. ``residual_in_fp32`` keeps the residual stream in fp32 under bf16/fp16; at fp32 (how
we load by default) it changes nothing, and at lower precision our residual stays in the model dtype.
Options that only shape the initialisation (time_step_min/max/floor/scale/init_scheme,
rescale_prenorm_residual, initializer_range) are not needed to run the weights and are ignored.
"""

from __future__ import annotations

import math

from ..config import HybridConfig, Mamba1Config, Mamba2Config
from . import Converter, register
from .common import hf_float, refuse
from .rename import Rule, Table

# An HF Mamba block is one of our sub-layers under the prefix "backbone."; older checkpoints name the
# embedding "embedding" (read, not written).
_RULES = (
    Rule("embed.weight", "backbone.embeddings.weight"),
    Rule("embed.weight", "backbone.embedding.weight", export=False),
    Rule("norm_f.weight", "backbone.norm_f.weight"), Rule("lm_head.weight", "lm_head.weight"),
    Rule("layers.{i}.norm.{rest}", "backbone.layers.{i}.norm.{rest}"),
    Rule("layers.{i}.mixer.{rest}", "backbone.layers.{i}.mixer.{rest}"),
)
_TIED = ("lm_head.weight", ("backbone.embeddings.weight", "backbone.embedding.weight"))
MAMBA1 = Table("MambaForCausalLM", rules=_RULES, tied_head=_TIED)
MAMBA2 = Table("Mamba2ForCausalLM", rules=_RULES, tied_head=_TIED)


def _check_act(arch: str, hf: dict) -> None:
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):
        raise refuse(arch, f"hidden_act={hf['hidden_act']!r} for the conv (only silu)")


def mamba1_config_from_hf(hf: dict) -> HybridConfig:
    arch = "MambaForCausalLM"
    _check_act(arch, hf)
    d = hf["hidden_size"]
    rank = hf.get("time_step_rank", "auto")
    m1 = Mamba1Config(d_state=hf.get("state_size", 16), d_conv=hf.get("conv_kernel", 4),
                      d_inner=int(hf.get("expand", 2) * d), dt_rank=math.ceil(d / 16) if rank == "auto" else int(rank),
                      conv_bias=bool(hf.get("use_conv_bias", True)), proj_bias=bool(hf.get("use_bias", False)))
    return HybridConfig(vocab_size=hf["vocab_size"], d_model=d, pattern="m" * hf["num_hidden_layers"], mamba1=m1,
                        norm_eps=hf.get("layer_norm_epsilon", 1e-5),
                        tie_embeddings=bool(hf.get("tie_word_embeddings", True)))


def mamba2_config_from_hf(hf: dict) -> HybridConfig:
    arch = "Mamba2ForCausalLM"
    _check_act(arch, hf)
    d = hf["hidden_size"]
    d_inner = int(hf.get("expand", 2) * d)
    n_heads, head_dim = hf["num_heads"], hf["head_dim"]
    if n_heads * head_dim != d_inner:
        raise refuse(arch, f"num_heads * head_dim = {n_heads * head_dim} != expand * hidden_size = {d_inner}")
    lo, hi = hf.get("time_step_limit") or (0.0, math.inf)
    m2 = Mamba2Config(d_state=hf.get("state_size", 128), d_conv=hf.get("conv_kernel", 4), d_inner=d_inner,
                      head_dim=head_dim, n_groups=hf.get("n_groups", 1), chunk_size=hf.get("chunk_size", 256),
                      dt_limit=(hf_float(lo), math.inf if hi is None else hf_float(hi)),
                      conv_bias=bool(hf.get("use_conv_bias", True)), proj_bias=bool(hf.get("use_bias", False)),
                      norm_before_gate=False)  # MambaRMSNormGated: norm(x * silu(z)), grouped by n_groups
    return HybridConfig(vocab_size=hf["vocab_size"], d_model=d, pattern="M" * hf["num_hidden_layers"], mamba2=m2,
                        norm_eps=hf.get("layer_norm_epsilon", 1e-5),
                        tie_embeddings=bool(hf.get("tie_word_embeddings", False)))


# ---- export -------------------------------------------------------------------------------------------
def _mamba1_refusal(cfg: HybridConfig) -> str | None:
    if cfg.pattern != "m" * cfg.n_layers:
        return f"MambaForCausalLM is Mamba-1 blocks only; pattern {cfg.pattern!r} is not 'm' * n"
    if cfg.mamba1.inner_norms:
        return "MambaForCausalLM has no RMSNorms on dt, B and C (this model has inner_norms=True)"
    if cfg.mamba1.d_inner % cfg.d_model:
        return f"MambaForCausalLM needs d_inner ({cfg.mamba1.d_inner}) = expand * d_model with an integer expand"
    return None


def _mamba2_refusal(cfg: HybridConfig) -> str | None:
    m = cfg.mamba2
    if cfg.pattern != "M" * cfg.n_layers:
        return f"Mamba2ForCausalLM is Mamba-2 blocks only; pattern {cfg.pattern!r} is not 'M' * n"
    if m.norm_before_gate or m.norm_groups != m.n_groups:
        return (f"Mamba2ForCausalLM's gated norm is norm(y * silu(z)) grouped by n_groups; this model has "
                f"norm_before_gate={m.norm_before_gate}, norm_groups={m.norm_groups}, n_groups={m.n_groups}")
    if m.d_inner % cfg.d_model:
        return f"Mamba2ForCausalLM needs d_inner ({m.d_inner}) = expand * d_model with an integer expand"
    return None


def _mamba1_config_to_hf(cfg: HybridConfig) -> dict:
    m = cfg.mamba1
    return {"architectures": ["MambaForCausalLM"], "model_type": "mamba", "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers, "state_size": m.d_state,
            "conv_kernel": m.d_conv, "expand": m.d_inner // cfg.d_model, "time_step_rank": m.dt_rank,
            "use_bias": m.proj_bias, "use_conv_bias": m.conv_bias, "hidden_act": "silu",
            "layer_norm_epsilon": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
            "residual_in_fp32": True}


def _mamba2_config_to_hf(cfg: HybridConfig) -> dict:
    m = cfg.mamba2
    lo, hi = m.dt_limit
    return {"architectures": ["Mamba2ForCausalLM"], "model_type": "mamba2", "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers, "state_size": m.d_state,
            "conv_kernel": m.d_conv, "expand": m.d_inner // cfg.d_model, "num_heads": m.n_heads,
            "head_dim": m.head_dim, "n_groups": m.n_groups, "chunk_size": m.chunk_size,
            "time_step_limit": [lo, hi], "use_bias": m.proj_bias, "use_conv_bias": m.conv_bias,
            "hidden_act": "silu", "layer_norm_epsilon": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
            "residual_in_fp32": True}


register(Converter(name="mamba", architectures=("MambaForCausalLM",), config_from_hf=mamba1_config_from_hf,
                   state_from_hf=lambda state, hf, cfg: MAMBA1.from_hf(state, cfg), export_refusal=_mamba1_refusal,
                   config_to_hf=_mamba1_config_to_hf, state_to_hf=MAMBA1.to_hf))
register(Converter(name="mamba2", architectures=("Mamba2ForCausalLM",), config_from_hf=mamba2_config_from_hf,
                   state_from_hf=lambda state, hf, cfg: MAMBA2.from_hf(state, cfg), export_refusal=_mamba2_refusal,
                   config_to_hf=_mamba2_config_to_hf, state_to_hf=MAMBA2.to_hf))
