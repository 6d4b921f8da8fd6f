"""GGUF ``mamba`` and ``mamba2`` -> transformers' ``MambaForCausalLM`` / ``Mamba2ForCausalLM``.

What llama.cpp's converter (``MambaModel`` / ``Mamba2Model``) changes, undone here:

- ``A_log`` is stored as ``A = -exp(A_log)`` (tensor ``blk.N.ssm_a``, no ``.weight`` suffix); it is read back
  as ``log(-A)``, computed in float64 and rounded once to fp32. exp then log is not the identity in floating
  point, so A_log comes back within an ulp or so of the original, not always bit for bit.
- the conv weight ``[C, 1, K]`` is squeezed to ``[C, K]``; Mamba-2's ``A`` and ``D`` get a trailing axis
  (``[H, 1]``) and its gated norm weight is stored per group (``[G, d_inner / G]``): reshaped back.
- Mamba-2's ``dt_bias`` is renamed ``dt_proj.bias`` (``blk.N.ssm_dt.bias``).
- the vocabulary is padded (to a multiple of 8 / 16): the embedding's rows are the vocabulary, as transformers'
  config then says.

Refused by name: ``mamba.ssm.dt_b_c_rms`` (FalconMamba's weightless dt/B/C norms).
"""

from __future__ import annotations

import numpy as np

from ..checkpoint import CheckpointError
from .gguf_file import GGUFArch, GGUFFile, register, require, special_ids, vocab_size

_TOP_NAMES = {"token_embd": "backbone.embeddings", "output_norm": "backbone.norm_f", "output": "lm_head"}
_MIXER = {"attn_norm": "norm", "ssm_in": "mixer.in_proj", "ssm_conv1d": "mixer.conv1d", "ssm_a": "mixer.A_log",
          "ssm_d": "mixer.D", "ssm_out": "mixer.out_proj"}
MAMBA1_NAMES = {**_MIXER, "ssm_x": "mixer.x_proj", "ssm_dt": "mixer.dt_proj"}
MAMBA2_NAMES = {**_MIXER, "ssm_dt.bias": "mixer.dt_bias", "ssm_norm": "mixer.norm"}


def _common(f: GGUFFile, names: list[str], hf_arch: str) -> dict:
    require(f, "block_count", "embedding_length", "ssm.conv_kernel", "ssm.inner_size", "ssm.state_size",
            "ssm.time_step_rank")
    d_model, d_inner = int(f.arch_key("embedding_length")), int(f.arch_key("ssm.inner_size"))
    return {"architectures": [hf_arch], "model_type": f.arch, "vocab_size": vocab_size(f), "hidden_size": d_model,
            "num_hidden_layers": int(f.arch_key("block_count")), "state_size": int(f.arch_key("ssm.state_size")),
            "conv_kernel": int(f.arch_key("ssm.conv_kernel")), "expand": d_inner / d_model,
            "use_bias": "blk.0.ssm_in.bias" in names, "use_conv_bias": "blk.0.ssm_conv1d.bias" in names,
            "hidden_act": "silu", "layer_norm_epsilon": float(f.arch_key("attention.layer_norm_rms_epsilon", 1e-5)),
            "tie_word_embeddings": "output.weight" not in names, **special_ids(f)}


def mamba1_config(f: GGUFFile, names: list[str]) -> dict:
    if f.arch_key("ssm.dt_b_c_rms"):
        raise CheckpointError("GGUF mamba: ssm.dt_b_c_rms (FalconMamba's RMS norms on dt, B and C without weights) "
                              "is not supported; refusing to load")
    return {**_common(f, names, "MambaForCausalLM"), "time_step_rank": int(f.arch_key("ssm.time_step_rank"))}


def mamba2_config(f: GGUFFile, names: list[str]) -> dict:
    hf = _common(f, names, "Mamba2ForCausalLM")
    n_heads = int(f.arch_key("ssm.time_step_rank"))  # llama.cpp writes the head count there for Mamba-2
    d_inner = int(f.arch_key("ssm.inner_size"))
    if d_inner % n_heads:
        raise CheckpointError(f"{f.path}: mamba2 ssm.inner_size {d_inner} is not a multiple of its "
                              f"{n_heads} heads (ssm.time_step_rank)")
    # no time_step_limit: llama.cpp applies none, as transformers' default (0, inf)
    return {**hf, "num_heads": n_heads, "head_dim": d_inner // n_heads,
            "n_groups": int(f.arch_key("ssm.group_count", 1))}


def _a_log(a: np.ndarray) -> np.ndarray:
    return np.log(-a.astype(np.float64)).astype(np.float32)


def _restore(name: str, values: np.ndarray, hf: dict) -> np.ndarray:
    if name.endswith(".A_log"):
        return _a_log(values.reshape(-1) if hf["architectures"][0] == "Mamba2ForCausalLM" else values)
    if name.endswith(".conv1d.weight"):
        return values[:, None, :]
    if name.endswith((".mixer.D", ".mixer.norm.weight")):  # Mamba-2's [H, 1] and [G, d_inner / G]
        return values.reshape(-1)
    return values


register(GGUFArch(name="mamba", hf_architecture="MambaForCausalLM", config=mamba1_config, top_names=_TOP_NAMES,
                  layer_prefix="backbone.layers", layer_names=MAMBA1_NAMES, restore=_restore))
register(GGUFArch(name="mamba2", hf_architecture="Mamba2ForCausalLM", config=mamba2_config, top_names=_TOP_NAMES,
                  layer_prefix="backbone.layers", layer_names=MAMBA2_NAMES, restore=_restore))
