"""Reading and writing Hugging Face style checkpoint folders (config.json + weights)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..checkpoint import CheckpointError
from ..checkpoint_files import load_safetensors, load_torch_bin, read_json

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
    return read_json(p)


def read_state(directory: str | Path, *, verify: bool = True) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint: single or sharded safetensors, else pytorch_model.bin (pickle only
    ``weights_only``: tensors and plain containers, never arbitrary objects). Each file's structure is checked
    as far as its format allows (safetensors: header against file size) and, with ``verify``, every value is
    finite; a damaged file is a CheckpointError naming it."""
    d = Path(directory)

    def safetensors(p):
        return load_safetensors(p, verify=verify)

    def torch_bin(p):
        return load_torch_bin(p, verify=verify)

    if (d / SAFE_SINGLE).is_file():
        return safetensors(d / SAFE_SINGLE)
    for index, loader in ((SAFE_INDEX, safetensors), (BIN_INDEX, torch_bin)):
        if (d / index).is_file():
            weight_map = read_json(d / index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{d / index} has no 'weight_map' (tensor name -> shard file); "
                                      f"fix or re-download it")
            state: dict[str, torch.Tensor] = {}
            for shard in sorted(set(weight_map.values())):
                if not (d / shard).is_file():
                    raise CheckpointError(f"{d / index} names shard {shard}, which is missing from {d}")
                state.update(loader(d / shard))
            return state
    if (d / BIN_SINGLE).is_file():
        return torch_bin(d / BIN_SINGLE)
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
