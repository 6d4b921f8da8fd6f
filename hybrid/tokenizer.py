"""Tokenizers: a checkpoint's ``tokenizer.json`` (via the ``tokenizers`` package), else bytes.

Both expose ``encode(text) -> list[int]``, ``decode(ids) -> str``, ``bos_token_id``,
``eos_token_id``, ``pad_token_id``, ``eos_token_ids`` (every id that ends generation) and
``vocab_size``. :class:`StreamDecoder` turns a growing id list into text deltas without ever
emitting half of a multi-byte character.
"""

from __future__ import annotations

import json
from pathlib import Path

REPLACEMENT = "\ufffd"


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then ``<bos>`` 256, ``<eos>`` 257, ``<pad>`` 258.

    The fallback when a checkpoint has no tokenizer. No BOS is added unless ``add_bos`` (byte-vocab
    models of 256 ids have no room for it). Ids past the specials, which a model with a larger
    vocabulary can emit, decode to ``<unk:ID>`` (not U+FFFD, which streaming reads as a cut character).
    """

    bos_token_id, eos_token_id, pad_token_id = 256, 257, 258
    vocab_size = 259
    _SPECIALS = {256: "<bos>", 257: "<eos>", 258: "<pad>"}

    def __init__(self, add_bos: bool = False):
        self.add_bos = add_bos

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return (self.eos_token_id,)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if self.add_bos and add_special_tokens else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        out, run = [], bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < 256:
                run.append(i)
                continue
            out.append(run.decode("utf-8", errors="replace"))
            run = bytearray()
            if i in self._SPECIALS:
                out.append("" if skip_special_tokens else self._SPECIALS[i])
            else:
                out.append(f"<unk:{i}>")
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)


def _token_content(entry) -> str | None:
    """tokenizer_config.json gives special tokens as a string or as {"content": ...}."""
    if isinstance(entry, dict):
        return entry.get("content")
    return entry if isinstance(entry, str) else None


class HFTokenizer:
    """A ``tokenizer.json`` loaded with the ``tokenizers`` package; special tokens from
    ``tokenizer_config.json`` and ``generation_config.json`` beside it (the latter's ids win)."""

    def __init__(self, directory: str | Path):
        try:
            from tokenizers import Tokenizer
        except ImportError as e:  # pragma: no cover - tokenizers ships with the hf/dev extras
            raise ImportError("loading tokenizer.json needs the `tokenizers` package: pip install tokenizers") from e
        directory = Path(directory)
        self._tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
        config = _read_json(directory / "tokenizer_config.json")
        gen = _read_json(directory / "generation_config.json")
        ids = {}
        for name in ("bos", "eos", "pad"):
            content = _token_content(config.get(f"{name}_token"))
            ids[name] = self._tok.token_to_id(content) if content is not None else None
        eos_ids = gen.get("eos_token_id", ids["eos"])
        eos_ids = [eos_ids] if isinstance(eos_ids, int) else list(eos_ids or [])
        self.eos_token_ids = tuple(eos_ids)
        self.eos_token_id = eos_ids[0] if eos_ids else None
        self.bos_token_id = gen.get("bos_token_id", ids["bos"])
        self.pad_token_id = gen.get("pad_token_id", ids["pad"])
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def load_tokenizer(path: str | Path | None = None) -> ByteTokenizer | HFTokenizer:
    """The tokenizer of a checkpoint folder (its ``tokenizer.json``), or the byte-level fallback
    when ``path`` is None or the folder has none."""
    if path is None:
        return ByteTokenizer()
    path = Path(path)
    if path.is_file() and path.name == "tokenizer.json":
        return HFTokenizer(path.parent)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is neither a checkpoint folder nor a tokenizer.json file")
    return HFTokenizer(path) if (path / "tokenizer.json").is_file() else ByteTokenizer()


class StreamDecoder:
    """Incremental detokenizer: ``push(ids)`` returns the new text those ids complete.

    Text is decoded over a short window of recent ids (decoding single tokens loses the spaces
    and byte pieces that only make sense together) and held back while it ends in U+FFFD, i.e.
    mid-way through a multi-byte character; ``flush()`` returns whatever is left at the end.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # ids[_prefix:_read] are already emitted; they give the window its context
        self._read = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def push(self, ids: list[int]) -> str:
        self.ids.extend(int(i) for i in ids)
        before = self._decode(self.ids[self._prefix:self._read])
        now = self._decode(self.ids[self._prefix:])
        if len(now) <= len(before) or now.endswith(REPLACEMENT):
            return ""
        delta = now[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        before = self._decode(self.ids[self._prefix:self._read])
        now = self._decode(self.ids[self._prefix:])
        delta = now[len(before):]
        self._prefix = self._read = len(self.ids)
        self.text += delta
        return delta
