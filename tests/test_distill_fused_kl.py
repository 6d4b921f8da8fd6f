"""The fused LM-head KL (hybrid.distill.fused_kl): the same value and gradients as autograd through the unfused
loss (whole-vocab logits, log-softmax, KL), for the hidden states and for a trained head, eager and compiled."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybrid.distill.fused_kl import compile_available, linear_kl_sum


def _case(n=37, d=16, V=301, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    ws = (torch.randn(V, d, generator=g) * 0.5).to(dtype)
    wt = (torch.randn(V, d, generator=g) * 0.5).to(dtype)
    hs = torch.randn(n, d, generator=g).to(dtype)
    ht = torch.randn(n, d, generator=g).to(dtype)
    return hs, ws, ht, wt


def _unfused(hs, ws, ht, wt):
    hs, ws = hs.detach().requires_grad_(), ws.detach().requires_grad_()
    lp_t = F.log_softmax((ht @ wt.T).float(), -1)
    kl = F.kl_div(F.log_softmax((hs @ ws.T).float(), -1), lp_t, log_target=True, reduction="sum")
    (kl * 0.37).backward()  # an upstream scale, as the mean over tokens is
    return float(kl.detach()), hs.grad, ws.grad


def _fused(hs, ws, ht, wt, chunk, compiled):
    hs, ws = hs.detach().requires_grad_(), ws.detach().requires_grad_()
    kl = linear_kl_sum(hs, ws, ht, wt, chunk=chunk, compiled=compiled)
    (kl * 0.37).backward()
    return float(kl.detach()), hs.grad, ws.grad


def _close(a, b, rel):
    return (a - b).abs().max().item() <= rel * b.abs().max().item()


@pytest.mark.parametrize("chunk", [1, 8, 37, 64])  # one row, chunks cutting rows, one exact chunk, past the end
def test_fused_kl_equals_the_unfused_loss_and_gradients(chunk):
    case = _case()
    kl_ref, gh_ref, gw_ref = _unfused(*case)
    kl, gh, gw = _fused(*case, chunk, compiled=False)
    # fp32 throughout: the same sums in another order
    assert abs(kl - kl_ref) <= 1e-6 * kl_ref, (kl, kl_ref)
    assert _close(gh, gh_ref, 1e-5) and _close(gw, gw_ref, 1e-5)


def test_fused_kl_of_identical_models_is_zero_with_zero_gradient():
    hs, ws, _, _ = _case()
    kl, gh, gw = _fused(hs, ws, hs, ws, 8, compiled=False)
    assert abs(kl) < 1e-4 and gh.abs().max() < 1e-6 and gw.abs().max() < 1e-6


def test_fused_kl_bf16_tracks_fp32():
    """bf16 heads and hidden states (the training dtype): the logits are rounded to bf16 like the unfused
    path's, the softmaxes and the KL are fp32; against the fp32 loss the difference is bf16's rounding (measured
    when written: 2.2e-4 relative on the KL, 8.5e-3 of the largest gradient, about one bf16 step)."""
    case32 = _case()
    kl32, gh32, _ = _fused(*case32, 16, compiled=False)
    kl16, gh16, gw16 = _fused(*(t.bfloat16() for t in case32), 16, compiled=False)
    assert gh16.dtype == gw16.dtype == torch.bfloat16
    assert abs(kl16 - kl32) <= 1e-3 * kl32 and _close(gh16.float(), gh32, 2e-2)


def test_fused_kl_rejects_mismatched_shapes():
    hs, ws, ht, wt = _case()
    with pytest.raises(ValueError, match="heads"):
        linear_kl_sum(hs, ws, ht[:, :4], wt)
    with pytest.raises(ValueError, match="chunk"):
        linear_kl_sum(hs, ws, ht, wt, chunk=0)


@pytest.mark.skipif(not compile_available(), reason="Inductor cannot compile here (no C++ compiler)")
def test_compiled_chunk_math_equals_eager():
    case = _case(n=32, V=640)
    kl_e, gh_e, gw_e = _fused(*case, 16, compiled=False)
    kl_c, gh_c, gw_c = _fused(*case, 16, compiled=True)
    assert abs(kl_c - kl_e) <= 1e-6 * kl_e and _close(gh_c, gh_e, 1e-5) and _close(gw_c, gw_e, 1e-5)
