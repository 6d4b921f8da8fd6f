"""The model runner: turns a scheduled step into one forward pass and sampled token ids.

Prefill and decode are different programs (after gpt-fast). A step with any prompt chunk runs eagerly:
:func:`~hybrid.engine.packed_batch.build_batch` makes its metadata once (validated once, host copies attached,
RoPE cos/sin computed once for all attention layers) and ``model.forward_packed`` runs it. A step of
only one-token decodes can instead run a ``torch.compile``-d decode forward (``compile=True``): the batch
is padded to a bucket size (1, 2, 4, ..., ``max_seqs``) and the block tables to a power-of-two width, so a
handful of static shapes cover every step; padded rows write their K/V into the null block and update the
scratch state slot, touching no live sequence. The decode inputs live in persistent buffers per shape
(what CUDA graphs need: ``mode="reduce-overhead"`` on GPU). Compile time is measured on its own and kept
out of the tokens/s.

Sampling happens on the device (:func:`hybrid.sampling.sample`); only the sampled ids come back.
"""

from __future__ import annotations

import contextlib
import time

import torch

from ..cache import NULL_BLOCK, HybridCache
from ..cache.manager import CacheManager
from ..kernels import native
from ..layers import fused_decode
from ..sampling import SamplingBatch, SamplingParams, sample
from .decode_inputs import DecodeInputs
from .packed_batch import PackedBatch, SeqChunk, SeqGroup, build_batch, observed_rows


def bucket_sizes(max_seqs: int) -> list[int]:
    """Powers of two below ``max_seqs``, then ``max_seqs``: the padded decode batch sizes."""
    sizes, b = [], 1
    while b < max_seqs:
        sizes.append(b)
        b *= 2
    return sizes + [max_seqs]


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class DecodeBuffers:
    """Persistent input tensors of one compiled decode shape (batch bucket x block-table width)."""

    def __init__(self, batch: int, width: int, device: torch.device):
        def z(*shape, dtype):
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.tokens = z(batch, dtype=torch.long)
        self.positions = z(batch, dtype=torch.long)
        self.slot_mapping = z(batch, dtype=torch.long)
        self.seq_lens = z(batch, dtype=torch.int32)
        self.block_tables = z(batch, width, dtype=torch.int32)
        self.state_slots = z(batch, dtype=torch.long)

    def fill(self, tokens, positions, slot_mapping, seq_lens, tables, state_slots) -> None:
        for buf, values in ((self.tokens, tokens), (self.positions, positions), (self.slot_mapping, slot_mapping),
                            (self.seq_lens, seq_lens), (self.state_slots, state_slots)):
            buf.copy_(torch.tensor(values, dtype=buf.dtype))
        table = torch.full(tuple(self.block_tables.shape), NULL_BLOCK, dtype=torch.int32)
        for b, t in enumerate(tables):
            table[b, :len(t)] = torch.tensor(t, dtype=torch.int32)
        self.block_tables.copy_(table)


class ModelRunner:
    def __init__(self, model, cache: HybridCache, manager: CacheManager, *, compile: bool = False,
                 compile_backend: str = "inductor", compile_mode: str | None = None):
        self.model, self.cache, self.manager = model, cache, manager
        self.device = cache.device
        self.vocab = model.config.vocab_size
        self.compile = compile
        self.buckets = bucket_sizes(cache.ssm.num_slots)
        self._buffers: dict[tuple[int, int], DecodeBuffers] = {}
        self.compile_seconds = 0.0  # first call of each compiled shape (tracing + codegen), never in tokens/s
        self.compiled_shapes: list[tuple[int, int]] = []
        self._decode = None
        self._inputs: DecodeInputs | None = None  # a CPU decode step's rows, kept across steps
        self.verify_states = None  # the last step's per-position Mamba states of its verify chunks
        if compile:
            import torch._dynamo

            # one compiled graph per (bucket, width): allow enough of them before dynamo gives up
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
            if compile_mode is None and compile_backend == "inductor" and self.device.type == "cuda":
                compile_mode = "reduce-overhead"  # CUDA graphs: one launch per decode step
            self._decode = torch.compile(self._decode_forward, backend=compile_backend, mode=compile_mode,
                                         dynamic=False)

    # ---- which program and threads a step runs with -------------------------------------------
    def decode_path(self) -> str:
        """Which program a decode-only step runs here: the compiled decode forward, the native fused sub-layers
        (CPU, the default), or the eager torch layers — and why not the native one."""
        if self.compile:
            return "compiled (torch.compile of the decode forward)"
        from ..kernels import dispatch

        device = self.device.type
        backend, _ = dispatch.choose("decode_sublayer", device)
        if backend == "native":
            return "native fused sub-layers (kernels/native; layers they do not cover run eager)"
        why = dispatch.why_not("decode_sublayer", "native", device)
        return f"eager torch layers (native: {why or 'not chosen: HYBRID_BACKEND'})"

    def step_threads(self, *, decode_only: bool):
        """The thread arrangement for a whole engine step (scheduling, forward, sampling, output). On CPU a
        decode step's native kernels take the intra-op threads for all of it (torch's few small ops run on
        one): torch's OpenMP workers spin after any parallel region of the step (its sampling, a gather) and
        took a core from the native products (14 -> 9 ms a llama-d512 step). Otherwise torch keeps them."""
        if self.device.type == "cpu" and decode_only:
            return native.owns_threads()
        return contextlib.nullcontext()

    # ---- forward ---------------------------------------------------------------------------------
    def execute(self, chunks: list[SeqChunk], *, all_logits: bool = False,
                num_verify: int = 0) -> tuple[torch.Tensor, bool]:
        """Run one step; returns (last-token logits [B, V] on the device, whether the compiled decode ran).
        A step that compiled a new shape reports it through ``compile_seconds``. ``all_logits``: every new
        token's logits [T, V] instead (eager; prompt scoring). ``num_verify``: the chunks after the decodes
        that are speculative verify chunks (eager); their every row's logits come back, in place of one, and
        their per-position Mamba states are left in ``verify_states`` for the cache manager to commit."""
        self.verify_states = None
        if num_verify:
            batch = build_batch(self.manager, chunks, num_verify)
            self.verify_states = batch.verify_states
            return self.model.forward_packed(batch, self.cache, all_logits=all_logits), False
        if all_logits:
            return self.model.forward_packed(build_batch(self.manager, chunks), self.cache, all_logits=True), False
        if self._decode is not None and all(len(c.tokens) == 1 for c in chunks) and len(chunks) <= self.buckets[-1] \
                and observed_rows(self.manager, chunks) is None:  # SnapKV's window queries: eager capture
            return self._execute_compiled(chunks), True
        if self.device.type == "cpu" and all(len(c.tokens) == 1 for c in chunks):
            # a decode step: its work is the native program (hybrid/layers/fused_decode.py), which takes the
            # intra-op threads while torch's small ops run on one (the engine holds them for its whole step)
            with native.owns_threads():  # (the engine samples these logits before its next step: borrowed)
                logits = self._native_decode(chunks)
                if logits is not None:
                    return logits, False
                return self.model.forward_packed(build_batch(self.manager, chunks), self.cache,
                                                 borrow_logits=True), False
        return self.model.forward_packed(build_batch(self.manager, chunks), self.cache), False

    def _native_decode(self, chunks: list[SeqChunk]) -> torch.Tensor | None:
        """A CPU decode step's logits (borrowed: the program's buffer) from the whole-step native program fed from
        the kept :class:`~hybrid.engine.decode_inputs.DecodeInputs`, no packed batch built; None where the program does
        not cover this model and cache (or this step: more rows than it takes, SnapKV's observed queries)."""
        prog = self._kept_inputs(chunks)
        if prog is None:
            return None
        tokens, positions, kv_slots, seq_lens, tables, state_slots = self._inputs.views()
        return prog.run(self.model, tokens, positions, self._inputs.max_position, kv_slots, seq_lens, tables,
                        state_slots)

    def _kept_inputs(self, chunks: list[SeqChunk]):
        """The whole-step program for these one-token chunks, their rows written into the kept inputs; None (nothing
        written) where it cannot take them."""
        if len(chunks) > native.MAX_ROWS or self.manager.kv.capture is not None or torch.is_grad_enabled():
            return None
        prog = fused_decode.whole_program(self.model, self.cache)
        if prog is None:
            return None
        if self._inputs is None:
            self._inputs = DecodeInputs(native.MAX_ROWS)
        self._inputs.fill(self.manager, chunks)
        return prog

    def can_run_steps(self) -> bool:
        """Whether greedy decode steps here may take their argmax in C, several at a time (:meth:`run_steps`): a CPU
        engine without compilation or SnapKV observation. (Whether the program covers the model, :meth:`run_steps`
        finds out: it returns None where not.)"""
        return self.device.type == "cpu" and not self.compile and self.manager.kv.capture is None

    def covers_whole_step(self) -> bool:
        """Whether the native program runs this model's whole decode step (asked before an engine grows its rows'
        blocks for several steps: a model it does not cover, Mamba-1 or MoE, steps one at a time)."""
        return self.can_run_steps() and fused_decode.whole_program(self.model, self.cache) is not None

    def run_steps(self, chunks: list[SeqChunk], steps: int) -> list[list[int]] | None:
        """``steps`` greedy decode steps of these one-token chunks in one native call (see
        :meth:`DecodeProgram.run_steps`): each row's argmax ids, [steps][rows]; None where the program cannot take
        them (the caller steps one at a time). Every row's blocks must hold ``start + steps`` tokens."""
        prog = self._kept_inputs(chunks)
        if prog is None:
            return None
        block_size = self.manager.block_size if self.manager.kv.enabled else 0
        tokens, positions, kv_slots, seq_lens, tables, state_slots = self._inputs.views()
        with native.owns_threads():
            return prog.run_steps(self.model, steps, block_size, tokens, positions, self._inputs.max_position,
                                  kv_slots, seq_lens, tables, state_slots)

    def _decode_forward(self, tokens, positions, slot_mapping, seq_lens, block_tables, state_slots):
        n = tokens.shape[0]
        cu = torch.arange(n + 1, dtype=torch.int32, device=tokens.device)
        group = SeqGroup(slice(0, n), cu, seq_lens, block_tables, state_slots)
        batch = PackedBatch(tokens, positions, slot_mapping, torch.arange(n, device=tokens.device), group, None)
        return self.model.forward_packed(batch, self.cache)

    def _execute_compiled(self, chunks: list[SeqChunk]) -> torch.Tensor:
        m, n = self.manager, len(chunks)
        bucket = next(b for b in self.buckets if b >= n)
        tables = [m.block_table(c.seq_id) if m.kv.enabled else [] for c in chunks]
        width = _pow2_at_least(max(1, max(len(t) for t in tables)))
        key = (bucket, width)
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = DecodeBuffers(bucket, width, self.device)
        pad = bucket - n
        # padded rows: token 0 at position 0, K/V into the null block's first slot, state in the scratch row
        buf.fill([c.tokens[0] for c in chunks] + [0] * pad, [c.start for c in chunks] + [0] * pad,
                 [m.pool_slots(c.seq_id, c.start, c.start + 1)[0] for c in chunks] + [NULL_BLOCK] * pad,
                 [m.kv_length(c.seq_id, c.start + 1) for c in chunks] + [1] * pad, tables,
                 [m.state_slot(c.seq_id) for c in chunks] + [self.cache.ssm.scratch_slot] * pad)
        first = key not in self.compiled_shapes
        t0 = time.perf_counter()
        logits = self._decode(buf.tokens, buf.positions, buf.slot_mapping, buf.seq_lens, buf.block_tables,
                              buf.state_slots)
        if first:
            self.compiled_shapes.append(key)
            self.compile_seconds += time.perf_counter() - t0
        return logits[:n]

    # ---- sampling --------------------------------------------------------------------------------
    def sample(self, logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], counters: list[int],
               contexts: list[list[int]] | None) -> list[int]:
        """Sample one token per row on the device; only the ids are copied back."""
        if all(p.greedy and p.repetition_penalty == 1.0 for p in params):
            # what sample() returns for these rows, without building its tensors
            return native.argmax(logits) if native.argmax_supports(logits) else logits.argmax(dim=-1).tolist()
        batch = SamplingBatch.build(params, seeds, counters, contexts, self.vocab, logits.device)
        return sample(logits, batch).tolist()

