"""KV pruning: StreamingLLM attention sinks + recent window in the paged cache."""

import pytest
import torch
from hybrid.kernels.paged_attention import (
    gather_kv,
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_prefill_attention,
    sink_attention,
)

from hybrid import Engine, HybridLM, SamplingParams, recipes
from hybrid.cache import NULL_BLOCK
from hybrid.cache.pruning import StreamingLLM


def test_sink_attention_sees_exactly_the_sinks_and_the_window():
    policy = StreamingLLM(sinks=2, window=3)
    Lk, Lq = 9, 4
    q, k, v = torch.randn(1, Lq, 2, 8), torch.randn(1, Lk, 1, 8), torch.randn(1, Lk, 1, 8)
    out = sink_attention(q, k, v, window=3, sinks=2)
    for i in range(Lq):
        qpos = Lk - Lq + i
        seen = [j for j in range(Lk) if policy.visible(j, qpos)]
        s = torch.einsum("hd,sd->hs", q[0, i], k[0, seen, 0]) / 8 ** 0.5
        torch.testing.assert_close(out[0, i], torch.softmax(s, -1) @ v[0, seen, 0])


@pytest.mark.parametrize("batch", [2, 6])
def test_paged_ops_with_sinks_skip_freed_blocks(batch):
    BS, H, D = 4, 2, 8
    lens = [13, 30, 7, 22, 17, 9][:batch]
    per = [-(-n // BS) for n in lens]
    k_pool, v_pool = torch.randn(sum(per) + 1, BS, H, D), torch.randn(sum(per) + 1, BS, H, D)
    tables = torch.zeros(batch, max(per), dtype=torch.int32)
    ids = iter(torch.randperm(sum(per)).add(1).tolist())
    for b, n in enumerate(per):
        tables[b, :n] = torch.tensor([next(ids) for _ in range(n)])
    sl = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(batch, 4, D)
    ref = paged_decode_attention_ref(q, k_pool, v_pool, sl, tables, window=6, sinks=3)
    # what a pruned sequence holds: blocks wholly between the sinks and the window point at the null block,
    # whose contents are garbage (huge here: any leak into the softmax would dominate the output)
    pruned = tables.clone()
    for b, n in enumerate(lens):
        for j in range(1, (n - 6) // BS):  # wholly before the window of the query at n - 1
            pruned[b, j] = NULL_BLOCK
    k_pool[NULL_BLOCK], v_pool[NULL_BLOCK] = 1e4, 1e4
    out = paged_decode_attention(q, k_pool, v_pool, sl, pruned, window=6, sinks=3)
    torch.testing.assert_close(out, ref)
    cu = torch.arange(batch + 1, dtype=torch.int32)
    torch.testing.assert_close(paged_prefill_attention(q, k_pool, v_pool, cu, sl, pruned, window=6, sinks=3), ref)
    one = sink_attention(q[None, :1], gather_kv(k_pool, tables[0], lens[0])[None],
                         gather_kv(v_pool, tables[0], lens[0])[None], window=6, sinks=3)[0]
    torch.testing.assert_close(out[:1], one)


def _engine(model, policy, **kw):
    return Engine(model, num_blocks=40, block_size=4, max_batch_tokens=8, kv_pruning=policy, **kw)


def _check_kept(engine, policy):
    """Every position a future token attends lives in a live block of its sequence's table; the blocks freed are
    back in the pool (held + free = all)."""
    m = engine.cache_manager
    held = set()
    for req in engine.running:
        if not m.holds(req.request_id):
            continue
        table = m.block_table(req.request_id)
        nxt = req.num_computed
        for p in range(nxt):
            if policy.visible(p, nxt):
                assert table[p // 4] != NULL_BLOCK, (req.request_id, p, nxt)
        held.update(b for b in table if b != NULL_BLOCK)
        bound = m.kv.blocks_held_at_most(len(req.prompt) + req.params.max_new_tokens, engine.max_batch_tokens)
        assert sum(b != NULL_BLOCK for b in table) <= bound
    assert m.num_free_blocks + len(held) == m.kv.num_blocks


def test_streaming_llm_engine_frees_blocks_and_keeps_what_is_seen():
    torch.manual_seed(0)
    model = HybridLM(recipes.get("jamba-tiny")).eval()
    policy = StreamingLLM(sinks=3, window=9)
    prompts = [[(5 * i + 11 * j) % 256 for j in range(n)] for i, n in enumerate([30, 13, 21])]
    engine = _engine(model, policy)
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=24)) for p in prompts]
    peak = 0
    while engine.has_unfinished():
        engine.step()
        _check_kept(engine, policy)
        peak = max(peak, engine.cache.report().kv_blocks_in_use)
    # without pruning the three would hold ceil((30+24)/4) + ceil(37/4) + ceil(45/4) = 14 + 10 + 12 blocks
    assert peak < 36
    # the same engine with nothing ever freed (every block stays; the ops mask the same positions) agrees:
    # freeing only drops blocks no future query reads
    ref = _engine(model, policy)
    ref.cache_manager.trim = lambda seq_id, next_pos: None
    ref_ids = [ref.add_request(p, SamplingParams(max_new_tokens=24)) for p in prompts]
    ref.run()
    assert [engine.requests[i].output for i in ids] == [ref.requests[i].output for i in ref_ids]


def test_streaming_llm_refuses_what_it_cannot_do():
    model = HybridLM(recipes.get("llama-tiny")).eval()
    with pytest.raises(ValueError, match="sinks >= 0 and window >= 1"):
        StreamingLLM(sinks=-1, window=4)
    with pytest.raises(ValueError, match="kv_pruning with prefix_caching"):
        Engine(model, num_blocks=8, kv_pruning=StreamingLLM(2, 8), prefix_caching=True)
