"""Reading and writing Hugging Face style checkpoint folders (config.json + weights)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..checkpoint import CheckpointError

SAFE_SINGLE = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
BIN_SINGLE = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"
# The files a checkpoint's tokenizer and generation defaults live in (copied along by `hybrid convert`).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "tokenizer.model", "vocab.json", "merges.txt")


def read_config(directory: str | Path) -> dict:
    p = Path(directory) / "config.json"
    if not p.is_file():
        raise CheckpointError(f"{directory} has no config.json; a checkpoint folder needs one")
    return json.loads(p.read_text())


def _load_bin(path: Path) -> dict[str, torch.Tensor]:
    # pickle only with weights_only=True: tensors and plain containers, never arbitrary objects
    return torch.load(path, map_location="cpu", weights_only=True)


def read_state(directory: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint: single or sharded safetensors, else pytorch_model.bin (weights_only)."""
    d = Path(directory)
    if (d / SAFE_SINGLE).is_file():
        return load_file(str(d / SAFE_SINGLE))
    for index, loader in ((SAFE_INDEX, lambda p: load_file(str(p))), (BIN_INDEX, _load_bin)):
        if (d / index).is_file():
            weight_map = json.loads((d / index).read_text())["weight_map"]
            state: dict[str, torch.Tensor] = {}
            for shard in sorted(set(weight_map.values())):
                if not (d / shard).is_file():
                    raise CheckpointError(f"{d / index} names shard {shard}, which is missing from {d}")
                state.update(loader(d / shard))
            return state
    if (d / BIN_SINGLE).is_file():
        return _load_bin(d / BIN_SINGLE)
    raise CheckpointError(f"{d} has no weights: expected {SAFE_SINGLE}, {SAFE_INDEX}, {BIN_INDEX} or {BIN_SINGLE}")


def write_checkpoint(directory: str | Path, config: dict, state: dict[str, torch.Tensor]) -> Path:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({k: v.detach().contiguous() for k, v in state.items()}, str(d / SAFE_SINGLE),
              metadata={"format": "pt"})
    return d


def copy_tokenizer_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copy the tokenizer files of checkpoint folder ``src`` into ``dst``; returns the names copied."""
    copied = []
    for name in TOKENIZER_FILES:
        if (Path(src) / name).is_file():
            shutil.copyfile(Path(src) / name, Path(dst) / name)
            copied.append(name)
    return copied
