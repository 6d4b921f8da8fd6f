"""Tokenizers: a checkpoint's ``tokenizer.json`` (via the ``tokenizers`` package), else bytes.

Both expose ``encode(text) -> list[int]``, ``decode(ids) -> str``, ``bos_token_id``,
``eos_token_id``, ``pad_token_id``, ``eos_token_ids`` (every id that ends generation),
``sampling_defaults`` (the checkpoint's generation_config.json sampling values) and ``vocab_size``.
:class:`StreamDecoder` turns a growing id list into text deltas without ever emitting half of a multi-byte
character (through ``tokenizers.decoders.DecodeStream`` where the tokenizer has a ``tokenizers`` backend).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

REPLACEMENT = "\ufffd"
log = logging.getLogger("hybrid.tokenizer")


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then ``<bos>`` 256, ``<eos>`` 257, ``<pad>`` 258.

    The fallback when a checkpoint has no tokenizer. No BOS is added unless ``add_bos`` (byte-vocab
    models of 256 ids have no room for it). Ids past the specials, which a model with a larger
    vocabulary can emit, decode to ``<unk:ID>`` (not U+FFFD, which streaming reads as a cut character).
    """

    bos_token_id, eos_token_id, pad_token_id = 256, 257, 258
    vocab_size = 259
    sampling_defaults: dict = {}  # no checkpoint, no defaults (never mutated)
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
        # generation ends at every end-of-turn id generation_config.json lists and at the tokenizer's own EOS
        # (a chat model's <|im_end|> / <|eot_id|> may be only one of them), as transformers' generate does
        if ids["eos"] is not None and ids["eos"] not in eos_ids:
            eos_ids.append(ids["eos"])
        self.eos_token_ids = tuple(eos_ids)
        self.eos_token_id = eos_ids[0] if eos_ids else None
        self.bos_token_id = gen.get("bos_token_id", ids["bos"])
        self.pad_token_id = gen.get("pad_token_id", ids["pad"])
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.sampling_defaults = sampling_defaults(gen)

    @property
    def backend_tokenizer(self):
        """The ``tokenizers.Tokenizer`` itself (transformers' fast tokenizers name it the same)."""
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)


# generation_config.json keys that set a sampling default -> SamplingParams' name (vLLM reads the same ones;
# like vLLM, ``do_sample`` is not read: an explicit temperature says whether to sample)
SAMPLING_KEYS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                 "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_new_tokens"}


def sampling_defaults(generation_config: dict) -> dict:
    """The sampling defaults a checkpoint's ``generation_config.json`` sets, as SamplingParams keywords; the
    caller's own values (flags, request fields) override them."""
    return {name: generation_config[key] for key, name in SAMPLING_KEYS.items()
            if generation_config.get(key) is not None}


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def load_tokenizer(path: str | Path | None = None) -> ByteTokenizer | HFTokenizer:
    """The tokenizer of a checkpoint folder (its ``tokenizer.json``; a model name stands for its folder,
    :func:`hybrid.pretrained_path`) or of a ``.gguf`` file, or the byte-level fallback when ``path`` is None or
    the folder has none."""
    if path is None:
        return ByteTokenizer()
    from .pretrained_names import resolve

    path = Path(resolve(path))
    if path.is_file() and path.name == "tokenizer.json":
        return HFTokenizer(path.parent)
    if path.is_file() and path.suffix == ".gguf":  # the tokenizer llama.cpp's file carries
        from .interop.gguf_tokenizer import tokenizer_folder

        with tokenizer_folder(path) as folder:
            return load_tokenizer(folder)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is neither a checkpoint folder, a tokenizer.json nor a .gguf file")
    return HFTokenizer(path) if (path / "tokenizer.json").is_file() else ByteTokenizer()


class StreamDecoder:
    """Incremental detokenizer: ``push(ids)`` returns the new text those ids complete; ``flush()``
    returns what is left at the end (a character cut by the end shows as U+FFFD, as in a full decode).

    A tokenizer with a ``tokenizers`` backend (ours, or a transformers fast tokenizer: its
    ``backend_tokenizer``) streams through ``tokenizers.decoders.DecodeStream``, the library's own
    incremental decoder (byte-fallback pieces, multi-byte characters, a decoder's prefix handling).
    Other tokenizers -- the byte-level fallback, a slow transformers tokenizer, one that cleans up
    spaces after decoding, which DecodeStream does not do -- use the same method written here: decode a
    short window of recent ids (single tokens lose spaces and byte pieces that only make sense
    together) and hold the text back while it ends in U+FFFD, i.e. mid-way through a character.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self._streamed = ""  # what push() returned so far (``text`` may be cut at a stop string)
        self._backend = _stream_backend(tokenizer)
        self.stream = None
        if self._backend is not None:
            from tokenizers.decoders import DecodeStream

            self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._full = False  # after a DecodeStream error: diff full decodes
        self._pending = 0  # ids[_pending:] have not shown in any delta yet
        self._prefix = 0  # the fallback's window: ids[_prefix:_read] are already emitted and give context
        self._read = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def push(self, ids: list[int]) -> str:
        ids = [int(i) for i in ids]
        self.ids.extend(ids)
        if self.stream is not None:
            delta = self._stream_step(ids)
        elif self._full:
            full = self._decode(self.ids)
            ok = not full.endswith(REPLACEMENT) and full.startswith(self._streamed)
            delta = full[len(self._streamed):] if ok else ""
            if ok:
                self._pending = len(self.ids)
        else:
            before = self._decode(self.ids[self._prefix:self._read])
            now = self._decode(self.ids[self._prefix:])
            if len(now) <= len(before) or now.endswith(REPLACEMENT):
                return ""
            delta = now[len(before):]
            self._prefix, self._read = self._read, len(self.ids)
        self._streamed += delta
        self.text += delta
        return delta

    def _stream_step(self, ids: list[int]) -> str:
        parts = []
        start = len(self.ids) - len(ids)
        try:
            for k, i in enumerate(ids):  # one id a step: what every tokenizers release with DecodeStream accepts
                chunk = self.stream.step(self._backend, i)
                if chunk is not None:
                    parts.append(chunk)
                    self._pending = start + k + 1
        except Exception:  # noqa: BLE001 - DecodeStream refuses a decoder whose window text rewrites its
            # earlier text (InvalidPrefix): the rest of this stream diffs full decodes; a request never fails
            log.warning("DecodeStream failed; streaming the rest of this request by full decodes", exc_info=True)
            self.stream, self._full = None, True
            full = self._decode(self.ids)
            if full.endswith(REPLACEMENT) or not full.startswith(self._streamed + "".join(parts)):
                return "".join(parts)
            self._pending = len(self.ids)
            return full[len(self._streamed):]
        return "".join(parts)

    def flush(self) -> str:
        if self.stream is not None or self._full:
            # the ids DecodeStream still holds back (a character cut by the end): the full decode's tail, or
            # where that rewrites what streamed (byte-fallback decoders garble a whole cut byte run), their own
            delta = ""
            if self._pending < len(self.ids):
                full = self._decode(self.ids)
                delta = (full[len(self._streamed):] if full.startswith(self._streamed)
                         else self._decode(self.ids[self._pending:]))
            self._pending = len(self.ids)
        else:
            before = self._decode(self.ids[self._prefix:self._read])
            delta = self._decode(self.ids[self._prefix:])[len(before):]
            self._prefix = self._read = len(self.ids)
        self._streamed += delta
        self.text += delta
        return delta


def _stream_backend(tokenizer):
    """The ``tokenizers.Tokenizer`` that DecodeStream can step for ``tokenizer``, or None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    try:
        from tokenizers import Tokenizer
        from tokenizers.decoders import DecodeStream  # noqa: F401 - tokenizers >= 0.21
    except ImportError:
        return None
    return backend if isinstance(backend, Tokenizer) else None
