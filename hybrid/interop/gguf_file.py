"""llama.cpp's GGUF files -> a Hugging Face config dict and state dict, which the converter for that
architecture (:mod:`hybrid.interop.llama`, :mod:`hybrid.interop.mamba`) turns into a ``HybridLM``.

The file's layout is read by :mod:`hybrid.interop.gguf_reader` (llama.cpp's ``gguf.GGUFReader`` takes
seconds to open a file with a large vocabulary), its tensors dequantised to fp32 by llama.cpp's
``gguf.quants.dequantize`` (every type it implements: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_*, the K-quants,
the IQ types, ...; the others are refused by name). The tensor names are llama.cpp's (``gguf.TENSOR_NAMES``),
mapped back to the names transformers uses, and what llama.cpp's converter (``convert_hf_to_gguf.py``) changed
on the way in is undone:

- ``llama``: the q and k rows (weights and biases) are permuted from the HF rotary layout (halves) to
  llama.cpp's interleaved pairs, per head (``LlamaModel.permute``); :func:`unpermute_rows` inverts it,
  as transformers' GGUF loader does.
- ``qwen2``: written as is (no permutation), with q/k/v biases.

Other architectures are refused by name; so are GGUF options the converters cannot run exactly (a RoPE
frequency table, partial rotary dimensions, a scaling type we do not implement).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..checkpoint import CheckpointError


def _gguf():
    try:
        import gguf
    except ImportError:
        raise CheckpointError("reading a GGUF file needs llama.cpp's reader: pip install gguf "
                              "(or pip install 'hybrid-lm[hf]')") from None
    return gguf


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` is a GGUF file (by its magic bytes, so a misnamed file is still recognised)."""
    p = Path(path)
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == b"GGUF"


class GGUFFile:
    """One GGUF file's metadata and tensors (memory-mapped; :mod:`hybrid.interop.gguf_reader` reads the layout, the
    ``gguf`` package dequantises)."""

    def __init__(self, path: str | Path):
        _gguf()
        from .gguf_reader import GGUFFormatError, GGUFMetadata

        self.path = Path(path)
        if not is_gguf(self.path):
            raise CheckpointError(f"{self.path} is not a GGUF file (no GGUF magic at its start)")
        try:
            self.reader = GGUFMetadata(self.path)
        except (GGUFFormatError, OSError) as e:
            raise CheckpointError(f"{self.path}: not a readable GGUF file ({e}); download or convert it "
                                  "again") from None
        self.arch = self.get("general.architecture")
        if self.arch is None:
            raise CheckpointError(f"{self.path}: the GGUF metadata has no general.architecture")

    def get(self, key: str, default=None):
        """A metadata value (str, number, or list of them), or ``default`` when the file lacks ``key``."""
        return self.reader.get(key, default)

    def arch_key(self, suffix: str, default=None):
        """``{architecture}.{suffix}``: llama.cpp prefixes the model's hyperparameters with its arch name."""
        return self.get(f"{self.arch}.{suffix}", default)

    def tensor_names(self) -> list[str]:
        return [t.name for t in self.reader.tensors]

    def tensors(self, progress: bool = True):
        """(name, fp32 numpy array in PyTorch's [out, in] order) for every tensor, dequantised."""
        from gguf.quants import dequantize
        from tqdm import tqdm

        for t in tqdm(self.reader.tensors, desc=f"dequantise {self.path.name}", unit="tensor", disable=not progress,
                      leave=False):
            try:
                values = dequantize(t.data, t.tensor_type)
            except NotImplementedError:
                raise CheckpointError(f"{self.path}: tensor {t.name} has GGUF type {t.tensor_type.name}, which "
                                      f"gguf.quants cannot dequantise; re-quantise the file to a supported type "
                                      f"(F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, K-quants)") from None
            yield t.name, np.asarray(values, dtype=np.float32)


@dataclass(frozen=True)
class GGUFArch:
    """How one llama.cpp architecture maps back to transformers'."""

    name: str  # llama.cpp's general.architecture
    hf_architecture: str  # the transformers class its converter in hybrid.interop reads
    config: Callable[[GGUFFile, list[str]], dict]  # (file, tensor names) -> transformers config dict
    top_names: dict[str, str]  # llama.cpp stem -> transformers' module (token_embd -> model.embed_tokens)
    layer_prefix: str  # transformers' prefix of layer i's modules, "{prefix}.{i}."
    # llama.cpp per-layer stem -> transformers' module under the prefix (its .weight / .bias follows), or a
    # whole name ("ssm_a" -> "mixer.A_log": llama.cpp writes some tensors without a suffix; "ssm_dt.bias" ->
    # "mixer.dt_bias": one tensor whose name differs from its module's siblings)
    layer_names: dict[str, str]
    # (transformers' name, values, config) -> values as transformers stores them (undoing llama.cpp's changes)
    restore: Callable[[str, np.ndarray, dict], np.ndarray] = staticmethod(lambda name, values, hf: values)
    # llama.cpp stems that have a reason to be refused (shown in the error)
    refused: tuple[tuple[str, str], ...] = ()

    def hf_name(self, name: str) -> str:
        """transformers' name for llama.cpp tensor ``name`` (``blk.3.attn_q.weight``), or a refusal naming it."""
        parts = name.split(".")
        kind = parts.pop() if parts[-1] in ("weight", "bias") else None
        suffix = f".{kind}" if kind else ""
        stem = ".".join(parts)
        if len(parts) == 1 and stem in self.top_names:
            return f"{self.top_names[stem]}{suffix}"
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
            if kind is not None and f"{parts[2]}{suffix}" in self.layer_names:  # a whole name
                return f"{self.layer_prefix}.{parts[1]}.{self.layer_names[parts[2] + suffix]}"
            if kind is None and parts[2] in self.layer_names:  # llama.cpp wrote it without a suffix
                return f"{self.layer_prefix}.{parts[1]}.{self.layer_names[parts[2]]}"
            if kind is not None and parts[2] in self.layer_names:
                return f"{self.layer_prefix}.{parts[1]}.{self.layer_names[parts[2]]}{suffix}"
        why = dict(self.refused).get(stem)
        raise CheckpointError(f"GGUF {self.name}: tensor {name!r} has no counterpart in the {self.hf_architecture} "
                              f"converter{f' ({why})' if why else ''}; refusing to load a model without it")


ARCHITECTURES: dict[str, GGUFArch] = {}  # by llama.cpp name, filled by the modules in _MODULES
_MODULES = ("gguf_llama", "gguf_mamba")


def register(arch: GGUFArch) -> GGUFArch:
    ARCHITECTURES[arch.name] = arch
    return arch


def supported() -> list[str]:
    """The llama.cpp architectures :func:`read_gguf` reads."""
    for mod in _MODULES:
        importlib.import_module(f"{__package__}.{mod}")
    return sorted(ARCHITECTURES)


def require(f: GGUFFile, *keys: str) -> None:
    """Refuse a file whose metadata lacks any of ``{arch}.{key}``, naming them."""
    missing = [f"{f.arch}.{k}" for k in keys if f.arch_key(k) is None]
    if missing:
        raise CheckpointError(f"{f.path}: the GGUF metadata lacks {', '.join(missing)}")


def vocab_size(f: GGUFFile) -> int:
    """The vocabulary: the embedding's rows (llama.cpp pads some vocabularies past the tokenizer's)."""
    embed = next((t for t in f.reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise CheckpointError(f"{f.path}: the GGUF file has no token_embd.weight")
    return int(embed.shape[-1])


def special_ids(f: GGUFFile) -> dict:
    """bos / eos / pad token ids of the file's tokenizer metadata, as transformers config keys."""
    out = {}
    for key, tok in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding")):
        if f.get(f"tokenizer.ggml.{tok}_token_id") is not None:
            out[key] = int(f.get(f"tokenizer.ggml.{tok}_token_id"))
    return out


def read_gguf(path: str | Path, *, progress: bool = True) -> tuple[dict, dict[str, torch.Tensor]]:
    """(transformers config dict, transformers-named fp32 state dict) of a GGUF file."""
    f = GGUFFile(path)
    known = supported()
    if f.arch not in ARCHITECTURES:
        raise CheckpointError(f"{f.path}: GGUF architecture {f.arch!r} is not supported; supported: "
                              f"{', '.join(known)}")
    arch = ARCHITECTURES[f.arch]
    names = f.tensor_names()
    hf = arch.config(f, names)
    for name in names:  # refuse an unknown tensor before any dequantising
        arch.hf_name(name)
    state = {}
    for name, values in f.tensors(progress=progress):
        hf_name = arch.hf_name(name)
        # a writable, contiguous fp32 copy (the reader's arrays are read-only views of the mapped file)
        state[hf_name] = torch.from_numpy(np.array(arch.restore(hf_name, values, hf), dtype=np.float32))
    return hf, state
