"""GGUF ``llama`` and ``qwen2`` -> transformers' ``LlamaForCausalLM`` / ``Qwen2ForCausalLM``.

- ``llama`` (also what llama.cpp writes for Mistral and SmolLM): llama.cpp's converter permutes the q and k
  rows (weights and biases) from the HF rotary layout (two halves per head) into interleaved pairs
  (``LlamaModel.permute``); :func:`unpermute_rows` inverts it, as transformers' GGUF loader does.
- ``qwen2``: written as is (no permutation), with q/k/v biases.

Refused by name: a ``rope_freqs`` tensor (llama3-style RoPE scaling, which the file stores as a table without
the parameters our RoPE is built from), partial rotary dimensions, RoPE scaling other than linear, a sliding
window, value heads of another size than key heads.
"""

from __future__ import annotations

import numpy as np

from ..checkpoint import CheckpointError
from .gguf_file import GGUFArch, GGUFFile, register, require, special_ids, vocab_size


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's ``LlamaModel.permute`` of q/k rows: per head, rows (pair, 2) -> (2, pair), i.e.
    interleaved rotary pairs back to the HF halves layout. ``w``: [n_head * head_dim, ...] (weight or bias)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` (HF halves -> interleaved pairs); the inverse of :func:`unpermute_rows`.
    Here for writing test files the way llama.cpp's converter does."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_LAYER_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_REFUSED = (("rope_freqs", "a RoPE frequency table: llama3-style scaling, which a GGUF stores without its "
                           "parameters"),)


def _config(hf_arch: str):
    def config(f: GGUFFile, names: list[str]) -> dict:
        arch = f.arch
        require(f, "block_count", "embedding_length", "feed_forward_length", "attention.head_count")
        n_heads = int(f.arch_key("attention.head_count"))
        d_model = int(f.arch_key("embedding_length"))
        head_dim = int(f.arch_key("attention.key_length", d_model // n_heads))
        if int(f.arch_key("attention.value_length", head_dim)) != head_dim:
            raise CheckpointError(f"GGUF {arch}: attention.value_length != key_length is not supported; refusing "
                                  "to load")
        rot = int(f.arch_key("rope.dimension_count", head_dim))
        if rot != head_dim:
            raise CheckpointError(f"GGUF {arch}: rope.dimension_count={rot} < head_dim {head_dim} (partial rotary) "
                                  f"is not supported by {hf_arch}; refusing to load")
        rope = {"rope_type": "default", "rope_theta": float(f.arch_key("rope.freq_base", 10000.0))}
        scaling = f.arch_key("rope.scaling.type")
        if scaling not in (None, "none"):
            if scaling != "linear":
                raise CheckpointError(f"GGUF {arch}: RoPE scaling {scaling!r} is not supported (only linear); "
                                      "refusing to load")
            rope.update(rope_type="linear", factor=float(f.arch_key("rope.scaling.factor")))
        window = f.arch_key("attention.sliding_window")
        if window:
            raise CheckpointError(f"GGUF {arch}: attention.sliding_window={window} is not supported; refusing to "
                                  "load")
        hf = {"architectures": [hf_arch], "model_type": arch, "vocab_size": vocab_size(f), "hidden_size": d_model,
              "intermediate_size": int(f.arch_key("feed_forward_length")),
              "num_hidden_layers": int(f.arch_key("block_count")), "num_attention_heads": n_heads,
              "num_key_value_heads": int(f.arch_key("attention.head_count_kv", n_heads)), "head_dim": head_dim,
              "hidden_act": "silu", "rms_norm_eps": float(f.arch_key("attention.layer_norm_rms_epsilon", 1e-6)),
              "rope_parameters": rope, "max_position_embeddings": int(f.arch_key("context_length", 2048)),
              # llama.cpp writes no output.weight for a model whose head is its embedding
              "tie_word_embeddings": "output.weight" not in names, **special_ids(f)}
        if arch == "llama":  # Llama's attention_bias covers q, k, v and o together; the tensors say which it is
            hf["attention_bias"] = any(n.endswith(".attn_q.bias") for n in names)
            hf["mlp_bias"] = any(n.endswith(".ffn_up.bias") for n in names)
        return hf
    return config


def _unpermute_qk(name: str, values: np.ndarray, hf: dict) -> np.ndarray:
    if ".q_proj." in name:
        return unpermute_rows(values, hf["num_attention_heads"])
    if ".k_proj." in name:
        return unpermute_rows(values, hf["num_key_value_heads"])
    return values


register(GGUFArch(name="llama", hf_architecture="LlamaForCausalLM", config=_config("LlamaForCausalLM"),
                  top_names=_TOP_NAMES, layer_prefix="model.layers", layer_names=_LAYER_NAMES,
                  restore=_unpermute_qk, refused=_REFUSED))
register(GGUFArch(name="qwen2", hf_architecture="Qwen2ForCausalLM", config=_config("Qwen2ForCausalLM"),
                  top_names=_TOP_NAMES, layer_prefix="model.layers", layer_names=_LAYER_NAMES, refused=_REFUSED))
