"""Native save/load: ``config.json`` (the HybridConfig, tagged with our format) + ``model.safetensors``."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from .checkpoint_files import CheckpointError, load_safetensors, read_json, verify_manifest, write_manifest
from .config import HybridConfig

FORMAT_TAG = "hybrid-lm"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def save_native(model, directory: str | Path) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cfg = {"format": FORMAT_TAG, **model.config.to_dict()}
    (directory / CONFIG_FILE).write_text(json.dumps(cfg, indent=2) + "\n")
    # safetensors refuses aliased tensors; tied models have no lm_head entry, so nothing is shared.
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(directory / WEIGHTS_FILE), metadata={"format": "pt", "library": FORMAT_TAG})
    write_manifest(directory, [WEIGHTS_FILE])
    return directory


def is_native(directory: str | Path) -> bool:
    p = Path(directory) / CONFIG_FILE
    return p.is_file() and read_json(p).get("format") == FORMAT_TAG


def read_native_config(directory: str | Path) -> HybridConfig:
    raw = read_json(Path(directory) / CONFIG_FILE)
    raw.pop("format", None)
    raw.pop("quantization", None)  # hybrid.quantized_checkpoint's section, not part of the architecture
    return HybridConfig.from_dict(raw)


def load_state_strict(model: torch.nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Load ``state`` into ``model`` in place, or raise one error listing every missing,
    unexpected and mis-shaped tensor."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    shapes = sorted(f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(expected[k].shape)}"
                    for k in set(state) & set(expected) if state[k].shape != expected[k].shape)
    if missing or unexpected or shapes:
        parts = []
        for title, items in (("missing tensors", missing), ("unexpected tensors", unexpected),
                             ("shape mismatches", shapes)):
            if items:
                parts.append(f"{title} ({len(items)}): " + ", ".join(items))
        raise CheckpointError(f"{source} does not match the model config:\n  " + "\n  ".join(parts))
    model.load_state_dict(state, strict=True, assign=True)


def empty_model(directory: Path, *, verify: bool = True):
    """The folder's HybridLM on the meta device (no memory), its files checked first (``verify``: against
    ``checksums.json`` too, where the folder has one)."""
    from .model import HybridLM

    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (directory / name).is_file():
            raise CheckpointError(f"{directory} has no {name}; a hybrid-lm checkpoint folder holds "
                                  f"{CONFIG_FILE} and {WEIGHTS_FILE} (written by save_pretrained)")
    config = read_native_config(directory)
    if verify:
        verify_manifest(directory)
    with torch.device("meta"):
        return HybridLM(config)


def load_native(directory: str | Path, *, dtype: torch.dtype | None = None,
                device: str | torch.device | None = None, verify: bool = True):
    """Our format; ``verify``: the weights' checksums (where saved) and finite values checked (see
    :mod:`hybrid.checkpoint_files`)."""
    directory = Path(directory)
    model = empty_model(directory, verify=verify)
    state = load_safetensors(directory / WEIGHTS_FILE, device=str(device) if device is not None else "cpu",
                             verify=verify)
    load_state_strict(model, state, str(directory / WEIGHTS_FILE))
    if dtype is not None:
        model.to(dtype)
    return model.eval()

