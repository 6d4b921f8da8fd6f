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

import functools
import os
from collections.abc import Mapping
from pathlib import Path

TASKS_DIR = Path(__file__).resolve().parent


# TaskManager's methods that take task names, and what lists every task it knows (lm-eval 0.4.5-0.4.13 names)
_NAME_TAKING = ("load", "load_task_or_group", "match_tasks")
_LISTING = ("all_tasks", "all_groups", "all_subtasks", "all_tags")


class _IndexView(Mapping):
    """``TaskManager.task_index`` of an :func:`ours_first` manager: a name of ours is looked up in our folder's
    index (lm-eval reads the entries of the tasks it loaded, after the run); any other name, or iterating it,
    indexes lm-eval's own configs first."""

    def __init__(self, manager, prop):
        self._manager, self._prop = manager, prop

    def _index(self, name=None):
        if name not in self._manager.hybrid_tasks:
            self._manager.index_defaults()
        return self._prop.fget(self._manager)

    def __getitem__(self, name):
        return self._index(name)[name]

    def __contains__(self, name):
        return name in self._index(name)

    def __iter__(self):
        return iter(self._index())

    def __len__(self):
        return len(self._index())


def ours_first(base: type) -> type:
    """lm-eval's ``TaskManager`` class ``base``, made to index lm-eval's own ~15k task configs (15-30 s on 2 cores)
    only when it needs them: asked for a name that is not one of this package's tasks (another task, a glob, a
    config, a path), or to list what it knows. Asked only for ours (``mmlu_local``...), it answers from our folder.
    ``include_defaults=False`` never indexes lm-eval's. The names each instance knows without indexing lm-eval's
    are ``hybrid_tasks``."""

    class OursFirst(base):
        def __init__(self, *args, include_defaults: bool = True, **kwargs):
            self._defaults_pending = (args, kwargs) if include_defaults else None
            self._answering = 0  # inside a name-taking call: its own listing reads do not index lm-eval's
            super().__init__(*args, include_defaults=False, **kwargs)
            self.hybrid_tasks = frozenset(base.all_tasks.fget(self))

        def index_defaults(self) -> None:
            """Index lm-eval's own task configs now (once), beside ours."""
            if self._defaults_pending is not None:
                args, kwargs = self._defaults_pending
                self._defaults_pending = None
                base.__init__(self, *args, include_defaults=True, **kwargs)

    def name_taking(method):
        @functools.wraps(method)
        def call(self, task_list, *args, **kwargs):
            names = task_list if isinstance(task_list, (list, tuple)) else [task_list]
            if not all(isinstance(n, str) and n in self.hybrid_tasks for n in names):
                self.index_defaults()
            self._answering += 1
            try:
                return method(self, task_list, *args, **kwargs)
            finally:
                self._answering -= 1
        return call

    def listing(prop):
        def get(self):
            if not self._answering:
                self.index_defaults()
            return prop.fget(self)
        return property(get, doc=prop.__doc__)

    def listing_method(method):
        @functools.wraps(method)
        def call(self, *args, **kwargs):
            self.index_defaults()
            return method(self, *args, **kwargs)
        return call

    if isinstance(getattr(base, "task_index", None), property):
        index = base.task_index
        OursFirst.task_index = property(lambda self: _IndexView(self, index), doc=index.__doc__)
    for name in _NAME_TAKING:
        if callable(getattr(base, name, None)):
            setattr(OursFirst, name, name_taking(getattr(base, name)))
    for name in _LISTING:
        if isinstance(getattr(base, name, None), property):
            setattr(OursFirst, name, listing(getattr(base, name)))
    if callable(getattr(base, "list_all_tasks", None)):
        OursFirst.list_all_tasks = listing_method(base.list_all_tasks)
    OursFirst.__name__ = OursFirst.__qualname__ = f"OursFirst{base.__name__}"
    return OursFirst


def task_manager(mmlu_dir: str | os.PathLike | None = None, *, include_defaults: bool = True,
                 metadata: dict | None = None):
    """An lm-eval ``TaskManager`` that knows this package's tasks (``mmlu_local``, ``mmlu_local_<subject>``, the
    category groups) beside lm-eval's own, indexing lm-eval's ~15k configs (tens of seconds) only when a task that
    is not ours is asked for or everything is listed (:func:`ours_first`); ``include_defaults=False`` never does.
    ``mmlu_dir`` is where ``mmlu_local`` reads MMLU (else ``$HYBRID_MMLU_DIR``); ``metadata`` is passed to every
    task, as ``simple_evaluate(metadata=...)`` would (lm-eval applies that argument only to the TaskManager it
    builds itself)."""
    from lm_eval.tasks import TaskManager

    meta = dict(metadata or {})
    if mmlu_dir is not None:
        meta["mmlu_dir"] = str(mmlu_dir)
    return ours_first(TaskManager)(include_path=str(TASKS_DIR), include_defaults=include_defaults,
                                   metadata=meta or None)
