"""Typed, frozen, validated model configuration with a JSON round trip.

Sizes a sub-config leaves as ``None`` (head dims, inner widths, MLP width) are derived from
``d_model`` when the :class:`HybridConfig` is built, so a saved config states every size.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from .pattern import parse_pattern, register_symbol

ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu", "relu2")


class ConfigError(ValueError):
    """A configuration that cannot describe a working model."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


# section name -> sub-config class, in definition order; filled by SubConfig.__init_subclass__
SUBCONFIGS: dict[str, type[SubConfig]] = {}


class SubConfig:
    """Base of a layer kind's section of :class:`HybridConfig`. A subclass declares, next to its fields, all that
    the rest of the config needs to know about its kind: ``section`` (the HybridConfig field and the layer kind
    the layer registry maps to a class), ``symbol`` (its pattern symbol), ``mixer`` (a sequence mixer, which
    ``blocks_pattern`` may place, rather than a channel MLP), how sizes left as ``None`` follow from ``d_model``
    (:meth:`resolved`) and its checks (:meth:`_validate`). Defining the class registers it; a new layer kind
    adds its sub-config and one HybridConfig field, and edits no switch here or in :mod:`hybrid.pattern`."""

    section: ClassVar[str]
    symbol: ClassVar[str]
    mixer: ClassVar[bool]

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if cls.section in SUBCONFIGS:
            raise ValueError(f"config section {cls.section!r} is declared twice ({SUBCONFIGS[cls.section].__name__}, "
                             f"{cls.__name__})")
        SUBCONFIGS[cls.section] = cls
        register_symbol(cls.symbol, cls.section, mixer=cls.mixer)

    def resolved(self, d_model: int):
        """This section with every size left as ``None`` derived from ``d_model`` (a saved config states all)."""
        return self

    def _validate(self) -> None:
        """Raise :class:`ConfigError` naming the field when this section cannot describe a working layer."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (tuples become lists; :meth:`from_dict` turns them back)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]):
        known = {f.name for f in dataclasses.fields(cls)}
        bad = sorted(set(d) - known)
        _check(not bad, f"unknown {cls.section} fields {bad}; known: {sorted(known)}")
        # JSON has no tuples and no infinity: lists come back as tuples, null inside them as infinity
        return cls(**{k: tuple(math.inf if x is None else x for x in v) if isinstance(v, list) else v
                      for k, v in d.items()})


def _resolved_d_ff(d_ff: int | None, gated: bool, d_model: int) -> int:
    """An MLP width left as None: 8/3 d_model when gated (SwiGLU keeps the parameter count), else 4 d_model,
    rounded up to a multiple of 64."""
    if d_ff is not None:
        return d_ff
    return 64 * math.ceil((8 * d_model / 3 if gated else 4 * d_model) / 64)


@dataclass(frozen=True, kw_only=True)
class AttentionConfig(SubConfig):
    """GQA attention (``*``). ``n_kv_heads < n_heads`` is GQA, ``n_kv_heads == 1`` MQA."""

    section: ClassVar[str] = "attention"
    symbol: ClassVar[str] = "*"
    mixer: ClassVar[bool] = True

    n_heads: int = 8
    n_kv_heads: int | None = None  # None: same as n_heads (MHA)
    head_dim: int | None = None  # None: d_model // n_heads
    rope_theta: float = 10000.0
    rotary_fraction: float = 1.0  # share of head_dim that is rotated; 0.0 = no RoPE (NemotronH)
    sliding_window: int | None = None  # attend to at most this many most recent tokens (incl. self)
    qkv_bias: bool = False
    out_bias: bool = False
    # RoPE frequency scaling in Hugging Face's form, e.g. {"rope_type": "linear", "factor": 4.0} or Llama-3's
    # {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}.
    rope_scaling: dict | None = None
    # Qwen3-Next's gated attention: q_proj also yields a per-channel output gate (per head, the head's query
    # rows then its gate rows), and the attention output is multiplied by sigmoid(gate) before o_proj
    output_gate: bool = False
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (Qwen3, Qwen3-Next)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rotary_fraction) if self.head_dim else 0

    def resolved(self, d_model: int) -> AttentionConfig:
        return dataclasses.replace(
            self, n_kv_heads=self.n_kv_heads if self.n_kv_heads is not None else self.n_heads,
            head_dim=self.head_dim if self.head_dim is not None else d_model // max(self.n_heads, 1))

    def _validate(self) -> None:
        _check(self.n_heads >= 1, f"attention.n_heads must be >= 1, got {self.n_heads}")
        _check(self.n_kv_heads >= 1, f"attention.n_kv_heads must be >= 1, got {self.n_kv_heads}")
        _check(self.n_heads % self.n_kv_heads == 0,
               f"attention.n_heads ({self.n_heads}) must be a multiple of attention.n_kv_heads "
               f"({self.n_kv_heads}) for grouped-query attention")
        _check(self.head_dim >= 1, f"attention.head_dim must be >= 1, got {self.head_dim}")
        _check(0.0 <= self.rotary_fraction <= 1.0,
               f"attention.rotary_fraction must be in [0, 1], got {self.rotary_fraction}")
        _check(self.rotary_dim % 2 == 0,
               f"the rotary dim (head_dim {self.head_dim} x rotary_fraction {self.rotary_fraction} = "
               f"{self.rotary_dim}) must be even")
        _check(self.rope_theta > 0, f"attention.rope_theta must be > 0, got {self.rope_theta}")
        _check(self.sliding_window is None or self.sliding_window >= 1,
               f"attention.sliding_window must be None or >= 1, got {self.sliding_window}")
        if self.rope_scaling is not None:
            _check_rope_scaling(self.rope_scaling)


ROPE_SCALING_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def _check_rope_scaling(rs: dict) -> None:
    kind = rs.get("rope_type") if isinstance(rs, dict) else None
    _check(kind in ROPE_SCALING_KEYS,
           f"attention.rope_scaling must be a dict with rope_type in {sorted(ROPE_SCALING_KEYS)}, got {rs!r}")
    need = set(ROPE_SCALING_KEYS[kind])
    have = set(rs) - {"rope_type"}
    _check(have == need, f"attention.rope_scaling of type {kind!r} needs exactly the keys {sorted(need)}, "
                         f"got {sorted(have)}")
    _check(rs["factor"] > 0, f"attention.rope_scaling factor must be > 0, got {rs['factor']}")
    if kind == "llama3":
        _check(rs["high_freq_factor"] > rs["low_freq_factor"] > 0,
               f"attention.rope_scaling needs high_freq_factor > low_freq_factor > 0, got {rs}")


@dataclass(frozen=True, kw_only=True)
class Mamba2Config(SubConfig):
    """Mamba-2 mixer (``M``): SSD with scalar-per-head decay, in mamba_ssm's layout."""

    section: ClassVar[str] = "mamba2"
    symbol: ClassVar[str] = "M"
    mixer: ClassVar[bool] = True

    d_state: int = 128
    d_conv: int = 4
    expand: int = 2
    d_inner: int | None = None  # None: expand * d_model
    head_dim: int = 64
    n_groups: int = 1  # B/C groups (like KV heads in GQA)
    chunk_size: int = 256
    dt_min: float = 0.001
    dt_max: float = 0.1
    dt_init_floor: float = 1e-4
    dt_limit: tuple[float, float] = (0.0, math.inf)
    A_init_range: tuple[float, float] = (1.0, 16.0)
    conv_bias: bool = True
    proj_bias: bool = False
    norm_before_gate: bool = False  # gated RMSNorm: norm(y) * silu(z) if True else norm(y * silu(z))
    norm_groups: int | None = None  # groups of the gated RMSNorm; None: n_groups (mamba_ssm)

    @property
    def n_heads(self) -> int:
        return self.d_inner // self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.n_groups * self.d_state

    def resolved(self, d_model: int) -> Mamba2Config:
        return dataclasses.replace(
            self, d_inner=self.d_inner if self.d_inner is not None else self.expand * d_model,
            norm_groups=self.norm_groups if self.norm_groups is not None else self.n_groups,
            dt_limit=tuple(self.dt_limit), A_init_range=tuple(self.A_init_range))

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out["dt_limit"] = [None if math.isinf(v) else v for v in self.dt_limit]  # JSON has no infinity
        return out

    def _validate(self) -> None:
        for name in ("d_state", "d_conv", "expand", "d_inner", "head_dim", "n_groups", "chunk_size",
                     "norm_groups"):
            _check(getattr(self, name) >= 1, f"mamba2.{name} must be >= 1, got {getattr(self, name)}")
        _check(self.d_inner % self.head_dim == 0,
               f"mamba2.d_inner ({self.d_inner}) must be a multiple of mamba2.head_dim ({self.head_dim})")
        _check(self.n_heads % self.n_groups == 0,
               f"mamba2 heads (d_inner/head_dim = {self.n_heads}) must be a multiple of "
               f"mamba2.n_groups ({self.n_groups})")
        _check(self.d_inner % self.norm_groups == 0,
               f"mamba2.d_inner ({self.d_inner}) must be a multiple of mamba2.norm_groups ({self.norm_groups})")
        _check(0 < self.dt_min <= self.dt_max, f"need 0 < mamba2.dt_min <= dt_max, got {self.dt_min}, {self.dt_max}")
        lo, hi = self.dt_limit
        _check(0.0 <= lo < hi, f"mamba2.dt_limit must be (lo, hi) with 0 <= lo < hi, got {self.dt_limit}")
        a, b = self.A_init_range
        _check(0 < a <= b, f"mamba2.A_init_range must be (lo, hi) with 0 < lo <= hi, got {self.A_init_range}")


@dataclass(frozen=True, kw_only=True)
class Mamba1Config(SubConfig):
    """Mamba-1 mixer (``m``): selective scan with a per-channel, per-state decay."""

    section: ClassVar[str] = "mamba1"
    symbol: ClassVar[str] = "m"
    mixer: ClassVar[bool] = True

    d_state: int = 16
    d_conv: int = 4
    expand: int = 2
    d_inner: int | None = None  # None: expand * d_model
    dt_rank: int | None = None  # None: ceil(d_model / 16)
    dt_min: float = 0.001
    dt_max: float = 0.1
    dt_init_floor: float = 1e-4
    conv_bias: bool = True
    proj_bias: bool = False
    inner_norms: bool = False  # RMSNorm on dt, B and C before use (Jamba)

    def resolved(self, d_model: int) -> Mamba1Config:
        return dataclasses.replace(
            self, d_inner=self.d_inner if self.d_inner is not None else self.expand * d_model,
            dt_rank=self.dt_rank if self.dt_rank is not None else math.ceil(d_model / 16))

    def _validate(self) -> None:
        for name in ("d_state", "d_conv", "expand", "d_inner", "dt_rank"):
            _check(getattr(self, name) >= 1, f"mamba1.{name} must be >= 1, got {getattr(self, name)}")
        _check(0 < self.dt_min <= self.dt_max, f"need 0 < mamba1.dt_min <= dt_max, got {self.dt_min}, {self.dt_max}")


@dataclass(frozen=True, kw_only=True)
class GatedDeltaNetConfig(SubConfig):
    """Gated DeltaNet mixer (``G``), as Qwen3-Next / flash-linear-attention: ``n_heads`` value heads with a
    ``[head_k_dim, head_v_dim]`` state each, ``n_k_heads`` query/key heads (each serving ``n_heads / n_k_heads``
    value heads), a ``d_conv``-tap causal conv on q/k/v."""

    section: ClassVar[str] = "gated_deltanet"
    symbol: ClassVar[str] = "G"
    mixer: ClassVar[bool] = True

    n_heads: int = 4
    n_k_heads: int | None = None  # None: n_heads
    head_k_dim: int | None = None  # None: d_model // n_heads
    head_v_dim: int | None = None  # None: head_k_dim
    d_conv: int = 4
    chunk_size: int = 64  # chunk of the chunked (WY/UT) prefill
    dt_min: float = 0.001
    dt_max: float = 0.1
    dt_init_floor: float = 1e-4
    A_init_range: tuple[float, float] = (1.0, 16.0)
    conv_bias: bool = False
    proj_bias: bool = False

    @property
    def conv_dim(self) -> int:
        """Channels of the conv (and of its state): q, k and v."""
        return 2 * self.n_k_heads * self.head_k_dim + self.n_heads * self.head_v_dim

    def resolved(self, d_model: int) -> GatedDeltaNetConfig:
        k_dim = self.head_k_dim if self.head_k_dim is not None else d_model // max(self.n_heads, 1)
        return dataclasses.replace(
            self, n_k_heads=self.n_k_heads if self.n_k_heads is not None else self.n_heads, head_k_dim=k_dim,
            head_v_dim=self.head_v_dim if self.head_v_dim is not None else k_dim,
            A_init_range=tuple(self.A_init_range))

    def _validate(self) -> None:
        for name in ("n_heads", "n_k_heads", "head_k_dim", "head_v_dim", "chunk_size"):
            _check(getattr(self, name) >= 1, f"gated_deltanet.{name} must be >= 1, got {getattr(self, name)}")
        _check(self.d_conv >= 2, f"gated_deltanet.d_conv must be >= 2 (a causal conv keeps d_conv - 1 inputs), "
               f"got {self.d_conv}")
        _check(self.n_heads % self.n_k_heads == 0,
               f"gated_deltanet.n_heads ({self.n_heads}) must be a multiple of gated_deltanet.n_k_heads "
               f"({self.n_k_heads}): each key head serves a whole number of value heads")
        _check(0 < self.dt_min <= self.dt_max,
               f"need 0 < gated_deltanet.dt_min <= dt_max, got {self.dt_min}, {self.dt_max}")
        a, b = self.A_init_range
        _check(0 < a <= b,
               f"gated_deltanet.A_init_range must be (lo, hi) with 0 < lo <= hi, got {self.A_init_range}")


# fla's GatedLinearAttention options that are kernel choices (its ``mode``: chunk / fused_chunk / fused_recurrent,
# all the same recurrence) have no field here: an unknown field is refused by name by from_dict.
GLA_GATE_FNS = ("swish",)  # fla's default output-gate activation (silu), the one its fused norm-and-gate takes


@dataclass(frozen=True, kw_only=True)
class GLAConfig(SubConfig):
    """GLA mixer (``L``, gated linear attention) as flash-linear-attention's ``GatedLinearAttention``: ``n_heads``
    heads with a ``[head_k_dim, head_v_dim]`` state each (``key_dim = d_model * expand_k`` split over the heads,
    likewise ``value_dim``), a per-key-dim decay ``logsigmoid(low-rank(x)) / gate_logit_normalizer``, an output
    gate ``silu(g_proj(x))`` after a per-head RMSNorm, ``n_kv_heads`` key/value/decay heads each shared by
    ``n_heads / n_kv_heads`` query heads, an optional ``d_conv``-tap causal conv (SiLU) on q/k/v."""

    section: ClassVar[str] = "gla"
    symbol: ClassVar[str] = "L"
    mixer: ClassVar[bool] = True

    n_heads: int = 4
    n_kv_heads: int | None = None  # None: n_heads
    expand_k: float = 0.5
    expand_v: float = 1.0
    key_dim: int | None = None  # None: int(d_model * expand_k) (fla's); a saved config states it
    value_dim: int | None = None  # None: int(d_model * expand_v)
    gate_low_rank_dim: int = 16
    gate_logit_normalizer: float = 16.0
    clamp_min: float | None = None  # lower bound of the log decay (fla's clamp_min); None: none
    use_output_gate: bool = True
    gate_fn: str = "swish"
    elementwise_affine: bool = True  # the per-head norm has a weight
    norm_eps: float = 1e-5
    # fla fuses the norm and the swish gate into one kernel when True; the two compute the same function, so this
    # is recorded (a config from fla keeps it) and changes nothing here
    fuse_norm: bool = True
    feature_map: str | None = None  # fla's optional feature map on q and k; only None (its default) is supported
    use_short_conv: bool = False
    d_conv: int = 4  # fla's conv_size
    conv_bias: bool = False
    chunk_size: int = 64  # chunk of the chunked prefill

    @property
    def head_k_dim(self) -> int:
        return self.key_dim // self.n_heads

    @property
    def head_v_dim(self) -> int:
        return self.value_dim // self.n_heads

    @property
    def kv_key_dim(self) -> int:
        """Width of k and of the decay gate (the ``n_kv_heads`` shared heads)."""
        return self.n_kv_heads * self.head_k_dim

    @property
    def kv_value_dim(self) -> int:
        return self.n_kv_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the short conv (and of its state): q, k and v."""
        return self.key_dim + self.kv_key_dim + self.kv_value_dim

    def resolved(self, d_model: int) -> GLAConfig:
        return dataclasses.replace(
            self, n_kv_heads=self.n_kv_heads if self.n_kv_heads is not None else self.n_heads,
            key_dim=self.key_dim if self.key_dim is not None else int(d_model * self.expand_k),
            value_dim=self.value_dim if self.value_dim is not None else int(d_model * self.expand_v))

    def _validate(self) -> None:
        for name in ("n_heads", "n_kv_heads", "key_dim", "value_dim", "gate_low_rank_dim", "chunk_size"):
            _check(getattr(self, name) >= 1, f"gla.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("key_dim", "value_dim"):
            _check(getattr(self, name) % self.n_heads == 0,
                   f"gla.{name} ({getattr(self, name)}: d_model x gla.expand_{name[0]} unless set) must be a multiple "
                   f"of gla.n_heads ({self.n_heads})")
        _check(self.n_heads % self.n_kv_heads == 0,
               f"gla.n_heads ({self.n_heads}) must be a multiple of gla.n_kv_heads ({self.n_kv_heads}): each "
               f"key/value head serves a whole number of heads")
        _check(self.gate_logit_normalizer > 0,
               f"gla.gate_logit_normalizer must be > 0, got {self.gate_logit_normalizer}")
        _check(self.clamp_min is None or self.clamp_min < 0,
               f"gla.clamp_min bounds a log decay (<= 0) from below: it must be None or < 0, got {self.clamp_min}")
        _check(self.gate_fn in GLA_GATE_FNS,
               f"gla.gate_fn {self.gate_fn!r} is not supported; choose one of {GLA_GATE_FNS}")
        _check(self.feature_map is None,
               f"gla.feature_map {self.feature_map!r} is not supported; only None (fla's default: q and k as "
               f"projected)")
        _check(self.norm_eps > 0, f"gla.norm_eps must be > 0, got {self.norm_eps}")
        _check(not self.use_short_conv or self.d_conv >= 2,
               f"gla.d_conv must be >= 2 with use_short_conv (a causal conv keeps d_conv - 1 inputs), got "
               f"{self.d_conv}")


@dataclass(frozen=True, kw_only=True)
class MLPConfig(SubConfig):
    """MLP (``-``): ``down(act(gate(x)) * up(x))`` when gated (SwiGLU), else ``down(act(up(x)))``."""

    section: ClassVar[str] = "mlp"
    symbol: ClassVar[str] = "-"
    mixer: ClassVar[bool] = False

    d_ff: int | None = None  # None: 8/3 d_model (gated) or 4 d_model, rounded up to a multiple of 64
    activation: str = "silu"
    gated: bool = True
    bias: bool = False

    def resolved(self, d_model: int) -> MLPConfig:
        return dataclasses.replace(self, d_ff=_resolved_d_ff(self.d_ff, self.gated, d_model))

    def _validate(self) -> None:
        _check(self.d_ff >= 1, f"mlp.d_ff must be >= 1, got {self.d_ff}")
        _check(self.activation in ACTIVATIONS,
               f"mlp.activation {self.activation!r} is not supported; choose one of {ACTIVATIONS}")


@dataclass(frozen=True, kw_only=True)
class MoEConfig(SubConfig):
    """Mixture-of-experts MLP (``E``), as in Jamba/Mixtral: a bias-free linear router, softmax over all
    experts (fp32), the ``top_k`` largest probabilities picked per token, and the token's output the sum
    of its picked experts' MLP outputs weighted by those probabilities (renormalised to sum to 1 when
    ``normalize_top_k``, as Mixtral does; Jamba does not)."""

    section: ClassVar[str] = "moe"
    symbol: ClassVar[str] = "E"
    mixer: ClassVar[bool] = False

    n_experts: int = 8
    top_k: int = 2
    d_ff: int | None = None  # width of each expert; None: as MLPConfig derives it
    activation: str = "silu"
    gated: bool = True
    normalize_top_k: bool = False
    # A shared expert every token also runs through (Qwen2-MoE / Qwen3-Next): a dense MLP of this width with the
    # experts' activation, added to the routed sum (times sigmoid(shared_expert_gate(x)) when shared_gate). 0: none.
    shared_d_ff: int = 0
    shared_gate: bool = False

    def resolved(self, d_model: int) -> MoEConfig:
        return dataclasses.replace(self, d_ff=_resolved_d_ff(self.d_ff, self.gated, d_model))

    def _validate(self) -> None:
        _check(self.shared_d_ff >= 0, f"moe.shared_d_ff must be >= 0 (0: no shared expert), got {self.shared_d_ff}")
        _check(self.shared_d_ff > 0 or not self.shared_gate,
               "moe.shared_gate=True needs a shared expert (moe.shared_d_ff > 0)")
        _check(self.n_experts >= 1, f"moe.n_experts must be >= 1, got {self.n_experts}")
        _check(1 <= self.top_k <= self.n_experts,
               f"moe.top_k must be in [1, moe.n_experts = {self.n_experts}], got {self.top_k}")
        _check(self.d_ff >= 1, f"moe.d_ff must be >= 1, got {self.d_ff}")
        _check(self.activation in ACTIVATIONS,
               f"moe.activation {self.activation!r} is not supported; choose one of {ACTIVATIONS}")


@dataclass(frozen=True, kw_only=True)
class HybridConfig:
    """Whole-model configuration. ``pattern`` has one symbol per residual sub-layer
    (``M`` Mamba-2, ``m`` Mamba-1, ``G`` Gated DeltaNet, ``L`` GLA, ``*`` attention, ``-`` MLP, ``E`` mixture-of-experts
    MLP)."""

    vocab_size: int
    d_model: int
    pattern: str
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    mamba2: Mamba2Config = field(default_factory=Mamba2Config)
    mamba1: Mamba1Config = field(default_factory=Mamba1Config)
    gated_deltanet: GatedDeltaNetConfig = field(default_factory=GatedDeltaNetConfig)
    gla: GLAConfig = field(default_factory=GLAConfig)
    mlp: MLPConfig = field(default_factory=MLPConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    initializer_range: float = 0.02
    # The RMSNorms before each sub-layer, the final norm and attention's q/k norms scale by
    # (norm_offset + weight): 1.0 is the zero-centred form of Qwen3-Next and Gemma (weights start at 0).
    norm_offset: float = 0.0

    def __post_init__(self) -> None:
        _check(isinstance(self.vocab_size, int) and self.vocab_size >= 1,
               f"vocab_size must be a positive int, got {self.vocab_size!r}")
        _check(isinstance(self.d_model, int) and self.d_model >= 1,
               f"d_model must be a positive int, got {self.d_model!r}")
        _check(self.norm_eps > 0, f"norm_eps must be > 0, got {self.norm_eps}")
        _check(self.norm_offset in (0.0, 1.0),
               f"norm_offset must be 0.0 (weight) or 1.0 (1 + weight, zero-centred), got {self.norm_offset}")
        kinds = parse_pattern(self.pattern)
        for name, cls in SUBCONFIGS.items():
            _check(isinstance(getattr(self, name), cls),
                   f"{name} must be a {cls.__name__}, got {type(getattr(self, name)).__name__}")
        self._resolve_sizes()
        for name in SUBCONFIGS:
            if name in kinds:  # sub-configs the pattern does not use are not validated
                getattr(self, name)._validate()

    def _resolve_sizes(self) -> None:
        for name in SUBCONFIGS:
            object.__setattr__(self, name, getattr(self, name).resolved(self.d_model))

    # ---- pattern facts -------------------------------------------------------------------------
    @property
    def layer_kinds(self) -> tuple[str, ...]:
        return parse_pattern(self.pattern)

    @property
    def n_layers(self) -> int:
        return len(self.pattern)

    def count(self, kind: str) -> int:
        return sum(k == kind for k in self.layer_kinds)

    # ---- JSON round trip -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for name in SUBCONFIGS:
            out[name] = getattr(self, name).to_dict()
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HybridConfig:
        d = dict(d)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        _check(not unknown, f"unknown HybridConfig fields {unknown}; known: {sorted(known)}")
        required = sorted(f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING
                          and f.default_factory is dataclasses.MISSING and f.name not in d)
        _check(not required, f"the config lacks the required fields {required}")
        for name, sub_cls in SUBCONFIGS.items():
            if name in d and isinstance(d[name], dict):
                d[name] = sub_cls.from_dict(d[name])
        return cls(**d)

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=2)
        if path is not None:
            Path(path).write_text(text + "\n")
        return text

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> HybridConfig:
        p = Path(text_or_path) if not str(text_or_path).lstrip().startswith("{") else None
        text = p.read_text() if p is not None else str(text_or_path)
        return cls.from_dict(json.loads(text))


# A sub-config without its HybridConfig field would be registered (its symbol parses) but never built: say so
# where the kind is added rather than at the first model that uses it.
_missing = sorted(set(SUBCONFIGS) - {f.name for f in dataclasses.fields(HybridConfig)})
if _missing:
    raise TypeError(f"config sections {_missing} have no HybridConfig field; add `{_missing[0]}: ...` to it")
