"""Cache compression: int8 / fp8 K/V pages with per-token scales, int8 / bf16 Mamba state, and the engine on them.

Exact equality with the uncompressed cache is not expected; each compressed path is compared with its own
reference (dequantise, then the reference op) or with the same dtype's engine run another way.
"""

import pytest
import torch
from hybrid.kernels import kv_quant
from hybrid.kernels.paged_attention import (
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_decode_attention_triton,
    paged_prefill_attention,
    paged_prefill_attention_ref,
    write_kv,
)
from triton_cases import needs_triton

from hybrid import Engine, HybridCache, HybridLM, SamplingParams, recipes
from hybrid.cache import StatePool, cache_dtypes, sequences_that_fit

QUANT_KV = [torch.int8, kv_quant.FP8]
DTYPE_PAIRS = [("bfloat16", "bfloat16"), ("int8", "int8"), ("fp8", "bfloat16"), ("int8", "float32")]


def _half_step(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Half the distance to the next code of each stored value (the rounding error bound), times its scale."""
    if q.dtype == torch.int8:
        return (0.5 * scale).expand(q.shape)
    # e4m3: 3 mantissa bits, so half a step is 2^-4 of the value's power of two; subnormals step 2^-9
    mag = q.float().abs()
    step = torch.where(mag >= 2.0 ** -6, torch.exp2(torch.floor(torch.log2(mag.clamp_min(2.0 ** -6)))) / 8, 2.0 ** -9)
    return 0.5 * step * scale


@pytest.mark.parametrize("dtype", QUANT_KV)
def test_quantize_round_trip_within_the_format_bound(dtype):
    x = torch.randn(64, 4, 16) * torch.rand(64, 4, 1) * 10
    scale = x.abs().amax(-1, keepdim=True) / kv_quant.qmax(dtype)
    q = kv_quant.quantize(x, scale, dtype)
    err = (kv_quant.dequantize(q, scale) - x).abs()
    assert (err <= _half_step(q, scale) * (1 + 1e-5) + 1e-7).all()
    assert q.dtype == dtype and kv_quant.quantize(torch.zeros(2, 3), torch.zeros(2, 1), dtype).float().abs().sum() == 0


def _pages(dtype, lens, BS=4, H=2, D=16, token_by_token=True, seed=0):
    """Quantised pools written as an engine does (token by token, or each sequence's tokens in one write), the
    fp32 values written, and block tables."""
    g = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // BS) for n in lens]
    nb = sum(per_seq) + 2
    order = (torch.randperm(nb - 1, generator=g) + 1).tolist()
    tables = torch.zeros(len(lens), max(per_seq), dtype=torch.int32)
    used = 0
    for b, n in enumerate(per_seq):
        tables[b, :n] = torch.tensor(order[used:used + n])
        used += n
    kp, vp = torch.zeros(nb, BS, H, D, dtype=dtype), torch.zeros(nb, BS, H, D, dtype=dtype)
    ks, vs = (torch.zeros(nb, BS, H, dtype=kv_quant.KV_SCALE_DTYPE) for _ in "kv")
    kf, vf = torch.zeros(nb, BS, H, D), torch.zeros(nb, BS, H, D)
    writes = [(b, p, p + 1) for p in range(max(lens)) for b, n in enumerate(lens) if p < n] if token_by_token \
        else [(b, 0, n) for b, n in enumerate(lens)]
    for b, p0, p1 in writes:
        slots = torch.tensor([int(tables[b, p // BS]) * BS + p % BS for p in range(p0, p1)])
        # magnitudes that differ along the sequence and between heads, as real keys do
        k = torch.randn(p1 - p0, H, D, generator=g) * torch.arange(p0 + 1, p1 + 1)[:, None, None] ** 0.5
        v = torch.randn(p1 - p0, H, D, generator=g) * torch.tensor([1.0, 0.01])[:H, None]
        write_kv(kp, vp, k, v, slots, ks, vs)
        kf.view(-1, H, D)[slots], vf.view(-1, H, D)[slots] = k, v
    return kp, vp, ks, vs, kf, vf, tables, torch.tensor(lens, dtype=torch.int32)


def _written(pool, tables, lens):
    BS = pool.shape[1]
    mask = torch.zeros(pool.shape[:2], dtype=torch.bool)
    for b, n in enumerate(lens.tolist()):
        for p in range(n):
            mask[int(tables[b, p // BS]), p % BS] = True
    return mask


def _token_bound(q, scale, x):
    """Half a step of each token's own scale, plus what saturating costs where the stored (fp16-rounded)
    scale came out a hair below |max| / qmax (at most 2^-11 of |max|)."""
    qm = kv_quant.qmax(q.dtype)
    amax = x.abs().amax(-1, keepdim=True)
    s = scale.float()[..., None]
    return _half_step(q, s) + (amax - qm * s).clamp_min(0) + 1e-7


@pytest.mark.parametrize("dtype", QUANT_KV)
def test_write_kv_scales_each_token_alone_within_the_bound(dtype):
    kp, vp, ks, vs, kf, vf, tables, lens = _pages(dtype, [7, 10, 3], token_by_token=False)
    mask = _written(kp, tables, lens)
    # a token's codes and scale depend on that token only: the same values written one token at a time, last
    # first, into fresh pools give the same bits as each sequence's tokens in one write
    alone = [torch.zeros_like(t) for t in (kp, vp, ks, vs)]
    for slot in reversed(mask.flatten().nonzero()[:, 0].tolist()):
        write_kv(*alone[:2], kf.view(-1, *kf.shape[2:])[slot:slot + 1], vf.view(-1, *vf.shape[2:])[slot:slot + 1],
                 torch.tensor([slot]), *alone[2:])
    for a, b in zip(alone, (kp, vp, ks, vs), strict=True):
        assert torch.equal(kv_quant._bits(a), kv_quant._bits(b))
    for q, s, x in ((kp, ks, kf), (vp, vs, vf)):
        expect = (x.abs().amax(-1) / kv_quant.qmax(dtype)).clamp_min(kv_quant.KV_SCALE_MIN).to(s.dtype)
        assert torch.equal(s[mask], expect[mask])  # the scale is the token's own |max| / qmax, per head
        err = (kv_quant.dequantize_pages(q, s, torch.float32) - x).abs()
        assert (err[mask] <= _token_bound(q, s, x)[mask] * (1 + 1e-5)).all()


@pytest.mark.parametrize("dtype", QUANT_KV)
def test_a_large_token_does_not_coarsen_its_block_neighbours(dtype):
    """One outlier token (1e5 x the others) in a block. Per-block scales (the write this replaced) grew the
    block's scale to the outlier's and re-quantised its neighbours: int8 rounded every small value to 0, fp8
    pushed them into its subnormal range (steps of scale * 2^-9). Per token, the neighbours keep their own
    scale and codes, and their own error bound."""
    BS, H, D = 4, 2, 16
    kp, vp = torch.zeros(2, BS, H, D, dtype=dtype), torch.zeros(2, BS, H, D, dtype=dtype)
    ks, vs = (torch.zeros(2, BS, H, dtype=kv_quant.KV_SCALE_DTYPE) for _ in "kv")
    x = torch.randn(BS, H, D, generator=torch.Generator().manual_seed(3))
    x[2] *= 1e5
    for t in range(BS):  # decode: one token at a time into block 1
        write_kv(kp, vp, x[t:t + 1], x[t:t + 1], torch.tensor([BS + t]), ks, vs)
        if t == 1:
            before = kp[1, :2].clone(), ks[1, :2].clone()
    assert torch.equal(kv_quant._bits(kp[1, :2]), kv_quant._bits(before[0])) and torch.equal(ks[1, :2], before[1])
    err = (kv_quant.dequantize_pages(kp, ks, torch.float32)[1] - x).abs()
    own = (x.abs().amax(-1) / kv_quant.qmax(dtype)).to(ks.dtype)  # each token's own scale, whatever the layout
    assert (err <= _token_bound(kp[1], own, x) * (1 + 1e-5)).all()
    small = torch.tensor([0, 1, 3])
    relative = 0.5 / 127 if dtype == torch.int8 else 1 / 16  # half a step: of |max| (int8), of the value (e4m3)
    assert err[small].amax() <= x[small].abs().amax() * relative * 1.01


@pytest.mark.parametrize("dtype", QUANT_KV)
def test_write_kv_compiles_whole_and_equals_eager(dtype):
    """The compiled decode step traces the write: one graph (fullgraph: no break, no data-dependent branch)
    that writes the same bits as the eager op."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 2, 16, generator=g).bfloat16()
    slots = torch.tensor([5, 6, 7, 12, 0, 0])  # two sequences and padded rows into the null block
    pools = [(torch.zeros(4, 4, 2, 16, dtype=dtype), torch.zeros(4, 4, 2, dtype=kv_quant.KV_SCALE_DTYPE))
             for _ in range(2)]
    kv_quant.write_kv_quantized(*pools[0], x, slots)
    torch.compile(kv_quant.write_kv_quantized, backend="aot_eager", fullgraph=True, dynamic=False)(*pools[1], x, slots)
    for a, b in zip(*pools, strict=True):
        assert torch.equal(kv_quant._bits(a), kv_quant._bits(b))


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_compiled_decode_on_quantised_pages_equals_eager(kv):
    model = _peaked("hybrid-1to7-tiny")
    kw = dict(num_blocks=64, block_size=4, kv_dtype=kv, max_seqs=4)
    eager, _ = _run(model, PROMPTS, 6, **kw)
    compiled, e = _run(model, PROMPTS, 6, compile=True, compile_backend="aot_eager", **kw)
    assert e.stats.compiled_steps > 0 and compiled == eager


def test_copies_carry_scales_and_a_reused_block_needs_no_reset():
    cache = HybridCache(recipes.get("llama-tiny"), num_blocks=4, block_size=4, max_seqs=1, kv_dtype="int8")
    k_pool, v_pool = cache.kv.pools[0]
    k_scale, v_scale = cache.kv.scales[0]
    assert k_scale.shape == k_pool.shape[:3] and k_scale.dtype == kv_quant.KV_SCALE_DTYPE
    (b,) = cache.kv.allocator.allocate(1)
    k_scale[b], k_pool[b] = 3.0, 7
    (c,) = cache.kv.allocator.allocate(1)
    cache.kv.copy_block(b, c)
    assert (k_scale[c] == 3.0).all() and (k_pool[c] == 7).all()
    # a block given back and handed out again keeps its last owner's codes and scales in the slots nobody
    # has written yet; attention never reads them (lengths mask them), so nothing resets them
    for t in (k_pool, v_pool):
        t[b] = 127
    for t in (k_scale, v_scale):
        t[b] = 1e4
    cache.kv.allocator.release([b])
    assert b in cache.kv.allocator.allocate(3)  # 4 blocks, c held: b comes back among the other 3
    H, D = k_pool.shape[2:]
    x = torch.randn(2, H, D)
    write_kv(k_pool, v_pool, x, x, torch.tensor([b * 4, b * 4 + 1]), k_scale, v_scale)
    tables, sl = torch.tensor([[b]], dtype=torch.int32), torch.tensor([2], dtype=torch.int32)
    kd, vd = kv_quant.dequantize_pages(k_pool, k_scale, torch.float32), kv_quant.dequantize_pages(v_pool, v_scale,
                                                                                                   torch.float32)
    q = torch.randn(1, 4 * H, D)
    ref = paged_decode_attention_ref(q, kd, vd, sl, tables)
    torch.testing.assert_close(paged_decode_attention(q, k_pool, v_pool, sl, tables, k_scale=k_scale,
                                                      v_scale=v_scale), ref, atol=1e-5, rtol=1e-5)
    assert ref.abs().max() < 10  # the stale 1e4 * 127 values are not in it


@pytest.mark.parametrize("dtype", QUANT_KV)
@pytest.mark.parametrize("batch", [2, 6])  # 6: the batched torch decode (online softmax over block groups)
def test_paged_ops_on_quantised_pages_equal_dequantise_then_reference(dtype, batch):
    lens = [5, 11, 1, 9, 16, 3][:batch]
    kp, vp, ks, vs, _, _, tables, sl = _pages(dtype, lens)
    kd, vd = kv_quant.dequantize_pages(kp, ks, torch.float32), kv_quant.dequantize_pages(vp, vs, torch.float32)
    q = torch.randn(batch, 4, 16)
    ref = paged_decode_attention_ref(q, kd, vd, sl, tables)
    out = paged_decode_attention(q, kp, vp, sl, tables, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(paged_decode_attention(q, kp, vp, sl, tables, k_scale=ks, v_scale=vs, window=4),
                               paged_decode_attention_ref(q, kd, vd, sl, tables, window=4), atol=1e-5, rtol=1e-5)
    new = [min(n, 3) for n in lens]
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    qp = torch.randn(sum(new), 4, 16)
    torch.testing.assert_close(paged_prefill_attention(qp, kp, vp, cu, sl, tables, k_scale=ks, v_scale=vs),
                               paged_prefill_attention_ref(qp, kd, vd, cu, sl, tables), atol=1e-5, rtol=1e-5)


def test_paged_ops_refuse_quantised_pages_without_scales():
    kp, vp, ks, vs, _, _, tables, sl = _pages(torch.int8, [3, 4])
    with pytest.raises(ValueError, match="needs k_scale and v_scale"):
        paged_decode_attention(torch.randn(2, 4, 16), kp, vp, sl, tables)
    with pytest.raises(ValueError, match="scales must be per token"):
        paged_decode_attention(torch.randn(2, 4, 16), kp, vp, sl, tables, k_scale=ks[:, :1], v_scale=vs[:, :1])
    with pytest.raises(ValueError, match=r"\[blocks, block_size, Hkv\]"):  # the per-block layout of before
        paged_decode_attention(torch.randn(2, 4, 16), kp, vp, sl, tables, k_scale=ks[:, 0], v_scale=vs[:, 0])


@needs_triton
@pytest.mark.parametrize("dtype", QUANT_KV)
def test_triton_paged_kernels_read_quantised_pages(dtype):
    from hybrid.kernels.attention import flash_attention_triton

    lens = [5, 11, 2]
    kp, vp, ks, vs, _, _, tables, sl = _pages(dtype, lens)
    kd, vd = kv_quant.dequantize_pages(kp, ks, torch.float32), kv_quant.dequantize_pages(vp, vs, torch.float32)
    q = torch.randn(3, 4, 16)
    torch.testing.assert_close(paged_decode_attention_triton(q, kp, vp, sl, tables, k_scale=ks, v_scale=vs),
                               paged_decode_attention_ref(q, kd, vd, sl, tables), atol=1e-5, rtol=1e-5)
    cu = torch.tensor([0, 3, 6, 8], dtype=torch.int32)
    qp = torch.randn(8, 4, 16)
    torch.testing.assert_close(flash_attention_triton(qp, kp, vp, cu, seq_lens=sl, block_tables=tables, k_scale=ks,
                                                      v_scale=vs),
                               paged_prefill_attention_ref(qp, kd, vd, cu, sl, tables), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("stochastic", [False, True])
def test_int8_state_rows_round_trip_per_head(stochastic):
    pool = StatePool((4, 8, 16), torch.int8, 5, 4, stochastic=stochastic)
    x = torch.randn(3, 4, 8, 16) * torch.tensor([0.01, 1.0, 10.0, 100.0])[None, :, None, None]
    slots = torch.tensor([4, 0, 2])
    pool.write(slots, x)
    back = pool.read(slots)
    per_head = x.abs().amax((2, 3)) / 127  # [3, 4]: each head keeps its own scale
    bound = (1.0 if stochastic else 0.5) * per_head[..., None, None]
    assert ((back - x).abs() <= bound * (1 + 1e-5)).all()
    assert torch.equal(pool.scale[slots], per_head)


def test_stochastic_rounding_is_unbiased_and_bf16_stochastic_brackets():
    x = torch.full((20000,), 0.3)
    q, s = kv_quant.quantize_rows(torch.cat([x, torch.ones(1)])[None], 1, stochastic=True)
    mean = kv_quant.dequantize_rows(q, s)[0, :-1].mean()
    assert abs(mean - 0.3) < 3 * (s.item() / 2) / 20000 ** 0.5 * 2
    y = torch.rand(1000) * 3
    b = kv_quant.bf16_stochastic(y).float()
    lo, hi = y.to(torch.bfloat16).float(), y.to(torch.bfloat16).float()
    near = (b - y).abs() <= (y.abs() * 2.0 ** -7)  # within one bf16 step
    assert near.all() and ((b == lo) | (b == hi) | (b != lo)).all()


def test_state_pool_step_runs_the_kernel_on_dequantised_rows():
    from hybrid import kernels

    pool = StatePool((4, 3), torch.int8, 4, 4)
    ref = torch.randn(2, 4, 3)
    slots = torch.tensor([3, 1])
    pool.write(slots, ref)
    ref = pool.read(slots).clone()
    x, w = torch.randn(2, 4), torch.randn(4, 4)
    y = pool.step(kernels.causal_conv1d_step, x, w, None, slots=slots)
    y_ref = kernels.causal_conv1d_step_ref(ref, x, w)
    torch.testing.assert_close(y, y_ref)
    assert ((pool.read(slots) - ref).abs() <= 0.5 * ref.abs().amax(-1, keepdim=True).max() / 127 + 1e-6).all()


def test_bad_dtypes_say_what_is_accepted():
    with pytest.raises(ValueError, match="kv_dtype 'int4' is not supported; choose one of"):
        Engine(HybridLM(recipes.get("llama-tiny")), num_blocks=4, kv_dtype="int4")
    with pytest.raises(ValueError, match="state_dtype 'fp8'"):
        cache_dtypes(torch.float32, None, "fp8")
    with pytest.raises(ValueError, match="with cache= pass them"):
        m = HybridLM(recipes.get("llama-tiny"))
        Engine(m, cache=HybridCache.for_model(m, num_blocks=4), kv_dtype="int8")


@pytest.mark.parametrize("kv,state", [("int8", "int8"), ("fp8", "bfloat16"), ("bfloat16", "float32")])
def test_capacity_from_specs_equals_what_the_cache_allocates(kv, state):
    cfg = recipes.get("jamba-tiny")
    d = cache_dtypes(torch.float32, kv, state)
    budget, seq_len, max_seqs = 2**20, 100, 4
    cache = HybridCache(cfg, cache_bytes=budget, max_seqs=max_seqs, block_size=16, kv_dtype=d.kv, conv_dtype=d.conv,
                        ssm_dtype=d.ssm)
    tensors = [t for pair in [*cache.kv.pools.values(), *cache.kv.scales.values()] for t in pair]
    tensors += [t for pools in cache.ssm.state_pools.values() for p in pools for t in (p.data, p.scale)
                if t is not None]
    allocated = sum(t.numel() * t.element_size() for t in tensors)
    assert allocated == cache.bytes_total <= budget
    assert budget - allocated < cache.kv.bytes_per_block  # the budget is spent, to less than one block
    r = cache.report()
    assert r.bytes_per_sequence(seq_len) == cache.spec.bytes_per_sequence(seq_len, block_size=16)
    # as many sequences as the spec says fit in a cache with that many slots really get admitted
    fits = sequences_that_fit(cfg, budget, seq_len, kv_dtype=d.kv, conv_dtype=d.conv, ssm_dtype=d.ssm)
    big = HybridCache(cfg, cache_bytes=budget, max_seqs=fits, kv_dtype=d.kv, conv_dtype=d.conv, ssm_dtype=d.ssm)
    assert big.kv.num_blocks // big.kv.blocks_for(seq_len) >= fits
    bigger = HybridCache(cfg, num_blocks=0, max_seqs=fits + 1, kv_dtype=d.kv, conv_dtype=d.conv, ssm_dtype=d.ssm,
                         device="meta")
    room = (budget - bigger.ssm.bytes_total) // bigger.kv.bytes_per_block - 1
    assert room // big.kv.blocks_for(seq_len) < fits + 1  # one more sequence does not fit


def test_compressed_state_shrinks_the_hybrids_cache_as_the_specs_say():
    cfg = recipes.get("hybrid-1to7-small")
    base = sequences_that_fit(cfg, 4 * 2**30, 4096, kv_dtype=torch.bfloat16, conv_dtype=torch.bfloat16)
    small = sequences_that_fit(cfg, 4 * 2**30, 4096, kv_dtype="int8", conv_dtype="int8", ssm_dtype="int8")
    assert small >= 2.5 * base  # the capacity goal for the 1:7 hybrid, from the specs


def _peaked(name: str) -> HybridLM:
    """A tiny random model with peaked logits (a scaled-up head), so greedy tokens are stable under the
    small perturbations of a compressed cache and equalities between engine paths are meaningful."""
    torch.manual_seed(0)
    model = HybridLM(recipes.get(name)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0) if hasattr(model, "lm_head") else model.embed.weight.mul_(30.0)
    return model


def _run(model, prompts, n, **kw):
    e = Engine(model, **kw)
    ids = [e.add_request(p, SamplingParams(max_new_tokens=n)) for p in prompts]
    e.run()
    return [e.requests[i].output for i in ids], e


PROMPTS = [[(7 * i + 3 * j) % 256 for j in range(n)] for i, n in enumerate([9, 23, 5])]


@pytest.mark.parametrize("kv,state", DTYPE_PAIRS)
@pytest.mark.parametrize("name", ["jamba-tiny", "hybrid-1to7-tiny", "gla-hybrid-tiny"])
def test_engine_invariants_under_each_dtype(name, kv, state):
    model = _peaked(name)
    kw = dict(block_size=4, kv_dtype=kv, state_dtype=state)
    packed, e = _run(model, PROMPTS, 8, num_blocks=64, max_batch_tokens=64, **kw)
    assert e.cache.report().kv_dtype == kv
    alone = [_run(model, [p], 8, num_blocks=64, max_batch_tokens=64, **kw)[0][0] for p in PROMPTS]
    assert packed == alone  # each sequence's blocks, scales and state slot are its own
    chunked, _ = _run(model, PROMPTS, 8, num_blocks=64, max_batch_tokens=6, **kw)
    assert chunked == packed
    tight, e = _run(model, PROMPTS, 8, num_blocks=12, max_batch_tokens=64, **kw)  # preempts and recomputes
    assert e.stats.preemptions > 0 and tight == packed


@pytest.mark.parametrize("kv,state", [("int8", "int8"), ("fp8", "bfloat16")])
def test_prefix_cache_checkpoints_keep_codes_and_scales(kv, state):
    model = _peaked("jamba-tiny")
    shared = list(range(40, 70))
    prompts = [shared + [1, 2, 3], shared + [9, 8]]
    off, _ = _run(model, prompts, 6, num_blocks=64, block_size=4, kv_dtype=kv, state_dtype=state)
    e = Engine(model, num_blocks=64, block_size=4, kv_dtype=kv, state_dtype=state, prefix_caching=True,
               prefix_checkpoint_interval=8)
    outs = []
    for p in prompts:  # one after the other, so the second resumes from the first's blocks and checkpoint
        rid = e.add_request(p, SamplingParams(max_new_tokens=6))
        e.run()
        outs.append(e.requests[rid].output)
    assert e.stats.prefix_hit_tokens > 0 and outs == off
    r = e.cache.report()
    assert r.prefix_state_bytes == r.prefix_checkpoints * r.state_bytes_per_sequence
    saved = next(iter(e.cache.prefix.checkpoints.saved.values()))
    assert saved[0][1][0].dtype == (torch.int8 if state == "int8" else torch.bfloat16)


def test_hybrid_info_reports_bytes_at_the_cache_dtypes(capsys):
    from hybrid.cli import main

    main(["info", "--recipe", "jamba-tiny", "--kv-dtype", "int8", "--state-dtype", "int8", "--seq-len", "100"])
    out = capsys.readouterr().out
    cfg = recipes.get("jamba-tiny")
    d = cache_dtypes(torch.float32, "int8", "int8")  # what the CLI's --state-dtype int8 means (conv: model dtype)
    spec = HybridCache(cfg, num_blocks=0, kv_dtype=d.kv, conv_dtype=d.conv, ssm_dtype=d.ssm, device="meta").spec
    assert "KV_bytes/token(int8/int8)" in out and f"| {spec.state_bytes_per_sequence} " in out
    assert str(round(spec.kv_bytes_per_token_with_scales(16), 2)) in out


def test_round_nearest_equals_torch_round_ties_to_even():
    y = torch.cat([torch.arange(-254, 255) / 2, torch.randn(4096) * 60]).clamp(-127, 127)  # every .5 tie
    assert torch.equal(kv_quant.round_nearest_(y.clone()), torch.round(y))
