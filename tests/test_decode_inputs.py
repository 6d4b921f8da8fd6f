"""The model runner's kept decode inputs (hybrid/engine/decode_inputs.py) hold what build_batch's packed batch holds
for the same decode-only step, with or without attention, across block boundaries, and refuse what build_batch
refuses."""

from __future__ import annotations

import pytest
import torch

from hybrid import Engine, HybridLM, recipes
from hybrid.engine.decode_inputs import DecodeInputs
from hybrid.engine.packed_batch import SeqChunk, build_batch
from hybrid.sampling import SamplingParams


@pytest.mark.parametrize("recipe", ["llama-tiny", "mamba2-tiny", "hybrid-1to7-tiny"])
def test_kept_inputs_equal_the_packed_batch(recipe):
    torch.manual_seed(0)
    model = HybridLM(recipes.get(recipe)).eval()
    engine = Engine(model, num_blocks=64, block_size=4, max_seqs=4)
    for n in (3, 6, 9):  # prompts ending inside and at the edge of a 4-token block
        engine.add_request(list(range(1, n + 1)), SamplingParams(max_new_tokens=12, ignore_eos=True))
    inputs = DecodeInputs(8)
    checked = 0
    while engine.has_unfinished():
        plan = engine.scheduler.schedule()  # the step the engine runs next, its blocks grown
        if all(n == 1 for _, n in plan):
            chunks = [SeqChunk(r.request_id, r.pending(1), r.num_computed) for r, _ in plan]
            batch = build_batch(engine.cache_manager, chunks)
            inputs.fill(engine.cache_manager, chunks)
            tokens, positions, kv_slots, seq_lens, tables, state_slots = inputs.views()
            d = batch.decode
            assert tokens.tolist() == batch.tokens.tolist()
            assert positions.tolist() == batch.positions.tolist() and inputs.max_position == max(positions.tolist())
            assert kv_slots.tolist() == batch.slot_mapping.tolist()
            assert seq_lens.tolist() == d.seq_lens.tolist() and state_slots.tolist() == d.state_slots.tolist()
            if engine.cache_manager.kv.enabled:  # the rows' live blocks; past them the ops read nothing
                for row, (r, _) in enumerate(plan):
                    live = len(engine.cache_manager.block_table(r.request_id))
                    assert tables[row, :live].tolist() == d.block_tables[row, :live].tolist()
                    assert live <= inputs.width
            checked += 1
        with torch.inference_mode():
            engine._run(plan, 0.0, 0.0)  # then run that step
    assert checked >= 8


def test_kept_inputs_refuse_what_build_batch_refuses():
    model = HybridLM(recipes.get("llama-tiny")).eval()
    engine = Engine(model, num_blocks=16, block_size=4, max_seqs=2)
    inputs = DecodeInputs(2)
    with pytest.raises(ValueError, match="hold no cache"):
        inputs.fill(engine.cache_manager, [SeqChunk(7, [1], 0)])
    with pytest.raises(ValueError, match="one-token"):
        inputs.fill(engine.cache_manager, [SeqChunk(7, [1, 2], 0)])
    with pytest.raises(ValueError, match="one-token"):
        inputs.fill(engine.cache_manager, [SeqChunk(i, [1], 0) for i in range(3)])
    rid = engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=4))
    engine.step()  # the prompt: 3 tokens in one 4-token block
    with pytest.raises(ValueError, match="too few KV blocks"):
        inputs.fill(engine.cache_manager, [SeqChunk(rid, [5], 4)])  # position 4 needs a second block
