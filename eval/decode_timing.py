"""Timing a decode step through the engine: an engine holding a batch of sequences mid-generation, and the
median step with its split. ``hybrid bench`` and the decode benchmarks (``benchmarks/decode.py``) share it."""

from __future__ import annotations

import statistics
import time

import torch

from ..engine import Engine
from ..engine.config import EngineConfig
from ..model import HybridLM
from ..sampling import SamplingParams

BLOCK = 16


def sync(model: HybridLM) -> None:
    p = next(model.parameters())
    if p.device.type == "cuda":
        torch.cuda.synchronize(p.device)


def random_prompt(model: HybridLM, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist()


def spread(times: list[float]) -> dict:
    """min / median / max in milliseconds, and whether the spread is wide (max > 1.25 x min)."""
    return {"ms_min": round(min(times) * 1e3, 2), "ms_med": round(statistics.median(times) * 1e3, 2),
            "ms_max": round(max(times) * 1e3, 2), "wide": max(times) > 1.25 * min(times)}


# ---- the machine -----------------------------------------------------------------------------------
def decode_engine(model: HybridLM, batch: int, context: int, *, steps: int, compile: bool, warmup: int,
                  kv_dtype: str | None = None, state_dtype: str | None = None, multi_step: int = 1) -> Engine:
    """An engine holding ``batch`` sequences of ``context`` tokens, all decoding (compiled steps warmed up),
    with room for ``steps`` more timed steps (of ``multi_step`` decode steps each at most); cache dtypes as
    ``Engine`` takes them (None: the defaults)."""
    new = (warmup + steps) * multi_step + 2
    blocks = -(-(context + new) // BLOCK) + (batch - 1) * (-(-new // BLOCK) + 1)  # shared prompt + own tails
    # a step's token budget must hold the whole batch (one token each) as well as the prompt: with the prompt's
    # alone, a batch wider than its context decoded part of its rows a step
    engine = Engine(model, EngineConfig(num_blocks=blocks, block_size=BLOCK, max_seqs=batch,
                                        max_batch_tokens=max(context, batch), compile=compile, kv_dtype=kv_dtype,
                                        state_dtype=state_dtype, multi_step=multi_step))
    rid = engine.add_request(random_prompt(model, context, 0), SamplingParams(max_new_tokens=new, ignore_eos=True))
    while not engine.requests[rid].output:
        engine.step()  # the prompt, prefilled once
    for _ in range(batch - 1):
        engine.fork(rid)
    for _ in range(warmup):
        engine.step()
    return engine


def decode_speed(engine: Engine, steps: int) -> tuple[dict, dict]:
    """Time ``steps`` calls of ``engine.step()``; returns the speed row and the mean time split of a step. Every
    call must advance every running sequence by the same number of tokens (one; up to ``engine.multi_step``
    with multi-step decode): RuntimeError if not. The times are per decode step (a call's time over the steps
    it ran), so the rate counts ``batch`` tokens a step."""
    model, batch = engine.model, len(engine.running)
    s0 = dict(engine.stats.__dict__)
    times = []
    for _ in range(steps):
        before = [len(r.output) for r in engine.running]
        sync(model)
        t0 = time.perf_counter()
        engine.step()
        sync(model)
        dt = time.perf_counter() - t0
        made = {len(r.output) - b for r, b in zip(engine.running, before, strict=False)}
        if len(engine.running) != batch or len(made) != 1 or not 1 <= min(made) <= engine.multi_step:
            raise RuntimeError(f"a timed decode step advanced the {batch} sequences by {sorted(made)} tokens "
                               f"({len(engine.running)} still running): the engine's budget does not hold the batch")
        times.append(dt / made.pop())
    s = spread(times)
    ran = max(1, engine.stats.decode_steps - s0["decode_steps"])  # decode steps (more than calls with multi-step)
    split = {k.replace("_seconds", "_ms"): round((engine.stats.__dict__[k] - s0[k]) / ran * 1e3, 3)
             for k in ("schedule_seconds", "forward_seconds", "sample_seconds", "output_seconds")}
    split["overhead_ms"] = round(s["ms_med"] - sum(split.values()), 3)  # step() outside the four parts
    return {"batch": batch, **s, "decode_tok/s": round(batch / (s["ms_med"] / 1e3), 1)}, split
