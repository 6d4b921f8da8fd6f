"""Pieces the Hugging Face hybrid converters (Bamba, NemotronH, Jamba, GraniteMoeHybrid) share: reading
config values the way ``transformers`` does, refusing unsupported options by name, activation names, the
pattern facts exports need (decoder-layer pairs, periodic layer positions), and the tensor names of
decoder layers that hold a mixer and a feed-forward (:class:`DecoderPairNames`)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import HybridConfig
from .common import drop_tied_head, refuse

# Bamba and Jamba name the embedding and the final norm alike (theirs -> ours).
TOP_LEVEL = {"model.embed_tokens.weight": "embed.weight", "model.final_layernorm.weight": "norm_f.weight"}


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


def rename_first(name: str, mapping: dict[str, str]) -> str:
    """Rename the first dotted component of ``name`` through ``mapping``."""
    head, dot, tail = name.partition(".")
    return mapping.get(head, head) + dot + tail


# (our feed-forward layer j, the format's sub-module name, the rest of the tensor name, the tensor, out) -> None
FFNFromHF = Callable[[int, str, str, torch.Tensor, dict], None]
# (the format's "model.layers.{i}" prefix, our layer j, our name under "layers.{j}.mixer.", the tensor, our whole
# state, out) -> None
FFNToHF = Callable[[str, int, str, torch.Tensor, dict, dict], None]


@dataclass(frozen=True)
class DecoderPairNames:
    """The tensor names of a format whose decoder layer ``i`` is a pre-normed mixer then a pre-normed
    feed-forward, our layers ``2i`` and ``2i + 1`` (Bamba, Jamba, GraniteMoeHybrid). Norms, the Mamba and
    attention mixers and the top-level tensors map the same way in every such format; each format hands
    :meth:`from_hf` / :meth:`to_hf` only its feed-forward mapping (dense, fused or per-expert layouts)."""

    arch: str
    ffn_norm: str  # the feed-forward's pre-norm: "pre_ff_layernorm" (Bamba, Jamba), "post_attention_layernorm"
    ffn_parts: tuple[str, ...]  # the sub-modules that hold the feed-forward ("feed_forward"; "shared_mlp", ...)
    top_level: dict[str, str]  # theirs -> ours, outside the decoder layers
    mamba_names: dict[str, str] = field(default_factory=dict)  # first-component renames in the Mamba mixer
    mixer_norm: str = "input_layernorm"

    def _layer_re(self) -> re.Pattern:
        parts = "|".join(map(re.escape, (self.mixer_norm, self.ffn_norm, "mamba", "self_attn", *self.ffn_parts)))
        return re.compile(rf"model\.layers\.(\d+)\.({parts})\.(.+)")

    def from_hf(self, state: dict[str, torch.Tensor], cfg: HybridConfig, ffn: FFNFromHF) -> dict[str, torch.Tensor]:
        """The format's tensors under our names. Names nothing maps stay as they are, so a strict load
        reports them; a tied model's stored head must equal the embedding (it is dropped)."""
        if cfg.tie_embeddings:
            drop_tied_head(self.arch, state, "lm_head.weight", "model.embed_tokens.weight")
        layer, out = self._layer_re(), {}
        for k, v in state.items():
            m = layer.fullmatch(k)
            if not m:
                out[self.top_level.get(k, k)] = v
                continue
            i, part, rest = int(m[1]), m[2], m[3]
            if part == self.mixer_norm:
                out[f"layers.{2 * i}.norm.{rest}"] = v
            elif part == self.ffn_norm:
                out[f"layers.{2 * i + 1}.norm.{rest}"] = v
            elif part == "mamba":
                out[f"layers.{2 * i}.mixer.{rename_first(rest, self.mamba_names)}"] = v
            elif part == "self_attn":
                out[f"layers.{2 * i}.mixer.{rest}"] = v
            else:
                ffn(2 * i + 1, part, rest, v, out)
        return out

    def to_hf(self, state: dict[str, torch.Tensor], cfg: HybridConfig, ffn: FFNToHF) -> dict[str, torch.Tensor]:
        """Our tensors under the format's names (the inverse of :meth:`from_hf`)."""
        back = {ours: theirs for theirs, ours in self.mamba_names.items()}
        top = {ours: theirs for theirs, ours in self.top_level.items()}
        out = {}
        for k, v in state.items():
            m = re.fullmatch(r"layers\.(\d+)\.(norm|mixer)\.(.+)", k)
            if not m:
                out[top.get(k, k)] = v
                continue
            j, part, rest = int(m[1]), m[2], m[3]
            i, is_ffn = divmod(j, 2)
            pre = f"model.layers.{i}"
            if part == "norm":
                out[f"{pre}.{self.ffn_norm if is_ffn else self.mixer_norm}.{rest}"] = v
            elif is_ffn:
                ffn(pre, j, rest, v, state, out)
            elif cfg.pattern[j] == "*":
                out[f"{pre}.self_attn.{rest}"] = v
            else:
                out[f"{pre}.mamba.{rename_first(rest, back)}"] = v
        return out
