"""The one table from a layer kind (a pattern symbol's meaning, see :mod:`hybrid.pattern`) to the class
that implements it. Each class says how it is built (``from_config``; a kind reads the HybridConfig
section of its own name, which is all that config validation needs to know) and what it caches during
inference (``cache_spec``: an attention or constant-state spec, or None); the model, the caches and the
reports ask this table instead of switching on kinds, and :func:`cache_specs` collects a model's specs."""

from __future__ import annotations

from torch import nn

from ..cache.specs import CacheDtypes, ModelCacheSpec
from ..config import SUBCONFIGS, HybridConfig
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
