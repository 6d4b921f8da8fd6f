"""llama.cpp's GGUF files -> a Hugging Face config dict and state dict, which the converter for that
architecture (:mod:`hybrid.interop.llama`) turns into a ``HybridLM``.

The file is read with llama.cpp's own Python reader (the ``gguf`` package): metadata from
``GGUFReader.fields``, tensors dequantised to fp32 by ``gguf.quants.dequantize`` (every type it
implements: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_*, the K-quants, the IQ types, ...; the others are refused by
name). The tensor names are llama.cpp's (``gguf.TENSOR_NAMES``), mapped back to the names transformers
uses, and what llama.cpp's converter (``convert_hf_to_gguf.py``) changed on the way in is undone:

- ``llama``: the q and k rows (weights and biases) are permuted from the HF rotary layout (halves) to
  llama.cpp's interleaved pairs, per head (``LlamaModel.permute``); :func:`unpermute_rows` inverts it,
  as transformers' GGUF loader does.
- ``qwen2``: written as is (no permutation), with q/k/v biases.

Other architectures are refused by name; so are GGUF options the converters cannot run exactly (a RoPE
frequency table, partial rotary dimensions, a scaling type we do not implement).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..checkpoint import CheckpointError

GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}  # llama.cpp name -> transformers'
# llama.cpp permutes q/k for these (convert_hf_to_gguf.py's LlamaModel and its subclasses)
_PERMUTED = {"llama"}


def _gguf():
    try:
        import gguf
    except ImportError:
        raise CheckpointError("reading a GGUF file needs llama.cpp's reader: pip install gguf "
                              "(or pip install 'hybrid-lm[hf]')") from None
    return gguf


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` is a GGUF file (by its magic bytes, so a misnamed file is still recognised)."""
    p = Path(path)
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == b"GGUF"


class GGUFFile:
    """One GGUF file's metadata and tensors, read through ``gguf.GGUFReader`` (memory-mapped)."""

    def __init__(self, path: str | Path):
        gguf = _gguf()
        self.path = Path(path)
        if not is_gguf(self.path):
            raise CheckpointError(f"{self.path} is not a GGUF file (no GGUF magic at its start)")
        try:
            self.reader = gguf.GGUFReader(str(self.path))
        except (ValueError, OSError) as e:
            raise CheckpointError(f"{self.path}: not a readable GGUF file ({e})") from None
        self.arch = self.get("general.architecture")
        if self.arch is None:
            raise CheckpointError(f"{self.path}: the GGUF metadata has no general.architecture")

    def get(self, key: str, default=None):
        """A metadata value (str, number, or list of them), or ``default`` when the file lacks ``key``."""
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def arch_key(self, suffix: str, default=None):
        """``{architecture}.{suffix}``: llama.cpp prefixes the model's hyperparameters with its arch name."""
        return self.get(f"{self.arch}.{suffix}", default)

    def tensor_names(self) -> list[str]:
        return [t.name for t in self.reader.tensors]

    def tensors(self, progress: bool = True):
        """(name, fp32 numpy array in PyTorch's [out, in] order) for every tensor, dequantised."""
        from gguf.quants import dequantize
        from tqdm import tqdm

        for t in tqdm(self.reader.tensors, desc=f"dequantise {self.path.name}", unit="tensor", disable=not progress,
                      leave=False):
            try:
                values = dequantize(t.data, t.tensor_type)
            except NotImplementedError:
                raise CheckpointError(f"{self.path}: tensor {t.name} has GGUF type {t.tensor_type.name}, which "
                                      f"gguf.quants cannot dequantise; re-quantise the file to a supported type "
                                      f"(F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, K-quants)") from None
            yield t.name, np.asarray(values, dtype=np.float32)


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


# llama.cpp tensor name (gguf.TENSOR_NAMES, {bid} the layer) -> transformers' name for the Llama family
_LAYER_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _hf_name(arch: str, name: str) -> str:
    """transformers' name for llama.cpp tensor ``name`` (``blk.3.attn_q.weight``), or a refusal naming it."""
    stem, _, kind = name.rpartition(".")
    parts = stem.split(".")
    if len(parts) == 1 and stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{kind}"
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{kind}"
    why = (" (a RoPE frequency table: llama3-style scaling, which a GGUF stores without its parameters)"
           if stem == "rope_freqs" else "")
    raise CheckpointError(f"GGUF {arch}: tensor {name!r} has no counterpart in the {GGUF_ARCHITECTURES[arch]} "
                          f"converter{why}; refusing to load a model without it")


def _llama_family_config(f: GGUFFile, names: list[str]) -> dict:
    arch = f.arch
    hf_arch = GGUF_ARCHITECTURES[arch]
    need = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count")
    missing = [f"{arch}.{k}" for k in need if f.arch_key(k) is None]
    if missing:
        raise CheckpointError(f"{f.path}: the GGUF metadata lacks {', '.join(missing)}")
    n_heads = int(f.arch_key("attention.head_count"))
    d_model = int(f.arch_key("embedding_length"))
    head_dim = int(f.arch_key("attention.key_length", d_model // n_heads))
    if int(f.arch_key("attention.value_length", head_dim)) != head_dim:
        raise CheckpointError(f"GGUF {arch}: attention.value_length != key_length is not supported; refusing to load")
    rot = int(f.arch_key("rope.dimension_count", head_dim))
    if rot != head_dim:
        raise CheckpointError(f"GGUF {arch}: rope.dimension_count={rot} < head_dim {head_dim} (partial rotary) is "
                              f"not supported by {hf_arch}; refusing to load")
    rope = {"rope_type": "default", "rope_theta": float(f.arch_key("rope.freq_base", 10000.0))}
    scaling = f.arch_key("rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise CheckpointError(f"GGUF {arch}: RoPE scaling {scaling!r} is not supported (only linear); "
                                  f"refusing to load")
        rope.update(rope_type="linear", factor=float(f.arch_key("rope.scaling.factor")))
    window = f.arch_key("attention.sliding_window")
    if window:
        raise CheckpointError(f"GGUF {arch}: attention.sliding_window={window} is not supported; refusing to load")
    tokens = f.get("tokenizer.ggml.tokens")
    vocab = f.arch_key("vocab_size") or (len(tokens) if tokens is not None else None)
    if vocab is None:
        raise CheckpointError(f"{f.path}: the GGUF metadata gives no vocabulary size ({arch}.vocab_size or "
                              "tokenizer.ggml.tokens)")
    hf = {"architectures": [hf_arch], "model_type": arch, "vocab_size": int(vocab), "hidden_size": d_model,
          "intermediate_size": int(f.arch_key("feed_forward_length")),
          "num_hidden_layers": int(f.arch_key("block_count")), "num_attention_heads": n_heads,
          "num_key_value_heads": int(f.arch_key("attention.head_count_kv", n_heads)), "head_dim": head_dim,
          "hidden_act": "silu", "rms_norm_eps": float(f.arch_key("attention.layer_norm_rms_epsilon", 1e-6)),
          "rope_parameters": rope, "max_position_embeddings": int(f.arch_key("context_length", 2048)),
          # llama.cpp writes no output.weight for a model whose head is its embedding
          "tie_word_embeddings": "output.weight" not in names}
    for key, tok in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding")):
        if f.get(f"tokenizer.ggml.{tok}_token_id") is not None:
            hf[key] = int(f.get(f"tokenizer.ggml.{tok}_token_id"))
    if arch == "llama":  # Llama's attention_bias covers q, k, v and o together; the tensors say which it is
        hf["attention_bias"] = any(n.endswith(".attn_q.bias") for n in names)
        hf["mlp_bias"] = any(n.endswith(".ffn_up.bias") for n in names)
    return hf


def read_gguf(path: str | Path, *, progress: bool = True) -> tuple[dict, dict[str, torch.Tensor]]:
    """(transformers config dict, transformers-named fp32 state dict) of a GGUF file."""
    f = GGUFFile(path)
    if f.arch not in GGUF_ARCHITECTURES:
        raise CheckpointError(f"{f.path}: GGUF architecture {f.arch!r} is not supported; supported: "
                              f"{', '.join(sorted(GGUF_ARCHITECTURES))}")
    names = f.tensor_names()
    hf = _llama_family_config(f, names)
    for name in names:  # refuse an unknown tensor before any dequantising
        _hf_name(f.arch, name)
    state = {}
    for name, values in f.tensors(progress=progress):
        if f.arch in _PERMUTED and (".attn_q." in name or ".attn_k." in name):
            heads = hf["num_attention_heads"] if ".attn_q." in name else hf["num_key_value_heads"]
            values = unpermute_rows(values, heads)
        state[_hf_name(f.arch, name)] = torch.from_numpy(np.array(values, dtype=np.float32))  # a writable copy
    return hf, state
