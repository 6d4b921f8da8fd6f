"""Prefill speed versus accuracy across a family of models that differ in their attention share.

Two sources of accuracy:
- **MQAR** (default, nothing to download): the family ``recipes.attention_family(size, share)`` for
  each share is trained from scratch on multi-query associative recall on this machine and scored
  at several numbers of key-value pairs (``eval/mqar.py``);
- **lm-eval** (``checkpoints`` + ``tasks``): each checkpoint is scored on the tasks (e.g.
  ``mmlu_local``) through the ``hybrid`` lm-eval model.

Each model's prefill is then timed at every context length (``prefill_bench.sweep``), and the
report is written as JSON, CSV, a markdown table and a PNG plot.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from pathlib import Path

import torch
from tqdm import tqdm

from ..model import HybridLM
from ..pattern import attention_share
from . import mqar
from .prefill_bench import matmul_peak_flops, sweep
from .tables import markdown, write_csv

DEFAULT_SHARES = (0.0, 0.125, 0.25, 0.5, 1.0)


@dataclass
class TradeoffResult:
    """One row per model (``rows``), one per model and length (``prefill``), and how it was made."""

    rows: list[dict]
    prefill: list[dict]
    settings: dict = field(default_factory=dict)


def share_label(share: float) -> str:
    return f"attn={Fraction(share).limit_denominator(64)}"


def build_family(size: str, shares: tuple[float, ...], n_blocks: int, seed: int) -> dict[str, HybridLM]:
    """One freshly initialised model per attention share (same width, depth and seed)."""
    from ..recipes import attention_family

    models = {}
    for share in shares:
        torch.manual_seed(seed)
        models[share_label(share)] = HybridLM(attention_family(size, share, n_blocks))
    return models


def mqar_accuracy(models: dict[str, HybridLM], cfg: mqar.TrainConfig, progress: bool = True) -> dict[str, dict]:
    """Train each model on MQAR (in place) and score it; per model its accuracy at each number of
    key-value pairs, the mean over them, the final training loss and the training seconds."""
    out = {}
    for name, model in tqdm(models.items(), desc="MQAR family", unit="model", disable=not progress):
        t0 = time.perf_counter()
        losses = mqar.train(model, cfg, desc=f"train {name}", progress=progress)
        acc = mqar.evaluate(model, cfg)
        out[name] = {"accuracy": sum(acc.values()) / len(acc), "per_kv": acc,
                     "final_loss": sum(losses[-10:]) / len(losses[-10:]), "train_s": time.perf_counter() - t0}
    return out


def lm_eval_accuracy(checkpoints: list[str], tasks: list[str], *, num_fewshot: int | None, limit: int | None,
                     mmlu_dir: str | None, batch_size: int, device: str, dtype: str, output: Path) -> dict[str, dict]:
    """Score each checkpoint on ``tasks`` with lm-eval (results JSON kept under ``output``); the
    accuracy is the first task's ``acc`` (its group aggregate for a group such as mmlu_local)."""
    from .lm_eval_run import run, task_accuracy, write_results

    out = {}
    for path in tqdm(checkpoints, desc="lm-eval", unit="model"):
        results = run(path, tasks=tasks, num_fewshot=num_fewshot, limit=limit, mmlu_dir=mmlu_dir,
                      batch_size=batch_size, device=device, dtype=dtype)
        saved = write_results(results, output / "lm_eval", Path(path).name)
        out[path] = {"accuracy": task_accuracy(results, tasks[0]),
                     "per_task": {t: task_accuracy(results, t) for t in tasks}, "results_json": str(saved)}
    return out


def summary_rows(models: dict[str, HybridLM], accuracy: dict[str, dict], prefill: list[dict],
                 metric: str) -> list[dict]:
    """One row per model: shape, accuracy (and its parts), prefill ms per length, cache bytes."""
    rows = []
    for name, model in models.items():
        cfg, acc = model.config, accuracy[name]
        row = {"model": name, "attn_share": round(attention_share(cfg.pattern), 4),
               "params_M": round(model.num_parameters() / 1e6, 3), metric: round(acc["accuracy"], 4)}
        for key, value in acc.get("per_kv", {}).items():
            row[f"{metric}@{key}kv"] = round(value, 4)
        for key, value in acc.get("per_task", {}).items():
            if len(acc["per_task"]) > 1:
                row[key] = round(value, 4)
        for p in prefill:
            if p["model"] == name:
                row[f"prefill_ms@{p['seq_len']}"] = p.get("prefill_ms", "skipped")
        spec = model.cache_spec()  # as the engine stores it: SSM state fp32, the rest in the model dtype
        row["KV_bytes/token"] = spec.kv_bytes_per_token
        row["state_bytes/seq"] = spec.state_bytes_per_sequence
        row["pattern"] = cfg.pattern
        rows.append(row)
    return rows


def plot(result: TradeoffResult, metric: str, path: Path) -> Path:
    """Left: prefill latency at the longest timed length vs accuracy, one point per model.
    Right: prefill latency vs context length, one line per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_acc, ax_len) = plt.subplots(1, 2, figsize=(12, 4.8))
    timed = [p for p in result.prefill if "prefill_ms" in p]
    longest = max((p["seq_len"] for p in timed), default=None)
    for row in result.rows:
        mine = sorted((p for p in timed if p["model"] == row["model"]), key=lambda p: p["seq_len"])
        if mine:
            ax_len.plot([p["seq_len"] for p in mine], [p["prefill_ms"] for p in mine], marker="o", label=row["model"])
        at_longest = [p["prefill_ms"] for p in mine if p["seq_len"] == longest]
        if at_longest:
            ax_acc.scatter(at_longest, [row[metric]], s=50)
            ax_acc.annotate(row["model"], (at_longest[0], row[metric]), textcoords="offset points", xytext=(5, 5))
    ax_acc.set_xlabel(f"prefill latency at {longest} tokens (ms)")
    ax_acc.set_ylabel(metric)
    ax_acc.set_title("accuracy vs prefill latency")
    ax_acc.grid(True, alpha=0.3)
    ax_len.set_xscale("log", base=2)
    ax_len.set_yscale("log")
    ax_len.set_xlabel("context length (tokens)")
    ax_len.set_ylabel("prefill latency (ms)")
    ax_len.set_title("prefill latency vs context length")
    ax_len.grid(True, which="both", alpha=0.3)
    ax_len.legend(fontsize=8)
    device = result.settings.get("device", "")
    fig.suptitle(f"attention share tradeoff ({device})")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_report(result: TradeoffResult, metric: str, output: Path) -> dict[str, Path]:
    """``tradeoff.json`` (everything), ``tradeoff.csv`` (summary rows), ``tradeoff.md``, ``tradeoff.png``."""
    output.mkdir(parents=True, exist_ok=True)
    paths = {"json": output / "tradeoff.json", "csv": output / "tradeoff.csv", "md": output / "tradeoff.md",
             "png": output / "tradeoff.png"}
    paths["json"].write_text(json.dumps(asdict(result), indent=2, default=str) + "\n")
    write_csv(result.rows, paths["csv"])
    s = result.settings
    table_rows = [{k: v for k, v in r.items() if k != "pattern"} for r in result.rows]
    md = [f"# Prefill speed vs {metric}", "",
          f"Device: {s.get('device')}, {s.get('threads')} threads, dtype {s.get('dtype')}, "
          f"median of {s.get('repeats')} runs; matmul peak {s.get('matmul_peak_GFLOP/s')} GFLOP/s.", "",
          markdown(table_rows), "", "Patterns:", ""]
    md += [f"- `{r['model']}`: `{r['pattern']}`" for r in result.rows]
    md += ["", "Prefill runs:", "", markdown(result.prefill), ""]
    paths["md"].write_text("\n".join(md))
    plot(result, metric, paths["png"])
    return paths


def run(*, checkpoints: list[str] | None = None, tasks: list[str] | None = None, num_fewshot: int | None = None,
        limit: int | None = None, mmlu_dir: str | None = None, eval_batch_size: int = 8,
        size: str = "tiny", n_blocks: int = 8, shares: tuple[float, ...] = DEFAULT_SHARES,
        train: mqar.TrainConfig | None = None, lengths: tuple[int, ...] = (512, 2048, 8192),
        repeats: int = 3, warmup: int = 1, device: str = "cpu", dtype: str = "float32", seed: int = 0,
        output: str | Path = "out/tradeoff", progress: bool = True) -> tuple[TradeoffResult, dict[str, Path]]:
    """The whole report: accuracy (MQAR on a trained family, or lm-eval on ``checkpoints``), prefill
    timings at ``lengths``, then the four output files under ``output``."""
    from .. import from_pretrained

    output = Path(output)
    torch_dtype = getattr(torch, dtype)
    settings = {"device": f"{device} ({platform.processor() or platform.machine()})" if device == "cpu" else device,
                "threads": torch.get_num_threads(), "dtype": dtype, "repeats": repeats, "warmup": warmup,
                "lengths": list(lengths)}
    if checkpoints:
        if not tasks:
            raise ValueError("--checkpoints needs --tasks (e.g. mmlu_local) to measure accuracy")
        metric = "acc"
        accuracy = lm_eval_accuracy(checkpoints, tasks, num_fewshot=num_fewshot, limit=limit, mmlu_dir=mmlu_dir,
                                    batch_size=eval_batch_size, device=device, dtype=dtype, output=output)
        models = {p: from_pretrained(p, dtype=torch_dtype, device=device) for p in checkpoints}
        settings.update(source="lm-eval", tasks=tasks, num_fewshot=num_fewshot, limit=limit)
    else:
        metric = "mqar_acc"
        train = train or mqar.TrainConfig(seed=seed)
        models = build_family(size, shares, n_blocks, seed)
        accuracy = mqar_accuracy(models, train, progress=progress)
        models = {n: m.to(device=device, dtype=torch_dtype).eval() for n, m in models.items()}
        settings.update(source="mqar", size=size, n_blocks=n_blocks, train=asdict(train),
                        train_s={n: round(a["train_s"], 1) for n, a in accuracy.items()},
                        final_loss={n: round(a["final_loss"], 4) for n, a in accuracy.items()})
    peak = matmul_peak_flops(device, torch_dtype)
    settings["matmul_peak_GFLOP/s"] = round(peak / 1e9, 2)
    prefill = sweep(models, list(lengths), warmup=warmup, repeats=repeats, peak_flops=peak, progress=progress)
    result = TradeoffResult(summary_rows(models, accuracy, prefill, metric), prefill, settings)
    return result, write_report(result, metric, output)
