import json

import pytest
import torch

import hybrid
from hybrid import CheckpointError, HybridConfig, HybridLM, Mamba2Config, recipes

TINY = [n for n in recipes.names() if n.endswith("-tiny")]
ALL_KINDS = HybridConfig(vocab_size=64, d_model=32, pattern="M-m-*-",
                         attention=hybrid.AttentionConfig(n_heads=4, n_kv_heads=2, rotary_fraction=0.5),
                         mamba2=Mamba2Config(head_dim=16, d_state=8, n_groups=2, chunk_size=8),
                         mamba1=hybrid.Mamba1Config(d_state=4))


@pytest.mark.parametrize("name", TINY)
def test_causality(name):
    """Changing token t never changes the logits before t."""
    model = HybridLM(recipes.get(name)).eval()
    ids = torch.randint(0, 256, (2, 40))
    t = 23
    changed = ids.clone()
    changed[:, t] = (changed[:, t] + 1) % 256
    with torch.no_grad():
        a, b = model(ids), model(changed)
    assert torch.equal(a[:, :t], b[:, :t])
    assert not torch.allclose(a[:, t:], b[:, t:])


@pytest.mark.parametrize("name", TINY)
def test_batch_rows_are_independent(name):
    model = HybridLM(recipes.get(name)).eval()
    ids = torch.randint(0, 256, (3, 21))
    with torch.no_grad():
        full = model(ids)
        alone = model(ids[1:2])
    assert torch.allclose(full[1:2], alone, atol=1e-5, rtol=1e-5)


def test_tiny_model_overfits_and_every_parameter_gets_gradient():
    model = HybridLM(ALL_KINDS)
    ids = torch.randint(0, 64, (4, 24))
    loss0 = model.loss(ids)
    loss0.backward()
    no_grad = [n for n, p in model.named_parameters() if p.grad is None or p.grad.abs().sum() == 0]
    assert not no_grad, f"parameters without gradient: {no_grad}"
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(150):
        opt.zero_grad()
        loss = model.loss(ids)
        loss.backward()
        opt.step()
    assert loss.item() < 0.2 * loss0.item(), (loss0.item(), loss.item())


def test_loss_respects_ignore_index():
    model = HybridLM(ALL_KINDS)
    ids = torch.randint(0, 64, (2, 10))
    labels = ids.clone()
    labels[:, :5] = -100
    logits = model(ids)[:, 4:-1]
    expect = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), ids[:, 5:].reshape(-1))
    assert torch.allclose(model.loss(ids, labels), expect, atol=1e-6)


@pytest.mark.parametrize("name", ["hybrid-1to7-tiny", "samba-tiny", "nemotronh-tiny"])
@pytest.mark.parametrize("tie", [False, True])
def test_save_load_round_trip_is_bit_identical(name, tie, tmp_path):
    import dataclasses
    cfg = dataclasses.replace(recipes.get(name), tie_embeddings=tie)
    model = HybridLM(cfg).eval()
    hybrid.save_pretrained(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["format"] == "hybrid-lm"
    for loaded in (hybrid.from_pretrained(tmp_path),):
        assert loaded.config == cfg
        ids = torch.randint(0, 256, (2, 19))
        with torch.no_grad():
            assert torch.equal(model(ids), loaded(ids))


def test_load_lists_missing_unexpected_and_misshaped(tmp_path):
    from safetensors.torch import load_file, save_file
    model = HybridLM(recipes.get("hybrid-1to7-tiny"))
    hybrid.save_pretrained(model, tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["layers.0.mixer.A_log"]
    state["layers.99.mixer.bogus"] = torch.zeros(3)
    state["norm_f.weight"] = torch.zeros(7)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="checksums.json"):  # the rewritten file no longer matches its checksum
        hybrid.from_pretrained(tmp_path)
    with pytest.raises(CheckpointError) as err:  # past the checksum: what the tensors themselves say is wrong
        hybrid.from_pretrained(tmp_path, verify=False)
    msg = str(err.value)
    assert "missing tensors (1): layers.0.mixer.A_log" in msg
    assert "unexpected tensors (1): layers.99.mixer.bogus" in msg
    assert "norm_f.weight: checkpoint (7,) vs model (64,)" in msg


def test_load_errors_on_non_checkpoints(tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        hybrid.from_pretrained(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="has no config.json"):
        hybrid.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="names no architecture"):
        hybrid.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(CheckpointError, match="architecture 'GPT2LMHeadModel' is not supported"):
        hybrid.from_pretrained(tmp_path)


def test_token_ids_out_of_range_are_rejected():
    model = HybridLM(recipes.get("llama-tiny"))
    with pytest.raises(ValueError, match="token id 256 is out of range for vocab_size 256"):
        model(torch.tensor([[1, 256]]))
    with pytest.raises(ValueError, match="token id -1"):
        model(torch.tensor([[-1, 2]]))
    with pytest.raises(ValueError, match=r"\[batch, length\]"):
        model(torch.tensor([1, 2]))


def test_accounting():
    llama = HybridLM(recipes.get("llama-tiny"))
    hyb = HybridLM(recipes.get("hybrid-1to7-tiny"))
    a = llama.config.attention
    assert llama.kv_bytes_per_token(torch.bfloat16) == 4 * 2 * a.n_kv_heads * a.head_dim * 2
    assert llama.state_bytes_per_sequence() == 0
    assert hyb.kv_bytes_per_token(torch.bfloat16) == 1 * 2 * a.n_kv_heads * a.head_dim * 2
    m2 = hyb.config.mamba2
    assert hyb.state_bytes_per_sequence(torch.float32) == 7 * 4 * (
        m2.n_heads * m2.head_dim * m2.d_state + (m2.d_conv - 1) * m2.conv_dim)
    # attention cost grows with context, Mamba cost does not
    assert llama.flops_per_token(4096) > llama.flops_per_token(512)
    mamba = HybridLM(recipes.get("mamba2-tiny"))
    assert mamba.flops_per_token(4096) == mamba.flops_per_token(512)
    # a sliding window caps the context term
    samba = HybridLM(recipes.get("samba-tiny"))
    assert samba.flops_per_token(4096) == pytest.approx(samba.flops_per_token(8192), rel=1e-2)
    assert llama.num_parameters() - llama.num_parameters(exclude_embeddings=True) == 256 * 64


@pytest.mark.parametrize("family", ["llama", "mamba2", "mamba1", "hybrid-1to7", "jamba", "nemotronh", "samba"])
def test_small_recipes_are_about_100m(family):
    with torch.device("meta"):
        model = HybridLM(recipes.get(f"{family}-small"))
    assert 80e6 < model.num_parameters() < 125e6
