"""A Mamba-2 verify chunk in closed form: the conv and SSD states at every position of k+1 tokens at once.

For a chunk this short, unrolling the recurrence is cheaper than k+1 step-op calls per layer (one launch
sequence instead of k+1 on a GPU, a handful of tensor ops instead of ~10 per position on a CPU):

- conv: with the slot's K-1 last inputs in front, the output at t is the K-wide window ending at t, and the
  conv state after t is the K-1 inputs ending at t: two ``unfold`` views of the same padded row;
- SSD: h_t = exp(cum_t) h_0 + sum_{s<=t} exp(cum_t - cum_s) dt_s x_s B_s^T with cum the running sum of
  dt * A (the intra-chunk form of the chunked scan, one chunk, keeping every h_t), y_t = C_t h_t + D x_t.

Everything is fp32 inside, as the step ops compute. :func:`hybrid.kernels.ssd_step` is the reference
(``tests/test_speculative_engine.py`` checks one against the other).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def conv_states(conv0: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """conv0 [n, C, K-1], x [n, L, C], weight [C, K] -> (silu(conv) [n, L, C] fp32, states [L, n, C, K-1])."""
    K = weight.shape[1]
    full = torch.cat([conv0.float(), x.float().transpose(1, 2)], -1)  # [n, C, K-1+L]
    y = (full.unfold(-1, K, 1) * weight.float()[None, :, None, :]).sum(-1)  # [n, C, L]
    if bias is not None:
        y = y + bias.float()[None, :, None]
    states = full.unfold(-1, K - 1, 1)[:, :, 1:]  # [n, C, L, K-1]: the K-1 inputs ending at each position
    return F.silu(y).transpose(1, 2), states.permute(2, 0, 1, 3)


def ssd_states(h0: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
               D: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """h0 [n, H, P, N], x [n, L, H, P], dt [n, L, H] (positive), A [H], B/C [n, L, G, N] ->
    (y [n, L, H, P] fp32, states [L, n, H, P, N] fp32: the state after each position)."""
    L, H = x.shape[1], x.shape[2]
    rep = H // B.shape[2]
    Bh = B.float().repeat_interleave(rep, dim=2)
    Ch = C.float().repeat_interleave(rep, dim=2)
    cum = (dt.float() * A.float()).cumsum(1)  # [n, L, H]
    causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
    seg = (cum[:, :, None] - cum[:, None, :]).masked_fill(~causal[None, :, :, None], -torch.inf)  # [n, t, s, H]
    u = dt.float()[..., None] * x.float()  # [n, L, H, P]
    h = torch.exp(cum)[..., None, None] * h0.float()[:, None] + torch.einsum("ntsh,nshp,nshk->nthpk", seg.exp(), u, Bh)
    y = torch.einsum("nthpk,nthk->nthp", h, Ch)
    if D is not None:
        y = y + x.float() * D.float()[:, None]
    return y, h.transpose(0, 1)
