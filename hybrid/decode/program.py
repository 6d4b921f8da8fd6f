"""A decode step as a *program* of native ops (``kernels/native/program.c``), built once per engine: for the
one-token rows of a decode-only step, each residual sub-layer ``x + mixer(norm(x))`` is a few ops with its
weights, cache pools and scratch buffers bound, and when every layer is covered the whole step — all
sub-layers, the final norm and the LM head — is a single call into C.

Why: a decode step reads every weight once, and on a CPU that takes a few milliseconds (llama-d512 fp32: 208
MB at ~28 GB/s, 7.4 ms). The eager layers spend as long again between the products (about 25 torch ops a
sub-layer, each microseconds of dispatch, several an OpenMP fork/join); the same ops called one by one from
Python through ctypes still cost ~5 ms a step of interpreter and tensor bookkeeping and a thread wake-up per
call (measured: issue 25's closing note). A program pays that once a step.

An attention sub-layer is four ops (norm; q/k/v with RoPE and the K/V write in one pass over the three
matrices; paged attention; out-projection with the residual), a gated MLP three, a plain MLP three, a
Mamba-2 layer seven, a Gated DeltaNet layer six (norm; in-projection; conv step; q/k L2 norm, gates and the
delta-rule step; per-head gated norm; out-projection), a GLA layer five or six (the same, the conv only with
the short conv, the decay gate's low-rank up-projection and log decay inside the GLA step's op); each mirrors
the rounding points of the torch ops it replaces (tests hold the program to the eager layers, bit for bit in
bf16, and to the full forward).

Covered: attention over fp32/bf16 K/V pools (no int8/fp8 pages, no StreamingLLM/SnapKV pruning), gated or
plain MLPs, Mamba-2, Gated DeltaNet (head dims up to 512) and GLA (value heads up to 512, no int4 decay-gate
projection) with fp32/bf16 state pools (no int8 or stochastic-rounded state); fp32, bf16, torchao
int8 weight-only, torchao CPU int4 weight-only or torchao int8dq / 8da4w (int8 activations, quantised once per
op) linear layers (int4 attention: head_dim a multiple of 16); up
to 64 decoding sequences (from 4 on, the products are blocked 4 weight rows x 3 input rows: a batched step is
compute-bound; past 64 torch's GEMMs take them). A layer outside that runs
its eager forward (the others keep their programs; the step is then one call per covered sub-layer).
Which layers each kind lowers, and how, is the layer's own ``lower_decode`` (hybrid/layers/*, handed a
:class:`~hybrid.decode.builder.DecodeBuilder`); the native backends of :mod:`hybrid.decode` run the program.
``HYBRID_BACKEND=torch`` turns it all off.
"""

from __future__ import annotations

import ctypes
import weakref

import torch

from ..kernels import host_memory, native
from ..kernels.native import DTYPE_CODES
from ..kernels.packing import host_values
from ..quantize import decode_bytes
from .builder import FLOATS, DecodeBuilder, HlOp, HlStep, Unsupported, X, plain


def _check_abi() -> None:
    lib = native.library()
    want = ctypes.sizeof(HlOp) * 1000 + ctypes.sizeof(HlStep)
    if lib.hl_program_abi() != want:
        raise RuntimeError(f"kernels/native/program.c's HlOp/HlStep ({lib.hl_program_abi()}) differ from their "
                           f"ctypes mirrors in {__name__} ({want}): the two must change together")


class _Ops:
    """The ops of one or more builders, in order, as program.c takes them, and what they must find unchanged to
    run (their scratch buffers are kept here: the ops point into them)."""

    def __init__(self, *builders: DecodeBuilder):
        ops = [o for b in builders for o in b.ops]
        self.array = (HlOp * len(ops))(*ops)
        self.scratch = [t for b in builders for t in b.buffers.values()]
        bound = {k: t for b in builders for k, t in b.bound.items()}
        self.bound_tensors = list(bound.values())
        self.bound_ptrs = [t.data_ptr() for t in self.bound_tensors]
        self.times = None  # set to a (ctypes.c_double * n)() to collect each op's microseconds

    def valid(self) -> bool:
        # every step checks every bound tensor (a few hundred): map over the C method, not a generator (26 -> 8 us)
        return list(map(torch.Tensor.data_ptr, self.bound_tensors)) == self.bound_ptrs

    def run(self, step: HlStep) -> None:
        rc = native.library().hl_program_run(self.array, len(self.array), ctypes.byref(step), self.times)
        if rc:
            raise RuntimeError(f"the native decode program refused op {-rc - 1} of {len(self.array)}: its arguments "
                               "are outside what the kernels take (a bug: the builder should have refused them)")


class DecodeProgram:
    """The decode ops of one model over one cache: ``blocks[i]`` the ops of block i (None where it is not
    covered: ``why[i]`` says why), ``whole`` every block plus the final norm and the LM head as one list (None
    unless all are covered)."""

    def __init__(self, model, cache):
        _check_abi()
        self.huge_page_bytes = _weights_on_huge_pages(model)
        self.dtype = model.embed.weight.dtype
        self.d_model = model.config.d_model
        self.vocab = model.config.vocab_size
        self.views = {}
        self.blocks, self.why, built = [], [], []
        for block in model.layers:
            view = cache.view(block.index) if block.caches else None
            self.views[block.index] = view
            try:
                own = DecodeBuilder(self.dtype)
                own.block(block, view)  # the mixer's own lower_decode
                built.append(own)
                self.blocks.append(_Ops(own))
                self.why.append(None)
            except Unsupported as e:
                self.blocks.append(None)
                self.why.append(str(e))
        self.whole = self.logits = self._x = self._rope_rows = None
        self._step = HlStep()  # the whole step's inputs, refilled by run() (a ctypes struct a step is ~2 us)
        # weights that fit in the last-level cache stay there between steps unless a prefetch
        # pushes them out: the products prefetch only what streams from memory (kernels/native/pool.c P_stream)
        self.weight_bytes = _decode_weight_bytes(model)
        self.stream = native.streams_from_memory(self.weight_bytes)
        if all(w is None for w in self.why):
            # the whole step: every block's own ops (and buffers; blocks run one after another), then the head
            whole = DecodeBuilder(self.dtype)
            try:
                self.logits = whole.buffer(self.vocab)
                h = whole.buffer(self.d_model)
                whole.norm(model.norm_f, X, h)
                head = model.lm_head
                if head is None:  # tied embeddings
                    if not plain(model.embed.weight):
                        raise Unsupported("the tied embedding's weight")
                    N, K = model.embed.weight.shape
                    dt = DTYPE_CODES[self.dtype]
                    whole.op("GEMV", w=model.embed.weight, scale=None, bias=None, x=h, res=None, y=self.logits,
                             wdt=dt, bdt=-1, xdt=dt, ydt=dt, N=N, K=K, act1=0)
                else:
                    whole.linear(head, h, self.logits)
                self.whole = _Ops(*built, whole)
            except Unsupported as e:
                self.why.append(f"LM head: {e}")

    def _rows(self, model) -> torch.Tensor:
        """The kept input-row buffer [MAX_ROWS, d_model] in the embedding's dtype: the program gathers the step's
        embedding rows into it and adds every block's output to it in place (a new one each step would be an
        allocation)."""
        w = model.embed.weight
        if self._x is None or self._x.dtype != w.dtype:
            with torch.inference_mode(False):  # a normal tensor: written in and out of inference mode alike
                self._x = torch.empty(native.MAX_ROWS, w.shape[1], dtype=w.dtype)
        return self._x

    def run(self, model, tokens: torch.Tensor, positions: torch.Tensor, max_position: int, kv_slots: torch.Tensor,
            seq_lens: torch.Tensor, tables: torch.Tensor, state_slots: torch.Tensor) -> torch.Tensor | None:
        """The whole step (``whole`` must be set) for rows given by their token ids and positions: int64 ``tokens``,
        ``positions``, ``kv_slots``, ``state_slots`` [n], int32 ``seq_lens`` [n] and ``tables`` [n, width], all
        contiguous CPU tensors the caller has checked (``max_position``: the largest of ``positions``). The
        program gathers the embedding rows (a plain ``nn.Embedding``; else the module runs here) and the RoPE
        table's rows itself. Returns the logits [n, vocab]: a view of this program's buffer, which the next step
        overwrites; None when the embedding's rows are not in the program's dtype (the caller runs the layers)."""
        if not self._set_step(model, tokens, positions, max_position, kv_slots, seq_lens, tables, state_slots,
                              embed_here=True):
            return None
        self.whole.run(self._step)
        return self.logits[:tokens.shape[0]]

    def run_steps(self, model, steps: int, block_size: int, tokens: torch.Tensor, positions: torch.Tensor,
                  max_position: int, kv_slots: torch.Tensor, seq_lens: torch.Tensor, tables: torch.Tensor,
                  state_slots: torch.Tensor) -> list[list[int]] | None:
        """``steps`` greedy decode steps in one call (program.c's hl_program_steps), the inputs as :meth:`run` takes
        them: each step's argmax ids become the rows' next tokens, their positions, K/V lengths and slots (along
        ``tables``, blocks of ``block_size``; 0 without attention) move one on. ``tokens``, ``positions``,
        ``kv_slots`` and ``seq_lens`` are written in place (left as the last step had them). The caller has grown
        every row's blocks for all the steps. Returns the ids, [steps][n]; None where the program cannot take
        these rows this way (an embedding it cannot gather: the caller steps one at a time)."""
        if not self._set_step(model, tokens, positions, max_position + steps - 1, kv_slots, seq_lens, tables,
                              state_slots, embed_here=False):
            return None
        n = tokens.shape[0]
        ids = (ctypes.c_int64 * (steps * n))()
        logits = self.logits
        rc = native.library().hl_program_steps(self.whole.array, len(self.whole.array), ctypes.byref(self._step),
                                               self.whole.times, steps, block_size, logits.data_ptr(),
                                               DTYPE_CODES[logits.dtype], logits.shape[1], ids)
        if rc:
            raise RuntimeError(f"the native decode program refused a multi-step call (code {rc}): its arguments are "
                               "outside what the kernels take (a bug: the builder should have refused them)")
        flat = list(ids)
        return [flat[s * n:(s + 1) * n] for s in range(steps)]

    def _set_step(self, model, tokens, positions, max_position, kv_slots, seq_lens, tables, state_slots, *,
                  embed_here: bool) -> bool:
        """Fill the kept HlStep for these rows (see :meth:`run`); False where the embedding's rows do not suit the
        program. ``embed_here``: an embedding the program cannot gather runs here (else: False)."""
        n = tokens.shape[0]
        st = self._step
        if _plain_embedding(model.embed, n):
            w = model.embed.weight
            if w.dtype != self.dtype:
                return False
            st.x, st.tokens, st.embed = self._rows(model).data_ptr(), tokens.data_ptr(), w.data_ptr()
            st.embed_row_bytes, st.vocab = w.shape[1] * w.element_size(), w.shape[0]
        elif embed_here:
            x = model.embed(tokens)
            if x.dtype != self.dtype or x.shape != (n, self.d_model):
                return False
            x = self._rows(model)[:n].copy_(x)
            st.x, st.tokens = x.data_ptr(), None
        else:
            return False
        rope = model.rope
        if rope is not None and rope.rotary_dim:
            cos, sin = rope.table(max_position + 1, self.dtype, tokens.device)
            if self._rope_rows is None or self._rope_rows[0].shape[1] != cos.shape[1]:
                self._rope_rows = tuple(torch.empty(native.MAX_ROWS, cos.shape[1], dtype=self.dtype) for _ in "cs")
            st.cos, st.sin = self._rope_rows[0].data_ptr(), self._rope_rows[1].data_ptr()
            st.positions, st.cos_table, st.sin_table = positions.data_ptr(), cos.data_ptr(), sin.data_ptr()
            st.rope_row_bytes, st.table_rows = cos.shape[1] * cos.element_size(), cos.shape[0]
        st.n, st.kv_slots, st.seq_lens = n, kv_slots.data_ptr(), seq_lens.data_ptr()
        st.state_slots = state_slots.data_ptr()
        st.tables, st.tstride = tables.data_ptr(), tables.stride(0) if tables.dim() == 2 else 0
        native.set_stream_prefetch(self.stream)
        return True

    def valid(self, cache) -> bool:
        """The cache still hands out the views it was built on (a pruning policy set since rebuilds them)."""
        return all(cache.view(i) is v for i, v in self.views.items() if v is not None)

    @staticmethod
    def step_args(batch, x: torch.Tensor) -> HlStep:
        d = batch.decode
        cos, sin = batch.rope if batch.rope is not None else (None, None)
        tables = d.block_tables
        return HlStep(n=x.shape[0], x=x.data_ptr(), kv_slots=batch.slot_mapping.data_ptr(),
                      seq_lens=d.seq_lens.data_ptr(), tables=tables.data_ptr(),
                      tstride=tables.stride(0) if tables.dim() == 2 else 0, state_slots=d.state_slots.data_ptr(),
                      cos=None if cos is None else cos.data_ptr(), sin=None if sin is None else sin.data_ptr())


_programs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # cache -> (model ref, DecodeProgram)
_MOVED_ATTR = "_hybrid_huge_page_bytes"


def _weights_on_huge_pages(model) -> int:
    """Once per model, before its first program binds any pointer: the weights a decode step streams (every
    matrix but an untied embedding's, whose rows are only looked up) moved onto 2 MiB pages
    (kernels.host_memory.huge_page_weights; the values unchanged). Returns the bytes on huge pages."""
    moved = getattr(model, _MOVED_ATTR, None)
    if moved is None:
        skip = model.embed.weight if model.lm_head is not None else None
        weights = [t for t in (*model.parameters(), *model.buffers())
                   if t is not skip and t.dim() >= 2 and t.numel() * t.element_size() >= 65536]
        moved = host_memory.huge_page_weights(weights)
        object.__setattr__(model, _MOVED_ATTR, moved)
    return moved


def _plain_embedding(emb, rows: int) -> bool:
    """Whether ``emb`` is a plain ``nn.Embedding`` (no max_norm, no hooks) whose rows the program may gather for
    ``rows`` rows itself."""
    mod = torch.nn.modules.module
    return (type(emb) is torch.nn.Embedding and emb.max_norm is None and not emb._forward_hooks
            and not emb._forward_pre_hooks and not mod._global_forward_hooks and not mod._global_forward_pre_hooks
            and 0 < rows <= native.MAX_ROWS)


def _step_ok(batch, dtype: torch.dtype) -> bool:
    """Whether the whole-step program may run ``batch`` (a decode-only step's packed batch) as it is."""
    d = batch.decode
    return (d is not None and batch.prefill is None and batch.observe is None and 0 < d.num_seqs <= native.MAX_ROWS
            and batch.tokens.device.type == "cpu" and not torch.is_grad_enabled() and dtype in FLOATS
            and all(t.dtype == torch.int64 and t.is_contiguous() and t.shape[0] == d.num_seqs
                    for t in (batch.tokens, batch.positions, batch.slot_mapping, d.state_slots))
            and d.seq_lens.dtype == torch.int32 and d.block_tables.dtype == torch.int32
            and d.block_tables.is_contiguous())


def _batch_ok(batch, x: torch.Tensor) -> bool:
    d = batch.decode
    return (d is not None and batch.prefill is None and x.dtype in FLOATS and x.is_contiguous()
            and 0 < x.shape[0] <= native.MAX_ROWS and x.device.type == "cpu" and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling() and batch.observe is None
            and batch.slot_mapping.dtype == torch.int64 and batch.slot_mapping.is_contiguous()
            and d.seq_lens.dtype == torch.int32 and d.block_tables.dtype == torch.int32
            and d.block_tables.is_contiguous() and d.state_slots.dtype == torch.int64
            and (batch.rope is None or all(t.dtype == x.dtype and t.is_contiguous() for t in batch.rope)))


def program(model, cache) -> DecodeProgram:
    """The decode program of ``model`` over ``cache`` (built on first use, rebuilt when a view or a bound tensor
    changed)."""
    entry = _programs.get(cache)
    if entry is not None:
        ref, prog = entry
        # the whole step's ops bind every block's tensors; without it each block checks its own when it runs
        if ref() is model and prog.valid(cache) and (prog.whole is None or prog.whole.valid()):
            return prog
    prog = DecodeProgram(model, cache)
    _programs[cache] = (weakref.ref(model), prog)
    return prog


def _decode_weight_bytes(model) -> int:
    """Bytes of the weights a decode step reads: every linear layer's (its int8 / int4 codes and scales where
    quantised) and the LM head (the tied embedding's matrix); not the embedding's other rows."""
    total = sum(decode_bytes(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear))
    return total + (decode_bytes(model.embed.weight) if model.lm_head is None else 0)


def coverage(model, cache) -> list[str | None]:
    """Per block, None when its decode runs as native ops, else why not (then an LM-head line if that failed)."""
    return list(program(model, cache).why)


def run_sublayer(prog: DecodeProgram, block, x: torch.Tensor, batch, cache) -> torch.Tensor | None:
    """``x + mixer(norm(x))`` of ``block`` for a decode-only step's rows x [n, d_model] as its own ops, or None when
    the program does not cover this block, batch or cache (the caller runs the layer's forward)."""
    if not _batch_ok(batch, x):
        return None
    ops = prog.blocks[block.index] if block.index < len(prog.blocks) else None
    if ops is None or not ops.valid() or (block.caches and cache.view(block.index) is not prog.views[block.index]):
        return None
    y = x.clone()
    native.set_stream_prefetch(prog.stream)
    ops.run(DecodeProgram.step_args(batch, y))
    return y


def run_packed(prog: DecodeProgram, model, batch, *, borrow: bool = False) -> torch.Tensor | None:
    """The logits [n, vocab] of a decode-only packed batch as the whole-step program (``prog.whole`` set), or None
    when the program cannot take this batch as it is. ``borrow``: a view of the program's buffer (the next step
    overwrites it), not a copy."""
    if not _step_ok(batch, prog.dtype):
        return None
    d = batch.decode
    logits = prog.run(model, batch.tokens, batch.positions, max(host_values(batch.positions)), batch.slot_mapping,
                      d.seq_lens, d.block_tables, d.state_slots)
    return logits if borrow or logits is None else logits.clone()
