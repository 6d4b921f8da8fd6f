"""Small helpers the converters share: refusing options, reading RoPE settings, activations, tied heads."""

from __future__ import annotations

import math

import torch

from ..checkpoint import CheckpointError
from ..config import ROPE_SCALING_KEYS

# Hugging Face ``hidden_act`` names -> our MLPConfig.activation (same function, not an approximation:
# "gelu_new" is the tanh formula that F.gelu(approximate="tanh") computes).
HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
                  "gelu_new": "gelu_tanh", "relu": "relu", "relu2": "relu2"}
# ... and back, for export (one canonical HF name per activation).
ACTIVATIONS_TO_HF = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu",
                     "relu2": "relu2"}


def refuse(arch: str, what: str) -> CheckpointError:
    """The error for a checkpoint option we do not implement exactly (raise it)."""
    return CheckpointError(f"{arch}: {what} is not supported, and loading it approximately would give wrong "
                           f"outputs; refusing to load")


def activation_from_hf(arch: str, name: str, key: str = "hidden_act") -> str:
    if name not in HF_ACTIVATIONS:
        raise refuse(arch, f"{key}={name!r} (supported: {sorted(HF_ACTIVATIONS)})")
    return HF_ACTIVATIONS[name]


def rope_from_hf(arch: str, hf: dict) -> tuple[float, dict | None, float]:
    """(rope_theta, rope_scaling, partial_rotary_factor) from a config in either the transformers 5
    form (``rope_parameters``) or the older one (top-level ``rope_theta`` + ``rope_scaling``)."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
    partial = params.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    kind = params.pop("rope_type", params.pop("type", "default"))
    if kind == "default":
        return float(theta), None, float(partial)
    if kind not in ROPE_SCALING_KEYS:
        raise refuse(arch, f"RoPE scaling type {kind!r} (supported: default, {', '.join(sorted(ROPE_SCALING_KEYS))})")
    need = ROPE_SCALING_KEYS[kind]
    if kind == "llama3" and "original_max_position_embeddings" not in params:
        # transformers falls back to max_position_embeddings for this key
        params["original_max_position_embeddings"] = hf.get("max_position_embeddings")
    missing = [k for k in need if params.get(k) is None]
    extra = sorted(set(params) - set(need))
    if missing:
        raise CheckpointError(f"{arch}: RoPE scaling {kind!r} lacks {missing} in its config")
    if extra:
        raise refuse(arch, f"RoPE scaling {kind!r} with the extra settings {extra}")
    return float(theta), {"rope_type": kind, **{k: params[k] for k in need}}, float(partial)


def rope_to_hf(theta: float, scaling: dict | None) -> dict:
    """The ``rope_parameters`` dict transformers 5 writes (it also reads the older top-level keys)."""
    return {"rope_type": "default", "rope_theta": theta} if scaling is None else {"rope_theta": theta, **scaling}


def drop_tied_head(arch: str, state: dict[str, torch.Tensor], head: str, embed: str) -> None:
    """A tied model has no head of its own; a checkpoint may still store it as a copy of the embedding."""
    if head in state:
        if embed in state and not torch.equal(state[head], state[embed]):
            raise CheckpointError(f"{arch}: the config ties the embeddings, but {head} differs from {embed}")
        del state[head]


# Our models have no length limit; serving stacks cap the context at max_position_embeddings (vLLM's
# max_model_len, llama.cpp's context_length), so exports write it generously rather than leave each
# architecture's small default (GraniteMoeHybrid's is 2048).
EXPORT_MAX_POSITIONS = 131072

FLOAT_TAG = "__float__"  # how transformers 5 writes non-finite floats into config.json


def hf_float(v) -> float:
    """A float from a config.json: transformers 5 writes infinities as {"__float__": "Infinity"}."""
    if isinstance(v, dict) and FLOAT_TAG in v:
        return float(v[FLOAT_TAG])
    return float(v)


def float_to_hf(v: float):
    return {FLOAT_TAG: "Infinity" if v > 0 else "-Infinity"} if math.isinf(v) else float(v)


def split_rows(t: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    return [p.contiguous() for p in torch.split(t, sizes, dim=0)]
