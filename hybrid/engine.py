"""``Engine``: continuous batching over paged KV blocks and Mamba state slots — the small front door over
four rooms (after vLLM's v1 engine):

- :class:`~hybrid.scheduler.Scheduler`: who runs this step and how many tokens (token budget, chunked
  prefill, newest-first preemption with recompute);
- :class:`~hybrid.cache_manager.CacheManager`: the only code that hands out and takes back blocks and
  state slots;
- :class:`~hybrid.model_runner.ModelRunner`: the step's metadata, built once; the eager or compiled
  forward; sampling on the device;
- :mod:`~hybrid.output_processor`: stop ids and strings, length limit, detokenising.

The engine itself validates requests, wires the rooms together and keeps the statistics.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .cache import HybridCache
from .cache_manager import CacheManager
from .model_runner import ModelRunner
from .output_processor import eos_ids, process_token
from .packed_batch import SeqChunk
from .request import Request, RequestOutput
from .sampling import SamplingParams
from .scheduler import Scheduler
from .tokenizer import StreamDecoder

DEFAULT_CACHE_BYTES = 256 * 2**20


@dataclass
class EngineStats:
    """Counters and the time of each part of a step. A step that held any prompt chunk counts as prefill,
    one of only one-token decodes as decode. ``forward_seconds`` is the model forward (metadata build
    included), ``sample_seconds`` the on-device sampling and id copy, ``schedule_seconds`` the scheduler,
    ``output_seconds`` the output processor; ``compile_seconds`` is the first run of each compiled decode
    shape, and those steps are left out of the decode counters."""

    steps: int = 0
    preemptions: int = 0
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    decode_steps: int = 0
    compiled_steps: int = 0
    compile_seconds: float = 0.0
    schedule_seconds: float = 0.0
    forward_seconds: float = 0.0
    sample_seconds: float = 0.0
    output_seconds: float = 0.0
    time_to_first_token: dict[int, float] = field(default_factory=dict)  # request id -> seconds since add_request


class Engine:
    """Serve many generation requests on one model with continuous batching.

    ``max_seqs``: state slots (sequences in flight); ``max_batch_tokens``: token budget per step
    (prompts longer than it are prefilled in chunks). The cache is ``cache``, or one built for
    the model from ``num_blocks`` KV blocks or ``cache_bytes`` (default 256 MiB). ``compile=True`` runs
    decode-only steps through a ``torch.compile``-d forward over bucketed batch sizes (prefill stays
    eager; greedy tokens equal the eager engine's); ``compile_backend`` is torch.compile's backend
    (``"inductor"`` generates fused code; ``"aot_eager"`` only captures the graph, for debugging).
    """

    def __init__(self, model, *, cache: HybridCache | None = None, num_blocks: int | None = None,
                 cache_bytes: int | None = None, block_size: int = 16, max_seqs: int = 16,
                 max_batch_tokens: int = 512, tokenizer=None, compile: bool = False,
                 compile_backend: str = "inductor"):
        if max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
        self.model = model.eval()
        if cache is None:
            if num_blocks is None and cache_bytes is None:
                cache_bytes = DEFAULT_CACHE_BYTES
            cache = HybridCache.for_model(model, num_blocks=num_blocks, cache_bytes=cache_bytes,
                                          block_size=block_size, max_seqs=max_seqs)
        self.cache = cache
        self.cache_manager = CacheManager(cache)
        self.scheduler = Scheduler(self.cache_manager, max_seqs=cache.ssm.num_slots, max_batch_tokens=max_batch_tokens)
        self.runner = ModelRunner(self.model, cache, self.cache_manager, compile=compile,
                                  compile_backend=compile_backend)
        self.tokenizer = tokenizer
        self.requests: dict[int, Request] = {}
        self.stats = EngineStats()
        self._next_id = 0

    @property
    def max_seqs(self) -> int:
        return self.scheduler.max_seqs

    @property
    def max_batch_tokens(self) -> int:
        return self.scheduler.max_batch_tokens

    @property
    def running(self) -> list[Request]:
        return self.scheduler.running

    @property
    def waiting(self):
        return self.scheduler.waiting

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
        self._check_fits(len(prompt), params)
        seed = params.seed if params.seed is not None else _random_seed()
        rid = self._next_id
        self._next_id += 1
        req = Request(rid, prompt, params, self._stop_ids(params), seed,
                      StreamDecoder(self.tokenizer) if self.tokenizer is not None else None,
                      arrival_time=time.perf_counter())
        self.requests[rid] = req
        self.scheduler.add(req)
        return rid

    def abort(self, request_id: int) -> None:
        """Stop a request now and free its cache (a no-op for one that has finished)."""
        req = self.requests[request_id]
        if not req.finished:
            self._finish(req, "abort")

    def fork(self, request_id: int, params: SamplingParams | None = None) -> int:
        """A new request continuing from where ``request_id`` is now, sharing its cached prompt (KV blocks by
        reference count, the Mamba state copied): parallel samples of one prompt without prefilling it
        twice. The source must be decoding (its prompt computed, its next token sampled); the fork gets the
        same tokens so far and ``params`` (default: the source's, with a fresh seed unless given)."""
        src = self.requests[request_id]
        if src not in self.scheduler.running or src.num_pending != 1:
            raise ValueError(f"request {request_id} cannot be forked now: only a request that is decoding (prompt "
                             "computed, a token sampled) can be; step the engine until it has output")
        if len(self.scheduler.running) >= self.max_seqs:
            raise ValueError(f"cannot fork request {request_id}: all {self.max_seqs} sequence slots are running")
        own = params is not None and params.seed is not None
        params = params or src.params
        if len(src.output) >= params.max_new_tokens:
            raise ValueError(f"max_new_tokens={params.max_new_tokens} leaves the fork nothing to generate: the source "
                             f"has {len(src.output)} tokens already")
        self._check_fits(len(src.prompt), params)
        rid = self._next_id
        self._next_id += 1
        seed = params.seed if own else _random_seed()  # a fork of a sampled request samples its own path
        self.cache_manager.fork(request_id, rid, src.num_computed)
        req = Request(rid, list(src.prompt), params, self._stop_ids(params), seed,
                      StreamDecoder(self.tokenizer) if self.tokenizer is not None else None,
                      arrival_time=time.perf_counter(), output=list(src.output), num_computed=src.num_computed)
        if req.decoder is not None:
            req.decoder.push(list(src.output))
        self.requests[rid] = req
        self.scheduler.add_running(req)
        return rid

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def forget(self, request_id: int) -> Request:
        """Drop a finished request from ``requests`` (a long-running server calls this once it
        has read the result) and return it."""
        req = self.requests[request_id]
        if not req.finished:
            raise ValueError(f"request {request_id} has not finished; abort it first")
        return self.requests.pop(request_id)

    def _check_fits(self, prompt_len: int, params: SamplingParams) -> None:
        """A request the whole cache could never hold is refused up front, with the numbers."""
        need = prompt_len + params.max_new_tokens - 1  # the last sampled token is never cached
        kv = self.cache.kv
        held = kv.blocks_held_at_most(need, self.max_batch_tokens)
        if kv.enabled and held > kv.num_blocks:
            raise ValueError(
                f"request needs {need} cached tokens ({prompt_len} prompt + {params.max_new_tokens} new - 1), "
                f"{held} KV blocks at once, but the whole KV cache holds {kv.capacity_tokens} tokens "
                f"({kv.num_blocks} blocks of {kv.block_size}); shorten the prompt, lower max_new_tokens "
                "or give the engine a bigger cache")

    def _stop_ids(self, params: SamplingParams) -> frozenset[int]:
        stop_ids = set(params.stop_token_ids)
        if self.tokenizer is not None and not params.ignore_eos:
            stop_ids.update(eos_ids(self.tokenizer))
        return frozenset(stop_ids)

    def _finish(self, req: Request, reason: str) -> None:
        self.scheduler.release(req)
        req.finish_reason = reason

    # ---- one step --------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one packed forward over the scheduled sequences; return each one's new tokens
        (requests that only advanced a prompt chunk get none and are not listed)."""
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        self.stats.preemptions = self.scheduler.preemptions
        if not plan:
            if self.has_unfinished():  # add_request's size check makes this unreachable; never spin silently
                raise RuntimeError(f"the scheduler could not place any of {len(self.waiting)} waiting requests "
                                   f"({self.cache_manager.num_free_blocks} KV blocks, "
                                   f"{self.cache_manager.num_free_slots} state slots free)")
            return []
        t1 = time.perf_counter()
        compile_before = self.runner.compile_seconds
        chunks = [SeqChunk(r.request_id, r.pending(n), r.num_computed) for r, n in plan]
        logits, compiled = self.runner.execute(chunks)
        t2 = time.perf_counter()
        ready = self.scheduler.advance(plan)
        rows = [b for b, (req, _) in enumerate(plan) if req in ready]
        new_ids = []
        if rows:
            picked = logits[rows] if len(rows) < len(plan) else logits
            contexts = [r.tokens for r in ready] if any(r.params.repetition_penalty != 1.0 for r in ready) else None
            new_ids = self.runner.sample(picked, [r.params for r in ready], [r.seed for r in ready],
                                         [len(r.output) for r in ready], contexts)
        t3 = time.perf_counter()
        outputs = []
        for req, tok in zip(ready, new_ids, strict=True):
            out, reason = process_token(req, tok)
            if req.first_token_time is None:
                req.first_token_time = t3
                self.stats.time_to_first_token[req.request_id] = t3 - req.arrival_time
            if reason is not None:
                self._finish(req, reason)
            outputs.append(out)
        t4 = time.perf_counter()
        self._count(plan, compiled, self.runner.compile_seconds - compile_before, t0, t1, t2, t3, t4)
        return outputs

    def _count(self, plan, compiled, compile_dt, t0, t1, t2, t3, t4) -> None:
        s = self.stats
        s.steps += 1
        n_tokens = sum(n for _, n in plan)
        if compile_dt > 0:  # this step traced and compiled a new shape: its time is not decode speed
            s.compile_seconds += compile_dt
            return
        s.schedule_seconds += t1 - t0
        s.forward_seconds += t2 - t1
        s.sample_seconds += t3 - t2
        s.output_seconds += t4 - t3
        if any(n > 1 for _, n in plan):
            s.prefill_tokens += n_tokens
            s.prefill_seconds += t4 - t0
        else:
            s.decode_tokens += n_tokens
            s.decode_seconds += t4 - t0
            s.decode_steps += 1
            s.compiled_steps += compiled

    def run(self) -> dict[int, Request]:
        """Step until every queued request has finished; returns all requests by id."""
        while self.has_unfinished():
            self.step()
        return self.requests


def _random_seed() -> int:
    return int(torch.randint(0, 2**62, ()).item())
