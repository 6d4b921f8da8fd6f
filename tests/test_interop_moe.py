"""The mixture-of-experts sub-layer (``E``): routing, the per-expert dispatch against a naive per-token
loop, gradients, config validation and round trip, and its place in the model's accounting."""

import dataclasses

import pytest
import torch
from conftest import rel_err

from hybrid import ConfigError, HybridConfig, HybridLM, MLPConfig, MoEConfig
from hybrid.layers.moe import MoE, moe_reference

D = 32


def make_moe(**kw) -> MoE:
    cfg = HybridConfig(vocab_size=64, d_model=D, pattern="E", moe=MoEConfig(d_ff=48, **kw)).moe
    moe = MoE(D, cfg)
    moe.reset_special_parameters(std=0.2)
    return moe


@pytest.mark.parametrize("kw", [
    dict(n_experts=4, top_k=2),
    dict(n_experts=8, top_k=1),
    dict(n_experts=6, top_k=3, normalize_top_k=True),
    dict(n_experts=4, top_k=4),  # every expert active: a dense mixture
    dict(n_experts=4, top_k=2, gated=False, activation="relu2"),
])
def test_moe_matches_per_token_loop(kw):
    moe = make_moe(**kw)
    x = torch.randn(3, 7, D)
    with torch.no_grad():
        out, ref = moe(x), moe_reference(moe, x)
    assert out.shape == x.shape
    assert rel_err(out, ref) < 1e-6


def test_moe_accepts_any_leading_shape():
    """The packed inference path applies stateless sub-layers token-wise on [T, D]."""
    moe = make_moe(n_experts=4, top_k=2)
    x = torch.randn(2, 5, D)
    assert torch.equal(moe(x.reshape(10, D)), moe(x).reshape(10, D))
    assert moe(x[0, 0]).shape == (D,)


def test_routing_weights_follow_softmax_top_k():
    moe = make_moe(n_experts=5, top_k=2)
    x = torch.randn(11, D)
    w, e = moe.route(x)
    probs = torch.softmax(x @ moe.router.weight.t(), -1)
    top = probs.topk(2, -1)
    assert torch.equal(e, top.indices)
    assert torch.allclose(w, top.values)
    assert (w.sum(-1) < 1).all()  # Jamba keeps the raw probabilities
    wn, _ = make_moe(n_experts=5, top_k=2, normalize_top_k=True).route(x)
    assert torch.allclose(wn.sum(-1), torch.ones(11))


def test_each_expert_runs_only_on_its_tokens(monkeypatch):
    moe = make_moe(n_experts=8, top_k=2)
    x = torch.randn(40, D)
    _, experts = moe.route(x)
    seen = {}
    orig = moe.expert

    def spy(e, xs):
        seen[e] = xs.shape[0]
        return orig(e, xs)

    monkeypatch.setattr(moe, "expert", spy)
    moe(x)
    expected = torch.bincount(experts.reshape(-1), minlength=8)
    assert seen == {e: int(n) for e, n in enumerate(expected) if n}
    assert sum(seen.values()) == 40 * 2


def test_gradients_reach_router_and_routed_experts():
    moe = make_moe(n_experts=4, top_k=2)
    x = torch.randn(2, 9, D, requires_grad=True)
    moe(x).square().sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    assert moe.router.weight.grad.abs().sum() > 0
    _, experts = moe.route(x.detach().reshape(-1, D))
    for p in (moe.gate_proj, moe.up_proj, moe.down_proj):
        for e in range(4):
            used = bool((experts == e).any())
            assert (p.grad[e].abs().sum() > 0) == used


def test_grads_match_reference():
    moe = make_moe(n_experts=4, top_k=2)
    x = torch.randn(6, D)
    params = [moe.router.weight, moe.gate_proj, moe.up_proj, moe.down_proj]
    g1 = torch.autograd.grad(moe(x).sum(), params)
    g2 = torch.autograd.grad(moe_reference(moe, x).sum(), params)
    for a, b in zip(g1, g2, strict=True):
        assert rel_err(a, b) < 1e-5


@pytest.mark.parametrize("bad, msg", [
    (dict(n_experts=4, top_k=5), "top_k"),
    (dict(n_experts=4, top_k=0), "top_k"),
    (dict(n_experts=0, top_k=1), "n_experts"),
    (dict(activation="tanh"), "activation"),
    (dict(d_ff=0), "d_ff"),
])
def test_invalid_moe_config_is_refused(bad, msg):
    with pytest.raises(ConfigError, match=msg):
        HybridConfig(vocab_size=64, d_model=D, pattern="mE", moe=MoEConfig(**bad))


def test_moe_config_round_trips_and_derives_width():
    cfg = HybridConfig(vocab_size=64, d_model=D, pattern="mE*-",
                       moe=MoEConfig(n_experts=6, top_k=3, normalize_top_k=True))
    assert cfg.moe.d_ff == 64 * -(-8 * D // 3 // 64)
    assert HybridConfig.from_json(cfg.to_json()) == cfg
    # a pattern without E does not validate the unused MoE section
    HybridConfig(vocab_size=64, d_model=D, pattern="m-", moe=MoEConfig(n_experts=2, top_k=3))


def test_model_with_moe_counts_active_experts_and_all_parameters():
    cfg = HybridConfig(vocab_size=64, d_model=D, pattern="mE*-", tie_embeddings=True, mlp=MLPConfig(d_ff=48),
                       moe=MoEConfig(n_experts=8, top_k=2, d_ff=48))
    model = HybridLM(cfg)
    moe = model.layers[1].mixer
    expert_params = 3 * 8 * D * 48
    assert moe.gate_proj.numel() + moe.up_proj.numel() + moe.down_proj.numel() == expert_params
    dense = HybridLM(dataclasses.replace(cfg, pattern="m-*-"))
    # parameters: all 8 experts + router, instead of one MLP
    assert model.num_parameters() - dense.num_parameters() == expert_params - 3 * D * 48 + 8 * D
    # FLOPs: 2 active experts + the router, instead of one MLP
    assert model.flops_per_token(16) - dense.flops_per_token(16) == pytest.approx(2 * (3 * D * 48 + 8 * D))
    # initialised (not left as torch.empty garbage) and trainable end to end
    assert moe.up_proj.std().item() == pytest.approx(cfg.initializer_range, rel=0.2)
    ids = torch.randint(0, 64, (2, 12))
    model.loss(ids).backward()
    assert moe.router.weight.grad.abs().sum() > 0
