"""The decode program (hybrid/decode/ and each layer's lower_decode, kernels/native/program.c and
linear_attention.c) on Gated DeltaNet and GLA models: the whole step native, each sub-layer the eager layer's
bits in bf16, the logits the eager blocks', greedy decode the full forward's, a packed batch each sequence alone;
hl_gla_step against gla_step_ref; configs the ops do not take refused by name."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from decode_hooks import eager_step_logits, no_native_steps, sublayer_ops, whole_step_logits
from hybrid.kernels import gla, native, use_backend
from hybrid.kernels.native import ops
from test_native_decode import _greedy, _noise

from hybrid import HybridLM, recipes

pytestmark = pytest.mark.skipif(native.available() is not None, reason=f"native kernels: {native.available()}")

RECIPES = ["gdn-tiny", "qwen3next-like-tiny", "gla-tiny", "gla-hybrid-tiny"]


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K,V", [(8, 16), (5, 19), (64, 128)])  # the AVX2 loop, its scalar tail, a small model's
def test_gla_step_matches_reference(dtype, state_dtype, K, V):
    g_ = torch.Generator().manual_seed(K * V)
    n, H = 3, 4
    q, k, v = (torch.randn(n, H, d, generator=g_).to(dtype) for d in (K, K, V))
    g = -torch.rand(n, H, K, generator=g_) * 0.5
    pool = torch.randn(6, H, K, V, generator=g_).to(state_dtype)
    slots = torch.tensor([4, 0, 2])
    start = pool[slots].float()
    expect = start.clone()
    y_ref = gla.gla_step_ref(expect, q, k, v, g, scale=0.3)  # (steps expect in place)
    assert ops.supports_gla_step(pool, q, k, v, g, scale=0.3, slots=slots) is None
    untouched = pool[[1, 3, 5]].clone()
    y = ops.gla_step(pool, q, k, v, g, scale=0.3, slots=slots)
    assert y.dtype == dtype and torch.equal(pool[[1, 3, 5]], untouched)
    # fp32: summation order only; bf16 inputs/outputs: one rounding of the output; a bf16 state: one of each
    # stored element (the reference keeps fp32)
    s_tol = 1e-5 + 2 * _noise(expect, state_dtype)
    assert (pool[slots].float() - expect).abs().max() <= s_tol
    y_tol = 1e-5 + 2 * _noise(y_ref, dtype) + (0 if state_dtype == torch.float32 else 2 * _noise(y_ref, torch.bfloat16))
    assert (y.float() - y_ref.float()).abs().max() <= y_tol
    if state_dtype == torch.float32 and dtype == torch.float32:  # and the dispatch takes the native step
        pool2 = torch.zeros(6, H, K, V)
        pool2[slots] = start
        assert torch.equal(gla.gla_step(pool2, q, k, v, g, scale=0.3, slots=slots), y)


def _tiny(recipe: str, dtype=torch.float32, **changes) -> HybridLM:
    torch.manual_seed(0)
    cfg = recipes.get(recipe)
    for section, fields in changes.items():
        cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **fields)})
    model = HybridLM(cfg).to(dtype).eval()
    with torch.no_grad():  # sharper logits: greedy tokens then depend on every layer's output
        (model.lm_head.weight if model.lm_head is not None else model.embed.weight).mul_(20)
    return model


def _coverage(model, **engine_kw):
    from hybrid import Engine
    from hybrid.decode import program as decode_program
    from hybrid.sampling import SamplingParams

    with torch.inference_mode():
        engine = Engine(model, num_blocks=64, block_size=16, max_seqs=4, **engine_kw)
        engine.add_request(list(range(1, 9)), SamplingParams(max_new_tokens=3, ignore_eos=True))
        engine.run()
        return decode_program.coverage(model, engine.cache)


@pytest.mark.parametrize("recipe", RECIPES)
def test_whole_step_is_native_and_greedy_equals_eager_and_forward(recipe):
    """Every block of the Gated DeltaNet / GLA recipes (and their hybrids with attention) is covered: the step is
    one native call; its greedy tokens are the eager layers' (HYBRID_BACKEND=torch) and the full forward's."""
    model = _tiny(recipe)
    assert _coverage(model) == [None] * len(model.layers)
    prompts = [list(range(1, 12)), list(range(5, 30)), [3] * 7]
    native_tokens = _greedy(model, prompts, 12)
    assert native_tokens == _greedy(model, prompts, 12, backend="torch")
    seq = list(prompts[1])
    with torch.inference_mode():
        for _ in range(12):
            seq.append(int(model(torch.tensor([seq]), logits_to_keep=1)[0, -1].argmax()))
    assert native_tokens[1] == seq[len(prompts[1]):]


@pytest.mark.parametrize("recipe", ["gdn-tiny", "gla-tiny", "gla-hybrid-tiny"])
def test_sublayers_bit_equal_to_eager_in_bf16(recipe, monkeypatch):
    """In bf16 each Gated DeltaNet / GLA sub-layer's ops round where the eager layer's torch ops round: from the
    same input and the same states, the same output bits and the same new states (the states are restored
    between the two, since a step updates them)."""
    import hybrid.model as model_mod

    model = _tiny(recipe, torch.bfloat16)
    checked = []
    plain = model_mod.Block.forward

    def both(self, x, batch=None, cache=None):
        if batch is None or batch.prefill is not None or self.kind not in ("gated_deltanet", "gla"):
            return plain(self, x, batch, cache)
        view = cache.view(self.index)
        before = [view[n].data.clone() for n in view.names]
        fused = sublayer_ops(model, self, x, batch, cache)
        after = [view[n].data.clone() for n in view.names]
        for n, t in zip(view.names, before, strict=True):
            view[n].data.copy_(t)
        eager = x + self.mixer.forward_packed(self.norm(x), batch, view)
        assert fused is not None and torch.equal(fused, eager)
        for n, t in zip(view.names, after, strict=True):
            assert torch.equal(view[n].data, t), n
        checked.append(self.kind)
        return eager

    monkeypatch.setattr(model_mod.Block, "forward", both)
    no_native_steps(monkeypatch)  # the eager blocks, each beside its own native ops (sublayer_ops)
    for state_dtype in (None, torch.bfloat16):
        _greedy(model, [list(range(1, 12)), [7] * 20, [9, 4]], 5, state_dtype=state_dtype)
    assert len(checked) >= 2 * 4 * 2


def _logits(model, prompts, native_step: bool, monkeypatch):
    """Each decode step's logits: the whole step as one program, or (native_step=False) the eager blocks (no
    program at all: every sub-layer its layer's forward, on the default per-op kernels)."""
    got = whole_step_logits(monkeypatch) if native_step else eager_step_logits(monkeypatch)
    _greedy(model, prompts, 6)
    monkeypatch.undo()
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recipe", RECIPES)
def test_program_logits_equal_eager_blocks(recipe, dtype, monkeypatch):
    """The whole step's logits against the eager blocks' (a step, then greedy, from the same prompts): the blocks
    are the eager layers' bits in bf16 (test above); the final norm sums in another order (hl_rmsnorm in double,
    torch's vector_norm in fp32), so in bf16 a logit may be one rounding of the largest off. fp32: the gates,
    q/k norm, decay and state steps are the same native loops on both sides, but every RMSNorm (block, per-head
    output, final) sums in double here and in fp32 in torch: fp32 ulps per norm, carried through the states over
    5 steps and 4-8 blocks: a bound of 1e-5 of the largest logit."""
    model = _tiny(recipe, dtype)
    prompts = [list(range(1, 12)), [7] * 20, list(range(40, 45))]
    program = _logits(model, prompts, True, monkeypatch)
    eager = _logits(model, prompts, False, monkeypatch)
    assert len(program) == len(eager) == 5  # the prefill samples the first of the 6 tokens
    for a, b in zip(program, eager, strict=True):
        assert a.dtype == b.dtype == dtype and a.shape == b.shape == (len(prompts), model.config.vocab_size)
        bound = 1e-5 * b.float().abs().max().item() if dtype == torch.float32 else 2 * _noise(b, dtype)
        assert (a.float() - b.float()).abs().max() <= bound


@pytest.mark.parametrize("recipe", ["qwen3next-like-tiny", "gla-hybrid-tiny"])
def test_packed_batch_equals_alone(recipe):
    """Seven sequences decoding together (the products' 4x3 blocking and row tails, seven state slots) give the
    eager layers' tokens, and each sequence the tokens it gets alone."""
    model = _tiny(recipe)
    prompts = [list(range(1 + i, 9 + 3 * i)) for i in range(7)]
    together = _greedy(model, prompts, 10, max_seqs=8)
    assert together == _greedy(model, prompts, 10, backend="torch", max_seqs=8)
    for i in (0, 5):
        assert together[i] == _greedy(model, [prompts[i]], 10)[0]


@pytest.mark.parametrize("recipe,changes,why", [
    ("gdn-tiny", {"gated_deltanet": {"n_heads": 1, "n_k_heads": 1, "head_k_dim": 8, "head_v_dim": 520}},
     "head dims 8x520"),
    ("gdn-tiny", {"gated_deltanet": {"n_heads": 1, "n_k_heads": 1, "head_k_dim": 520, "head_v_dim": 8}},
     "head dims 520x8"),
    ("gla-tiny", {"gla": {"n_heads": 1, "n_kv_heads": 1, "key_dim": 8, "value_dim": 520}}, "head_v_dim 520"),
])
def test_shapes_the_ops_do_not_take_are_refused(recipe, changes, why):
    """A head wider than the native steps take: those blocks say why and decode eagerly (the same tokens as
    HYBRID_BACKEND=torch), the others keep their ops."""
    model = _tiny(recipe, **changes)
    cov = _coverage(model)
    mixers = [i for i, b in enumerate(model.layers) if b.kind in ("gated_deltanet", "gla")]
    assert all(why in cov[i] for i in mixers), cov
    assert all(cov[i] is None for i in range(len(model.layers)) if i not in mixers)
    prompts = [list(range(1, 12)), [4] * 9]
    with use_backend("torch"):
        expect = _greedy(model, prompts, 6)
    assert _greedy(model, prompts, 6) == expect


@pytest.mark.parametrize("recipe", ["gdn-tiny", "gla-hybrid-tiny"])
def test_int8_state_pools_run_eager(recipe):
    """An int8 state pool (compressed state) is outside the native steps: the mixers say so and step eagerly."""
    model = _tiny(recipe)
    cov = _coverage(model, state_dtype=torch.int8)
    assert all("quantised" in cov[i] for i, b in enumerate(model.layers) if b.kind in ("gated_deltanet", "gla")), cov


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_gates_norm_and_decay_match_torch(dtype):
    """The decode step's native gate / q-k norm / decay loops (the eager layers' ops for a decode step's rows, and
    the program's) against their torch forms: libm's exp / log1p against Sleef's, a double sum against torch's
    fp32 one: a few fp32 ulps; bf16 q/k: within one bf16 rounding. Prefill-sized rows stay with torch."""
    from hybrid.kernels import gated_delta

    g_ = torch.Generator().manual_seed(1)
    n, H, Hk, K = 5, 6, 3, 20
    proj = (torch.randn(n, 2 * H + 3, generator=g_) * 4).to(dtype)
    b, a = proj[:, :H], proj[:, H:2 * H]  # rows strided, as the layer's slices of its projection
    A_log, dt_bias = torch.rand(H, generator=g_).to(dtype) * 3, torch.randn(H, generator=g_).to(dtype)
    assert ops.supports_gdn_gates(b, a, A_log, dt_bias) is None
    (g, beta), (g_t, beta_t) = ops.gdn_gates(b, a, A_log, dt_bias), gated_delta._gates_torch(b, a, A_log, dt_bias)
    assert g.dtype == beta.dtype == torch.float32
    assert torch.allclose(g, g_t, rtol=1e-6, atol=0) and torch.allclose(beta, beta_t, rtol=1e-6, atol=0)
    qk = torch.randn(n, 2 * Hk * K + 7, generator=g_).to(dtype)[:, :Hk * K].reshape(n, Hk, K)
    assert ops.supports_l2norm_heads(qk) is None
    got, ref = ops.l2norm_heads(qk), gated_delta.l2norm(qk)
    assert got.dtype == dtype and (got.float() - ref).abs().max() <= 1e-6 + 2 * _noise(ref, dtype)
    x = (torch.randn(n, 12, generator=g_) * 8).to(dtype)
    for clamp_min in (None, -0.2):
        got, ref = ops.gla_decay(x, 16.0, clamp_min), gla._decay_torch(x, 16.0, clamp_min)
        assert torch.allclose(got, ref, rtol=1e-6, atol=1e-9)
        assert clamp_min is None or got.min() >= clamp_min
    long = torch.randn(65, H).to(dtype)
    assert "65 rows" in ops.supports_gdn_gates(long, long, A_log, dt_bias)
    assert "65 rows" in ops.supports_gla_decay(long, 16.0)
    assert "65 rows" in ops.supports_l2norm_heads(long.reshape(65, 2, 3))
