"""The Gated DeltaNet layer (``G``) against the kernels' token-by-token reference, and its config checks.
The engine invariants (greedy = forward, packed = alone, chunked prefill, preemption, prefix caching,
speculation) run for gdn-tiny and qwen3next-like-tiny through the recipe-parametrized tests."""

import pytest
import torch
import torch.nn.functional as F

from hybrid import kernels, recipes
from hybrid.config import ConfigError, GatedDeltaNetConfig, HybridConfig
from hybrid.layers.gated_deltanet import GatedDeltaNet


def _loop(layer: GatedDeltaNet, u: torch.Tensor) -> torch.Tensor:
    """The layer written out token by token: conv by hand, the delta rule through gated_delta_ref."""
    qkv, z, b, a = layer.split_projection(layer.in_proj(u))
    K = layer.conv1d.weight.shape[-1]
    x = F.pad(qkv.transpose(1, 2), (K - 1, 0))
    conv = F.conv1d(x, layer.conv1d.weight, layer.conv1d.bias, groups=qkv.shape[-1])
    q, k, v = layer.split_qkv(F.silu(conv).transpose(1, 2))
    g, beta = layer.gates(b, a)
    o, _ = kernels.gated_delta_ref(q, k, v, g, beta)
    return layer._out(o, z)


def test_forward_equals_token_by_token_reference():
    torch.manual_seed(0)
    cfg = recipes.get("gdn-tiny")
    layer = GatedDeltaNet.from_config(cfg).eval()
    u = torch.randn(2, 37, cfg.d_model)  # chunks of 16: two whole, one partial
    with torch.no_grad():
        ref, out = _loop(layer, u), layer(u)
    assert (out - ref).abs().max() / ref.abs().max() < 1e-5


def test_heads_not_dividing_are_refused_by_name():
    with pytest.raises(ConfigError, match="gated_deltanet.n_heads"):
        HybridConfig(vocab_size=32, d_model=32, pattern="G",
                     gated_deltanet=GatedDeltaNetConfig(n_heads=6, n_k_heads=4))
