"""The CPU blocked attention (kernels/attention_blocked.py) against the naive reference: fp32 exact over
windows, query offsets (prefill on top of cached keys), GQA and block edges; bf16 within bf16's own rounding
of the exact result even when scores are large, which an unshifted bf16 score matrix is not."""

import pytest
import torch
from conftest import rel_err
from hybrid.kernels import attention_blocked
from hybrid.kernels.compute_dtype import cpu_has_native_bf16

from hybrid import kernels


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(attention_blocked, "BLOCK_Q", 8)  # several blocks, a partial last one


@pytest.mark.parametrize("Lq,Lk", [(37, 37), (13, 50), (1, 21)])
@pytest.mark.parametrize("window", [None, 1, 5, 16, 100])
@pytest.mark.parametrize("heads", [(4, 2), (3, 3)])
def test_fp32_equals_the_reference(small_blocks, Lq, Lk, window, heads):
    Hq, Hkv = heads
    q = torch.randn(2, Lq, Hq, 16)
    k, v = torch.randn(2, Lk, Hkv, 16), torch.randn(2, Lk, Hkv, 16)
    out = attention_blocked.blocked_causal_attention(q, k, v, window=window, scale=0.3)
    ref = kernels.causal_attention_ref(q, k, v, window=window, scale=0.3)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("shift", [False, True])
def test_fp32_shift_changes_nothing(small_blocks, shift):
    q, k, v = torch.randn(1, 30, 4, 8), torch.randn(1, 30, 2, 8), torch.randn(1, 30, 2, 8)
    out = attention_blocked.blocked_causal_attention(q, k, v, window=7, shift=shift)
    assert rel_err(out, kernels.causal_attention_ref(q, k, v, window=7)) < 1e-5


def _flash_style(q, k, v):
    """What flash-attention does on a GPU in bf16: fp32 scores and softmax, the weights rounded to bf16 for
    the P.V product (fp32 accumulation), the output rounded once: the yardstick for a bf16 attention."""
    rep = q.shape[2] // k.shape[2]
    kf, vf = (t.float().repeat_interleave(rep, dim=2) for t in (k, v))
    s = torch.einsum("blhd,bshd->bhls", q.float(), kf) * q.shape[-1] ** -0.5
    L = q.shape[1]
    s = s.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
    p = torch.softmax(s, dim=-1).bfloat16().float()
    return torch.einsum("bhls,bshd->blhd", p, vf).bfloat16()


def test_bf16_as_exact_as_fp32_scores_with_large_scores(small_blocks):
    """Scores of std ~12 (up to ~40): with the shift, bf16 scores are as good as fp32 ones (the error of the
    flash-attention recipe: fp32 scores, bf16 weights); scoring once in bf16 (no shift) is clearly worse —
    the error the shift exists to remove."""
    torch.manual_seed(1)
    q = (torch.randn(1, 64, 4, 32) * 3.5).bfloat16()
    k = (torch.randn(1, 64, 2, 32) * 3.5).bfloat16()
    v = torch.randn(1, 64, 2, 32).bfloat16()
    exact = kernels.causal_attention_ref(q.float(), k.float(), v.float())
    shifted = attention_blocked.blocked_causal_attention(q, k, v, shift=True)
    plain = attention_blocked.blocked_causal_attention(q, k, v, shift=False)
    assert shifted.dtype == torch.bfloat16

    def err(t):
        return float((t.float() - exact).abs().mean())

    assert err(shifted) <= 1.25 * err(_flash_style(q, k, v))
    assert err(plain) > 1.5 * err(shifted)


def test_dispatch_takes_it_for_native_bf16_and_windows(monkeypatch):
    calls = []
    real = attention_blocked.blocked_causal_attention
    monkeypatch.setattr(kernels.attention, "blocked_causal_attention",
                        lambda *a, **kw: calls.append(a[0].dtype) or real(*a, **kw))
    q, k, v = torch.randn(1, 20, 2, 8), torch.randn(1, 20, 2, 8), torch.randn(1, 20, 2, 8)
    with torch.inference_mode():
        kernels.causal_attention(q, k, v)  # fp32, no window: SDPA
        kernels.causal_attention(q, k, v, window=4)
        kernels.causal_attention(q.bfloat16(), k.bfloat16(), v.bfloat16())
    expected = [torch.float32] + ([torch.bfloat16] if cpu_has_native_bf16() else [])
    assert calls == expected
    calls.clear()
    kernels.causal_attention(q.requires_grad_(), k, v, window=4)  # autograd: SDPA, which differentiates
    assert calls == []
