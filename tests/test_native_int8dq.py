"""The int8-activation decode products (kernels/native/int8_activation.c: hl_gemv_q and the program's OP_GEMV_Q /
OP_QKV_ROPE_Q / OP_GATED_UP_Q) for torchao's int8dq and 8da4w weights: the activations quantised as torchao
quantises them, the kernel against its reference, the reference against torchao's own product, and inside an
engine's decode (greedy = full forward, the whole-step program = the eager layers).

Exactness: int8dq's product is an integer dot and two fp32 multiplies, so kernel, reference and torchao agree
bit for bit (fp32 and bf16). 8da4w's group dots are integers too, but their scaled sum is fp32 in a different
order in each (the kernel: groups in turn, with FMAs; the reference: torch's sum; torchao: F.linear of the
dequantised tensors, whose values in bf16 are each rounded to bf16 first), so those agree to fp32 summation
order (and, against torchao in bf16, to a few roundings of the largest output)."""

from __future__ import annotations

import pytest
import torch
from decode_hooks import eager_step_logits, no_native_steps, whole_step_logits
from hybrid.kernels import dispatch, native, projection

import hybrid
from hybrid import Engine, HybridLM, recipes
from hybrid.quantize import int8_rows, q_operands
from hybrid.sampling import SamplingParams

pytestmark = pytest.mark.skipif(native.available() is not None, reason=f"native kernels: {native.available()}")
torchao = pytest.importorskip("torchao")

DTYPES = [torch.float32, torch.bfloat16]


def _noise(ref: torch.Tensor, dtype: torch.dtype) -> float:
    """One rounding of the reference's largest value in ``dtype`` (0 for fp32)."""
    return 0.0 if dtype == torch.float32 else ref.float().abs().max().item() * 2.0 ** -8


def _rows(B, K, dtype, g):
    x = torch.randn(B, K, generator=g)
    # rows whose most negative entry is their largest (int8dq's -128 code, when the scale's rounding allows), one
    # all positive (8da4w's zero point at -128)
    x[::2, K // 2] = -x[::2].abs().amax(-1) * torch.linspace(1.0, 1.5, len(range(0, B, 2)))
    if B > 1:
        x[1] = x[1].abs()
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_activation_quantisation_is_torchaos(dtype):
    """quantize_rows_sym / _asym give torchao's own codes, scales and zero points (its choose_qparams_affine and
    quantize_affine called as Int8Tensor.from_hp and IntxUnpackedToInt8Tensor's activation path call them),
    bit for bit. A -128 symmetric code does occur in fp32 (the case the kernel's sign trick must handle); in bf16 it
    cannot: max|x| has 8 significant bits m, and m (1 + 1/255) always rounds up to m + 1 in bf16, so the scale is
    above max|x| / 127.5 and every |x| / scale below 127.5."""
    from torchao.quantization.quant_primitives import MappingType, choose_qparams_affine, quantize_affine

    g = torch.Generator().manual_seed(1)
    x = _rows(64, 200, dtype, g)
    block = [1, x.shape[1]]
    s, z = choose_qparams_affine(x, MappingType.SYMMETRIC, block, torch.int8, -128, 127, scale_dtype=torch.float32,
                                 zero_point_dtype=torch.int8, keepdim=True, eps=torch.finfo(torch.float32).eps)
    q = quantize_affine(x, block, s, z, torch.int8, -128, 127)
    ours_q, ours_s = projection.quantize_rows_sym(x)
    assert torch.equal(ours_q, q) and torch.equal(ours_s, s) and ours_s.dtype == torch.float32
    assert bool((q == -128).any()) == (dtype == torch.float32)
    s, z = choose_qparams_affine(x, MappingType.ASYMMETRIC, block, torch.int8, -128, 127, zero_point_dtype=torch.int8)
    q = quantize_affine(x, block, s, z, torch.int8, -128, 127)
    ours_q, ours_s, ours_z = projection.quantize_rows_asym(x)
    assert torch.equal(ours_q, q) and torch.equal(ours_s.reshape(-1), s.reshape(-1))
    assert torch.equal(ours_z.reshape(-1), z.reshape(-1)) and ours_s.dtype == dtype


def _w4(N, K, dtype, g):
    values = torch.randint(-8, 8, (N, K), dtype=torch.int8, generator=g)
    return values, (torch.rand(N, K // 32, generator=g) * 0.02 + 1e-3).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 7, 64])
def test_q_products_match_their_references(rows, dtype):
    """Every row count (1..64), widths with a tail past the last 64 / 32 codes (int8dq), with and without bias
    and residual. int8dq: equal bit for bit. 8da4w: to fp32 summation order (1e-5 of the largest output; in
    bf16 one rounding, where the two fp32 sums fall either side of a bf16 tie). K 224: whole blocks of four
    groups and groups after them (the AVX512-VNNI 8da4w pass takes 128 k a step)."""
    g = torch.Generator().manual_seed(rows)
    for N, K in ((96, 384), (40, 100), (33, 32), (16, 1024), (24, 224)):
        x = _rows(rows, K, dtype, g)
        b, r = torch.randn(N, generator=g).to(dtype), torch.randn(rows, N, generator=g).to(dtype)
        codes, ws = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=g), torch.rand(N, generator=g) * 0.01
        for bias, res in ((None, None), (b, None), (b, r)):
            assert projection._q_native_supports(x, projection.QK_I8DQ, codes, ws, bias, res) is None
            got = projection._linear_q_native(x, projection.QK_I8DQ, codes, ws, bias, res)
            ref = projection.linear_int8dq_ref(x, codes, ws, bias, res)
            assert got.dtype == dtype and got.shape == (rows, N) and torch.equal(got, ref), (N, K)
            if K % 32:
                continue
            values, scale = _w4(N, K, dtype, g)
            nibbles, packed = projection.pack_8da4w(values, scale)
            assert projection._q_native_supports(x, projection.QK_8DA4W, nibbles, packed, bias, res) is None
            got = projection._linear_q_native(x, projection.QK_8DA4W, nibbles, packed, bias, res)
            ref = projection.linear_8da4w_ref(x, values, scale, bias, res)
            tol = 1e-5 * ref.float().abs().max().item() + _noise(ref, dtype)
            assert (got.float() - ref.float()).abs().max().item() <= tol, (N, K)


@pytest.mark.parametrize("threads", [1, 2])
def test_q_products_threads_and_chunks(threads):
    """Matrices cut into many chunks of the pool: every row written once, the same numbers on one thread or two."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(threads)
        N, K = 4100, 512
        x = _rows(2, K, torch.float32, g)
        codes, ws = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=g), torch.rand(N, generator=g)
        assert torch.equal(projection._linear_q_native(x, projection.QK_I8DQ, codes, ws),
                           projection.linear_int8dq_ref(x, codes, ws))
        values, scale = _w4(N, K, torch.float32, g)
        got = projection._linear_q_native(x, projection.QK_8DA4W, *projection.pack_8da4w(values, scale))
        ref = projection.linear_8da4w_ref(x, values, scale)
        assert (got - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    finally:
        torch.set_num_threads(before)


def test_q_supports_refuses_what_it_cannot_take():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 96)
    codes, ws = torch.randint(-128, 128, (8, 96), dtype=torch.int8, generator=g), torch.rand(8)
    nibbles, packed = projection.pack_8da4w(*_w4(8, 96, torch.float32, g))
    assert projection._q_native_supports(x, projection.QK_I8DQ, codes, ws) is None
    assert "rows" in projection._q_native_supports(torch.randn(native.MAX_ROWS + 1, 96), projection.QK_I8DQ, codes, ws)
    assert "dtype" in projection._q_native_supports(x.half(), projection.QK_I8DQ, codes, ws)
    assert "int8dq codes" in projection._q_native_supports(torch.randn(2, 64), projection.QK_I8DQ, codes, ws)
    assert "8da4w" in projection._q_native_supports(x, projection.QK_8DA4W, nibbles, ws)  # scales without C
    with pytest.raises(ValueError, match="K a multiple of 32"):
        projection.pack_8da4w(torch.zeros(4, 40, dtype=torch.int8), torch.ones(4, 1))
    # the dispatch hands what the native product refuses to the torch reference
    many = torch.randn(native.MAX_ROWS + 1, 96)
    assert torch.equal(projection.linear_q(many, projection.QK_I8DQ, codes, ws),
                       projection.linear_int8dq_ref(many, codes, ws))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", ["int8dq", "8da4w"])
def test_layer_products_equal_torchaos(method, dtype):
    """hybrid.quantize makes torchao's own tensors (Int8Tensor with dynamic activations; IntxUnpackedToInt8Tensor,
    int4 in groups of 32), the int8 weight-only path does not take them, and a layer's decode product (native)
    equals torchao's F.linear on the same weight: int8dq bit for bit; 8da4w to fp32 summation order (bf16: the
    dequantised values' own roundings, a few roundings of the largest output)."""
    from hybrid.layers.linear import Linear

    torch.manual_seed(3)
    layer = Linear(256, 72, bias=True).to(dtype)
    hybrid.quantize(torch.nn.Sequential(layer), method)
    w = layer.weight
    assert type(w).__name__ == ("Int8Tensor" if method == "int8dq" else "IntxUnpackedToInt8Tensor")
    assert int8_rows(w) is None and q_operands(w) is not None
    if method == "8da4w":
        assert w.qdata.min() >= -8 and w.qdata.max() <= 7 and tuple(w.block_size) == (1, 32)
    for rows in (1, 5):
        x = _rows(rows, 256, dtype, torch.Generator().manual_seed(rows))
        with torch.inference_mode():
            ours = layer(x)  # Linear.forward: the native product
            theirs = torch.nn.functional.linear(x, w, layer.bias)  # torchao's dispatch
        assert ours.dtype == theirs.dtype == dtype
        if method == "int8dq":
            assert torch.equal(ours, theirs)
        else:
            tol = 1e-5 * theirs.float().abs().max().item() + 4 * _noise(theirs, dtype)
            assert (ours.float() - theirs.float()).abs().max().item() <= tol


def _greedy(model, prompts, n, backend=None):
    from hybrid.kernels import use_backend

    with torch.inference_mode(), use_backend(backend):
        engine = Engine(model, num_blocks=64, block_size=16, max_seqs=4)
        ids = [engine.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True)) for p in prompts]
        engine.run()
        return [engine.requests[i].output for i in ids]


def _sharp(recipe, dtype=torch.float32):
    torch.manual_seed(0)
    model = HybridLM(recipes.get(recipe)).to(dtype).eval()
    with torch.no_grad():  # sharp logits, as a trained model's: greedy ties would measure nothing
        (model.lm_head.weight if model.lm_head is not None else model.embed.weight).mul_(20)
    return model


@pytest.mark.parametrize("method", ["int8dq", "8da4w"])
@pytest.mark.parametrize("recipe", ["llama-tiny", "hybrid-1to7-tiny"])
def test_engine_decodes_through_the_q_products_and_equals_full_forward(recipe, method, monkeypatch):
    """An int8dq / 8da4w model's decode steps take the native int8-activation products (counted, the program
    off), and greedy decode gives the tokens of the same quantised model's full forward (whose many rows take
    torchao's kernels)."""
    model = _sharp(recipe)
    hybrid.quantize(model, method)
    calls = [0]

    def counted(*args):
        calls[0] += 1
        return projection._linear_q_native(*args)

    no_native_steps(monkeypatch)
    dispatch.register("linear_q", "native", counted, native.available, projection._q_native_supports)
    try:
        prompts = [list(range(1, 12)), list(range(5, 30)), [3] * 7]
        got = _greedy(model, prompts, 10)
    finally:
        dispatch.register("linear_q", "native", projection._linear_q_native, native.available,
                          projection._q_native_supports)
    monkeypatch.undo()
    assert calls[0] > 0
    for p, out in zip(prompts, got, strict=True):
        seq = list(p)
        with torch.inference_mode():
            for _ in range(10):
                seq.append(int(model(torch.tensor([seq]), logits_to_keep=1)[0, -1].argmax()))
        assert out == seq[len(p):]
    # and the whole-step program decodes the same tokens
    assert _greedy(model, prompts, 10) == got


def _decode_logits(model, prompts, monkeypatch, *, program: bool):
    """Each decode step's logits of an engine run: through the whole-step native program (program=True: every
    block and the head covered) or through the eager layers (their products still native)."""
    got = whole_step_logits(monkeypatch) if program else eager_step_logits(monkeypatch)
    _greedy(model, prompts, 6)
    monkeypatch.undo()
    return got


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", ["int8dq", "8da4w"])
@pytest.mark.parametrize("recipe", ["llama-tiny", "mamba2-tiny", "hybrid-1to7-tiny"])
def test_whole_step_program_equals_eager_layers(recipe, method, dtype, monkeypatch):
    """An int8dq / 8da4w model's decode step is one native call (q/k/v with RoPE, gated MLP, the plain products,
    the head) and computes the eager layers' logits. In bf16 the program's ops round where torch's do and the
    logits agree to a few roundings of the largest (measured: equal). In fp32 the norms and attention sum in
    another order, and quantising an activation is a step function: fp32 noise upstream now and then moves a
    code by one (a 1/255 or 1/127.5 step of its row's range), which moves the outputs that read it by that
    step times their weights; hence a bound of 3% of the largest logit (0.5% on average), not fp32 noise."""
    torch.manual_seed(0)
    model = HybridLM(recipes.get(recipe)).to(dtype).eval()
    hybrid.quantize(model, method)
    assert sum(q_operands(m.weight) is not None for m in model.modules() if isinstance(m, torch.nn.Linear)) > 3
    prompts = [list(range(1, 12)), [7] * 20, list(range(40, 45))]
    whole = _decode_logits(model, prompts, monkeypatch, program=True)
    eager = _decode_logits(model, prompts, monkeypatch, program=False)
    assert len(whole) == len(eager) == 5
    for a, b in zip(whole, eager, strict=True):
        assert a.dtype == b.dtype == dtype and a.shape == b.shape == (len(prompts), model.config.vocab_size)
        d, top = (a.float() - b.float()).abs(), b.float().abs().max()
        if dtype == torch.bfloat16:
            assert d.max() <= 4 * _noise(b, dtype)
        else:  # code flips (see the docstring): measured at most 1.2% of the largest logit, 0.15% on average
            assert d.max() <= 0.03 * top and d.mean() <= 0.005 * top


@pytest.mark.parametrize(("recipe", "method", "bound"), [
    ("llama-tiny", "int8dq", 0.9), ("hybrid-1to7-tiny", "int8dq", 0.9),
    # int4 in groups of 32 with int8 activations: the int4 weights' noise dominates (int4wo's bound, 0.6)
    ("llama-tiny", "8da4w", 0.6), ("hybrid-1to7-tiny", "8da4w", 0.6)])
def test_greedy_agrees_with_fp32(recipe, method, bound):
    """Next-token agreement along the fp32 model's greedy continuations (teacher forced): at least ``bound``, the
    weight-only methods' bounds (tests/test_quantize.py) on the same sharpened random models."""
    model = _sharp(recipe)
    prompts = [list(range(1, 12)), list(range(40, 60)), [3] * 9]
    ref = _greedy(model, prompts, 16)
    hybrid.quantize(model, method)
    agree = total = 0
    for p, r in zip(prompts, ref, strict=True):
        for t in range(len(r)):
            agree += _greedy(model, [p + r[:t]], 1)[0][0] == r[t]
            total += 1
    print(f"{recipe} {method}: {agree}/{total} agree")
    assert agree / total >= bound, agree / total


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K", [256, 1536, 9000])
def test_int8dq_prefill_equals_torchaos(K, dtype):
    """Many rows of an int8dq layer (a prefill) on a CPU go through fp32 GEMMs (projection.int8_dot: one GEMM up
    to K = 1024, the codes split in two past that, fp64 past 8192) and give torchao's integer-matmul numbers
    bit for bit."""
    from hybrid.layers.linear import Linear

    torch.manual_seed(K)
    layer = Linear(K, 48, bias=True).to(dtype)
    hybrid.quantize(torch.nn.Sequential(layer), "int8dq")
    x = _rows(40, K, dtype, torch.Generator().manual_seed(K)).reshape(2, 20, K)
    with torch.inference_mode():
        ours = layer(x)
        theirs = torch.nn.functional.linear(x, layer.weight, layer.bias)
    assert ours.shape == theirs.shape == (2, 20, 48) and torch.equal(ours, theirs)
