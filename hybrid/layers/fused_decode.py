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
``HYBRID_BACKEND=torch`` turns it all off.
"""

from __future__ import annotations

import ctypes
import weakref

import torch

from ..kernels import dispatch, host_memory, native
from ..kernels.native import DTYPE_CODES, program_ops
from ..kernels.native.ops import ACTIVATIONS
from ..kernels.packing import host_values
from ..kernels.projection import int4_layout_refusal, int4pack_block
from ..quantize import decode_bytes, int4_blocks, int8_rows, q_operands
from .attention import Attention
from .gated_deltanet import GatedDeltaNet
from .gla import GLA
from .mamba2 import Mamba2
from .mlp import MLP
from .norm import GatedRMSNorm, RMSNorm

_FLOATS = (torch.float32, torch.bfloat16)
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


class _Unsupported(Exception):
    """This layer (or cache) is outside what the program covers; the message says why."""


def _plain(*tensors) -> bool:
    return all(t is None or (type(t) in (torch.Tensor, torch.nn.Parameter) and t.is_contiguous()
                             and t.dtype in _FLOATS) for t in tensors)


def _code(t) -> int:
    return -1 if t is None else DTYPE_CODES[t.dtype]


class _Builder:
    """Collects a program's ops, the scratch buffers they write (MAX_ROWS rows each) and every tensor they point
    at (kept alive, and checked before each run that it still is what the program bound)."""

    def __init__(self, dtype: torch.dtype):
        self.dtype, self.ops, self.bound, self.buffers = dtype, [], {}, {}

    def buffer(self, width: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        t = torch.zeros(native.MAX_ROWS, width, dtype=dtype or self.dtype)
        self.buffers[t.data_ptr()] = t
        return t

    def weight(self, linear) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight, None) of a plain float linear layer, (int8 codes, row scales) of a torchao int8 one."""
        w = linear.weight
        if _plain(w):
            return w, None
        rows = int8_rows(w)
        if rows is None:
            raise _Unsupported(f"a {type(w).__name__} weight")
        return rows

    @staticmethod
    def int4(linear) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """(int4pack codes, scale_and_zero, group) of a torchao CPU int4 weight-only layer, else None."""
        blocks = int4_blocks(linear.weight)
        if blocks is not None and not (blocks[0].is_contiguous() and blocks[1].is_contiguous()):
            raise _Unsupported("int4 codes not contiguous")
        why = int4_layout_refusal() if blocks is not None else None
        if why is not None:
            raise _Unsupported(why)
        return blocks

    @staticmethod
    def q(linear) -> tuple | None:
        """(kind, codes or nibbles, scales) of a torchao int8dq / 8da4w layer (:func:`hybrid.quantize.q_operands`),
        else None."""
        ops = q_operands(linear.weight)
        return None if ops is None else ops[:3]

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
                    raise _Unsupported("not on the CPU")
                o.p[k] = t.data_ptr()
                if t.untyped_storage().data_ptr() not in self.buffers:  # a weight or pool, not our scratch
                    self.bound.setdefault(id(t), t)
        for k, v in enumerate(ints):
            o.i[k] = int(v)
        for k, v in enumerate(floats):
            o.f[k] = float(v)
        self.ops.append(o)

    def rmsnorm(self, norm, x, y) -> None:
        if type(norm) is not RMSNorm or norm.offset:
            raise _Unsupported(f"a {type(norm).__name__}" + (f" with offset {norm.offset}" if norm.offset else ""))
        d = norm.weight.shape[0]
        self.op("RMSNORM", x=x, w=norm.weight, y=y, xdt=DTYPE_CODES[self.dtype], wdt=_code(norm.weight), d=d,
                eps=norm.eps)

    def gemv(self, linear, x, y, *, residual=None, act: str | None = None) -> None:
        if not _plain(linear.bias):
            raise _Unsupported("a bias of another dtype")
        act1 = 0 if act is None else ACTIVATIONS[act] + 1
        qops = self.q(linear)
        if qops is not None:
            kind, w, ws = qops
            dt = DTYPE_CODES[self.dtype]
            self.op("GEMV_Q", w=w, ws=ws, bias=linear.bias, x=x, res=residual, y=y, qkind=kind,
                    bdt=_code(linear.bias), xdt=dt, ydt=dt, N=w.shape[0], K=linear.in_features, act1=act1)
            return
        blocks = self.int4(linear)
        if blocks is not None:
            q, sz, group = blocks
            dt = DTYPE_CODES[self.dtype]
            self.op("GEMV_INT4", q=q, sz=sz, bias=linear.bias, x=x, res=residual, y=y, sdt=_code(sz), G=group,
                    bdt=_code(linear.bias), xdt=dt, ydt=dt, N=q.shape[0], K=linear.in_features, act1=act1,
                    bn=int4pack_block())
            return
        w, scale = self.weight(linear)
        N, K = w.shape
        dt = DTYPE_CODES[self.dtype]
        self.op("GEMV", w=w, scale=scale, bias=linear.bias, x=x, res=residual, y=y, wdt=_code(w),
                bdt=_code(linear.bias), xdt=dt, ydt=dt, N=N, K=K, act1=act1)


def _attention(b: _Builder, block, view) -> None:
    attn = block.mixer
    if attn.cfg.output_gate or attn.cfg.qk_norm:
        raise _Unsupported("gated attention or q/k norms")
    if view.k_scale is not None or view.sinks is not None or view.observe is not None or view.renumber:
        raise _Unsupported("quantised K/V pages or a pruning policy")
    k_pool, v_pool = view.k_pool, view.v_pool
    if k_pool.dtype not in _FLOATS or v_pool.dtype != k_pool.dtype or attn.head_dim > 512 \
            or attn.n_heads % attn.n_kv_heads or attn.n_heads // attn.n_kv_heads > 64:
        raise _Unsupported(f"a {k_pool.dtype} pool or head layout")
    rot = attn.rope.rotary_dim
    if rot % 2 or rot > attn.head_dim:
        raise _Unsupported(f"rotary_dim {rot}")
    q_, k_, v_ = attn.q_proj, attn.k_proj, attn.v_proj
    qops = [b.q(m) for m in (q_, k_, v_)]
    if any(t is not None for t in qops):
        _attention_q(b, block, view, qops)
        return
    int4 = [b.int4(m) for m in (q_, k_, v_)]
    if any(t is not None for t in int4):
        _attention_int4(b, block, view, int4)
        return
    (wq, sq), (wk, sk), (wv, sv) = b.weight(q_), b.weight(k_), b.weight(v_)
    if len({wq.dtype, wk.dtype, wv.dtype}) != 1 or not _plain(q_.bias, k_.bias, v_.bias) \
            or len({t.dtype for t in (q_.bias, k_.bias, v_.bias) if t is not None}) > 1:
        raise _Unsupported("q/k/v weights of different dtypes")
    _attention_ops(b, block, view, "QKV_ROPE", dict(wq=wq, bq=q_.bias, wk=wk, bk=k_.bias, wv=wv, bv=v_.bias, sq=sq,
                                                    sk=sk, sv=sv, wdt=_code(wq)))


def _attention_ops(b: _Builder, block, view, qkv_kind: str, weights: dict) -> None:
    """An attention sub-layer's ops once its q/k/v weights are vetted: the norm, the q/k/v product of
    ``qkv_kind`` (``weights``: its weight fields, each weight format's own) with RoPE and the K/V write, paged
    attention, the out-projection with the residual."""
    attn = block.mixer
    k_pool, v_pool = view.k_pool, view.v_pool
    d_model, Hq, Hkv, D = attn.q_proj.in_features, attn.n_heads, attn.n_kv_heads, attn.head_dim
    dt = DTYPE_CODES[b.dtype]
    h, q, o = b.buffer(d_model), b.buffer(Hq * D), b.buffer(Hq * D)
    b.rmsnorm(block.norm, X, h)
    b.op(qkv_kind, **weights, x=h, q_out=q, kpool=k_pool, vpool=v_pool, bdt=_code(attn.q_proj.bias), xdt=dt,
         pdt=_code(k_pool), rot=attn.rope.rotary_dim, Hq=Hq, Hkv=Hkv, D=D, K=d_model)
    b.op("PAGED", q=q, k=k_pool, v=v_pool, out=o, qdt=dt, kvdt=_code(k_pool), Hq=Hq, Hkv=Hkv, D=D,
         BS=k_pool.shape[1], window=view.window or 0, scale=D ** -0.5)
    b.gemv(attn.o_proj, o, X, residual=X)


def _same_biases(attn) -> None:
    biases = (attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias)
    if not _plain(*biases) or len({t.dtype for t in biases if t is not None}) > 1:
        raise _Unsupported("q/k/v biases of different dtypes")


def _attention_int4(b: _Builder, block, view, int4) -> None:
    """_attention's ops for int4 q/k/v weights (all three int4, one group and scale dtype, head_dim a multiple of
    16: the int4pack layout's granularity)."""
    attn = block.mixer
    if any(t is None for t in int4) or len({(t[1].dtype, t[2]) for t in int4}) != 1 or attn.head_dim % 16:
        raise _Unsupported("q/k/v not all int4 of one group, or a head_dim not a multiple of 16")
    _same_biases(attn)
    (qq, szq, group), (qk, szk, _), (qv, szv, _) = int4
    _attention_ops(b, block, view, "QKV_ROPE_INT4",
                   dict(qq=qq, szq=szq, bq=attn.q_proj.bias, qk=qk, szk=szk, bk=attn.k_proj.bias, qv=qv, szv=szv,
                        bv=attn.v_proj.bias, sdt=_code(szq), G=group, bn=int4pack_block()))


def _attention_q(b: _Builder, block, view, qops) -> None:
    """_attention's ops for int8dq / 8da4w q/k/v weights (all three of one kind): the input row quantised once for
    the three products, RoPE and the K/V write as for float weights."""
    attn = block.mixer
    if any(t is None for t in qops) or len({t[0] for t in qops}) != 1:
        raise _Unsupported("q/k/v not all int8dq or all 8da4w")
    _same_biases(attn)
    (kind, wq, sq), (_, wk, sk), (_, wv, sv) = qops
    _attention_ops(b, block, view, "QKV_ROPE_Q",
                   dict(wq=wq, sq=sq, bq=attn.q_proj.bias, wk=wk, sk=sk, bk=attn.k_proj.bias, wv=wv, sv=sv,
                        bv=attn.v_proj.bias, qkind=kind))


def _mlp(b: _Builder, block, view) -> None:
    m = block.mixer
    d_model, d_ff = m.up_proj.weight.shape[1], m.up_proj.weight.shape[0]
    h, a = b.buffer(d_model), b.buffer(d_ff)
    b.rmsnorm(block.norm, X, h)
    if m.gate_proj is None:
        b.gemv(m.up_proj, h, a, act=m.activation)
    elif b.q(m.gate_proj) is not None or b.q(m.up_proj) is not None:
        gq, uq = b.q(m.gate_proj), b.q(m.up_proj)
        if gq is None or uq is None or gq[0] != uq[0] or not _plain(m.gate_proj.bias, m.up_proj.bias):
            raise _Unsupported("gate/up weights not both int8dq or both 8da4w")
        b.op("GATED_UP_Q", wg=gq[1], sg=gq[2], bg=m.gate_proj.bias, wu=uq[1], su=uq[2], bu=m.up_proj.bias, x=h, y=a,
             qkind=gq[0], bdt=_code(m.up_proj.bias), xdt=DTYPE_CODES[b.dtype], act=ACTIVATIONS[m.activation],
             N=d_ff, K=d_model)
    elif b.int4(m.gate_proj) is not None or b.int4(m.up_proj) is not None:
        g4, u4 = b.int4(m.gate_proj), b.int4(m.up_proj)
        if g4 is None or u4 is None or (g4[1].dtype, g4[2]) != (u4[1].dtype, u4[2]) \
                or not _plain(m.gate_proj.bias, m.up_proj.bias):
            raise _Unsupported("gate/up weights not both int4 of one group")
        b.op("GATED_UP_INT4", qg=g4[0], szg=g4[1], bg=m.gate_proj.bias, qu=u4[0], szu=u4[1], bu=m.up_proj.bias,
             x=h, y=a, sdt=_code(g4[1]), G=g4[2], bdt=_code(m.up_proj.bias), xdt=DTYPE_CODES[b.dtype],
             act=ACTIVATIONS[m.activation], N=d_ff, K=d_model, bn=int4pack_block())
    else:
        (wg, sg), (wu, su) = b.weight(m.gate_proj), b.weight(m.up_proj)
        if wg.dtype != wu.dtype or not _plain(m.gate_proj.bias, m.up_proj.bias):
            raise _Unsupported("gate/up weights of different dtypes")
        b.op("GATED_UP", wg=wg, sg=sg, bg=m.gate_proj.bias, wu=wu, su=su, bu=m.up_proj.bias, x=h, y=a,
             wdt=_code(wu), bdt=_code(m.up_proj.bias), xdt=DTYPE_CODES[b.dtype], act=ACTIVATIONS[m.activation],
             N=d_ff, K=d_model)
    b.gemv(m.down_proj, a, X, residual=X)


def _mamba2(b: _Builder, block, view) -> None:
    m = block.mixer
    conv_pool, ssm_pool = view["conv"], view["ssm"]
    # a plain float pool only (anything else, e.g. a study's stand-in codec pool, steps the eager way)
    if any(getattr(p, "quantized", True) or getattr(p, "stochastic", True) or p.data.dtype not in _FLOATS
           or not p.data.is_contiguous() for p in (conv_pool, ssm_pool)):
        raise _Unsupported("a quantised or stochastic-rounded state pool")
    if not isinstance(m.norm, GatedRMSNorm) or m.d_inner // m.norm.groups > 8192 or m.d_state > 512 \
            or m.n_heads % m.n_groups:
        raise _Unsupported("the gated norm or state layout")
    conv_w = m.conv1d.weight[:, 0]
    if not _plain(conv_w, m.conv1d.bias, m.dt_bias, m.A_log, m.D, m.norm.weight):
        raise _Unsupported("conv / dt / A / D parameters")
    d_model = m.in_proj.weight.shape[1]
    width, conv_dim, H, gn = m.in_proj.weight.shape[0], m.cfg.conv_dim, m.n_heads, m.n_groups * m.d_state
    dt = DTYPE_CODES[b.dtype]
    h, zxbcdt, xbc = b.buffer(d_model), b.buffer(width), b.buffer(conv_dim)
    dt_out, A = b.buffer(H, torch.float32), b.buffer(H, torch.float32)
    y, g = b.buffer(m.d_inner), b.buffer(m.d_inner)
    b.rmsnorm(block.norm, X, h)
    b.gemv(m.in_proj, h, zxbcdt)
    xbc_in = zxbcdt[:, m.d_inner:]  # z | xBC | dt rows of in_proj's output, read with its row stride
    b.op("CONV", state=conv_pool.data, x=xbc_in, w=conv_w, bias=m.conv1d.bias, y=xbc, sdt=_code(conv_pool.data),
         xdt=dt, xs=width, wdt=_code(conv_w), bdt=_code(m.conv1d.bias), silu=1, C=conv_dim, K=conv_w.shape[-1])
    lo, hi = m.cfg.dt_limit
    clamp = lo > 0.0 or hi != float("inf")
    b.op("DT", dt_raw=zxbcdt[:, m.d_inner + conv_dim:], dt_bias=m.dt_bias, A_log=m.A_log, dt_out=dt_out, A_out=A,
         xdt=dt, dts=width, bdt=_code(m.dt_bias), adt=_code(m.A_log), clamp=int(clamp), H=H, lo=lo,
         hi=min(hi, 3.0e38))
    b.op("SSD", state=ssm_pool.data, x=xbc, dt=dt_out, A=A, B=xbc[:, m.d_inner:], C=xbc[:, m.d_inner + gn:], Dp=m.D,
         y=y, sdt=_code(ssm_pool.data), xdt=dt, xs=conv_dim, dts=H, bs=conv_dim, cs=conv_dim, ddt=_code(m.D), H=H,
         P=m.head_dim, N=m.d_state, G=m.n_groups)
    b.op("GATED_RMSNORM", y=y, z=zxbcdt, w=m.norm.weight, out=g, zs=width, dt=dt, wdt=_code(m.norm.weight),
         groups=m.norm.groups, norm_before_gate=int(m.norm.norm_before_gate), d=m.d_inner, eps=m.norm.eps)
    b.gemv(m.out_proj, g, X, residual=X)


def _float_pools(view, names) -> list:
    """The state pools ``names`` of a constant-state layer's view, plain float rows only (the native steps update
    them in place; anything else, e.g. an int8 or stochastic-rounded pool, steps the eager way)."""
    pools = [view[n] for n in names]
    if any(getattr(p, "quantized", True) or getattr(p, "stochastic", True) or p.data.dtype not in _FLOATS
           or not p.data.is_contiguous() for p in pools):
        raise _Unsupported("a quantised or stochastic-rounded state pool")
    return pools


def _conv(b: _Builder, conv, pool, x, width: int, y) -> None:
    """The short causal conv (SiLU) of a decode step: x's first conv_dim channels (rows ``width`` apart) -> y."""
    w = conv.weight[:, 0]
    if not _plain(w, conv.bias):
        raise _Unsupported("the conv's parameters")
    b.op("CONV", state=pool.data, x=x, w=w, bias=conv.bias, y=y, sdt=_code(pool.data), xdt=DTYPE_CODES[b.dtype],
         xs=width, wdt=_code(w), bdt=_code(conv.bias), silu=1, C=w.shape[0], K=w.shape[-1])


def _head_norm(b: _Builder, norm, o, z, width: int, H: int, V: int, y) -> None:
    """The per-head output norm (one [V] weight shared by the heads) of o [n, H V]: GatedRMSNorm(V,
    norm_before_gate) by silu(z) (z's rows ``width`` apart), or a plain RMSNorm(V) when z is None."""
    gated = z is not None
    if gated and not (type(norm) is GatedRMSNorm and norm.norm_before_gate and norm.groups == 1):
        raise _Unsupported("an output norm other than a per-head GatedRMSNorm(norm_before_gate)")
    if not gated and not (type(norm) is RMSNorm and not norm.offset and norm.weight.dtype == b.dtype):
        raise _Unsupported("an output norm other than a plain per-head RMSNorm in the model dtype")
    if norm.weight.shape != (V,) or not _plain(norm.weight):
        raise _Unsupported(f"an output norm weight of shape {tuple(norm.weight.shape)}")
    b.op("HEAD_NORM", y=o, z=z, w=norm.weight, out=y, ys=H * V, zs=width, dt=DTYPE_CODES[b.dtype],
         wdt=_code(norm.weight), gated=int(gated), H=H, V=V, eps=norm.eps)


def _gated_deltanet(b: _Builder, block, view) -> None:
    m = block.mixer
    conv_pool, rec_pool = _float_pools(view, ("conv", "recurrent"))
    H, Hk, K, V = m.n_heads, m.n_k_heads, m.head_k_dim, m.head_v_dim
    if K > 512 or V > 512:
        raise _Unsupported(f"head dims {K}x{V} (the native step takes up to 512)")
    if not _plain(m.A_log, m.dt_bias):
        raise _Unsupported("A_log / dt_bias parameters")
    d_model, width, conv_dim = m.in_proj.in_features, m.in_proj.out_features, m.cfg.conv_dim
    h, proj, qkv = b.buffer(d_model), b.buffer(width), b.buffer(conv_dim)
    qk, o, y = b.buffer(2 * m.key_dim), b.buffer(m.value_dim), b.buffer(m.value_dim)
    g, beta = b.buffer(H, torch.float32), b.buffer(H, torch.float32)
    b.rmsnorm(block.norm, X, h)
    b.gemv(m.in_proj, h, proj)  # q | k | v | z | b | a
    _conv(b, m.conv1d, conv_pool, proj, width, qkv)
    b.op("GDN", state=rec_pool.data, qkv=qkv, ba=proj[:, conv_dim + m.value_dim:], A_log=m.A_log, dt_bias=m.dt_bias,
         qk=qk, g=g, beta=beta, y=o, sdt=_code(rec_pool.data), xdt=DTYPE_CODES[b.dtype], qkv_s=conv_dim, ba_s=width,
         adt=_code(m.A_log), bdt=_code(m.dt_bias), H=H, Hk=Hk, K=K, V=V,
         eps=1e-6, scale=K ** -0.5)  # kernels.gated_delta.l2norm's eps; the step's default scale
    _head_norm(b, m.norm, o, proj[:, conv_dim:], width, H, V, y)
    b.gemv(m.out_proj, y, X, residual=X)


def _gla(b: _Builder, block, view) -> None:
    m = block.mixer
    c = m.cfg
    pools = _float_pools(view, ("conv", "recurrent") if m.conv1d is not None else ("recurrent",))
    H, Hkv, K, V, R = m.n_heads, c.n_kv_heads, m.head_k_dim, m.head_v_dim, c.gate_low_rank_dim
    if V > 512 or c.feature_map is not None or c.gate_fn != "swish":
        raise _Unsupported(f"head_v_dim {V} (the native step takes up to 512), or a feature map / gate function")
    if b.int4(m.gk_proj) is not None or not _plain(m.gk_proj.bias):
        raise _Unsupported("an int4 (or oddly typed) decay-gate projection")
    wg, sg = b.weight(m.gk_proj)
    d_model, width = m.in_proj.in_features, m.in_proj.out_features
    h, proj = b.buffer(d_model), b.buffer(width)
    low, gk, gf = b.buffer(R), b.buffer(c.kv_key_dim), b.buffer(c.kv_key_dim, torch.float32)
    o, y = b.buffer(c.value_dim), b.buffer(c.value_dim)
    b.rmsnorm(block.norm, X, h)
    b.gemv(m.in_proj, h, proj)  # q | k | v | g | gk_low
    qkv, stride = proj, width
    if m.conv1d is not None:
        qkv, stride = b.buffer(c.conv_dim), c.conv_dim
        _conv(b, m.conv1d, pools[0], proj, width, qkv)
    clamp = c.clamp_min is not None
    b.op("GLA", state=pools[-1].data, qkv=qkv, low=proj[:, c.conv_dim + m.gate_dim:], low_buf=low, w=wg, wscale=sg,
         bias=m.gk_proj.bias, gk=gk, g=gf, y=o, sdt=_code(pools[-1].data), xdt=DTYPE_CODES[b.dtype], qkv_s=stride,
         low_s=width, wdt=_code(wg), bdt=_code(m.gk_proj.bias), R=R, H=H, Hkv=Hkv, K=K, V=V, clamp=int(clamp),
         normalizer=c.gate_logit_normalizer, clamp_min=c.clamp_min if clamp else 0.0)
    _head_norm(b, m.norm, o, proj[:, c.conv_dim:] if m.gate_dim else None, width, H, V, y)
    b.gemv(m.out_proj, y, X, residual=X)


_EMITTERS = {Attention: _attention, MLP: _mlp, Mamba2: _mamba2, GatedDeltaNet: _gated_deltanet, GLA: _gla}


def _check_abi() -> None:
    lib = native.library()
    want = ctypes.sizeof(HlOp) * 1000 + ctypes.sizeof(HlStep)
    if lib.hl_program_abi() != want:
        raise RuntimeError(f"kernels/native/program.c's HlOp/HlStep ({lib.hl_program_abi()}) differ from their "
                           f"ctypes mirrors in {__name__} ({want}): the two must change together")


class _Ops:
    """The ops of one or more builders, in order, as program.c takes them, and what they must find unchanged to
    run (their scratch buffers are kept here: the ops point into them)."""

    def __init__(self, *builders: _Builder):
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
            emit = _EMITTERS.get(type(block.mixer))
            try:
                if emit is None:
                    raise _Unsupported(f"no native ops for {type(block.mixer).__name__}")
                own = _Builder(self.dtype)
                emit(own, block, view)
                built.append(own)
                self.blocks.append(_Ops(own))
                self.why.append(None)
            except _Unsupported as e:
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
            whole = _Builder(self.dtype)
            try:
                self.logits = whole.buffer(self.vocab)
                h = whole.buffer(self.d_model)
                whole.rmsnorm(model.norm_f, X, h)
                head = model.lm_head
                if head is None:  # tied embeddings
                    if not _plain(model.embed.weight):
                        raise _Unsupported("the tied embedding's weight")
                    N, K = model.embed.weight.shape
                    dt = DTYPE_CODES[self.dtype]
                    whole.op("GEMV", w=model.embed.weight, scale=None, bias=None, x=h, res=None, y=self.logits,
                             wdt=dt, bdt=-1, xdt=dt, ydt=dt, N=N, K=K, act1=0)
                else:
                    whole.gemv(head, h, self.logits)
                self.whole = _Ops(*built, whole)
            except _Unsupported as e:
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
            and batch.tokens.device.type == "cpu" and not torch.is_grad_enabled() and dtype in _FLOATS
            and all(t.dtype == torch.int64 and t.is_contiguous() and t.shape[0] == d.num_seqs
                    for t in (batch.tokens, batch.positions, batch.slot_mapping, d.state_slots))
            and d.seq_lens.dtype == torch.int32 and d.block_tables.dtype == torch.int32
            and d.block_tables.is_contiguous())


def _batch_ok(batch, x: torch.Tensor) -> bool:
    d = batch.decode
    return (d is not None and batch.prefill is None and x.dtype in _FLOATS and x.is_contiguous()
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


def _fused_sublayer(block, x, batch, cache):
    entry = _programs.get(cache) if cache is not None else None  # (never reached under Dynamo: Block.forward)
    if entry is None or not _batch_ok(batch, x):
        return None
    prog = entry[1]
    ops = prog.blocks[block.index] if block.index < len(prog.blocks) else None
    if ops is None or not ops.valid() or (block.caches and cache.view(block.index) is not prog.views[block.index]):
        return None
    y = x.clone()
    native.set_stream_prefetch(prog.stream)
    ops.run(DecodeProgram.step_args(batch, y))
    return y


def _none(*args):
    return None


def step(model, batch, cache, *, borrow: bool = False) -> torch.Tensor | None:
    """The logits [n, vocab] of a decode-only step's rows as one native program, or
    None when the program does not cover this model, cache or batch: the caller then runs the blocks, and those
    the program covers run their own ops (:func:`sublayer`). ``borrow``: the logits are a view of the
    program's buffer (the next step overwrites it), not a copy."""
    if batch.prefill is not None or batch.decode is None or batch.tokens.device.type != "cpu" \
            or torch.compiler.is_compiling():
        return None  # (a compiled decode graph runs the layers: Inductor's code, not ours)
    prog = whole_program(model, cache)  # (builds the program: the per-block path finds it too)
    if prog is None or not _step_ok(batch, prog.dtype):
        return None
    d = batch.decode
    logits = prog.run(model, batch.tokens, batch.positions, max(host_values(batch.positions)), batch.slot_mapping,
                      d.seq_lens, d.block_tables, d.state_slots)
    return logits if borrow or logits is None else logits.clone()


def whole_program(model, cache) -> DecodeProgram | None:
    """The program that runs a whole CPU decode step of ``model`` over ``cache`` (:meth:`DecodeProgram.run`), or
    None where it does not cover them or the native backend is not the one chosen (the caller runs the layers).
    Builds the program on first use, so that the blocks it covers find their own ops when it cannot run whole."""
    if torch.compiler.is_compiling() or cache is None or cache.device.type != "cpu":
        return None
    if dispatch.choose("decode_sublayer", "cpu")[1] is _none:
        return None
    prog = program(model, cache)
    return prog if prog.whole is not None else None


def sublayer(block, x: torch.Tensor, batch, cache) -> torch.Tensor | None:
    """``x + mixer(norm(x))`` of ``block`` for a decode-only step's rows x [n, d_model], or None when no program
    covers this layer or cache (the caller then runs the layer's own forward)."""
    _, fn = dispatch.choose("decode_sublayer", x.device.type)
    return fn(block, x, batch, cache)


dispatch.register("decode_sublayer", "torch", _none)
dispatch.register("decode_sublayer", "native", _fused_sublayer, native.available)


def coverage(model, cache) -> list[str | None]:
    """Per block, None when its decode runs as native ops, else why not (then an LM-head line if that failed)."""
    return list(program(model, cache).why)
