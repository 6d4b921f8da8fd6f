"""``SpeculativeConfig``: how an :class:`hybrid.Engine` drafts tokens for its decoding requests."""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("draft", "ngram")


@dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """Speculative decoding settings.

    ``method="draft"``: a draft ``HybridLM`` (``draft_model``, same vocabulary as the target, typically much
    smaller) proposes ``num_tokens`` tokens per step for every decoding request; it keeps its own cache
    (``draft_cache_bytes`` or ``draft_num_blocks`` of KV, default: the engine's KV budget scaled by the
    models' bytes per token) and is rolled back like the target's. ``method="ngram"``: prompt lookup, no
    draft model: the continuation of the latest earlier occurrence of the request's last ``ngram_max`` ..
    ``ngram_min`` tokens (longest match first) is proposed.

    The target checks all drafts in one packed forward; its output distribution is unchanged (greedy
    output is identical; sampled output follows the speculative rejection rule).
    """

    method: str
    num_tokens: int = 4
    draft_model: object = None
    ngram_max: int = 3
    ngram_min: int = 1
    draft_cache_bytes: int | None = None
    draft_num_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        if not isinstance(self.num_tokens, int) or self.num_tokens < 1:
            raise ValueError(f"num_tokens (draft tokens per step) must be an int >= 1, got {self.num_tokens!r}")
        if self.method == "draft":
            if self.draft_model is None:
                raise ValueError('method="draft" needs draft_model= (a HybridLM with the target\'s vocabulary)')
        elif self.draft_model is not None or self.draft_cache_bytes is not None or self.draft_num_blocks is not None:
            raise ValueError('method="ngram" drafts without a model: drop draft_model / draft_cache_bytes / '
                             'draft_num_blocks, or use method="draft"')
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got ngram_min={self.ngram_min}, "
                             f"ngram_max={self.ngram_max}")
