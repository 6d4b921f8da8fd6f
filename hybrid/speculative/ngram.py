"""N-gram prompt lookup (no draft model): propose what followed the latest earlier occurrence of the
request's last n tokens (longest n first). Deterministic: its proposal distribution is one-hot."""

from __future__ import annotations


def ngram_lookup(tokens: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """Up to ``k`` tokens continuing the latest earlier match of ``tokens``' last n tokens, for n from
    ``n_max`` down to ``n_min``; [] when nothing matches."""
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = tokens[length - n:]
        first = suffix[0]
        for i in range(length - n - 1, -1, -1):  # latest first; i + n <= length - 1 leaves a continuation
            if tokens[i] == first and tokens[i:i + n] == suffix:
                return tokens[i + n:i + n + k]
    return []


class NgramDrafter:
    """Drafts from each request's own tokens; holds no cache, so it has nothing to roll back."""

    deterministic = True

    def __init__(self, n_max: int, n_min: int):
        self.n_max, self.n_min = n_max, n_min
        self.forward_seconds = 0.0
        self.rollback_seconds = 0.0

    def propose(self, reqs, ks: list[int]) -> tuple[list[list[int]], None]:
        return [ngram_lookup(r.tokens, k, self.n_max, self.n_min) for r, k in zip(reqs, ks, strict=True)], None

    def rollback(self, reqs, starts: list[int], drafted: list[int], kept: list[int]) -> None:
        """Nothing to undo: the drafter keeps no state."""

    def release(self, request_id: int, tokens: list[int] | None = None) -> None:
        """Nothing held."""
