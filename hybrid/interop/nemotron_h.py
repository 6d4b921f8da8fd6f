"""``NemotronHForCausalLM`` (NVIDIA's Mamba-2 / attention / MLP hybrid) <-> ``HybridLM``.

NemotronH's layers are single pre-norm residual sub-layers, exactly our symbols: its pattern
(``layers_block_type``, or the older ``hybrid_override_pattern`` string) maps 1:1 — Mamba-2 ``M``,
attention ``*``, MLP ``-``. Attention has no RoPE and no biases (transformers builds q/k/v/o without
bias whatever ``attention_bias`` says); the MLP is plain ``down(act(up(x)))`` with
``mlp_hidden_act`` (squared ReLU by default). The gated RMSNorm (``NemotronHRMSNormGated``) gates
before normalising and normalises in ``n_groups`` groups; ``d_inner = mamba_num_heads x
mamba_head_dim`` (``expand`` is not used). transformers clamps dt from below at ``time_step_min``
(and not above) in the prefill scan, whatever ``time_step_limit`` says; we map that clamp exactly.
``residual_in_fp32`` is not used by transformers' NemotronH (and is moot in fp32). Its ``moe``
layer type (sigmoid router with grouped top-k, a shared expert, latent projections) is a different
design from our ``E`` and is refused. transformers' NemotronH never ties ``lm_head`` to the
embeddings (``tie_word_embeddings`` has no effect there, nor in vLLM's NemotronH: both read
``lm_head.weight`` from the file), so a tied model is written with ``lm_head.weight`` as a copy of the
embedding (and ``tie_word_embeddings: true``, which only we read): every engine computes the tied
model's logits, and we read such a folder back as tied. A folder whose head differs from its embedding
is untied whatever the flag says (what transformers and vLLM run); one with the flag and no head at all
is tied (the only reading that gives the model a head). Multi-token-prediction
weights (``mtp.*``) are not part of the causal LM's forward and are skipped, as transformers skips them.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..config import AttentionConfig, HybridConfig, Mamba2Config, MLPConfig
from . import Converter, register
from .common import ACTIVATIONS_TO_HF, EXPORT_MAX_POSITIONS, activation_from_hf, float_to_hf, refuse
from .hf_hybrid import attention_mismatches, no_attention, require, with_defaults
from .rename import Rule, Table

ARCH = "NemotronHForCausalLM"
# NemotronHConfig's defaults (transformers 5.x) for keys a config.json may leave out.
DEFAULTS = dict(
    vocab_size=131072, hidden_size=4096, tie_word_embeddings=False, num_attention_heads=32, num_key_value_heads=8,
    head_dim=128, attention_bias=False, sliding_window=None, intermediate_size=21504, mlp_hidden_act="relu2",
    mlp_bias=False, ssm_state_size=128, mamba_num_heads=128, mamba_head_dim=64, mamba_hidden_act="silu",
    n_groups=8, conv_kernel=4, expand=2, time_step_min=0.001, time_step_max=0.1, time_step_floor=1e-4,
    use_conv_bias=True, chunk_size=128, use_bias=False, initializer_range=0.02, layer_norm_epsilon=1e-5,
)
# Older config.json names, as NemotronHConfig renames them.
LEGACY_KEYS = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_expand": "expand",
               "mamba_dt_min": "time_step_min", "mamba_dt_max": "time_step_max",
               "mamba_dt_init_floor": "time_step_floor", "mamba_conv_bias": "use_conv_bias",
               "mamba_chunk_size": "chunk_size"}
LAYER_SYMBOL = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*", "mlp": "-"}
SYMBOL_LAYER = {"M": "linear_attention", "*": "full_attention", "-": "mlp"}
EMBED_KEYS = ("backbone.embeddings.weight", "model.embeddings.weight", "embeddings.weight")


def pattern_of(hf: dict) -> str:
    types = hf.get("layers_block_type")
    if types is None:
        override = hf.get("hybrid_override_pattern")
        if override is None:
            raise refuse(ARCH, "config.json has neither layers_block_type nor hybrid_override_pattern")
        types = ["moe" if s == "E" else {"M": "mamba", "*": "attention", "-": "mlp"}.get(s, s) for s in override]
    out = []
    for i, t in enumerate(types):
        if t == "moe":
            raise refuse(ARCH, f"layer {i} is a 'moe' layer (NemotronH's mixture of experts: sigmoid router with "
                               "grouped top-k, shared expert)")
        if t not in LAYER_SYMBOL:
            raise refuse(ARCH, f"layer {i} has unknown type {t!r} (known: {sorted(LAYER_SYMBOL)})")
        out.append(LAYER_SYMBOL[t])
    return "".join(out)


def config_from_hf(raw: dict) -> HybridConfig:
    hf = with_defaults({LEGACY_KEYS.get(k, k): v for k, v in raw.items()}, DEFAULTS)
    require(ARCH, hf, "mamba_hidden_act", "silu")
    if hf["attention_bias"]:
        raise refuse(ARCH, "attention_bias=True (transformers' NemotronH ignores it and builds "
                           "attention without bias, so the intended model is ambiguous)")
    if hf["sliding_window"]:
        raise refuse(ARCH, f"sliding_window={hf['sliding_window']} (transformers' NemotronH "
                           "ignores it; the intended model is ambiguous)")
    d, n_groups = hf["hidden_size"], hf["n_groups"]
    return HybridConfig(
        vocab_size=hf["vocab_size"], d_model=d, pattern=pattern_of(hf),
        attention=AttentionConfig(n_heads=hf["num_attention_heads"],
                                  n_kv_heads=hf["num_key_value_heads"] or hf["num_attention_heads"],
                                  head_dim=hf["head_dim"], rotary_fraction=0.0),
        mamba2=Mamba2Config(d_state=hf["ssm_state_size"], d_conv=hf["conv_kernel"],
                            d_inner=hf["mamba_num_heads"] * hf["mamba_head_dim"], head_dim=hf["mamba_head_dim"],
                            n_groups=n_groups, chunk_size=hf["chunk_size"],
                            # time_step_min is the dt clamp and the init range's floor; a 0 clamp (no clamp)
                            # leaves the init range at our default
                            dt_min=hf["time_step_min"] or Mamba2Config.dt_min,
                            dt_max=hf["time_step_max"], dt_init_floor=hf["time_step_floor"],
                            dt_limit=(float(hf["time_step_min"]), math.inf), conv_bias=bool(hf["use_conv_bias"]),
                            proj_bias=bool(hf["use_bias"]), norm_before_gate=False, norm_groups=n_groups),
        mlp=MLPConfig(d_ff=hf["intermediate_size"], activation=activation_from_hf(ARCH, hf["mlp_hidden_act"],
                                                                                    key="mlp_hidden_act"),
                      gated=False, bias=bool(hf["mlp_bias"])),
        norm_eps=float(hf["layer_norm_epsilon"]), tie_embeddings=False,  # settled by tie_from_state
        initializer_range=float(hf["initializer_range"]),
    )


# NemotronH's layers are ours 1:1 under the prefix "backbone." (on disk; "model." in transformers' memory, read
# too); the multi-token-prediction head (mtp.*) is not part of the causal LM forward and is dropped. A tied
# model's head is absent or equal to the embedding (tie_from_state), and is written as a copy of it.
TABLE = Table(ARCH, tied_head=("lm_head.weight", EMBED_KEYS), export_tied_head=True, skip=("mtp.{any}",), rules=(
    Rule("embed.weight", "backbone.embeddings.weight"),
    Rule("embed.weight", "model.embeddings.weight", export=False),
    Rule("embed.weight", "embeddings.weight", export=False),
    Rule("lm_head.weight", "lm_head.weight"),
    Rule("{rest}", "backbone.{rest}"),
    Rule("{rest}", "model.{rest}", export=False),
))


def tie_from_state(cfg: HybridConfig, state: dict, hf: dict) -> HybridConfig:
    """Tied when the config says so and the head is absent or equal to the embedding (see the module
    docstring): then tied and untied readings give the same model."""
    if not hf.get("tie_word_embeddings"):
        return cfg
    embed = state.get(TABLE.embedding_name(state))
    head = state.get("lm_head.weight")
    if head is None or (embed is not None and torch.equal(head, embed)):
        return dataclasses.replace(cfg, tie_embeddings=True)
    return cfg


def state_from_hf(state: dict, hf: dict, cfg: HybridConfig) -> dict:
    return TABLE.from_hf(state, cfg)


def export_refusal(cfg: HybridConfig) -> str | None:
    problems = no_attention(cfg, "NemotronH")
    if "m" in cfg.pattern:
        problems.append("the pattern has Mamba-1 layers (m); NemotronH's Mamba layers are Mamba-2")
    if "E" in cfg.pattern:
        problems.append("the pattern has mixture-of-experts layers (E); NemotronH's MoE (sigmoid router, shared "
                        "expert) is a different design")
    if "*" in cfg.pattern:
        problems += attention_mismatches(cfg, rotary_fraction=0.0, bias=False)
    if "-" in cfg.pattern:
        if cfg.mlp.gated:
            problems.append(f"the MLP is gated ({cfg.mlp.activation}); NemotronH's MLP is plain down(act(up(x))) "
                            "(squared ReLU by default)")
        if cfg.mlp.activation not in ACTIVATIONS_TO_HF:
            problems.append(f"mlp.activation {cfg.mlp.activation!r} has no transformers name")
    if "M" in cfg.pattern:
        m = cfg.mamba2
        if m.dt_limit[1] != math.inf:
            problems.append(f"mamba2.dt_limit has an upper bound ({m.dt_limit[1]}); NemotronH clamps dt only "
                            "from below (time_step_min)")
        if m.norm_groups != m.n_groups:
            problems.append(f"mamba2.norm_groups ({m.norm_groups}) != n_groups ({m.n_groups}); NemotronH's gated "
                            "RMSNorm normalises in n_groups groups")
        if m.norm_before_gate:
            problems.append("mamba2.norm_before_gate=True; NemotronH gates before normalising")
    return "; ".join(problems) or None


def config_to_hf(cfg: HybridConfig) -> dict:
    a, m, mlp = cfg.attention, cfg.mamba2, cfg.mlp
    lo = m.dt_limit[0]
    return {
        "architectures": [ARCH], "model_type": "nemotron_h", "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "layers_block_type": [SYMBOL_LAYER[s] for s in cfg.pattern],
        "hybrid_override_pattern": cfg.pattern,  # read by older transformers and by vLLM's config class
        # tied: a copy of the embedding as lm_head (transformers and vLLM never tie) and the flag, for us
        "num_hidden_layers": len(cfg.pattern), "tie_word_embeddings": cfg.tie_embeddings,
        "layer_norm_epsilon": cfg.norm_eps, "initializer_range": cfg.initializer_range,
        "max_position_embeddings": EXPORT_MAX_POSITIONS,
        "residual_in_fp32": False,
        "num_attention_heads": a.n_heads, "num_key_value_heads": a.n_kv_heads, "head_dim": a.head_dim,
        "attention_bias": False,
        "intermediate_size": mlp.d_ff, "mlp_hidden_act": ACTIVATIONS_TO_HF.get(mlp.activation), "mlp_bias": mlp.bias,
        "ssm_state_size": m.d_state, "mamba_num_heads": m.n_heads, "mamba_head_dim": m.head_dim,
        "n_groups": m.n_groups, "conv_kernel": m.d_conv, "expand": max(1, m.d_inner // cfg.d_model),
        "chunk_size": m.chunk_size, "use_conv_bias": m.conv_bias, "use_bias": m.proj_bias,
        "mamba_hidden_act": "silu", "time_step_min": lo, "time_step_max": max(m.dt_max, lo),
        "time_step_floor": m.dt_init_floor, "time_step_limit": [lo, float_to_hf(math.inf)],
    }


def state_to_hf(state: dict[str, torch.Tensor], cfg: HybridConfig) -> dict[str, torch.Tensor]:
    return TABLE.to_hf(state, cfg)  # tied: lm_head too, as transformers' and vLLM's NemotronH read it from the file


register(Converter(name="nemotron_h", architectures=(ARCH,), config_from_hf=config_from_hf,
                   state_from_hf=state_from_hf, export_refusal=export_refusal, config_to_hf=config_to_hf,
                   state_to_hf=state_to_hf, config_from_state=tie_from_state))
