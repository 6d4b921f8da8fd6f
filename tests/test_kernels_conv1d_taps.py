"""The torch causal conv's in-place taps (inference) and its concatenated form (autograd) both equal the
reference: with and without a state, bias and activation, prompts shorter than the window, strided input."""

import pytest
import torch
from conftest import rel_err

from hybrid import kernels


@pytest.mark.parametrize("L", [1, 3, 4, 17])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("activation", [None, "silu"])
def test_conv_taps_equal_the_reference_with_and_without_autograd(L, with_state, with_bias, activation):
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
