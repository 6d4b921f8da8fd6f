"""Pieces the Hugging Face hybrid converters (Bamba, NemotronH, Jamba, GraniteMoeHybrid) share: reading
config values the way ``transformers`` does, refusing unsupported options by name, activation names, the
pattern facts exports need (decoder-layer pairs, periodic layer positions), and the rename rules of
decoder layers that hold a mixer and a feed-forward (:func:`decoder_pair_rules`)."""

from __future__ import annotations

from typing import Any

from ..config import HybridConfig
from .common import refuse
from .rename import Rule

# Bamba and Jamba name the embedding, the final norm and the head alike.
TOP_LEVEL = (Rule("embed.weight", "model.embed_tokens.weight"), Rule("norm_f.weight", "model.final_layernorm.weight"),
             Rule("lm_head.weight", "lm_head.weight"))
TIED_HEAD = ("lm_head.weight", "model.embed_tokens.weight")


def with_defaults(hf: dict, defaults: dict[str, Any]) -> dict[str, Any]:
    """The config as transformers sees it: the class defaults for keys config.json leaves out."""
    return {**defaults, **{k: v for k, v in hf.items() if not (v is None and k in defaults)}}


def require(arch: str, cfg: dict, key: str, allowed: Any) -> None:
    """Refuse unless ``cfg[key]`` equals ``allowed`` (or is one of a tuple of allowed values)."""
    options = allowed if isinstance(allowed, tuple) else (allowed,)
    if cfg.get(key) not in options:
        raise refuse(arch, f"{key}={cfg.get(key)!r} (only {' or '.join(map(repr, options))})")


def decoder_pairs(cfg: HybridConfig, mixers: str, ffns: str) -> tuple[list[tuple[str, str]], str | None]:
    """Split the pattern into (mixer, feed-forward) pairs, as HF decoder layers hold them; the reason
    it cannot be split (or None)."""
    p = cfg.pattern
    pairs = [(p[i], p[i + 1]) for i in range(0, len(p) - 1, 2)]
    bad = [i for i, (m, f) in enumerate(pairs) if m not in mixers or f not in ffns]
    if len(p) % 2 == 0 and not bad:
        return pairs, None
    where = (f"decoder layer {bad[0]} would be {''.join(pairs[bad[0]])!r}" if bad
             else f"the pattern has an odd length ({len(p)})")
    return pairs, (f"every decoder layer of the format is a mixer ({' or '.join(mixers)}) followed by a feed-forward "
                   f"({' or '.join(ffns)}), so the pattern must alternate them; in {p!r} {where}")


def periodic(flags: list[bool]) -> tuple[int, int] | None:
    """The (period, offset) with ``flags[i] == (i % period == offset)`` for every i, smallest period
    first; a never-true list gets a period longer than the list. None when no such pair exists."""
    n = len(flags)
    if not any(flags):
        return n + 1, n
    for period in range(1, n + 1):
        for offset in range(period):
            if all(f == (i % period == offset) for i, f in enumerate(flags)):
                return period, offset
    return None


def no_attention(cfg: HybridConfig, arch: str) -> list[str]:
    """transformers' hybrid models cannot run without an attention layer: their cache asks one for the
    sequence length (``get_seq_length``), so an attention-free export would load but not run."""
    if "*" in cfg.pattern:
        return []
    return [f"the model has no attention layer; transformers' {arch} cannot run without one (its cache needs "
            "an attention layer to know the sequence length)"]


def attention_mismatches(cfg: HybridConfig, *, rotary_fraction: float | None, bias: bool | None) -> list[str]:
    """Ways ``cfg.attention`` differs from a format whose attention has the given RoPE share
    (None: any) and q/k/v/o bias (None: one flag for all four)."""
    a, out = cfg.attention, []
    if rotary_fraction is not None and a.rotary_fraction != rotary_fraction:
        out.append(f"attention.rotary_fraction is {a.rotary_fraction}, the format has "
                   + ("no RoPE (0.0)" if rotary_fraction == 0 else f"{rotary_fraction}"))
    if a.sliding_window is not None:
        out.append(f"attention.sliding_window={a.sliding_window}: the format has only full attention")
    if bias is None and a.qkv_bias != a.out_bias:
        out.append("attention.qkv_bias and attention.out_bias differ; the format has one bias flag for q/k/v/o")
    if bias is False and (a.qkv_bias or a.out_bias):
        out.append("attention has biases; the format's attention has none")
    return out


def decoder_pair_rules(ffn_norm: str, mixer_norm: str = "input_layernorm",
                       mamba_names: dict[str, str] | None = None) -> tuple[Rule, ...]:
    """The rename rules of a format whose decoder layer ``i`` is a pre-normed mixer then a pre-normed
    feed-forward, our layers ``2i`` and ``2i + 1`` (Bamba, Jamba, GraniteMoeHybrid): the two norms and the
    Mamba / attention mixers (``mamba_names``: the format's Mamba sub-module names -> ours). Each format
    adds its top-level and feed-forward rules."""
    renamed = tuple(Rule(f"layers.{{2i}}.mixer.{ours}.{{rest}}", f"model.layers.{{i}}.mamba.{theirs}.{{rest}}",
                         kinds="Mm")
                    for theirs, ours in (mamba_names or {}).items())
    return (
        Rule("layers.{2i}.norm.{rest}", f"model.layers.{{i}}.{mixer_norm}.{{rest}}"),
        Rule("layers.{2i+1}.norm.{rest}", f"model.layers.{{i}}.{ffn_norm}.{{rest}}"),
        *renamed,
        Rule("layers.{2i}.mixer.{rest}", "model.layers.{i}.self_attn.{rest}", kinds="*"),
        Rule("layers.{2i}.mixer.{rest}", "model.layers.{i}.mamba.{rest}", kinds="Mm"),
    )
