"""``EngineConfig``: every setting of a :class:`hybrid.Engine` in one frozen, validated value (vLLM's
``EngineArgs`` -> ``VllmConfig``): the CLI, the server, eval, the benchmarks and the distill data build it once and
hand it over, instead of mapping a dozen keyword arguments by hand at each call site.

A wrong value is refused when the config is built, in one line naming the field, the value and what is allowed;
what depends on the model (does a checkpoint fit, how long may a request be) is checked when the engine builds its
cache. :meth:`EngineConfig.to_dict` / :meth:`EngineConfig.from_dict` round-trip it through JSON, so a benchmark
record can store the exact engine it ran (a draft model is named, not stored: ``from_dict`` takes it back as an
argument). The command-line flags for these fields are defined once, in :mod:`hybrid.cli.engine_args`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields

import torch

from ..cache.pruning import SnapKV, StreamingLLM, parse_policy, policy_text
from ..kernels.kv_quant import KV_DTYPES, STATE_DTYPES, parse_dtype
from ..speculative.config import SpeculativeConfig

# the fields that must be ints >= the bound (None allowed where the default is None)
_AT_LEAST = {"max_seqs": 1, "max_batch_tokens": 1, "block_size": 1, "multi_step": 1, "long_prefill_tokens": 1,
             "num_blocks": 0, "cache_bytes": 1, "prefix_state_bytes": 0, "prefix_checkpoint_interval": 1,
             "max_model_len": 2, "max_prompt_tokens": 1}
_WHY = {"max_model_len": " (a prompt token and a generated one)",
        "multi_step": " (1: one decode step per call of step())",
        "num_blocks": " (0: a cache without KV blocks, for models without attention)"}


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """How an :class:`hybrid.Engine` batches, caches and runs (the defaults are ``Engine(model)``'s).

    Batching: ``max_seqs`` state slots (sequences in flight); ``max_batch_tokens`` tokens a step (longer prompts
    are prefilled in chunks); a prompt with more than ``long_prefill_tokens`` left to prefill (default:
    ``max_batch_tokens``) takes only the budget the others leave. ``multi_step``: up to that many greedy decode
    steps in one native call on a CPU.

    Cache: ``num_blocks`` KV blocks of ``block_size`` tokens, or ``cache_bytes`` (default 256 MiB when neither is
    given; not both); ``kv_dtype`` (bfloat16, float16, float32, int8, fp8) and ``state_dtype`` (float32, bfloat16,
    int8) compress it (None: K/V in the model's dtype, SSM state fp32), ``stochastic_state`` rounds state writes
    stochastically; ``kv_pruning`` is a :class:`~hybrid.cache.pruning.StreamingLLM` /
    :class:`~hybrid.cache.pruning.SnapKV` or its ``--kv-pruning`` text (``"snapkv:budget=256"``).

    Prefix cache: ``prefix_caching`` on; Mamba checkpoints take at most ``prefix_state_bytes`` (default 256 MiB),
    one every ``prefix_checkpoint_interval`` prompt tokens as well (None: at branch points and ends only);
    ``prefix_flop_weight`` weighs FLOPs saved per byte against recency in eviction.

    ``speculative``: a :class:`~hybrid.speculative.SpeculativeConfig`. ``compile``: the decode step through
    ``torch.compile`` with ``compile_backend``. ``max_model_len`` / ``max_prompt_tokens``: the longest request and
    prompt accepted (None: what the cache holds for one sequence; see :class:`hybrid.Engine`).
    """

    max_seqs: int = 16
    max_batch_tokens: int = 512
    long_prefill_tokens: int | None = None
    multi_step: int = 1
    num_blocks: int | None = None
    cache_bytes: int | None = None
    block_size: int = 16
    kv_dtype: str | None = None
    state_dtype: str | None = None
    stochastic_state: bool = False
    kv_pruning: StreamingLLM | SnapKV | None = None
    prefix_caching: bool = False
    prefix_state_bytes: int | None = None
    prefix_checkpoint_interval: int | None = None
    prefix_flop_weight: float = 1.0
    speculative: SpeculativeConfig | None = None
    compile: bool = False
    compile_backend: str = "inductor"
    max_model_len: int | None = None
    max_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        for name, least in _AT_LEAST.items():
            value = getattr(self, name)
            optional = _field(name).default is None
            if (value is None and optional) or (_is_int(value) and value >= least):
                continue
            allowed = f"an int >= {least}{_WHY.get(name, '')}" + (" or None" if optional else "")
            raise ValueError(f"EngineConfig {name}={value!r}: must be {allowed}")
        for name in ("stochastic_state", "prefix_caching", "compile"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"EngineConfig {name}={getattr(self, name)!r}: must be True or False")
        w = self.prefix_flop_weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not (0 <= w < math.inf):
            raise ValueError(f"EngineConfig prefix_flop_weight={w!r}: must be a finite number >= 0 (0: evict the "
                             "least recently used first)")
        if not isinstance(self.compile_backend, str) or not self.compile_backend:
            raise ValueError(f"EngineConfig compile_backend={self.compile_backend!r}: must be a torch.compile backend "
                             "name (inductor, aot_eager, ...)")
        if self.num_blocks is not None and self.cache_bytes is not None:
            raise ValueError(f"EngineConfig num_blocks={self.num_blocks} and cache_bytes={self.cache_bytes}: size the "
                             "cache with exactly one of num_blocks= or cache_bytes=")
        # canonical names (not torch dtypes) keep the config comparable and JSON-able
        object.__setattr__(self, "kv_dtype", _dtype_name(self.kv_dtype, KV_DTYPES, "kv_dtype"))
        object.__setattr__(self, "state_dtype", _dtype_name(self.state_dtype, STATE_DTYPES, "state_dtype"))
        if isinstance(self.kv_pruning, str):
            try:
                object.__setattr__(self, "kv_pruning", parse_policy(self.kv_pruning))
            except ValueError as e:
                raise ValueError(f"EngineConfig kv_pruning={self.kv_pruning!r}: {e}") from None
        if self.kv_pruning is not None and not isinstance(self.kv_pruning, (StreamingLLM, SnapKV)):
            raise TypeError(f"EngineConfig kv_pruning={self.kv_pruning!r}: must be a StreamingLLM or SnapKV, their "
                             "text (snapkv:budget=N or streaming:sinks=S,window=W) or None")
        if self.kv_pruning is not None and self.prefix_caching:
            raise ValueError(f"kv_pruning with prefix_caching is not supported ({type(self.kv_pruning).__name__}): a "
                             "pruned sequence's blocks are not the prompt's whole prefix; turn one of them off")
        if not self.prefix_caching and (self.prefix_state_bytes is not None
                                        or self.prefix_checkpoint_interval is not None):
            raise ValueError("EngineConfig prefix_state_bytes / prefix_checkpoint_interval need prefix_caching=True")
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise TypeError(f"EngineConfig speculative={self.speculative!r}: must be a "
                             "hybrid.speculative.SpeculativeConfig or None")
        if (self.max_model_len is not None and self.max_prompt_tokens is not None
                and self.max_prompt_tokens >= self.max_model_len):
            raise ValueError(f"max_prompt_tokens={self.max_prompt_tokens} leaves no room to generate within "
                             f"max_model_len={self.max_model_len}; give max_prompt_tokens <= {self.max_model_len - 1}")

    def replace(self, **changes) -> EngineConfig:
        """A copy with ``changes`` (checked again); an unknown name is a ValueError listing the fields."""
        _check_names(changes, "EngineConfig.replace")
        return dataclasses.replace(self, **changes)

    # ---- JSON ------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """Plain JSON values: pruning as its ``--kv-pruning`` text, speculation as its fields with the draft
        model named by class (a model is not a setting that JSON can carry)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.kv_pruning is not None:
            out["kv_pruning"] = policy_text(self.kv_pruning)
        if self.speculative is not None:
            spec = {f.name: getattr(self.speculative, f.name) for f in fields(self.speculative)}
            if spec["draft_model"] is not None:
                spec["draft_model"] = type(spec["draft_model"]).__name__
            out["speculative"] = spec
        return out

    @classmethod
    def from_dict(cls, data: dict, *, draft_model=None) -> EngineConfig:
        """The config :meth:`to_dict` wrote (missing fields take their defaults); ``draft_model``: the model of a
        ``method="draft"`` speculative config, which the dict only names."""
        if not isinstance(data, dict):
            raise ValueError(f"EngineConfig.from_dict needs a dict (what to_dict wrote), got {type(data).__name__}")
        _check_names(data, "EngineConfig.from_dict")
        data = dict(data)
        spec = data.get("speculative")
        if isinstance(spec, dict):
            spec = dict(spec)
            if spec.get("method") == "draft":
                if draft_model is None:
                    raise ValueError(f"this EngineConfig speculates with a draft model ({spec.get('draft_model')}), "
                                     "which JSON does not carry: pass it as from_dict(..., draft_model=MODEL)")
                spec["draft_model"] = draft_model
            data["speculative"] = SpeculativeConfig(**spec)
        return cls(**data)

    @classmethod
    def from_args(cls, args, **overrides) -> EngineConfig:
        """The config of parsed command-line flags (:func:`hybrid.cli.engine_args.add_engine_args`): every field
        the parser defined, then ``overrides`` (what the sub-command decides itself: a cache sized for one prompt,
        the speculative config built with the model)."""
        _check_names(overrides, "EngineConfig.from_args")
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        values.pop("speculative", None)  # --draft-model / --ngram need the model: the sub-command builds it
        return cls(**{**values, **overrides})


def _field(name: str):
    return next(f for f in fields(EngineConfig) if f.name == name)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _dtype_name(value, allowed: dict[str, torch.dtype], what: str) -> str | None:
    try:
        dtype = parse_dtype(value, allowed, what)
    except ValueError as e:
        raise ValueError(f"EngineConfig {e}") from None
    return None if dtype is None else next(name for name, d in allowed.items() if d == dtype)


def _check_names(names, where: str) -> None:
    known = {f.name for f in fields(EngineConfig)}
    unknown = sorted(set(names) - known)
    if unknown:
        raise ValueError(f"{where}: no engine setting named {', '.join(map(repr, unknown))}; the settings are "
                         f"{', '.join(sorted(known))}")
