"""The scheduler: which requests run this step and how many tokens each computes.

Each step packs, within one token budget (``max_batch_tokens``) shared by everything in the step, in this
order (vLLM's chunked-prefill policy):

1. one token for every running sequence that is decoding;
2. the rest of every running prefill that finishes within ``long_prefill_tokens`` (a short prompt, or the
   last chunk of a long one);
3. waiting requests, as many as there are state slots, KV blocks and budget for, each admitted with a
   chunk of its prompt;
4. a chunk of every running *long* prefill (more than ``long_prefill_tokens`` left) from what budget is left.

So a long prompt is prefilled a chunk per step, interleaved with everything else, and never ahead of a
request that arrived after it started: a newly arrived request is scheduled in the very next step as long as
a state slot and KV blocks are free (the long prompt takes its KV blocks a chunk at a time, not up front).
Within each group, requests go by ``priority`` (lower first, vLLM's field), then by arrival (FCFS); the
waiting queue is kept in that order.

A request computes ``tokens[num_computed:]`` each time it is scheduled, so a prompt, a prompt chunk, a
decode and a recompute after preemption are one code path. When a running sequence cannot grow, the running
sequence with the largest ``priority`` value, the newest of those, is preempted: its cache is freed at once
and it goes back to the front of its priority in the queue to recompute later from its tokens so far. All
cache questions go to the :class:`~hybrid.cache.manager.CacheManager`.

With a prefix cache, a request whose longer prefix a running sequence is computing right now waits for it
(that sequence saves a checkpoint where they part; requests behind the waiting one may go first), and a
request admitted from the queue starts at the longest prefix the cache holds for it
(``num_computed`` jumps there, a recompute after preemption included), and a prefill chunk ends exactly at
each position where the cache wants a Mamba state checkpoint, so the state saved after the step is the
state at that position.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from itertools import islice

from ..cache.manager import CacheManager
from .request import Request


class Scheduler:
    def __init__(self, manager: CacheManager, *, max_seqs: int, max_batch_tokens: int,
                 long_prefill_tokens: int | None = None,
                 draft_tokens: Callable[[Request], int] | None = None,
                 on_release: Callable[[Request], None] | None = None):
        if max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
        if long_prefill_tokens is not None and long_prefill_tokens < 1:
            raise ValueError(f"long_prefill_tokens must be >= 1 (None: max_batch_tokens), got {long_prefill_tokens}")
        self.manager = manager
        self.max_seqs = max_seqs
        self.max_batch_tokens = max_batch_tokens
        # a running prefill with more than this many tokens left is "long": it yields the step's budget to
        # waiting requests and takes what they leave
        self.long_prefill_tokens = max_batch_tokens if long_prefill_tokens is None else long_prefill_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last one is preempted first
        self.preemptions = 0
        self.prefix_hit_tokens = 0  # prompt tokens served by the prefix cache at first admissions
        self.recompute_hit_tokens = 0  # tokens served by it when preempted requests came back
        # speculative decoding: how many draft tokens a decoding request may have checked this step (its
        # chunk is then its last token plus up to that many drafts; 0: a plain decode)
        self.draft_tokens = draft_tokens
        self.on_release = on_release  # told of every request whose cache is freed (a drafter frees its own)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: Request) -> None:
        """Queue ``req`` behind every waiting request of its priority or a more urgent one (lower value)."""
        at = len(self.waiting)
        while at and self.waiting[at - 1].priority > req.priority:
            at -= 1
        self.waiting.insert(at, req)

    def add_running(self, req: Request) -> None:
        """A request that already holds its cache (a fork) joins the running set."""
        if len(self.running) >= self.max_seqs:
            raise ValueError(f"all {self.max_seqs} sequence slots are running")
        self.running.append(req)

    def release(self, req: Request) -> None:
        """Take ``req`` out of the queues, freeing whatever cache it holds (a prefix cache keeps what it
        computed)."""
        if req in self.running:
            self.running.remove(req)
            self.manager.free(req.request_id, req.tokens, req.num_computed)
            if self.on_release is not None:
                self.on_release(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def preempt(self, req: Request) -> None:
        """Free everything ``req`` holds; it recomputes its tokens when it is scheduled again."""
        self.release(req)
        req.num_computed = 0
        at = 0  # ahead of every waiting request of its priority: it was admitted before them
        while at < len(self.waiting) and self.waiting[at].priority < req.priority:
            at += 1
        self.waiting.insert(at, req)
        self.preemptions += 1

    def _victim(self) -> Request:
        """The running sequence to preempt: the largest priority value, the newest admitted among those (the
        newest of all when priorities are equal)."""
        worst = max(r.priority for r in self.running)
        return next(r for r in reversed(self.running) if r.priority == worst)

    def _admit(self, req: Request, budget: int) -> int:
        """Admit ``req`` with as many tokens as the budget allows (after its prefix-cache hit); returns
        the number scheduled, 0 when it does not fit."""
        if len(self.running) >= self.max_seqs or self.manager.num_free_slots == 0:
            return 0
        adm = self.manager.plan(req.tokens, len(req.prompt), req.max_prefix_hit)
        if adm.defer:  # a running sequence is computing a longer prefix of it: start from its checkpoint
            return -1
        n = min(req.num_tokens - adm.start, budget)
        stop = next((p for p in adm.wanted if p > adm.start), None)
        if stop is not None:
            n = min(n, stop - adm.start)
        if not self.manager.try_admit(req.request_id, adm.start + n, adm):
            return 0
        req.num_computed = adm.start
        if req.prefix_hit is None:
            self.prefix_hit_tokens += min(adm.start, len(req.prompt))
        else:
            self.recompute_hit_tokens += adm.start
        req.on_admit(adm.start)
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.perf_counter()
        self.running.append(req)
        return n

    def _chunk(self, req: Request, budget: int) -> int:
        want = req.num_pending
        if want == 1 and self.draft_tokens is not None:
            want += self.draft_tokens(req)
        n = min(want, budget)
        stop = self.manager.next_checkpoint(req.request_id, req.num_computed)
        return n if stop is None else min(n, stop - req.num_computed)

    def schedule(self) -> list[tuple[Request, int]]:
        """This step's (request, new tokens) pairs, one-token decodes first (the packed forward's decode group).
        A decoding request given more than one token is to be speculated: its last token and that many minus
        one drafts (the engine asks the drafter and may shorten it). The tokens add up to at most
        ``max_batch_tokens``; see the module docstring for the order."""
        budget = self.max_batch_tokens
        plan: dict[Request, int] = {}
        if self.manager.prefix is not None:
            # the next requests in line tell running sequences where they will part from them (Marconi's
            # speculative insertion) before this step's chunks are cut, so a checkpoint lands exactly there
            for req in islice(self.waiting, self.max_seqs):
                self.manager.plan(req.tokens, len(req.prompt), req.max_prefix_hit)
        by_priority = sorted(self.running, key=lambda r: r.priority)  # stable: admission order within one
        decoding = [r for r in by_priority if r.num_pending == 1]
        prefilling = [r for r in by_priority if r.num_pending > 1]
        short = [r for r in prefilling if r.num_pending <= self.long_prefill_tokens]
        long = [r for r in prefilling if r.num_pending > self.long_prefill_tokens]
        budget = self._schedule_running(decoding + short, plan, budget)
        budget = self._admit_waiting(plan, budget)
        self._schedule_running(long, plan, budget, yielding=True)
        return sorted(plan.items(), key=lambda rn: rn[1] != 1)

    def _schedule_running(self, reqs: list[Request], plan: dict[Request, int], budget: int, *,
                          yielding: bool = False) -> int:
        """Give each of ``reqs`` (running) its next chunk from ``budget``, preempting for room; returns the
        budget left. ``yielding`` (long prefills): a chunk shrinks to the free blocks rather than preempt a
        request this step already scheduled (one just admitted would otherwise be thrown out for it); it
        preempts only when nothing else runs this step, so the step is never empty."""
        for req in reqs:
            if not budget:
                break
            if req not in self.running:  # preempted this step to make room for an older sequence
                continue
            n = self._chunk(req, budget)
            if n == 0:
                continue
            if yielding and plan:
                while n and not self.manager.can_grow(req.request_id, req.num_computed + n):
                    n //= 2
                if n == 0:
                    continue
            if n > req.num_pending and not self.manager.can_grow(req.request_id, req.num_computed + n):
                n = req.num_pending  # no room for drafts: a plain decode, before anyone is preempted for it
            while not self.manager.can_grow(req.request_id, req.num_computed + n):
                victim = self._victim()
                self.preempt(victim)
                budget += plan.pop(victim, 0)
                if victim is req:
                    break
            if req not in self.running:
                continue
            self.manager.grow(req.request_id, req.num_computed + n)
            plan[req] = n
            budget -= n
        return budget

    def _admit_waiting(self, plan: dict[Request, int], budget: int) -> int:
        """Admit waiting requests in queue order while the budget, slots and blocks last; returns the budget
        left."""
        for req in list(islice(self.waiting, 4 * self.max_seqs)):  # deferred ones are skipped, within reason
            if not budget:
                break
            n = self._admit(req, budget)
            if n < 0:  # deferred for a prefix a running sequence is about to provide; later ones may go
                continue
            if not n:
                break
            self.waiting.remove(req)
            plan[req] = n
            budget -= n
        return budget

    def advance(self, plan: list[tuple[Request, int]]) -> list[Request]:
        """After the forward: count the computed tokens, hand them to the prefix cache, let a sliding
        window's old blocks go, and return the requests that now need a sampled token (those whose pending
        tokens are all computed)."""
        ready = []
        for req, n in plan:
            req.num_computed += n
            self.manager.computed(req.request_id, req.tokens, req.num_computed)
            self.manager.trim(req.request_id, req.num_computed)
            if req.num_pending == 0:
                ready.append(req)
        return ready
