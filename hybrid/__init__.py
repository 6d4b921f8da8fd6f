"""hybrid-lm: build, run and evaluate language models that mix GQA attention with Mamba layers."""

from __future__ import annotations

from .cache import CacheFullError, HybridCache, PagedKVCache, SSMStateCache
from .checkpoint import CheckpointError
from .config import (
    AttentionConfig,
    ConfigError,
    GatedDeltaNetConfig,
    GLAConfig,
    HybridConfig,
    Mamba1Config,
    Mamba2Config,
    MLPConfig,
    MoEConfig,
)
from .engine import Engine, EngineConfig
from .engine.request import RequestOutput
from .generation import generate
from .model import HybridLM
from .pattern import PatternError, attention_share, blocks_pattern, parse_pattern, ratio_pattern
from .pretrained import from_pretrained, save_pretrained
from .pretrained_names import NAMED_MODELS, pretrained_path
from .quantize import quantize
from .sampling import SamplingParams
from .speculative import SpeculativeConfig
from .tokenizer import ByteTokenizer, HFTokenizer, StreamDecoder, load_tokenizer

__version__ = "0.1.0"


__all__ = [
    "AttentionConfig", "CheckpointError", "ConfigError", "GatedDeltaNetConfig", "GLAConfig", "HybridConfig",
    "HybridLM", "MLPConfig",
    "Mamba1Config", "Mamba2Config", "MoEConfig", "PatternError", "attention_share", "blocks_pattern",
    "NAMED_MODELS", "from_pretrained", "parse_pattern", "pretrained_path", "quantize", "ratio_pattern",
    "save_pretrained",
    # inference engine
    "ByteTokenizer", "CacheFullError", "Engine", "EngineConfig", "HFTokenizer", "HybridCache", "PagedKVCache",
    "RequestOutput", "SSMStateCache", "SamplingParams", "SpeculativeConfig", "StreamDecoder", "generate",
    "load_tokenizer",
]


def __getattr__(name: str):
    # ``hybrid.recipes`` and ``hybrid.eval`` depend on the library, not the other way round: they are
    # imported on first access, so ``import hybrid; hybrid.recipes.get(...)`` works without a cycle.
    if name in ("recipes", "eval"):
        import importlib
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
