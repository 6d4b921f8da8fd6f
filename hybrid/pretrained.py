"""The one place checkpoints are loaded and saved: our own format (:mod:`hybrid.checkpoint`) and the
converters of :mod:`hybrid.interop`. It sits above the model (``HybridLM`` imports neither), so the
dependency runs one way: pretrained -> checkpoint / interop -> model."""

from __future__ import annotations

from pathlib import Path

import torch

from .checkpoint import CheckpointError, is_native, load_native, save_native
from .tokenizer import load_tokenizer


def from_pretrained(path: str | Path, *, dtype: torch.dtype | None = None,
                    device: str | torch.device | None = None):
    """Load a checkpoint folder: our own format (:func:`save_pretrained`), or a Hugging Face /
    mamba_ssm checkpoint through the converter for its architecture (``hybrid.interop``). The
    folder's tokenizer, if it has a ``tokenizer.json``, is attached as ``model.tokenizer``."""
    from .interop import load_foreign

    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory; give the checkpoint folder")
    model = load_native(path, dtype=dtype, device=device) if is_native(path) else \
        load_foreign(path, dtype=dtype, device=device)
    # the checkpoint's own tokenizer (tokenizer.json, special tokens from tokenizer_config.json and
    # generation_config.json), or None when the folder has none
    model.tokenizer = load_tokenizer(path) if (path / "tokenizer.json").is_file() else None
    return model


def save_pretrained(model, directory: str | Path, format: str = "hybrid") -> Path:
    """Write ``directory``: ``format="hybrid"`` (ours: config.json + model.safetensors) or the name
    of an export format of ``hybrid.interop`` (a checkpoint its home library loads; ``"hf"`` picks
    the first one that is exact)."""
    if format == "hybrid":
        return save_native(model, directory)
    from .interop import export
    return export(model, directory, format)
