"""The model runner: turns a scheduled step into one forward pass and sampled token ids.

Prefill and decode are different programs (after gpt-fast). A step with any prompt chunk runs eagerly:
:func:`~hybrid.engine.packed_batch.build_batch` makes its metadata once (validated once, host copies attached,
RoPE cos/sin computed once for all attention layers) and ``model.forward_packed`` runs it. A step of only
one-token decodes runs on a decode backend (:mod:`hybrid.decode`): the compiled decode forward
(``compile=True``), the native decode program (CPU, whole or per sub-layer), or the eager layers. Which one is
decided here and only here, once per :class:`~hybrid.decode.DecodeShape` (rows, and the switches that can change
between steps), from each backend's ``supports()``; :meth:`ModelRunner.decode_report` prints every verdict.

Sampling happens on the device (:func:`hybrid.sampling.sample`); only the sampled ids come back.
"""

from __future__ import annotations

import contextlib

import torch

from ..cache import HybridCache
from ..cache.manager import CacheManager
from ..decode import DecodeShape, choose, describe
from ..decode.compiled import CompiledBackend
from ..decode.eager import EagerBackend
from ..decode.native_program import NativeProgramBackend, NativeSublayersBackend, native_switch
from ..kernels import native
from ..sampling import SamplingBatch, SamplingParams, sample
from .decode_inputs import DecodeInputs
from .packed_batch import SeqChunk, build_batch


def bucket_sizes(max_seqs: int) -> list[int]:
    """Powers of two below ``max_seqs``, then ``max_seqs``: the padded decode batch sizes."""
    sizes, b = [], 1
    while b < max_seqs:
        sizes.append(b)
        b *= 2
    return sizes + [max_seqs]


class ModelRunner:
    def __init__(self, model, cache: HybridCache, manager: CacheManager, *, compile: bool = False,
                 compile_backend: str = "inductor", compile_mode: str | None = None):
        self.model, self.cache, self.manager = model, cache, manager
        self.device = cache.device
        self.vocab = model.config.vocab_size
        self.compile = compile
        self.buckets = bucket_sizes(cache.ssm.num_slots)
        self.compiled = CompiledBackend(model, cache, self.buckets, enabled=compile, backend=compile_backend,
                                        mode=compile_mode)
        # the decode backends in the order they are asked: the first whose supports() says yes runs the step
        self.decode_backends = (self.compiled, NativeProgramBackend(), NativeSublayersBackend(), EagerBackend())
        self._chosen: dict[tuple, object] = {}  # _choice_key -> backend
        self._inputs: DecodeInputs | None = None  # a CPU decode step's rows, kept across steps
        self.verify_states = None  # the last step's per-position Mamba states of its verify chunks

    @property
    def compile_seconds(self) -> float:
        """First call of each compiled shape (tracing + codegen), never in tokens/s."""
        return self.compiled.compile_seconds

    @property
    def compiled_shapes(self) -> list[tuple[int, int]]:
        return self.compiled.compiled_shapes

    # ---- which program and threads a step runs with -------------------------------------------
    def _choice_key(self, rows: int) -> tuple:
        """The fields of :class:`DecodeShape` that can change between steps (rows, observed, grad, native_off), as a
        plain tuple: the cache key of :meth:`decode_backend` (a frozen dataclass costs microseconds a step to build)."""
        return (rows, self.manager.kv.capture is not None, torch.is_grad_enabled(),
                native_switch() if self.device.type == "cpu" else None)

    def _shape(self, key: tuple) -> DecodeShape:
        return DecodeShape(key[0], self.device.type, self.compile, *key[1:])

    def decode_shape(self, rows: int) -> DecodeShape:
        """What the backend choice of a ``rows``-row decode step depends on, as things are now."""
        return self._shape(self._choice_key(rows))

    def decode_backend(self, rows: int):
        """The backend that runs a ``rows``-row decode step here: chosen once per shape, then looked up."""
        key = self._choice_key(rows)
        backend = self._chosen.get(key)
        if backend is None:
            backend = self._chosen[key] = choose(self.decode_backends, self.model, self.cache, self._shape(key))
        return backend

    def decode_report(self, rows: int = 1) -> str:
        """The backend a ``rows``-row engine decode step runs on here, and every backend's verdict (why not). As an
        engine step sees it: under ``torch.inference_mode`` (Engine.step's)."""
        with torch.inference_mode():
            return describe(self.decode_backends, self.model, self.cache, self.decode_shape(rows))

    def decode_path(self) -> str:
        """Which program a one-row decode step runs here, and why not the others (:meth:`decode_report`)."""
        return self.decode_report(1)

    def kept_inputs(self) -> DecodeInputs:
        """The decode inputs kept across steps (the native program reads its rows from them)."""
        if self._inputs is None:
            self._inputs = DecodeInputs(native.MAX_ROWS)
        return self._inputs

    def step_threads(self, *, decode_only: bool):
        """The thread arrangement for a whole engine step (scheduling, forward, sampling, output). On CPU a
        decode step's native kernels take the intra-op threads for all of it (torch's few small ops run on
        one): torch's OpenMP workers spin after any parallel region of the step (its sampling, a gather) and
        took a core from the native products. Otherwise torch keeps them."""
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
        their per-position Mamba states are left in ``verify_states`` for the cache manager to commit. A
        decode step's logits may be borrowed (a view of a buffer the next step overwrites): the engine samples
        them before its next step."""
        self.verify_states = None
        if num_verify:
            batch = build_batch(self.manager, chunks, num_verify)
            self.verify_states = batch.verify_states
            return self.model.forward_packed(batch, self.cache, all_logits=all_logits), False
        if all_logits or not all(len(c.tokens) == 1 for c in chunks):
            return self.model.forward_packed(build_batch(self.manager, chunks), self.cache,
                                             all_logits=all_logits), False
        backend = self.decode_backend(len(chunks))
        # a CPU decode step's native kernels take the intra-op threads while torch's small ops run on one
        threads = native.owns_threads() if self.device.type == "cpu" and backend is not self.compiled \
            else contextlib.nullcontext()
        with threads:
            logits = backend.run(self, chunks)
            if logits is None:  # refused this step after all (SnapKV's window queries, a view rebuilt since the
                # choice): the next backend that takes the shape
                later = self.decode_backends[self.decode_backends.index(backend) + 1:]
                shape = self.decode_shape(len(chunks))
                for backend in (b for b in later if b.supports(self.model, self.cache, shape) is None):
                    logits = backend.run(self, chunks)
                    if logits is not None:
                        break
        return logits, backend is self.compiled

    def can_run_steps(self) -> bool:
        """Whether greedy decode steps here may take their argmax in C, several at a time (:meth:`run_steps`): the
        backend a decode step runs on is the whole-step native program."""
        return self.decode_backend(1).multi_step

    def run_steps(self, chunks: list[SeqChunk], steps: int) -> list[list[int]] | None:
        """``steps`` greedy decode steps of these one-token chunks in one native call (see
        :meth:`~hybrid.decode.program.DecodeProgram.run_steps`): each row's argmax ids, [steps][rows]; None where
        the backend cannot take them (the caller steps one at a time). Every row's blocks must hold
        ``start + steps`` tokens."""
        backend = self.decode_backend(len(chunks))
        if not backend.multi_step:
            return None
        with native.owns_threads():
            return backend.run_steps(self, chunks, steps)

    # ---- sampling --------------------------------------------------------------------------------
    def sample(self, logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], counters: list[int],
               contexts: list[list[int]] | None) -> list[int]:
        """Sample one token per row on the device; only the ids are copied back."""
        if all(p.greedy and p.repetition_penalty == 1.0 for p in params):
            # what sample() returns for these rows, without building its tensors
            return native.argmax(logits) if native.argmax_supports(logits) else logits.argmax(dim=-1).tolist()
        batch = SamplingBatch.build(params, seeds, counters, contexts, self.vocab, logits.device)
        return sample(logits, batch).tolist()

