"""Tiny GGUF files written from our test models the way llama.cpp's converter writes them: its tensor names
(``gguf.TENSOR_NAMES``), q/k rows permuted into interleaved rotary pairs for ``llama``, 2-D weights quantised
with ``gguf.quants.quantize`` (1-D norms stay F32, as llama.cpp keeps them), the hyperparameters under the
architecture's prefix."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

import hybrid
from hybrid.interop.gguf_llama import permute_rows

QTYPES = {"F32": gguf.GGMLQuantizationType.F32, "F16": gguf.GGMLQuantizationType.F16,
          "BF16": gguf.GGMLQuantizationType.BF16, "Q8_0": gguf.GGMLQuantizationType.Q8_0,
          "Q4_0": gguf.GGMLQuantizationType.Q4_0, "Q4_1": gguf.GGMLQuantizationType.Q4_1}

_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}



def _add_tensor(w, name: str, values, qtype: str) -> None:
    """One tensor into the writer as llama.cpp stores it: F32, F16, or quantised by gguf's own quantiser."""
    if qtype == "F32":
        w.add_tensor(name, np.ascontiguousarray(values, dtype=np.float32))
    elif qtype == "F16":
        w.add_tensor(name, values.astype(np.float16))
    else:
        q = QTYPES[qtype]
        w.add_tensor(name, gguf.quants.quantize(values, q), raw_dtype=q)

def tiny_llama(seed: int = 0, *, qkv_bias: bool = False, out_bias: bool | None = None,
               tie: bool = True) -> hybrid.HybridLM:
    """A 2-layer GQA Llama whose rows are multiples of 32 (the quantised types' block)."""
    torch.manual_seed(seed)
    cfg = hybrid.HybridConfig(vocab_size=96, d_model=64, pattern="*-*-",
                              attention=hybrid.AttentionConfig(n_heads=4, n_kv_heads=2, head_dim=16,
                                                               rope_theta=10000.0, qkv_bias=qkv_bias,
                                                               out_bias=qkv_bias if out_bias is None else out_bias),
                              mlp=hybrid.MLPConfig(d_ff=128), tie_embeddings=tie,
                              norm_eps=float(np.float32(1e-5)))  # GGUF stores it as float32
    model = hybrid.HybridLM(cfg).eval()
    with torch.no_grad():  # norms away from 1, so a norm mapped to the wrong place shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    return model


def _gguf_name(hf_name: str) -> str:
    stem, _, kind = hf_name.rpartition(".")
    if stem in _TOP:
        return f"{_TOP[stem]}.{kind}"
    _, _, layer, rest = stem.split(".", 3)
    return f"blk.{layer}.{_LAYER[rest]}.{kind}"


def write_llama_gguf(model: hybrid.HybridLM, path: Path, qtype: str = "F32", *, arch: str = "llama",
                     extra_tensor: tuple[str, np.ndarray] | None = None) -> Path:
    """``model`` (a ``"*-" * n`` HybridLM) as a GGUF of architecture ``arch`` with 2-D weights in ``qtype``."""
    from hybrid.interop import FORMATS, _ensure_loaded

    _ensure_loaded()
    cfg, a = model.config, model.config.attention
    state = FORMATS["llama"].state_to_hf({k: v.detach() for k, v in model.state_dict().items()}, cfg)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.n_layers // 2)
    w.add_context_length(2048)
    w.add_embedding_length(cfg.d_model)
    w.add_feed_forward_length(cfg.mlp.d_ff)
    w.add_head_count(a.n_heads)
    w.add_head_count_kv(a.n_kv_heads)
    w.add_key_length(a.head_dim)
    w.add_value_length(a.head_dim)
    w.add_rope_dimension_count(a.head_dim)
    w.add_rope_freq_base(a.rope_theta)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    for hf_name, t in state.items():
        values = t.float().numpy()
        if arch == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
            values = permute_rows(values, a.n_heads if ".q_proj." in hf_name else a.n_kv_heads)
        name = _gguf_name(hf_name)
        _add_tensor(w, name, values, "F32" if values.ndim == 1 else qtype)
    if extra_tensor is not None:
        w.add_tensor(*extra_tensor)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def gguf_round_trip(values: np.ndarray, qtype: str) -> torch.Tensor:
    """What a tensor becomes after llama.cpp's quantisation to ``qtype`` and back (the reference for loading)."""
    q = QTYPES[qtype]
    if q == gguf.GGMLQuantizationType.F32:
        return torch.from_numpy(values.astype(np.float32))
    if q == gguf.GGMLQuantizationType.F16:
        return torch.from_numpy(values.astype(np.float16).astype(np.float32))
    return torch.from_numpy(np.array(gguf.quants.dequantize(gguf.quants.quantize(values, q), q), dtype=np.float32))


# llama.cpp keeps these SSM tensors in F32 whatever the file type
_MAMBA_F32 = {"ssm_conv1d", "ssm_a", "ssm_d", "ssm_norm"}


def write_mamba_gguf(model: hybrid.HybridLM, path: Path, qtype: str = "F32") -> Path:
    """A Mamba-1 (``"m" * n``) or Mamba-2 (``"M" * n``) HybridLM as llama.cpp's converter writes it: A_log as
    ``A = -exp(A_log)``, the conv weight squeezed, Mamba-2's A and D with a trailing axis, its norm per group,
    its dt_bias as ``ssm_dt.bias``; 2-D weights whose rows are whole 32-blocks in ``qtype``."""
    from hybrid.interop import FORMATS, _ensure_loaded
    from hybrid.interop.gguf_mamba import MAMBA1_NAMES, MAMBA2_NAMES

    _ensure_loaded()
    cfg = model.config
    two = cfg.pattern[0] == "M"
    m = cfg.mamba2 if two else cfg.mamba1
    state = FORMATS["mamba2" if two else "mamba"].state_to_hf(
        {k: v.detach() for k, v in model.state_dict().items()}, cfg)
    to_gguf = {hf: gg for gg, hf in (MAMBA2_NAMES if two else MAMBA1_NAMES).items()}
    w = gguf.GGUFWriter(str(path), "mamba2" if two else "mamba")
    w.add_block_count(cfg.n_layers)
    w.add_context_length(2**20)
    w.add_embedding_length(cfg.d_model)
    w.add_feed_forward_length(0)
    w.add_head_count(0)
    w.add_ssm_conv_kernel(m.d_conv)
    w.add_ssm_inner_size(m.d_inner)
    w.add_ssm_state_size(m.d_state)
    w.add_ssm_time_step_rank(m.n_heads if two else m.dt_rank)
    if two:
        w.add_ssm_group_count(m.n_groups)
    else:
        w.add_ssm_dt_b_c_rms(False)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    for hf_name, t in state.items():
        values = t.float().numpy()
        if hf_name.endswith(".A_log"):
            values = -np.exp(values)
        if hf_name.endswith(".conv1d.weight"):
            values = values[:, 0, :]
        if two and hf_name.endswith((".A_log", ".mixer.D")):
            values = values[:, None]
        if two and hf_name.endswith(".mixer.norm.weight"):
            values = values.reshape(m.n_groups, -1)
        name = {"backbone.embeddings.weight": "token_embd.weight", "backbone.norm_f.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}.get(hf_name)
        if name is None:
            _, _, layer, tail = hf_name.split(".", 3)
            stem, _, kind = tail.rpartition(".")
            if tail in to_gguf:  # a whole name: A_log, D, dt_bias
                name = f"blk.{layer}.{to_gguf[tail]}"
            else:
                name = f"blk.{layer}.{to_gguf[stem]}.{kind}"
        kept_f32 = name.split(".")[2] in _MAMBA_F32 if name.startswith("blk.") else False
        f32 = values.ndim == 1 or values.shape[-1] % 32 or kept_f32
        _add_tensor(w, name, values, "F32" if f32 else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
