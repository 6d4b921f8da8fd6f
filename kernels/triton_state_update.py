"""Triton: the one-token state update shared by Mamba-2 (``ssd_step``) and Mamba-1 (``selective_step``).

Both are ``s = exp(dt A) s + dt x B^T`` on a state ``[H, P, N]`` followed by ``y = s C + D x``; they
differ only in which axes dt, A and D vary along. The kernel takes a general [H, P, N] view with
explicit strides, and a stride of 0 broadcasts: Mamba-2 has dt [B, H], A [H], D [H] (P and N
strides 0); Mamba-1 is one head of P = d_inner channels with dt [B, D], A [D, N], D [D].
The state rows may be picked from a pool by ``slots`` (continuous batching); they are updated in
place, in the pool's dtype, and y is computed from the fp32 update. Forward only (decode).
"""

from __future__ import annotations

import torch

from .triton_support import jit, next_pow2, tl, triton


@jit
def _state_update_kernel(
    S, X, DT, A, Bm, Cm, Dp, Y, slots,
    stride_ss, stride_sh, stride_sp, stride_xb, stride_xh, stride_xp, stride_dtb, stride_dth, stride_dtp,
    stride_ah, stride_ap, stride_an, stride_bb, stride_bg, stride_cb, stride_cg, stride_dh, stride_dp,
    stride_yb, stride_yh, stride_yp,
    P, N, HEADS_PER_GROUP: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_D: tl.constexpr, HAS_SLOTS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    pid_p = tl.program_id(2)
    g = h // HEADS_PER_GROUP
    if HAS_SLOTS:
        row = tl.load(slots + b).to(tl.int64)
    else:
        row = b.to(tl.int64)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    p_valid = offs_p < P
    n_valid = offs_n < N
    mask = p_valid[:, None] & n_valid[None, :]
    s_ptrs = S + row * stride_ss + h * stride_sh + offs_p[:, None] * stride_sp + offs_n[None, :]
    s = tl.load(s_ptrs, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(X + b * stride_xb + h * stride_xh + offs_p * stride_xp, mask=p_valid, other=0.0).to(tl.float32)
    dt = tl.load(DT + b * stride_dtb + h * stride_dth + offs_p * stride_dtp, mask=p_valid, other=0.0).to(tl.float32)
    a = tl.load(A + h * stride_ah + offs_p[:, None] * stride_ap + offs_n[None, :] * stride_an, mask=mask,
                other=0.0).to(tl.float32)
    bvec = tl.load(Bm + b * stride_bb + g * stride_bg + offs_n, mask=n_valid, other=0.0).to(tl.float32)
    cvec = tl.load(Cm + b * stride_cb + g * stride_cg + offs_n, mask=n_valid, other=0.0).to(tl.float32)
    s = s * tl.exp(dt[:, None] * a) + (dt * x)[:, None] * bvec[None, :]
    tl.store(s_ptrs, s.to(S.dtype.element_ty), mask=mask)
    y = tl.sum(s * cvec[None, :], 1)
    if HAS_D:
        y += x * tl.load(Dp + h * stride_dh + offs_p * stride_dp, mask=p_valid, other=0.0).to(tl.float32)
    tl.store(Y + b * stride_yb + h * stride_yh + offs_p * stride_yp, y.to(Y.dtype.element_ty), mask=p_valid)


def _launch(state, x, y, slots, D, H, P, N, G, strides):
    if state.stride(-1) != 1:
        raise ValueError("state update: the state pool must be contiguous along d_state")
    block_p = min(next_pow2(P, 16), 64)
    dummy = y
    grid = (x.shape[0], H, triton.cdiv(P, block_p))
    _state_update_kernel[grid](
        state, *strides["tensors"], D if D is not None else dummy, y, slots if slots is not None else dummy,
        *strides["s"], *strides["x"], *strides["dt"], *strides["a"], *strides["b"], *strides["c"],
        *(strides["d"] if D is not None else (0, 0)), *strides["y"],
        P, N, HEADS_PER_GROUP=H // G, BLOCK_P=block_p, BLOCK_N=next_pow2(N, 16), HAS_D=D is not None,
        HAS_SLOTS=slots is not None,
    )
    return y


def ssd_state_update(state, x, dt, A, B, C, *, D=None, slots=None):
    """Mamba-2: state [S, H, P, N] (in place), x [B, H, P], dt [B, H], A [H], B/C [B, G, N],
    D [H] or None, slots [B] or None (rows 0..B-1) -> y [B, H, P]."""
    H, P, N, G = x.shape[1], x.shape[2], state.shape[-1], B.shape[1]
    B, C = (t if t.stride(-1) == 1 else t.contiguous() for t in (B, C))
    y = torch.empty_like(x)
    return _launch(state, x, y, slots, D, H, P, N, G, {
        "tensors": (x, dt, A, B, C),
        "s": state.stride()[:3], "x": x.stride(), "dt": (dt.stride(0), dt.stride(1), 0),
        "a": (A.stride(0), 0, 0), "b": B.stride()[:2], "c": C.stride()[:2],
        "d": (D.stride(0), 0) if D is not None else None, "y": y.stride(),
    })


def selective_state_update(state, x, dt, A, B, C, *, D=None, slots=None):
    """Mamba-1: state [S, D, N] (in place), x, dt [B, D], A [D, N], B/C [B, N], D [D] or None,
    slots [B] or None -> y [B, D]. One head of P = D channels."""
    Dm, N = A.shape
    B, C = (t if t.stride(-1) == 1 else t.contiguous() for t in (B, C))
    y = torch.empty_like(x)
    return _launch(state, x, y, slots, D, 1, Dm, N, 1, {
        "tensors": (x, dt, A, B, C),
        "s": (state.stride(0), 0, state.stride(1)), "x": (x.stride(0), 0, x.stride(1)),
        "dt": (dt.stride(0), 0, dt.stride(1)), "a": (0, A.stride(0), A.stride(1)),
        "b": (B.stride(0), 0), "c": (C.stride(0), 0), "d": (0, D.stride(0)) if D is not None else None,
        "y": (y.stride(0), 0, y.stride(1)),
    })


# --- int8 state rows: codes [S, H, P, N] and one fp32 scale per (head, P) row, scale [S, H * P] -----------
# The program holds whole rows (BLOCK_N >= N), so the new scale is the row's |max| after the update, found
# in registers; the codes are written back at that scale (round half away from zero, as torch.round's
# half-to-even differs only at exact .5 quotients).

@jit
def _state_update_int8_kernel(
    Q, QS, X, DT, A, Bm, Cm, Dp, Y, slots,
    stride_qs, stride_qh, stride_qp, stride_ss, stride_xb, stride_xh, stride_dtb, stride_bb, stride_bg,
    stride_cb, stride_cg, stride_yb, stride_yh,
    P, N, HEADS_PER_GROUP: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_D: tl.constexpr, HAS_SLOTS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    pid_p = tl.program_id(2)
    g = h // HEADS_PER_GROUP
    if HAS_SLOTS:
        row = tl.load(slots + b).to(tl.int64)
    else:
        row = b.to(tl.int64)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    p_valid = offs_p < P
    n_valid = offs_n < N
    mask = p_valid[:, None] & n_valid[None, :]
    q_ptrs = Q + row * stride_qs + h * stride_qh + offs_p[:, None] * stride_qp + offs_n[None, :]
    s_ptrs = QS + row * stride_ss + h * P + offs_p
    scale = tl.load(s_ptrs, mask=p_valid, other=0.0)
    x = tl.load(X + b * stride_xb + h * stride_xh + offs_p, mask=p_valid, other=0.0).to(tl.float32)
    dt = tl.load(DT + b * stride_dtb + h).to(tl.float32)
    a = tl.load(A + h).to(tl.float32)
    bvec = tl.load(Bm + b * stride_bb + g * stride_bg + offs_n, mask=n_valid, other=0.0).to(tl.float32)
    cvec = tl.load(Cm + b * stride_cb + g * stride_cg + offs_n, mask=n_valid, other=0.0).to(tl.float32)
    codes = tl.load(q_ptrs, mask=mask, other=0).to(tl.float32)
    s = codes * (scale * tl.exp(dt * a))[:, None] + (dt * x)[:, None] * bvec[None, :]
    y = tl.sum(s * cvec[None, :], 1)
    new_scale = tl.max(tl.abs(s), 1) / 127.0
    safe = tl.where(new_scale > 0, new_scale, 1.0)
    v = s / safe[:, None]
    v = tl.where(v >= 0, tl.floor(v + 0.5), -tl.floor(-v + 0.5))
    v = tl.minimum(tl.maximum(v, -127.0), 127.0)
    tl.store(q_ptrs, v.to(tl.int8), mask=mask)
    tl.store(s_ptrs, new_scale, mask=p_valid)
    if HAS_D:
        y += x * tl.load(Dp + h).to(tl.float32)
    tl.store(Y + b * stride_yb + h * stride_yh + offs_p, y.to(Y.dtype.element_ty), mask=p_valid)


def ssd_state_update_int8(codes, scale, x, dt, A, B, C, *, D=None, slots=None):
    """Mamba-2 on int8 rows: codes [S, H, P, N] and scale [S, H * P] (both in place), x [B, H, P], dt [B, H],
    A [H], B/C [B, G, N], D [H] or None, slots [B] or None -> y [B, H, P]."""
    H, P, N, G = x.shape[1], x.shape[2], codes.shape[-1], B.shape[1]
    if codes.stride(-1) != 1 or scale.stride(-1) != 1 or x.stride(-1) != 1:
        raise ValueError("int8 state update: codes, scales and x must be contiguous along their last dimension")
    B, C, dt, A = (t if t.stride(-1) == 1 else t.contiguous() for t in (B, C, dt, A))
    D = D if D is None or D.stride(-1) == 1 else D.contiguous()
    y = torch.empty_like(x)
    block_p = min(next_pow2(P, 16), 64)
    grid = (x.shape[0], H, triton.cdiv(P, block_p))
    _state_update_int8_kernel[grid](
        codes, scale, x, dt, A, B, C, D if D is not None else y, y, slots if slots is not None else y,
        codes.stride(0), codes.stride(1), codes.stride(2), scale.stride(0), x.stride(0), x.stride(1), dt.stride(0),
        B.stride(0), B.stride(1), C.stride(0), C.stride(1), y.stride(0), y.stride(1),
        P, N, HEADS_PER_GROUP=H // G, BLOCK_P=block_p, BLOCK_N=next_pow2(N, 16), HAS_D=D is not None,
        HAS_SLOTS=slots is not None,
    )
    return y
