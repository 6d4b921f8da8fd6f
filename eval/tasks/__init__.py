"""lm-eval task configs shipped with hybrid-lm (``mmlu_local`` and its subjects), and the lm-eval
``TaskManager`` that finds them.

lm-eval 0.4.x indexes task YAMLs only under its own ``lm_eval/tasks`` folder and the folders named by
``include_path``; ``simple_evaluate`` builds a ``TaskManager(metadata=...)`` of its own when none is passed,
and neither reads an environment variable nor a plugin entry point. So the supported way to put these
tasks in front of lm-eval from Python is lm-eval's own ``task_manager=`` argument::

    from hybrid.eval.tasks import task_manager
    lm_eval.simple_evaluate(model="hybrid", ..., tasks=["mmlu_local"], task_manager=task_manager(mmlu_dir))

and from lm-eval's CLI, ``--include_path`` with :data:`TASKS_DIR` (``hybrid-lm-eval`` adds it)."""

from __future__ import annotations

import os
from pathlib import Path

TASKS_DIR = Path(__file__).resolve().parent


def task_manager(mmlu_dir: str | os.PathLike | None = None, *, include_defaults: bool = True,
                 metadata: dict | None = None):
    """An lm-eval ``TaskManager`` that knows this package's tasks (``mmlu_local``, ``mmlu_local_<subject>``, the
    category groups) beside lm-eval's own (``include_defaults=False`` skips indexing lm-eval's ~15k configs,
    which takes tens of seconds, when only ours are wanted). ``mmlu_dir`` is where ``mmlu_local`` reads MMLU
    (else ``$HYBRID_MMLU_DIR``); ``metadata`` is passed to every task, as ``simple_evaluate(metadata=...)``
    would (lm-eval applies that argument only to the TaskManager it builds itself)."""
    from lm_eval.tasks import TaskManager

    meta = dict(metadata or {})
    if mmlu_dir is not None:
        meta["mmlu_dir"] = str(mmlu_dir)
    return TaskManager(include_path=str(TASKS_DIR), include_defaults=include_defaults, metadata=meta or None)
