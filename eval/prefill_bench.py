"""Prefill (and decode) speed: median latency, tokens/s and achieved FLOP/s at a sweep of context
lengths, next to the cache memory each length costs and this device's measured matmul peak.

Timing: warm-up runs first (allocator, kernel selection, caches), then ``repeats`` timed runs and
their median. On GPU each run is bracketed by CUDA events after a synchronise, so the number is
device time, not launch time. A length that runs out of memory is recorded as skipped, and the
model's longer lengths are skipped with it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from tqdm import tqdm

from ..model import HybridLM


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], object], device: torch.device, *, warmup: int, repeats: int) -> float:
    """Median wall (CPU) or device (CUDA events) seconds of ``fn()`` over ``repeats`` runs."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            _sync(device)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.inference_mode()
def matmul_peak_flops(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, *,
                      size: int | None = None, repeats: int = 5) -> float:
    """This device's dense matmul rate (FLOP/s): the median of timed ``size``-square matmuls in
    ``dtype``. The yardstick the models' achieved FLOP/s is compared with."""
    device = torch.device(device)
    size = size or (8192 if device.type == "cuda" else 1024)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    secs = median_seconds(lambda: a @ b, device, warmup=2, repeats=repeats)
    return 2.0 * size**3 / secs


def _is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower() \
        or "can't allocate memory" in str(err).lower()


@torch.inference_mode()
def time_prefill(model: HybridLM, seq_len: int, *, batch: int = 1, warmup: int = 1, repeats: int = 3,
                 peak_flops: float | None = None) -> dict:
    """Median time of ``model(ids)`` for ``batch`` random prompts of ``seq_len`` tokens, with the
    achieved FLOP/s (from ``flops_per_token``), its share of ``peak_flops`` and the cache bytes a
    sequence of this length holds (KV in the model's dtype, plus Mamba state)."""
    param = next(model.parameters())
    device = param.device
    ids = torch.randint(0, model.config.vocab_size, (batch, seq_len), device=device)
    med = median_seconds(lambda: model(ids), device, warmup=warmup, repeats=repeats)
    flops_s = model.flops_per_token(seq_len) * seq_len * batch / med
    row = {"seq_len": seq_len, "batch": batch, "prefill_ms": round(med * 1e3, 3),
           "tokens_per_s": round(batch * seq_len / med, 1), "GFLOP/s": round(flops_s / 1e9, 3)}
    if peak_flops:
        row["of_peak"] = round(flops_s / peak_flops, 4)
    # what the engine's cache holds for this sequence (K/V and conv state in the model dtype, SSM state fp32)
    row["cache_MB/seq"] = round(model.cache_spec().bytes_per_sequence(seq_len) / 2**20, 3)
    return row


def sweep(models: dict[str, HybridLM], lengths: list[int], *, batch: int = 1, warmup: int = 1, repeats: int = 3,
          peak_flops: float | None = None, progress: bool = True) -> list[dict]:
    """``time_prefill`` for every model at every length (shortest first); a length that runs out of
    memory gives a row marked skipped and skips that model's longer lengths."""
    rows = []
    todo = [(n, L) for n in models for L in sorted(lengths)]
    failed: dict[str, int] = {}
    for name, L in tqdm(todo, desc="prefill", unit="run", disable=not progress):
        if name in failed:
            rows.append({"model": name, "seq_len": L, "skipped": f"out of memory at {failed[name]} tokens"})
            continue
        try:
            rows.append({"model": name, **time_prefill(models[name], L, batch=batch, warmup=warmup,
                                                       repeats=repeats, peak_flops=peak_flops)})
        except (RuntimeError, MemoryError) as err:
            if not _is_oom(err) and not isinstance(err, MemoryError):
                raise
            failed[name] = L
            rows.append({"model": name, "seq_len": L, "skipped": f"out of memory at {L} tokens"})
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return rows
