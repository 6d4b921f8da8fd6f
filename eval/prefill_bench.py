"""The names ``eval/llamacpp_bench.py`` and ``eval/engine_bench.py`` import from here, until they move to
``benchmarks/``: the timing core is :mod:`.timing`."""

from .timing import engine_prefill_fn, set_threads

__all__ = ["engine_prefill_fn", "set_threads"]
