"""The scheduler: which requests run this step and how many tokens each computes.

Each step it packs, within a token budget, one token for every running sequence that is decoding, the
next chunk of every running prefill, and then as many waiting requests as there are state slots, KV
blocks and budget for. A request computes ``tokens[num_computed:]`` each time it is scheduled, so a
prompt, a prompt chunk, a decode and a recompute after preemption are one code path. When a running
sequence cannot grow, the newest running sequence is preempted: its cache is freed at once and it goes
back to the front of the queue to recompute later from its tokens so far. All cache questions go to the
:class:`~hybrid.cache_manager.CacheManager`.

With a prefix cache, a request whose longer prefix a running sequence is computing right now waits for it
(that sequence saves a checkpoint where they part; requests behind the waiting one may go first), and a
request admitted from the queue starts at the longest prefix the cache holds for it
(``num_computed`` jumps there, a recompute after preemption included), and a prefill chunk ends exactly at
each position where the cache wants a Mamba state checkpoint, so the state saved after the step is the
state at that position.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from itertools import islice

from .cache_manager import CacheManager
from .request import Request


class Scheduler:
    def __init__(self, manager: CacheManager, *, max_seqs: int, max_batch_tokens: int,
                 draft_tokens: Callable[[Request], int] | None = None,
                 on_release: Callable[[Request], None] | None = None):
        if max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
        self.manager = manager
        self.max_seqs = max_seqs
        self.max_batch_tokens = max_batch_tokens
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
        self.waiting.append(req)

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
        self.waiting.appendleft(req)
        self.preemptions += 1

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
        one drafts (the engine asks the drafter and may shorten it)."""
        budget = self.max_batch_tokens
        plan: dict[Request, int] = {}
        if self.manager.prefix is not None:
            # the next requests in line tell running sequences where they will part from them (Marconi's
            # speculative insertion) before this step's chunks are cut, so a checkpoint lands exactly there
            for req in islice(self.waiting, self.max_seqs):
                self.manager.plan(req.tokens, len(req.prompt), req.max_prefix_hit)
        decoding = [r for r in self.running if r.num_pending == 1]
        prefilling = [r for r in self.running if r.num_pending > 1]
        for req in decoding + prefilling:
            if req not in self.running:  # preempted this step to make room for an older sequence
                continue
            n = self._chunk(req, budget)
            if n == 0:
                break
            if n > req.num_pending and not self.manager.can_grow(req.request_id, req.num_computed + n):
                n = req.num_pending  # no room for drafts: a plain decode, before anyone is preempted for it
            while not self.manager.can_grow(req.request_id, req.num_computed + n):
                victim = self.running[-1]  # the newest running sequence
                self.preempt(victim)
                budget += plan.pop(victim, 0)
                if victim is req:
                    break
            if req not in self.running:
                continue
            self.manager.grow(req.request_id, req.num_computed + n)
            plan[req] = n
            budget -= n
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
        return sorted(plan.items(), key=lambda rn: rn[1] != 1)

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
