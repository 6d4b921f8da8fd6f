"""Mamba-2 state-space duality (SSD): chunked scan for prefill and the one-step state update.

Shapes: ``x: [B, L, H, P]`` (H heads of P channels), ``dt: [B, L, H]`` (already positive:
softplus(dt + dt_bias) and clamped by the caller), ``A: [H]`` (negative decay rates),
``B, C: [B, L, G, N]`` (G groups shared by H/G heads each), state ``[B, H, P, N]`` in fp32.

Recurrence (per head h): ``s_t = exp(dt_t A) s_{t-1} + dt_t x_t B_t^T``, ``y_t = s_t C_t + D x_t``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import dispatch
from .packing import check_cu_seqlens, sequences, step_on_slots

_TORCH_MAX_CHUNK = 128


def ssd_scan_ref(x, dt, A, B, C, *, D=None, initial_state=None):
    """Token-by-token recurrence in fp32: the reference the chunked forms are checked against."""
    b, L, H, P = x.shape
    G, N = B.shape[2:]
    rep = H // G
    Bh = B.float().repeat_interleave(rep, dim=2)  # [b, L, H, N]
    Ch = C.float().repeat_interleave(rep, dim=2)
    s = torch.zeros(b, H, P, N, device=x.device) if initial_state is None else initial_state.float().clone()
    ys = []
    for t in range(L):
        dA = torch.exp(dt[:, t].float() * A.float())  # [b, H]
        s = s * dA[:, :, None, None] + (dt[:, t, :, None].float() * x[:, t].float())[..., None] * Bh[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", s, Ch[:, t]))
    y = torch.stack(ys, dim=1)
    if D is not None:
        y = y + x.float() * D.float()[:, None]
    return y.to(x.dtype), s


def _segsum(a: torch.Tensor) -> torch.Tensor:
    """[..., T] -> [..., T, T] with out[i, j] = a[j+1] + ... + a[i] for i >= j, -inf above.

    Summing masked copies (rather than subtracting cumsums) keeps it exact for long chunks.
    """
    T = a.shape[-1]
    strict = torch.tril(torch.ones(T, T, dtype=torch.bool, device=a.device), diagonal=-1)
    cs = torch.cumsum(a[..., :, None].expand(*a.shape, T).masked_fill(~strict, 0.0), dim=-2)
    return cs.masked_fill(~torch.tril(torch.ones(T, T, dtype=torch.bool, device=a.device)), float("-inf"))


def _ssd_chunk_scan_torch(x, dt, A, B, C, *, chunk_size, D=None, initial_state=None):
    b, L, H, P = x.shape
    G, N = B.shape[2:]
    hpg = H // G
    # The chunk size changes only the cost, never the result: on this path 64-128 beats the 256
    # that GPU kernels like (the [T, T] decay matrices grow with T), so cap it there.
    T = min(chunk_size, _TORCH_MAX_CHUNK, L)
    pad = (-L) % T
    xf, dtf, Bf, Cf = x.float(), dt.float(), B.float(), C.float()
    if pad:
        # Zero dt on the padding: decay 1 and no input, so the final state is the one at L - 1.
        xf, Bf, Cf = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (xf, Bf, Cf))
        dtf = F.pad(dtf, (0, 0, 0, pad))
    nc = (L + pad) // T
    xdt = (xf * dtf[..., None]).view(b, nc, T, G, hpg, P)
    Bc = Bf.view(b, nc, T, G, N)
    Cc = Cf.view(b, nc, T, G, N)
    dA = (dtf * A.float()).view(b, nc, T, H).permute(0, 3, 1, 2)  # [b, H, nc, T]
    dA_cs = torch.cumsum(dA, dim=-1)

    # 1. within each chunk: the quadratic (attention-like) form
    decay_in = torch.exp(_segsum(dA)).view(b, G, hpg, nc, T, T)
    CB = torch.einsum("bclgn,bcsgn->bgcls", Cc, Bc)  # [b, G, nc, T, T]
    y = torch.einsum("bghcls,bcsghp->bclghp", CB[:, :, None] * decay_in, xdt)

    # 2. each chunk's final state, from zero
    decay_to_end = torch.exp(dA_cs[..., -1:] - dA_cs).view(b, G, hpg, nc, T)
    states = torch.einsum("bcsgn,bghcs,bcsghp->bcghpn", Bc, decay_to_end, xdt).reshape(b, nc, H, P, N)

    # 3. pass states across chunks (a scan over nc chunks, as a small decay matrix)
    init = (torch.zeros(b, 1, H, P, N, device=x.device) if initial_state is None
            else initial_state.float()[:, None])
    states = torch.cat([init, states], dim=1)
    chunk_decay = torch.exp(_segsum(F.pad(dA_cs[..., -1], (1, 0))))  # [b, H, nc+1, nc+1]
    states = torch.einsum("bhzc,bchpn->bzhpn", chunk_decay, states)
    prev_states, final_state = states[:, :-1], states[:, -1]

    # 4. contribution of the state entering each chunk
    decay_from_start = torch.exp(dA_cs).view(b, G, hpg, nc, T)
    y = y + torch.einsum("bclgn,bcghpn,bghcl->bclghp", Cc, prev_states.view(b, nc, G, hpg, P, N),
                         decay_from_start)
    y = y.reshape(b, nc * T, H, P)[:, :L]
    if D is not None:
        y = y + x.float() * D.float()[:, None]
    return y.to(x.dtype), final_state


def _check_ssd_shapes(x, dt, A, B, C):
    if x.dim() != 4:
        raise ValueError(f"ssd: x must be [B, L, H, P], got {tuple(x.shape)}")
    b, L, H, _ = x.shape
    if dt.shape != (b, L, H) or A.shape != (H,):
        raise ValueError(f"ssd: dt must be [B, L, H] = {(b, L, H)} and A [H] = {(H,)}, "
                         f"got {tuple(dt.shape)} and {tuple(A.shape)}")
    if B.shape != C.shape or B.dim() != 4 or B.shape[:2] != (b, L) or H % B.shape[2]:
        raise ValueError(f"ssd: B and C must be [B, L, G, N] with H % G == 0, got {tuple(B.shape)}, {tuple(C.shape)}")


def ssd_chunk_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   *, chunk_size: int = 256, D: torch.Tensor | None = None,
                   initial_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """SSD over whole sequences. Returns ``(y [B, L, H, P], final_state [B, H, P, N] fp32)``."""
    _check_ssd_shapes(x, dt, A, B, C)
    _, fn = dispatch.choose("ssd_chunk_scan", x.device.type)
    return fn(x, dt, A, B, C, chunk_size=chunk_size, D=D, initial_state=initial_state)


def ssd_step_ref(state, x, dt, A, B, C, *, D=None):
    """One token: state [B, H, P, N] (updated in place), x [B, H, P], dt [B, H], B/C [B, G, N] -> y [B, H, P]."""
    rep = x.shape[1] // B.shape[1]
    Bh = B.float().repeat_interleave(rep, dim=1)
    Ch = C.float().repeat_interleave(rep, dim=1)
    dA = torch.exp(dt.float() * A.float())
    new = state.float() * dA[..., None, None] + (dt.float()[..., None] * x.float())[..., None] * Bh[:, :, None, :]
    state.copy_(new)
    y = torch.einsum("bhpn,bhn->bhp", new, Ch)
    if D is not None:
        y = y + x.float() * D.float()[:, None]
    return y.to(x.dtype)


def _ssd_step_torch(state, x, dt, A, B, C, *, D=None, slots=None):
    return step_on_slots(ssd_step_ref, state, slots, x, dt, A, B, C, D=D)


def ssd_step(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
             C: torch.Tensor, *, D: torch.Tensor | None = None, slots: torch.Tensor | None = None) -> torch.Tensor:
    """One decode step of SSD, updating the state in place. Returns y [B, H, P].

    ``state`` is [B, H, P, N], or with ``slots`` ([B] int64) a pool [S, H, P, N] whose rows
    ``slots`` belong to the batch (mamba_ssm's ``state_batch_indices``).
    """
    _, fn = dispatch.choose("ssd_step", x.device.type)
    return fn(state, x, dt, A, B, C, D=D, slots=slots)


def _ssd_varlen_scan_torch(x, dt, A, B, C, cu_seqlens, *, chunk_size, D=None, initial_states=None):
    y = torch.empty_like(x)
    finals = []
    for b, s in sequences(cu_seqlens):
        init = None if initial_states is None else initial_states[b:b + 1]
        yb, fb = _ssd_chunk_scan_torch(x[None, s], dt[None, s], A, B[None, s], C[None, s], chunk_size=chunk_size,
                                       D=D, initial_state=init)
        y[s] = yb[0]
        finals.append(fb)
    return y, torch.cat(finals)


def ssd_varlen_scan_ref(x, dt, A, B, C, cu_seqlens, *, D=None, initial_states=None):
    y = torch.empty_like(x)
    finals = []
    for b, s in sequences(cu_seqlens):
        init = None if initial_states is None else initial_states[b:b + 1]
        yb, fb = ssd_scan_ref(x[None, s], dt[None, s], A, B[None, s], C[None, s], D=D, initial_state=init)
        y[s] = yb[0]
        finals.append(fb)
    return y, torch.cat(finals)


def ssd_varlen_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                    cu_seqlens: torch.Tensor, *, chunk_size: int = 256, D: torch.Tensor | None = None,
                    initial_states: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """SSD over a packed batch: x [T, H, P], dt [T, H], B/C [T, G, N], cu_seqlens [B+1];
    initial_states [B, H, P, N] or None (zeros). Returns (y [T, H, P], final_states [B, H, P, N] fp32).
    The state never crosses a sequence boundary."""
    _check_ssd_shapes(x[None], dt[None], A, B[None], C[None])
    check_cu_seqlens(cu_seqlens, x.shape[0], "ssd_varlen_scan")
    _, fn = dispatch.choose("ssd_varlen_scan", x.device.type)
    return fn(x, dt, A, B, C, cu_seqlens, chunk_size=chunk_size, D=D, initial_states=initial_states)


dispatch.register("ssd_chunk_scan", "torch", _ssd_chunk_scan_torch)
dispatch.register("ssd_varlen_scan", "torch", _ssd_varlen_scan_torch)
dispatch.register("ssd_step", "torch", _ssd_step_torch)
