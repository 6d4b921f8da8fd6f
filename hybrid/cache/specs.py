"""What each layer caches during inference, in bytes: the one source every size is read from.

Each mixer class declares its cache with ``cache_spec(config, dtypes)``: attention layers an
:class:`AttentionSpec` (K and V per token, grows with context), Mamba layers a :class:`MambaStateSpec`
(conv + SSM state per sequence, constant; any constant-state layer a :class:`ConstantStateSpec`, a tuple of
named state tensors). :func:`hybrid.layers.registry.cache_specs` collects them for a model (the registry knows
the layer classes; this module knows none, so the layers can import it); the caches
allocate their pools from these specs, and ``HybridLM.kv_bytes_per_token``, ``hybrid info``, ``hybrid bench``,
the engine benchmark and the tradeoff report read their byte counts from the same objects, so they agree
with what the cache really holds by construction. A compressed cache is a dtype on the spec: int8 / fp8
K/V pages carry one scale per token and KV head (fp16, :data:`hybrid.kernels.kv_quant.KV_SCALE_DTYPE`), int8
Mamba state one fp32 scale per head (group) of each row, and the byte counts include those scales
(:mod:`hybrid.kernels.kv_quant`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..kernels import kv_quant
from ..kernels.kv_quant import is_quantized

SCALE_BYTES = 4  # one fp32 scale (of the int8 Mamba state rows)
DEFAULT_BLOCK_SIZE = 16  # the engine's KV block size


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
    def scale_dtype(self) -> torch.dtype:
        """The dtype of a quantised pool's per-token scales (read when asked, so the benchmark can vary it)."""
        return kv_quant.KV_SCALE_DTYPE

    @property
    def scale_bytes_per_token(self) -> int:
        """The K and V scales per KV head of one token of a quantised (int8 / fp8) pool; 0 otherwise."""
        return 2 * self.n_kv_heads * self.scale_dtype.itemsize if is_quantized(self.dtype) else 0

    @property
    def bytes_per_token(self) -> int:
        """K and V bytes of one token: elements, and a quantised pool's per-token scales."""
        return 2 * self.n_kv_heads * self.head_dim * self.dtype.itemsize + self.scale_bytes_per_token

    def bytes_per_block(self, block_size: int) -> int:
        return self.bytes_per_token * block_size

    def pool_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
        """Shape of the K pool (and of the V pool) of this layer."""
        return (num_blocks, block_size, self.n_kv_heads, self.head_dim)


@dataclass(frozen=True)
class StateTensorSpec:
    """One named state tensor of a constant-state layer, per sequence: its shape, storage dtype and, for int8
    storage, how many fp32 scales a row carries (``groups``: equal slices of the row along its leading
    dimensions, see :func:`state_scale_groups`; unused for float dtypes)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    groups: int = 1

    @property
    def scales(self) -> int:
        """fp32 scales per sequence (0 unless the tensor is quantised)."""
        return self.groups if is_quantized(self.dtype) else 0

    @property
    def bytes_per_sequence(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize + self.scales * SCALE_BYTES


class ConstantStateSpec:
    """What every constant-state layer's spec is (Mamba-1/2, and any mixer whose cache is a fixed-size state per
    sequence, e.g. linear attention's ``[d_k, d_v]`` matrix per head): ``states``, its named state tensors
    (:class:`StateTensorSpec`), from which the state cache allocates one pool per tensor and the layer's cache
    view (:class:`hybrid.cache.views.StateCacheView`) takes its names."""

    states: tuple[StateTensorSpec, ...]

    @property
    def bytes_per_sequence(self) -> int:
        return sum(t.bytes_per_sequence for t in self.states)


@dataclass(frozen=True)
class StateSpec(ConstantStateSpec):
    """A constant-state layer's cache given by its state tensors alone (what a new mixer kind declares)."""

    states: tuple[StateTensorSpec, ...]

    def __post_init__(self) -> None:
        names = [t.name for t in self.states]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"a StateSpec needs one or more state tensors with distinct names, got {names}")


@dataclass(frozen=True)
class MambaStateSpec(ConstantStateSpec):
    """One Mamba layer's per-sequence state: the conv state (last ``d_conv - 1`` inputs per channel)
    and the SSM state; its state tensors are named ``conv`` and ``ssm``."""

    conv_shape: tuple[int, ...]
    ssm_shape: tuple[int, ...]
    conv_dtype: torch.dtype
    ssm_dtype: torch.dtype
    # int8 rows carry one fp32 scale per group: equal slices of the row along its leading dimensions
    # (Mamba-2: SSM state per head and head_dim row, conv state per head; see state_scale_groups); unused
    # for float dtypes
    conv_groups: int = 1
    ssm_groups: int = 1

    @property
    def states(self) -> tuple[StateTensorSpec, StateTensorSpec]:
        return (StateTensorSpec("conv", self.conv_shape, self.conv_dtype, self.conv_groups),
                StateTensorSpec("ssm", self.ssm_shape, self.ssm_dtype, self.ssm_groups))

    @property
    def conv_scales(self) -> int:
        """fp32 scales per sequence of the conv state (0 unless it is quantised)."""
        return self.states[0].scales

    @property
    def ssm_scales(self) -> int:
        return self.states[1].scales


def state_scale_groups(rows: int, target: int) -> int:
    """Scale groups along a state's leading dimension of ``rows``: ``target`` (the heads) when it divides
    ``rows``, else the largest divisor of ``rows`` below it (every group the same size)."""
    return math.gcd(rows, max(1, target))


LayerCacheSpec = AttentionSpec | ConstantStateSpec


@dataclass(frozen=True)
class ModelCacheSpec:
    """Every caching layer of a model, by layer index."""

    layers: dict[int, LayerCacheSpec]

    @property
    def attention(self) -> dict[int, AttentionSpec]:
        return {i: s for i, s in self.layers.items() if isinstance(s, AttentionSpec)}

    @property
    def mamba(self) -> dict[int, ConstantStateSpec]:
        """The constant-state layers (Mamba, and any other :class:`ConstantStateSpec`)."""
        return {i: s for i, s in self.layers.items() if isinstance(s, ConstantStateSpec)}

    @property
    def kv_bytes_per_token(self) -> int:
        """K/V bytes one token costs across all attention layers (a quantised pool's per-token scales
        included)."""
        return sum(s.bytes_per_token for s in self.attention.values())

    def kv_bytes_per_block(self, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
        """Bytes of one KV block across all attention layers, scales included: what the pool allocates."""
        return sum(s.bytes_per_block(block_size) for s in self.attention.values())

    def kv_bytes_per_token_with_scales(self, block_size: int = DEFAULT_BLOCK_SIZE) -> float:
        """K/V bytes per token, scales included (per token since the scales are: :attr:`kv_bytes_per_token`;
        ``block_size`` is kept for callers that count per block)."""
        return self.kv_bytes_per_block(block_size) / block_size

    @property
    def state_bytes_per_sequence(self) -> int:
        """State bytes one sequence holds across all constant-state layers (Mamba: conv + SSM), whatever its
        length."""
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
        plus its Mamba state; a quantised pool's per-token scales included."""
        held = seq_len if self.window is None else min(seq_len, self.window)
        if block_size is not None:
            held = -(-held // block_size) * block_size
        return held * self.kv_bytes_per_token + self.state_bytes_per_sequence
