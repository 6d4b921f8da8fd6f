"""Llama, Qwen2 and Mistral (attention-only decoders) <-> ``HybridLM`` with pattern ``"*-" * n``.

One HF decoder layer (input_layernorm, self_attn, post_attention_layernorm, mlp) is two of our
sub-layers: ``layers.{2i}`` (attention) and ``layers.{2i+1}`` (MLP). The three architectures differ
only in which biases they have and in the sliding window:

- Llama: ``attention_bias`` on q, k, v and o; ``mlp_bias`` on the MLP; no window.
- Qwen2: bias on q, k, v only; a window only on layers ``>= max_window_layers`` when
  ``use_sliding_window`` (we load it when all layers or none have it).
- Mistral: no biases; one ``sliding_window`` for every layer. transformers' mask lets query i see
  key j when ``i - sliding_window < j <= i``, i.e. the window counts the query itself, as ours does.
"""

from __future__ import annotations

import dataclasses

from ..config import AttentionConfig, HybridConfig, MLPConfig
from . import Converter, register
from .common import (
    ACTIVATIONS_TO_HF,
    EXPORT_MAX_POSITIONS,
    activation_from_hf,
    refuse,
    rope_from_hf,
    rope_to_hf,
)
from .rename import Rule, Table

# One HF decoder layer is our layers 2i (attention) and 2i + 1 (MLP); the rotary inv_freq buffer older
# checkpoints store is recomputed, so import drops it.
TABLE = Table("LlamaForCausalLM", tied_head=("lm_head.weight", "model.embed_tokens.weight"),
              skip=("{any}rotary_emb.inv_freq",), rules=(
    Rule("embed.weight", "model.embed_tokens.weight"), Rule("norm_f.weight", "model.norm.weight"),
    Rule("lm_head.weight", "lm_head.weight"),
    Rule("layers.{2i}.norm.{rest}", "model.layers.{i}.input_layernorm.{rest}"),
    Rule("layers.{2i+1}.norm.{rest}", "model.layers.{i}.post_attention_layernorm.{rest}"),
    Rule("layers.{2i}.mixer.{rest}", "model.layers.{i}.self_attn.{rest}"),
    Rule("layers.{2i+1}.mixer.{rest}", "model.layers.{i}.mlp.{rest}"),
))


def _one_window(arch: str, types: list[str], window: int | None, detail: str) -> int | None:
    """The single window all layers share (None: full attention everywhere), or a refusal."""
    kinds = set(types)
    if kinds <= {"full_attention"}:
        return None
    if kinds == {"sliding_attention"} and window is not None:
        return window
    raise refuse(arch, f"a sliding window on only some layers (layer_types {types}{detail}); one window for all "
                       f"layers or none is supported")


def _window(arch: str, hf: dict) -> int | None:
    n = hf["num_hidden_layers"]
    window = hf.get("sliding_window")
    if arch == "MistralForCausalLM":
        # transformers' Mistral applies sliding_window to every layer and ignores layer_types; a checkpoint
        # whose layer_types say otherwise is a Ministral-style model that class would run wrongly
        uniform = ["sliding_attention" if window is not None else "full_attention"] * n
        if hf.get("layer_types") and hf["layer_types"] != uniform:
            raise refuse(arch, f"layer_types {hf['layer_types']} that disagree with sliding_window={window}")
        return window
    if arch == "Qwen2ForCausalLM":  # transformers' rule: sliding on layers >= max_window_layers
        window = window if hf.get("use_sliding_window") else None
        types = hf.get("layer_types") or [
            "sliding_attention" if window is not None and i >= hf.get("max_window_layers", 28) else "full_attention"
            for i in range(n)]
        return _one_window(arch, types, window, f", use_sliding_window={hf.get('use_sliding_window')}, "
                                                f"max_window_layers={hf.get('max_window_layers')}")
    if window is not None:
        raise refuse(arch, f"sliding_window={window} (Llama attends to the full context)")
    return _one_window(arch, hf.get("layer_types") or [], None, "")


def config_from_hf(hf: dict) -> HybridConfig:
    arch = hf["architectures"][0]
    theta, scaling, partial = rope_from_hf(arch, hf)
    if partial != 1.0:
        raise refuse(arch, f"partial_rotary_factor={partial} (transformers' {arch} rotates the whole head)")
    if arch == "LlamaForCausalLM":
        qkv_bias = out_bias = bool(hf.get("attention_bias", False))
        mlp_bias = bool(hf.get("mlp_bias", False))
    elif arch == "Qwen2ForCausalLM":
        qkv_bias, out_bias, mlp_bias = True, False, False
    else:
        qkv_bias = out_bias = mlp_bias = False
    n_heads = hf["num_attention_heads"]
    attention = AttentionConfig(
        n_heads=n_heads, n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads, rope_theta=theta, rope_scaling=scaling,
        sliding_window=_window(arch, hf), qkv_bias=qkv_bias, out_bias=out_bias)
    return HybridConfig(
        vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], pattern="*-" * hf["num_hidden_layers"],
        attention=attention,
        mlp=MLPConfig(d_ff=hf["intermediate_size"], activation=activation_from_hf(arch, hf.get("hidden_act", "silu")),
                      gated=True, bias=mlp_bias),
        norm_eps=hf.get("rms_norm_eps", 1e-6), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        initializer_range=hf.get("initializer_range", 0.02))


# ---- export -------------------------------------------------------------------------------------------
def _common_refusal(cfg: HybridConfig, name: str) -> str | None:
    n = cfg.n_layers // 2
    if cfg.pattern != "*-" * n:
        return f"{name} is attention-only with an MLP after each attention; pattern {cfg.pattern!r} is not '*-' * n"
    a, mlp = cfg.attention, cfg.mlp
    if a.rotary_fraction != 1.0:
        return f"{name} rotates the whole head; this model has rotary_fraction={a.rotary_fraction}"
    if not mlp.gated or mlp.activation not in ACTIVATIONS_TO_HF:
        return f"{name}'s MLP is gated; this model's is gated={mlp.gated}, activation={mlp.activation!r}"
    return None


def _llama_refusal(cfg: HybridConfig) -> str | None:
    a = cfg.attention
    if a.sliding_window is not None:
        return f"Llama has no sliding window (this model: {a.sliding_window}); use format='mistral'"
    if a.qkv_bias != a.out_bias:
        return (f"Llama's attention_bias covers q, k, v and o together; this model has qkv_bias={a.qkv_bias}, "
                f"out_bias={a.out_bias}" + ("; use format='qwen2'" if a.qkv_bias else ""))
    return _common_refusal(cfg, "Llama")


def _mistral_refusal(cfg: HybridConfig) -> str | None:
    a = cfg.attention
    if a.qkv_bias or a.out_bias or cfg.mlp.bias:
        return "Mistral has no biases in attention or MLP"
    return _common_refusal(cfg, "Mistral")


def _qwen2_refusal(cfg: HybridConfig) -> str | None:
    a = cfg.attention
    if not a.qkv_bias or a.out_bias or cfg.mlp.bias:
        return (f"Qwen2 has biases on q, k, v only; this model has qkv_bias={a.qkv_bias}, out_bias={a.out_bias}, "
                f"mlp bias={cfg.mlp.bias}")
    return _common_refusal(cfg, "Qwen2")


def _config_to_hf(cfg: HybridConfig, arch: str, model_type: str) -> dict:
    a = cfg.attention
    out = {
        "architectures": [arch], "model_type": model_type, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model, "intermediate_size": cfg.mlp.d_ff, "num_hidden_layers": cfg.n_layers // 2,
        "num_attention_heads": a.n_heads, "num_key_value_heads": a.n_kv_heads, "head_dim": a.head_dim,
        "hidden_act": ACTIVATIONS_TO_HF[cfg.mlp.activation], "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings, "rope_parameters": rope_to_hf(a.rope_theta, a.rope_scaling),
        "initializer_range": cfg.initializer_range,
        # Our models have no length limit; serving stacks (vLLM) cap the context at this value, so it is
        # written generously rather than left to each architecture's small default.
        "max_position_embeddings": EXPORT_MAX_POSITIONS,
    }
    if arch == "LlamaForCausalLM":
        out.update(attention_bias=a.qkv_bias, mlp_bias=cfg.mlp.bias)
    elif arch == "MistralForCausalLM":
        out.update(sliding_window=a.sliding_window)
    else:
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layers // 2)
    return out


def _converter(name: str, arch: str, refusal) -> Converter:
    table = dataclasses.replace(TABLE, arch=arch)  # one set of names, three archs; the arch names errors
    return Converter(name=name, architectures=(arch,), config_from_hf=config_from_hf,
                     state_from_hf=lambda state, hf, cfg: table.from_hf(state, cfg), export_refusal=refusal,
                     config_to_hf=lambda cfg: _config_to_hf(cfg, arch, name), state_to_hf=table.to_hf)


register(_converter("llama", "LlamaForCausalLM", _llama_refusal))
register(_converter("mistral", "MistralForCausalLM", _mistral_refusal))
register(_converter("qwen2", "Qwen2ForCausalLM", _qwen2_refusal))
