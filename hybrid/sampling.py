"""Sampling on the device, batched: greedy, temperature, top-k, top-p, min-p, repetition penalty, seeds.

:func:`sample` turns a step's logits ``[B, V]`` into ``B`` token ids with tensor ops over the whole batch
(rows with different settings side by side); only the ids leave the device. Randomness is counter-based:
row ``b``'s draw is a hash of (its request's seed, how many tokens the request has sampled so far), so the
same seed gives the same tokens whatever else shares the batch, in whatever order, and after a
preemption — with no per-request generator object and no host round trip.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    ``temperature == 0`` is greedy. ``top_k = 0``, ``top_p = 1``, ``min_p = 0`` and
    ``repetition_penalty = 1`` switch those filters off. Generation stops after
    ``max_new_tokens``, at any of ``stop_token_ids`` (not included in the output; the engine adds
    the tokenizer's EOS unless ``ignore_eos``) or once the text contains a ``stop`` string (needs
    a tokenizer; the text is cut before it). ``seed=None`` draws a seed from torch's global RNG.
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))
        checks = [
            (isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1,
             f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}"),
            (self.temperature >= 0.0, f"temperature must be >= 0 (0 is greedy), got {self.temperature}"),
            (self.top_k >= 0, f"top_k must be >= 0 (0 is off), got {self.top_k}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.repetition_penalty > 0.0,
             f"repetition_penalty must be > 0 (1 is off), got {self.repetition_penalty}"),
            (all(isinstance(s, str) and s for s in self.stop), f"stop strings must be non-empty, got {self.stop!r}"),
            (self.seed is None or isinstance(self.seed, int), f"seed must be an int or None, got {self.seed!r}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def filters(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


# ---- counter-based uniforms ------------------------------------------------------------------------
# splitmix64's finaliser on int64 tensors. Multiplication wraps (two's complement); right shifts are
# arithmetic on int64, so each is masked down to a logical shift. Constants are the usual odd 64-bit
# multipliers written as signed int64.
_GOLDEN = -7046029254386353131  # 0x9e3779b97f4a7c15
_M1 = -4658895280553007687  # 0xbf58476d1ce4e5b9
_M2 = -7723592293110705685  # 0x94d049bb133111eb


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    return (x >> n) & ((1 << (64 - n)) - 1)


def uniforms(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """One uniform number in [0, 1) per row, a pure function of (seed, counter): int64 [B] each -> float64 [B]."""
    x = seeds * _GOLDEN + counters * _M2 + _GOLDEN
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    x = x ^ _shr(x, 31)
    return _shr(x, 11).double() / float(1 << 53)


# ---- the batch's settings as tensors -------------------------------------------------------------
@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling settings of one step, on the logits' device. ``seen`` [B, V] marks the tokens each
    row's context holds (only built when some row has a repetition penalty)."""

    temperature: torch.Tensor  # [B] float32; 0 for greedy rows
    top_k: torch.Tensor  # [B] int64; V when off
    top_p: torch.Tensor  # [B] float32
    min_p: torch.Tensor  # [B] float32
    penalty: torch.Tensor  # [B] float32
    seeds: torch.Tensor  # [B] int64
    counters: torch.Tensor  # [B] int64
    seen: torch.Tensor | None
    all_greedy: bool
    any_filter: bool

    @classmethod
    def build(cls, params: list[SamplingParams], seeds: list[int], counters: list[int],
              contexts: list[list[int]] | None, vocab: int, device: torch.device | str) -> SamplingBatch:
        """``contexts[b]``: row b's prompt + output ids (read only for rows with a repetition penalty)."""
        def t(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device)

        penalised = [b for b, p in enumerate(params) if p.repetition_penalty != 1.0]
        seen = None
        if penalised:
            rows = [b for b in penalised for _ in contexts[b]]
            cols = [tok for b in penalised for tok in contexts[b]]
            seen = torch.zeros(len(params), vocab, dtype=torch.bool, device=device)
            seen[t(rows, torch.long), t(cols, torch.long)] = True
        return cls(temperature=t([p.temperature for p in params], torch.float32),
                   top_k=t([p.top_k if p.top_k else vocab for p in params], torch.long),
                   top_p=t([p.top_p for p in params], torch.float32),
                   min_p=t([p.min_p for p in params], torch.float32),
                   penalty=t([p.repetition_penalty for p in params], torch.float32),
                   seeds=t(seeds, torch.long), counters=t(counters, torch.long), seen=seen,
                   all_greedy=all(p.greedy for p in params), any_filter=any(p.filters for p in params))


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """CTRL's penalty on tokens already in the context: divide positive logits, multiply negative ones.
    logits [B, V]; seen [B, V] bool; penalty [B]."""
    pen = penalty[:, None]
    return torch.where(seen, torch.where(logits > 0, logits / pen, logits * pen), logits)


def filtered_probs(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [B, V] (already penalised) -> (unnormalised probabilities [B, V], their token order [B, V] or
    None). With top-k / top-p / min-p on some row the probabilities come sorted, most likely first (the
    order maps a column back to its token id); without, they stay in vocabulary order."""
    temp = torch.where(batch.temperature > 0, batch.temperature, 1.0)[:, None]
    probs = torch.softmax(logits / temp, dim=-1)
    if not batch.any_filter:
        return probs, None
    sorted_p, order = torch.sort(probs, dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=probs.device)
    sorted_p = torch.where(rank[None] < batch.top_k[:, None], sorted_p, 0.0)  # top-k
    before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass of the strictly more likely kept tokens
    sorted_p = torch.where(before < batch.top_p[:, None] * sorted_p.sum(-1, keepdim=True), sorted_p, 0.0)  # top-p
    sorted_p = torch.where(sorted_p >= batch.min_p[:, None] * sorted_p[:, :1], sorted_p, 0.0)  # min-p
    return sorted_p, order


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """One next token per row: logits [B, V] -> ids [B] (int64, on the logits' device)."""
    logits = logits.float()
    if batch.seen is not None:
        logits = apply_repetition_penalty(logits, batch.seen, batch.penalty)
    greedy = logits.argmax(dim=-1)
    if batch.all_greedy:
        return greedy
    probs, order = filtered_probs(logits, batch)
    cdf = torch.cumsum(probs, dim=-1)
    total = cdf[:, -1:]
    # strictly below the total, so rounding can never land past the last token with mass
    u = torch.minimum(uniforms(batch.seeds, batch.counters).to(cdf.dtype)[:, None] * total,
                      torch.nextafter(total, torch.zeros_like(total)))
    col = torch.searchsorted(cdf, u, right=True).clamp_max(probs.shape[-1] - 1)
    drawn = (col if order is None else order.gather(1, col))[:, 0]
    return torch.where(batch.temperature > 0, drawn, greedy)
