"""One member of a distilled family, measured: MMLU (cloze and multiple choice) with 95% Wilson intervals,
perplexity and top-1 agreement with the teacher on held-out teacher text, the phonebook recall probe, and
(under the timing lock, elsewhere) prefill / decode / cache bytes through the shared timing core.

Accuracy over several subjects is question-weighted (lm-eval's ``weight_by_size``): the sum of the subjects'
correct answers over their questions. The interval is the Wilson score interval of that proportion
(:func:`hybrid.eval.intervals.wilson`), not lm-eval's stderr (which the run skips: ``bootstrap_iters=0``).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from .intervals import wilson

# 10 subjects spread over MMLU's four categories (stem 3, humanities 3, social sciences 2, other 2), the default
# subset: 60 questions each give the 600-question sample the report's numbers are quoted on
DEFAULT_SUBJECTS = ("astronomy", "college_biology", "high_school_physics", "high_school_us_history",
                    "philosophy", "world_religions", "high_school_macroeconomics", "sociology",
                    "marketing", "nutrition")


def mmlu(model, tokenizer_dir: str, *, subjects: tuple[str, ...], limit: int | None, mmlu_dir: str | None,
         cloze: bool, batch_size: int = 16) -> dict:
    """0-shot MMLU over ``subjects`` (``limit`` questions each): cloze (``mmlu_local_cloze_*``: acc and acc_norm)
    or multiple choice (``mmlu_local_*``: acc), question-weighted, with Wilson intervals and per-subject acc."""
    from .lm_eval_run import run

    prefix = "mmlu_local_cloze_" if cloze else "mmlu_local_"
    tasks = [prefix + s for s in subjects]
    t0 = time.perf_counter()
    results = run(model, tokenizer=tokenizer_dir, tasks=tasks, num_fewshot=0, limit=limit, mmlu_dir=mmlu_dir,
                  batch_size=batch_size)
    out: dict = {"questions": 0, "per_subject": {}, "seconds": round(time.perf_counter() - t0, 1),
                 "tokens_computed": results.get("hybrid_tokens_computed")}
    metrics = ("acc", "acc_norm") if cloze else ("acc",)
    correct = dict.fromkeys(metrics, 0.0)
    for t, s in zip(tasks, subjects, strict=True):
        n = int(results["n-samples"][t]["effective"])
        out["questions"] += n
        out["per_subject"][s] = {m: results["results"][t][f"{m},none"] for m in metrics}
        for m in metrics:
            correct[m] += results["results"][t][f"{m},none"] * n
    for m in metrics:
        out[m] = correct[m] / out["questions"]
        out[f"{m}_ci95"] = list(wilson(round(correct[m]), out["questions"]))
    return out


def heldout_and_recall(model, tokenizer, heldout: torch.Tensor, teacher_top1: torch.Tensor, *, seq_len: int,
                       recall_lengths: tuple[int, ...], recall_queries: int, recall_contexts: int,
                       progress: bool) -> dict:
    from .perplexity import perplexity
    from .recall_probe import recall

    t0 = time.perf_counter()
    ppl = perplexity(model, heldout, seq_len=seq_len, teacher_top1=teacher_top1)
    t1 = time.perf_counter()
    rec = recall(model, tokenizer, lengths=recall_lengths, n_queries=recall_queries, contexts=recall_contexts,
                 progress=progress)
    return {"heldout": {**ppl, "seconds": round(t1 - t0, 1)},
            "recall": {str(L): r for L, r in rec.items()}, "recall_s": round(time.perf_counter() - t1, 1)}


def speed(model, *, prefill_lengths: tuple[int, ...], memory_length: int, decode_context: int, decode_steps: int,
          repeats: int, chunk: int = 2048) -> dict:
    """Prefill through the engine at each length (``tradeoff.time_member``), batch-1 decode tok/s at
    ``decode_context`` (``decode_timing``), and the cache bytes one sequence holds at ``memory_length``."""
    from .decode_timing import decode_engine, decode_speed
    from .timing import MAX_SPREAD
    from .tradeoff import memory_rows, time_member

    t0 = time.perf_counter()
    prefill = time_member(model, list(prefill_lengths), chunk=chunk, warmup=1, repeats=repeats,
                          max_spread=MAX_SPREAD) if prefill_lengths else []
    engine = decode_engine(model, 1, decode_context, steps=decode_steps, compile=False, warmup=2)
    decode, _ = decode_speed(engine, decode_steps)
    del engine
    memory = memory_rows(model, [memory_length], cache_budget=4 * 2**30)[0]
    return {"prefill": prefill, "decode": {**decode, "context": decode_context}, "memory": memory,
            "kv_bytes_per_token": model.kv_bytes_per_token(), "state_bytes_per_sequence":
                model.state_bytes_per_sequence(), "speed_s": round(time.perf_counter() - t0, 1)}


def load(folder: str | Path):
    from ..pretrained import from_pretrained

    return from_pretrained(folder, dtype=torch.float32).eval()
