"""A decode step's residual sub-layers as a few native calls each (``x + mixer(norm(x))`` for the one-token rows
of a decode-only step), for the layer kinds and cache layouts the native kernels cover; anything else runs
the layers' eager forward, which computes the same thing.

Why: a decode step reads every weight once, and on a CPU that takes a few milliseconds (llama-d512: 221 MB at
~28 GB/s, 7.9 ms). The eager layers spend as long again between the products — about 25 torch ops per
sub-layer, each a few microseconds of dispatch, several an OpenMP fork/join — which no faster matrix-vector
product can win back. Here an attention sub-layer is four calls (norm; q/k/v with RoPE and the K/V write in
one pass over the three matrices; paged attention; out-projection with the residual), a gated MLP three, a
Mamba-2 layer seven; each mirrors the rounding points of the torch ops it replaces (tests hold the two paths
to each other, and both to the full forward).

Covered: attention over fp32/bf16 K/V pools (no int8/fp8 pages, no StreamingLLM/SnapKV pruning), gated or
plain MLPs, Mamba-2 with fp32/bf16 state pools (no int8 or stochastic-rounded state); fp32 or bf16 models, up
to 16 decoding sequences (past that the products are compute-bound GEMMs, torch's). ``HYBRID_BACKEND=torch``
turns it off with every other native op.
"""

from __future__ import annotations

import torch

from .. import kernels
from ..kernels import dispatch, native
from ..kernels.native import ops
from ..quantize import int8_rows
from .attention import Attention
from .mamba2 import Mamba2
from .mlp import MLP
from .norm import GatedRMSNorm, RMSNorm

_FLOATS = (torch.float32, torch.bfloat16)


def _plain(*tensors) -> bool:
    return all(t is None or (type(t) in (torch.Tensor, torch.nn.Parameter) and t.is_contiguous()
                             and t.dtype in _FLOATS) for t in tensors)


def _weight(linear) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight, None) of a plain float linear layer, (int8 codes, row scales) of a torchao int8 one, else None."""
    w = linear.weight
    if _plain(w):
        return w, None
    return int8_rows(w)


def _attention(block, x, batch, view):
    attn, d = block.mixer, batch.decode
    if view.k_scale is not None or view.sinks is not None or view.observe is not None or view.renumber:
        return None  # quantised pages or a pruning policy: the eager layer
    k_pool, v_pool = view.k_pool, view.v_pool
    if k_pool.dtype not in _FLOATS or attn.head_dim > 512:
        return None
    q_, k_, v_, o_ = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
    if not _plain(q_.weight, k_.weight, v_.weight, q_.bias, k_.bias, v_.bias) or \
            len({q_.weight.dtype, k_.weight.dtype, v_.weight.dtype}) != 1:
        return None
    cos, sin = batch.rope if attn.rope.rotary_dim else (None, None)
    h = ops.rmsnorm(x, block.norm.weight, block.norm.eps)
    q = ops.qkv_rope(h, attn, k_pool, v_pool, batch.slot_mapping, cos, sin)
    o = kernels.paged_decode_attention(q, k_pool, v_pool, d.seq_lens, d.block_tables,
                                       window=view.window)
    return o_(o.view(x.shape[0], -1), residual=x)


def _mlp(block, x, batch, view):
    m = block.mixer
    h = ops.rmsnorm(x, block.norm.weight, block.norm.eps)
    gate, up = (_weight(m.gate_proj), _weight(m.up_proj)) if m.gate_proj is not None else (None, None)
    if gate is not None and up is not None and gate[0].dtype == up[0].dtype \
            and _plain(m.gate_proj.bias, m.up_proj.bias):
        a = ops.gated_up(h, gate, up, m.gate_proj.bias, m.up_proj.bias, m.activation)
    elif m.gate_proj is not None:
        a = m.act(m.gate_proj(h)) * m.up_proj(h)
    else:
        a = m.act(m.up_proj(h))
    return m.down_proj(a, residual=x)


def _mamba2(block, x, batch, view):
    m, d = block.mixer, batch.decode
    pools = conv_pool, ssm_pool = view["conv"], view["ssm"]
    # a plain float pool only (anything else, e.g. a study's stand-in codec pool, steps the eager way)
    if any(getattr(p, "quantized", True) or getattr(p, "stochastic", True) or p.data.dtype not in _FLOATS
           for p in pools) or \
            not isinstance(m.norm, GatedRMSNorm) or m.d_inner // m.norm.groups > 8192:
        return None
    n = x.shape[0]
    h = ops.rmsnorm(x, block.norm.weight, block.norm.eps)
    z, xBC, dt_raw = m.split_projection(m.in_proj(h))
    xBC = kernels.causal_conv1d_step(conv_pool.data, xBC, m.conv1d.weight[:, 0], m.conv1d.bias, activation="silu",
                                     slots=d.state_slots)
    xs, B, C = m.split_xBC(xBC)
    dt, A = ops.mamba2_dt(dt_raw, m)
    y = kernels.ssd_step(ssm_pool.data, xs, dt, A, B, C, D=m.D, slots=d.state_slots)
    y = ops.gated_rmsnorm(y.view(n, m.d_inner), z, m.norm)
    return m.out_proj(y, residual=x)


_SUBLAYERS = {Attention: _attention, MLP: _mlp, Mamba2: _mamba2}


def _fused(block, x, batch, cache):
    fn = _SUBLAYERS.get(type(block.mixer))
    if fn is None or type(block.norm) is not RMSNorm or x.dtype not in _FLOATS or not x.is_contiguous() \
            or x.shape[0] > native.MAX_ROWS or x.device.type != "cpu" or torch.is_grad_enabled() \
            or torch.compiler.is_compiling():
        return None
    return fn(block, x, batch, cache.view(block.index) if block.caches else None)


def _eager(block, x, batch, cache):
    return None


def sublayer(block, x: torch.Tensor, batch, cache) -> torch.Tensor | None:
    """``x + mixer(norm(x))`` of ``block`` for a decode-only step's rows x [n, d_model], or None when the fused
    path does not cover this layer or cache (the caller then runs the layer's own forward)."""
    _, fn = dispatch.choose("decode_sublayer", x.device.type)
    return fn(block, x, batch, cache)


dispatch.register("decode_sublayer", "torch", _eager)
dispatch.register("decode_sublayer", "native", _fused, native.available)
