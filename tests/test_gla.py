"""The GLA layer (``L``) against a token-by-token reference written out here, its cache spec, and its config
checks. The engine invariants (greedy = forward, packed = alone, chunked prefill, preemption, prefix caching,
speculation) run for gla-tiny and gla-hybrid-tiny through the recipe-parametrized tests; compressed states in
test_cache_compression and test_speculative_engine."""

import pytest
import torch
import torch.nn.functional as F

from hybrid import kernels, recipes
from hybrid.cache.specs import CacheDtypes
from hybrid.config import ConfigError, GLAConfig, HybridConfig
from hybrid.layers.gla import GLA


def _loop(layer: GLA, u: torch.Tensor) -> torch.Tensor:
    """The layer as fla writes it, token by token: separate q/k/v/g/gk projections sliced from the fused
    weight, the conv by hand, the decay, the shared heads repeated, the recurrence through gla_ref, the per-head
    RMSNorm then the swish gate."""
    c = layer.cfg
    w = layer.in_proj.weight
    sizes = [c.key_dim, c.kv_key_dim, c.kv_value_dim, layer.gate_dim, c.gate_low_rank_dim]
    wq, wk, wv, wg, wlow = w.split(sizes, dim=0)
    q, k, v = u @ wq.T, u @ wk.T, u @ wv.T
    if c.use_short_conv:
        qkv = torch.cat([q, k, v], -1)
        x = F.pad(qkv.transpose(1, 2), (c.d_conv - 1, 0))
        conv = F.silu(F.conv1d(x, layer.conv1d.weight, layer.conv1d.bias, groups=qkv.shape[-1])).transpose(1, 2)
        q, k, v = conv.split([c.key_dim, c.kv_key_dim, c.kv_value_dim], -1)
    gk = (u @ wlow.T) @ layer.gk_proj.weight.T + layer.gk_proj.bias
    b, L = u.shape[:2]
    H, K, V, G = c.n_heads, c.head_k_dim, c.head_v_dim, c.n_heads // c.n_kv_heads
    q = q.reshape(b, L, H, K)
    k, gk = (x.reshape(b, L, c.n_kv_heads, 1, K).expand(-1, -1, -1, G, -1).reshape(b, L, H, K) for x in (k, gk))
    v = v.reshape(b, L, c.n_kv_heads, 1, V).expand(-1, -1, -1, G, -1).reshape(b, L, H, V)
    gk = F.logsigmoid(gk) / c.gate_logit_normalizer
    if c.clamp_min is not None:
        gk = gk.clamp(min=c.clamp_min)
    o, _ = kernels.gla_ref(q, k, v, gk)
    o = o * torch.rsqrt(o.square().mean(-1, keepdim=True) + c.norm_eps) * layer.norm.weight
    if c.use_output_gate:
        o = o * F.silu((u @ wg.T).reshape(b, L, H, V))
    return layer.out_proj(o.reshape(b, L, H * V))


CONFIGS = {
    "fla defaults": GLAConfig(n_heads=4, chunk_size=16),
    "conv + shared heads": GLAConfig(n_heads=4, n_kv_heads=2, use_short_conv=True, conv_bias=True, chunk_size=16),
    "no output gate, no affine, clamp": GLAConfig(n_heads=2, expand_k=1.0, expand_v=0.5, use_output_gate=False,
                                                  elementwise_affine=False, clamp_min=-0.02, gate_logit_normalizer=2),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_forward_equals_token_by_token_reference(name):
    torch.manual_seed(0)
    cfg = HybridConfig(vocab_size=32, d_model=32, pattern="L", gla=CONFIGS[name])
    layer = GLA.from_config(cfg).eval()
    assert isinstance(layer.norm.weight, torch.nn.Parameter) == cfg.gla.elementwise_affine
    with torch.no_grad():
        if cfg.gla.elementwise_affine:
            layer.norm.weight.copy_(torch.rand_like(layer.norm.weight) + 0.5)
        layer.gk_proj.bias.normal_()  # decays that matter
        u = torch.randn(2, 37, cfg.d_model)  # chunks of 16: two whole, one partial
        ref, out = _loop(layer, u), layer(u)
    assert (out - ref).abs().max() / ref.abs().max() < 1e-5


def test_cache_spec_names_the_state_tensors():
    d = CacheDtypes.for_dtype(torch.float32)
    plain = GLA.cache_spec(recipes.get("gla-tiny"), d)
    assert [t.name for t in plain.states] == ["recurrent"]
    assert plain.states[0].shape == (4, 8, 16) and plain.bytes_per_sequence == 4 * 8 * 16 * 4
    conv = GLA.cache_spec(recipes.get("gla-hybrid-tiny"), d)
    g = recipes.get("gla-hybrid-tiny").gla
    assert [t.name for t in conv.states] == ["conv", "recurrent"]
    assert conv.states[0].shape == (g.conv_dim, 3) and g.conv_dim == 32 + 16 + 32


def test_small_recipe_takes_fla_sizes():
    g = recipes.get("gla-small").gla
    assert (g.n_heads, g.key_dim, g.value_dim, g.head_k_dim, g.head_v_dim) == (4, 384, 768, 96, 192)
    assert recipes.get("gla-small").pattern == "L-" * 12


def test_config_round_trips_through_json():
    cfg = recipes.get("gla-hybrid-tiny")
    again = HybridConfig.from_json(cfg.to_json())
    assert again == cfg and again.gla.key_dim == 32  # the derived size is stated in the saved config


@pytest.mark.parametrize("gla,field", [
    (GLAConfig(n_heads=3), "gla.key_dim"),  # 32 * 0.5 = 16 over 3 heads
    (GLAConfig(n_heads=4, value_dim=30), "gla.value_dim"),
    (GLAConfig(n_heads=4, n_kv_heads=3), "gla.n_heads"),
    (GLAConfig(gate_fn="sigmoid"), "gla.gate_fn"),
    (GLAConfig(feature_map="relu"), "gla.feature_map"),
    (GLAConfig(clamp_min=0.5), "gla.clamp_min"),
    (GLAConfig(gate_logit_normalizer=0), "gla.gate_logit_normalizer"),
    (GLAConfig(use_short_conv=True, d_conv=1), "gla.d_conv"),
])
def test_bad_configs_are_refused_by_name(gla, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        HybridConfig(vocab_size=32, d_model=32, pattern="L", gla=gla)


def test_unknown_option_is_refused_by_name():
    """fla's kernel choice (``mode``) and any other field GLA does not have: refused, naming it."""
    d = recipes.get("gla-tiny").to_dict()
    d["gla"]["mode"] = "fused_chunk"
    with pytest.raises(ConfigError, match=r"unknown gla fields \['mode'\]"):
        HybridConfig.from_dict(d)


def test_unused_section_is_not_validated():
    """A pattern without ``L`` does not check the gla section (as every other kind)."""
    HybridConfig(vocab_size=32, d_model=32, pattern="*-", gla=GLAConfig(n_heads=3))


def test_int8_state_step_is_the_step_on_the_dequantised_state_within_the_code_bound():
    """Compressed state: a GLA step on an int8 pool (its spec's groups: one scale per head and key row) is the fp32
    step on the dequantised rows, re-quantised: output equal, new state within half a code of each row's scale."""
    from hybrid.cache import StatePool

    cfg = recipes.get("gla-tiny")
    spec = GLA.cache_spec(cfg, CacheDtypes.for_dtype(torch.float32, ssm=torch.int8)).states[0]
    assert spec.dtype == torch.int8 and spec.groups == 4 * 8
    pool = StatePool(spec.shape, spec.dtype, 5, spec.groups)
    slots = torch.tensor([4, 1])
    pool.write(slots, torch.randn(2, *spec.shape) * torch.tensor([0.01, 1.0, 10.0, 100.0])[None, :, None, None])
    before = pool.read(slots).clone()
    q, k, g = torch.randn(2, 4, 8), torch.randn(2, 4, 8), F.logsigmoid(torch.randn(2, 4, 8)) / 16
    v = torch.randn(2, 4, 16)
    y = pool.step(kernels.gla_step, q, k, v, g, slots=slots)
    expect = before.clone()
    y_ref = kernels.gla_step_ref(expect, q, k, v, g)
    torch.testing.assert_close(y, y_ref)
    bound = 0.5 * expect.abs().amax(-1, keepdim=True) / 127  # per (head, key row), the spec's groups
    assert ((pool.read(slots) - expect).abs() <= bound * (1 + 1e-5) + 1e-7).all()
    assert pool.data.dtype == torch.int8 and not torch.equal(pool.read(slots), expect)  # really re-quantised
