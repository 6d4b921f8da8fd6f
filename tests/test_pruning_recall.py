"""The long-context recall scenario of the compression benchmark (benchmarks/compression_accuracy.py)."""

import torch
from hybrid.eval import mqar

from benchmarks import compression_accuracy as pr
from hybrid import HybridLM, recipes
from hybrid.cache.pruning import SnapKV, StreamingLLM


def test_recall_batch_puts_the_filler_between_pairs_and_queries():
    b = pr.recall_batch(5, 6, 20, 256, generator=torch.Generator().manual_seed(0))
    assert b.inputs.shape == (5, 4 * 6 + 20)
    _, values = mqar.key_value_ranges(256)
    filler = b.inputs[:, 12:32]
    assert ((filler >= values.start) & (filler < values.stop)).all()  # never a key
    plain = mqar.MQARBatch(torch.cat([b.inputs[:, :12], b.inputs[:, 32:]], 1),
                           torch.cat([b.labels[:, :12], b.labels[:, 32:]], 1), 6)
    mqar.check_batch(plain)  # without the filler: a valid MQAR batch
    assert (b.labels[:, 12:32] == mqar.IGNORE).all()


def test_unpruned_harness_equals_the_full_forward_and_pruning_frees_blocks():
    torch.manual_seed(0)
    model = HybridLM(recipes.get("jamba-tiny")).eval()
    inputs = torch.randint(1, 256, (3, 70))
    ref, blocks, _ = pr.pruned_logits(model, inputs, 60, None)
    with torch.inference_mode():
        full = model(inputs)[:, 59:69]
    torch.testing.assert_close(ref, full, atol=1e-4, rtol=1e-4)
    assert blocks == 5  # ceil(69 / 16)
    for policy in (SnapKV(budget=20, window=4), StreamingLLM(sinks=4, window=12)):
        out, held, kept = pr.pruned_logits(model, inputs, 60, policy, watch=10)
        assert out.shape == ref.shape and held <= 3
        assert len(kept) == (3 * 2 if isinstance(policy, SnapKV) else 0)  # 3 sequences, 1 layer, 2 KV heads
        assert all(0 <= x <= 1 for x in kept)


def test_filler_batches_feed_mqar_train():
    cfg = mqar.TrainConfig(steps=2, tokens_per_step=256, warmup=1)
    draw = pr.filler_batches(cfg, 30)
    b = draw(4, torch.Generator().manual_seed(0))
    assert b.inputs.shape[0] * b.inputs.shape[1] <= 256 and 16 <= b.inputs.shape[1] <= 16 + 30
    torch.manual_seed(0)
    model = mqar.build_model("tiny", 1.0, 2, cfg)
    losses = mqar.train(model, cfg, progress=False, batch_fn=draw)
    assert len(losses) == 2 and all(x == x for x in losses)
