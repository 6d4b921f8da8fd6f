"""hybrid-lm: build, run and evaluate language models that mix GQA attention with Mamba layers."""

from __future__ import annotations

from pathlib import Path

import torch

from .cache import CacheFullError, HybridCache, PagedKVCache, SSMStateCache
from .checkpoint import CheckpointError
from .config import AttentionConfig, ConfigError, HybridConfig, Mamba1Config, Mamba2Config, MLPConfig, MoEConfig
from .engine import Engine, RequestOutput
from .generate import generate
from .model import HybridLM
from .pattern import PatternError, attention_share, blocks_pattern, parse_pattern, ratio_pattern
from .sampling import SamplingParams
from .tokenizer import ByteTokenizer, HFTokenizer, StreamDecoder, load_tokenizer

__version__ = "0.1.0"


def from_pretrained(path: str | Path, *, dtype: torch.dtype | None = None,
                    device: str | torch.device | None = None) -> HybridLM:
    """Load a checkpoint folder: our own format (``save_pretrained``), or a Hugging Face /
    mamba_ssm checkpoint through the converter for its architecture (``hybrid.interop``). The
    folder's tokenizer, if it has a ``tokenizer.json``, is attached as ``model.tokenizer``."""
    from .checkpoint import is_native, load_native
    from .interop import load_foreign

    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory; give the checkpoint folder")
    if is_native(path):
        model = load_native(path, dtype=dtype, device=device)
    else:
        model = load_foreign(path, dtype=dtype, device=device)
    # the checkpoint's own tokenizer (tokenizer.json, special tokens from tokenizer_config.json and
    # generation_config.json), or None when the folder has none
    model.tokenizer = load_tokenizer(path) if (path / "tokenizer.json").is_file() else None
    return model


__all__ = [
    "AttentionConfig", "CheckpointError", "ConfigError", "HybridConfig", "HybridLM", "MLPConfig",
    "Mamba1Config", "Mamba2Config", "MoEConfig", "PatternError", "attention_share", "blocks_pattern",
    "from_pretrained", "parse_pattern", "ratio_pattern",
    # inference engine
    "ByteTokenizer", "CacheFullError", "Engine", "HFTokenizer", "HybridCache", "PagedKVCache", "RequestOutput",
    "SSMStateCache", "SamplingParams", "StreamDecoder", "generate", "load_tokenizer",
]
