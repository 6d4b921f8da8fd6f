"""Checkpoint interop: load Hugging Face / mamba_ssm checkpoints as ``HybridLM`` and export back.

A converter knows one family of architectures. It maps the foreign config to a
:class:`~hybrid.HybridConfig` (refusing, with a message naming it, any option we do not implement
exactly) and renames/reshapes the weights; where it can, it also exports a ``HybridLM`` back to its
format. Converters register themselves in :data:`CONVERTERS` (modules listed in ``_MODULES``,
imported on first use).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoint import CheckpointError, load_state_strict
from ..config import HybridConfig
from .io import read_config, read_state, write_checkpoint

MAMBA_SSM = "mamba_ssm"  # pseudo-architecture name for mamba_ssm's MambaLMHeadModel folders


@dataclass(frozen=True)
class Converter:
    name: str  # export format name, e.g. "llama"
    architectures: tuple[str, ...]  # config.json "architectures" values it reads
    config_from_hf: Callable[[dict], HybridConfig]
    state_from_hf: Callable[[dict, dict, HybridConfig], dict]  # (foreign state, foreign config, ours)
    # Export (optional): why this config cannot be written exactly (None: it can), and the writers.
    export_refusal: Callable[[HybridConfig], str | None] | None = None
    config_to_hf: Callable[[HybridConfig], dict] | None = None
    state_to_hf: Callable[[dict, HybridConfig], dict] | None = None


CONVERTERS: dict[str, Converter] = {}  # by architecture name
FORMATS: dict[str, Converter] = {}  # by export format name
_MODULES: tuple[str, ...] = ("bamba", "nemotron_h", "jamba")  # converter modules in this package


def register(conv: Converter) -> Converter:
    for arch in conv.architectures:
        CONVERTERS[arch] = conv
    if conv.config_to_hf is not None:
        FORMATS[conv.name] = conv
    return conv


def _ensure_loaded() -> None:
    for mod in _MODULES:
        importlib.import_module(f"{__name__}.{mod}")


def architecture_of(hf_config: dict) -> str:
    archs = hf_config.get("architectures") or []
    if archs:
        return archs[0]
    if {"d_model", "n_layer"} <= set(hf_config):  # mamba_ssm's MambaConfig has no "architectures"
        return MAMBA_SSM
    raise CheckpointError("config.json names no architecture (no 'architectures' list) and is not a "
                          "mamba_ssm config (d_model, n_layer); cannot tell how to load it")


def load_foreign(path: str | Path, *, dtype: torch.dtype | None = None,
                 device: str | torch.device | None = None):
    """Load a Hugging Face or mamba_ssm checkpoint folder as a ``HybridLM``."""
    from ..model import HybridLM

    _ensure_loaded()
    hf = read_config(path)
    arch = architecture_of(hf)
    conv = CONVERTERS.get(arch)
    if conv is None:
        raise CheckpointError(f"architecture {arch!r} is not supported; supported: {sorted(CONVERTERS)}")
    cfg = conv.config_from_hf(hf)
    state = conv.state_from_hf(read_state(path), hf, cfg)
    with torch.device("meta"):
        model = HybridLM(cfg)
    if device is not None:
        state = {k: v.to(device) for k, v in state.items()}
    load_state_strict(model, state, f"{path} ({arch})")
    if dtype is not None:
        model.to(dtype)
    return model.eval()


def export(model, directory: str | Path, fmt: str) -> Path:
    """Write ``model`` as a checkpoint of format ``fmt`` (a converter name) that its home library loads."""
    _ensure_loaded()
    conv = FORMATS.get(fmt)
    if conv is None:
        raise CheckpointError(f"unknown export format {fmt!r}; known: {sorted(FORMATS)} (or 'hybrid')")
    why_not = conv.export_refusal(model.config) if conv.export_refusal else None
    if why_not:
        raise CheckpointError(f"cannot export this model as {fmt!r} exactly: {why_not}")
    state = {k: v.detach() for k, v in model.state_dict().items()}
    return write_checkpoint(directory, conv.config_to_hf(model.config), conv.state_to_hf(state, model.config))


__all__ = ["CONVERTERS", "FORMATS", "MAMBA_SSM", "Converter", "architecture_of", "export", "load_foreign",
           "register", "read_config", "read_state", "write_checkpoint"]
