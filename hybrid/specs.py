"""What each layer caches during inference, in bytes: the one source every size is read from.

Each mixer class declares its cache with ``cache_spec(config, dtypes)``: attention layers an
:class:`AttentionSpec` (K and V per token, grows with context), Mamba layers a :class:`MambaStateSpec`
(conv + SSM state per sequence, constant). :func:`cache_specs` collects them for a model; the caches
allocate their pools from these specs, and ``HybridLM.kv_bytes_per_token``, ``hybrid info``, ``hybrid bench``,
the engine benchmark and the tradeoff report read their byte counts from the same objects, so they agree
with what the cache really holds by construction. A later cache dtype (int8/fp8 KV, bf16 state) is a
dtype on the spec.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .config import HybridConfig


@dataclass(frozen=True)
class CacheDtypes:
    """Storage dtypes of the inference caches. The SSM state accumulates over the whole sequence, so it
    defaults to fp32 whatever the model's dtype; K/V and the conv state (raw recent inputs) default to
    the model's dtype."""

    kv: torch.dtype
    conv: torch.dtype
    ssm: torch.dtype = torch.float32

    @classmethod
    def for_dtype(cls, model_dtype: torch.dtype, *, kv: torch.dtype | None = None, conv: torch.dtype | None = None,
                  ssm: torch.dtype = torch.float32) -> CacheDtypes:
        return cls(kv=kv or model_dtype, conv=conv or model_dtype, ssm=ssm)


@dataclass(frozen=True)
class AttentionSpec:
    """One attention layer's paged K/V: ``n_kv_heads x head_dim`` keys and values per token."""

    n_kv_heads: int
    head_dim: int
    window: int | None  # sliding window (tokens a query sees, itself included); None = full causal
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.n_kv_heads * self.head_dim * self.dtype.itemsize

    def bytes_per_block(self, block_size: int) -> int:
        return self.bytes_per_token * block_size

    def pool_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
        """Shape of the K pool (and of the V pool) of this layer."""
        return (num_blocks, block_size, self.n_kv_heads, self.head_dim)


@dataclass(frozen=True)
class MambaStateSpec:
    """One Mamba layer's per-sequence state: the conv state (last ``d_conv - 1`` inputs per channel)
    and the SSM state."""

    conv_shape: tuple[int, ...]
    ssm_shape: tuple[int, ...]
    conv_dtype: torch.dtype
    ssm_dtype: torch.dtype

    @property
    def bytes_per_sequence(self) -> int:
        return (math.prod(self.conv_shape) * self.conv_dtype.itemsize
                + math.prod(self.ssm_shape) * self.ssm_dtype.itemsize)


LayerCacheSpec = AttentionSpec | MambaStateSpec


@dataclass(frozen=True)
class ModelCacheSpec:
    """Every caching layer of a model, by layer index."""

    layers: dict[int, LayerCacheSpec]

    @property
    def attention(self) -> dict[int, AttentionSpec]:
        return {i: s for i, s in self.layers.items() if isinstance(s, AttentionSpec)}

    @property
    def mamba(self) -> dict[int, MambaStateSpec]:
        return {i: s for i, s in self.layers.items() if isinstance(s, MambaStateSpec)}

    @property
    def kv_bytes_per_token(self) -> int:
        """K/V bytes one token costs across all attention layers."""
        return sum(s.bytes_per_token for s in self.attention.values())

    @property
    def state_bytes_per_sequence(self) -> int:
        """Conv + SSM state bytes one sequence holds across all Mamba layers, whatever its length."""
        return sum(s.bytes_per_sequence for s in self.mamba.values())

    @property
    def window(self) -> int | None:
        windows = {s.window for s in self.attention.values()}
        if len(windows) > 1:
            raise ValueError(f"attention layers with different windows {sorted(windows, key=str)}: one paged "
                             "pool needs one window")
        return windows.pop() if windows else None

    def bytes_per_sequence(self, seq_len: int, block_size: int | None = None) -> int:
        """Cache bytes one sequence of ``seq_len`` tokens holds: its K/V (whole blocks of ``block_size``
        when given, as the paged cache allocates them; a sliding window keeps at most ``window`` tokens)
        plus its Mamba state."""
        held = seq_len if self.window is None else min(seq_len, self.window)
        if block_size is not None:
            held = -(-held // block_size) * block_size
        return held * self.kv_bytes_per_token + self.state_bytes_per_sequence


def cache_specs(config: HybridConfig, dtypes: CacheDtypes) -> ModelCacheSpec:
    """The cache spec of every layer of ``config`` that caches something (as its layer class declares)."""
    from .layers.registry import layer_class

    specs = {}
    for i, kind in enumerate(config.layer_kinds):
        spec = layer_class(kind).cache_spec(config, dtypes)
        if spec is not None:
            specs[i] = spec
    return ModelCacheSpec(specs)
