"""``HybridLM.forward(ids, logits_to_keep=...)``: the kept rows are exactly the full forward's rows."""

import pytest
import torch

import hybrid
from hybrid import HybridConfig, HybridLM, Mamba2Config, recipes

# every mixer kind (Mamba-2 with n_groups > 1, Mamba-1, attention with partial RoPE) and an MLP
ALL_KINDS = HybridConfig(vocab_size=64, d_model=32, pattern="M-m-*-",
                         attention=hybrid.AttentionConfig(n_heads=4, n_kv_heads=2, rotary_fraction=0.5),
                         mamba2=Mamba2Config(head_dim=16, d_state=8, n_groups=2, chunk_size=8),
                         mamba1=hybrid.Mamba1Config(d_state=4))


@pytest.mark.parametrize("cfg", [ALL_KINDS, recipes.get("jamba-moe-tiny")], ids=["M-m-*-", "jamba-moe"])
def test_kept_logits_equal_the_last_rows_of_the_full_forward(cfg: HybridConfig):
    model = HybridLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 37))
    with torch.no_grad():
        full = model(ids)
        assert full.shape == (2, 37, cfg.vocab_size)
        assert torch.equal(model(ids, logits_to_keep=0), full)
        for n in (1, 5, 37):
            kept = model(ids, logits_to_keep=n)
            assert kept.shape == (2, n, cfg.vocab_size)
            # the LM head runs on fewer rows: a matmul may block its sums differently, so rounding-level only
            torch.testing.assert_close(kept, full[:, -n:], rtol=1e-5, atol=1e-5)
        picked = model(ids, logits_to_keep=torch.tensor([3, 0, -1]))
        torch.testing.assert_close(picked, full[:, [3, 0, 36]], rtol=1e-5, atol=1e-5)


def test_kept_logits_carry_gradients_to_every_layer():
    model = HybridLM(ALL_KINDS)
    ids = torch.randint(0, ALL_KINDS.vocab_size, (1, 12))
    model(ids, logits_to_keep=1).sum().backward()
    assert all(p.grad is not None for p in model.layers.parameters())


def test_bad_logits_to_keep_is_rejected_with_what_to_give():
    model = HybridLM(recipes.get("llama-tiny"))
    ids = torch.randint(0, 256, (1, 8))
    with pytest.raises(ValueError, match=r"logits_to_keep=9 for a 8-token input: give 0 .* or 1..8"):
        model(ids, logits_to_keep=9)
    with pytest.raises(ValueError, match="logits_to_keep=-1"):
        model(ids, logits_to_keep=-1)
    with pytest.raises(TypeError, match="must be an int .* got float"):
        model(ids, logits_to_keep=1.0)
    with pytest.raises(TypeError, match="got bool"):
        model(ids, logits_to_keep=True)
    with pytest.raises(ValueError, match="outside the 8 input positions"):
        model(ids, logits_to_keep=torch.tensor([8]))
    with pytest.raises(ValueError, match="1-D integer positions"):
        model(ids, logits_to_keep=torch.tensor([[0]]))
