"""Prefill timing, the core ``hybrid bench`` and ``hybrid tradeoff`` share: latency with its spread, tokens/s
and achieved FLOP/s at a sweep of context lengths, next to the cache memory each length costs and this
device's measured matmul peak. (The benchmark scripts built on it live in the repo's ``benchmarks/``.)

Timing: warm-up runs first (allocator, kernel selection, caches), then ``repeats`` timed runs, kept
whole: every timing is reported as min / median / max, and its *spread* is (max - min) / median. A
measurement whose spread exceeds ``max_spread`` (25% by default) is taken again once; if it is still
wide, the row is flagged ``wide`` so a reader knows the machine was not steady (another process,
frequency changes) while it ran. On GPU each run is bracketed by CUDA events after a synchronise, so
the number is device time, not launch time. A length that runs out of memory is recorded as skipped,
and the model's longer lengths are skipped with it.

Two prefill paths: :func:`time_prefill` times the plain forward ``model(ids, logits_to_keep=1)`` (``hybrid
bench``; ``logits="all"`` for every position's logits, as scoring computes them);
:func:`time_engine_prefill` times a prompt through :class:`hybrid.Engine` — paged KV cache, state
slots, chunked prefill of ``chunk`` tokens per step, last-token logits — the path a served prompt
takes (the tradeoff report).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm import tqdm

from ..model import HybridLM

MAX_SPREAD = 0.25


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def set_threads(threads: int | None) -> int:
    """Set torch's intra-op threads to ``threads`` (0 or None: the CPU cores this process may use)
    and return the number now in force, so every benchmark states it."""
    if threads is None or threads == 0:
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if threads < 1:
        raise ValueError(f"threads must be >= 1 (or 0 for one per core), got {threads}")
    torch.set_num_threads(threads)
    return torch.get_num_threads()


def run_seconds(fn: Callable[[], object], device: torch.device, *, warmup: int, repeats: int) -> list[float]:
    """Wall (CPU) or device (CUDA events) seconds of each of ``repeats`` runs of ``fn()``, after
    ``warmup`` untimed runs."""
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
    return times


def median_seconds(fn: Callable[[], object], device: torch.device, *, warmup: int, repeats: int) -> float:
    """Median of :func:`run_seconds` (the kernel and interop benchmarks' one number)."""
    return statistics.median(run_seconds(fn, device, warmup=warmup, repeats=repeats))


@dataclass(frozen=True)
class Timing:
    """Seconds of every timed run of one measurement (the last attempt) and whether it stayed wide."""

    seconds: tuple[float, ...]
    attempts: int = 1  # 2 when the first attempt was wider than the limit and was taken again
    wide: bool = False  # still wider than the limit after the second attempt

    @property
    def min(self) -> float:
        return min(self.seconds)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def max(self) -> float:
        return max(self.seconds)

    @property
    def spread(self) -> float:
        """(max - min) / median; 0 for a single run (which has no spread to show: see ``runs``)."""
        return (self.max - self.min) / self.median

    def row(self, prefix: str = "prefill") -> dict:
        """The timing as table columns, in milliseconds."""
        return {f"{prefix}_ms": round(self.median * 1e3, 3), f"{prefix}_min_ms": round(self.min * 1e3, 3),
                f"{prefix}_max_ms": round(self.max * 1e3, 3), "spread": round(self.spread, 3),
                "runs": len(self.seconds), "attempts": self.attempts, "wide": self.wide}


def measure(fn: Callable[[], object], device: torch.device, *, warmup: int, repeats: int,
            max_spread: float = MAX_SPREAD) -> Timing:
    """Time ``fn``; if the spread exceeds ``max_spread``, time it again (no new warm-up) and keep the
    second attempt, flagged ``wide`` if it is still over the limit."""
    first = run_seconds(fn, device, warmup=warmup, repeats=repeats)
    timing = Timing(tuple(first))
    if timing.spread <= max_spread:
        return timing
    again = Timing(tuple(run_seconds(fn, device, warmup=0, repeats=repeats)), attempts=2)
    return Timing(again.seconds, attempts=2, wide=again.spread > max_spread)


# (m, k, n) of the peak probe's matmuls: squares, and the prefill's own shapes ([tokens, d_model] x [d_model,
# width], the in_proj / MLP / projection matmuls of d_model 512-768 models at 2K-8K tokens). A single 1024 square
# read 72.7 GFLOP/s at 2 threads while llama-small's prefill achieved 82-90 in the same run: too small to reach
# the blocked kernel's steady rate. The best shape wins; on CUDA larger squares.
CPU_PEAK_SHAPES = ((1024, 1024, 1024), (2048, 2048, 2048), (2048, 512, 2048), (8192, 512, 2048),
                   (8192, 768, 2304), (2048, 2048, 512))
CUDA_PEAK_SHAPES = ((4096, 4096, 4096), (8192, 8192, 8192), (8192, 1024, 8192))
PEAK_WARMUP_S = 1.0  # busy time before timing: long enough for the core clocks to settle under load


@dataclass(frozen=True)
class MatmulPeak:
    """The peak probe's result: the best shape's rate (FLOP/s, from the median of its timed runs), that
    shape, and every shape's median rate."""

    flops: float
    shape: tuple[int, int, int]  # (m, k, n): [m, k] @ [k, n]
    per_shape: dict[tuple[int, int, int], float]

    def describe(self) -> str:
        m, k, n = self.shape
        return f"{self.flops / 1e9:.1f} GFLOP/s at [{m}, {k}] x [{k}, {n}]"


@torch.inference_mode()
def matmul_peak(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, *,
                shapes: tuple[tuple[int, int, int], ...] | None = None, repeats: int = 5,
                warmup_s: float | None = None) -> MatmulPeak:
    """This device's dense matmul rate in ``dtype``: for each ``(m, k, n)`` of ``shapes`` the median of
    ``repeats`` timed ``[m, k] @ [k, n]`` products, the best of those medians. The yardstick the models'
    achieved FLOP/s is compared with, so it is built to read the peak, not below it: the product goes into
    a preallocated ``out=`` tensor (a fresh result of more than 32 MB is a new mmap whose page faults cost
    more than the multiply here), and ``warmup_s`` seconds of matmuls run first so the clock has settled
    before the first timed run (default :data:`PEAK_WARMUP_S`)."""
    device = torch.device(device)
    warmup_s = PEAK_WARMUP_S if warmup_s is None else warmup_s
    shapes = tuple(shapes or (CUDA_PEAK_SHAPES if device.type == "cuda" else CPU_PEAK_SHAPES))
    if not shapes or any(len(s) != 3 or min(s) < 1 for s in shapes):
        raise ValueError(f"shapes must be (m, k, n) triples of positive sizes, got {shapes!r}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    per_shape: dict[tuple[int, int, int], float] = {}
    for i, (m, k, n) in enumerate(shapes):
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        out = torch.empty(m, n, device=device, dtype=dtype)

        def mm(a=a, b=b, out=out) -> None:
            torch.matmul(a, b, out=out)

        mm()  # first touch of every page of a, b and out, outside the clock
        _sync(device)
        if i == 0:  # the clock settles once, under load, before the first timed shape
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < warmup_s:
                mm()
                _sync(device)
        per_shape[(m, k, n)] = 2.0 * m * k * n / median_seconds(mm, device, warmup=1, repeats=repeats)
        del a, b, out
    best = max(per_shape, key=per_shape.__getitem__)
    return MatmulPeak(per_shape[best], best, per_shape)


def matmul_peak_flops(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, **kw) -> float:
    """:func:`matmul_peak`'s rate alone (FLOP/s)."""
    return matmul_peak(device, dtype, **kw).flops


_TRAINING_PEAKS: dict[tuple[torch.dtype, int], float] = {}


def training_peaks(train_dtype: torch.dtype) -> dict[str, float]:
    """The matmul peaks (FLOP/s) a training run's GFLOP/s are read against: fp32's, and bf16's when it trains in
    bf16 (the keys of the distillation budget's ``peak_flops``). Each is measured once per process and thread
    count (seconds of matmuls; the CPU's rate does not change within a process): a session that distils or runs
    the tradeoff again, or resumes it, reads the first measurement."""
    def peak(dtype: torch.dtype) -> float:
        key = (dtype, torch.get_num_threads())
        if key not in _TRAINING_PEAKS:
            _TRAINING_PEAKS[key] = matmul_peak_flops("cpu", dtype)
        return _TRAINING_PEAKS[key]

    peaks = {"fp32": peak(torch.float32)}
    if train_dtype == torch.bfloat16:
        peaks["bf16"] = peak(torch.bfloat16)
    return peaks


def peak_exceeded(rows: list[dict]) -> list[dict]:
    """The rows whose achieved rate is above the measured peak (``of_peak`` > 1): the probe read low (the
    machine was busier while it ran than during those rows), so their shares of peak are not to be trusted."""
    return [r for r in rows if r.get("of_peak") is not None and r["of_peak"] > 1.0]


def _is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower() \
        or "can't allocate memory" in str(err).lower()


LOGITS = ("last", "all")


def _check_logits(logits: str) -> None:
    if logits not in LOGITS:
        raise ValueError(f"logits must be one of {LOGITS} (last: the last position's, what a prompt needs; "
                         f"all: every position's, as scoring does), got {logits!r}")


def prefill_flops(model: HybridLM, seq_len: int, batch: int = 1, logits: str = "all") -> float:
    """FLOPs of one prefill of ``batch`` prompts of ``seq_len`` tokens: ``flops_per_token`` over every
    token, less the LM head of the positions whose logits are not computed (``logits="last"``)."""
    _check_logits(logits)
    total = model.flops_per_token(seq_len) * seq_len * batch
    if logits == "last":
        total -= 2.0 * model.config.vocab_size * model.config.d_model * (seq_len - 1) * batch
    return total


def _rates(model: HybridLM, seq_len: int, batch: int, seconds: float, peak_flops: float | None,
           logits: str = "all") -> dict:
    flops_s = prefill_flops(model, seq_len, batch, logits) / seconds
    row = {"tokens_per_s": round(batch * seq_len / seconds, 1), "GFLOP/s": round(flops_s / 1e9, 3)}
    if peak_flops:
        row["of_peak"] = round(flops_s / peak_flops, 4)
    return row


@torch.inference_mode()
def time_prefill(model: HybridLM, seq_len: int, *, batch: int = 1, warmup: int = 1, repeats: int = 3,
                 peak_flops: float | None = None, max_spread: float = MAX_SPREAD, logits: str = "last") -> dict:
    """Latency of the plain forward ``model(ids)`` for ``batch`` random prompts of ``seq_len`` tokens
    (min / median / max over ``repeats``), the achieved FLOP/s at the median, its share of ``peak_flops``,
    and the cache bytes a sequence of this length holds (KV in the model's dtype, plus Mamba state).

    ``logits="last"`` (the default) computes the last position's logits only (``logits_to_keep=1``: what a
    prompt needs, as ``llama-bench -p`` times it); ``"all"`` every position's. The FLOPs follow: the LM
    head of positions not computed is not counted."""
    _check_logits(logits)
    param = next(model.parameters())
    device = param.device
    ids = torch.randint(0, model.config.vocab_size, (batch, seq_len), device=device)
    keep = 1 if logits == "last" else 0
    timing = measure(lambda: model(ids, logits_to_keep=keep), device, warmup=warmup, repeats=repeats,
                     max_spread=max_spread)
    row = {"seq_len": seq_len, "batch": batch, "logits": logits, **timing.row(),
           **_rates(model, seq_len, batch, timing.median, peak_flops, logits)}
    # what the engine's cache holds for this sequence (K/V and conv state in the model dtype, SSM state fp32)
    row["cache_MB/seq"] = round(model.cache_spec().bytes_per_sequence(seq_len) / 2**20, 3)
    return row


def engine_prefill_fn(model: HybridLM, seq_len: int, *, chunk: int = 2048, block_size: int = 16,
                      seed: int = 0) -> Callable[[], None]:
    """A function that runs one ``seq_len``-token prompt through :class:`hybrid.Engine` with
    ``max_batch_tokens=chunk`` (longer prompts are prefilled in chunks) and one new token: the engine's
    own prompt path, cache writes and last-token logits included. One engine, sized for the prompt,
    serves every call (a finished request frees its blocks)."""
    from ..engine import Engine
    from ..engine.config import EngineConfig
    from ..sampling import SamplingParams

    device = next(model.parameters()).device
    engine = Engine(model, EngineConfig(num_blocks=-(-seq_len // block_size), block_size=block_size, max_seqs=1,
                                        max_batch_tokens=chunk))
    prompt = torch.randint(0, model.config.vocab_size, (seq_len,),
                           generator=torch.Generator().manual_seed(seed)).tolist()
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)

    def prefill() -> None:
        rid = engine.add_request(prompt, params)
        engine.run()
        engine.forget(rid)
        _sync(device)

    return prefill


def time_engine_prefill(model: HybridLM, seq_len: int, *, chunk: int = 2048, block_size: int = 16,
                        warmup: int = 1, repeats: int = 3, max_spread: float = MAX_SPREAD, seed: int = 0) -> dict:
    """Latency of one ``seq_len``-token prompt through :class:`hybrid.Engine` (:func:`engine_prefill_fn`):
    min / median / max over ``repeats`` after ``warmup``, and tokens/s at the median."""
    device = next(model.parameters()).device
    prefill = engine_prefill_fn(model, seq_len, chunk=chunk, block_size=block_size, seed=seed)
    timing = measure(prefill, device, warmup=warmup, repeats=repeats, max_spread=max_spread)
    return {"seq_len": seq_len, "chunk": chunk, **timing.row(), "tokens_per_s": round(seq_len / timing.median, 1)}


def sweep(models: dict[str, HybridLM], lengths: list[int], *, batch: int = 1, warmup: int = 1, repeats: int = 3,
          peak_flops: float | None = None, max_spread: float = MAX_SPREAD, progress: bool = True,
          logits: str = "last") -> list[dict]:
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
                                                       repeats=repeats, peak_flops=peak_flops,
                                                       max_spread=max_spread, logits=logits)})
        except (RuntimeError, MemoryError) as err:
            if not _is_oom(err) and not isinstance(err, MemoryError):
                raise
            failed[name] = L
            rows.append({"model": name, "seq_len": L, "skipped": f"out of memory at {L} tokens"})
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return rows
