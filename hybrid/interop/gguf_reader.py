"""A GGUF file's key/value metadata and tensor table, read straight from the mapped file (the layout of ggml's
``docs/gguf.md``, versions 2 and 3, either byte order).

Why not ``gguf.GGUFReader`` (llama.cpp's own reader, which this package otherwise uses for the format's
constants and dequantisers): it builds a numpy view for every element of every array field when it opens a file,
and a tokenizer's vocabulary and merges are ~100K strings, so opening SmolLM2-135M's GGUF took 12 s on one Zen
core, paid again by every reader of the file (the converter opened it four times). Here an array of strings is
one pass over its length prefixes, decoded only when its value is asked for; an array of numbers is one
``np.frombuffer``. Values come back as ``GGUFReader``'s ``ReaderField.contents()`` gives them (str, int, float,
bool, or a list of them), and tensor data as the same memory-mapped numpy arrays (dtype and shape) its
``ReaderTensor.data`` holds, which ``gguf.quants.dequantize`` takes unchanged.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# GGUF value types (gguf.GGUFValueType): struct code of each scalar
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# tensor types stored as plain numbers (GGUFReader's dtypes); every other type is blocks of bytes
_PLAIN = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
          "I32": np.int32, "I64": np.int64}


class GGUFFormatError(ValueError):
    """The file is not a GGUF file this reader understands (message says where and why)."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # ggml's order: the fastest-varying dimension first (GGUFReader's ReaderTensor.shape)
    data: np.ndarray  # read-only view of the mapped file, as GGUFReader's ReaderTensor.data


class _Lazy:
    """An array field's value, decoded when first asked for."""

    def __init__(self, decode):
        self._decode, self._value = decode, None

    def value(self):
        if self._decode is not None:
            self._value, self._decode = self._decode(), None
        return self._value


class GGUFMetadata:
    """Metadata (``get``) and tensor table (``tensors``) of one GGUF file, memory-mapped while the object lives."""

    def __init__(self, path: str | Path):
        import gguf  # the format's tensor types and block sizes

        self.path = Path(path)
        with open(self.path, "rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as e:  # an empty file
                raise GGUFFormatError(f"empty file ({e})") from None
        buf = self._buf = memoryview(self._map)
        if bytes(buf[:4]) != MAGIC:
            raise GGUFFormatError("no GGUF magic at the start")
        self._end = "<"
        (version,) = struct.unpack_from("<I", buf, 4)
        if version & 0xFFFF == 0:  # written on a machine of the other byte order
            self._end = ">"
            (version,) = struct.unpack_from(">I", buf, 4)
        if version not in VERSIONS:
            raise GGUFFormatError(f"GGUF version {version}; this reader takes versions {VERSIONS}")
        self.version = version
        n_tensors, n_kv = self._unpack("QQ", 8)
        offset = 24
        self._fields: dict[str, object] = {}
        for _ in range(n_kv):
            key, offset = self._string(offset)
            (vtype,), offset = self._unpack("I", offset), offset + 4
            self._fields[key], offset = self._value(vtype, offset, key)
        infos = []
        for _ in range(n_tensors):
            name, offset = self._string(offset)
            (n_dims,) = self._unpack("I", offset)
            dims = self._unpack("Q" * n_dims, offset + 4)
            ttype, rel = self._unpack("IQ", offset + 4 + 8 * n_dims)
            offset += 4 + 8 * n_dims + 12
            infos.append((name, dims, ttype, rel))
        alignment = self.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise GGUFFormatError(f"general.alignment={alignment!r} is not a power of two")
        self.data_offset = -(-offset // alignment) * alignment
        self.tensors = []
        seen = set()
        for name, dims, ttype, rel in infos:
            if name in seen:
                raise GGUFFormatError(f"tensor {name} appears twice")
            seen.add(name)
            try:
                qtype = gguf.GGMLQuantizationType(ttype)
            except ValueError:
                raise GGUFFormatError(f"tensor {name} has unknown GGML type {ttype}") from None
            self.tensors.append(TensorInfo(name, qtype, tuple(int(d) for d in dims),
                                           self._tensor_data(gguf, name, dims, qtype, self.data_offset + rel)))

    def get(self, key: str, default=None):
        """A metadata value (str, int, float, bool, or a list of them), or ``default`` when the file lacks ``key``."""
        if key not in self._fields:
            return default
        value = self._fields[key]
        return value.value() if isinstance(value, _Lazy) else value

    def keys(self) -> list[str]:
        return list(self._fields)

    # ---- the layout ------------------------------------------------------------------------------------------
    def _unpack(self, fmt: str, offset: int) -> tuple:
        try:
            return struct.unpack_from(self._end + fmt, self._buf, offset)
        except struct.error:
            raise GGUFFormatError(f"truncated at byte {offset}") from None

    def _string(self, offset: int) -> tuple[str, int]:
        (n,) = self._unpack("Q", offset)
        start = offset + 8
        if start + n > len(self._buf):
            raise GGUFFormatError(f"a string at byte {offset} runs past the end of the file")
        return str(self._buf[start:start + n], "utf-8", errors="replace"), start + n

    def _value(self, vtype: int, offset: int, key: str):
        """(value, offset after it); arrays as _Lazy."""
        if vtype in _SCALARS:
            (v,) = self._unpack(_SCALARS[vtype], offset)
            return v, offset + struct.calcsize(self._end + _SCALARS[vtype])  # standard sizes, not the C ones
        if vtype == _STRING:
            return self._string(offset)
        if vtype != _ARRAY:
            raise GGUFFormatError(f"metadata {key}: unknown value type {vtype}")
        etype, count = self._unpack("IQ", offset)
        start = offset + 12
        if etype in _SCALARS:
            code = _SCALARS[etype]
            end = start + count * struct.calcsize(self._end + code)
            if end > len(self._buf):
                raise GGUFFormatError(f"metadata {key}: its array runs past the end of the file")
            dtype = np.dtype(np.bool_ if code == "?" else self._end + code)
            return _Lazy(lambda: np.frombuffer(self._buf, dtype, count, start).tolist()), end
        if etype == _STRING:
            starts, at = [], start
            for _ in range(count):  # only the length prefixes: the strings are decoded when asked for
                (n,) = self._unpack("Q", at)
                starts.append(at)
                at += 8 + n
            if at > len(self._buf):
                raise GGUFFormatError(f"metadata {key}: its strings run past the end of the file")
            return _Lazy(lambda: [self._string(s)[0] for s in starts]), at
        values, at = [], start  # arrays of arrays: rare, read now
        for _ in range(count):
            v, at = self._value(etype, at, key)
            values.append(v.value() if isinstance(v, _Lazy) else v)
        return values, at

    def _tensor_data(self, gguf, name, dims, qtype, offset) -> np.ndarray:
        n = int(np.prod(dims)) if dims else 1
        np_dims = tuple(reversed([int(d) for d in dims]))
        plain = _PLAIN.get(qtype.name)
        if plain is not None:
            dtype, count = np.dtype(plain).newbyteorder(self._end), n
        else:
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            if np_dims and np_dims[-1] % block:
                raise GGUFFormatError(f"tensor {name}: {np_dims[-1]} values per row is not a multiple of "
                                      f"{qtype.name}'s block of {block}")
            dtype, count = np.dtype(np.uint8), n * type_size // block
            np_dims = gguf.quant_shape_to_byte_shape(np_dims, qtype)
        if offset + count * dtype.itemsize > len(self._buf):
            raise GGUFFormatError(f"tensor {name} runs past the end of the file")
        return np.frombuffer(self._buf, dtype, count, offset).reshape(np_dims)
