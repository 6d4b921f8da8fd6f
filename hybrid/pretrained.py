"""The one place checkpoints are loaded and saved: our own format (:mod:`hybrid.checkpoint`) and the
converters of :mod:`hybrid.interop`. It sits above the model (``HybridLM`` imports neither), so the
dependency runs one way: pretrained -> checkpoint / interop -> model."""

from __future__ import annotations

from pathlib import Path

import torch

from .checkpoint import CheckpointError, is_native, load_native, save_native
from .quantized_checkpoint import is_quantized
from .quantized_checkpoint import load as load_quantized
from .quantized_checkpoint import save as save_quantized
from .tokenizer import load_tokenizer


def as_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """A dtype as transformers accepts it: a ``torch.dtype``, its name (``"bfloat16"``, ``"torch.float16"``,
    ``"bf16"``), or ``None`` / ``"auto"`` for the checkpoint's own."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if not isinstance(dtype, str):
        raise TypeError(f"dtype must be a torch.dtype or its name, got {type(dtype).__name__}")
    name = dtype.removeprefix("torch.")
    if name == "auto":
        return None
    name = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}.get(
        name, name)
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(f"dtype {dtype!r} is not a floating-point torch dtype; give e.g. 'float32', 'bfloat16', "
                         "'float16' or 'auto' (the checkpoint's)")
    return value


def _from_gguf(path: Path, *, dtype: torch.dtype | None, device):
    """A GGUF file's model (dequantised) with its tokenizer attached."""
    from .interop import load_gguf
    from .interop.gguf_tokenizer import tokenizer_folder

    model = load_gguf(path, dtype=dtype, device=device)
    with tokenizer_folder(path) as folder:
        model.tokenizer = load_tokenizer(folder) if (folder / "tokenizer.json").is_file() else None
    return model


def from_pretrained(path: str | Path, *, dtype: str | torch.dtype | None = None,
                    device: str | torch.device | None = None, torch_dtype: str | torch.dtype | None = None,
                    verify: bool = True):
    """Load a checkpoint folder: our own format (:func:`save_pretrained`), or a Hugging Face /
    mamba_ssm checkpoint through the converter for its architecture (``hybrid.interop``); or a llama.cpp
    ``.gguf`` file (dequantised to fp32, :mod:`hybrid.interop.gguf_file`); or a model name
    (:data:`hybrid.pretrained_names.NAMED_MODELS`, e.g. ``"smollm2-135m-instruct"``: its converted folder). The
    folder's tokenizer, if it has a ``tokenizer.json``, is attached as ``model.tokenizer``. A folder saved
    from a quantised model loads quantised (its torchao weights as saved; ``model.quantization`` set).
    ``dtype`` (or transformers' older name ``torch_dtype``) is a torch dtype or its name; None or
    ``"auto"`` keeps the checkpoint's. ``verify`` (default on): the weights' checksums where the folder has them
    (``save_pretrained`` writes them) and every weight finite; damage is a CheckpointError naming the file
    (:mod:`hybrid.checkpoint_files`); ``verify=False`` skips both."""
    if torch_dtype is not None:
        if dtype is not None:
            raise ValueError("give dtype or its older name torch_dtype, not both")
        dtype = torch_dtype
    dtype = as_dtype(dtype)
    from .interop import load_foreign
    from .pretrained_names import resolve

    path = Path(resolve(path))
    if path.is_file() and path.suffix == ".gguf":
        return _from_gguf(path, dtype=dtype, device=device)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory; give the checkpoint folder, a .gguf file or a model "
                              "name (hybrid.NAMED_MODELS)")
    if not is_native(path):
        model = load_foreign(path, dtype=dtype, device=device, verify=verify)
    elif is_quantized(path):  # saved from a hybrid.quantize'd model: its torchao weights as they were
        model = load_quantized(path, dtype=dtype, device=device, verify=verify)
    else:
        model = load_native(path, dtype=dtype, device=device, verify=verify)
    # the checkpoint's own tokenizer (tokenizer.json, special tokens from tokenizer_config.json and
    # generation_config.json), or None when the folder has none
    model.tokenizer = load_tokenizer(path) if (path / "tokenizer.json").is_file() else None
    return model


def save_pretrained(model, directory: str | Path, format: str = "hybrid") -> Path:
    """Write ``directory``: ``format="hybrid"`` (ours: config.json + model.safetensors; a model quantised by
    :func:`hybrid.quantize` keeps its torchao weights, see :mod:`hybrid.quantized_checkpoint`) or the name
    of an export format of ``hybrid.interop`` (a checkpoint its home library loads; ``"hf"`` picks
    the first one that is exact; refused for a quantised model)."""
    method = getattr(model, "quantization", None)
    if format == "hybrid":
        return save_native(model, directory) if method is None else save_quantized(model, directory)
    if method is not None:  # before anything is written: a half-written folder would lose nothing but confuse
        raise ValueError(f"save_pretrained(format={format!r}) of a {method}-quantised model is not supported: "
                         f"that format holds unquantised weights. Save it in ours (format='hybrid' keeps the "
                         f"quantisation), or export the model before hybrid.quantize")
    from .interop import export
    return export(model, directory, format)
