"""Declarative weight-name tables: one table per converter drives both import and export.

The design follows torchtitan's ``state_dict_adapter.py`` (a ``from_hf_map`` of name templates whose
inverse gives ``to_hf``), extended with declared tensor transforms for the tensors that are not a
pure rename. A converter writes a :class:`Table` of :class:`Rule` s and calls
:meth:`Table.from_hf` / :meth:`Table.to_hf`; no converter keeps its own name loop.

API (for converters, including ones added later)::

    TABLE = Table(arch="BambaForCausalLM", tied_head=("lm_head.weight", "model.embed_tokens.weight"), rules=(
        Rule("embed.weight", "model.embed_tokens.weight"),
        Rule("layers.{2i}.mixer.{rest}", "model.layers.{i}.self_attn.{rest}", kinds="*"),
        Rule(("layers.{2i+1}.mixer.gate_proj", "layers.{2i+1}.mixer.up_proj"),
             "model.layers.{i}.feed_forward.experts.gate_up_proj", op=Chunk(2, dim=1)),
        Rule("layers.{2i+1}.mixer.{mat:gate_proj|up_proj|down_proj}",
             "model.layers.{i}.feed_forward.experts.{e}.{mat}.weight",
             op=Stack("e", count=lambda cfg: cfg.moe.n_experts)),
    ), skip=("mtp.{any}",))
    ours = TABLE.from_hf(hf_state, cfg);  theirs = TABLE.to_hf(our_state, cfg)

Templates: ``{i}`` is the checkpoint's layer index; on our side ``{i}`` is the same index, ``{2i}`` /
``{2i+1}`` our layers when one checkpoint layer holds two of ours (a mixer then a feed-forward);
``{e}`` (any other bare name) an index; ``{name:a|b}`` one of the listed words; ``{rest}`` any
non-empty tail; ``{any}`` any text, empty included. A rule has one or more names on each side and an
:class:`Op` mapping the checkpoint's tensors to ours (``op.from_hf``) and back (``op.to_hf``), given the
model config: one op declares both directions, so no hand-written inverse exists. Ops here are the
layout changes formats share (:class:`Chunk`, :class:`Split`, :class:`Stack`); a value transform only one
format has is an :class:`Op` subclass declared next to its table. The first matching rule wins, in both
directions, so specific rules come before ``{rest}`` rules. ``kinds`` (our pattern symbols) limits a
rule to our layers of those kinds when exporting (``self_attn`` vs ``mamba`` both hold
``layers.{2i}.mixer.*``), and on import too with ``import_kinds=True`` (for formats whose names alone do
not tell the layer kinds apart). ``export=False`` marks an alternative layout read on import only (the
first exportable rule is what is written). ``drop_empty`` drops a rule's tensors when all are empty
(transformers saves absent modules as empty tensors). A table's ``skip`` templates name checkpoint
tensors import drops (multi-token-prediction heads, recomputable buffers); ``tied_head`` names the head
and embedding a tied checkpoint may store (the head is dropped on import, and written as a copy of the
embedding on export when ``export_tied_head``, for formats whose loaders never tie).

Names no rule matches keep their own name, so the strict load that follows refuses them by name
(and a missing tensor is reported by name the same way)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch

from ..checkpoint import CheckpointError
from .common import drop_tied_head

_FIELD = re.compile(r"\{([\w+]+)(?::([\w|]+))?\}")
# our-side layer placeholders -> (stride, offset): layer = stride * i + offset
_LAYER = {"i": (1, 0), "2i": (2, 0), "2i+1": (2, 1)}


class Op:
    """A tensor transform between a rule's checkpoint tensors and ours (given the model config);
    identity by default."""

    def from_hf(self, theirs: list[torch.Tensor], cfg) -> list[torch.Tensor]:
        return theirs

    def to_hf(self, ours: list[torch.Tensor], cfg) -> list[torch.Tensor]:
        return ours


@dataclass(frozen=True)
class Chunk(Op):
    """One checkpoint tensor fused along ``dim`` from our ``n`` equal parts, in order (e.g. gate then up)."""

    n: int
    dim: int = 0

    def from_hf(self, theirs, cfg):
        return [p.contiguous() for p in theirs[0].chunk(self.n, dim=self.dim)]

    def to_hf(self, ours, cfg):
        return [torch.cat(ours, dim=self.dim)]


@dataclass(frozen=True)
class Split(Op):
    """One checkpoint tensor fused along ``dim`` from our parts of unequal sizes, in order: ``sizes(cfg)``
    (e.g. the q, k and v rows of a fused projection with fewer key/value heads)."""

    sizes: Callable
    dim: int = 0

    def from_hf(self, theirs, cfg):
        return [p.contiguous() for p in torch.split(theirs[0], self.sizes(cfg), dim=self.dim)]

    def to_hf(self, ours, cfg):
        return [torch.cat(ours, dim=self.dim)]


@dataclass(frozen=True)
class Stack(Op):
    """Checkpoint tensors, one per value of the placeholder ``over`` (``count(cfg)`` of them), are
    slices ``[k]`` of one tensor of ours."""

    over: str
    count: Callable
    label: str = "experts"  # what the stacked slices are, for errors

    def from_hf(self, theirs, cfg):
        return [torch.stack(theirs)]

    def to_hf(self, ours, cfg):
        return list(ours[0].unbind(0))


IDENTITY = Op()


@dataclass(frozen=True)
class Rule:
    ours: str | tuple[str, ...]
    theirs: str | tuple[str, ...]
    op: Op = IDENTITY
    kinds: str | None = None
    export: bool = True
    drop_empty: bool = False
    import_kinds: bool = False  # apply ``kinds`` on import too

    def __post_init__(self):
        for side in ("ours", "theirs"):
            if isinstance(getattr(self, side), str):
                object.__setattr__(self, side, (getattr(self, side),))
        # a {name:a|b} declared in one template holds for a bare {name} in the rule's others
        words = {m[1]: m[2] for t in (*self.ours, *self.theirs) for m in _FIELD.finditer(t) if m[2]}
        if words:
            def declare(t: str) -> str:
                return _FIELD.sub(lambda m: f"{{{m[1]}:{words[m[1]]}}}" if m[1] in words else m[0], t)
            for side in ("ours", "theirs"):
                object.__setattr__(self, side, tuple(map(declare, getattr(self, side))))


@cache
def _regex(template: str) -> re.Pattern:
    out, pos = [], 0
    for m in _FIELD.finditer(template):
        out.append(re.escape(template[pos:m.start()]))
        name, words = m[1], m[2]
        group = {"2i": "_m", "2i+1": "_f"}.get(name, name)
        if words:
            value = "|".join(map(re.escape, words.split("|")))
        else:
            value = {"rest": ".+", "any": ".*"}.get(name, r"\d+")
        out.append(f"(?P<{group}>{value})")
        pos = m.end()
    out.append(re.escape(template[pos:]))
    return re.compile("".join(out))


def _match(template: str, name: str, ours: bool) -> dict | None:
    """The placeholder values of ``name`` under ``template`` (with ``"layer"``: our layer index), or None."""
    m = _regex(template).fullmatch(name)
    if m is None:
        return None
    b = {k: (int(v) if v.isdigit() and k not in ("rest", "any") else v) for k, v in m.groupdict().items()}
    for field_name, group in (("2i", "_m"), ("2i+1", "_f"), ("i", "i")):
        if group in b:
            stride, offset = _LAYER[field_name] if ours else (1, 0)
            v = b.pop(group)
            if v % stride != offset:
                return None
            b["layer"], b["i"] = v, v // stride
            break  # one layer placeholder per template
    return b


def _our_layer(template: str, i: int) -> int | None:
    """Our layer index that ``template`` (our side) gives checkpoint layer ``i``; None without a layer."""
    for m in _FIELD.finditer(template):
        if m[1] in _LAYER:
            stride, offset = _LAYER[m[1]]
            return stride * i + offset
    return None


def _fill(template: str, b: dict) -> str:
    def one(m):
        name = m[1]
        if name in _LAYER:
            stride, offset = _LAYER[name]
            return str(stride * b["i"] + offset)
        return str(b[name])
    return _FIELD.sub(one, template)


@dataclass(frozen=True)
class Table:
    """A converter's whole name mapping (see the module docstring)."""

    arch: str
    rules: tuple[Rule, ...]
    # (the checkpoint's head, its embedding, or the embedding's alternative names, first present wins):
    # the head is dropped on import when tied
    tied_head: tuple[str, str | tuple[str, ...]] | None = None
    export_tied_head: bool = False  # a tied model is written with its head as a copy of the embedding
    skip: tuple[str, ...] = ()  # checkpoint names import drops

    def from_hf(self, state: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors under our names."""
        if self.skip:
            state = {k: v for k, v in state.items() if not any(_regex(t).fullmatch(k) for t in self.skip)}
        if self.tied_head is not None and cfg.tie_embeddings:
            drop_tied_head(self.arch, state, self.tied_head[0], self.embedding_name(state))
        return self._apply(state, cfg, importing=True)

    def embedding_name(self, state: dict[str, torch.Tensor]) -> str:
        """The name ``state`` stores the embedding under: the first of ``tied_head``'s alternatives present
        (the last when none is)."""
        embed = self.tied_head[1]
        embeds = (embed,) if isinstance(embed, str) else embed
        return next((e for e in embeds if e in state), embeds[-1])

    def to_hf(self, state: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
        """Our tensors under the checkpoint's names (the same rules read the other way)."""
        out = self._apply(state, cfg, importing=False)
        if self.export_tied_head and cfg.tie_embeddings:
            head, embed = self.tied_head
            out[head] = out[embed if isinstance(embed, str) else embed[0]].clone()
        return out

    def _apply(self, state, cfg, importing: bool) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        groups: dict[tuple, dict] = {}  # (rule, placeholder values) -> {(slot, stacked index): tensor}
        for name, v in state.items():
            hit = self._find(name, cfg, importing)
            if hit is None:
                out[name] = v  # unknown: keeps its name so the strict load names it
                continue
            r, slot, b = hit
            over = r.op.over if isinstance(r.op, Stack) else None
            k = b.pop(over) if over is not None and over in b else None
            key = (r, tuple(sorted((n, x) for n, x in b.items() if n != "layer")))
            groups.setdefault(key, {})[(slot, k)] = v
        for (r, bound), parts in groups.items():
            b = dict(bound)
            src, dst = (r.theirs, r.ours) if importing else (r.ours, r.theirs)
            if isinstance(r.op, Stack):
                out.update(self._stack(r, b, parts, src, dst, cfg, importing))
                continue
            lacking = [_fill(src[s], b) for s in range(len(src)) if (s, None) not in parts]
            if lacking:
                raise CheckpointError(f"{self.arch}: {_fill(src[0], b) if len(src) == 1 else lacking[0]} is missing "
                                      f"from the group {[_fill(t, b) for t in src]} that maps to "
                                      f"{[_fill(t, b) for t in dst]}")
            tensors = [parts[(s, None)] for s in range(len(src))]
            if importing and r.drop_empty and all(t.numel() == 0 for t in tensors):
                continue
            for t, v in zip(dst, r.op.from_hf(tensors, cfg) if importing else r.op.to_hf(tensors, cfg), strict=True):
                out[_fill(t, b)] = v
        return out

    def _stack(self, r, b, parts, src, dst, cfg, importing):
        n = r.op.count(cfg)
        if importing:
            have = sorted(k for _, k in parts)
            if have != list(range(n)):
                lacking = sorted(set(range(n)) - set(have))
                where = _fill(src[0], {**b, r.op.over: f"{{{r.op.over}}}"})  # e.g. "...experts.{e}.up_proj"
                raise CheckpointError(f"{self.arch}: {_fill(dst[0], b)} has {r.op.label} {have} in the checkpoint "
                                      f"({where}) but the config says {n}"
                                      + (f" (missing {r.op.label} {lacking})" if lacking else ""))
            return {_fill(dst[0], b): r.op.from_hf([parts[(0, k)] for k in range(n)], cfg)[0]}
        return {_fill(dst[0], {**b, r.op.over: k}): t for k, t in enumerate(r.op.to_hf([parts[(0, None)]], cfg))}

    def _find(self, name: str, cfg, importing: bool):
        for r in self.rules:
            if not importing and not r.export:
                continue
            for slot, template in enumerate(r.theirs if importing else r.ours):
                b = _match(template, name, ours=not importing)
                if b is None:
                    continue
                if r.kinds is not None and not self._of_kinds(r, b, cfg, importing):
                    continue
                return r, slot, b
        return None

    @staticmethod
    def _of_kinds(r: Rule, b: dict, cfg, importing: bool) -> bool:
        """Whether the matched layer is of ``r.kinds`` (always, where the rule does not check kinds)."""
        if importing:
            if not r.import_kinds or "i" not in b:
                return True
            layer = _our_layer(r.ours[0], b["i"])
            # a layer the config does not have matches no kind, so its tensors keep their names (refused)
            return layer is None or (layer < len(cfg.pattern) and cfg.pattern[layer] in r.kinds)
        return "layer" not in b or cfg.pattern[b["layer"]] in r.kinds
