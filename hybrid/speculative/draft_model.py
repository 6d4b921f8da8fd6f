"""A draft ``HybridLM`` that proposes tokens for the target, with its own cache rolled back like the target's.

The draft keeps its own :class:`~hybrid.cache.HybridCache` (KV blocks and state slots) and
:class:`~hybrid.cache.manager.CacheManager` (with its own prefix cache when the engine has one, so draft
prompts share prefixes too). For each speculating request it remembers how many of the request's tokens it
has cached. Drafting k tokens is one packed forward that catches up on the tokens it has not seen (the
whole prompt the first time, then the tokens the last verify accepted) and k - 1 one-token steps; the draft's
Mamba states after each of those forwards are kept (:meth:`CacheManager.save_states`), and once the target
has accepted j drafts the draft's slot is rolled back to the state after the j-th (KV past it given back).
"""

from __future__ import annotations

import time

import torch

from ..cache.manager import CacheManager
from ..decode.native_program import forward_packed
from ..engine.packed_batch import SeqChunk, build_batch
from .verifier import DRAFT_SALT, draw, stream_uniforms, token_probs


class DraftModelDrafter:
    deterministic = False

    def __init__(self, model, manager: CacheManager):
        self.model, self.manager = model.eval(), manager
        self.cache = manager.cache
        self.computed: dict[int, int] = {}  # request id -> tokens of the request the draft has cached
        self._saved: list = []  # the states after each drafting forward of this step, but the last
        self._ids: list[int] = []
        self.forward_seconds = 0.0  # draft forwards (and their sampling)
        self.rollback_seconds = 0.0  # draft state rollback and KV give-back
        self.prefix_hit_tokens = 0  # tokens the draft's prefix cache served at admissions

    # ---- bookkeeping -----------------------------------------------------------------------------
    def release(self, request_id: int, tokens: list[int] | None = None) -> None:
        """The target request finished or was preempted: free what the draft holds for it."""
        if request_id in self.computed:
            n = self.computed.pop(request_id)
            if request_id in self._ids:  # drafted this step, not rolled back: its slot is past ``n``, keep none
                tokens = None
            self.manager.free(request_id, tokens, n if tokens is not None else 0)

    def _hold(self, req, k: int) -> bool:
        """Make sure the draft holds ``req`` with room for its tokens plus k - 1 drafts; False if it cannot."""
        rid, need = req.request_id, req.num_tokens + k - 1
        m = self.manager
        if rid not in self.computed:
            adm = m.plan(req.tokens, len(req.prompt), req.num_tokens - 1)
            if adm.defer:
                adm = type(adm)(0)
            if not m.try_admit(rid, max(need, adm.start), adm):
                return False
            self.computed[rid] = adm.start
            self.prefix_hit_tokens += adm.start
            return True
        if not m.can_grow(rid, need):
            return False
        m.grow(rid, need)
        return True

    def _catch_up_end(self, req) -> int:
        """Where this step's catch-up chunk of ``req`` ends: its last token, or an earlier position where the
        draft's prefix cache wants a Mamba state checkpoint."""
        stop = self.manager.next_checkpoint(req.request_id, self.computed[req.request_id])
        return req.num_tokens if stop is None or stop >= req.num_tokens else stop

    # ---- drafting --------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, reqs, ks: list[int]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Up to ``ks[i]`` draft tokens for each request, and the distributions [k_i, V] they were drawn
        from (a request the draft cache cannot hold gets none)."""
        t0 = time.perf_counter()
        drafts: list[list[int]] = [[] for _ in reqs]
        probs: list[list[torch.Tensor]] = [[] for _ in reqs]
        live = [i for i, (r, k) in enumerate(zip(reqs, ks, strict=True)) if self._hold(r, k)]
        self._saved = []
        kmax = max((ks[i] for i in live), default=0)
        for j in range(kmax):
            active = [i for i in live if ks[i] > j]
            if j == 0:
                # catch up on the tokens not seen yet; a chunk stops at a position where the draft's prefix
                # cache wants a Mamba checkpoint (saved right after), and that request drafts next step
                ends = {i: self._catch_up_end(reqs[i]) for i in active}
                chunks = [SeqChunk(reqs[i].request_id, reqs[i].tokens[self.computed[reqs[i].request_id]:ends[i]],
                                   self.computed[reqs[i].request_id]) for i in active]
            else:
                chunks = [SeqChunk(reqs[i].request_id, [drafts[i][-1]], reqs[i].num_tokens + j - 1) for i in active]
            order = sorted(range(len(chunks)), key=lambda c: len(chunks[c].tokens) != 1)  # decodes first
            logits = forward_packed(self.model, build_batch(self.manager, [chunks[c] for c in order]), self.cache)
            logits = logits[torch.tensor([order.index(c) for c in range(len(chunks))], device=logits.device)]
            if j == 0:
                for i in active:
                    if ends[i] < reqs[i].num_tokens:
                        rid = reqs[i].request_id
                        self.computed[rid] = ends[i]
                        self.manager.computed(rid, reqs[i].tokens, ends[i])
                        self.manager.trim(rid, ends[i])
                keep = [row for row, i in enumerate(active) if ends[i] == reqs[i].num_tokens]
                live = active = [active[row] for row in keep]
                logits = logits[keep]
                self._ids = [reqs[i].request_id for i in live]
                if not live:
                    break
            q = token_probs(logits, [reqs[i].params for i in active])
            u = stream_uniforms([reqs[i].seed for i in active],
                                [[len(reqs[i].output) + j] for i in active], DRAFT_SALT, q.device)[:, 0]
            for row, (i, tok) in enumerate(zip(active, draw(q, u).tolist(), strict=True)):
                drafts[i].append(tok)
                probs[i].append(q[row])
            if j < kmax - 1:
                self._saved.append(self.manager.save_states(self._ids))
        self.forward_seconds += time.perf_counter() - t0
        return drafts, [torch.stack(p) if p else None for p in probs]

    def rollback(self, reqs, starts: list[int], drafted: list[int], kept: list[int]) -> None:
        """After the verify: request ``reqs[i]``, which had ``starts[i]`` tokens before this step, kept
        ``kept[i]`` of its ``drafted[i]`` drafts (now in its tokens). Roll the draft back to the state after
        the last kept draft it computed (it ran drafts 1..k-1; the k-th is caught up next step), give back KV
        past it, and let the prefix cache see the accepted tokens."""
        t0 = time.perf_counter()
        back_ids, back_which = [], []
        for req, start, k, j in zip(reqs, starts, drafted, kept, strict=True):
            rid = req.request_id
            if rid not in self.computed or k == 0:
                continue
            which = min(j, k - 1)  # index of the saved state: after the chunk (0) or after draft `which`
            if which != k - 1:  # the slot already holds the state after the last draft forward
                back_ids.append(rid)
                back_which.append(which)
            self.computed[rid] = start + which
        if back_ids:
            pos = [self._ids.index(r) for r in back_ids]
            # each layer's saved rows, whatever state tensors its spec names (conv + SSM, recurrent alone, ...)
            saved = [[tuple(t[pos] for t in states) for states in snap] for snap in self._saved]
            self.manager.load_states(back_ids, saved, back_which)
        for req in reqs:
            rid = req.request_id
            if rid in self.computed:
                n = self.computed[rid]
                self.manager.computed(rid, req.tokens, n)
                self.manager.trim(rid, n)
                self.manager.shrink(rid, n)
        self._saved = []
        self._ids = [r for r in self._ids if r not in {q.request_id for q in reqs}]
        self.rollback_seconds += time.perf_counter() - t0
