"""StreamingLLM's positions as the paper numbers them (within the cache), by a second query rotation.

The references are written from the paper's definition: the query at real position p sees the keys
``StreamingLLM.visible`` allows; they are taken *un-rotated*, rotated at their cache positions 0..n-1 (the
query at n-1), and attended with full softmax attention."""

import copy

import pytest
import torch
from hybrid.kernels import kv_quant
from hybrid.kernels.paged_attention import paged_decode_attention, paged_prefill_attention, write_kv

from hybrid import HybridLM, recipes
from hybrid.cache import NULL_BLOCK, PagedKVCache
from hybrid.cache.manager import CacheManager
from hybrid.cache.pruning import StreamingLLM, parse_policy
from hybrid.engine import Engine
from hybrid.engine.packed_batch import SeqChunk, build_batch
from hybrid.layers.attention import Attention
from hybrid.layers.rope import RotaryEmbedding


def paper_attention(q0, k0, v, policy, rope, query_pos):
    """One query: q0 [Hq, D], k0 / v [L, Hkv, D] un-rotated keys (and values) of positions 0..L-1 ->
    [Hq, D], with the paper's (or, without ``renumber``, the real) positions."""
    seen, cache_pos = policy.cache_positions(query_pos)
    cos, sin = rope.cos_sin(torch.tensor(cache_pos), torch.float32)
    k = rope(k0[seen].float(), cos, sin)
    q = rope(q0[None].float(), cos[-1:], sin[-1:])[0]
    rep = q.shape[0] // k.shape[1]
    s = torch.einsum("hd,shd->hs", q, k.repeat_interleave(rep, 1)) * q.shape[-1] ** -0.5
    return torch.einsum("hs,shd->hd", torch.softmax(s, -1), v[seen].float().repeat_interleave(rep, 1))


def test_sink_position_is_the_querys_place_in_the_papers_cache():
    policy = StreamingLLM(sinks=4, window=4)
    # the paper's example: cache [0, 1, 2, 3, 6, 7, 8] decoding token 9 -> positions 0..7, the query at 7
    seen, cache_pos = policy.cache_positions(9)
    assert seen == [0, 1, 2, 3, 6, 7, 8, 9] and cache_pos == list(range(8))
    p = torch.arange(12)
    assert StreamingLLM.sink_position(p, 4, 4).tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 7, 7, 7, 7]
    for qp in range(12):  # distances: the window keys keep their real ones, the sinks are min(p, S+W-1) - i away
        seen, cache_pos = policy.cache_positions(qp)
        for j, c in zip(seen, cache_pos, strict=True):
            real = qp - j
            assert cache_pos[-1] - c == (real if j >= 4 or qp < 7 else min(qp, 7) - j)


def _pools(k0, v, tables, lens, rope, dtype, bs):
    """Rotated (real positions) keys and values of each sequence written into a paged pool of ``dtype``."""
    H, D = k0[0].shape[1:]
    nb = int(tables.max()) + 1
    k_pool, v_pool = torch.zeros(nb, bs, H, D, dtype=dtype), torch.zeros(nb, bs, H, D, dtype=dtype)
    per_token = dict(dtype=kv_quant.KV_SCALE_DTYPE)  # one scale per token slot and KV head
    scales = ((torch.zeros(nb, bs, H, **per_token), torch.zeros(nb, bs, H, **per_token))
              if kv_quant.is_quantized(dtype) else (None, None))
    for b, n in enumerate(lens):
        pos = torch.arange(n)
        k = rope(k0[b], *rope.cos_sin(pos, torch.float32))
        slots = tables[b].long()[pos // bs] * bs + pos % bs
        write_kv(k_pool, v_pool, k, v[b], slots, *scales)
    return k_pool, v_pool, scales


def _dequantised_unrotated(k_pool, v_pool, scales, table, n, rope, bs):
    """What a sequence's pages hold, back as un-rotated fp32 keys and values (the reference reads the pages)."""
    from hybrid.kernels.paged_attention import gather_kv
    k = gather_kv(k_pool, table, n, scales[0], torch.float32)
    v = gather_kv(v_pool, table, n, scales[1], torch.float32)
    cos, sin = rope.cos_sin(torch.arange(n), torch.float32)
    return rope(k, cos, -sin), v  # rotating by -p undoes the rotation at p


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
@pytest.mark.parametrize("batch", [2, 6])  # per-sequence decode path and the batched one
def test_paged_ops_with_q_sinks_equal_the_papers_attention(dtype, batch):
    torch.manual_seed(1)
    BS, Hq, Hkv, D, S, W = 4, 4, 2, 16, 3, 6
    policy, rope = StreamingLLM(sinks=S, window=W), RotaryEmbedding(D, 10000.0)
    lens = [37, 30, 9, 22, 41, 13][:batch]
    per = [-(-n // BS) for n in lens]
    tables = torch.zeros(batch, max(per), dtype=torch.int32)
    ids = iter(torch.randperm(sum(per)).add(1).tolist())
    for b, n in enumerate(per):
        tables[b, :n] = torch.tensor([next(ids) for _ in range(n)])
    k0 = [torch.randn(n, Hkv, D) for n in lens]
    v = [torch.randn(n, Hkv, D) for n in lens]
    k_pool, v_pool, scales = _pools(k0, v, tables, lens, rope, dtype, BS)
    q0 = torch.randn(batch, Hq, D)
    pos = torch.tensor(lens) - 1
    q = rope(q0[:, None], *rope.cos_sin(pos[:, None], torch.float32))[:, 0]
    q_sinks = rope(q0[:, None], *rope.cos_sin(StreamingLLM.sink_position(pos, S, W)[:, None], torch.float32))[:, 0]
    ref = []
    for b, n in enumerate(lens):
        kd, vd = _dequantised_unrotated(k_pool, v_pool, scales, tables[b], n, rope, BS)
        ref.append(paper_attention(q0[b], kd, vd, policy, rope, n - 1))
    ref = torch.stack(ref)
    pruned = tables.clone()  # the blocks wholly between the sinks and the window are freed: garbage in them
    for b, n in enumerate(lens):
        for j in range(-(-S // BS), (n - W) // BS):
            pruned[b, j] = NULL_BLOCK
    if dtype == torch.float32:
        k_pool[NULL_BLOCK], v_pool[NULL_BLOCK] = 1e4, 1e4
    sl = torch.tensor(lens, dtype=torch.int32)
    kw = dict(window=W, sinks=S, k_scale=scales[0], v_scale=scales[1], q_sinks=q_sinks)
    torch.testing.assert_close(paged_decode_attention(q, k_pool, v_pool, sl, pruned, **kw), ref, atol=2e-5, rtol=1e-5)
    cu = torch.arange(batch + 1, dtype=torch.int32)
    torch.testing.assert_close(paged_prefill_attention(q, k_pool, v_pool, cu, sl, pruned, **kw), ref,
                               atol=2e-5, rtol=1e-5)
    # without the second rotation the ops give the real positions, which differ here (every query is past S + W)
    kw.pop("q_sinks")
    assert (paged_decode_attention(q, k_pool, v_pool, sl, pruned, **kw) - ref).abs().max() > 1e-2


def test_q_sinks_without_sinks_is_refused():
    q, pool = torch.randn(2, 2, 8), torch.zeros(3, 4, 1, 8)
    tables, sl = torch.ones(2, 1, dtype=torch.int32), torch.tensor([2, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="q_sinks .* needs sinks > 0"):
        paged_decode_attention(q, pool, pool, sl, tables, window=4, q_sinks=q)


def schedule(prompt: int, total: int, chunk: int) -> list[tuple[int, int]]:
    """(start, length) of a sequence's steps: its prompt in chunks of ``chunk`` tokens, then one token a step."""
    out, done = [], 0
    while done < total:
        n = 1 if done >= prompt else min(chunk, prompt - done)
        out.append((done, n))
        done += n
    return out


def _paper_model(model, policy, kv_dtype=None, steps=None, bs=4):
    """A copy of ``model`` whose attention layers attend as the paper does (un-rotated keys re-rotated at cache
    positions, every query on its own), for the whole-sequence forward of one sequence. With a quantised
    ``kv_dtype`` the keys and values are first stored in pages of that dtype step by step as the engine
    stores them (``steps``: its (start, length) writes), and each query reads them back dequantised (and
    un-rotated) as they stood after its own step."""
    ref = copy.deepcopy(model)
    spec = model.cache_spec(kv_dtype=kv_dtype) if kv_dtype is not None else None

    def forward(self, x):
        B, L, _ = x.shape
        assert B == 1
        q = self.q_proj(x).view(L, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(L, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(L, self.n_kv_heads, self.head_dim)
        if spec is None:
            out = torch.stack([paper_attention(q[p], k, v, policy, self.rope, p) for p in range(L)])
        else:
            kv = PagedKVCache(spec, num_blocks=-(-L // bs), block_size=bs)
            i = kv.layer_indices[0]
            (k_pool, v_pool), scales = kv.pools[i], kv.scales[i]
            table = torch.arange(1, kv.num_blocks + 1, dtype=torch.int32)
            k_rot = self.rope(k, *self.rope.cos_sin(torch.arange(L), k.dtype))
            out = torch.empty(L, self.n_heads, self.head_dim)
            for start, n in steps:
                pos = torch.arange(start, start + n)
                write_kv(k_pool, v_pool, k_rot[pos], v[pos], table.long()[pos // bs] * bs + pos % bs, *scales)
                kd, vd = _dequantised_unrotated(k_pool, v_pool, scales, table, start + n, self.rope, bs)
                for p in range(start, start + n):
                    out[p] = paper_attention(q[p], kd, vd, policy, self.rope, p)
        return self.o_proj(out.to(x.dtype).reshape(B, L, -1))

    for layer in ref.modules():
        if isinstance(layer, Attention):
            layer.forward = forward.__get__(layer)
    return ref


def _engine_logits(model, policy, seqs, prompts, kv_dtype, chunk=7, bs=4):
    """Every position's logits of ``seqs`` (lists of tokens) through an engine's cache manager and the packed
    forward, all sequences in every step: the prompts (``prompts[b]`` tokens) in chunks of ``chunk`` tokens,
    then one token per step (decodes first, then the other sequences' prompt chunks, as the scheduler packs
    them); blocks trimmed after every step as the scheduler does. Also the KV blocks pruning gave back."""
    engine = Engine(model, num_blocks=64, block_size=bs, max_seqs=len(seqs), max_batch_tokens=64,
                    kv_pruning=policy, kv_dtype=kv_dtype)
    m, cache = engine.cache_manager, engine.cache
    assert isinstance(m, CacheManager)
    steps = [schedule(p, len(s), chunk) for p, s in zip(prompts, seqs, strict=True)]
    logits = [[None] * len(s) for s in seqs]
    for b in range(len(seqs)):
        m.admit(b, 1)
    with torch.inference_mode():
        for t in range(max(map(len, steps))):
            chunks = [SeqChunk(b, seqs[b][st[t][0]:st[t][0] + st[t][1]], st[t][0])
                      for b, st in enumerate(steps) if t < len(st)]
            chunks.sort(key=lambda c: len(c.tokens) != 1)  # one-token chunks first
            for c in chunks:
                m.grow(c.seq_id, c.start + len(c.tokens))
            out = model.forward_packed(build_batch(m, chunks), cache, all_logits=True).float()
            row = 0
            for c in chunks:
                for i in range(len(c.tokens)):
                    logits[c.seq_id][c.start + i] = out[row]
                    row += 1
                m.trim(c.seq_id, c.start + len(c.tokens))
    return [torch.stack(x) for x in logits], cache.kv.pruned_blocks


def _model():
    torch.manual_seed(0)
    model = HybridLM(recipes.get("jamba-tiny")).eval()  # Mamba, attention and MoE layers
    with torch.no_grad():
        model.lm_head.weight.mul_(8)  # peaked logits, as a trained model's
    return model


SEQS = [[(7 * i + 3 * j * j + 1) % 256 for j in range(n)] for i, n in enumerate([60, 43, 51])]
PROMPTS = [23, 5, 16]


@pytest.mark.parametrize("renumber", [True, False])
def test_engine_logits_equal_the_papers_streaming_llm(renumber):
    """Sequences 3-5x longer than sinks + window (many freed blocks), packed together, chunked prefill: fp32
    logits of every position equal the paper's definition with re-numbering, and differ without it."""
    model = _model()
    policy = StreamingLLM(sinks=3, window=9, renumber=renumber)
    out, freed = _engine_logits(model, policy, SEQS, PROMPTS, "float32")
    assert freed >= 15
    paper = _paper_model(model, StreamingLLM(sinks=3, window=9, renumber=True))
    with torch.no_grad():
        ref = [paper(torch.tensor([s]))[0].float() for s in SEQS]
    if renumber:
        for o, r in zip(out, ref, strict=True):
            torch.testing.assert_close(o, r, atol=1e-4, rtol=1e-4)
    else:  # real positions: equal up to the query at sinks + window - 1, then off by 10x the tolerance or more
        for o, r in zip(out, ref, strict=True):
            torch.testing.assert_close(o[:12], r[:12], atol=1e-4, rtol=1e-4)
            assert (o[12:] - r[12:]).abs().amax(-1).min() > 1e-3


@pytest.mark.parametrize("renumber", [True, False])
def test_engine_on_int8_pages_equals_the_papers_streaming_llm_on_the_same_pages(renumber):
    """int8 pages: the same sequences and steps; the reference stores K/V in int8 pages the same way (each
    query reads them as they stood after its step), then attends as the paper does."""
    model = _model()
    out, freed = _engine_logits(model, StreamingLLM(sinks=3, window=9, renumber=renumber), SEQS, PROMPTS, "int8")
    assert freed >= 15
    for o, seq, prompt in zip(out, SEQS, PROMPTS, strict=True):
        paper = _paper_model(model, StreamingLLM(sinks=3, window=9), torch.int8, schedule(prompt, len(seq), 7))
        with torch.no_grad():
            r = paper(torch.tensor([seq]))[0].float()
        if renumber:
            torch.testing.assert_close(o, r, atol=1e-4, rtol=1e-4)
        else:
            torch.testing.assert_close(o[:12], r[:12], atol=1e-4, rtol=1e-4)
            assert (o[12:] - r[12:]).abs().amax(-1).min() > 1e-3


def test_cli_spec_takes_renumber():
    assert parse_policy("streaming:sinks=2,window=8") == StreamingLLM(2, 8, renumber=True)
    assert parse_policy("streaming:sinks=2,window=8,renumber=0") == StreamingLLM(2, 8, renumber=False)
    assert parse_policy("streaming:renumber=1").renumber is True
    with pytest.raises(ValueError, match="renumber must be 0 or 1"):
        parse_policy("streaming:renumber=yes")
    with pytest.raises(ValueError, match="renumber must be True or False"):
        StreamingLLM(2, 8, renumber=2)
