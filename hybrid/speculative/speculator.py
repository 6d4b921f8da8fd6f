"""The engine's speculative decoding glue: the drafter it builds from a :class:`~.config.SpeculativeConfig`,
how many drafts each decoding request may have checked, and the two halves of a speculative step around the
target's packed forward — asking the drafter for drafts before it, and after it the rejection rule, each
request's emitted tokens, and the rollback (Mamba states written back at the last accepted token, rejected
tokens' KV blocks given back, in the target's and the draft's cache).

The engine owns the loop; this module owns what a step does differently when it speculates.
"""

from __future__ import annotations

import time

import torch

from ..cache.build import draft_cache, prefix_cache_for
from ..cache.manager import CacheManager
from ..engine.output import process_token
from ..engine.request import Request, RequestOutput
from .config import SpeculativeConfig
from .verifier import ACCEPT_SALT, stream_uniforms, token_probs, verify


def make_drafter(spec, model, cache, *, block_size: int, prefix_caching: bool, prefix_state_bytes: int | None,
                 checkpoint_interval: int | None, flop_weight: float):
    """The drafter ``spec`` asks for: n-gram lookup, or a draft model with its own cache (as many tokens as
    the target's ``cache`` holds, plus drafts, unless the config sizes it) and its own prefix cache when the
    target has one."""
    from .draft_model import DraftModelDrafter
    from .ngram import NgramDrafter

    if not isinstance(spec, SpeculativeConfig):
        raise TypeError(f"speculative must be a hybrid.SpeculativeConfig, got {type(spec).__name__}")
    if spec.method == "ngram":
        return NgramDrafter(spec.ngram_max, spec.ngram_min)
    draft = spec.draft_model
    if draft.config.vocab_size != model.config.vocab_size:
        raise ValueError(f"the draft model's vocab_size {draft.config.vocab_size} differs from the target's "
                         f"{model.config.vocab_size}: a draft must share the target's vocabulary")
    if next(draft.parameters()).device != cache.device:
        raise ValueError(f"the draft model is on {next(draft.parameters()).device}, the engine's cache on "
                         f"{cache.device}: move the draft model there")
    dcache = draft_cache(draft, cache, spec, block_size)
    prefix = prefix_cache_for(dcache, draft, enabled=prefix_caching, state_bytes=prefix_state_bytes,
                              checkpoint_interval=checkpoint_interval, flop_weight=flop_weight)
    return DraftModelDrafter(draft, CacheManager(dcache, prefix))


class Speculator:
    """One engine's speculative decoding: ``config`` and the ``drafter`` built from it."""

    def __init__(self, config, model, cache, **drafter_options):
        self.config = config
        self.drafter = make_drafter(config, model, cache, **drafter_options)

    def allowance(self, req: Request) -> int:
        """The most draft tokens ``req`` may have checked this step: the configured number, fewer near its
        length limit (the verify emits drafts + 1 tokens), none for requests the rule does not cover."""
        p = req.params
        if req.score_only or p.repetition_penalty != 1.0:
            return 0
        return max(0, min(self.config.num_tokens, p.max_new_tokens - len(req.output) - 1))

    def release(self, req: Request) -> None:
        """A request finished or was preempted: the drafter frees what it holds for it too."""
        self.drafter.release(req.request_id, req.tokens)

    def draft(self, plan, stats):
        """Ask the drafter for the drafts of the decoding requests the scheduler gave room for; returns the
        plan with each one's real chunk length (decodes, then verify chunks, then prefills) and
        {request: (drafts, their proposal distributions or None)}."""
        t0 = time.perf_counter()
        want = [(req, n - 1) for req, n in plan if n > 1 and req.num_pending == 1]
        drafts = {}
        if want:
            proposals, qs = self.drafter.propose([r for r, _ in want], [k for _, k in want])
            for i, ((req, k), toks) in enumerate(zip(want, proposals, strict=True)):
                toks = toks[:k]
                if toks:
                    drafts[req] = (toks, None if qs is None else qs[i][:len(toks)])
        plan = [(req, 1 + len(drafts[req][0]) if req in drafts else (1 if req.num_pending == 1 else n))
                for req, n in plan]
        plan.sort(key=lambda rn: 0 if rn[1] == 1 else 1 if rn[0] in drafts else 2)
        stats.draft_seconds += time.perf_counter() - t0
        return plan, drafts

    def verify(self, verified, drafts, out, verify_states, manager, scheduler, stats, finish) -> list[RequestOutput]:
        """The rejection rule over every verify chunk of this step at once (``verified``: (request, its first
        row of ``out``)), then each request's emitted tokens (accepted drafts + one of the target's own), the
        Mamba states written back at the last accepted token and the rejected tokens' KV blocks given back, in
        the target's and the draft's cache; ``finish(req, reason)`` ends the requests a token stopped."""
        t0 = time.perf_counter()
        reqs = [r for r, _ in verified]
        lens = [len(drafts[r][0]) for r in reqs]
        K, n, dev = max(lens), len(reqs), out.device
        index = torch.tensor([s + j for (_, s), k in zip(verified, lens, strict=True) for j in range(k + 1)],
                             device=dev)
        probs = token_probs(out[index], [r.params for r, k in zip(reqs, lens, strict=True) for _ in range(k + 1)])
        p = torch.zeros(n, K + 1, probs.shape[-1], device=dev)
        where = torch.tensor([i * (K + 1) + j for i, k in enumerate(lens) for j in range(k + 1)], device=dev)
        p.view(n * (K + 1), -1)[where] = probs
        tokens = torch.tensor([drafts[r][0] + [0] * (K - k) for r, k in zip(reqs, lens, strict=True)], device=dev)
        q = None
        if not self.drafter.deterministic:
            q = torch.zeros(n, K, probs.shape[-1], device=dev)
            for i, r in enumerate(reqs):
                q[i, :lens[i]] = drafts[r][1]
        seeds = [r.seed for r in reqs]
        counters = [[len(r.output) + j for j in range(K + 1)] for r in reqs]
        u_accept = stream_uniforms(seeds, [c[:K] for c in counters], ACCEPT_SALT, dev)
        u_resample = stream_uniforms(seeds, counters, 0, dev)
        accepted, nxt = verify(p, tokens, torch.tensor(lens, device=dev), q, u_accept, u_resample)
        accepted, nxt = accepted.tolist(), nxt.tolist()
        starts = [r.num_tokens for r in reqs]
        outputs, kept, reasons = [], [], []
        for req, m, x in zip(reqs, accepted, nxt, strict=True):
            before, reason, ids, text, last = len(req.output), None, [], "", None
            for tok in drafts[req][0][:m] + [x]:
                last, reason = process_token(req, tok)
                ids.extend(last.new_token_ids)
                text += last.text
                if reason is not None:
                    break
            outputs.append(RequestOutput(req.request_id, ids, text, last.finished, last.finish_reason))
            kept.append(min(m, len(req.output) - before))
            reasons.append(reason)
        t1 = time.perf_counter()
        manager.commit_verified(verify_states, kept)
        stats.verify_state_bytes = max(stats.verify_state_bytes, verify_states.nbytes)
        scheduler.advance([(r, 1 + j) for r, j in zip(reqs, kept, strict=True)])
        for r in reqs:
            manager.shrink(r.request_id, r.num_computed)
        self.drafter.rollback(reqs, starts, lens, kept)  # finished ones too: their prefix stays in the draft's tree
        t2 = time.perf_counter()
        for req, reason in zip(reqs, reasons, strict=True):
            if reason is not None:
                finish(req, reason)
        stats.count_verify(n, sum(lens), sum(accepted), t1 - t0, t2 - t1)
        return outputs
