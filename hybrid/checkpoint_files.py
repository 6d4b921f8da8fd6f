"""Reading a checkpoint's files so that damage is refused with the file named, never loaded.

What each check catches, cheapest first:

- **JSON** (``config.json``, indexes, the manifest): a parse error names the file and the line.
- **safetensors structure**: the 8-byte header length, the header JSON, every tensor's byte range against its
  dtype and shape, and the data's end against the file's size. A truncated or random file fails here, before
  safetensors maps it.
- **checksums** (our format): ``save_pretrained`` writes ``checksums.json``, the SHA-256 and size of every weights
  file, and loading recomputes them. SHA-256 rather than a per-tensor size/dtype/shape record: that record
  repeats what the structural check already sees, and only a hash of the bytes catches bytes overwritten in
  place with finite values (a flipped exponent bit, a block of another file), which leave the header intact and
  every number finite. It is ``sha256sum``-compatible and costs about a second per GB, small beside loading.
  ``config.json`` is not hashed: people edit it on purpose, and the config is validated when it is parsed.
- **finite values**: every floating-point tensor is checked for NaN / inf (one read of the weights), so damage in a
  folder without checksums (a foreign format, or ours written before checksums) is refused too, as far as it
  made values non-finite.

``verify=False`` (``--no-verify``) skips the checksums and the finite check; the structure is always checked.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from pathlib import Path

import torch


class CheckpointError(ValueError):
    """A checkpoint folder whose files or tensors do not fit the model it describes, or are damaged; the
    message names the file (re-exported by :mod:`hybrid.checkpoint`)."""

MANIFEST_FILE = "checksums.json"
MANIFEST_FORMAT = "hybrid-lm checksums"
SKIP_HINT = "re-save or re-download it (or load with verify=False / --no-verify to skip this check)"
# bytes per element of safetensors' dtype names
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8,
               "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}


def read_json(path: str | Path) -> dict:
    """A JSON object file, or a CheckpointError naming the file and what is wrong with it."""
    path = Path(path)
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise CheckpointError(f"{path} is not text (not UTF-8): the file is damaged or not a JSON file; "
                              f"re-save or re-download it") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); "
                              f"fix or re-download it") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} holds a JSON {type(value).__name__}, not an object of settings; "
                              f"fix or re-download it")
    return value


def check_safetensors(path: str | Path) -> None:
    """The structure of a safetensors file against its size: a CheckpointError naming the file when it is
    truncated, padded, or not a safetensors file at all."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path} is {size} bytes, too short for a safetensors file (truncated or "
                                  f"empty); re-save or re-download it")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise CheckpointError(f"{path} is truncated or not a safetensors file: its header claims {n:,} bytes "
                                  f"but the file holds {size:,}; re-save or re-download it")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
        entries = {k: v for k, v in header.items() if k != "__metadata__"}
        ranges = [(name, e["dtype"], e["shape"], e["data_offsets"]) for name, e in entries.items()]
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError, KeyError, TypeError):
        raise CheckpointError(f"{path} is not a safetensors file (its header is not the JSON table of tensors "
                              f"safetensors writes): the file is damaged; re-save or re-download it") from None
    data = size - 8 - n
    end = 0
    for name, dtype, shape, (begin, stop) in ranges:
        need = DTYPE_BYTES.get(dtype)
        if need is not None and stop - begin != math.prod(shape) * need:
            raise CheckpointError(f"{path}: tensor {name!r} ({dtype} {list(shape)}) spans {stop - begin:,} bytes "
                                  f"instead of {math.prod(shape) * need:,}: the header is damaged; "
                                  f"re-save or re-download it")
        end = max(end, stop)
    if end > data:
        raise CheckpointError(f"{path} is truncated: its tensors need {end:,} bytes of data after the header, the "
                              f"file holds {data:,}; re-save or re-download it")
    if end < data:
        raise CheckpointError(f"{path} has {data - end:,} bytes past its last tensor: the file is damaged or was "
                              f"appended to; re-save or re-download it")


def load_safetensors(path: str | Path, *, device: str = "cpu", verify: bool = True) -> dict[str, torch.Tensor]:
    """All tensors of one safetensors file, its structure checked first and (``verify``) every value finite."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    check_safetensors(path)
    try:
        state = load_file(str(path), device=device)
    except SafetensorError as e:
        raise CheckpointError(f"{path} cannot be read by safetensors ({e}); re-save or re-download it") from None
    if verify:
        check_finite(state, path)
    return state


def load_torch_bin(path: str | Path, *, verify: bool = True) -> dict[str, torch.Tensor]:
    """A ``pytorch_model.bin``: tensors and plain containers only (``weights_only``), load errors naming it."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated zip, a pickle of objects: torch names neither the file nor the fix
        raise CheckpointError(f"{path} cannot be read as PyTorch weights ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else 'no detail'}); re-save or re-download it") \
            from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds a {type(state).__name__}, not a dict of tensors")
    if verify:
        check_finite(state, path)
    return state


def check_finite(state: dict[str, torch.Tensor], path: str | Path) -> None:
    """A CheckpointError naming ``path`` and the first floating-point tensor holding NaN or inf."""
    for name, t in state.items():
        if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise CheckpointError(f"{path}: tensor {name!r} holds {bad:,} NaN/inf value(s) of {t.numel():,}: the "
                                  f"file is damaged; {SKIP_HINT}")


def file_sha256(path: str | Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_manifest(directory: str | Path, names: list[str]) -> Path:
    """``checksums.json`` beside the files ``names`` of ``directory``: size and SHA-256 of each."""
    directory = Path(directory)
    files = {n: {"bytes": (directory / n).stat().st_size, "sha256": file_sha256(directory / n)} for n in names}
    path = directory / MANIFEST_FILE
    path.write_text(json.dumps({"format": MANIFEST_FORMAT, "files": files}, indent=2) + "\n")
    return path


def verify_manifest(directory: str | Path) -> bool:
    """Check every file ``checksums.json`` lists (size, then SHA-256); False when the folder has no manifest
    (written before checksums, or by another library), a CheckpointError naming the first file that differs."""
    directory = Path(directory)
    path = directory / MANIFEST_FILE
    if not path.is_file():
        return False
    manifest = read_json(path)
    files = manifest.get("files")
    if manifest.get("format") != MANIFEST_FORMAT or not isinstance(files, dict):
        raise CheckpointError(f"{path} is not a hybrid-lm checksum list (format {manifest.get('format')!r}); "
                              f"delete it or re-save the checkpoint")
    for name, want in files.items():
        file = directory / name
        if not file.is_file():
            raise CheckpointError(f"{file} is missing (listed in {MANIFEST_FILE}); re-save or re-download it")
        size = file.stat().st_size
        if size != want.get("bytes"):
            raise CheckpointError(f"{file} is {size:,} bytes, {MANIFEST_FILE} says {want.get('bytes'):,}: the file "
                                  f"is truncated or was replaced; {SKIP_HINT}")
        if file_sha256(file) != want.get("sha256"):
            raise CheckpointError(f"{file} does not match its SHA-256 in {MANIFEST_FILE}: its bytes changed after "
                                  f"it was saved (damaged on disk or in a copy); {SKIP_HINT}")
    return True
