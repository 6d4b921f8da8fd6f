"""The native int4 weight-only product (kernels/native/decode.c: hl_gemv_int4, torchao's CPU Int4OpaqueTensor
codes in aten's int4pack layout) against its reference, against torchao's own computation, and inside an
engine's decode."""

from __future__ import annotations

import pytest
import torch
from decode_hooks import eager_step_logits, whole_step_logits
from hybrid.kernels import dispatch, native, projection, use_backend

import hybrid
from hybrid import Engine, HybridLM, recipes
from hybrid.quantize import int4_blocks
from hybrid.sampling import SamplingParams

pytestmark = pytest.mark.skipif(native.available() is not None, reason=f"native kernels: {native.available()}")
# the native int4 product reads AVX2's 32-row int4pack blocks; where aten packs 64-row blocks (its AVX512 kernels)
# the dispatch refuses it and aten's kernel runs (test_int4_native_refuses_aten_s_avx512_layout)
needs_32_row_blocks = pytest.mark.skipif(projection.int4pack_block() != 32,
                                         reason=f"{projection.int4pack_block()}-row int4pack blocks on this CPU")


def _noise(ref: torch.Tensor, dtype: torch.dtype) -> float:
    """One rounding of the reference's largest value in ``dtype`` (0 for fp32)."""
    return 0.0 if dtype == torch.float32 else ref.float().abs().max().item() * 2.0 ** -8


def _random_int4(N, K, group, sz_dtype, g):
    q = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=g)
    sz = torch.stack([torch.rand(K // group, N, generator=g) * 0.02 + 0.001,
                      torch.randn(K // group, N, generator=g) * 0.05], -1).to(sz_dtype)
    return q, sz


@needs_32_row_blocks
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 3, 7, 64])
def test_int4_product_matches_reference(rows, group, x_dtype):
    """Every row count path (one row straight from the codes; pairs of rows over widened codes; an odd last
    row), whole 32-row blocks and a 16-row tail (N % 32 == 16), with and without bias and residual."""
    g = torch.Generator().manual_seed(rows * 1000 + group)
    K = 384  # 3, 6 or 12 groups
    for N, sz_dtype in ((96, x_dtype), (80, x_dtype), (16, torch.float32)):
        q, sz = _random_int4(N, K, group, sz_dtype, g)
        x = torch.randn(rows, K, generator=g).to(x_dtype)
        b, r = torch.randn(N, generator=g).to(x_dtype), torch.randn(rows, N, generator=g).to(x_dtype)
        for bias, res in ((None, None), (b, None), (b, r)):
            assert projection._int4_native_supports(x, q, sz, group, bias, res) is None
            got = projection._linear_int4_native(x, q, sz, group, bias, res)
            ref = projection.linear_int4_ref(x, q, sz, group, bias, res)
            assert got.dtype == x_dtype and got.shape == (rows, N)
            tol = 1e-5 * ref.abs().max().item() + 2 * _noise(ref, x_dtype)
            assert (got.float() - ref.float()).abs().max().item() <= tol, (N, bias is None, res is None)


@needs_32_row_blocks
@pytest.mark.parametrize("threads", [1, 2])
def test_int4_product_threads_and_chunks(threads):
    """A matrix large enough to be cut into several chunks of the pool: every block written once, the same
    numbers on one thread or two."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(threads)
        N, K, group = 4112, 512, 128  # 128 blocks of 32 and a tail of 16
        q, sz = _random_int4(N, K, group, torch.float32, g)
        x = torch.randn(2, K, generator=g)
        got = projection._linear_int4_native(x, q, sz, group)
        ref = projection.linear_int4_ref(x, q, sz, group)
        assert (got - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    finally:
        torch.set_num_threads(before)


@needs_32_row_blocks
def test_int4_supports_refuses_what_it_cannot_take():
    g = torch.Generator().manual_seed(0)
    q, sz = _random_int4(32, 128, 32, torch.float32, g)
    x = torch.randn(2, 128)
    assert projection._int4_native_supports(x, q, sz, 32) is None
    assert "rows" in projection._int4_native_supports(torch.randn(native.MAX_ROWS + 1, 128), q, sz, 32)
    assert "group" in projection._int4_native_supports(x, q, sz, 64)  # scales of another group count
    assert "dtypes" in projection._int4_native_supports(x.half(), q, sz, 32)
    # the dispatch hands a call the native product refuses to aten's kernel (torchao's)
    many = torch.randn(native.MAX_ROWS + 1, 128)
    torch.testing.assert_close(projection.linear_int4(many, q, sz, 32), projection.linear_int4_ref(many, q, sz, 32),
                               rtol=1e-5, atol=1e-5)


torchao = pytest.importorskip("torchao")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("N", "K"), [(96, 384), (80, 256), (48, 64)])
def test_int4_layout_and_product_equal_torchaos(N, K, dtype):
    """torchao's PrototypeInt4WeightOnlyConfig (via hybrid.quantize) fills the codes and scale/zero the way
    docs/notes/int4-cpu-layout.md decodes them: the decoded weight is torchao's own tinygemm dequantisation of the
    original weight, exactly (N % 32 == 16 included); and a layer's native product is torchao's. Tolerance: for
    fp32 weights torchao's CPU kernel computes in fp32 (measured: activations are cast to the scales' dtype,
    which is the weight's), so fp32 summation-order noise; for bf16 both round one fp32 sum to bf16, so at most
    two roundings of the largest output apart (plus the bf16 products aten forms in its own order)."""
    from torchao.quantization.quant_primitives import (
        MappingType,
        _choose_qparams_affine_tinygemm,
        _dequantize_affine_tinygemm,
        _quantize_affine_tinygemm,
    )

    from hybrid.layers.linear import Linear

    torch.manual_seed(N + K)
    layer = Linear(K, N, bias=True).to(dtype)
    w = layer.weight.detach().clone()
    hybrid.quantize(torch.nn.Sequential(layer), "int4wo")
    blocks = int4_blocks(layer.weight)
    assert blocks is not None
    qdata, sz, group = blocks
    assert group == (128 if K % 128 == 0 else 64 if K % 64 == 0 else 32) and sz.dtype == dtype
    block = [1, group]
    s, z = _choose_qparams_affine_tinygemm(w, MappingType.ASYMMETRIC, block, torch.int32, 0, 15, 1e-6, None, w.dtype)
    codes = _quantize_affine_tinygemm(w, block, s, z, torch.int32, 0, 15)
    theirs_w = _dequantize_affine_tinygemm(codes, block, s, z, torch.int32, 0, 15, output_dtype=torch.float32)
    assert torch.equal(projection.int4_dequantize(qdata, sz, group), theirs_w)
    for rows in (1, 5):
        x = torch.randn(rows, K).to(dtype)
        with torch.inference_mode():
            ours = layer(x)  # Linear.forward: the native int4 product
            theirs = torch.nn.functional.linear(x, layer.weight, layer.bias)  # torchao's dispatch, aten's kernel
        assert ours.dtype == theirs.dtype == dtype
        tol = 1e-5 * theirs.float().abs().max().item() + (4 * _noise(theirs, dtype))
        assert (ours.float() - theirs.float()).abs().max().item() <= tol


def _greedy(model, prompts, n, backend=None):
    with torch.inference_mode(), use_backend(backend):
        engine = Engine(model, num_blocks=64, block_size=16, max_seqs=4)
        ids = [engine.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True)) for p in prompts]
        engine.run()
        return [engine.requests[i].output for i in ids]


@pytest.mark.parametrize("recipe", ["llama-tiny", "hybrid-1to7-tiny"])
def test_int4wo_engine_decodes_through_the_native_product_and_equals_full_forward(recipe, monkeypatch):
    """An int4wo model's decode steps take the native int4 product (counted; never where aten packs 64-row blocks),
    and greedy decode gives the tokens of the same quantised model's full forward (whose many rows take torchao's
    kernel)."""
    torch.manual_seed(0)
    model = HybridLM(recipes.get(recipe)).eval()
    with torch.no_grad():
        (model.lm_head.weight if model.lm_head is not None else model.embed.weight).mul_(20)
    hybrid.quantize(model, "int4wo")
    calls = [0]

    def counted(*args):
        calls[0] += 1
        return projection._linear_int4_native(*args)

    dispatch.register("linear_int4", "native", counted, native.available, projection._int4_native_supports)
    try:
        prompts = [list(range(1, 12)), list(range(5, 30)), [3] * 7]
        got = _greedy(model, prompts, 10)
    finally:
        dispatch.register("linear_int4", "native", projection._linear_int4_native, native.available,
                          projection._int4_native_supports)
    assert calls[0] > 0 if projection.int4pack_block() == 32 else calls[0] == 0
    for p, out in zip(prompts, got, strict=True):
        seq = list(p)
        with torch.inference_mode():
            for _ in range(10):
                seq.append(int(model(torch.tensor([seq]), logits_to_keep=1)[0, -1].argmax()))
        assert out == seq[len(p):]


def _decode_logits(model, prompts, monkeypatch, *, program: bool):
    """Each decode step's logits of an engine run: through the whole-step native program (program=True: every
    block and the head covered) or through the eager layers (no program; their int4 products still native)."""
    got = whole_step_logits(monkeypatch) if program else eager_step_logits(monkeypatch)
    _greedy(model, prompts, 6)
    monkeypatch.undo()
    return got


@needs_32_row_blocks
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recipe", ["llama-tiny", "mamba2-tiny", "hybrid-1to7-tiny"])
def test_int4wo_whole_step_program_equals_eager_layers(recipe, dtype, monkeypatch):
    """An int4wo model's decode step is one native call (int4 q/k/v with RoPE, gated MLP, plain products, the
    head), and it computes the eager layers' logits: the same int4 block arithmetic, the norms and attention in
    another summation order (fp32 noise; in bf16 the ops round where torch rounds, at most a rounding of the
    largest logit or two apart after the layers)."""
    torch.manual_seed(0)
    model = HybridLM(recipes.get(recipe)).to(dtype).eval()
    hybrid.quantize(model, "int4wo")
    assert sum(int4_blocks(m.weight) is not None for m in model.modules() if isinstance(m, torch.nn.Linear)) > 3
    prompts = [list(range(1, 12)), [7] * 20, list(range(40, 45))]
    whole = _decode_logits(model, prompts, monkeypatch, program=True)
    eager = _decode_logits(model, prompts, monkeypatch, program=False)
    assert len(whole) == len(eager) == 5
    for a, b in zip(whole, eager, strict=True):
        assert a.dtype == b.dtype == dtype and a.shape == b.shape == (len(prompts), model.config.vocab_size)
        assert (a.float() - b.float()).abs().max() <= 1e-4 * b.float().abs().max() + 4 * _noise(b, dtype)


@pytest.mark.skipif(projection.int4pack_block() == 32, reason="aten packs AVX2's 32-row blocks here")
def test_int4_native_refuses_aten_s_avx512_layout():
    """Where aten packs int4 in 64-row blocks the native product (32-row blocks) is refused by name, the dispatch
    runs aten's kernel, and that equals the reference decoded in this machine's layout."""
    from hybrid.layers.linear import Linear

    torch.manual_seed(0)
    layer = Linear(128, 96, bias=False)
    hybrid.quantize(torch.nn.Sequential(layer), "int4wo")
    q, sz, group = int4_blocks(layer.weight)
    x = torch.randn(2, 128)
    assert "64-row blocks" in projection._int4_native_supports(x, q, sz, group)
    torch.testing.assert_close(projection.linear_int4(x, q, sz, group), projection.linear_int4_ref(x, q, sz, group),
                               rtol=1e-4, atol=1e-4)
