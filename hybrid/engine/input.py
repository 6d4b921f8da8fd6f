"""The input processor: a prompt and its sampling parameters become a :class:`~hybrid.engine.request.Request`
(after vLLM v1's input processor) — the prompt checked against the vocabulary, the parameters against what the
engine can do, the stop ids gathered, the seed drawn — and a fork's request built from its source's."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ..sampling import SamplingParams
from ..tokenizer import StreamDecoder
from .output import eos_ids
from .request import Request


def random_seed() -> int:
    """A request's seed when its parameters give none: drawn from torch's global RNG."""
    return int(torch.randint(0, 2**62, ()).item())


class InputProcessor:
    """Builds the engine's requests. ``check_fits(prompt_len, new_cached)`` refuses a request the whole
    cache could never hold; it runs after every other check, before the seed is drawn."""

    def __init__(self, vocab_size: int, tokenizer, check_fits: Callable[[int, int], None]):
        self.vocab_size, self.tokenizer, self.check_fits = vocab_size, tokenizer, check_fits

    def stop_ids(self, params: SamplingParams) -> frozenset[int]:
        stop_ids = set(params.stop_token_ids)
        if self.tokenizer is not None and not params.ignore_eos:
            stop_ids.update(eos_ids(self.tokenizer))
        return frozenset(stop_ids)

    def _decoder(self) -> StreamDecoder | None:
        return StreamDecoder(self.tokenizer) if self.tokenizer is not None else None

    def request(self, rid: int, prompt_ids, params: SamplingParams | None, logprobs_from: int | None, *,
                score_only: bool, priority: int = 0) -> Request:
        """A new request ``rid``: ValueError for an empty prompt, ids outside the vocabulary, a
        ``logprobs_from`` without a token before it, stop strings without a tokenizer, or a request the cache
        can never hold; TypeError for parameters that are not a SamplingParams."""
        params = params or SamplingParams(max_new_tokens=1 if score_only else SamplingParams().max_new_tokens)
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        prompt = [int(t) for t in prompt_ids]
        vocab = self.vocab_size
        if not prompt:
            raise ValueError("empty prompt: give at least one token id")
        if logprobs_from is not None and not score_only and not 1 <= logprobs_from < len(prompt):
            raise ValueError(f"prompt_logprobs_from must be in 1..{len(prompt) - 1} (a position with a token "
                             f"before it), got {logprobs_from}")
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is out of range for vocab_size {vocab} "
                             f"(valid ids are 0..{vocab - 1}); check the tokenizer matches the model")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop strings {list(params.stop)} need a tokenizer: pass tokenizer= to the Engine")
        self.check_fits(len(prompt), 0 if score_only else params.max_new_tokens - 1)
        seed = params.seed if params.seed is not None else random_seed()
        return Request(rid, prompt, params, self.stop_ids(params), seed, self._decoder(),
                       arrival_time=time.perf_counter(), logprobs_from=logprobs_from, score_only=score_only,
                       priority=priority)

    def fork_params(self, src: Request, params: SamplingParams | None) -> tuple[SamplingParams, int]:
        """A fork's parameters (``params``, default the source's) and seed (a fork of a sampled request samples
        its own path unless ``params`` gives a seed); ValueError when they leave it nothing to generate or the
        cache could never hold it."""
        own = params is not None and params.seed is not None
        params = params or src.params
        if len(src.output) >= params.max_new_tokens:
            raise ValueError(f"max_new_tokens={params.max_new_tokens} leaves the fork nothing to generate: the source "
                             f"has {len(src.output)} tokens already")
        self.check_fits(len(src.prompt), params.max_new_tokens - 1)
        return params, params.seed if own else random_seed()

    def fork(self, rid: int, src: Request, params: SamplingParams, seed: int) -> Request:
        """The forked request ``rid``: the source's tokens so far, its own parameters and seed."""
        req = Request(rid, list(src.prompt), params, self.stop_ids(params), seed, self._decoder(),
                      arrival_time=time.perf_counter(), output=list(src.output), num_computed=src.num_computed,
                      priority=src.priority)
        if req.decoder is not None:
            req.decoder.push(list(src.output))
        return req
