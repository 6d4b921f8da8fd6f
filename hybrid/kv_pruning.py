"""KV pruning policies for the attention layers, chosen per engine (``Engine(model, kv_pruning=...)``).

:class:`StreamingLLM` (Xiao et al., 2023): every query sees the first ``sinks`` tokens of its sequence (the
attention sinks) and the last ``window`` (itself included); the blocks wholly between the two are freed
back to the pool as the sequence grows (:meth:`hybrid.cache_manager.CacheManager.trim`, the same path a
sliding window takes, with the sink blocks kept), so a sequence holds at most
``ceil(sinks / block_size) + ceil(window / block_size) + 1`` blocks however long it gets. The attention ops
take ``sinks`` beside ``window`` (:mod:`hybrid.kernels.paged_attention`).

Positions: the cache stores keys with RoPE already applied at their original positions, so a kept token
keeps its original position; the paper instead re-numbers positions within the cache (rotating keys when
they are read), which matters once a sequence runs past the model's training context. Inside the trained
context the two agree on which tokens are seen; re-numbering is not implemented (it needs un-rotated keys
in the cache). The KV length of a sequence therefore equals its next position, and nothing in the
metadata changes.

SnapKV-style prompt compression (keep per KV head the prompt positions the prompt's last window attends
to most, free the rest) is **not implemented**: it needs a sequence's KV length to differ from its next
position and per-head keep lists, which the paged layout here (one block table per sequence, shared by
all heads) does not have yet.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StreamingLLM:
    """Attention sinks + recent window: the first ``sinks`` tokens and the last ``window`` stay visible."""

    sinks: int = 4
    window: int = 1020

    def __post_init__(self) -> None:
        if self.sinks < 0 or self.window < 1:
            raise ValueError(f"StreamingLLM needs sinks >= 0 and window >= 1, got sinks={self.sinks}, "
                             f"window={self.window}")

    def visible(self, key_pos: int, query_pos: int) -> bool:
        """Whether the token at ``key_pos`` is attended by the query at ``query_pos`` (the reference rule)."""
        return key_pos <= query_pos and (key_pos < self.sinks or query_pos - key_pos < self.window)
