"""What every benchmark script shares: the ``--threads`` / ``--json`` / ``--lock`` options, the machine facts a
number depends on (CPU model and its SIMD flags as ``lscpu`` reports them, cores, torch), the JSON record a run
leaves (what ``benchmarks/render_results.py`` turns into the docs' results pages), and timing variants that
take turns run by run.

Run a benchmark from the repo root as a module: ``python -m benchmarks.NAME --help``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path

from hybrid.eval.timing import set_threads
from hybrid.eval.tradeoff import machine_facts

__all__ = ["add_json", "add_lock", "add_threads", "cpu_flags", "interleaved_seconds", "machine", "record",
           "set_threads", "timing_lock"]

REPO = Path(__file__).resolve().parents[1]
# the SIMD features that decide which kernels are fast here (bf16 matmuls need AVX512-BF16 or AMX on a CPU)
FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "neon", "sve")


def add_threads(p: argparse.ArgumentParser, default: int) -> None:
    p.add_argument("--threads", type=int, default=default,
                   help="torch intra-op threads" + (" (0: one per CPU core this process may use)" if default == 0
                                                    else ""))


def add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", type=Path, default=None,
                   help="also write the rows with the machine, date and command as JSON here (the format "
                        "benchmarks/render_results.py reads)")


def add_lock(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lock", default=None,
                   help="file to hold an exclusive flock on while timing (as `flock FILE cmd`), e.g. /tmp/bench.lock")


def cpu_flags() -> list[str]:
    """The :data:`FLAGS` this CPU has (from ``lscpu``, else ``/proc/cpuinfo``); empty where neither exists."""
    text = ""
    if shutil.which("lscpu"):
        text = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    if "Flags" not in text:
        with contextlib.suppress(OSError):
            text = Path("/proc/cpuinfo").read_text()
    have = set()
    for line in text.splitlines():
        if line.lower().startswith(("flags", "features")):
            have |= set(line.split(":", 1)[1].split())
    return [f for f in FLAGS if f in have]


def machine() -> dict:
    """The tradeoff report's machine facts (CPU, cores, OS, python, torch) plus the CPU's SIMD flags."""
    return {**machine_facts(), "cpu_flags": cpu_flags()}


def record(path: Path | None, benchmark: str, rows: list[dict], **extra) -> Path | None:
    """Write ``rows`` with the machine, the UTC date and the command line to ``path`` as JSON (nothing when
    ``path`` is None); ``extra`` keys (settings, notes) go beside them."""
    if path is None:
        return None
    body = {"benchmark": benchmark, "date": datetime.now(timezone.utc).isoformat(timespec="minutes"),
            "machine": machine(), "command": " ".join(["python -m", f"benchmarks.{benchmark}", *sys.argv[1:]]),
            **extra, "rows": rows}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(body, indent=1, default=str) + "\n")
    return path


@contextlib.contextmanager
def timing_lock(path: str | Path | None) -> Iterator[None]:
    """Hold an exclusive flock on ``path`` for the block (the tradeoff report's lock; None: no lock)."""
    from hybrid.eval.tradeoff import timing_lock as lock

    with lock(path, {}, progress=True):
        yield


def interleaved_seconds(fns: dict[str, Callable[[], object]], warmup: int, repeats: int) -> dict[str, list[float]]:
    """Seconds of each of ``repeats`` runs of every fn, the fns taking turns run by run (after ``warmup``
    turns: a compiled variant compiles there), so a change in the machine's load falls on all of them alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return times
