"""What a layer's ``lower_decode`` is handed: the builder of the decode program (``kernels/native/program.c``).

A layer kind lowers its own residual sub-layer ``x + mixer(norm(x))`` for the one-token rows of a decode step
(``lower_decode(b, norm, view)``, defined beside the layer; see docs/adding-a-mixer.md): it asks the builder for
scratch buffers and appends ops by name with named fields (:meth:`DecodeBuilder.op`, the table of
``kernels/native/program_ops.py``). The builder also offers the lowerings every layer shares: a linear layer in any
weight format the program takes (:meth:`DecodeBuilder.linear`), the short causal conv (:meth:`causal_conv`), the
float state pools a step updates in place (:meth:`float_pools`). A layer that cannot be lowered (a cache or
weight format the ops do not take) raises ``b.Unsupported`` with a one-line reason; the program then leaves that
layer to its eager forward and the native backends' ``supports()`` show the reason.

This module is the layers' only door to the native library: layers receive a builder and never import it.
"""

from __future__ import annotations

import ctypes

import torch

from ..kernels import native
from ..kernels.native import DTYPE_CODES, program_ops
from ..kernels.native.ops import ACTIVATIONS
from ..kernels.projection import int4_layout_refusal, int4pack_block
from ..quantize import int4_blocks, int8_rows, q_operands

FLOATS = (torch.float32, torch.bfloat16)
X = object()  # an op argument standing for the step's residual stream (program.c's HL_STEP_X)


class HlOp(ctypes.Structure):
    """program.c's HlOp: an op kind and its fields in slots, named by kernels/native/program_ops.py (both sides)."""
    _fields_ = [("kind", ctypes.c_int64), ("p", ctypes.c_void_p * program_ops.PTRS),
                ("i", ctypes.c_int64 * program_ops.INTS), ("f", ctypes.c_double * program_ops.FLOATS)]


class HlStep(ctypes.Structure):
    _fields_ = [("n", ctypes.c_int64), ("x", ctypes.c_void_p), ("kv_slots", ctypes.c_void_p),
                ("seq_lens", ctypes.c_void_p), ("tables", ctypes.c_void_p), ("tstride", ctypes.c_int64),
                ("state_slots", ctypes.c_void_p), ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p),
                # the gathers program.c does before its first op when these are set (see its HlStep)
                ("tokens", ctypes.c_void_p), ("embed", ctypes.c_void_p), ("embed_row_bytes", ctypes.c_int64),
                ("vocab", ctypes.c_int64), ("positions", ctypes.c_void_p), ("cos_table", ctypes.c_void_p),
                ("sin_table", ctypes.c_void_p), ("rope_row_bytes", ctypes.c_int64), ("table_rows", ctypes.c_int64)]


class Unsupported(Exception):
    """This layer (or cache) is outside what the program's ops take; the message says why."""


def plain(*tensors) -> bool:
    """Every tensor None or a plain contiguous fp32/bf16 tensor (what the ops read by pointer)."""
    return all(t is None or (type(t) in (torch.Tensor, torch.nn.Parameter) and t.is_contiguous()
                             and t.dtype in FLOATS) for t in tensors)


def code(t) -> int:
    """The dtype code of ``t`` (program_ops' ``*dt`` fields), -1 for None."""
    return -1 if t is None else DTYPE_CODES[t.dtype]


class DecodeBuilder:
    """Collects a program's ops, the scratch buffers they write (MAX_ROWS rows each) and every tensor they point
    at (kept alive, and checked before each run that it still is what the program bound). ``X`` stands for the
    step's residual stream; ``dtype`` / ``dt`` are the model's activation dtype and its code."""

    X = X
    Unsupported = Unsupported
    plain = staticmethod(plain)
    code = staticmethod(code)
    int4_block = staticmethod(lambda: int4pack_block())  # (looked up per call: tests pick another block)

    def __init__(self, dtype: torch.dtype):
        self.dtype, self.dt, self.ops, self.bound, self.buffers = dtype, DTYPE_CODES[dtype], [], {}, {}

    @staticmethod
    def act(name: str) -> int:
        """The activation code of ``name`` (the fused ops' ``act``; ``act1`` is this plus one, 0 for none)."""
        return ACTIVATIONS[name]

    def buffer(self, width: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A scratch buffer [MAX_ROWS, width] (the model dtype unless told) the program's ops write."""
        t = torch.zeros(native.MAX_ROWS, width, dtype=dtype or self.dtype)
        self.buffers[t.data_ptr()] = t
        return t

    def op(self, kind: str, **fields) -> None:
        """One op of ``kind`` (a name of kernels/native/program_ops.py: "GEMV", ...) with every one of its fields
        by name: tensors (or None, or X) for its pointers, ints, floats."""
        spec = program_ops.BY_NAME[kind]
        ptrs, ints, floats = program_ops.pack_slots(spec, fields)
        o = HlOp(kind=spec.code)
        for k, t in enumerate(ptrs):
            if t is X:
                o.p[k] = 1
            elif t is not None:
                if t.device.type != "cpu":
                    raise Unsupported("not on the CPU")
                o.p[k] = t.data_ptr()
                if t.untyped_storage().data_ptr() not in self.buffers:  # a weight or pool, not our scratch
                    self.bound.setdefault(id(t), t)
        for k, v in enumerate(ints):
            o.i[k] = int(v)
        for k, v in enumerate(floats):
            o.f[k] = float(v)
        self.ops.append(o)

    # ---- weight formats ----------------------------------------------------------------------
    @staticmethod
    def weight(linear) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight, None) of a plain float linear layer, (int8 codes, row scales) of a torchao int8 one."""
        w = linear.weight
        if plain(w):
            return w, None
        rows = int8_rows(w)
        if rows is None:
            raise Unsupported(f"a {type(w).__name__} weight")
        return rows

    @staticmethod
    def int4(linear) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """(int4pack codes, scale_and_zero, group) of a torchao CPU int4 weight-only layer, else None."""
        blocks = int4_blocks(linear.weight)
        if blocks is not None and not (blocks[0].is_contiguous() and blocks[1].is_contiguous()):
            raise Unsupported("int4 codes not contiguous")
        why = int4_layout_refusal() if blocks is not None else None
        if why is not None:
            raise Unsupported(why)
        return blocks

    @staticmethod
    def q(linear) -> tuple | None:
        """(kind, codes or nibbles, scales) of a torchao int8dq / 8da4w layer (:func:`hybrid.quantize.q_operands`),
        else None."""
        ops = q_operands(linear.weight)
        return None if ops is None else ops[:3]

    # ---- shared lowerings --------------------------------------------------------------------
    def linear(self, linear, x, y, *, residual=None, act: str | None = None) -> None:
        """``y = act(linear(x)) (+ residual)`` in whichever of the weight formats the program takes."""
        if not plain(linear.bias):
            raise Unsupported("a bias of another dtype")
        act1 = 0 if act is None else ACTIVATIONS[act] + 1
        qops = self.q(linear)
        if qops is not None:
            kind, w, ws = qops
            self.op("GEMV_Q", w=w, ws=ws, bias=linear.bias, x=x, res=residual, y=y, qkind=kind,
                    bdt=code(linear.bias), xdt=self.dt, ydt=self.dt, N=w.shape[0], K=linear.in_features, act1=act1)
            return
        blocks = self.int4(linear)
        if blocks is not None:
            q, sz, group = blocks
            self.op("GEMV_INT4", q=q, sz=sz, bias=linear.bias, x=x, res=residual, y=y, sdt=code(sz), G=group,
                    bdt=code(linear.bias), xdt=self.dt, ydt=self.dt, N=q.shape[0], K=linear.in_features, act1=act1,
                    bn=int4pack_block())
            return
        w, scale = self.weight(linear)
        N, K = w.shape
        self.op("GEMV", w=w, scale=scale, bias=linear.bias, x=x, res=residual, y=y, wdt=code(w),
                bdt=code(linear.bias), xdt=self.dt, ydt=self.dt, N=N, K=K, act1=act1)

    def norm(self, norm, x, y) -> None:
        """A pre-norm (the norm module's own ``lower_decode``), rows x -> y."""
        lower = getattr(norm, "lower_decode", None)
        if lower is None:
            raise Unsupported(f"a {type(norm).__name__} (no lower_decode)")
        lower(self, x, y)

    def float_pools(self, view, names) -> list:
        """The state pools ``names`` of a constant-state layer's view, plain float rows only (the native steps update
        them in place; anything else, e.g. an int8 or stochastic-rounded pool, steps the eager way)."""
        pools = [view[n] for n in names]
        if any(getattr(p, "quantized", True) or getattr(p, "stochastic", True) or p.data.dtype not in FLOATS
               or not p.data.is_contiguous() for p in pools):
            raise Unsupported("a quantised or stochastic-rounded state pool")
        return pools

    def causal_conv(self, conv, pool, x, width: int, y) -> None:
        """The short causal depthwise conv (SiLU) of a decode step over ``conv``'s state ``pool``: x's first
        conv_dim channels (rows ``width`` apart) -> y."""
        w = conv.weight[:, 0]
        if not plain(w, conv.bias):
            raise Unsupported("the conv's parameters")
        self.op("CONV", state=pool.data, x=x, w=w, bias=conv.bias, y=y, sdt=code(pool.data), xdt=self.dt,
                xs=width, wdt=code(w), bdt=code(conv.bias), silu=1, C=w.shape[0], K=w.shape[-1])

    def block(self, block, view) -> None:
        """A model block's ops: its mixer's ``lower_decode(builder, norm, view)``."""
        lower = getattr(block.mixer, "lower_decode", None)
        if lower is None:
            raise Unsupported(f"{type(block.mixer).__name__} has no lower_decode (docs/adding-a-mixer.md)")
        lower(self, block.norm, view)
