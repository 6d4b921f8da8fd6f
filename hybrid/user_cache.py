"""The package's one cache folder: ``$HYBRID_CACHE_DIR``, default ``~/.cache/hybrid-lm``.

Named models are converted into ``models/``, GGUF tokenizers into ``gguf-tokenizers/``; the native library's
source builds land there too (``kernels/native/build.py`` reads the same variable: kernels import nothing from
``hybrid``). A leaf module, so any part of the package may ask for the folder without an import cycle."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    root = os.environ.get("HYBRID_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "hybrid-lm"
