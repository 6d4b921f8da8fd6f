"""Mamba-1 selective scan (prefill) and its one-step update (decode).

Shapes: ``x, dt: [B, L, D]`` (dt already positive), ``A: [D, N]`` (negative), ``B, C: [B, L, N]``,
state ``[B, D, N]`` fp32. Recurrence: ``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t``,
``y_t = h_t C_t + D x_t``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import cuda_backend, dispatch, native, triton_support
from .native import ops as native_ops
from .packing import check_cu_seqlens, sequences, slot_rows
from .state_tiles import scratch, update_in_fp32_tiles
from .triton_state_update import selective_state_update
from .triton_support import needs_grad

# Within a sub-chunk of _SUB tokens the scan is h_t = e^{c_t} (h_0 + sum_{s<=t} e^{-c_s} u_s), with c the
# running sum of log-decays since the sub-chunk's start: one cumsum, no sequential step. e^{-c_s} grows with
# the sub-chunk's total decay: past 60 fp32 could overflow and the block is computed in fp64; past 600 even
# fp64 could, and the block runs the plain recurrence (such decays zero the state within a token anyway;
# trained models rarely get there).
_FP32_SAFE_LOG_RANGE = 60.0
_FP64_SAFE_LOG_RANGE = 600.0
_SUB = 16  # tokens per sub-chunk: a sequential step only every 16 tokens
# Tokens materialised at once ([B, BLOCK, D, N] work tensors). The path is bound by memory traffic, so the
# block is sized for the work tensors to stay near the cache: 12 MB each at 1536 channels x 16 states. At
# 2K tokens, 1 thread, blocks of 32/64/128 ran the same (751-753 ms), 256 (25 MB tensors) 973 ms; 128 has
# half the ops of 64 (each op is a sync point of the threads on a shared CPU).
_BLOCK = 128


def selective_scan_ref(x, dt, A, B, C, *, D=None, initial_state=None):
    """Token-by-token recurrence in fp32: the reference."""
    b, L, Dm = x.shape
    h = torch.zeros(b, Dm, A.shape[1], device=x.device) if initial_state is None else initial_state.float().clone()
    ys = []
    for t in range(L):
        h = torch.exp(dt[:, t, :, None].float() * A.float()) * h + \
            (dt[:, t].float() * x[:, t].float())[..., None] * B[:, t, None, :].float()
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, t].float()))
    y = torch.stack(ys, dim=1)
    if D is not None:
        y = y + x.float() * D.float()
    return y.to(x.dtype), h


def _scan_block(h0, x, dt, A, B, C):
    """Scan one block of T tokens (T a multiple of _SUB) from state h0 [b, D, N]; returns y, h_end.

    Without autograd the [b, T, D, N] work tensors are updated in place (this path is memory-bound:
    fewer passes and allocations make it ~2x faster); with autograd the same ops run out of place.
    """
    b, T, Dm = x.shape
    N = A.shape[1]
    nS = T // _SUB
    inplace = not needs_grad(h0, x, dt, A, B, C)
    # the log-decay dt_t A factorises (A does not depend on t): its running sum is A * cumsum(dt), a cumsum
    # over [T, D] instead of [T, D, N] — one full pass over the work tensors fewer
    cdt = dt.view(b, nS, _SUB, Dm).cumsum(2)
    log_range = float(-(cdt[:, :, -1, :, None] * A).detach().min())
    if log_range > _FP64_SAFE_LOG_RANGE:
        return selective_scan_ref(x, dt, A, B, C, initial_state=h0)
    work = torch.float64 if log_range > _FP32_SAFE_LOG_RANGE else torch.float32
    cum = cdt.to(work)[..., None] * A.to(work)  # [b, nS, SUB, D, N]
    e = cum.exp_() if inplace else cum.exp()  # decay since the sub-chunk's start, in (0, 1]
    u = ((dt * x).to(work)[..., None] * B.to(work)[:, :, None, :]).view(b, nS, _SUB, Dm, N)
    # local states from a zero state: e_t * cumsum(u_s / e_s)
    local = (u.div_(e).cumsum_(dim=2).mul_(e) if inplace else torch.cumsum(u / e, dim=2) * e).float()
    e = e.float()
    # carry the state across sub-chunks: only nS small sequential steps
    entering = []
    h = h0
    for s in range(nS):
        entering.append(h)
        h = torch.addcmul(local[:, s, -1], e[:, s, -1], h)
    entering = torch.stack(entering, dim=1)[:, :, None]
    full = local.addcmul_(e, entering) if inplace else torch.addcmul(local, e, entering)
    y = torch.matmul(full, C.view(b, nS, _SUB, N, 1)).view(b, T, Dm)
    return y, h


def _scan_steps(x, dt, A, B, C, h):
    """The recurrence token by token, for inference: per block of _BLOCK tokens the decays e^{dt A} and inputs
    dt x B are made in two batched ops, then each token is one in-place multiply-add of the [b, D, N] state,
    which stays in cache, and the outputs one batched matmul with C. Exact (no cumulative decays to guard).
    -> y [b, L, D] fp32, the final state."""
    b, L, Dm = x.shape
    y = torch.empty(b, L, Dm, device=x.device)
    block = max(_SUB, _BLOCK // b)
    for t0 in range(0, L, block):
        s = slice(t0, min(t0 + block, L))
        dA = torch.exp(dt[:, s, :, None] * A)  # [b, n, D, N]
        states = (dt[:, s] * x[:, s])[..., None] * B[:, s, None, :]  # the inputs, overwritten by the states
        for t in range(s.stop - s.start):
            h = states[:, t].addcmul_(dA[:, t], h)
        torch.matmul(states, C[:, s, :, None], out=y[:, s, :, None])
    return y, h


def _selective_scan_torch(x, dt, A, B, C, *, D=None, initial_state=None):
    b, L, Dm = x.shape
    N = A.shape[1]
    h = torch.zeros(b, Dm, N, device=x.device) if initial_state is None else initial_state.float()
    Af = A.float()
    if not needs_grad(x, dt, A, B, C, D, initial_state):
        # Inference where the native scan (kernels/native/scan.c, the ``native`` backend) does not run: token
        # steps on an in-cache state beat the chunked form on a CPU (1 thread, jamba-small widths, 2K tokens:
        # 0.61 s against 1.7-3.7 s): the chunked form's [T, D, N] work tensors cost a dozen passes through
        # memory, a step touches its state while it is in cache.
        y, h = _scan_steps(x.float(), dt.float(), Af, B.float(), C.float(), h)
    else:  # autograd: the chunked form (the steps' in-place updates could not be differentiated)
        ys = []
        for start in range(0, L, _BLOCK):
            end = min(start + _BLOCK, L)
            n = end - start
            pad = (-n) % _SUB
            xs, dts, Bs, Cs = (t[:, start:end].float() for t in (x, dt, B, C))
            if pad:  # dt = 0 on padding: decay 1, no input, so h is unchanged by it
                xs, dts, Bs, Cs = (F.pad(t, (0, 0, 0, pad)) for t in (xs, dts, Bs, Cs))
            yb, h = _scan_block(h, xs, dts, Af, Bs, Cs)
            ys.append(yb[:, :n])
        y = torch.cat(ys, dim=1)
    if D is not None:
        y = y + x.float() * D.float()
    return y.to(x.dtype), h


def selective_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   *, D: torch.Tensor | None = None,
                   initial_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Selective scan over whole sequences. Returns ``(y [B, L, D], final_state [B, D, N] fp32)``."""
    if x.dim() != 3 or dt.shape != x.shape or A.dim() != 2 or A.shape[0] != x.shape[2]:
        raise ValueError(f"selective_scan: need x, dt [B, L, D] and A [D, N]; got {tuple(x.shape)}, "
                         f"{tuple(dt.shape)}, {tuple(A.shape)}")
    if B.shape != C.shape or B.shape != (*x.shape[:2], A.shape[1]):
        raise ValueError(f"selective_scan: B and C must be [B, L, N] = {(*x.shape[:2], A.shape[1])}, "
                         f"got {tuple(B.shape)}, {tuple(C.shape)}")
    _, fn = dispatch.choose("selective_scan", x.device.type)
    with torch.profiler.record_function("selective.scan"):
        return fn(x, dt, A, B, C, D=D, initial_state=initial_state)


def selective_step_ref(state, x, dt, A, B, C, *, D=None):
    """One token: state [B, D, N] (in place), x, dt [B, D], B, C [B, N] -> y [B, D]."""
    new = torch.exp(dt.float()[..., None] * A.float()) * state.float() + \
        (dt.float() * x.float())[..., None] * B.float()[:, None, :]
    state.copy_(new)
    y = torch.einsum("bdn,bn->bd", new, C.float())
    if D is not None:
        y = y + x.float() * D.float()
    return y.to(x.dtype)


def _selective_step_torch(state, x, dt, A, B, C, *, D=None, slots=None):
    # in place on the rows, a tile of sequences at a time (.state_tiles; see ssd's step), the decay
    # exp(dt A) [t, d_inner, N] in a reused buffer; a bf16 / fp16 state is updated in an fp32 copy of each
    # tile and rounded back once. One gather and one scatter for a slot pool.
    rows, scatter = slot_rows(state, slots)
    if not rows.is_contiguous() or needs_grad(x, dt, A, B, C, D):  # strided, or autograd recording (see ssd's)
        y = selective_step_ref(rows, x, dt, A, B, C, D=D)
        if scatter:
            state.index_copy_(0, slots, rows)
        return y
    n, Dm, N = rows.shape
    dt, A = dt.float(), A.float()
    dtx, Bf, Cf = (dt * x.float())[..., None], B.float()[:, None, :], C.float()[..., None]
    y = torch.empty(n, Dm, 1, device=x.device)

    def update(i, j, f):
        t = j - i
        dA = torch.mul(dt[i:j, :, None], A, out=scratch(t * Dm * N, x.device, 1).view(t, Dm, N)).exp_()
        torch.bmm(f.mul_(dA).addcmul_(dtx[i:j], Bf[i:j]), Cf[i:j], out=y[i:j])

    update_in_fp32_tiles(rows, update)
    if scatter:
        state.index_copy_(0, slots, rows)
    y = y[..., 0]
    if D is not None:
        y = y + x.float() * D.float()
    return y.to(x.dtype)


def selective_step(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                   C: torch.Tensor, *, D: torch.Tensor | None = None,
                   slots: torch.Tensor | None = None) -> torch.Tensor:
    """One decode step of the selective scan, updating the state in place: ``state`` [B, D, N], or
    with ``slots`` a pool [S, D, N] whose rows ``slots`` belong to the batch. Returns y [B, D]."""
    _, fn = dispatch.choose("selective_step", x.device.type)
    return fn(state, x, dt, A, B, C, D=D, slots=slots)


def _varlen(scan, x, dt, A, B, C, cu_seqlens, D, initial_states):
    y = torch.empty_like(x)
    finals = []
    for b, s in sequences(cu_seqlens):
        init = None if initial_states is None else initial_states[b:b + 1]
        yb, fb = scan(x[None, s], dt[None, s], A, B[None, s], C[None, s], D=D, initial_state=init)
        y[s] = yb[0]
        finals.append(fb)
    return y, torch.cat(finals)


def selective_varlen_scan_ref(x, dt, A, B, C, cu_seqlens, *, D=None, initial_states=None):
    return _varlen(selective_scan_ref, x, dt, A, B, C, cu_seqlens, D, initial_states)


def _selective_varlen_scan_torch(x, dt, A, B, C, cu_seqlens, *, D=None, initial_states=None):
    return _varlen(_selective_scan_torch, x, dt, A, B, C, cu_seqlens, D, initial_states)


def selective_varlen_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                          cu_seqlens: torch.Tensor, *, D: torch.Tensor | None = None,
                          initial_states: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Selective scan over a packed batch: x, dt [T, D], B/C [T, N], cu_seqlens [B+1], initial_states
    [B, D, N] or None. Returns (y [T, D], final_states [B, D, N] fp32)."""
    check_cu_seqlens(cu_seqlens, x.shape[0], "selective_varlen_scan")
    _, fn = dispatch.choose("selective_varlen_scan", x.device.type)
    with torch.profiler.record_function("selective.scan"):
        return fn(x, dt, A, B, C, cu_seqlens, D=D, initial_states=initial_states)


dispatch.register("selective_scan", "torch", _selective_scan_torch)
dispatch.register("selective_varlen_scan", "torch", _selective_varlen_scan_torch)
dispatch.register("selective_step", "torch", _selective_step_torch)
# the native scan: a block of channels walked through a sequence's tokens with its states in L1, one native call for
# a whole (packed) batch; inference only (autograd takes the torch path's chunked form)
dispatch.register("selective_scan", "native", native_ops.selective_scan, native.available,
                  native_ops.supports_selective_scan)
dispatch.register("selective_varlen_scan", "native", native_ops.selective_varlen_scan, native.available,
                  native_ops.supports_selective_varlen_scan)


# --- Triton: the decode step (kernel shared with Mamba-2 in triton_state_update.py) ------------------
# The prefill scan has no Triton kernel: the triton backend is not registered for selective_scan /
# selective_varlen_scan, so they keep the default order (cuda's selective_scan_fn on a GPU, else torch).

def _selective_step_triton(state, x, dt, A, B, C, *, D=None, slots=None):
    if needs_grad(x, dt, A, B, C, D):  # forward-only kernel
        return _selective_step_torch(state, x, dt, A, B, C, D=D, slots=slots)
    return selective_state_update(state, x, dt, A, B, C, D=D, slots=slots)


dispatch.register("selective_step", "triton", _selective_step_triton, triton_support.probe)

_mamba = cuda_backend.probe("mamba_ssm")
dispatch.register("selective_scan", "cuda", cuda_backend.selective_scan, _mamba, cuda_backend.supports_no_initial_state)
dispatch.register("selective_varlen_scan", "cuda", cuda_backend.selective_varlen_scan, _mamba,
                  cuda_backend.supports_no_initial_state)
dispatch.register("selective_step", "cuda", cuda_backend.selective_step, _mamba)
