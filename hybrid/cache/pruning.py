"""KV pruning policies for the attention layers, chosen per engine (``Engine(model, kv_pruning=...)``).

:class:`StreamingLLM` (Xiao et al., 2023): every query sees the first ``sinks`` tokens of its sequence (the
attention sinks) and the last ``window`` (itself included); the blocks wholly between the two are freed
back to the pool as the sequence grows (:meth:`hybrid.cache.manager.CacheManager.trim`, the same path a
sliding window takes, with the sink blocks kept), so a sequence holds at most
``ceil(sinks / block_size) + ceil(window / block_size) + 1`` blocks however long it gets. The attention ops
take ``sinks`` beside ``window`` (:mod:`hybrid.kernels.paged_attention`).

Positions (``renumber=True``, the default): the paper numbers positions within the cache, not the text: the
``sinks`` sinks sit at cache positions ``0..sinks-1`` and the window right after them, the query last (a query
at real position ``p`` sees its last ``window`` tokens, itself included, so from ``p >= sinks + window - 1`` on
it is at cache position ``sinks + window - 1``). Under RoPE a score depends only on the query position minus
the key position, and the window keys are contiguous in both numberings: they keep their true distances to
the query, only the sinks move (the distance to sink ``i`` becomes ``min(p, sinks + window - 1) - i`` instead
of ``p - i``). So the cache keeps the keys RoPE-rotated at their real positions, and the attention layer rotates
each query a second time, at :meth:`StreamingLLM.sink_position` ``min(p, sinks + window - 1)``; the attention
ops score the sink keys with that query and the window keys with the normal one (``q_sinks``). Exact, no cache
rewrite, and int8 / fp8 pages work unchanged. ``renumber=False`` keeps every token at its real position (what
this module did before): inside ``sinks + window`` tokens the two agree, past it they differ. The KV length of a
sequence equals its next position either way, and nothing in the metadata changes.

SnapKV (Li et al., 2024, :class:`SnapKV`): after a sequence's prompt is prefilled, each attention layer scores
every prompt position, per KV head, by the softmax attention the last ``window`` prompt queries (the observation
window) give it (summed over the window's queries and the query heads of the KV group, 1-D max/avg pooled with
``kernel`` so neighbours of important tokens survive), keeps the ``budget - window`` best positions before the
window plus the window itself, and frees the rest; decoding attends only to the kept K/V and every new token.
How the engine does it:

- the queries of the observation window are *captured* in the attention layer's packed forward
  (:class:`QueryCapture`; the step's metadata says which rows, :class:`ObservedRows`), chunk by chunk, so a
  prompt whose last chunk is shorter than the window still has its whole window; recomputing them later would
  need the layer inputs, which the engine does not keep. The keys come from the pool (dequantised).
- compaction (:meth:`hybrid.cache.manager.CacheManager.trim` when the prompt's last chunk is done): slot ``j``
  of the sequence's first ``ceil(budget / block_size)`` blocks holds, for each KV head ``h``, head ``h``'s
  ``j``-th kept token (pool layout ``[blocks, block_size, Hkv, D]``: one block table serves per-head
  selections), re-quantised for int8 / fp8 pages; the blocks after them go back to the pool. Keys carry
  RoPE at their original positions, so nothing is re-rotated; a compressed sequence's *KV length* (tokens in
  its blocks: what the attention ops read) is then ``dropped`` less than its next *position* (what RoPE takes),
  and the cache manager converts one to the other for the step metadata.
- a preempted sequence recomputes its prompt, is compressed again at the prompt's end (a prefill chunk stops
  there), and its generated tokens then run as a prefill chunk over the compressed cache, as they first did one
  decode at a time.

Prompts of at most ``budget`` tokens are left alone. Not with prefix caching (a compressed sequence's blocks are
not its prompt's prefix) nor with a sliding-window model (the window would count KV slots, not positions).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class StreamingLLM:
    """Attention sinks + recent window: the first ``sinks`` tokens and the last ``window`` stay visible; with
    ``renumber`` (the paper's way) positions count within the cache (module docstring)."""

    sinks: int = 4
    window: int = 1020
    renumber: bool = True

    def __post_init__(self) -> None:
        if self.sinks < 0 or self.window < 1:
            raise ValueError(f"StreamingLLM needs sinks >= 0 and window >= 1, got sinks={self.sinks}, "
                             f"window={self.window}")
        if not isinstance(self.renumber, bool):
            raise ValueError(f"StreamingLLM renumber must be True or False (0 or 1 on the command line), "
                             f"got {self.renumber!r}")

    def visible(self, key_pos: int, query_pos: int) -> bool:
        """Whether the token at ``key_pos`` is attended by the query at ``query_pos`` (the reference rule)."""
        return key_pos <= query_pos and (key_pos < self.sinks or query_pos - key_pos < self.window)

    def cache_positions(self, query_pos: int) -> tuple[list[int], list[int]]:
        """The paper's numbering for the query at ``query_pos``: (the real positions of the keys it sees, in
        order, and the position each has in the cache); the query's own is the last. Without ``renumber`` the
        cache positions are the real ones."""
        seen = [j for j in range(query_pos + 1) if self.visible(j, query_pos)]
        return seen, (list(range(len(seen))) if self.renumber else seen)

    @staticmethod
    def sink_position(positions: torch.Tensor, sinks: int, window: int) -> torch.Tensor:
        """Where a query at real position ``positions`` sits in the paper's cache numbering: the position its
        second rotation (the one that scores the sink keys) takes, ``min(p, sinks + window - 1)``. Keys at
        ``< sinks`` are then ``p' - i`` away, as in the paper; a query whose window still overlaps the sinks
        (``p < sinks + window - 1``) sees positions ``0..p`` and is not moved."""
        return positions.clamp_max(sinks + window - 1)


POOLINGS = ("max", "avg")


@dataclass(frozen=True)
class SnapKV:
    """SnapKV prompt compression: per KV head keep the ``budget - window`` prompt positions the last ``window``
    prompt queries attend to most (scores pooled over ``kernel`` neighbours, ``pooling`` "max" or "avg"), plus
    the window itself; ``budget`` tokens per head in all."""

    budget: int
    window: int = 32
    kernel: int = 7
    pooling: str = "max"

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"SnapKV needs window >= 1 (the observation window of prompt queries), got {self.window}")
        if self.budget <= self.window:
            raise ValueError(f"SnapKV needs budget > window (the budget holds the window and the positions it picks), "
                             f"got budget={self.budget}, window={self.window}; raise budget or lower window")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"SnapKV needs an odd kernel >= 1 (pooling keeps one score per position), "
                             f"got {self.kernel}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"SnapKV pooling must be one of {POOLINGS}, got {self.pooling!r}")

    def compresses(self, prompt_len: int) -> bool:
        """Whether a prompt of ``prompt_len`` tokens is compressed (longer than the budget)."""
        return prompt_len > self.budget

    def scores(self, q: torch.Tensor, k: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """Pooled scores of the positions before the window: q [window, Hq, D] (the prompt's last queries), k
        [L, Hkv, D] (the prompt's keys) -> [Hkv, L - window] fp32."""
        W, Hq, D = q.shape
        L, Hkv = k.shape[0], k.shape[1]
        scale = D ** -0.5 if scale is None else scale
        qg = q.float().view(W, Hkv, Hq // Hkv, D)  # query head h serves KV head h // (Hq // Hkv)
        s = torch.einsum("wgrd,lgd->grwl", qg, k.float()) * scale  # [Hkv, rep, W, L]
        causal = torch.arange(L, device=q.device)[None, :] <= torch.arange(L - W, L, device=q.device)[:, None]
        p = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1)
        votes = p[..., :L - W].sum(dim=(1, 2))  # [Hkv, L - W]
        pool = F.max_pool1d if self.pooling == "max" else F.avg_pool1d
        return pool(votes[:, None], self.kernel, stride=1, padding=self.kernel // 2)[:, 0]

    def select(self, q: torch.Tensor, k: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """Kept prompt positions per KV head, ascending: [Hkv, budget] int64. The best ``budget - window``
        pooled scores (ties to the earlier position: max pooling makes runs of equal scores) and the window."""
        L = k.shape[0]
        pooled = self.scores(q, k, scale)
        order = torch.sort(pooled, dim=-1, descending=True, stable=True).indices[:, :self.budget - self.window]
        window = torch.arange(L - self.window, L, device=k.device).expand(k.shape[1], -1)
        return torch.cat([order.sort(dim=-1).values, window], dim=-1)


@dataclass(frozen=True)
class ObservedRows:
    """The rows of a step's packed batch that are observation-window queries of sequences SnapKV will compress:
    ``rows [R]`` int64 token rows, in sequence order, ``counts[i]`` of them for ``seq_ids[i]``."""

    rows: torch.Tensor
    seq_ids: tuple[int, ...]
    counts: tuple[int, ...]


class QueryCapture:
    """The observation-window queries of the sequences SnapKV will compress, per sequence and attention layer,
    as the attention layers' packed forwards hand them over (:meth:`layer`), chunk by chunk."""

    def __init__(self) -> None:
        self.saved: dict[int, dict[int, list[torch.Tensor]]] = {}

    def layer(self, index: int):
        """The callable attention layer ``index`` gets: ``observe(batch, q)`` keeps its rows ``batch.observe``."""
        def observe(batch, q: torch.Tensor) -> None:
            obs = batch.observe
            if obs is None:
                return
            for seq_id, part in zip(obs.seq_ids, q[obs.rows].split(list(obs.counts)), strict=True):
                self.saved.setdefault(seq_id, {}).setdefault(index, []).append(part.clone())
        return observe

    def take(self, seq_id: int) -> dict[int, torch.Tensor]:
        """The queries of ``seq_id`` per layer, [window, Hq, D], forgotten here."""
        return {i: torch.cat(parts) for i, parts in self.saved.pop(seq_id, {}).items()}

    def drop(self, seq_id: int) -> None:
        self.saved.pop(seq_id, None)


_POLICIES = {"snapkv": SnapKV, "streaming": StreamingLLM}


def parse_policy(text: str) -> SnapKV | StreamingLLM:
    """``snapkv:budget=512,window=32,kernel=7,pooling=max`` or ``streaming:sinks=4,window=1020,renumber=1``
    (fields left out take their defaults) -> the policy; what ``--kv-pruning`` takes."""
    name, _, fields = text.partition(":")
    cls = _POLICIES.get(name.strip().lower())
    if cls is None:
        raise ValueError(f"unknown KV pruning policy {name!r}: write "
                         "snapkv:budget=N[,window=W,kernel=K,pooling=max|avg] or "
                         "streaming:sinks=S,window=W[,renumber=0|1]")
    known = {f.name: f.type for f in cls.__dataclass_fields__.values()}
    kw = {}
    for item in filter(None, (f.strip() for f in fields.split(","))):
        key, eq, value = item.partition("=")
        if not eq or key not in known:
            raise ValueError(f"{name}: cannot read {item!r}; fields are {', '.join(known)} (as key=value)")
        if key == "renumber":
            if value not in ("0", "1"):
                raise ValueError(f"{name}: renumber must be 0 or 1, got {value!r}")
            kw[key] = value == "1"
            continue
        try:
            kw[key] = value if key == "pooling" else int(value)
        except ValueError:
            raise ValueError(f"{name}: {key} must be an integer, got {value!r}") from None
    try:
        return cls(**kw)
    except TypeError as e:
        raise ValueError(f"{name}: {e}; fields are {', '.join(known)}") from None


def policy_text(policy: SnapKV | StreamingLLM) -> str:
    """The ``--kv-pruning`` text of ``policy``, every field spelled out: ``parse_policy(policy_text(p)) == p``
    (how an :class:`hybrid.EngineConfig` stores its policy in JSON)."""
    name = next(n for n, cls in _POLICIES.items() if isinstance(policy, cls))
    values = {f: getattr(policy, f) for f in type(policy).__dataclass_fields__}
    return f"{name}:" + ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in values.items())
