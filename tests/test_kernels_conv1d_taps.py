"""The torch causal conv's inference paths (oneDNN's fused depthwise convolution, and the in-place taps where
oneDNN cannot take the dtype) and its concatenated form (autograd) all equal the reference: with and without
a state, bias and activation, prompts shorter than the window, strided input."""

import pytest
import torch
from conftest import rel_err
from hybrid.kernels import conv1d

from hybrid import kernels


@pytest.mark.parametrize("L", [1, 3, 4, 17])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("onednn", [True, False])
def test_conv_taps_equal_the_reference_with_and_without_autograd(monkeypatch, L, with_state, with_bias, activation,
                                                                 onednn):
    if onednn and not conv1d._onednn_conv_available():
        pytest.skip("this torch build has no oneDNN")
    monkeypatch.setattr(conv1d, "_onednn_conv_available", lambda: onednn)
    K, Cn = 4, 6
    wide = torch.randn(2, L, 3 * Cn)
    x = wide[..., Cn:2 * Cn]  # a strided view, as the in_proj split hands it over
    w = torch.randn(Cn, K)
    b = torch.randn(Cn) if with_bias else None
    st = torch.randn(2, Cn, K - 1) if with_state else None
    y_ref, s_ref = kernels.causal_conv1d_ref(x, w, b, initial_state=st, activation=activation)
    with torch.inference_mode():
        y, s = kernels.causal_conv1d(x, w, b, initial_state=st, activation=activation)
    assert rel_err(y, y_ref) < 1e-6 and torch.equal(s, s_ref)
    xg = x.detach().clone().requires_grad_()
    y_g, s_g = kernels.causal_conv1d(xg, w, b, initial_state=st, activation=activation)
    assert rel_err(y_g.detach(), y_ref) < 1e-6 and torch.equal(s_g.detach(), s_ref)
    y_g.sum().backward()
    xr = x.detach().clone().requires_grad_()
    kernels.causal_conv1d_ref(xr, w, b, initial_state=st, activation=activation)[0].sum().backward()
    assert rel_err(xg.grad, xr.grad) < 1e-6


@pytest.mark.parametrize("with_state", [False, True])
def test_onednn_conv_in_bf16_rounds_once(with_state):
    """Where the CPU multiplies bf16 natively the convolution runs in bf16 with the silu fused before its one
    rounding: within one bf16 rounding of the fp32 reference on the same bf16 inputs, across several rows."""
    if not (conv1d._onednn_conv_available() and kernels.compute_dtype.cpu_has_native_bf16()):
        pytest.skip("needs oneDNN and a CPU with native bf16")
    K, Cn, L = 4, 40, 33
    x = torch.randn(3, L, Cn).bfloat16()
    w, b = torch.randn(Cn, K).bfloat16(), torch.randn(Cn).bfloat16()
    st = torch.randn(3, Cn, K - 1).bfloat16() if with_state else None
    exact, s_ref = kernels.causal_conv1d_ref(x.float(), w, b, initial_state=None if st is None else st.float(),
                                             activation="silu")
    with torch.inference_mode():
        y, s = kernels.causal_conv1d(x, w, b, initial_state=st, activation="silu")
    assert y.dtype == torch.bfloat16 and torch.equal(s, s_ref.bfloat16())
    # fp32 accumulation, one rounding: at most one bf16 ulp (2^-8 relative) from the exact value
    assert bool(((y.float() - exact).abs() <= exact.abs() * 2**-8 + 1e-6).all())
