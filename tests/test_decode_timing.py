"""eval/decode_timing.py, the decode benchmarks' timing core: every timed step decodes the whole batch (a batch
wider than its context once decoded half its rows a step and the rate counted them all), and a step that
does not is refused rather than timed."""

import pytest
import torch
from hybrid.eval.decode_timing import decode_engine, decode_speed

from hybrid import recipes
from hybrid.model import HybridLM


def _model():
    torch.manual_seed(0)
    return HybridLM(recipes.get("llama-tiny")).eval()


@pytest.mark.parametrize("batch, context", [(12, 4), (3, 16)])
def test_every_row_decodes_every_step(batch, context):
    engine = decode_engine(_model(), batch, context, steps=3, compile=False, warmup=1)
    before = [len(r.output) for r in engine.running]
    row, _ = decode_speed(engine, 3)
    assert row["batch"] == batch and [len(r.output) for r in engine.running] == [n + 3 for n in before]


def test_a_step_that_leaves_rows_out_is_refused():
    engine = decode_engine(_model(), 8, 4, steps=4, compile=False, warmup=1)
    engine.scheduler.max_batch_tokens = 4  # the old budget (the context's): 4 tokens for 8 decoding sequences
    with pytest.raises(RuntimeError, match=r"advanced the 8 sequences by \[0, 1\] tokens"):
        decode_speed(engine, 2)


def test_multi_step_calls_are_timed_per_decode_step():
    """With Engine(multi_step=4) a timed call runs four steps: each row gets four tokens a call, and the time of a
    call is counted over its four steps."""
    engine = decode_engine(_model(), 2, 8, steps=3, compile=False, warmup=1, multi_step=4)
    before = [len(r.output) for r in engine.running]
    row, split = decode_speed(engine, 3)
    assert [len(r.output) for r in engine.running] == [n + 12 for n in before]
    assert row["batch"] == 2 and row["decode_tok/s"] == round(2 / (row["ms_med"] / 1e3), 1)
