"""``Engine``: continuous batching over paged KV blocks and Mamba state slots — the request loop, and a thin
coordinator over the rooms that own everything else (after vLLM's v1 engine; the loop itself is short, as in
gpt-fast's ``generate.py``):

- :class:`~hybrid.engine.input.InputProcessor`: a prompt and its parameters become a request (checked,
  stop ids gathered, seed drawn);
- :class:`~hybrid.engine.scheduler.Scheduler`: who runs this step and how many tokens (token budget, chunked
  prefill, newest-first preemption with recompute);
- :mod:`~hybrid.cache.build` builds and sizes the caches; :class:`~hybrid.cache.manager.CacheManager` is the
  only code that hands out and takes back blocks and state slots;
- :class:`~hybrid.engine.runner.ModelRunner`: the step's metadata, built once; the eager or compiled
  forward; sampling on the device; which decode program and threads a step runs with;
- :mod:`~hybrid.engine.output`: stop ids and strings, length limit, detokenising;
- :mod:`~hybrid.scoring`: prompt log-probabilities; :mod:`~hybrid.engine.stats`: the counters and step times;
- :class:`~hybrid.speculative.speculator.Speculator`: drafting before the forward, verify and rollback after.

``prefix_caching=True`` adds a :class:`~hybrid.cache.prefix.PrefixCache` to the cache manager: prompts that
start like earlier ones share their KV blocks and resume from saved Mamba state checkpoints, and prefill
only the rest; outputs equal those with the cache off. :meth:`Engine.score` returns the log-probabilities
of tokens given their prefix (lm-eval's loglikelihood), through the same cache.

``speculative=SpeculativeConfig(...)`` drafts tokens for decoding requests (a draft model or n-gram lookup,
:mod:`hybrid.speculative`) and checks them in the same packed forward as everything else: a decoding request
runs as a short chunk of its last token and its drafts, the Mamba layers keep their state at each position,
and after the rejection rule the cache manager writes back the state at the last accepted token and gives
back the rejected tokens' KV blocks. Greedy output is identical to the engine without it.
"""

from __future__ import annotations

import time

import torch

from ..cache import HybridCache
from ..cache.build import engine_cache, prefix_cache_for
from ..cache.manager import CacheManager
from ..sampling import SamplingParams
from ..scoring import ScoreResult, record_logprobs, scored_positions
from ..speculative.speculator import Speculator
from .config import EngineConfig
from .input import InputProcessor
from .output import process_token
from .packed_batch import SeqChunk
from .request import Request, RequestOutput
from .runner import ModelRunner
from .scheduler import Scheduler
from .stats import EngineStats


class Engine:
    """Serve many generation requests on one model with continuous batching.

    Its settings are one :class:`~hybrid.engine.config.EngineConfig` (``Engine(model, config=EngineConfig(...))``);
    keyword settings (``Engine(model, max_seqs=4)``) build one, or change a given one's fields. ``cache``: a
    :class:`HybridCache` to use instead of building one; ``tokenizer``: where stop strings and text come from
    (default: the model's own). The settings:

    ``max_seqs``: state slots (sequences in flight); ``max_batch_tokens``: token budget per step
    (prompts longer than it are prefilled in chunks). The cache is ``cache``, or one built for
    the model from ``num_blocks`` KV blocks or ``cache_bytes`` (default 256 MiB). ``compile=True`` runs
    decode-only steps through a ``torch.compile``-d forward over bucketed batch sizes (prefill stays
    eager; greedy tokens equal the eager engine's); ``compile_backend`` is torch.compile's backend
    (``"inductor"`` generates fused code; ``"aot_eager"`` only captures the graph, for debugging).

    ``prefix_caching=True`` keeps computed prefixes (see :mod:`hybrid.cache.prefix`): KV blocks live in the
    KV pool beside the live sequences' and give way to them; Mamba state checkpoints take at most
    ``prefix_state_bytes`` (default 256 MiB) of their own. ``prefix_checkpoint_interval`` also saves a
    checkpoint every that many tokens of a prefill (None: only at branch points, prompt ends and where a
    sequence stops). ``prefix_flop_weight`` weighs FLOPs saved per byte against recency in eviction
    (0: least recently used first).

    ``speculative``: a :class:`~hybrid.speculative.SpeculativeConfig` (draft model or n-gram drafting; see
    :mod:`hybrid.speculative`). Requests with a repetition penalty, scoring requests and the last token of a
    request are never speculated (plain decodes).

    ``kv_dtype`` (``"bfloat16"``, ``"float16"``, ``"float32"``, ``"int8"``, ``"fp8"``) and ``state_dtype``
    (``"float32"``, ``"bfloat16"``, ``"int8"``) compress the cache the engine builds (None: K/V in the
    model's dtype, SSM state fp32; see :func:`hybrid.cache.cache_dtypes`); the state set aside for
    ``max_seqs`` sequences is paid first from the one byte budget, the KV pool gets the rest.
    ``stochastic_state`` rounds int8 / bf16 state writes stochastically. ``kv_pruning``: a
    :class:`hybrid.cache.pruning.StreamingLLM` keeps only attention sinks + a recent window per sequence; a
    :class:`hybrid.cache.pruning.SnapKV` compresses each prompt longer than its budget once it is prefilled
    (per KV head, the positions the prompt's last window attends to most); ``cache.report()`` counts the
    blocks either gave back.

    ``long_prefill_tokens``: a running prefill with more than this many tokens left (default: ``max_batch_tokens``)
    is *long*: each step it takes only the budget that decodes, shorter prefills and newly arrived requests leave
    (see :mod:`hybrid.engine.scheduler`), so a long prompt never holds up a request that arrives while it is prefilled.
    ``add_request(..., priority=p)``: lower values are scheduled first (vLLM's ``priority``), ties by arrival.

    ``max_model_len``: the most tokens (prompt + ``max_new_tokens``) one request may have; default: what the KV
    cache holds for one sequence, plus the last sampled token, which is never cached (unbounded when the cache sets
    no limit: no attention layer, a sliding window, SnapKV). ``max_prompt_tokens``: the longest prompt accepted
    (default ``max_model_len - 1``). A request over either is refused by :meth:`add_request` with a ValueError
    naming the limit; :meth:`check_length` asks the same without queueing anything.

    ``multi_step``: a decode-only step may run up to that many greedy decode steps in one native call on a CPU
    (vLLM's multi-step scheduling): the Python around a step (scheduling, inputs, sampling, outputs: 0.3-0.5 ms,
    most of it cache misses after the step's weights went through) is paid once for them, and each request's
    output of the call carries its new tokens together. Only when nothing is waiting, every running request is
    decoding greedily (no repetition penalty, no scoring), no speculation, no prefix cache, and the native program
    covers the model; the steps stop at the first request's ``max_new_tokens``. A request that stops earlier (a
    stop id or string) keeps only its tokens up to the stop; the later steps' work for it is discarded with its
    cache. Tokens are the same as with 1 (the default: one step per :meth:`step`).
    """

    def decode_path(self) -> str:
        """Which backend a one-row decode step runs on here, and every backend's verdict (see
        :meth:`ModelRunner.decode_report`)."""
        return self.runner.decode_path()

    def __repr__(self) -> str:
        rows = self.runner.buckets[-1]
        full = f", decode at {rows} rows: {self.runner.decode_report(rows)}" if rows > 1 else ""
        return (f"Engine({type(self.model).__name__} {self.model.config.pattern!r}, "
                f"max_seqs={rows}, decode at 1 row: {self.decode_path()}{full}, "
                f"greedy steps per native call: up to {self.multi_step})")

    def __init__(self, model, config: EngineConfig | None = None, *, cache: HybridCache | None = None,
                 tokenizer=None, **settings):
        # the one place keyword settings become a config: Engine(model, max_seqs=4) stays the short spelling,
        # Engine(model, config, max_seqs=4) changes one field of a shared config
        if settings:
            config = EngineConfig(**settings) if config is None else config.replace(**settings)
        elif config is None:
            config = EngineConfig()
        elif not isinstance(config, EngineConfig):
            raise ValueError(f"Engine's config must be a hybrid.EngineConfig, got {type(config).__name__}; give "
                             "the settings as EngineConfig(...) or as keyword arguments")
        self.config = c = config
        self.multi_step = c.multi_step
        self.model = model.eval()
        self.cache = cache = engine_cache(
            model, cache, num_blocks=c.num_blocks, cache_bytes=c.cache_bytes, block_size=c.block_size,
            max_seqs=c.max_seqs, kv_dtype=c.kv_dtype, state_dtype=c.state_dtype, stochastic_state=c.stochastic_state,
            kv_pruning=c.kv_pruning)
        self.cache_manager = CacheManager(cache, prefix_cache_for(
            cache, self.model, enabled=c.prefix_caching, state_bytes=c.prefix_state_bytes,
            checkpoint_interval=c.prefix_checkpoint_interval, flop_weight=c.prefix_flop_weight))
        self.speculative = speculative = c.speculative
        self.speculator = None if speculative is None else Speculator(
            speculative, self.model, cache, block_size=c.block_size, prefix_caching=c.prefix_caching,
            prefix_state_bytes=c.prefix_state_bytes, checkpoint_interval=c.prefix_checkpoint_interval,
            flop_weight=c.prefix_flop_weight)
        self.drafter = None if speculative is None else self.speculator.drafter
        self.set_length_limits(c.max_model_len, c.max_prompt_tokens)
        self.scheduler = Scheduler(self.cache_manager, max_seqs=cache.ssm.num_slots,
                                   max_batch_tokens=c.max_batch_tokens, long_prefill_tokens=c.long_prefill_tokens,
                                   draft_tokens=None if speculative is None else self.speculator.allowance,
                                   on_release=None if speculative is None else self.speculator.release)
        self.runner = ModelRunner(self.model, cache, self.cache_manager, compile=c.compile,
                                  compile_backend=c.compile_backend)
        # the model's own tokenizer (hybrid.from_pretrained attaches the checkpoint's) unless one is given: its
        # end-of-turn ids are where a request stops
        tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
        self.inputs = InputProcessor(model.config.vocab_size, tokenizer, self._check_fits)
        self.requests: dict[int, Request] = {}
        self.stats = EngineStats()
        self._next_id = 0

    @property
    def tokenizer(self):
        """Where stop strings, EOS ids and the streamed text come from (None: token ids only)."""
        return self.inputs.tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer) -> None:
        self.inputs.tokenizer = tokenizer

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
    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None, *,
                    prompt_logprobs_from: int | None = None, priority: int = 0) -> int:
        """Queue a prompt; returns its request id. Raises ValueError for an empty prompt, ids
        outside the vocabulary, stop strings without a tokenizer, a prompt over ``max_prompt_tokens`` or a
        request over ``max_model_len``, or a request the cache can never hold. With ``prompt_logprobs_from=k``
        the request also records, in ``prompt_logprobs`` and ``prompt_greedy``, log P(prompt[i] | prompt[:i])
        for every i >= k (1 <= k < len(prompt)). ``priority``: lower values are scheduled first (ties: FCFS)."""
        return self._add(prompt_ids, params, prompt_logprobs_from, score_only=False, priority=priority)

    def set_length_limits(self, max_model_len: int | None = None, max_prompt_tokens: int | None = None) -> None:
        """Set ``max_model_len`` and ``max_prompt_tokens`` (None: their defaults; see the class docstring), e.g. to
        a checkpoint's context length; ValueError for limits that cannot hold. Requests already queued keep
        running."""
        self.max_model_len, self.max_prompt_tokens = length_limits(self.cache, max_model_len, max_prompt_tokens)
        # the config records the limits asked for (None: the defaults), so it rebuilds an engine like this one
        self.config = self.config.replace(max_model_len=max_model_len, max_prompt_tokens=max_prompt_tokens)

    def check_length(self, prompt_len: int, max_new_tokens: int, *, score_only: bool = False) -> None:
        """ValueError, naming the limit, for a prompt over ``max_prompt_tokens`` or prompt + ``max_new_tokens``
        over ``max_model_len`` (a scoring request generates nothing: its tokens alone count)."""
        if not score_only and self.max_prompt_tokens is not None and prompt_len > self.max_prompt_tokens:
            raise ValueError(f"the prompt has {prompt_len} tokens, more than max_prompt_tokens={self.max_prompt_tokens}"
                             "; shorten the prompt")
        total = prompt_len + (0 if score_only else max_new_tokens)
        if self.max_model_len is not None and total > self.max_model_len:
            raise ValueError(f"max_model_len={self.max_model_len} tokens, but the request has {total} "
                             f"({prompt_len} prompt + {0 if score_only else max_new_tokens} max_new_tokens); "
                             "shorten the prompt or lower max_new_tokens")

    def score(self, requests: list[tuple[list[int], int]], *, progress: bool = False) -> list[ScoreResult]:
        """Log-probabilities of ``tokens[start:]`` given what precedes them, for each ``(tokens, start)``
        (1 <= start <= len(tokens)), and the log-probabilities of every possible next token after all of
        ``tokens`` (``next_logprobs``): lm-eval's loglikelihood of a continuation after its context
        (continuations that differ only in their last token share one request). The requests run through
        the scheduler and prefix cache like prompts, sample nothing and finish with reason ``"scored"``.
        Runs until they are done (other queued requests advance too)."""
        from tqdm import tqdm

        ids = []
        for tokens, start in requests:
            tokens = [int(t) for t in tokens]
            if not 1 <= start <= len(tokens):
                raise ValueError(f"score needs 1 <= start <= len(tokens) (at least one token before the scored "
                                 f"ones); got start={start} for {len(tokens)} tokens")
            ids.append(self._add(tokens, None, start, score_only=True))
        with tqdm(total=len(ids), desc="score", unit="req", disable=not progress) as bar:
            while any(not self.requests[i].finished for i in ids):
                done = sum(self.requests[i].finished for i in ids)
                self.step()
                bar.update(sum(self.requests[i].finished for i in ids) - done)
        out = []
        for i in ids:
            req = self.forget(i)
            out.append(ScoreResult(req.prompt_logprobs, req.prompt_greedy, req.next_logprobs))
        return out

    def _add(self, prompt_ids, params, logprobs_from, *, score_only: bool, priority: int = 0) -> int:
        req = self.inputs.request(self._next_id, prompt_ids, params, logprobs_from, score_only=score_only,
                                  priority=priority)
        # after the input processor's checks: a request the whole cache cannot hold gets its message, with the numbers
        self.check_length(len(req.prompt), req.params.max_new_tokens, score_only=score_only)
        self._next_id += 1
        self.stats.prompt_tokens += len(req.prompt)
        self.requests[req.request_id] = req
        self.scheduler.add(req)
        return req.request_id

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
        params, seed = self.inputs.fork_params(src, params)
        rid = self._next_id
        self._next_id += 1
        self.cache_manager.fork(request_id, rid, src.num_computed)
        req = self.requests[rid] = self.inputs.fork(rid, src, params, seed)
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

    def _check_fits(self, prompt_len: int, new_cached: int) -> None:
        self.cache_manager.check_fits(prompt_len, new_cached, self.max_batch_tokens)

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
        with self.runner.step_threads(decode_only=self.drafter is None and all(n == 1 for _, n in plan)):
            steps = self._greedy_steps(plan)
            outputs = self._run_steps(plan, steps, t0, t1) if steps else None
            return self._run(plan, t0, t1) if outputs is None else outputs

    def _greedy_steps(self, plan) -> int:
        """How many greedy decode steps this step's plan runs in one native call, their argmax in C (see
        ``multi_step``), with every row's KV blocks grown for them; 0 when the plan takes the general path (a prompt
        chunk, sampling, speculation, compilation). One step when nothing allows more: it still spares the step its
        logits' trip through Python. Only asked of the native program backend (the model runner's choice), so
        that no row's blocks grow ahead of its tokens for nothing."""
        if self.speculator is not None:
            return 0
        k = self.multi_step
        for req, n in plan:
            p = req.params
            if n != 1 or req.score_only or not req.output or not p.greedy or p.repetition_penalty != 1.0:
                return 0
            k = min(k, p.max_new_tokens - len(req.output))
        if not self.runner.can_run_steps():  # (the decode backend chosen here: the whole-step native program)
            return 0
        if k < 2 or self.scheduler.waiting or self.cache_manager.prefix is not None:
            return 1  # (the scheduler grew every row's blocks for one token)
        m = self.cache_manager
        if not all(m.can_grow(req.request_id, req.num_computed + k) for req, _ in plan):
            return 1
        for req, _ in plan:
            m.grow(req.request_id, req.num_computed + k)
        return k

    def _run_steps(self, plan, steps: int, t0: float, t1: float) -> list[RequestOutput] | None:
        """``steps`` greedy decode steps of ``plan`` (all decoding) in one native call; None when the runner cannot
        (the caller runs one step)."""
        chunks = [SeqChunk(r.request_id, r.pending(1), r.num_computed) for r, _ in plan]
        ids = self.runner.run_steps(chunks, steps)
        if ids is None:
            return None
        t2 = time.perf_counter()
        outputs, emitted = [], 0
        for b, (req, _) in enumerate(plan):
            new, text, reason = [], "", None
            for s in range(steps):  # the tokens one step at a time: a stop ends the request there
                self.scheduler.advance([(req, 1)])
                out, reason = process_token(req, ids[s][b])
                new += out.new_token_ids
                text += out.text
                if reason is not None:
                    self._finish(req, reason)
                    break
            emitted += len(new)
            outputs.append(RequestOutput(req.request_id, new, text, reason is not None, reason))
        t3 = time.perf_counter()
        self.stats.count_step(plan, False, 0.0, t0, t1, t2, t2, t3, emitted=emitted, steps=steps)
        return outputs

    def _run(self, plan, t0: float, t1: float) -> list[RequestOutput]:
        compile_before = self.runner.compile_seconds
        self.stats.prefix_hit_tokens = self.scheduler.prefix_hit_tokens
        self.stats.recompute_hit_tokens = self.scheduler.recompute_hit_tokens
        self.stats.count_prompt_positions(plan)
        drafts = {}
        if self.speculator is not None:
            plan, drafts = self.speculator.draft(plan, self.stats)
        chunks = [SeqChunk(r.request_id, r.pending(1) + drafts[r][0] if r in drafts else r.pending(n), r.num_computed)
                  for r, n in plan]
        scoring = [scored_positions(r, n) for r, n in plan]
        t_fwd = time.perf_counter()
        if any(len(q) for q in scoring):
            out, compiled = self.runner.execute(chunks, all_logits=True, num_verify=len(drafts))
            counts = [n for _, n in plan]  # every token's row came back
            record_logprobs(plan, scoring, out)
        else:
            out, compiled = self.runner.execute(chunks, num_verify=len(drafts))
            counts = [n if r in drafts else 1 for r, n in plan]
        if not drafts and len(counts) == out.shape[0]:  # one row per sequence (a decode step): the logits
            ends, logits = None, out
        else:
            ends = torch.tensor(counts, device=out.device).cumsum(0) - 1
            logits = out[ends]
        t2 = time.perf_counter()
        if drafts:
            self.stats.verify_forward_seconds += t2 - t_fwd
        ready = self.scheduler.advance([(r, n) for r, n in plan if r not in drafts])
        for b, (req, _) in enumerate(plan):
            if req in ready and req.score_only:
                req.next_logprobs = torch.log_softmax(logits[b].float(), dim=-1)
                self._finish(req, "scored")
        ready = [r for r in ready if not r.score_only]
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
            out_, reason = process_token(req, tok)
            if req.first_token_time is None:
                req.first_token_time = t3
                self.stats.time_to_first_token[req.request_id] = t3 - req.arrival_time
            if reason is not None:
                self._finish(req, reason)
            outputs.append(out_)
        emitted = len(new_ids)
        if drafts:
            ends_list = ends.tolist()
            starts = [e - c + 1 for e, c in zip(ends_list, counts, strict=True)]
            verified = [(req, starts[b]) for b, (req, _) in enumerate(plan) if req in drafts]
            verify_outputs = self.speculator.verify(verified, drafts, out, self.runner.verify_states,
                                                    self.cache_manager, self.scheduler, self.stats, self._finish)
            outputs.extend(verify_outputs)
            emitted += sum(len(o.new_token_ids) for o in verify_outputs)
        t4 = time.perf_counter()
        self.stats.count_step(plan, compiled, self.runner.compile_seconds - compile_before, t0, t1, t2, t3, t4, drafts,
                              emitted)
        return outputs

    def run(self) -> dict[int, Request]:
        """Step until every queued request has finished; returns all requests by id."""
        while self.has_unfinished():
            self.step()
        return self.requests


def length_limits(cache: HybridCache, max_model_len: int | None,
                  max_prompt_tokens: int | None) -> tuple[int | None, int | None]:
    """``(max_model_len, max_prompt_tokens)`` with their defaults filled in (see :class:`Engine`); ValueError for
    limits that cannot hold (a length over what the cache holds for one sequence, a prompt limit that leaves no
    token to generate)."""
    kv = cache.kv
    # the cache bounds one sequence only when all of its tokens stay in the KV pool; the last sampled token never
    # enters it, so a sequence may be one token longer than the pool (the bound check_fits applies)
    held = int(kv.capacity_tokens) + 1 if kv.enabled and kv.window is None and kv.snapkv is None else None
    if max_model_len is None:
        max_model_len = held
    elif max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2 (a prompt token and a generated one), got {max_model_len}")
    elif held is not None and max_model_len > held:
        raise ValueError(f"max_model_len={max_model_len} is more than the KV cache holds for one sequence ({held} "
                         "tokens); give the engine a bigger cache or a smaller max_model_len")
    if max_prompt_tokens is None:
        return max_model_len, None if max_model_len is None else max_model_len - 1
    if max_prompt_tokens < 1:
        raise ValueError(f"max_prompt_tokens must be >= 1, got {max_prompt_tokens}")
    if max_model_len is not None and max_prompt_tokens >= max_model_len:
        raise ValueError(f"max_prompt_tokens={max_prompt_tokens} leaves no room to generate within "
                         f"max_model_len={max_model_len}; give max_prompt_tokens <= {max_model_len - 1}")
    return max_model_len, max_prompt_tokens
