"""The text of ``hybrid doctor``: package versions, the Triton interpreter state, and per device
type each op's chosen backend with the reason every other backend was not chosen."""

from __future__ import annotations

import importlib.metadata
import os

import torch

from . import cuda_backend, dispatch, host_memory, native, triton_support


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def report() -> str:
    lines = ["# packages"]
    cuda = f", CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}" if torch.cuda.is_available() else \
        ", no CUDA device"
    lines.append(f"torch: {torch.__version__}{cuda}")
    triton_note = triton_support.probe()
    lines.append(f"triton: {_version('triton')}" + (f" ({triton_note})" if triton_note else ""))
    lines += [f"{dist}: {note}" for dist, note in cuda_backend.versions().items()]
    mode = "run by the interpreter on the CPU" if triton_support.INTERPRET else "compiled for the GPU"
    lines.append(f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '<unset>')} (Triton kernels {mode})")
    native_note = native.available()
    lines.append("native CPU decode kernels (kernels/native: products, state steps, paged attention, fused "
                 "sub-layers, the Mamba-1 scan): "
                 + ("in use" if native_note is None else f"not in use ({native_note}); torch runs"))
    if native_note is None:
        lines.append(f"native library: {native.variant()} (prebuilt per instruction set, kernels/native/variants.py; "
                     f"the best this CPU runs unless {native.VARIANT_ENV} names one)")
        lines.append("native instruction paths: " + (", ".join(native.cpu_paths()) or "portable C only"))
        lines.append("decode weights moved onto 2 MiB pages: " + host_memory.huge_pages_note())
    forced = os.environ.get("HYBRID_BACKEND")
    lines.append(f"HYBRID_BACKEND={forced or '<unset>'}")
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        lines += ["", f"# ops on {device} (default order {', '.join(dispatch.DEFAULT_ORDER[device])})"]
        rows = dispatch.explain(device)
        width = max(len(op) for op, _, _ in rows)
        for op, chosen, notes in rows:
            lines.append(f"{op:<{width}}  -> {chosen:<6}  {notes}")
    return "\n".join(lines)
