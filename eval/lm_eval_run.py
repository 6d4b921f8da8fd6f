"""Run lm-eval tasks on a hybrid model, with this package's tasks (``mmlu_local``) on the task path."""

from __future__ import annotations

import json
import re
from pathlib import Path

from ..model import HybridLM
from .tasks import TASKS_DIR, ours_first, task_manager


def run(model: str | HybridLM | None = None, *, recipe: str | None = None, tasks: list[str],
        num_fewshot: int | None = None, limit: int | float | None = None, mmlu_dir: str | None = None,
        batch_size: int = 8, device: str = "cpu", dtype: str = "float32", max_length: int = 2048,
        backend: str | None = None, tokenizer: str | None = None, log_samples: bool = False,
        **model_kwargs) -> dict:
    """lm-eval's results dict for ``tasks`` on ``model`` (a checkpoint folder or a HybridLM) or
    ``recipe``. ``mmlu_dir`` is where ``mmlu_local`` reads MMLU from (else $HYBRID_MMLU_DIR, else
    ../shared/data/mmlu beside the repository). ``model_kwargs`` go to the model (e.g. ``prefix_caching=True``)."""
    import lm_eval

    from .lm_eval_model import HybridEvalLM

    lm = HybridEvalLM(pretrained=model, recipe=recipe, tokenizer=tokenizer, dtype=dtype, device=device,
                      batch_size=batch_size, max_length=max_length, backend=backend, **model_kwargs)
    manager = task_manager(mmlu_dir)  # indexes lm-eval's own ~15k task configs only if a task is not ours
    unknown = [t for t in tasks if t not in manager.hybrid_tasks and t not in manager.all_tasks
               and not any(c in t for c in "*?[/")]
    if unknown:
        raise ValueError(f"unknown lm-eval task(s) {unknown}; this package ships mmlu_local (and "
                         f"mmlu_local_<subject>); lm-eval's own tasks are there too (`lm_eval ls tasks`)")
    results = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit,
                                      task_manager=manager, log_samples=log_samples, bootstrap_iters=0)
    results["config"]["model"] = "hybrid"
    results["config"]["model_args"] = {"pretrained": model if isinstance(model, str) else None, "recipe": recipe,
                                       "dtype": dtype, "device": device, "batch_size": batch_size,
                                       "max_length": max_length, "backend": backend, **model_kwargs}
    results["hybrid_tokens_computed"] = lm.tokens_computed
    return results


def task_accuracy(results: dict, task: str) -> float:
    """``acc`` of ``task`` (a task or a group) from lm-eval's results dict."""
    for section in ("groups", "results"):
        entry = results.get(section, {}).get(task)
        if entry and "acc,none" in entry:
            return float(entry["acc,none"])
    raise KeyError(f"no acc for {task!r} in the results (have: {sorted(results.get('results', {}))})")


def write_results(results: dict, output_dir: str | Path, name: str) -> Path:
    """lm-eval's results JSON (samples left out) as ``output_dir/results_<name>.json``."""
    from lm_eval.utils import handle_non_serializable

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "model"
    path = out / f"results_{safe}.json"
    body = {k: v for k, v in results.items() if k != "samples"}
    path.write_text(json.dumps(body, indent=2, default=handle_non_serializable, ensure_ascii=False) + "\n")
    return path


def subtask_accuracies(results: dict) -> tuple[dict[str, float], dict[str, int]]:
    """``acc`` of every task and group in lm-eval's results dict (for mmlu_local: the overall average,
    the four category groups and the 57 subjects), and how many questions each was scored on (a
    group's count is the sum over the tasks below it)."""
    accs: dict[str, float] = {}
    for section in ("results", "groups"):
        for name, entry in results.get(section, {}).items():
            if "acc,none" in entry and name not in accs:
                accs[name] = float(entry["acc,none"])
    counts = {name: int(n.get("effective", n.get("original", 0))) for name, n in results.get("n-samples", {}).items()}
    subtasks = results.get("group_subtasks", {})

    def count(name: str) -> int:
        if name in counts:
            return counts[name]
        counts[name] = sum(count(child) for child in subtasks.get(name, []))
        return counts[name]

    for name in accs:
        count(name)
    return accs, counts


def lm_eval_main(argv: list[str] | None = None) -> None:
    """The ``hybrid-lm-eval`` command: lm-eval's own command line, every flag passed through, with the ``hybrid``
    model registered and this package's tasks (``mmlu_local``) on ``--include_path`` (lm-eval 0.4.x reads no plugin
    entry points for models or tasks, so ``lm_eval --model hybrid`` itself cannot find either)."""
    import sys

    from lm_eval.__main__ import cli_evaluate

    from . import lm_eval_model  # noqa: F401  (registers model "hybrid")

    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] not in ("run", "ls", "validate") and not args[0].startswith("-h"):
        args = ["run", *args]  # lm-eval's default sub-command, as its own CLI inserts it
    # run, ls and validate all index tasks; a user's own --include_path replaces ours (lm-eval takes one folder)
    ours = bool(args) and args[0] in ("run", "ls", "validate") and not any(a.startswith("--include_path") for a in args)
    if ours:
        args += ["--include_path", str(TASKS_DIR)]
    sys.argv = ["lm_eval", *args]
    import lm_eval.tasks

    # lm-eval's CLI builds TaskManager(include_path=...), which indexes lm-eval's own ~15k configs (15-30 s on 2
    # cores) even when every task asked for is ours, and has no flag against it; it imports the class at call time,
    # so the run gets one that indexes them only when a task is not ours (eval/tasks: ours_first)
    manager = lm_eval.tasks.TaskManager
    if ours:
        lm_eval.tasks.TaskManager = ours_first(manager)
    try:
        cli_evaluate()
    finally:
        lm_eval.tasks.TaskManager = manager
