"""A generation request as the engine tracks it, and what one step gives back for it."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..sampling import SamplingParams
from ..tokenizer import StreamDecoder


@dataclass
class RequestOutput:
    """What one step produced for one request: new token ids (and their text with a tokenizer)."""

    request_id: int
    new_token_ids: list[int]
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None  # "length", "stop" or "abort"


@dataclass(eq=False)  # identity semantics: requests are compared and hashed as objects
class Request:
    request_id: int
    prompt: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    seed: int
    decoder: StreamDecoder | None
    arrival_time: float = 0.0
    priority: int = 0  # vLLM's: lower values are scheduled first; ties go by arrival
    output: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens of ``tokens`` whose K/V and state are in the cache
    finish_reason: str | None = None
    first_token_time: float | None = None
    first_scheduled_time: float | None = None  # perf_counter when it was first admitted (its queue wait ends)
    # prompt log-probabilities: log P(prompt[i] | prompt[:i]) for i >= logprobs_from, with whether each
    # token was the argmax
    logprobs_from: int | None = None
    score_only: bool = False  # finish once the prompt is computed, sampling nothing (Engine.score)
    next_logprobs: object = None  # score_only: [vocab] log-probabilities after the whole prompt
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_greedy: list[bool] = field(default_factory=list)
    prefix_hit: int | None = None  # prompt tokens the prefix cache served at first admission
    recomputes: int = 0  # admissions after the first (preemption)

    @property
    def max_prefix_hit(self) -> int:
        """The most leading tokens a prefix-cache hit may serve: at least one token is computed (its
        logits are sampled), and every position whose logits are scored is computed."""
        limit = self.num_tokens - 1
        if self.logprobs_from is not None and self.logprobs_from < len(self.prompt):  # next position to score
            limit = min(limit, self.logprobs_from - 1 + len(self.prompt_logprobs))
        return limit

    def on_admit(self, start: int) -> None:
        if self.prefix_hit is None:
            self.prefix_hit = start
        else:
            self.recomputes += 1

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def num_pending(self) -> int:
        """Tokens not yet in the cache: 1 while decoding, more while (re)filling a prompt."""
        return self.num_tokens - self.num_computed

    def pending(self, n: int) -> list[int]:
        """The next ``n`` tokens to compute (without copying the whole sequence)."""
        start, cut = self.num_computed, len(self.prompt)
        if start >= cut:
            return self.output[start - cut:start - cut + n]
        return self.prompt[start:start + n] + self.output[:max(0, start + n - cut)]

    @property
    def text(self) -> str:
        return self.decoder.text if self.decoder is not None else ""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
