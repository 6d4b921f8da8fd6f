"""The speculative rejection rule (Leviathan et al. 2023; Chen et al. 2023), batched on the device.

For draft tokens d_1..d_k proposed from distributions q_1..q_k, and the target's distributions p_1..p_{k+1}
(from one verify forward): d_j is accepted with probability min(1, p_j(d_j) / q_j(d_j)); at the first
rejection the token is drawn from the normalised residual max(0, p_j - q_j); if all k are accepted a bonus
token is drawn from p_{k+1}. The emitted tokens are distributed exactly as the target samples them.
A deterministic draft (n-gram lookup) has one-hot q: accept with probability p_j(d_j), residual p_j without
d_j. Greedy requests use a one-hot p at the argmax, which turns the same rule into "accept while the draft is
the target's argmax, then emit the argmax": greedy output is identical to non-speculative greedy.

Randomness is counter-based like :mod:`hybrid.sampling`: the draw for output index c uses the request's seed
and c (the acceptance test and the draft's own sampling on salted seeds), so results do not depend on the
batch, and with nothing drafted the emitted token is the one plain sampling gives.
"""

from __future__ import annotations

import torch

from ..sampling import SamplingBatch, SamplingParams, filtered_probs, uniforms

ACCEPT_SALT = 0x5EC0_1A7E  # seed salt of the acceptance uniforms
DRAFT_SALT = 0x0D4A_F7ED  # seed salt of a draft model's sampling


def token_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each row's request samples from, normalised, in vocabulary order: logits [R, V] ->
    probs [R, V] float32 (temperature, top-k, top-p, min-p applied; one-hot at the argmax for greedy rows).
    Repetition penalty is not applied (requests with one are not speculated)."""
    logits = logits.float()
    vocab = logits.shape[-1]
    batch = SamplingBatch.build(params, [0] * len(params), [0] * len(params), None, vocab, logits.device)
    greedy = torch.zeros_like(logits).scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
    if batch.all_greedy:
        return greedy
    probs, order = filtered_probs(logits, batch)
    if order is not None:
        probs = torch.zeros_like(probs).scatter_(1, order, probs)
    probs = probs / probs.sum(-1, keepdim=True)
    return torch.where((batch.temperature > 0)[:, None], probs, greedy)


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw of one token per row: probs [R, V] (unnormalised, >= 0), u [R] in [0, 1) -> ids [R]."""
    cdf = torch.cumsum(probs.double(), dim=-1)
    total = cdf[:, -1:]
    x = torch.minimum(u.double()[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, x, right=True).clamp_max(probs.shape[-1] - 1)[:, 0]


def stream_uniforms(seeds: list[int], counters: list[list[int]], salt: int, device) -> torch.Tensor:
    """Uniforms [n, L] for each request's seed (salted) at the given output indices (rows padded equally)."""
    s = torch.tensor(seeds, dtype=torch.long, device=device) ^ salt
    c = torch.tensor(counters, dtype=torch.long, device=device)
    return uniforms(s[:, None].expand_as(c), c)


def verify(p: torch.Tensor, drafts: torch.Tensor, lens: torch.Tensor, q: torch.Tensor | None,
           u_accept: torch.Tensor, u_resample: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept or reject drafts and pick the next token, for n requests at once.

    p [n, K+1, V]: target distributions after the last accepted token and after each draft (rows past a
    request's own ``lens`` + 1 are ignored); drafts [n, K] int64 (padded); lens [n]: drafts per request;
    q [n, K, V]: the distributions the drafts were sampled from, or None for deterministic drafts;
    u_accept [n, K], u_resample [n, K+1]: uniforms in [0, 1).
    Returns (accepted [n]: leading drafts accepted, token [n]: the token emitted after them).
    """
    n, K = drafts.shape
    rows = torch.arange(n, device=p.device)
    p_d = p[:, :K].gather(2, drafts[..., None])[..., 0]
    q_d = torch.ones_like(p_d) if q is None else q.gather(2, drafts[..., None])[..., 0]
    in_range = torch.arange(K, device=p.device)[None] < lens[:, None]
    ok = (u_accept * q_d < p_d) & in_range  # u < min(1, p/q), division-free
    accepted = ok.long().cumprod(1).sum(1)
    p_m = p[rows, accepted]
    rejected = accepted < lens
    at = accepted.clamp_max(K - 1)
    if q is None:
        residual = p_m.scatter(1, drafts[rows, at][:, None], 0.0)
    else:
        residual = (p_m - q[rows, at]).clamp_min(0.0)
    # p == q leaves no residual mass, but then a rejection has probability 0: only rounding gets here
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_m)
    dist = torch.where(rejected[:, None], residual, p_m)
    return accepted, draw(dist, u_resample[rows, accepted])
