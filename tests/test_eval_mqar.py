"""MQAR: the generator follows the task's rules, and a tiny attention model learns it."""

import dataclasses

import pytest
import torch
from hybrid.eval import mqar

from hybrid import HybridLM, recipes


@pytest.mark.parametrize("n,q,vocab", [(1, 1, 8), (4, 4, 16), (8, 3, 64), (31, 31, 64)])
def test_keys_unique_and_every_query_answerable(n, q, vocab):
    g = torch.Generator().manual_seed(n * 7 + q)
    batch = mqar.make_batch(32, n, vocab, num_queries=q, generator=g)
    assert batch.inputs.shape == (32, 2 * (n + q))
    mqar.check_batch(batch)  # raises on a repeated key, an unknown query key or a wrong label
    keys, values = mqar.key_value_ranges(vocab)
    ctx = batch.inputs[:, : 2 * n]
    assert ctx[:, 0::2].min() >= keys.start and ctx[:, 0::2].max() < keys.stop
    assert ctx[:, 1::2].min() >= values.start and ctx[:, 1::2].max() < values.stop
    assert int((batch.labels != mqar.IGNORE).sum()) == 32 * q


def test_check_batch_catches_broken_batches():
    batch = mqar.make_batch(4, 4, 32, generator=torch.Generator().manual_seed(0))
    dup = batch.inputs.clone()
    dup[0, 2] = dup[0, 0]  # second key repeats the first
    with pytest.raises(AssertionError, match="repeated key"):
        mqar.check_batch(dataclasses.replace(batch, inputs=dup))
    wrong = batch.labels.clone()
    wrong[1, 9] = (wrong[1, 9] + 1 - 16) % 15 + 16  # another value
    with pytest.raises(AssertionError, match="labelled"):
        mqar.check_batch(dataclasses.replace(batch, labels=wrong))


def test_bad_sizes_are_explained():
    with pytest.raises(ValueError, match="num_kv_pairs must be in 1..7"):
        mqar.make_batch(2, 8, 16)
    with pytest.raises(ValueError, match="num_queries"):
        mqar.make_batch(2, 4, 16, num_queries=5)


def test_tiny_attention_model_learns_recall():
    torch.manual_seed(0)
    cfg = recipes.attention_family("tiny", 0.5, 2)
    # one Mamba-2 block (its short conv gives each value its key) then one attention block that looks
    # the queried key up; partial RoPE leaves most of each head for matching content
    model = HybridLM(dataclasses.replace(cfg, pattern="M*-", attention=dataclasses.replace(
        cfg.attention, rotary_fraction=0.25)))
    train = mqar.TrainConfig(steps=300, batch_size=32, lr=1e-2, warmup=10, vocab_size=16, train_kv_pairs=(2,),
                             eval_kv_pairs=(2,), eval_sequences=256)
    before = mqar.evaluate(model, train)[2]
    losses = mqar.train(model, train, progress=False)
    after = mqar.evaluate(model, train)[2]
    # chance is 1/7; copying either value seen in the context would give 0.75 at two pairs
    assert before < 0.4 and after > 0.9, (before, after, losses[-5:])
