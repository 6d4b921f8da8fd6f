"""The Mamba-2 decode step on an int8 SSM state, without a dequantised copy of the rows.

An int8 state row (one head and ``head_dim`` row: ``d_state`` codes and one fp32 scale, see
:func:`.kv_quant.quantize_rows`) is updated as ``s = (codes * scale) * exp(dt A) + dt x B`` and stored
again as ``round(s / (|s|max / 127))`` with its new scale. The generic path (``StatePool.step``)
dequantises the rows into a copy, runs the fp32 step and quantises the copy: about ten passes over fp32
rows. Here the row is updated in code units, ``f = codes + (dt x / factor) B`` with ``factor = scale *
exp(dt A)`` one number per row: the factor only multiplies the output and the new scale, and the codes
``round(f * 127 / |f|max)`` do not depend on it. Per tile of rows in L2 that is seven passes: codes to fp32,
the rank-1 update, the mat-vec (``bmm``), ``amax`` and ``amin``, the multiply by ``127 / |f|max`` and the
rounding, and the cast back (the fp32 step makes three, over 4x the bytes):

- ``torch``: those eager ops (the default on CPU);
- ``inductor``: the same arithmetic as one ``torch.compile``'d function (opt-in: ``HYBRID_BACKEND=inductor``
  or ``dispatch.use_backend("inductor")``). Batches are padded to a power of two (static shapes); the first
  call of each of those shapes compiles. Measured on this 2-core machine (1 thread, batch 32,
  ``mamba2-small``): 22 ms a step against 13.8 ms for the previous torch path in the same run (this one:
  9-12 ms), 10-26 s to compile; Inductor keeps the
  whole batch's fp32 rows in memory between its loops, and with them fused per row (tried) it was slower
  still (its int8 loads are 8-lane partial loads). Not the default;
- ``triton``: :func:`.triton_state_update.ssd_state_update_int8`, the state-update kernel reading and
  writing int8 rows directly.

The scale is the row's exact |max| after the update, recomputed at every write: a scale bounded from the
update (or kept between writes) would round a decaying state's small changes away (the state freezes:
19% of the entries of a trained model after 200 steps with kept scales, eval/state_drift_bench.py), while
a recomputed scale carries the decay itself. All backends match the dequantise -> fp32 step -> quantise
reference to float rounding (tests/test_cache_compression_state_step.py): the same scales to a few ulp, codes
at most one apart (a quotient within rounding of .5).
"""

from __future__ import annotations

import torch

from . import dispatch
from .packing import slot_rows
from .selective import selective_step
from .ssd import ssd_step
from .state_tiles import row_tiles, scratch, tiles


def _heads(B: torch.Tensor, C: torch.Tensor, H: int) -> tuple[torch.Tensor, torch.Tensor]:
    rep = H // B.shape[1]
    return B.float().repeat_interleave(rep, dim=1), C.float().repeat_interleave(rep, dim=1)


# Code units: an old row is ``scale * codes``, its decay ``exp(dt A)`` one more factor per row (Mamba-2), so
# the eager steps update ``f = codes + (dt x / factor) B`` (``factor = scale * exp(dt A)``) and apply the factor
# only to the output and the new scale (``factor * |f|max / 127``); the codes ``round(127 f / |f|max)`` do not
# depend on it. That saves the dequantising pass over the rows. The factor is floored at |dt x| 2^-64 (and
# 2^-100) so ``dt x / factor`` stays finite: an old row (or zero row) below that contributes at most
# ``127 * 2^-64 |dt x|`` where the update adds ``|dt x B|``, i.e. nothing fp32 could tell apart.
_FLOOR_REL, _FLOOR = 2.0 ** -64, 2.0 ** -100


def _code_unit_factor(old_scale: torch.Tensor, decay: torch.Tensor | float, dtx: torch.Tensor) -> torch.Tensor:
    return torch.maximum(old_scale * decay, dtx.abs().mul_(_FLOOR_REL)).clamp_min_(_FLOOR)


def _quantize_chunk_(f: torch.Tensor, codes: torch.Tensor, amax: torch.Tensor, amin: torch.Tensor,
                     scale127: torch.Tensor) -> None:
    """fp32 rows ``f [..., m]`` (overwritten) -> round-to-nearest int8 ``codes`` in the layout of ``f``, with the
    row's |max| left as ``max(amax, amin)`` (``amax`` floored at 2^-100 so an all-zero row divides by
    something, ``amin`` negated: one ``maximum`` over the whole batch after the tiles gives the scales). No
    clamp: ``|f| * 127 / |f|max`` is at most 127 and one rounding error, which rounds to 127. (``amax`` and
    ``amin`` beat one ``aminmax``, which is not vectorised on CPU: 42 against 337 us for a sequence's rows.)"""
    torch.amax(f, -1, keepdim=True, out=amax)
    torch.amin(f, -1, keepdim=True, out=amin)
    inv = torch.div(scale127, torch.maximum(amax.clamp_min_(_FLOOR), amin.neg_()))
    codes.copy_(f.mul_(inv).round_())


def _ssd_step_int8_torch(codes, scale, x, dt, A, B, C, *, D=None, slots=None):
    rows, scatter = slot_rows(codes, slots)  # a gathered copy for scattered slots: int8, a quarter of fp32
    srows, _ = slot_rows(scale, slots)
    n, H, P, N = rows.shape
    G = B.shape[1]
    R = H // G * P  # a block: the rows of one sequence and B/C group, which share B and C
    dt = dt.float()
    dtx = dt[..., None] * x.float()
    factor = _code_unit_factor(srows.view(n, H, P), torch.exp(dt * A.float())[..., None], dtx)
    k, t = row_tiles(n * G, R, N, x.device)  # tiles of t chunks of k rows (state_tiles)
    c = R // k
    T = n * G * c
    u = (dtx / factor).view(T, k, 1)
    Bc = B.float().reshape(n * G, 1, 1, N).expand(n * G, c, 1, N).reshape(T, 1, N)
    Cc = C.float().reshape(n * G, 1, N, 1).expand(n * G, c, N, 1).reshape(T, N, 1)
    y, amax, amin = (torch.empty(T, k, 1, device=x.device) for _ in range(3))
    f = scratch(t * k * N, x.device).view(t, k, N)
    scale127 = torch.full((1,), 127.0, device=x.device)
    # one rank-1 update and one mat-vec per chunk (bmm), then |max| and the codes while the rows are in cache
    for r, ui, bi, ci, yi, ai, zi in zip(*(v.split(t) for v in (rows.view(T, k, N), u, Bc, Cc, y, amax, amin)),
                                         strict=True):
        ft = f if r.shape[0] == t else f[:r.shape[0]]
        ft.copy_(r).addcmul_(ui, bi)
        torch.bmm(ft, ci, out=yi)
        _quantize_chunk_(ft, r, ai, zi, scale127)
    new_scale = torch.maximum(amax, amin).view(n, H * P).mul_(factor.view(n, H * P)).div_(127.0)
    if scatter:
        codes.index_copy_(0, slots, rows)
        scale.index_copy_(0, slots, new_scale)
    else:
        srows.copy_(new_scale)
    y = y.view(n, H, P).mul_(factor)
    if D is not None:
        y = y + x.float() * D.float()[:, None]
    return y.to(x.dtype)


def _selective_step_int8_torch(codes, scale, x, dt, A, B, C, *, D=None, slots=None):
    """Mamba-1: codes [S, d_inner, N] with one scale per group of ``d_inner / groups`` channels (all their
    ``N`` values), ``scale [S, groups]``; x, dt [B, d_inner], A [d_inner, N], B/C [B, N]. The decay
    ``exp(dt A)`` differs along N, so it stays a pass of its own; the code units take the scale."""
    rows, scatter = slot_rows(codes, slots)
    srows, _ = slot_rows(scale, slots)
    n, Dm, N = rows.shape
    groups = srows.shape[1]
    gs = Dm // groups
    dt, A = dt.float(), A.float()
    dtx = dt * x.float()  # [n, Dm]
    floor = dtx.abs().view(n, groups, gs).amax(-1).mul_(_FLOOR_REL)
    factor = torch.maximum(srows, floor).clamp_min_(_FLOOR)  # [n, groups]
    per_channel = factor.repeat_interleave(gs, dim=1)  # [n, Dm]
    u = (dtx / per_channel)[..., None]
    Bf, Cf = B.float()[:, None, :], C.float()[..., None]
    y = torch.empty(n, Dm, 1, device=x.device)
    amax, amin = (torch.empty(n, groups, 1, device=x.device) for _ in range(2))
    scale127 = torch.full((1,), 127.0, device=x.device)
    for i, j in tiles(n, Dm * N, x.device):
        t = j - i
        dA = torch.mul(dt[i:j, :, None], A, out=scratch(t * Dm * N, x.device, 1).view(t, Dm, N)).exp_()
        f = scratch(t * Dm * N, x.device).view(t, Dm, N)
        f.copy_(rows[i:j]).mul_(dA).addcmul_(u[i:j], Bf[i:j])
        torch.bmm(f, Cf[i:j], out=y[i:j])
        _quantize_chunk_(f.view(t, groups, gs * N), rows[i:j].view(t, groups, gs * N), amax[i:j], amin[i:j],
                         scale127)
    new_scale = torch.maximum(amax, amin).view(n, groups).mul_(factor).div_(127.0)
    if scatter:
        codes.index_copy_(0, slots, rows)
        scale.index_copy_(0, slots, new_scale)
    else:
        srows.copy_(new_scale)
    y = y[..., 0].mul_(per_channel)
    if D is not None:
        y = y + x.float() * D.float()
    return y.to(x.dtype)


def _ssd_step_int8_math(rows, srows, x, dt, A, B, C, D):
    """The step as one functional expression (what the compiled backend fuses): -> (y, codes, scales)."""
    n, H, P, N = rows.shape
    Bh, Ch = _heads(B, C, H)
    dt = dt.float()
    f = (rows.float() * (srows.view(n, H, P, 1) * torch.exp(dt * A.float())[..., None, None])
         + (dt[..., None] * x.float())[..., None] * Bh[:, :, None, :])
    y = (f * Ch[:, :, None, :]).sum(-1)
    if D is not None:
        y = y + x.float() * D.float()[:, None]
    new_scale = f.abs().amax(-1) / 127.0
    safe = torch.where(new_scale > 0, new_scale, torch.ones_like(new_scale))
    q = (f / safe[..., None]).round().clamp(-127, 127).to(torch.int8)
    return y.to(x.dtype), q, new_scale.view(n, -1)


_compiled = None
# Static shapes compile to a much faster loop nest than dynamic ones (measured at batch 32 on
# hybrid-1to7-small: 9.4 ms against 17 ms; fp32 in place 8.5 ms), so a batch is padded to the next power of
# two and batches above the largest bucket go in pieces: at most 8 shapes are ever compiled (1, 2, ... 128),
# within Dynamo's default recompile limit.
_MAX_BUCKET = 128


def _pad_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    return t if t.shape[0] == n else torch.cat([t, t.new_zeros(n - t.shape[0], *t.shape[1:])])


def _ssd_step_int8_compiled(codes, scale, x, dt, A, B, C, *, D=None, slots=None):
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(_ssd_step_int8_math, dynamic=False)
    n = x.shape[0]
    if n == 1 << (n - 1).bit_length() and n <= _MAX_BUCKET:
        rows, scatter = slot_rows(codes, slots)  # a run of slots: the pool's rows themselves, no gather
        if not scatter:
            y, q, sc = _compiled(rows, slot_rows(scale, slots)[0], x, dt, A, B, C, D)
            rows.copy_(q)
            slot_rows(scale, slots)[0].copy_(sc)
            return y
    if slots is None:
        slots = torch.arange(n, device=x.device)
    ys = []
    for i in range(0, n, _MAX_BUCKET):
        s = slots[i:i + _MAX_BUCKET]
        m = s.shape[0]
        bucket = 1 << (m - 1).bit_length()
        y, q, sc = _compiled(_pad_rows(codes[s], bucket), _pad_rows(scale[s], bucket),
                             *(_pad_rows(t[i:i + m], bucket) for t in (x, dt)), A,
                             *(_pad_rows(t[i:i + m], bucket) for t in (B, C)), D)
        codes.index_copy_(0, s, q[:m])
        scale.index_copy_(0, s, sc[:m])
        ys.append(y[:m])
    return ys[0] if len(ys) == 1 else torch.cat(ys)


def _compile_probe() -> str | None:
    try:
        import torch._inductor  # noqa: F401
    except Exception as e:  # pragma: no cover - a torch build without Inductor
        return f"torch.compile (Inductor) is not available: {e}"
    return None


def _ssd_step_int8_triton(codes, scale, x, dt, A, B, C, *, D=None, slots=None):
    from .triton_state_update import ssd_state_update_int8

    return ssd_state_update_int8(codes, scale, x, dt, A, B, C, D=D, slots=slots)


def ssd_step_int8(codes: torch.Tensor, scale: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                  B: torch.Tensor, C: torch.Tensor, *, D: torch.Tensor | None = None,
                  slots: torch.Tensor | None = None) -> torch.Tensor:
    """One SSD decode step on int8 state rows, in place: ``codes [S, H, P, N]`` (int8) with one scale per
    head and ``P`` row, ``scale [S, H * P]`` (fp32); rows ``slots`` belong to the batch (all rows when
    None). x [B, H, P], dt [B, H], A [H], B/C [B, G, N], D [H] -> y [B, H, P]."""
    if codes.dtype != torch.int8 or scale.shape != (codes.shape[0], codes.shape[1] * codes.shape[2]):
        raise ValueError(f"ssd_step_int8: need int8 codes [S, H, P, N] and fp32 scales [S, H*P]; got "
                         f"{codes.dtype} {tuple(codes.shape)} and {tuple(scale.shape)}")
    _, fn = dispatch.choose("ssd_step_int8", x.device.type)
    return fn(codes, scale, x, dt, A, B, C, D=D, slots=slots)


def selective_step_int8(codes: torch.Tensor, scale: torch.Tensor, x: torch.Tensor, dt: torch.Tensor,
                        A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, *, D: torch.Tensor | None = None,
                        slots: torch.Tensor | None = None) -> torch.Tensor:
    """One Mamba-1 selective-scan decode step on int8 state rows, in place: ``codes [S, d_inner, N]`` (int8)
    with one scale per group of ``d_inner / groups`` channels, ``scale [S, groups]`` (fp32); rows ``slots``
    belong to the batch (all rows when None). x, dt [B, d_inner], A [d_inner, N], B/C [B, N] -> y [B, d_inner]."""
    if codes.dtype != torch.int8 or codes.dim() != 3 or scale.dim() != 2 or scale.shape[0] != codes.shape[0] \
            or codes.shape[1] % scale.shape[1]:
        raise ValueError(f"selective_step_int8: need int8 codes [S, d_inner, N] and fp32 scales [S, groups] with "
                         f"groups dividing d_inner; got {codes.dtype} {tuple(codes.shape)} and {tuple(scale.shape)}")
    _, fn = dispatch.choose("selective_step_int8", x.device.type)
    return fn(codes, scale, x, dt, A, B, C, D=D, slots=slots)


def _triton_probe() -> str | None:
    from .triton_support import probe

    return probe()


dispatch.register("ssd_step_int8", "torch", _ssd_step_int8_torch)
dispatch.register("ssd_step_int8", "inductor", _ssd_step_int8_compiled, _compile_probe)
dispatch.register("ssd_step_int8", "triton", _ssd_step_int8_triton, _triton_probe)
dispatch.register("selective_step_int8", "torch", _selective_step_int8_torch)


# The one-token ops that have an int8 step of their own, and that step: the explicit table a cache's int8
# state looks its step up in (:class:`hybrid.cache.StatePool`). Keyed by the public op a layer hands its
# cache view, so a new int8 step is one line here.
FUSED_INT8_STEPS = {ssd_step: ssd_step_int8, selective_step: selective_step_int8}


def fused_int8_step(op):
    """The int8 step of the one-token op ``op`` (``ssd_step`` -> :func:`ssd_step_int8`, ``selective_step`` ->
    :func:`selective_step_int8`), or None: then a cache dequantises, runs ``op`` on fp32 rows and quantises."""
    return FUSED_INT8_STEPS.get(op)
