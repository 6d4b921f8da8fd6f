"""GGUFs of the decode benchmark's own models, for ``llama-bench`` on the same weights.

``benchmarks.decode --llama-cpp DIR`` times llama.cpp on exactly the model it times ours on: the recipe's
seed-0 model (the weights ``benchmarks.decode`` builds), exported in the format llama.cpp reads for that family
(``save_pretrained(format=...)``) and converted by llama.cpp's own converter (``scripts/serving/gguf_convert.py``)
at the type that matches what we run — fp32 -> ``f32``, bf16 -> ``bf16``, ``int8wo`` and ``int8dq`` -> ``Q8_0``,
``int4wo`` and ``8da4w`` -> ``Q4_0`` (llama.cpp's Q8_0 / Q4_0 products quantise the activations to int8 as well,
so int8dq / 8da4w are the like-for-like arithmetic; Q4_0 is made from the f32 GGUF by llama.cpp's
``llama-quantize``, which the converter cannot write). Files are
cached under the work folder by recipe and type, so a second run converts nothing.

Q8_0 keeps one scale per 32 weights and Q4_0 one per 32 as well, where torchao's int8 weight-only keeps one per
output row and our int4 one per 128 (or 64/32): llama.cpp reads slightly more scale bytes, the same codes.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from hybrid.model import HybridLM
from hybrid.pretrained import save_pretrained

SERVING = Path(__file__).resolve().parents[1] / "scripts" / "serving"
# recipe -> the export format llama.cpp's converter reads it from (as benchmarks/llamacpp.py's MODELS)
FORMATS = {"llama-d512": "llama", "mamba2-d512": "mamba2", "hybrid-1to7-d512": "bamba",
           "llama-small": "llama", "mamba2-small": "mamba2", "hybrid-1to7-small": "bamba"}
CONVERTER_TYPES = ("f32", "bf16", "q8_0")


def gguf_type(dtype: str, quantize: str | None) -> str:
    """The llama.cpp type that matches our run: the quantisation's if any, else the dtype's."""
    if quantize in ("int8wo", "int8dq"):
        return "q8_0"
    if quantize in ("int4wo", "8da4w"):
        return "q4_0"
    return {"float32": "f32", "bfloat16": "bf16"}[dtype]


def _run(cmd: list[str], log: Path) -> None:
    with open(log, "w") as f:
        res = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=1800)
    if res.returncode != 0:
        tail = log.read_text()[-800:]
        raise RuntimeError(f"{' '.join(cmd)} failed (log {log}):\n{tail}")


def make_gguf(name: str, model: HybridLM, tree: Path, work: Path, gtype: str, llama_quantize: Path | None) -> Path:
    """``work/name/model-{gtype}.gguf`` of ``model`` (fp32, unquantised: the weights before any rounding), made
    once. ``q4_0`` needs ``llama_quantize``."""
    if name not in FORMATS:
        raise SystemExit(f"--llama-cpp: no llama.cpp format known for recipe {name!r}; llama.cpp is timed on "
                         f"{', '.join(FORMATS)}")
    if next(model.parameters()).dtype != torch.float32:
        raise ValueError("make_gguf takes the fp32 model; llama.cpp's converter does the rounding")
    mdir = work / name
    out = mdir / f"model-{gtype}.gguf"
    if out.is_file():
        return out
    mdir.mkdir(parents=True, exist_ok=True)
    export = mdir / f"export-{FORMATS[name]}"
    if not (export / "config.json").is_file():
        save_pretrained(model, export, format=FORMATS[name])
    base = "f32" if gtype == "q4_0" else gtype
    if base not in CONVERTER_TYPES:
        raise ValueError(f"unknown GGUF type {gtype!r}")
    src = mdir / f"model-{base}.gguf"
    if not src.is_file():
        _run([sys.executable, str(SERVING / "gguf_convert.py"), str(tree), str(export), str(src), "--outtype", base],
             mdir / f"convert-{base}.log")
    if gtype == "q4_0":
        if llama_quantize is None:
            raise SystemExit("Q4_0 needs llama.cpp's llama-quantize: build it (cmake --build BUILD --target "
                             "llama-quantize) and pass --llama-quantize PATH or keep it in DIR/build/bin")
        _run([str(llama_quantize), str(src), str(out), "Q4_0"], mdir / "quantize-q4_0.log")
    return out
