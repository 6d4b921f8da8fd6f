"""``Engine``: continuous batching over a :class:`~hybrid.cache.HybridCache`.

Each :meth:`Engine.step` packs, within a token budget, one token for every running sequence that
is decoding, the next chunk of every running prefill, and then as many waiting requests as there
are state slots, KV blocks and budget for; runs one packed forward; samples; and returns the new
tokens of every request (streaming). A request computes ``tokens[num_computed:]`` each time it is
scheduled, so a prompt, a prompt chunk, a decode and a recompute after preemption are one code
path. When a decode finds no free KV block the newest running sequence is preempted: its blocks
and slot are freed at once and it re-enters the queue to recompute later from its tokens so far.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from .cache import HybridCache
from .inference import SeqChunk, build_batch
from .sampling import SamplingParams, sample_tokens
from .tokenizer import StreamDecoder

DEFAULT_CACHE_BYTES = 256 * 2**20


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
    generator: torch.Generator
    decoder: StreamDecoder | None
    output: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens of ``tokens`` whose K/V and state are in the cache
    finish_reason: str | None = None

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


@dataclass
class EngineStats:
    steps: int = 0
    preemptions: int = 0
    prefill_tokens: int = 0  # tokens run in steps that held any prefill (chunk of > 1 token)
    prefill_seconds: float = 0.0
    decode_tokens: int = 0  # tokens run in steps that were all one-token decodes
    decode_seconds: float = 0.0


class Engine:
    """Serve many generation requests on one model with continuous batching.

    ``max_seqs``: state slots (sequences in flight); ``max_batch_tokens``: token budget per step
    (prompts longer than it are prefilled in chunks). The cache is ``cache``, or one built for
    the model from ``num_blocks`` KV blocks or ``cache_bytes`` (default 256 MiB).
    """

    def __init__(self, model, *, cache: HybridCache | None = None, num_blocks: int | None = None,
                 cache_bytes: int | None = None, block_size: int = 16, max_seqs: int = 16,
                 max_batch_tokens: int = 512, tokenizer=None):
        if max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
        self.model = model.eval()
        if cache is None:
            if num_blocks is None and cache_bytes is None:
                cache_bytes = DEFAULT_CACHE_BYTES
            cache = HybridCache.for_model(model, num_blocks=num_blocks, cache_bytes=cache_bytes,
                                          block_size=block_size, max_seqs=max_seqs)
        self.cache = cache
        self.max_seqs = cache.ssm.num_slots
        self.max_batch_tokens = max_batch_tokens
        self.tokenizer = tokenizer
        self.requests: dict[int, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in arrival order: the last one is preempted first
        self.stats = EngineStats()
        self._next_id = 0

    # ---- requests --------------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None) -> int:
        """Queue a prompt; returns its request id. Raises ValueError for an empty prompt, ids
        outside the vocabulary, stop strings without a tokenizer, or a request the cache can
        never hold."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        prompt = [int(t) for t in prompt_ids]
        vocab = self.model.config.vocab_size
        if not prompt:
            raise ValueError("empty prompt: give at least one token id")
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is out of range for vocab_size {vocab} "
                             f"(valid ids are 0..{vocab - 1}); check the tokenizer matches the model")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop strings {list(params.stop)} need a tokenizer: pass tokenizer= to the Engine")
        need = len(prompt) + params.max_new_tokens - 1  # the last sampled token is never cached
        kv = self.cache.kv
        if kv.enabled and kv.blocks_held_at_most(need, self.max_batch_tokens) > kv.num_blocks:
            held = kv.blocks_held_at_most(need, self.max_batch_tokens)
            raise ValueError(
                f"request needs {need} cached tokens ({len(prompt)} prompt + {params.max_new_tokens} new - 1), "
                f"{held} KV blocks at once, but the whole KV cache holds {kv.capacity_tokens} tokens "
                f"({kv.num_blocks} blocks of {kv.block_size}); shorten the prompt, lower max_new_tokens "
                "or give the engine a bigger cache")
        stop_ids = set(params.stop_token_ids)
        if self.tokenizer is not None and not params.ignore_eos:
            stop_ids.update(_eos_ids(self.tokenizer))
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
        rid = self._next_id
        self._next_id += 1
        req = Request(rid, prompt, params, frozenset(stop_ids), torch.Generator().manual_seed(seed),
                      StreamDecoder(self.tokenizer) if self.tokenizer is not None else None)
        self.requests[rid] = req
        self.waiting.append(req)
        return rid

    def abort(self, request_id: int) -> None:
        req = self.requests[request_id]
        if req.finished:
            return
        if req in self.waiting:
            self.waiting.remove(req)
        self._finish(req, "abort")

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def forget(self, request_id: int) -> Request:
        """Drop a finished request from ``requests`` (a long-running server calls this once it
        has read the result) and return it."""
        req = self.requests[request_id]
        if not req.finished:
            raise ValueError(f"request {request_id} has not finished; abort it first")
        return self.requests.pop(request_id)

    # ---- scheduling ------------------------------------------------------------------------------
    def _release(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
            if self.cache.kv.enabled:
                self.cache.kv.free_sequence(req.request_id)
            self.cache.ssm.free(req.request_id)

    def _finish(self, req: Request, reason: str) -> None:
        self._release(req)
        req.finish_reason = reason

    def _preempt(self, req: Request) -> None:
        """Free everything ``req`` holds; it recomputes its tokens when it is scheduled again."""
        self._release(req)
        req.num_computed = 0
        self.waiting.appendleft(req)
        self.stats.preemptions += 1

    def _admit(self, req: Request, n: int) -> bool:
        kv = self.cache.kv
        full = len(self.running) >= self.max_seqs or self.cache.ssm.num_free == 0
        if full or kv.blocks_for(n) > kv.allocator.num_free:
            return False
        self.cache.ssm.allocate(req.request_id)
        if kv.enabled:
            kv.add_sequence(req.request_id)
            kv.reserve(req.request_id, n)
        self.running.append(req)
        return True

    def _schedule(self) -> list[tuple[Request, int]]:
        budget = self.max_batch_tokens
        plan: dict[Request, int] = {}
        kv = self.cache.kv
        decoding = [r for r in self.running if r.num_pending == 1]
        prefilling = [r for r in self.running if r.num_pending > 1]
        for req in decoding + prefilling:
            if req not in self.running:  # preempted this step to make room for an older sequence
                continue
            n = min(req.num_pending, budget)
            if n == 0:
                break
            while kv.enabled and not kv.can_hold(req.request_id, req.num_computed + n):
                victim = self.running[-1]  # the newest running sequence
                self._preempt(victim)
                budget += plan.pop(victim, 0)
                if victim is req:
                    break
            if req not in self.running:
                continue
            if kv.enabled:
                kv.reserve(req.request_id, req.num_computed + n)
            plan[req] = n
            budget -= n
        while budget and self.waiting:
            req = self.waiting[0]
            n = min(req.num_tokens, budget)
            if not self._admit(req, n):
                break
            self.waiting.popleft()
            plan[req] = n
            budget -= n
        # one-token sequences first (the packed forward's decode group); stable otherwise
        return sorted(plan.items(), key=lambda rn: rn[1] != 1)

    # ---- one step --------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one packed forward over the scheduled sequences; return each one's new tokens
        (requests that only advanced a prompt chunk get none and are not listed)."""
        plan = self._schedule()
        if not plan:
            if self.has_unfinished():  # add_request's size check makes this unreachable; never spin silently
                raise RuntimeError(f"the scheduler could not place any of {len(self.waiting)} waiting requests "
                                   f"({self.cache.kv.allocator.num_free} KV blocks, {self.cache.ssm.num_free} "
                                   "state slots free)")
            return []
        t0 = time.perf_counter()
        chunks = [SeqChunk(r.request_id, r.pending(n), r.num_computed) for r, n in plan]
        logits = self.model.forward_packed(build_batch(self.cache, chunks), self.cache)
        rows, sampled = [], []
        for b, (req, n) in enumerate(plan):
            req.num_computed += n
            if self.cache.kv.enabled:
                self.cache.kv.trim(req.request_id, req.num_computed)
            if req.num_pending == 0:
                rows.append(b)
                sampled.append(req)
        new_ids = sample_tokens(logits[rows], [r.params for r in sampled], [_context(r) for r in sampled],
                                [r.generator for r in sampled]) if rows else []
        outputs = [self._append(req, tok) for req, tok in zip(sampled, new_ids, strict=True)]
        n_tokens = sum(n for _, n in plan)
        dt = time.perf_counter() - t0
        if any(n > 1 for _, n in plan):
            self.stats.prefill_tokens += n_tokens
            self.stats.prefill_seconds += dt
        else:
            self.stats.decode_tokens += n_tokens
            self.stats.decode_seconds += dt
        self.stats.steps += 1
        return outputs

    def _append(self, req: Request, token: int) -> RequestOutput:
        p = req.params
        if token in req.stop_ids:
            self._finish(req, "stop")
            text = req.decoder.flush() if req.decoder is not None else ""
            return RequestOutput(req.request_id, [], text, True, "stop")
        req.output.append(token)
        text = ""
        if req.decoder is not None:
            seen = len(req.decoder.text)
            text = req.decoder.push([token])
            if len(req.output) >= p.max_new_tokens:
                text += req.decoder.flush()
            if p.stop:
                cut = _find_stop(req.decoder.text, p.stop, max(0, seen - max(map(len, p.stop)) + 1))
                if cut is not None:
                    text = req.decoder.text[seen:cut]
                    req.decoder.text = req.decoder.text[:cut]
                    self._finish(req, "stop")
                    return RequestOutput(req.request_id, [token], text, True, "stop")
        if len(req.output) >= p.max_new_tokens:
            self._finish(req, "length")
        return RequestOutput(req.request_id, [token], text, req.finished, req.finish_reason)

    def run(self) -> dict[int, Request]:
        """Step until every queued request has finished; returns all requests by id."""
        while self.has_unfinished():
            self.step()
        return self.requests


def _eos_ids(tokenizer) -> tuple[int, ...]:
    """Every end-of-sequence id of ``tokenizer`` (ours list them all; others give one or none)."""
    ids = getattr(tokenizer, "eos_token_ids", None)
    if ids is None:
        eos = getattr(tokenizer, "eos_token_id", None)
        ids = () if eos is None else (eos,)
    return tuple(ids)


def _context(req: Request) -> torch.Tensor:
    """The ids the repetition penalty looks at (none when it is off: no O(context) copy per token)."""
    return torch.tensor(req.tokens if req.params.repetition_penalty != 1.0 else [], dtype=torch.long)


def _find_stop(text: str, stops: tuple[str, ...], start: int) -> int | None:
    """Earliest index at which any stop string occurs in ``text[start:]``."""
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else None
