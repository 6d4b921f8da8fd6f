"""The one table from a layer kind (a pattern symbol's meaning, see :mod:`hybrid.pattern`) to the class
that implements it. Each class says how it is built (``from_config``; a kind reads the HybridConfig
section of its own name, which is all that config validation needs to know), what it caches during
inference (``cache_spec``: an attention or constant-state spec, or None) and, optionally, how its decode
sub-layer lowers into the native decode program (``lower_decode``, see docs/adding-a-mixer.md); the model,
the caches and the reports ask this table instead of switching on kinds, and :func:`cache_specs` collects a
model's specs. The library's own kinds each have a config section; :func:`register_layer` adds a kind from
outside (a test, an experiment) whose sizes follow from the HybridConfig's shared fields."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from ..cache.specs import CacheDtypes, ModelCacheSpec
from ..config import SUBCONFIGS, HybridConfig
from ..pattern import SYMBOLS, register_symbol, unregister_symbol
from .attention import Attention
from .gated_deltanet import GatedDeltaNet
from .gla import GLA
from .mamba1 import Mamba1
from .mamba2 import Mamba2
from .mlp import MLP
from .moe import MoE

LAYER_CLASSES: dict[str, type[nn.Module]] = {
    cls.kind: cls for cls in (Attention, Mamba2, Mamba1, GatedDeltaNet, GLA, MLP, MoE)}
# every config section (hybrid.config.SubConfig: a kind with a pattern symbol) needs its class here, and only those
if set(LAYER_CLASSES) != set(SUBCONFIGS):
    raise TypeError(f"layer kinds with a config section but no layer class: "
                    f"{sorted(set(SUBCONFIGS) - set(LAYER_CLASSES))}; with a class but no config section: "
                    f"{sorted(set(LAYER_CLASSES) - set(SUBCONFIGS))}")


def register_layer(cls: type[nn.Module], *, symbol: str, mixer: bool = True) -> Callable[[], None]:
    """Add layer kind ``cls.kind`` with pattern ``symbol`` (a sequence mixer when ``mixer``), built by
    ``cls.from_config(cfg)`` from the config's shared fields (``d_model``, ``norm_eps``: no section of its own),
    caching what ``cls.cache_spec`` says. Returns the undo (the kind and its symbol gone again). The library's own
    kinds add a config section instead (hybrid.config.SubConfig) and are listed in LAYER_CLASSES above."""
    kind = getattr(cls, "kind", None)
    if not isinstance(kind, str) or not kind:
        raise ValueError(f"{cls.__name__} needs a class attribute kind (the layer kind's name, e.g. 'toy_conv')")
    if kind in LAYER_CLASSES:
        raise ValueError(f"layer kind {kind!r} is taken by {LAYER_CLASSES[kind].__name__}; pick another name")
    missing = [m for m in ("from_config", "cache_spec", "flops_per_token") if not hasattr(cls, m)]
    if missing:
        raise TypeError(f"{cls.__name__} lacks {', '.join(missing)} (docs/adding-a-mixer.md lists what a kind defines)")
    if symbol in SYMBOLS:
        raise ValueError(f"pattern symbol {symbol!r} is taken by {SYMBOLS[symbol]!r}; pick another for {kind!r}")
    register_symbol(symbol, kind, mixer=mixer)
    LAYER_CLASSES[kind] = cls

    def undo() -> None:
        LAYER_CLASSES.pop(kind, None)
        unregister_symbol(symbol)

    return undo


def layer_class(kind: str) -> type[nn.Module]:
    try:
        return LAYER_CLASSES[kind]
    except KeyError:
        raise ValueError(f"unknown layer kind {kind!r}; known: {sorted(LAYER_CLASSES)}") from None


def cache_specs(config: HybridConfig, dtypes: CacheDtypes) -> ModelCacheSpec:
    """The cache spec of every layer of ``config`` that caches something (as its layer class declares)."""
    specs = {}
    for i, kind in enumerate(config.layer_kinds):
        spec = layer_class(kind).cache_spec(config, dtypes)
        if spec is not None:
            specs[i] = spec
    return ModelCacheSpec(specs)
