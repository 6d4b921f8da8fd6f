"""Causal GQA attention over a padded-free batch of equal-length sequences (training, scoring).

Layouts follow the model: ``q: [B, L, Hq, D]``, ``k, v: [B, L, Hkv, D]`` with ``Hq % Hkv == 0``.
The packed (varlen) and paged forms used by the inference engine are in ``paged_attention.py``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import cuda_backend, dispatch, triton_support
from .attention_blocked import blocked_causal_attention
from .compute_dtype import matmul_dtype
from .packing import host_values
from .triton_support import INTERPRET, dot_precision, jit, needs_grad, next_pow2, tl, triton

_LOG2E = 1.4426950408889634  # the kernels use exp2: softmax(s) = 2^(s log2 e - max)


def causal_mask(Lq: int, Lk: int, window: int | None, device: torch.device) -> torch.Tensor:
    """Bool mask [Lq, Lk], True where query i (at absolute position Lk - Lq + i) may see key j."""
    qpos = torch.arange(Lk - Lq, Lk, device=device)[:, None]
    kpos = torch.arange(Lk, device=device)[None, :]
    mask = kpos <= qpos
    if window is not None:
        mask &= qpos - kpos < window
    return mask


def causal_attention_ref(q, k, v, *, window=None, scale=None):
    """Naive softmax(QK^T)V with the KV heads repeated; the reference for every backend."""
    B, Lq, Hq, D = q.shape
    rep = Hq // k.shape[2]
    k = k.repeat_interleave(rep, dim=2)
    v = v.repeat_interleave(rep, dim=2)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    s = torch.einsum("blhd,bshd->bhls", q.float(), k.float()) * scale
    s = s.masked_fill(~causal_mask(Lq, k.shape[1], window, q.device), float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.einsum("bhls,bshd->blhd", p, v.float()).to(q.dtype)


def _use_blocked(q, k, v, window) -> bool:
    """The CPU cases SDPA serves badly (:mod:`.attention_blocked`): bf16 where the CPU multiplies it natively
    (SDPA runs it at its fp32 speed), and a window shorter than the keys (SDPA scores every masked pair)."""
    if q.device.type != "cpu" or needs_grad(q, k, v):
        return False
    native_low = q.dtype != torch.float32 and matmul_dtype(q.dtype, q.device) == q.dtype
    return native_low or (window is not None and window < k.shape[1])


def _causal_attention_torch(q, k, v, *, window=None, scale=None):
    if _use_blocked(q, k, v, window):
        return blocked_causal_attention(q, k, v, window=window, scale=scale)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, L, D]
    gqa = q.shape[2] != k.shape[2]
    # SDPA's is_causal aligns the mask top-left; queries that are the last Lq of Lk keys need ours.
    if (window is None or window >= k.shape[1]) and q.shape[1] == k.shape[1]:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        mask = causal_mask(q.shape[1], k.shape[1], window, q.device)
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, window: int | None = None,
                     scale: float | None = None) -> torch.Tensor:
    """Causal (optionally sliding-window) GQA attention.

    q: [B, Lq, Hq, D]; k, v: [B, Lk, Hkv, D] -> [B, Lq, Hq, D], with Lq <= Lk: the queries are the
    last Lq positions (Lq < Lk is a prefill on top of Lk - Lq cached tokens). ``window`` counts
    the query itself.
    """
    if q.dim() != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1] \
            or q.shape[1] > k.shape[1]:
        raise ValueError(f"causal_attention: bad shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"causal_attention: {q.shape[2]} query heads is not a multiple of {k.shape[2]} KV heads")
    _, fn = dispatch.choose("causal_attention", q.device.type)
    return fn(q, k, v, window=window, scale=scale)


dispatch.register("causal_attention", "torch", _causal_attention_torch)


# --- Triton: one flash-attention forward for packed batches, K/V contiguous or paged ---------------
# Grid (query blocks, sequences, query heads). Each program keeps a block of queries in registers and
# streams that sequence's keys in blocks with an online softmax (running max m, running sum l, fp32
# accumulator), visiting only the key blocks the causal mask and window leave: [lo, hi). Keys are
# either rows of contiguous K/V ([T, Hkv, D], sequence b at rows cu_k[b]...) or tokens of a paged
# pool found through the block table, so prefill on top of a cache (chunked prefill) is one launch.
# The queries of sequence b are its last q_len positions of k_len. Forward only.

@jit
def _flash_attn_fwd_kernel(
    Q, K, V, O, cu_q, cu_k, k_lens, block_tables, K_scale, V_scale,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_ot, stride_oh, stride_bt, stride_sb, stride_st, scale_log2, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr, HAS_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr, QUANT: tl.constexpr,
):
    pid_m = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    kvh = h // GROUP
    q_start = tl.load(cu_q + b)
    q_len = tl.load(cu_q + b + 1) - q_start
    if pid_m * BLOCK_M >= q_len:
        return
    if PAGED:
        k_start = 0
        k_len = tl.load(k_lens + b)
    else:
        k_start = tl.load(cu_k + b)
        k_len = tl.load(cu_k + b + 1) - k_start

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_valid = offs_m < q_len
    d_valid = offs_d < HEAD_DIM
    q_pos = k_len - q_len + offs_m  # absolute positions of the queries
    q = tl.load(Q + (q_start + offs_m).to(tl.int64)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=m_valid[:, None] & d_valid[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = tl.minimum(k_len, k_len - q_len + (pid_m + 1) * BLOCK_M)  # past the block's last query
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(0, k_len - q_len + pid_m * BLOCK_M - window + 1) // BLOCK_N * BLOCK_N
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_valid = offs_n < hi
        if PAGED:
            blk = tl.load(block_tables + b * stride_bt + offs_n // PAGE, mask=n_valid, other=0).to(tl.int64)
            k_rows = blk * stride_kb + (offs_n % PAGE) * stride_kt
            v_rows = blk * stride_vb + (offs_n % PAGE) * stride_vt
        else:
            k_rows = (k_start + offs_n).to(tl.int64) * stride_kt
            v_rows = (k_start + offs_n).to(tl.int64) * stride_vt
        kv_mask = n_valid[:, None] & d_valid[None, :]
        k = tl.load(K + k_rows[:, None] + kvh * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        if QUANT:  # paged int8 / fp8 codes times their token's scale (kv_quant), dequantised in registers
            s_rows = blk * stride_sb + (offs_n % PAGE) * stride_st + kvh
            ks = tl.load(K_scale + s_rows, mask=n_valid, other=0.0).to(tl.float32)
            k = (k.to(tl.float32) * ks[:, None]).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        keep = (offs_n[None, :] <= q_pos[:, None]) & n_valid[None, :]
        if HAS_WINDOW:
            keep = keep & (q_pos[:, None] - offs_n[None, :] < window)
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + v_rows[:, None] + kvh * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        if QUANT:
            vs = tl.load(V_scale + s_rows, mask=n_valid, other=0.0).to(tl.float32)
            v = (v.to(tl.float32) * vs[:, None]).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(O + (q_start + offs_m).to(tl.int64)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             acc.to(O.dtype.element_ty), mask=m_valid[:, None] & d_valid[None, :])


def flash_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, *,
                           cu_seqlens_k: torch.Tensor | None = None, seq_lens: torch.Tensor | None = None,
                           block_tables: torch.Tensor | None = None, max_seqlen_q: int | None = None,
                           window: int | None = None, scale: float | None = None,
                           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Launch the flash kernel. q: [T, Hq, D]; either contiguous k, v: [Tk, Hkv, D] with
    ``cu_seqlens_k`` [B+1], or pools [NB, BS, Hkv, D] with ``seq_lens`` [B] and ``block_tables``
    [B, MB] (int8 / fp8 pools with their per-token scales ``k_scale, v_scale [NB, BS, Hkv]``). Returns [T, Hq, D].
    ``max_seqlen_q`` saves a host sync when the caller knows it."""
    quant = k_scale is not None
    if quant and block_tables is None:
        raise ValueError("flash_attention_triton: quantised K/V (scales) are paged only; pass block_tables")
    T, Hq, D = q.shape
    B = cu_seqlens_q.numel() - 1
    paged = block_tables is not None
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    if paged:
        kv = (k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2))
        page, Hkv = k.shape[1], k.shape[2]
    else:
        kv = (0, k.stride(0), k.stride(1), 0, v.stride(0), v.stride(1))
        page, Hkv = 1, k.shape[1]
    if max_seqlen_q is None:
        bounds = host_values(cu_seqlens_q)
        max_seqlen_q = max(b - a for a, b in zip(bounds, bounds[1:], strict=False)) if T else 0
    out = torch.empty_like(q)
    if T == 0:
        return out
    block_m, block_n, warps = (32, 32, 4) if INTERPRET else (64, 64, 4 if D <= 64 else 8)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    dummy = cu_seqlens_q
    k_scale, v_scale = (k_scale.contiguous(), v_scale.contiguous()) if quant else (q, q)
    grid = (triton.cdiv(max_seqlen_q, block_m), B, Hq)
    _flash_attn_fwd_kernel[grid](
        q, k, v, out, cu_seqlens_q, dummy if paged else cu_seqlens_k, seq_lens if paged else dummy,
        block_tables if paged else dummy, k_scale, v_scale,
        q.stride(0), q.stride(1), *kv, out.stride(0), out.stride(1),
        block_tables.stride(0) if paged else 0, k_scale.stride(0) if quant else 0, k_scale.stride(1) if quant else 0,
        scale * _LOG2E, window or 0,
        GROUP=Hq // Hkv, HEAD_DIM=D, BLOCK_D=next_pow2(D, 16), BLOCK_M=block_m, BLOCK_N=block_n,
        PAGED=paged, PAGE=page, HAS_WINDOW=window is not None, PRECISION=dot_precision(q.dtype),
        QUANT=quant, num_warps=warps,
    )
    return out


def _causal_attention_triton(q, k, v, *, window=None, scale=None):
    if needs_grad(q, k, v):  # forward-only kernel: training goes through the torch path (SDPA has backward)
        return _causal_attention_torch(q, k, v, window=window, scale=scale)
    B, Lq, Hq, D = q.shape
    Lk = k.shape[1]
    steps = torch.arange(B + 1, device=q.device, dtype=torch.int32)
    out = flash_attention_triton(q.reshape(B * Lq, Hq, D), k.reshape(B * Lk, *k.shape[2:]),
                                 v.reshape(B * Lk, *v.shape[2:]), steps * Lq, cu_seqlens_k=steps * Lk,
                                 max_seqlen_q=Lq, window=window, scale=scale)
    return out.view(B, Lq, Hq, D)


dispatch.register("causal_attention", "triton", _causal_attention_triton, triton_support.probe)
dispatch.register("causal_attention", "cuda", cuda_backend.causal_attention, cuda_backend.probe("flash_attn"),
                  cuda_backend.supports_flash)
