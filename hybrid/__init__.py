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
    mamba_ssm checkpoint through the converter for its architecture (``hybrid.interop``)."""
    from .checkpoint import is_native, load_native
    from .interop import load_foreign

    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory; give the checkpoint folder")
    if is_native(path):
        return load_native(path, dtype=dtype, device=device)
    return load_foreign(path, dtype=dtype, device=device)


__all__ = [
    "AttentionConfig", "CheckpointError", "ConfigError", "HybridConfig", "HybridLM", "MLPConfig",
    "Mamba1Config", "Mamba2Config", "MoEConfig", "PatternError", "attention_share", "blocks_pattern",
    "from_pretrained", "parse_pattern", "ratio_pattern",
    # inference engine
    "ByteTokenizer", "CacheFullError", "Engine", "HFTokenizer", "HybridCache", "PagedKVCache", "RequestOutput",
    "SSMStateCache", "SamplingParams", "StreamDecoder", "generate", "load_tokenizer",
]
