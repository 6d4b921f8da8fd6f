"""A GGUF file's tokenizer, chat template and generation defaults -> the files a checkpoint folder carries.

The tokenizer comes from transformers' GGUF tokenizer converter
(``AutoTokenizer.from_pretrained(folder, gguf_file=name)``: BPE / SentencePiece vocabularies, merges, special
tokens, the ``tokenizer.chat_template`` metadata), saved as ``tokenizer.json`` + ``tokenizer_config.json``
with the chat template inside the latter. ``generation_config.json`` gets what llama.cpp treats as the end of
generation (``tokenizer.ggml.eos_token_id``, ``eot_token_id``, ``eom_token_id``) and the sampling defaults a
GGUF may carry (``general.sampling.temp`` / ``top_k`` / ``top_p`` / ``min_p``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from ..checkpoint import CheckpointError
from ..user_cache import cache_root
from .gguf_file import GGUFFile

# llama.cpp metadata keys whose ids end generation (its "end of generation" set), in this order
_STOP_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
# general.sampling.* (written by llama.cpp's converter from a model's generation_config) -> transformers' name
_SAMPLING_KEYS = {"temp": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p"}


def generation_config(f: GGUFFile) -> dict:
    """The ``generation_config.json`` content of GGUF file ``f``."""
    stops = []
    for key in _STOP_KEYS:
        value = f.get(key)
        if value is not None and int(value) not in stops:
            stops.append(int(value))
    out = {}
    if f.get("tokenizer.ggml.bos_token_id") is not None:
        out["bos_token_id"] = int(f.get("tokenizer.ggml.bos_token_id"))
    if stops:
        out["eos_token_id"] = stops[0] if len(stops) == 1 else stops
    if f.get("tokenizer.ggml.padding_token_id") is not None:
        out["pad_token_id"] = int(f.get("tokenizer.ggml.padding_token_id"))
    for key, name in _SAMPLING_KEYS.items():
        value = f.get(f"general.sampling.{key}")
        if value is not None:
            out[name] = value
    if any(k in out for k in ("temperature", "top_k", "top_p", "min_p")):
        out["do_sample"] = True
    return out


def write_tokenizer_files(gguf_path: str | Path, dst: str | Path) -> list[str]:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` (with the chat template) and
    ``generation_config.json`` of ``gguf_path`` into folder ``dst``; returns the names written."""
    gguf_path, dst = Path(gguf_path), Path(dst)
    f = GGUFFile(gguf_path)
    written = []
    if f.get("tokenizer.ggml.model") is not None:
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise CheckpointError("reading a GGUF file's tokenizer needs transformers: pip install "
                                  "'hybrid-lm[hf]'") from None
        try:
            tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"{gguf_path}: transformers cannot build its tokenizer ({e})") from None
        # the chat template inside tokenizer_config.json (not a chat_template.jinja beside it): one file
        # every reader of the folder (transformers 4 and 5, our fallback renderer) finds it in
        tok.save_pretrained(str(dst), save_jinja_files=False)
        written += ["tokenizer.json", "tokenizer_config.json"]
    (dst / "generation_config.json").write_text(json.dumps(generation_config(f), indent=2) + "\n")
    written.append("generation_config.json")
    return written


@contextlib.contextmanager
def tokenizer_folder(gguf_path: str | Path):
    """A folder holding the tokenizer files of ``gguf_path`` (:func:`write_tokenizer_files`), for the loaders
    that read a checkpoint folder. Written once per file (its resolved path, size and mtime) under the cache,
    ``$HYBRID_CACHE_DIR/gguf-tokenizers/KEY``: transformers' converter takes seconds to build a large vocabulary
    (tens of seconds for a 49K one on a busy core), and one command reads the tokenizer, the chat template and
    the generation config. Written to a temporary folder and renamed into place, so a reader never sees half."""
    gguf_path = Path(gguf_path).resolve()
    st = gguf_path.stat()
    key = hashlib.sha256(json.dumps([str(gguf_path), st.st_size, st.st_mtime_ns]).encode()).hexdigest()[:16]
    final = cache_root() / "gguf-tokenizers" / key
    if not (final / "generation_config.json").is_file():  # written last: its presence means the folder is whole
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}.writing-", dir=final.parent))
        try:
            write_tokenizer_files(gguf_path, tmp)
            try:
                os.rename(tmp, final)
            except OSError:  # another process renamed its own copy into place first
                if not (final / "generation_config.json").is_file():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    yield final
