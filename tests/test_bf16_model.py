"""Whole models in bf16 against the same model in fp32.

The yardstick is bf16's own rounding noise, measured, not a loosened fp32 tolerance: the same bf16
model run with every scan and conv replaced by its fp32 token-by-token reference (``*_ref``, which
upcasts inside and rounds only its output) carries just the unavoidable bf16 rounding of weights and
activations. The fast bf16 path may add rounding of its own, never more than a fraction of that.
"""

import copy

import pytest
import torch

from hybrid import HybridLM, kernels, recipes


def _reference_kernels(monkeypatch):
    def ssd(x, dt, A, B, C, *, chunk_size, D=None, initial_state=None):
        return kernels.ssd_scan_ref(x, dt, A, B, C, D=D, initial_state=initial_state)

    def selective(x, dt, A, B, C, *, D=None, initial_state=None):
        return kernels.selective_scan_ref(x, dt, A, B, C, D=D, initial_state=initial_state)

    monkeypatch.setattr(kernels, "ssd_chunk_scan", ssd)
    monkeypatch.setattr(kernels, "selective_scan", selective)
    monkeypatch.setattr(kernels, "causal_conv1d", kernels.causal_conv1d_ref)
    monkeypatch.setattr(kernels, "gated_delta_chunk", lambda q, k, v, g, beta, *, chunk_size, **kw:
                        kernels.gated_delta_ref(q, k, v, g, beta, **kw))
    monkeypatch.setattr(kernels, "gla_chunk", lambda q, k, v, g, *, chunk_size, **kw: kernels.gla_ref(q, k, v, g, **kw))
    monkeypatch.setattr(kernels, "causal_attention", kernels.causal_attention_ref)


@pytest.mark.parametrize("recipe", ["mamba2-tiny", "hybrid-1to7-tiny", "jamba-moe-tiny", "mamba1-tiny",
                                    "nemotronh-tiny", "gdn-tiny", "gla-tiny", "gla-hybrid-tiny"])
def test_bf16_logits_within_bf16_noise_of_fp32(monkeypatch, recipe):
    model = HybridLM(recipes.get(recipe)).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 75))  # several SSD chunks (16), a partial last one
    m16 = copy.deepcopy(model).to(torch.bfloat16)
    with torch.inference_mode():
        exact = model(ids).float()
        fast = m16(ids)
        with monkeypatch.context() as mp:
            _reference_kernels(mp)
            careful = m16(ids).float()
    assert fast.dtype == torch.bfloat16
    err_fast = (fast.float() - exact).abs()
    err_noise = (careful - exact).abs()
    scale = exact.abs().max()
    # bf16 really did run: the noise is bf16-sized (2^-8 relative), far above fp32's
    assert 1e-4 < float(err_noise.max() / scale) < 2**-3
    assert float(err_fast.mean()) <= 1.25 * float(err_noise.mean())
    assert float(err_fast.max()) <= 1.5 * float(err_noise.max())
