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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_prompt_in_token_blocks_equals_whole(monkeypatch, dtype):
    """Inference on a prompt longer than the layer's token block runs it a block at a time, the conv and recurrent
    states carried across: the same output as the whole prompt at once (a partial last block included)."""
    from hybrid.layers import gated_deltanet

    torch.manual_seed(0)
    cfg = recipes.get("gdn-tiny")
    layer = GatedDeltaNet.from_config(cfg).to(dtype).eval()
    u = torch.randn(2, 101, cfg.d_model).to(dtype)
    with torch.inference_mode():
        whole = layer(u)
        monkeypatch.setattr(gated_deltanet, "_TOKEN_BLOCK", 2 * cfg.gated_deltanet.chunk_size)
        blocks = layer(u)
        ref = _loop(layer.float(), u.float())
    # not bit for bit: the blocks' smaller batched products may round differently
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert (blocks.float() - whole.float()).abs().max() / whole.float().abs().max() < tol
    assert (blocks.float() - ref).abs().max() / ref.abs().max() < tol


def test_heads_not_dividing_are_refused_by_name():
    with pytest.raises(ConfigError, match="gated_deltanet.n_heads"):
        HybridConfig(vocab_size=32, d_model=32, pattern="G",
                     gated_deltanet=GatedDeltaNetConfig(n_heads=6, n_k_heads=4))
