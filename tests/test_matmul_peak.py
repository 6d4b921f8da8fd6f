"""The matmul peak probe that `hybrid bench` / the tradeoff report compare achieved FLOP/s with: a positive,
finite best-of-shapes rate, the shape that won, and clear errors for shapes it cannot time."""

import math

import pytest
import torch
from hybrid.eval import timing
from hybrid.eval.timing import MatmulPeak, matmul_peak, matmul_peak_flops, peak_exceeded

SMALL = ((64, 32, 48), (96, 96, 96))


def test_probe_returns_the_best_shape_and_its_finite_rate():
    peak = matmul_peak("cpu", torch.float32, shapes=SMALL, repeats=3, warmup_s=0.0)
    assert isinstance(peak, MatmulPeak)
    assert set(peak.per_shape) == set(SMALL)
    assert all(math.isfinite(r) and r > 0 for r in peak.per_shape.values())
    assert peak.flops == max(peak.per_shape.values()) and peak.per_shape[peak.shape] == peak.flops
    m, k, n = peak.shape
    assert f"[{m}, {k}] x [{k}, {n}]" in peak.describe()


def test_rate_alone_and_other_dtypes():
    assert 0 < matmul_peak_flops("cpu", torch.bfloat16, shapes=((32, 32, 32),), repeats=1, warmup_s=0.0) < math.inf


@pytest.mark.parametrize("shapes", [((8, 0, 8),), ((8, 8),), ((8, 8, 8, 8),)])
def test_bad_shapes_say_what_is_wanted(shapes):
    with pytest.raises(ValueError, match=r"\(m, k, n\) triples"):
        matmul_peak("cpu", shapes=shapes, warmup_s=0.0)


def test_rows_above_the_peak_are_flagged():
    rows = [{"of_peak": 0.8}, {"of_peak": 1.13}, {"skipped": "out of memory"}]
    assert peak_exceeded(rows) == [{"of_peak": 1.13}]


def test_training_peaks_are_measured_once_per_dtype_and_thread_count(monkeypatch):
    measured = []
    monkeypatch.setattr(timing, "_TRAINING_PEAKS", {})
    monkeypatch.setattr(timing, "matmul_peak_flops", lambda _, dtype: measured.append(dtype) or 1e9 * len(measured))
    assert timing.training_peaks(torch.float32) == {"fp32": 1e9}
    assert timing.training_peaks(torch.bfloat16) == {"fp32": 1e9, "bf16": 2e9}
    assert timing.training_peaks(torch.bfloat16) == {"fp32": 1e9, "bf16": 2e9} and len(measured) == 2
    n = torch.get_num_threads()
    torch.set_num_threads(n + 1)
    try:
        assert timing.training_peaks(torch.float32) == {"fp32": 3e9}  # another thread count: measured again
    finally:
        torch.set_num_threads(n)
