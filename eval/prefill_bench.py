"""Prefill speed: median latency and tokens/s of the full forward at a sweep of context lengths."""

from __future__ import annotations

import statistics
import time

import torch
from tqdm import tqdm

from ..model import HybridLM


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def time_prefill(model: HybridLM, seq_len: int, *, batch: int = 1, warmup: int = 1, repeats: int = 3) -> dict:
    """Median wall time of ``model(ids)`` for ``batch`` random prompts of ``seq_len`` tokens."""
    device = next(model.parameters()).device
    ids = torch.randint(0, model.config.vocab_size, (batch, seq_len), device=device)
    for _ in range(warmup):
        model(ids)
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        model(ids)
        _sync(device)
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    flops = model.flops_per_token(seq_len) * seq_len * batch
    return {"seq_len": seq_len, "batch": batch, "median_ms": round(med * 1e3, 2),
            "tokens_per_s": round(batch * seq_len / med, 1), "GFLOP/s": round(flops / med / 1e9, 2),
            "repeats": repeats}


def sweep(models: dict[str, HybridLM], lengths: list[int], **kw) -> list[dict]:
    rows = []
    todo = [(n, L) for n in models for L in lengths]
    for name, L in tqdm(todo, desc="prefill", unit="run"):
        rows.append({"model": name, **time_prefill(models[name], L, **kw)})
    return rows
