"""Prefill speed versus accuracy across a family of models that differ in their attention share.

Two sources of accuracy:
- **MQAR** (default, nothing to download): for each attention share the mixer pattern
  ``recipes.attention_family(size, share, n_blocks, mlp=False)`` (the mixers alone, as Zoology compares
  them) is built at a small width, trained from scratch on multi-query associative recall on this
  machine once per seed, and scored at several numbers of key-value pairs (``eval/mqar.py``);
- **lm-eval** (``checkpoints`` + ``tasks``): each checkpoint is scored on the tasks (e.g.
  ``mmlu_local``: every subject, the four category groups and the overall average) through the
  ``hybrid`` lm-eval model.

Speed and memory are measured where they mean something: with MQAR, the *same patterns* at the
``speed_size`` width (``small``: d_model 768, where prefill on a CPU is compute-bound; the weights are
untrained, which does not change the time), with checkpoints, the checkpoints themselves. Each prompt
runs through :class:`hybrid.Engine` (chunked prefill, paged KV cache, state slots), timed as min /
median / max over repeats, re-measured when the spread is wide (``timing.measure``). Memory is
the bytes one sequence holds at each length, read from the layers' cache specs, and how many such
sequences fit in ``cache_budget`` bytes (``hybrid.cache.sequences_that_fit``).

:mod:`.tradeoff_report` turns the result into the table, the seed-claim check, the CSV/JSON/markdown
files and (:mod:`.tradeoff_plot`) the PNG.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from fractions import Fraction
from pathlib import Path

import torch
from tqdm import tqdm

from ..model import HybridLM
from ..pattern import attention_share
from . import mqar
from .timing import MAX_SPREAD, _is_oom, matmul_peak_flops, set_threads, time_engine_prefill

DEFAULT_SHARES = (0.0, 0.25, 0.5, 0.75, 1.0)
DEFAULT_N_BLOCKS = 4
DEFAULT_LENGTHS = (2048, 8192)  # timed for every member
DEFAULT_LONG_LENGTHS = (32768,)  # timed for the members in long_shares only (all-attention at 32K costs minutes)
DEFAULT_LONG_SHARES = (0.0, 1.0)
CACHE_BUDGET = 4 * 2**30


@dataclass
class TradeoffResult:
    """``members``: one dict per model (accuracy, timings, memory); ``settings``: how it was made
    (machine, threads, dtype, date, wall time, budgets)."""

    members: list[dict]
    settings: dict = field(default_factory=dict)


def share_label(share: float) -> str:
    return f"attn={Fraction(share).limit_denominator(64)}"


def machine_facts() -> dict:
    """What the timings depend on: CPU model, cores this process may use, OS, torch build, load."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": cpu, "cores": cores, "os": f"{platform.system()} {platform.release()}",
            "python": platform.python_version(), "torch": torch.__version__}


def _load() -> list[float] | None:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


# ---- accuracy -----------------------------------------------------------------------------------

def _train_member(size: str, share: float, n_blocks: int, cfg: mqar.TrainConfig, mixer: str = "mamba2",
                  steps_done=None) -> dict:
    """Train and score one family member for one seed (``cfg.seed``), on one thread; a worker process
    runs this (the models are small: two single-thread trainings use two cores better than one
    two-thread training). ``steps_done``: a queue told how many steps are done, for the parent's bar."""
    torch.set_num_threads(1)
    torch.manual_seed(cfg.seed)
    model = mqar.build_model(size, share, n_blocks, cfg, mixer)
    t0 = time.perf_counter()
    losses = mqar.train(model, cfg, progress=False, on_steps=steps_done.put if steps_done is not None else None)
    acc = mqar.evaluate(model, cfg)
    return {"seed": cfg.seed, "accuracy": statistics.fmean(acc.values()), "per_kv": acc,
            "final_loss": statistics.fmean(losses[-20:]), "train_s": round(time.perf_counter() - t0, 1),
            "params": model.num_parameters(), "pattern": model.config.pattern,
            "state_bytes": model.cache_spec().state_bytes_per_sequence}


def _train_all(jobs: list[tuple], workers: int, total_steps: int, progress: bool) -> list[dict]:
    """``_train_member`` for every job, ``workers`` at a time in worker processes (inline for one),
    with one progress bar over all their training steps."""
    bar = tqdm(total=total_steps, desc="MQAR training (all members and seeds)", unit="step", disable=not progress)
    if workers <= 1:
        out = [_train_member(*job, steps_done=_Counter(bar)) for job in jobs]
        bar.close()
        return out
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    ctx = mp.get_context("spawn")  # a fork would copy this process's torch thread pool
    with ctx.Manager() as manager, ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        queue = manager.Queue()
        futures = [pool.submit(_train_member, *job, steps_done=queue) for job in jobs]
        while not all(f.done() for f in futures):
            _drain(queue, bar, timeout=0.5)
        _drain(queue, bar, timeout=0.0)
        out = [f.result() for f in futures]  # re-raises a worker's error here
    bar.close()
    return out


class _Counter:
    """``put(k)`` advances a progress bar: the inline stand-in for the workers' queue."""

    def __init__(self, bar):
        self.bar = bar

    def put(self, k: int) -> None:
        self.bar.update(k)


def _drain(queue, bar, timeout: float) -> None:
    import queue as queue_mod

    try:
        bar.update(queue.get(timeout=timeout) if timeout else queue.get_nowait())
        while True:
            bar.update(queue.get_nowait())
    except queue_mod.Empty:
        pass


def mqar_accuracy(shares: tuple[float, ...], n_blocks: int, cfg: mqar.TrainConfig, seeds: tuple[int, ...], *,
                  size: str, workers: int = 1, progress: bool = True, mixer: str = "mamba2") -> dict[str, dict]:
    """Train one model per share and seed on MQAR and score it. Per member: the mean over seeds of
    the mean accuracy over the scored pair counts, its min and max over seeds, the per-pair-count
    accuracy (mean, min and max over seeds), and each seed's numbers."""
    jobs = [(size, share, n_blocks, dataclasses.replace(cfg, seed=seed), mixer) for share in shares for seed in seeds]
    results = _train_all(jobs, workers, cfg.steps * len(jobs), progress)
    out = {}
    for share in shares:
        runs = [r for job, r in zip(jobs, results, strict=True) if job[1] == share]
        accs = [r["accuracy"] for r in runs]
        ns = cfg.eval_kv_pairs
        out[share_label(share)] = {
            "accuracy": statistics.fmean(accs), "accuracy_min": min(accs), "accuracy_max": max(accs),
            "per_kv": {n: statistics.fmean(r["per_kv"][n] for r in runs) for n in ns},
            "per_kv_min": {n: min(r["per_kv"][n] for r in runs) for n in ns},
            "per_kv_max": {n: max(r["per_kv"][n] for r in runs) for n in ns},
            "seeds": runs, "params": runs[0]["params"], "acc_pattern": runs[0]["pattern"],
            "acc_state_bytes": runs[0]["state_bytes"]}
    return out


def lm_eval_accuracy(checkpoints: list[str], tasks: list[str], *, num_fewshot: int | None, limit: float | None,
                     mmlu_dir: str | None, batch_size: int, device: str, dtype: str, output: Path,
                     progress: bool = True) -> dict[str, dict]:
    """Score each checkpoint on ``tasks`` with lm-eval (results JSON kept under ``output/lm_eval``).
    Per checkpoint: ``accuracy`` (the first task's ``acc``: for a group such as mmlu_local its
    question-weighted aggregate), ``stderr`` (binomial, from the number of questions), every task's,
    group's and subject's ``acc`` (``per_task``), and the results file."""
    from .lm_eval_run import run, subtask_accuracies, write_results

    out = {}
    for path in tqdm(checkpoints, desc="lm-eval", unit="model", disable=not progress):
        results = run(path, tasks=tasks, num_fewshot=num_fewshot, limit=limit, mmlu_dir=mmlu_dir,
                      batch_size=batch_size, device=device, dtype=dtype)
        saved = write_results(results, output / "lm_eval", Path(path).name)
        per_task, counts = subtask_accuracies(results)
        if tasks[0] not in per_task:
            raise ValueError(f"lm-eval gave no acc for {tasks[0]!r} (have: {sorted(per_task)})")
        groups = [t for t in per_task if t in results.get("groups", {})]
        # the first task, then its groups, then the tasks (subjects) alphabetically
        order = [tasks[0], *sorted(g for g in groups if g != tasks[0]),
                 *sorted(t for t in per_task if t not in groups and t != tasks[0])]
        acc = per_task[tasks[0]]
        n = counts.get(tasks[0], 0)
        out[path] = {"accuracy": acc, "stderr": (acc * (1 - acc) / n) ** 0.5 if n else None, "questions": n,
                     "per_task": {t: per_task[t] for t in order}, "groups": groups,
                     "results_json": str(saved)}
    return out


# ---- speed and memory ---------------------------------------------------------------------------

def time_member(model: HybridLM, lengths: list[int], *, chunk: int, warmup: int, repeats: int,
                max_spread: float) -> list[dict]:
    """Engine prefill of ``model`` at each length (shortest first); out of memory skips the rest.
    Only the first length gets the warm-up runs: later ones run on a warm allocator and kernels."""
    rows = []
    for i, L in enumerate(sorted(lengths)):
        try:
            rows.append(time_engine_prefill(model, L, chunk=chunk, warmup=warmup if i == 0 else 0,
                                            repeats=repeats, max_spread=max_spread))
        except (RuntimeError, MemoryError) as err:
            if not isinstance(err, MemoryError) and not _is_oom(err):
                raise
            rows += [{"seq_len": x, "skipped": f"out of memory at {L} tokens"} for x in sorted(lengths) if x >= L]
            break
    return rows


def memory_rows(model: HybridLM, lengths: list[int], cache_budget: int, block_size: int = 16, *,
                kv_dtype: str | None = None, state_dtype: str | None = None) -> list[dict]:
    """Bytes one sequence holds at each length (KV blocks + Mamba state, from the cache specs, as the
    engine stores them: ``kv_dtype`` / ``state_dtype`` as ``hybrid.Engine`` takes them, None: K/V and conv
    state in the model's dtype, SSM state fp32; block and state scales counted) and how many fit in
    ``cache_budget``."""
    from ..cache import cache_dtypes, sequences_that_fit

    d = cache_dtypes(next(model.parameters()).dtype, kv_dtype, state_dtype)
    spec = model.cache_spec(kv_dtype=d.kv, conv_dtype=d.conv, ssm_dtype=d.ssm)
    return [{"seq_len": L, "cache_bytes": spec.bytes_per_sequence(L, block_size=block_size),
             "seqs_in_budget": sequences_that_fit(model.config, cache_budget, L, block_size=block_size,
                                                  kv_dtype=d.kv, conv_dtype=d.conv, ssm_dtype=d.ssm)}
            for L in lengths]


def speed_and_memory(models: dict[str, HybridLM], *, lengths: tuple[int, ...], long_lengths: tuple[int, ...],
                     long_members: set[str], chunk: int, warmup: int, repeats: int, long_repeats: int,
                     max_spread: float, cache_budget: int, kv_dtype: str | None = None,
                     state_dtype: str | None = None, progress: bool = True) -> dict[str, dict]:
    """Per member: its prefill rows (``lengths`` for all, ``long_lengths`` for ``long_members``, with
    ``long_repeats``), its memory rows at every length, and its speed model's facts (cache bytes in the
    ``kv_dtype`` / ``state_dtype`` storage)."""
    from ..cache import cache_dtypes

    out = {}
    every = sorted(set(lengths) | set(long_lengths))
    for name, model in tqdm(models.items(), desc="prefill (engine)", unit="model", disable=not progress):
        rows = time_member(model, list(lengths), chunk=chunk, warmup=warmup, repeats=repeats,
                           max_spread=max_spread)
        if name in long_members and long_lengths:
            rows += time_member(model, list(long_lengths), chunk=chunk, warmup=0, repeats=long_repeats,
                                max_spread=max_spread)
        cfg = model.config
        memory = memory_rows(model, every, cache_budget, kv_dtype=kv_dtype, state_dtype=state_dtype)
        d = cache_dtypes(next(model.parameters()).dtype, kv_dtype, state_dtype)
        spec = model.cache_spec(kv_dtype=d.kv, conv_dtype=d.conv, ssm_dtype=d.ssm)
        out[name] = {"prefill": rows, "memory": memory,
                     "speed_model": {"pattern": cfg.pattern, "d_model": cfg.d_model, "n_layers": len(cfg.pattern),
                                     "params": model.num_parameters(),
                                     "kv_bytes_per_token": spec.kv_bytes_per_token,
                                     "state_bytes_per_sequence": spec.state_bytes_per_sequence}}
    return out


@contextlib.contextmanager
def timing_lock(path: str | Path | None, settings: dict, progress: bool):
    """Hold an exclusive ``flock(2)`` on ``path`` (the same lock ``flock(1) PATH cmd`` takes) for the
    block; records how long it waited in ``settings["lock_wait_s"]``."""
    if path is None:
        yield
        return
    import fcntl

    t0 = time.perf_counter()
    with open(path, "a") as f:
        if progress:
            print(f"waiting for the timing lock {path} ...", file=sys.stderr, flush=True)
        fcntl.flock(f, fcntl.LOCK_EX)
        settings["lock_wait_s"] = round(time.perf_counter() - t0, 1)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# ---- the whole report -----------------------------------------------------------------------------

def run(*, checkpoints: list[str] | None = None, tasks: list[str] | None = None, num_fewshot: int | None = None,
        limit: float | None = None, mmlu_dir: str | None = None, eval_batch_size: int = 8,
        size: str = "tiny", speed_size: str = "small", n_blocks: int = DEFAULT_N_BLOCKS,
        shares: tuple[float, ...] = DEFAULT_SHARES, train: mqar.TrainConfig | None = None,
        seeds: tuple[int, ...] = (0, 1), lengths: tuple[int, ...] = DEFAULT_LENGTHS,
        long_lengths: tuple[int, ...] = DEFAULT_LONG_LENGTHS, long_shares: tuple[float, ...] = DEFAULT_LONG_SHARES,
        chunk: int = 2048, repeats: int = 3, long_repeats: int = 1, warmup: int = 1,
        max_spread: float = MAX_SPREAD, cache_budget: int = CACHE_BUDGET, device: str = "cpu",
        dtype: str = "float32", threads: int | None = None, output: str | Path = "out/tradeoff",
        lock: str | Path | None = None, kv_dtype: str | None = None, state_dtype: str | None = None,
        mixer: str = "mamba2", progress: bool = True) -> tuple[TradeoffResult, dict[str, Path]]:
    """The whole report: accuracy (MQAR on a trained family, or lm-eval on ``checkpoints``), engine
    prefill timings, cache memory (``kv_dtype`` / ``state_dtype``: the cache's storage, as ``hybrid.Engine``
    takes them; the timings use the default cache), then the four output files under ``output``. ``lock``: a file
    held with an exclusive ``flock`` while timing (not while training), so that on a shared machine
    no two benchmarks that take the same lock run at once. ``mixer``: the family's constant-state mixer
    (``recipes.FAMILY_MIXERS``: ``mamba2``, ``gdn`` or ``gla``; MQAR family only, checkpoints are what they are)."""
    from .. import from_pretrained
    from ..recipes import FAMILY_MIXER_NAMES, FAMILY_MIXERS, attention_family
    from .tradeoff_report import write_report

    t_start = time.perf_counter()
    started = datetime.now(timezone.utc)
    load_before = _load()
    threads = set_threads(threads)
    output = Path(output)
    torch_dtype = getattr(torch, dtype)
    if chunk < 1 or repeats < 1 or long_repeats < 1:
        raise ValueError(f"chunk, repeats and long_repeats must be >= 1, got {chunk}, {repeats}, {long_repeats}")
    if not seeds:
        raise ValueError("give at least one seed")
    if mixer not in FAMILY_MIXERS:
        raise ValueError(f"unknown family mixer {mixer!r}; choose one of {sorted(FAMILY_MIXERS)}")
    settings = {"date": started.isoformat(timespec="seconds"), "machine": machine_facts(),
                "device": device, "threads": threads, "dtype": dtype, "repeats": repeats,
                "long_repeats": long_repeats, "warmup": warmup, "max_spread": max_spread, "chunk": chunk,
                "lengths": sorted(lengths), "long_lengths": sorted(long_lengths),
                "cache_budget_GiB": round(cache_budget / 2**30, 3), "load_before": load_before}
    from ..cache import cache_dtypes
    from ..kernels.kv_quant import dtype_name

    d = cache_dtypes(torch_dtype, kv_dtype, state_dtype)  # validates the names before any training
    settings["cache_dtypes"] = {"kv": dtype_name(d.kv), "conv": dtype_name(d.conv), "ssm": dtype_name(d.ssm)}
    if checkpoints:
        if not tasks:
            raise ValueError("--checkpoints needs --tasks (e.g. mmlu_local) to measure accuracy")
        metric = "acc"
        t0 = time.perf_counter()
        accuracy = lm_eval_accuracy(checkpoints, tasks, num_fewshot=num_fewshot, limit=limit, mmlu_dir=mmlu_dir,
                                    batch_size=eval_batch_size, device=device, dtype=dtype, output=output,
                                    progress=progress)
        settings["accuracy_s"] = round(time.perf_counter() - t0, 1)
        models = {p: from_pretrained(p, dtype=torch_dtype, device=device) for p in checkpoints}
        long_members = set(models)  # checkpoints: every one at every length
        settings.update(source="lm-eval", tasks=tasks, num_fewshot=num_fewshot, limit=limit,
                        accuracy_model="each checkpoint", speed_model="each checkpoint")
    else:
        metric = "mqar_acc"
        train = train or mqar.TrainConfig()
        bad = [s for s in long_shares if s not in shares]
        if bad:
            raise ValueError(f"long_shares {bad} are not among the family's shares {list(shares)}")
        t0 = time.perf_counter()
        accuracy = mqar_accuracy(tuple(shares), n_blocks, train, tuple(seeds), size=size, workers=threads,
                                  progress=progress, mixer=mixer)
        settings["accuracy_s"] = round(time.perf_counter() - t0, 1)
        # the training is the long part: keep its numbers even if the timing never happens
        output.mkdir(parents=True, exist_ok=True)
        (output / "accuracy.json").write_text(json.dumps({"settings": settings, "accuracy": accuracy,
                                                          "train": asdict(train)}, indent=2, default=str) + "\n")
        models = {}
        for share in shares:
            torch.manual_seed(0)
            with torch.device(device):
                models[share_label(share)] = HybridLM(attention_family(speed_size, share, n_blocks, mixer=mixer)).to(
                    torch_dtype).eval()
        long_members = {share_label(s) for s in long_shares}
        acc_cfg = mqar.family_config(size, 0.0, n_blocks, train.vocab_size, train.init_std, mixer)
        acc_state = HybridLM(acc_cfg).cache_spec().state_bytes_per_sequence  # its conv + SSM state, fp32
        speed_cfg = attention_family(speed_size, 0.0, n_blocks, mixer=mixer)
        fam = "" if mixer == "mamba2" else f", mixer='{mixer}'"  # the default's text as it always was
        pure = FAMILY_MIXER_NAMES[mixer]
        settings.update(source="mqar", mixer=mixer, size=size, speed_size=speed_size, n_blocks=n_blocks,
                        seeds=list(seeds),
                        train=asdict(train), long_shares=list(long_shares),
                        accuracy_model=f"attention_family('{size}', share, {n_blocks}, mlp=False{fam}) with vocab "
                                       f"{train.vocab_size}: {n_blocks} mixers and no MLPs, d_model {acc_cfg.d_model}, "
                                       f"init std {train.init_std} with every block's output projection zeroed, "
                                       f"trained here on MQAR ({len(seeds)} seeds, "
                                       f"{min(threads, len(shares) * len(seeds))} at a time, one thread each); the "
                                       f"pure {pure} member holds {acc_state} bytes of state per sequence",
                        speed_model=f"attention_family('{speed_size}', share, {n_blocks}{fam}): d_model "
                                    f"{speed_cfg.d_model}, untrained weights (prefill time does not depend on them)")
    with timing_lock(lock, settings, progress):
        settings["load_at_timing"] = _load()
        peak = matmul_peak_flops(device, torch_dtype)
        settings["matmul_peak_GFLOP/s"] = round(peak / 1e9, 2)
        t0 = time.perf_counter()
        speed = speed_and_memory(models, lengths=tuple(lengths), long_lengths=tuple(long_lengths),
                                 long_members=long_members, chunk=chunk, warmup=warmup, repeats=repeats,
                                 long_repeats=long_repeats, max_spread=max_spread, cache_budget=cache_budget,
                                 kv_dtype=kv_dtype, state_dtype=state_dtype, progress=progress)
        settings["speed_s"] = round(time.perf_counter() - t0, 1)
    members = []
    for name, model in models.items():
        members.append({"model": name, "attn_share": round(attention_share(model.config.pattern), 4),
                        "metric": metric, **accuracy[name], **speed[name]})
    settings["load_after"] = _load()
    settings["wall_s"] = round(time.perf_counter() - t_start, 1)
    result = TradeoffResult(members, settings)
    return result, write_report(result, output)
