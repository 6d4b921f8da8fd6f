"""The engine's statistics: counters and per-part step times (after vLLM v1's ``IterationStats``), and how
one step is counted into them. The engine takes the timestamps; this module decides which counter each
interval goes to."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    prompt_tokens: int = 0  # prompt tokens requested (add_request / score)
    prefix_hit_tokens: int = 0  # of those, served from the prefix cache at each request's first admission
    prompt_tokens_computed: int = 0  # prompt positions the model ran (recomputes after preemption included)
    recompute_hit_tokens: int = 0  # tokens a re-admitted (preempted) request got back from the prefix cache
    # speculative decoding (a decode step that verified drafts counts every token it emitted as decoded)
    draft_tokens_proposed: int = 0  # draft tokens checked by the target
    draft_tokens_accepted: int = 0  # of those, accepted
    verify_chunks: int = 0  # (request, step) pairs whose drafts were checked
    verify_steps: int = 0  # steps with at least one verify chunk
    verify_forward_seconds: float = 0.0  # the target forward of those steps
    draft_seconds: float = 0.0  # the drafter (draft model forwards and sampling, or n-gram lookup)
    accept_seconds: float = 0.0  # the rejection rule and the emitted tokens' output processing
    rollback_seconds: float = 0.0  # Mamba state write-back and KV give-back, in the target's and the draft's cache
    verify_state_bytes: int = 0  # the largest per-position Mamba state scratch of one verify step

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (0 before any was proposed)."""
        return self.draft_tokens_accepted / self.draft_tokens_proposed if self.draft_tokens_proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Draft tokens accepted per verify chunk (each chunk also emits one token of the target's own)."""
        return self.draft_tokens_accepted / self.verify_chunks if self.verify_chunks else 0.0

    def count_prompt_positions(self, plan) -> None:
        """The prompt positions this step's ``(request, tokens)`` plan runs (before it runs)."""
        for req, n in plan:
            self.prompt_tokens_computed += max(0, min(req.num_computed + n, len(req.prompt)) - req.num_computed)

    def count_step(self, plan, compiled: bool, compile_dt: float, t0: float, t1: float, t2: float, t3: float,
                   t4: float, drafts=(), emitted: int = 0, steps: int = 1) -> None:
        """One step: ``t0``..``t4`` bound the scheduler, the forward, sampling and output processing.
        ``compile_dt`` > 0: the step traced and compiled a new shape, and only its compile time counts. ``steps``:
        the decode steps a multi-step call ran (``emitted`` tokens in all)."""
        self.steps += 1
        n_tokens = sum(n for _, n in plan)
        if compile_dt > 0:  # this step traced and compiled a new shape: its time is not decode speed
            self.compile_seconds += compile_dt
            return
        self.schedule_seconds += t1 - t0
        self.forward_seconds += t2 - t1
        self.sample_seconds += t3 - t2
        self.output_seconds += t4 - t3
        if any(n > 1 and r not in drafts for r, n in plan):
            self.prefill_tokens += n_tokens
            self.prefill_seconds += t4 - t0
        else:
            self.decode_tokens += emitted if drafts or steps > 1 else n_tokens
            self.decode_seconds += t4 - t0
            self.decode_steps += steps
            self.compiled_steps += compiled

    def count_verify(self, chunks: int, proposed: int, accepted: int, accept_seconds: float,
                     rollback_seconds: float) -> None:
        """One step's speculative verify: its chunks, the drafts checked and accepted, and the times of the
        rejection rule and of the rollback."""
        self.verify_steps += 1
        self.verify_chunks += chunks
        self.draft_tokens_proposed += proposed
        self.draft_tokens_accepted += accepted
        self.accept_seconds += accept_seconds
        self.rollback_seconds += rollback_seconds
