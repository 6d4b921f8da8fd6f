"""lm-eval task configs shipped with hybrid-lm (``mmlu_local``): pass ``TASKS_DIR`` as an
lm-eval ``include_path``."""

from pathlib import Path

TASKS_DIR = Path(__file__).resolve().parent
