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
    # Import (optional): settle what only the tensors tell, (ours, foreign state, foreign config) -> ours;
    # e.g. whether a head equal to the embedding is a tie.
    config_from_state: Callable[[HybridConfig, dict, dict], HybridConfig] | None = None
    # the options of EXTENSIONS this format represents; export refuses the others, so a converter written
    # before an option existed never writes a model that uses it as if it did not
    extensions: tuple[str, ...] = ()


# Options added after most converters: name -> whether a config uses it (in a section its pattern uses).
EXTENSIONS: dict[str, Callable[[HybridConfig], bool]] = {
    "norm_offset": lambda c: c.norm_offset != 0.0,
    "attention.output_gate": lambda c: "*" in c.pattern and c.attention.output_gate,
    "attention.qk_norm": lambda c: "*" in c.pattern and c.attention.qk_norm,
    "moe.shared_d_ff": lambda c: "E" in c.pattern and c.moe.shared_d_ff > 0,
}


def export_problem(conv: Converter, config: HybridConfig) -> str | None:
    """Why ``conv``'s format cannot write ``config`` exactly (None: it can)."""
    used = [name for name, uses in EXTENSIONS.items() if uses(config) and name not in conv.extensions]
    if used:
        return f"the model uses {', '.join(used)}, which the {conv.name} format does not represent"
    return conv.export_refusal(config) if conv.export_refusal else None


CONVERTERS: dict[str, Converter] = {}  # by architecture name
FORMATS: dict[str, Converter] = {}  # by export format name
# converter modules in this package
_MODULES: tuple[str, ...] = ("llama", "mamba", "mamba_ssm", "bamba", "granitemoehybrid", "nemotron_h", "jamba",
                             "qwen3_next")
# format="hf" tries these in order and takes the first that represents the model exactly; formats not
# listed come after, alphabetically. The order is what the serving engines load: formats vLLM serves
# and llama.cpp converts come first (llama, mistral, qwen2, mamba2, mamba, nemotron_h, and
# granitemoehybrid for the Mamba-2 hybrids with SwiGLU MLPs), then bamba (the same weights; transformers
# loads it, vLLM 0.32 does not), then jamba (vLLM's CPU build cannot run its Mamba-1 layers).
HF_PREFERENCE: tuple[str, ...] = ("llama", "mistral", "qwen2", "mamba2", "mamba", "nemotron_h", "granitemoehybrid",
                                  "bamba", "jamba")


def register(conv: Converter) -> Converter:
    for arch in conv.architectures:
        CONVERTERS[arch] = conv
    if conv.config_to_hf is not None:
        FORMATS[conv.name] = conv
    return conv


def _ensure_loaded() -> None:
    for mod in _MODULES:
        importlib.import_module(f"{__name__}.{mod}")


def export_formats() -> list[str]:
    """Names ``save_pretrained(format=...)`` accepts besides "hybrid" and "hf"."""
    _ensure_loaded()
    return sorted(FORMATS)


def architecture_of(hf_config: dict) -> str:
    archs = hf_config.get("architectures") or []
    if archs:
        return archs[0]
    if {"d_model", "n_layer"} <= set(hf_config):  # mamba_ssm's MambaConfig has no "architectures"
        return MAMBA_SSM
    raise CheckpointError("config.json names no architecture (no 'architectures' list) and is not a "
                          "mamba_ssm config (d_model, n_layer); cannot tell how to load it")


def load_foreign(path: str | Path, *, dtype: torch.dtype | None = None,
                 device: str | torch.device | None = None, verify: bool = True):
    """Load a Hugging Face or mamba_ssm checkpoint folder as a ``HybridLM`` (``verify``: every weight finite)."""
    hf = read_config(path)
    # a config we refuse is named before any weights are read
    conv, cfg = converter_config(hf, str(Path(path) / "config.json"))
    return model_from_hf(conv, cfg, hf, read_state(path, verify=verify), str(path), dtype=dtype, device=device)


def load_gguf(path: str | Path, *, dtype: torch.dtype | None = None, device: str | torch.device | None = None,
              progress: bool = True):
    """Load a llama.cpp GGUF file as a ``HybridLM`` (dequantised; see :mod:`.gguf_file`)."""
    from .gguf_file import read_gguf

    hf, state = read_gguf(path, progress=progress)
    conv, cfg = converter_config(hf, str(path))
    return model_from_hf(conv, cfg, hf, state, str(path), dtype=dtype, device=device)


def converter_config(hf: dict, where: str) -> tuple[Converter, HybridConfig]:
    """The converter for a transformers config dict's architecture and our config from it; ``where`` names
    the source in errors."""
    _ensure_loaded()
    arch = architecture_of(hf)
    conv = CONVERTERS.get(arch)
    if conv is None:
        raise CheckpointError(f"architecture {arch!r} is not supported; supported: {sorted(CONVERTERS)}")
    try:
        return conv, conv.config_from_hf(hf)
    except KeyError as e:
        raise CheckpointError(f"{where} ({arch}): the config lacks the required key {e}") from None


def model_from_hf(conv: Converter, cfg: HybridConfig, hf: dict, foreign: dict, where: str, *,
                  dtype: torch.dtype | None = None, device: str | torch.device | None = None):
    """A ``HybridLM`` from a transformers state dict, by ``conv`` (see :func:`converter_config`)."""
    from ..model import HybridLM

    if conv.config_from_state is not None:
        cfg = conv.config_from_state(cfg, foreign, hf)
    state = conv.state_from_hf(foreign, hf, cfg)
    with torch.device("meta"):
        model = HybridLM(cfg)
    if device is not None:
        state = {k: v.to(device) for k, v in state.items()}
    load_state_strict(model, state, f"{where} ({architecture_of(hf)})")
    if dtype is not None:
        model.to(dtype)
    return model.eval()


def export(model, directory: str | Path, fmt: str) -> Path:
    """Write ``model`` as a checkpoint of format ``fmt`` (a converter name) that its home library loads."""
    _ensure_loaded()
    if fmt == "hf":
        fmt = pick_hf_format(model.config)
    conv = FORMATS.get(fmt)
    if conv is None:
        raise CheckpointError(f"unknown export format {fmt!r}; known: {sorted(FORMATS)} (or 'hybrid', 'hf')")
    why_not = export_problem(conv, model.config)
    if why_not:
        raise CheckpointError(f"cannot export this model as {fmt!r} exactly: {why_not}")
    state = {k: v.detach() for k, v in model.state_dict().items()}
    hf_config = conv.config_to_hf(model.config)
    # what transformers loads the weights as by default: the embedding's dtype (the model's, bar fp32 SSM params)
    hf_config.setdefault("dtype", str(model.embed.weight.dtype).removeprefix("torch."))
    return write_checkpoint(directory, hf_config, conv.state_to_hf(state, model.config))


def pick_hf_format(config: HybridConfig) -> str:
    """The first export format (in :data:`HF_PREFERENCE` order) that represents ``config`` exactly, or an
    error giving each format's reason."""
    _ensure_loaded()
    order = [f for f in HF_PREFERENCE if f in FORMATS] + sorted(set(FORMATS) - set(HF_PREFERENCE))
    reasons = {}
    for fmt in order:
        why_not = export_problem(FORMATS[fmt], config)
        if not why_not:
            return fmt
        reasons[fmt] = why_not
    lines = "\n  ".join(f"{f}: {r}" for f, r in reasons.items())
    raise CheckpointError(f"no Hugging Face format represents this model exactly:\n  {lines}")


__all__ = ["CONVERTERS", "EXTENSIONS", "FORMATS", "MAMBA_SSM", "Converter", "architecture_of", "export",
           "export_formats", "export_problem", "converter_config", "load_foreign", "load_gguf", "model_from_hf",
           "pick_hf_format", "register", "read_config", "read_state", "write_checkpoint"]
