"""Named model configs: ``hybrid.recipes.get("hybrid-1to7-small")``.

Each family comes at three sizes: ``tiny`` (d_model 64, byte vocab; for tests, seconds on a CPU),
``small`` (d_model 768, 32k vocab, ~90-115M parameters, like mamba-130m / GPT-2 small) and ``d512``
(d_model 512, 32k vocab, 8 blocks / 8 Mamba layers, untied head: the weights the llama.cpp comparison,
``benchmarks/llamacpp.py``, runs on both sides).

| family        | pattern                                   | after                         |
|---------------|-------------------------------------------|-------------------------------|
| llama         | ``*-`` repeated (GQA + SwiGLU)            | Llama                         |
| mamba2        | ``M`` repeated                            | mamba_ssm Mamba-2             |
| mamba1        | ``m`` repeated                            | mamba_ssm Mamba               |
| hybrid-1to7   | 1 attention per 8 Mamba-2 blocks, + MLPs  | Bamba                         |
| jamba         | 1 attention per 8 Mamba-1 blocks (4th)    | Jamba (dense MLP)             |
| jamba-moe     | as jamba, top-2 experts every other block | Jamba (exports to it exactly) |
| nemotronh     | ``M-M-M-M*-`` (no RoPE, squared-ReLU MLP) | NemotronH                     |
| samba         | ``m-*-`` with sliding-window attention    | Samba                         |
| gdn           | ``G`` repeated (Gated DeltaNet)           | flash-linear-attention GDN    |
| qwen3next-like| ``G-G-G-*-`` (3 Gated DeltaNet : 1 attn)  | Qwen3-Next (dense MLP, plain  |
|               |                                           | GQA: no MoE, no output gate)  |
| gla           | ``L-`` repeated (GLA + SwiGLU)            | flash-linear-attention GLA    |
| gla-hybrid    | ``L-L-L-*-`` (3 GLA : 1 attn), GLA with   | fla GLA options: short conv,  |
|               | the short conv and shared k/v heads       | num_kv_heads                  |

The Gated DeltaNet state of each size holds as many elements as its Mamba-2 layer's SSM state (``small``:
12 value heads x 128 x 128 = 1536 x 128), so the two mixers compare at equal state bytes. GLA takes fla's defaults
(4 heads, ``expand_k`` 0.5, ``expand_v`` 1: ``small`` 4 x 96 x 192 per layer) and, as fla's GLA models, an MLP
after each mixer; ``gla-hybrid`` turns on the options the plain family leaves off, so the tiny recipes cover both
state layouts (``recurrent`` alone; ``conv`` and ``recurrent``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ..config import (
    AttentionConfig,
    GatedDeltaNetConfig,
    GLAConfig,
    HybridConfig,
    Mamba1Config,
    Mamba2Config,
    MLPConfig,
    MoEConfig,
)
from ..pattern import blocks_pattern, ratio_pattern

_SIZES = {
    "tiny": dict(d_model=64, vocab_size=256, tie_embeddings=False,
                 attention=AttentionConfig(n_heads=4, n_kv_heads=2, head_dim=16),
                 mamba2=Mamba2Config(d_state=16, head_dim=16, chunk_size=16),
                 mamba1=Mamba1Config(d_state=8),
                 # chunks of 16 so test prompts cross chunk boundaries of the chunked delta rule
                 gated_deltanet=GatedDeltaNetConfig(n_heads=4, n_k_heads=2, head_k_dim=16, head_v_dim=16,
                                                    chunk_size=16),
                 gla=GLAConfig(n_heads=4, chunk_size=16),  # K 8, V 16; chunks of 16, as the delta rule's
                 mlp=MLPConfig(d_ff=128)),
    "small": dict(d_model=768, vocab_size=32000, tie_embeddings=True,
                  attention=AttentionConfig(n_heads=12, n_kv_heads=4, head_dim=64),
                  mamba2=Mamba2Config(d_state=128, head_dim=64, chunk_size=256),
                  mamba1=Mamba1Config(d_state=16),
                  gated_deltanet=GatedDeltaNetConfig(n_heads=12, n_k_heads=6, head_k_dim=128, head_v_dim=128),
                  gla=GLAConfig(n_heads=4),
                  mlp=MLPConfig(d_ff=2048)),
    # GQA 8/2 x 64 as llama.cpp's Llama runs it; the head untied so every exporter and llama.cpp converter
    # writes the same separate output matrix; d_ff 1408 ~ 8/3 d_model, rounded to 64
    "d512": dict(d_model=512, vocab_size=32000, tie_embeddings=False,
                 attention=AttentionConfig(n_heads=8, n_kv_heads=2, head_dim=64),
                 mamba2=Mamba2Config(d_state=128, head_dim=64, chunk_size=256),
                 mamba1=Mamba1Config(d_state=16),
                 gated_deltanet=GatedDeltaNetConfig(n_heads=8, n_k_heads=4, head_k_dim=128, head_v_dim=128),
                 gla=GLAConfig(n_heads=4),
                 mlp=MLPConfig(d_ff=1408)),
}
# Depth per size: (blocks for families with MLPs, layers for pure Mamba stacks)
_DEPTH = {"tiny": (4, 4), "small": (12, 24), "d512": (8, 8)}
_WINDOW = {"tiny": 16, "small": 2048, "d512": 2048}


def _make(size: str, pattern: str, **changes) -> HybridConfig:
    base = dict(_SIZES[size])
    base.update(changes)
    return HybridConfig(pattern=pattern, **base)


def _llama(size):
    return _make(size, "*-" * _DEPTH[size][0])


def _mamba2(size):
    return _make(size, "M" * _DEPTH[size][1])


def _mamba1(size):
    return _make(size, "m" * _DEPTH[size][1])


def _hybrid_1to7(size):
    return _make(size, blocks_pattern(8, "M", attn_every=8))


def _jamba(size):
    return _make(size, blocks_pattern(8, "m", attn_every=8, attn_offset=4))


def _jamba_moe(size):
    """Jamba's layout: no RoPE, dt/B/C norms in the Mamba-1 layers, experts (top-2) in odd blocks.
    ``small`` has ~220M parameters of which ~110M are active per token."""
    base = _SIZES[size]
    a, d_ff = base["attention"], base["mlp"].d_ff
    pattern = blocks_pattern(8, "m", attn_every=8, attn_offset=4)
    pattern = "".join(s if i % 4 != 3 else "E" for i, s in enumerate(pattern))  # FFN of every odd block
    return _make(size, pattern,
                 attention=AttentionConfig(n_heads=a.n_heads, n_kv_heads=a.n_kv_heads, head_dim=a.head_dim,
                                           rotary_fraction=0.0),
                 mamba1=Mamba1Config(d_state=base["mamba1"].d_state, inner_norms=True),
                 moe=MoEConfig(n_experts=4 if size == "tiny" else 8, top_k=2, d_ff=d_ff))


def _nemotronh(size):
    base = _SIZES[size]
    d_ff = 256 if size == "tiny" else 4 * base["d_model"]
    return _make(size, "M-M-M-M*-" * (1 if size == "tiny" else 2),
                 attention=AttentionConfig(n_heads=base["attention"].n_heads,
                                           n_kv_heads=base["attention"].n_kv_heads,
                                           head_dim=base["attention"].head_dim, rotary_fraction=0.0),
                 mlp=MLPConfig(d_ff=d_ff, activation="relu2", gated=False))


def _samba(size):
    a = _SIZES[size]["attention"]
    return _make(size, "m-*-" * (_DEPTH[size][0] // 2),
                 attention=AttentionConfig(n_heads=a.n_heads, n_kv_heads=a.n_kv_heads, head_dim=a.head_dim,
                                           sliding_window=_WINDOW[size]))


def _gdn(size):
    return _make(size, "G" * _DEPTH[size][1])


def _qwen3next_like(size):
    """Qwen3-Next's layout: three Gated DeltaNet blocks then one attention block, each with its MLP."""
    return _make(size, blocks_pattern(_DEPTH[size][0], "G", attn_every=4))


def _gla(size):
    return _make(size, "L-" * _DEPTH[size][0])


def _gla_hybrid(size):
    """Three GLA blocks then one attention block; the GLA with fla's short conv and 2 shared key/value heads."""
    gla = dataclasses.replace(_SIZES[size]["gla"], n_kv_heads=2, use_short_conv=True)
    return _make(size, blocks_pattern(_DEPTH[size][0], "L", attn_every=4), gla=gla)


_FAMILIES: dict[str, Callable[[str], HybridConfig]] = {
    "llama": _llama,
    "mamba2": _mamba2,
    "mamba1": _mamba1,
    "hybrid-1to7": _hybrid_1to7,
    "jamba": _jamba,
    "jamba-moe": _jamba_moe,
    "nemotronh": _nemotronh,
    "samba": _samba,
    "gdn": _gdn,
    "qwen3next-like": _qwen3next_like,
    "gla": _gla,
    "gla-hybrid": _gla_hybrid,
}


def names() -> list[str]:
    return [f"{fam}-{size}" for fam in _FAMILIES for size in _SIZES]


def get(name: str) -> HybridConfig:
    """The config of recipe ``name`` (e.g. ``"jamba-tiny"``); unknown names list the known ones."""
    fam, _, size = name.rpartition("-")
    if fam not in _FAMILIES or size not in _SIZES:
        raise KeyError(f"unknown recipe {name!r}; known recipes: {', '.join(names())}")
    return _FAMILIES[fam](size)


# The constant-state mixers a tradeoff family can be built with (``hybrid tradeoff --mixer``): name -> symbol
FAMILY_MIXERS = {"mamba2": "M", "gdn": "G", "gla": "L"}
# how the tradeoff report names a family's pure constant-state member
FAMILY_MIXER_NAMES = {"mamba2": "Mamba-2", "gdn": "Gated DeltaNet", "gla": "GLA"}


def attention_family(size: str, share: float, n_blocks: int = 8, *, mlp: bool = True,
                     mixer: str = "mamba2") -> HybridConfig:
    """One member of a same-width family whose attention share of mixers is ``share`` (0..1):
    ``n_blocks`` blocks of (mixer, MLP), ``mixer`` (a name of ``FAMILY_MIXERS``: Mamba-2, Gated DeltaNet or GLA)
    for the constant-state mixers, attention spread evenly; ``mlp=False``: the mixers alone (``MMM*`` instead
    of ``M-M-M-*-``), the pure sequence-mixer stacks of the MQAR accuracy family."""
    if size not in _SIZES:
        raise KeyError(f"unknown size {size!r}; known sizes: {list(_SIZES)}")
    if mixer not in FAMILY_MIXERS:
        raise ValueError(f"unknown family mixer {mixer!r}; choose one of {sorted(FAMILY_MIXERS)}")
    return _make(size, ratio_pattern(n_blocks, share, FAMILY_MIXERS[mixer], mlp=mlp))
