"""The native decode kernels (kernels/native/*.c) against their torch references, and the decode program
(hybrid/decode/ and each layer's lower_decode, kernels/native/program.c: per block, and the whole step as one
call) against the eager layers and the full forward."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest
import torch
from decode_hooks import avx2_build, eager_step_logits, no_native_steps, sublayer_ops, whole_step_logits
from hybrid.kernels import conv1d, native, paged_attention, projection, ssd, use_backend
from hybrid.kernels.native import ops
from hybrid.kernels.native.build import compiler as c_compiler

from hybrid import Engine, HybridLM, recipes
from hybrid.sampling import SamplingParams

pytestmark = pytest.mark.skipif(native.available() is not None, reason=f"native kernels: {native.available()}")


def _noise(ref: torch.Tensor, dtype: torch.dtype) -> float:
    """One rounding of the reference's largest value in ``dtype`` (0 for fp32: then a tight fp32 bound)."""
    return 0.0 if dtype == torch.float32 else ref.float().abs().max().item() * 2.0 ** -8


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16, 29, 64])  # the one-row, few-row and blocked 4x3 paths
def test_linear_matches_reference(dtype, rows, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # the pool re-sizes to it; 1: the caller alone
    try:
        _check_linear(dtype, rows)
    finally:
        torch.set_num_threads(before)


def _check_linear(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    # odd sizes: the vector tails and the last chunk; K 512, N 1030: bf16 batches on an AMX CPU take the tile unit
    # (16-row blocks, their tail rows the vdpbf16ps path)
    for K, N in ((515, 1027), (512, 1030)):
        _check_linear_shape(dtype, rows, K, N, g)


def _check_linear_shape(dtype, rows, K, N, g):
    x = torch.randn(rows, K, generator=g).to(dtype)
    w = torch.randn(N, K, generator=g).to(dtype)
    b, r = torch.randn(N, generator=g).to(dtype), torch.randn(rows, N, generator=g).to(dtype)
    for bias, res in ((None, None), (b, None), (b, r)):
        assert projection._native_supports(x, w, bias, res) is None
        got = projection._linear_native(x, w, bias, res)
        ref = projection.linear_ref(x, w, bias, res)
        tol = 1e-4 * ref.abs().max().item() + 2 * _noise(ref, dtype)
        assert (got.float() - ref.float()).abs().max().item() <= tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [4, 5, 6, 7, 8, 9, 11, 13, 17, 31, 33, 47, 63, 64])
def test_batched_linear_matches_reference(dtype, rows):
    """The blocked products of a batched step (fp32: 8 weight rows x up to 3 input rows on AVX-512; bf16: 4 x 2 by
    vdpbf16ps) for every way the input rows split into blocks, odd K (vector tails), N tails of the 4- and 16-row
    blocks, and K past an L1's worth of input rows"""
    g = torch.Generator().manual_seed(rows)
    for K, N in ((771, 1037), (64, 19), (2051, 130)):
        x = torch.randn(rows, K, generator=g).to(dtype)
        w = torch.randn(N, K, generator=g).to(dtype)
        got = projection._linear_native(x, w)
        ref = projection.linear_ref(x, w)
        tol = 1e-4 * ref.abs().max().item() + 2 * _noise(ref, dtype)
        assert (got.float() - ref.float()).abs().max().item() <= tol


@pytest.mark.parametrize("K", [515, 2048])
def test_bf16_rows_bits_do_not_depend_on_the_batch(K):
    """A bf16 input row's products (bf16 weights, vdpbf16ps where the CPU has it) carry the same bits alone (B=1) as
    in a batch of 5, 17 or 64: a sequence decodes the same tokens batched as alone"""
    paths = native.cpu_paths()
    if "AVX512-BF16 vdpbf16ps" not in paths or "AMX tile unit (batched bf16 products)" in paths:
        pytest.skip("the promise is the vdpbf16ps path's (the widening and AMX paths sum batches in another order)")
    g = torch.Generator().manual_seed(K)
    w = torch.randn(1031, K, generator=g).bfloat16()
    xs = torch.randn(64, K, generator=g).bfloat16()
    alone = torch.cat([projection._linear_native(xs[i:i + 1], w) for i in range(64)])
    for rows in (5, 17, 64):
        assert torch.equal(projection._linear_native(xs[:rows], w), alone[:rows])


def test_fp32_batched_rows_bits_do_not_depend_on_the_batch():
    """On AVX-512 an fp32 input row's products in a batch of 4-64 (8 weight rows x blocks of up to 3 input rows, one
    fixed reduction tree) carry the same bits whatever the batch and whichever block the row fell in; and the fused
    epilogues (bias, residual, the gated MLP's SiLU) give each row the bits of the same row in another batch"""
    if "AVX-512" not in native.cpu_paths():
        pytest.skip("the promise is the AVX-512 fp32 block path's")
    g = torch.Generator().manual_seed(7)
    w, b = torch.randn(1037, 771, generator=g), torch.randn(1037, generator=g)
    xs, res = torch.randn(64, 771, generator=g), torch.randn(64, 1037, generator=g)
    full = projection._linear_native(xs, w, b, res)
    for rows in (4, 5, 17, 33):
        for lo in (0, 64 - rows):  # the rows at the front and at the back of the 64 (other blocks of three)
            part = projection._linear_native(xs[lo:lo + rows], w, b, res[lo:lo + rows])
            assert torch.equal(part, full[lo:lo + rows])
    wg, wu = torch.randn(130, 771, generator=g), torch.randn(130, 771, generator=g)

    def gated(x):
        y = torch.empty(x.shape[0], 130)
        assert native.library().hl_gated_up(wg.data_ptr(), None, None, wu.data_ptr(), None, None, 0, -1,
                                            x.data_ptr(), 0, y.data_ptr(), 0, x.shape[0], 130, 771) == 0
        return y

    full = gated(xs)
    ref = torch.nn.functional.silu(xs @ wg.T) * (xs @ wu.T)
    assert (full - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()
    for rows in (4, 17):
        assert torch.equal(gated(xs[64 - rows:].contiguous()), full[64 - rows:])


@pytest.mark.parametrize("rows", [2, 7, 64])
def test_linear_int8_row_scales(rows):
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(-127, 128, (301, 133), dtype=torch.int8, generator=g)
    scale = torch.rand(301, generator=g) * 0.01
    x = torch.randn(rows, 133, generator=g)
    got = projection._linear_native(x, codes, None, None, scale)
    ref = projection.linear_ref(x, codes, None, None, scale)
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_linear_dispatch_takes_torch_for_many_rows_and_autograd():
    w = torch.randn(8, 4, requires_grad=True)
    assert projection._native_supports(torch.randn(2, 4), w) == "autograd"
    assert "rows" in projection._native_supports(torch.randn(native.MAX_ROWS + 1, 4), w.detach())
    y = projection.linear(torch.randn(2, 4), w)  # autograd still works through the dispatch
    y.sum().backward()
    assert w.grad is not None


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ssd_step_matches_reference(state_dtype, dtype):
    g = torch.Generator().manual_seed(1)
    S, B, H, P, N, G = 5, 3, 6, 8, 19, 2
    state = torch.randn(S, H, P, N, generator=g).to(state_dtype)
    slots = torch.tensor([4, 0, 2])
    xBC = torch.randn(B, H * P + 2 * G * N + 3, generator=g).to(dtype)  # strided views, as the layer splits them
    x = xBC[:, :H * P].reshape(B, H, P)
    Bm = xBC[:, H * P:H * P + G * N].reshape(B, G, N)
    Cm = xBC[:, H * P + G * N:H * P + 2 * G * N].reshape(B, G, N)
    dt, A, D = torch.rand(B, H, generator=g), -torch.rand(H, generator=g), torch.randn(H, generator=g).to(dtype)
    assert ops.supports_ssd_step(state, x, dt, A, Bm, Cm, D=D, slots=slots) is None
    mine, theirs = state.clone(), state.clone()
    y = ops.ssd_step(mine, x, dt, A, Bm, Cm, D=D, slots=slots)
    rows = theirs[slots].clone()
    y_ref = ssd.ssd_step_ref(rows, x, dt, A, Bm, Cm, D=D)
    theirs[slots] = rows
    assert (y.float() - y_ref.float()).abs().max() <= 1e-5 + 2 * _noise(y_ref, dtype)
    assert (mine.float() - theirs.float()).abs().max() <= 1e-5 + 2 * _noise(theirs, state_dtype)
    untouched = torch.tensor([1, 3])
    assert torch.equal(mine[untouched], state[untouched])


@pytest.mark.parametrize("K", [4, 3])  # 4: Mamba-2's width (its 16-lane path where the dtypes have one)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # x, weight and bias
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_conv_step_matches_reference(state_dtype, dtype, K):
    g = torch.Generator().manual_seed(2)
    S, B, C = 4, 2, 37
    state = torch.randn(S, C, K - 1, generator=g).to(state_dtype)
    slots = torch.tensor([3, 1])
    x = torch.randn(B, C + 5, generator=g).to(dtype)[:, :C]
    w, bias = torch.randn(C, K, generator=g).to(dtype), torch.randn(C, generator=g).to(dtype)
    mine, theirs = state.clone(), state.clone()
    y = ops.conv_step(mine, x, w, bias, activation="silu", slots=slots)
    rows = theirs[slots].clone()
    y_ref = conv1d.causal_conv1d_step_ref(rows, x, w, bias, activation="silu")
    theirs[slots] = rows
    assert (y.float() - y_ref.float()).abs().max() <= 1e-5 + _noise(y_ref, dtype) and torch.equal(mine, theirs)


def _libm_silu_bf16(acc: torch.Tensor) -> torch.Tensor:
    """bf16(x / (1 + expf(-x))) in fp32 with libm's expf: the scalar SiLU whose bits the native bf16 paths keep"""
    import ctypes
    import ctypes.util

    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    libm.expf.restype, libm.expf.argtypes = ctypes.c_float, [ctypes.c_float]
    e = torch.tensor([libm.expf(-v) for v in acc.tolist()], dtype=torch.float32)
    return (acc / (1.0 + e)).to(torch.bfloat16)  # fp32 add and divide (IEEE), then round to nearest even


@pytest.mark.parametrize("w_last", ["one", "fp32"])
def test_bf16_conv_silu_has_libms_bits_for_every_bf16_input(w_last):
    """A bf16 conv step's SiLU (16-lane silu16_ps, libm's expf where the two could round apart) gives libm's bits for
    every finite bf16 input: the conv as a pass-through (zero state and first taps) of each of the 65,536 bf16 bit
    patterns, times 1 (the gated MLP's case: its SiLU input is a bf16 value) or an fp32 weight (any fp32 sum)."""
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = x[torch.isfinite(x.float())]
    C = x.numel()
    w = torch.zeros(C, 4)
    g = torch.Generator().manual_seed(4)
    w[:, 3] = 1.0 if w_last == "one" else torch.rand(C, generator=g) * 1.5 + 0.5
    if w_last == "one":
        w = w.to(torch.bfloat16)  # all bf16: the width-4 16-lane path (the fp32 weights: the eight-channel one)
    state = torch.zeros(1, C, 3, dtype=torch.bfloat16)
    y = ops.conv_step(state, x[None], w, None, activation="silu")
    acc = x.float() * w[:, 3].float() + 0.0  # the conv's sum: from +0, one product added (rounded once)
    ref = _libm_silu_bf16(acc)
    nan = ref.isnan()  # (-inf / inf, past the fp32 range: a NaN either way, its sign bit aside)
    assert torch.equal(y[0].isnan(), nan) and (w_last == "fp32") == bool(nan.any())
    assert torch.equal(y[0][~nan].view(torch.int16), ref[~nan].view(torch.int16))


def test_bf16_conv_silu_has_libms_bits_where_the_vector_lanes_round_apart():
    """Where silu16_ps and libm's SiLU round to different bf16 (fp32 results a few ulp apart across a rounding
    midpoint: the inputs found here by solving silu(x) = a midpoint, then taking each solution's fp32 neighbours),
    the bf16 conv step still gives libm's bits: the lanes the fallback exists for, which an even sweep almost never
    meets."""
    g = torch.Generator().manual_seed(5)
    lo = (torch.rand(4000, generator=g, dtype=torch.float64) * 6 - 3).exp().to(torch.bfloat16)
    hi = (lo.view(torch.int16) + 1).view(torch.bfloat16)
    mid = (lo.double() + hi.double()) / 2  # bf16 rounding midpoints in 0.05..20
    x = mid.clone()
    for _ in range(40):  # Newton on x * sigmoid(x) = mid (increasing for x > 0)
        s = torch.sigmoid(x)
        x = x - (x * s - mid) / (s + x * s * (1 - s))
    x = x.float()
    steps = torch.arange(-3, 4, dtype=torch.int32)
    targets = (x.view(torch.int32)[:, None] + steps).flatten().view(torch.float32)  # fp32 neighbours
    C = targets.numel()
    w = torch.zeros(C, 4)
    w[:, 3] = 1.0
    vec = ops.conv_step(torch.zeros(1, C, 3), targets[None].clone(), w, None,
                        activation="silu")[0]  # all fp32: the sums are the targets, silu_f32's lanes, no fallback
    libm = _libm_silu_bf16(targets)
    apart = vec.to(torch.bfloat16).view(torch.int16) != libm.view(torch.int16)
    if "AVX-512" in native.cpu_paths():  # the vector lanes are there: so are the hard cases
        assert apart.sum() >= 5
    w[:, 3] = targets  # bf16 input 1.0 times the target: the conv's sum is the target exactly
    y = ops.conv_step(torch.zeros(1, C, 3, dtype=torch.bfloat16), torch.ones(1, C, dtype=torch.bfloat16), w, None,
                      activation="silu")[0]
    assert torch.equal(y.view(torch.int16), libm.view(torch.int16))


@pytest.mark.parametrize("window", [None, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_matches_reference(dtype, window):
    g = torch.Generator().manual_seed(3)
    NB, BS, Hkv, D, Hq = 20, 16, 2, 80, 8  # head_dim 80: not a multiple of the vector width twice over
    k_pool = torch.randn(NB, BS, Hkv, D, generator=g).to(dtype)
    v_pool = torch.randn(NB, BS, Hkv, D, generator=g).to(dtype)
    q = torch.randn(3, Hq, D, generator=g).to(dtype)
    lens = torch.tensor([5, 40, 70], dtype=torch.int32)
    tables = torch.tensor([[3, 0, 0, 0, 0], [1, 7, 9, 0, 0], [2, 4, 6, 8, 10]], dtype=torch.int32)
    assert ops.supports_paged_decode(q, k_pool, v_pool, lens, tables, window=window) is None
    got = ops.paged_decode(q, k_pool, v_pool, lens, tables, window=window)
    ref = paged_attention.paged_decode_attention_ref(q, k_pool, v_pool, lens, tables, window=window)
    assert (got.float() - ref.float()).abs().max() <= 1e-5 + 2 * _noise(ref, dtype)



@pytest.mark.parametrize("window", [None, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 4, 64, 16), (8, 2, 128, 16), (16, 2, 80, 7), (8, 1, 72, 16)])
@pytest.mark.parametrize("lens", [[2047], [1000, 3001], [17, 256, 257, 512, 1537]])
def test_paged_decode_long_contexts(heads, dtype, window, lens):
    """Long contexts (split into spans of keys that threads take apart and a second pass combines), spans ending
    on and off block and span boundaries, sliding windows, 1 / 4 / 8 query heads per KV head, head dims 64 / 72 /
    80 / 128, batch 1-5: within the rounding of the short-context test; and the same bits on 1 and 2 threads."""
    Hq, Hkv, D, BS = heads
    g = torch.Generator().manual_seed(len(lens) * 100 + D)
    B = len(lens)
    cols = -(-max(lens) // BS)
    NB = B * cols + 3
    k_pool = torch.randn(NB, BS, Hkv, D, generator=g).to(dtype)
    v_pool = torch.randn(NB, BS, Hkv, D, generator=g).to(dtype)
    q = (torch.randn(B, Hq, D, generator=g) * 2).to(dtype)  # peaked softmaxes as well as flat ones
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    tables = (torch.randperm(NB - 1, generator=g)[:B * cols] + 1).view(B, cols).to(torch.int32)
    assert ops.supports_paged_decode(q, k_pool, v_pool, seq_lens, tables, window=window) is None
    threads = torch.get_num_threads()
    try:
        got = []
        for n in (1, 2):
            torch.set_num_threads(n)
            got.append(ops.paged_decode(q, k_pool, v_pool, seq_lens, tables, window=window))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got[0], got[1])
    ref = paged_attention.paged_decode_attention_ref(q, k_pool, v_pool, seq_lens, tables, window=window)
    assert (got[0].float() - ref.float()).abs().max() <= 1e-5 + 2 * _noise(ref, dtype)


def _greedy(model, prompts, new_tokens, backend=None, max_seqs=4, **engine_kw):
    with torch.inference_mode(), use_backend(backend):
        engine = Engine(model, num_blocks=64, block_size=16, max_seqs=max_seqs, **engine_kw)
        ids = [engine.add_request(p, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)) for p in prompts]
        engine.run()
        return [engine.requests[i].output for i in ids]


@pytest.mark.parametrize("recipe", ["llama-tiny", "mamba2-tiny", "hybrid-1to7-tiny", "samba-tiny"])
def test_fused_decode_equals_eager_and_forward(recipe):
    """The fused sub-layers (the default on a CPU) give the tokens of the eager layers (HYBRID_BACKEND=torch)
    and of the full forward, for several sequences decoding together."""
    torch.manual_seed(0)
    model = HybridLM(recipes.get(recipe)).eval()
    with torch.no_grad():
        (model.lm_head.weight if model.lm_head is not None else model.embed.weight).mul_(20)
    prompts = [list(range(1, 12)), list(range(5, 30)), [3] * 7]
    fused = _greedy(model, prompts, 12)
    assert fused == _greedy(model, prompts, 12, backend="torch")
    seq = list(prompts[1])
    with torch.inference_mode():
        for _ in range(12):
            seq.append(int(model(torch.tensor([seq]), logits_to_keep=1)[0, -1].argmax()))
    assert fused[1] == seq[len(prompts[1]):]


@pytest.mark.parametrize("recipe", ["llama-tiny", "hybrid-1to7-tiny"])
def test_fused_sublayers_bit_equal_to_eager_in_bf16(recipe, monkeypatch):
    """In bf16 each fused sub-layer rounds where the torch ops round: the same bits as the eager layer on the
    same input (attention and MLP, whose cache writes are idempotent, so both can run on one step)."""
    import hybrid.model as model_mod

    torch.manual_seed(0)
    model = HybridLM(recipes.get(recipe)).to(torch.bfloat16).eval()
    checked = []
    plain = model_mod.Block.forward

    def both(self, x, batch=None, cache=None):
        if batch is None or batch.prefill is not None or self.kind not in ("attention", "mlp"):
            return plain(self, x, batch, cache)
        fused = sublayer_ops(model, self, x, batch, cache)
        h = self.norm(x)
        eager = x + (self.mixer.forward_packed(h, batch, cache.view(self.index)) if self.caches
                     else self.mixer(h))
        assert fused is not None and torch.equal(fused, eager)
        checked.append(self.kind)
        return eager

    monkeypatch.setattr(model_mod.Block, "forward", both)
    no_native_steps(monkeypatch)  # the eager blocks, each beside its own native ops (sublayer_ops)
    _greedy(model, [list(range(1, 12)), [7] * 20], 4)
    assert "mlp" in checked and ("attention" in checked or recipe != "llama-tiny")


def _step_logits(model, prompts, whole: bool, monkeypatch):
    """Each decode step's logits of an engine run, through the whole-step program or (whole=False) block by
    block."""
    got = whole_step_logits(monkeypatch) if whole else eager_step_logits(monkeypatch, sublayers=True)
    _greedy(model, prompts, 6)
    monkeypatch.undo()
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recipe", ["llama-tiny", "mamba2-tiny", "hybrid-1to7-tiny"])
def test_whole_step_program_equals_block_programs(recipe, dtype, monkeypatch):
    """The whole decode step as one native call computes what the per-block programs and the eager final norm
    and LM head compute: the blocks are the same ops, the final norm sums in another order (fp32 noise; in
    bf16 at most a rounding of the largest logit)."""
    torch.manual_seed(0)
    model = HybridLM(recipes.get(recipe)).to(dtype).eval()
    prompts = [list(range(1, 12)), [7] * 20, list(range(40, 45))]
    whole = _step_logits(model, prompts, True, monkeypatch)
    blocks = _step_logits(model, prompts, False, monkeypatch)
    assert len(whole) == len(blocks) == 5  # the prefill samples the first of the 6 tokens
    for a, b in zip(whole, blocks, strict=True):
        assert a.dtype == b.dtype == dtype and a.shape == b.shape == (len(prompts), model.config.vocab_size)
        assert (a.float() - b.float()).abs().max() <= 1e-5 + 2 * _noise(b, dtype)


def test_program_follows_rebound_weights_and_skips_uncovered_layers():
    """A program binds pointers: when a weight is replaced (not updated in place) the engine's next step
    rebuilds it, and the tokens follow the new weights; a layer it does not cover (int8 K/V pages) runs eager
    while the others keep their native ops."""
    from hybrid.decode import program as decode_program

    torch.manual_seed(0)
    model = HybridLM(recipes.get("llama-tiny")).eval()
    prompts = [list(range(1, 12))]
    before = _greedy(model, prompts, 8)
    with torch.no_grad():
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.flip(0).contiguous())
    after = _greedy(model, prompts, 8)
    with use_backend("torch"):
        assert after == _greedy(model, prompts, 8)
    assert after != before
    with torch.inference_mode():
        engine = Engine(model, num_blocks=64, block_size=16, max_seqs=4, kv_dtype=torch.int8)
        rid = engine.add_request(prompts[0], SamplingParams(max_new_tokens=8, ignore_eos=True))
        engine.run()
        why = decode_program.coverage(model, engine.cache)
    assert any(w and "quantised" in w for w in why) and None in why
    with use_backend("torch"):
        assert [engine.requests[rid].output] == _greedy(model, prompts, 8, kv_dtype=torch.int8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_equals_torch(dtype):
    """Greedy sampling's native argmax = torch.argmax: first index of the largest, NaN largest, ties, +inf, tails."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 32003, generator=g).to(dtype)
    x[2, 100] = float("nan")
    x[3, :] = 1.0
    x[4, 7] = float("inf")
    x[5, 32001] = 9.0
    x[6, 5], x[6, 9] = 50.0, 50.0
    assert native.argmax(x) == x.argmax(-1).tolist()
    assert native.argmax(x[:1]) == x[:1].argmax(-1).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recipe", ["llama-tiny", "hybrid-1to7-tiny"])
def test_batched_program_equals_eager(recipe, dtype):
    """Seven sequences decoding together (the blocked products of a batched step: 4x3 fp32, bf16 by vdpbf16ps or,
    on an AMX CPU, the tile unit; and their row tails) give the eager layers' tokens, and each sequence its tokens
    alone."""
    torch.manual_seed(0)
    model = HybridLM(recipes.get(recipe)).to(dtype).eval()
    with torch.no_grad():
        (model.lm_head.weight if model.lm_head is not None else model.embed.weight).mul_(20)
    prompts = [list(range(1 + i, 9 + 3 * i)) for i in range(7)]
    together = _greedy(model, prompts, 10, max_seqs=8)
    assert together == _greedy(model, prompts, 10, backend="torch", max_seqs=8)
    assert together[5] == _greedy(model, [prompts[5]], 10)[0]


def test_stream_prefetch_follows_the_weights_and_the_cache_and_changes_no_bits(monkeypatch):
    """The decode program prefetches its weights past the caches only when they do not fit in a quarter of the
    last-level cache (they are then read from memory every step); on or off, the products and the tokens are the
    same."""
    from hybrid.decode import program as decode_program

    assert native.l3_bytes() >= 0
    monkeypatch.setattr(native, "l3_bytes", lambda: 64 * 2**20)
    assert native.streams_from_memory(17 * 2**20) and not native.streams_from_memory(16 * 2**20)  # a quarter
    monkeypatch.setattr(native, "l3_bytes", lambda: 0)  # unknown: from memory, the kernels' default
    assert native.streams_from_memory(1)
    torch.manual_seed(0)
    model = HybridLM(recipes.get("hybrid-1to7-tiny")).to(torch.bfloat16).eval()
    expected = sum(m.weight.numel() * 2 for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert decode_program._decode_weight_bytes(model) == expected + (0 if model.lm_head is not None
                                                                   else model.embed.weight.numel() * 2)
    # one input row takes one weight row at a time while streaming and four rows a pass otherwise: the same bits
    pairs = [(torch.randn(300, 512).bfloat16(), torch.randn(rows, 512).bfloat16()) for rows in (2, 1)]
    pairs += [(torch.randn(301, 515), torch.randn(rows, 515)) for rows in (2, 1)]
    outs, tokens = [], []
    for on in (True, False):
        monkeypatch.setattr(native, "streams_from_memory", lambda n, on=on: on)
        native.set_stream_prefetch(on)
        outs.append([projection.linear(x, w) for w, x in pairs])
        tokens.append(_greedy(model, [list(range(1, 12)), [5] * 9], 6) + _greedy(model, [[3, 1, 4, 1, 5]], 6))
    native.set_stream_prefetch(True)
    assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True)) and tokens[0] == tokens[1]


@pytest.mark.parametrize("recipe", ["llama-tiny", "hybrid-1to7-tiny"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_row_streaming_paths_give_the_blocked_paths_bits(monkeypatch, recipe, dtype):
    """With the weights streaming (P_stream) one input row's products, gated MLP up-projections and q/k/v go row
    by row straight to their outputs; without, through the 16-row blocks: every batch-1 step's logits are the same
    bits either way (a model this small fits the cache, so the streaming paths run only when forced here)."""
    from hybrid.decode import program as decode_program

    torch.manual_seed(0)
    model = HybridLM(recipes.get(recipe)).to(dtype).eval()
    got = whole_step_logits(monkeypatch)
    runs = []
    for on in (True, False):
        monkeypatch.setattr(native, "streams_from_memory", lambda n, on=on: on)
        decode_program._programs.clear()  # a fresh program, which reads streams_from_memory
        got.clear()
        _greedy(model, [list(range(1, 12))], 6, max_seqs=1)
        runs.append([t.clone() for t in got])
    native.set_stream_prefetch(True)
    assert len(runs[0]) == len(runs[1]) == 5
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


@pytest.mark.parametrize("words", [1, 7, 32768, 32768 * 3 + 5])  # inside one 256 KB chunk, across chunks, tails
def test_stream_read_reads_every_word_once(words):
    """The read-bandwidth probe (hl_stream_read) reads the whole buffer, every 8-byte word once: its checksum is the
    XOR of all the words."""
    g = torch.Generator().manual_seed(words)
    buf = torch.randint(-2**62, 2**62, (words,), dtype=torch.int64, generator=g)
    want = 0
    for v in buf.tolist():
        want ^= v
    assert native.library().hl_stream_read(buf.data_ptr(), words * 8) == want
    assert native.read_bandwidth(mib=64, repeats=2) > 0


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or c_compiler() is None,
                    reason="needs an x86-64 host with a C compiler")
def test_the_library_compiles_for_an_x86_64_without_avx(tmp_path):
    """The kernels build on any x86-64 (their portable C paths), not only where AVX is: an empty asm pinning an
    8-float vector to a ymm register ("+x") made the whole library fail to compile there (then every native path
    was lost, silently: the build's failure falls back to torch). Compile only, no optimisation: the point is
    that the compiler takes it."""
    from hybrid.kernels.native import variants

    for header, text in variants.generated().items():
        (tmp_path / header).write_text(text)
    for f in variants.SOURCES:
        cmd = [c_compiler(), "-O0", "-march=x86-64", "-w", "-fPIC", f"-I{tmp_path}", "-c", str(variants.HERE / f),
               "-o", str(tmp_path / f"{f}.o")]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, (f, res.stderr[-2000:])


def test_avx2_build_matches_reference():
    """What a CPU without AVX-512 runs, built here with -mno-avx512f (on an AVX2-only CPU the library under test is
    that build already): paged decode attention at long contexts, the fp32 / bf16 products for one and several input
    rows, and greedy argmax, against their references with the tolerances of the tests above."""
    import ctypes

    lib = avx2_build()
    if lib is None:
        pytest.skip("no AVX-512 here: the library under test is the AVX2 build already")
    codes = native.DTYPE_CODES
    g = torch.Generator().manual_seed(5)
    for dtype in (torch.float32, torch.bfloat16):
        # paged decode: 4 query heads per KV head, D 80, a window, contexts across spans and blocks
        Hq, Hkv, D, BS, lens, window = 8, 2, 80, 16, [1300, 17, 513], 700
        cols = -(-max(lens) // BS)
        NB = len(lens) * cols + 1
        k_pool = torch.randn(NB, BS, Hkv, D, generator=g).to(dtype)
        v_pool = torch.randn(NB, BS, Hkv, D, generator=g).to(dtype)
        q = (torch.randn(len(lens), Hq, D, generator=g) * 2).to(dtype)
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        tables = (torch.randperm(NB - 1, generator=g)[:len(lens) * cols] + 1).view(len(lens), cols).to(torch.int32)
        for w in (None, window):
            out = torch.empty_like(q)
            lib.hl_paged_decode(q.data_ptr(), codes[dtype], k_pool.data_ptr(), v_pool.data_ptr(), codes[dtype],
                                seq_lens.data_ptr(), tables.data_ptr(), tables.stride(0), out.data_ptr(), len(lens),
                                Hq, Hkv, D, BS, w or 0, D ** -0.5)
            ref = paged_attention.paged_decode_attention_ref(q, k_pool, v_pool, seq_lens, tables, window=w)
            assert (out.float() - ref.float()).abs().max() <= 1e-5 + 2 * _noise(ref, dtype), (dtype, w)
        # products: one input row (one weight row at a time) and several (the blocked path)
        for rows in (1, 7):
            for K, N in ((515, 1027), (512, 96)):
                x, wt = torch.randn(rows, K, generator=g).to(dtype), torch.randn(N, K, generator=g).to(dtype)
                y = torch.empty(rows, N, dtype=dtype)
                assert lib.hl_gemv(wt.data_ptr(), codes[dtype], None, None, 0, x.data_ptr(), codes[dtype], None,
                                   y.data_ptr(), codes[dtype], rows, N, K) == 0
                ref = projection.linear_ref(x, wt)
                assert (y.float() - ref.float()).abs().max().item() <= 1e-4 * ref.abs().max().item() + 2 * _noise(
                    ref, dtype), (dtype, rows, K)
        # greedy argmax: ties, NaN, the tail past the last 8 lanes
        logits = torch.randn(4, 32003, generator=g).to(dtype)
        logits[1, 7], logits[1, 9] = 50.0, 50.0
        logits[2, 100] = float("nan")
        logits[3, 32001] = 60.0
        ids = (ctypes.c_int64 * 4)()
        lib.hl_argmax(logits.data_ptr(), codes[dtype], 4, logits.shape[1], ids)
        assert list(ids) == logits.argmax(-1).tolist()


def test_loading_the_library_leaves_the_floating_point_mode_alone():
    """GCC before 13 links crtfastmath.o into a -ffast-math shared library: loading it set flush-to-zero in the
    loading thread, and torch's ops there then flushed denormals. A fresh process, so no earlier load hides it."""
    code = ("import torch\n"
            "from hybrid.kernels import native\n"
            "x = torch.tensor([1e-39])\n"
            "assert (x * 1.0).item() > 0, 'flushed before the load'\n"
            "native.library()\n"
            "print((x * 1.0).item() > 0, (torch.tensor([1e-30]) * 1e-10).item() > 0)\n")
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "True"]
