"""The native int4 weight-only product (kernels/native/int4.c: hl_gemv_int4, torchao's CPU Int4OpaqueTensor
codes in aten's int4pack layout) against its reference, against torchao's own computation, and inside an
engine's decode."""

from __future__ import annotations

import pytest
import torch
from decode_hooks import avx2_build, eager_step_logits, whole_step_logits
from hybrid.kernels import dispatch, native, projection, use_backend

import hybrid
from hybrid import Engine, HybridLM, recipes
from hybrid.quantize import int4_blocks
from hybrid.sampling import SamplingParams

pytestmark = pytest.mark.skipif(native.available() is not None, reason=f"native kernels: {native.available()}")
# aten packs int4 in 32-row blocks where its int4 kernels use AVX2 and in 64-row blocks where they use AVX512; the
# native product reads both (the caller passes the block size). The layout this CPU does not pack is made here by
# projection.int4_pack from the layout's formula, so both are tested on every CPU.
HERE = projection.int4pack_block()
OTHER = 32 if HERE == 64 else 64
BLOCKS = (32, 64)


def _noise(ref: torch.Tensor, dtype: torch.dtype) -> float:
    """One rounding of the reference's largest value in ``dtype`` (0 for fp32)."""
    return 0.0 if dtype == torch.float32 else ref.float().abs().max().item() * 2.0 ** -8


def _random_int4(N, K, group, sz_dtype, g, block=None):
    """(int4pack bytes in ``block``-row blocks (default this CPU's), scale_and_zero, the codes [N, K])."""
    codes = torch.randint(0, 16, (N, K), dtype=torch.int32, generator=g)
    sz = torch.stack([torch.rand(K // group, N, generator=g) * 0.02 + 0.001,
                      torch.randn(K // group, N, generator=g) * 0.05], -1).to(sz_dtype)
    return projection.int4_pack(codes, block), sz, codes


def _weight(codes, sz, group):
    """The fp32 weight the codes stand for, straight from the formula (not through the layout)."""
    scale = sz[..., 0].float().t().repeat_interleave(group, 1)
    zero = sz[..., 1].float().t().repeat_interleave(group, 1)
    return (codes.float() - 8.0) * scale + zero


def test_int4_pack_writes_aten_s_layout_and_codes_reads_both():
    """int4_pack's formula for this CPU's block size is aten's own packing (tails of 16, 32 and 48 rows included);
    int4_codes reads either layout back."""
    g = torch.Generator().manual_seed(0)
    for N, K in ((16, 64), (48, 32), (64, 64), (80, 128), (96, 64), (112, 32), (176, 64), (2064, 64)):
        codes = torch.randint(0, 16, (N, K), dtype=torch.int32, generator=g)
        assert torch.equal(projection.int4_pack(codes), torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))
        for block in BLOCKS:
            assert torch.equal(projection.int4_codes(projection.int4_pack(codes, block), block), codes)
        if N >= 64:
            assert not torch.equal(projection.int4_pack(codes, 32), projection.int4_pack(codes, 64))
    with pytest.raises(ValueError):
        projection.int4_pack(torch.zeros(40, 8, dtype=torch.int32), 64)


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 64])
def test_int4_product_matches_reference(rows, group, x_dtype, block):
    """Both layouts, every row-count path (one row straight from the codes; up to four bf16 rows a pass of
    vdpbf16ps; pairs of rows over widened codes; an odd last row), whole blocks and every tail (N % 32 == 16 for
    32-row blocks; N % 64 = 16, 32, 48 for 64-row ones), several K, fp32 and bf16 scales, with and without bias
    and residual, against the weight the codes stand for. Tolerance: 1e-5 of the reference's largest magnitude
    (fp32 summation-order noise: the native sums run per group and block in another order than the reference's
    GEMM; measured up to ~1e-6), plus two roundings of it where the output is bf16."""
    g = torch.Generator().manual_seed(rows * 1000 + group + block)
    for K in (128, 384, 640):
        for i, N in enumerate((16, 48, 80, 96, 112, 192)):
            q, sz, codes = _random_int4(N, K, group, x_dtype if i % 2 else torch.float32, g, block)
            w = _weight(codes, sz, group)
            assert torch.equal(projection.int4_dequantize(q, sz, group, block), w)
            x = torch.randn(rows, K, generator=g).to(x_dtype)
            b, r = torch.randn(N, generator=g).to(x_dtype), torch.randn(rows, N, generator=g).to(x_dtype)
            for bias, res in ((None, None), (b, None), (b, r)):
                got = projection._linear_int4_native(x, q, sz, group, bias, res, block=block)
                ref = projection.linear_ref(x, w, bias, res)
                assert got.dtype == x_dtype and got.shape == (rows, N)
                tol = 1e-5 * ref.float().abs().max().item() + 2 * _noise(ref, x_dtype)
                assert (got.float() - ref.float()).abs().max().item() <= tol, (K, N, bias is None, res is None)
                if block == HERE:
                    assert projection._int4_native_supports(x, q, sz, group, bias, res) is None


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("threads", [1, 2])
def test_int4_product_threads_and_chunks(threads, x_dtype, block):
    """A matrix large enough to be cut into several chunks of the pool (and a tail block): every block written
    once, the same numbers on one thread or two."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(threads)
        N, K, group = (4112, 512, 128) if block == 32 else (4144, 512, 128)  # 128 blocks + 16 rows; 64 + 48
        q, sz, _ = _random_int4(N, K, group, torch.float32, g, block)
        x = torch.randn(2, K, generator=g).to(x_dtype)
        got = projection._linear_int4_native(x, q, sz, group, block=block)
        ref = projection.linear_int4_ref(x, q, sz, group, block=block)
        assert (got.float() - ref.float()).abs().max().item() <= 1e-5 * ref.float().abs().max().item() \
            + 2 * _noise(ref, x_dtype)
        torch.set_num_threads(3 - threads)
        assert torch.equal(projection._linear_int4_native(x, q, sz, group, block=block), got)
    finally:
        torch.set_num_threads(before)


def test_int4_supports_refuses_what_it_cannot_take(monkeypatch):
    g = torch.Generator().manual_seed(0)
    q, sz, _ = _random_int4(32, 128, 32, torch.float32, g)
    x = torch.randn(2, 128)
    assert projection._int4_native_supports(x, q, sz, 32) is None
    assert "rows" in projection._int4_native_supports(torch.randn(native.MAX_ROWS + 1, 128), q, sz, 32)
    assert "group" in projection._int4_native_supports(x, q, sz, 64)  # scales of another group count
    assert "dtypes" in projection._int4_native_supports(x.half(), q, sz, 32)
    # the dispatch hands a call the native product refuses to aten's kernel (torchao's)
    many = torch.randn(native.MAX_ROWS + 1, 128)
    torch.testing.assert_close(projection.linear_int4(many, q, sz, 32), projection.linear_int4_ref(many, q, sz, 32),
                               rtol=1e-5, atol=1e-5)
    # both of aten's layouts are read; any other block size is refused by name, in Python and in C
    assert projection.int4_layout_refusal(32) is None and projection.int4_layout_refusal(64) is None
    assert "128-row blocks" in projection.int4_layout_refusal(128)
    y = torch.empty(2, 32)
    assert native.library().hl_gemv_int4(q.data_ptr(), sz.data_ptr(), 0, 32, None, -1, x.data_ptr(), 0, None,
                                         y.data_ptr(), 0, 2, 32, 128, 48) == -1
    monkeypatch.setattr(projection, "int4pack_block", lambda: 128)
    assert "128-row blocks" in projection._int4_native_supports(x, q, sz, 32)


def test_int4_avx2_build_matches_reference():
    """The AVX2 code of both layouts (what a CPU without AVX-512 runs), built here with -mno-avx512f, against the
    reference: the same tolerance as test_int4_product_matches_reference."""
    lib = avx2_build()
    if lib is None:
        pytest.skip("no AVX-512 here: the library under test is the AVX2 build already")
    codes = native.DTYPE_CODES
    g = torch.Generator().manual_seed(3)
    for block in BLOCKS:
        for x_dtype in (torch.float32, torch.bfloat16):
            for rows in (1, 2, 3, 5):
                for N, K, group in ((80, 384, 128), (112, 256, 32), (192, 128, 64), (4144, 256, 64)):
                    q, sz, c = _random_int4(N, K, group, x_dtype, g, block)
                    x = torch.randn(rows, K, generator=g).to(x_dtype)
                    b, r = torch.randn(N, generator=g).to(x_dtype), torch.randn(rows, N, generator=g).to(x_dtype)
                    y = torch.empty(rows, N, dtype=x_dtype)
                    assert lib.hl_gemv_int4(q.data_ptr(), sz.data_ptr(), codes[sz.dtype], group, b.data_ptr(),
                                            codes[b.dtype], x.data_ptr(), codes[x_dtype], r.data_ptr(), y.data_ptr(),
                                            codes[x_dtype], rows, N, K, block) == 0
                    ref = projection.linear_ref(x, _weight(c, sz, group), b, r)
                    tol = 1e-5 * ref.float().abs().max().item() + 2 * _noise(ref, x_dtype)
                    assert (y.float() - ref.float()).abs().max().item() <= tol, (block, x_dtype, rows, N)


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
        assert projection._int4_native_supports(x, qdata, sz, group, layer.bias) is None  # aten's layout, read here
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
    """An int4wo model's decode steps take the native int4 product (counted: in aten's layout of this CPU, 32- or
    64-row blocks), and greedy decode gives the tokens of the same quantised model's full forward."""
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
    assert calls[0] > 0
    for p, out in zip(prompts, got, strict=True):
        seq = list(p)
        with torch.inference_mode():
            for _ in range(10):
                seq.append(int(model(torch.tensor([seq]), logits_to_keep=1)[0, -1].argmax()))
        assert out == seq[len(p):]


def _decode_logits(model, prompts, *, program: bool):
    """Each decode step's logits of an engine run: through the whole-step native program (program=True: every
    block and the head covered) or through the eager layers (no program; their int4 products still native)."""
    with pytest.MonkeyPatch.context() as mp:  # (its own: the caller's monkeypatch keeps what it set)
        got = whole_step_logits(mp) if program else eager_step_logits(mp)
        _greedy(model, prompts, 6)
    return got


def _repack(model, block: int, monkeypatch) -> None:
    """Every int4 weight's codes rewritten in place in the layout of ``block``-row blocks, and the block size the
    native products are handed (projection.int4pack_block) made that: the layout aten packs on the other kind of
    CPU, for the native products only (aten's own kernel would misread it: every product must stay native)."""
    from hybrid.decode import builder

    for m in model.modules():
        blocks = int4_blocks(m.weight) if isinstance(m, torch.nn.Linear) else None
        if blocks is not None:
            blocks[0].copy_(projection.int4_pack(projection.int4_codes(blocks[0], HERE), block))
    monkeypatch.setattr(projection, "int4pack_block", lambda: block)
    monkeypatch.setattr(builder, "int4pack_block", lambda: block)

    def aten_s(*args, **kw):
        raise AssertionError("aten's int4 kernel on codes repacked for the native product")

    dispatch.register("linear_int4", "torch", aten_s)
    monkeypatch.setattr(projection, "_linear_int4_torch", aten_s)


@pytest.mark.parametrize("layout", ["aten's", "other"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recipe", ["llama-tiny", "mamba2-tiny", "hybrid-1to7-tiny"])
def test_int4wo_whole_step_program_equals_eager_layers(recipe, dtype, layout, monkeypatch):
    """An int4wo model's decode step is one native call (int4 q/k/v with RoPE, gated MLP, plain products, the
    head), and it computes the eager layers' logits: the same int4 block arithmetic, the norms and attention in
    another summation order (fp32 noise; in bf16 the ops round where torch rounds, at most a rounding of the
    largest logit or two apart after the layers). In aten's layout of this CPU and, its codes repacked, in the
    other one (32- and 64-row blocks on every CPU)."""
    torch.manual_seed(0)
    model = HybridLM(recipes.get(recipe)).to(dtype).eval()
    hybrid.quantize(model, "int4wo")
    assert sum(int4_blocks(m.weight) is not None for m in model.modules() if isinstance(m, torch.nn.Linear)) > 3
    if layout == "other":
        _repack(model, OTHER, monkeypatch)
    prompts = [list(range(1, 12)), [7] * 20, list(range(40, 45))]
    try:
        whole = _decode_logits(model, prompts, program=True)
        eager = _decode_logits(model, prompts, program=False)
    finally:
        monkeypatch.undo()
        dispatch.register("linear_int4", "torch", projection._linear_int4_torch)
    assert len(whole) == len(eager) == 5
    for a, b in zip(whole, eager, strict=True):
        assert a.dtype == b.dtype == dtype and a.shape == b.shape == (len(prompts), model.config.vocab_size)
        assert (a.float() - b.float()).abs().max() <= 1e-4 * b.float().abs().max() + 4 * _noise(b, dtype)
