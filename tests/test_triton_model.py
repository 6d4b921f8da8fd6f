"""The whole model with every op that has a Triton kernel forced onto it matches the torch backend."""

import pytest
import torch
from conftest import rel_err
from hybrid.kernels import dispatch, use_backend
from triton_cases import DEVICE, needs_triton

import hybrid
from hybrid import HybridConfig, HybridLM, Mamba2Config, recipes

pytestmark = needs_triton

# All three mixers (Mamba-2, Mamba-1, attention with GQA and a sliding window) in one tiny model.
CONFIG = HybridConfig(vocab_size=64, d_model=32, pattern="M-m-*-",
                      attention=hybrid.AttentionConfig(n_heads=4, n_kv_heads=2, rotary_fraction=0.5,
                                                       sliding_window=24),
                      mamba2=Mamba2Config(head_dim=16, d_state=8, n_groups=2, chunk_size=8),
                      mamba1=hybrid.Mamba1Config(d_state=4))


def test_triton_model_matches_torch():
    model = HybridLM(CONFIG).to(DEVICE).eval()
    ids = torch.randint(0, 64, (2, 65), device=DEVICE)
    with torch.no_grad():
        with use_backend("torch"):
            ref = model(ids)
        with use_backend("triton"):
            assert dispatch.choose("ssd_chunk_scan", DEVICE)[0] == "triton"
            assert dispatch.choose("causal_attention", DEVICE)[0] == "triton"
            # no Triton selective scan: the forced backend is skipped for it, the default order stands
            assert dispatch.choose("selective_scan", DEVICE)[0] != "triton"
            out = model(ids)
    # each op is within ~1e-6 of the torch path; a few layers and the LM head compound that to ~1e-6-1e-5
    assert rel_err(out, ref) < 1e-4


@pytest.mark.parametrize("name", ["hybrid-1to7-tiny"])
def test_triton_recipe_matches_torch(name):
    model = HybridLM(recipes.get(name)).to(DEVICE).eval()
    ids = torch.randint(0, 256, (1, 40), device=DEVICE)
    with torch.no_grad():
        with use_backend("torch"):
            ref = model(ids)
        with use_backend("triton"):
            out = model(ids)
    assert rel_err(out, ref) < 1e-4
