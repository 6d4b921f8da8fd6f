"""Export: our model -> HF checkpoint that transformers loads with the same logits, and that we load back
bit-identically; format="hf" picks an exact target or refuses with each target's reason."""

import dataclasses

import pytest
import torch
from conftest import rel_err
from interop_helpers import LOGIT_TOL, randomize_

import hybrid
from hybrid import AttentionConfig, CheckpointError, HybridConfig, HybridLM, Mamba1Config, Mamba2Config, MLPConfig

transformers = pytest.importorskip("transformers")

V = 101
ATTN = AttentionConfig(n_heads=4, n_kv_heads=2, rope_theta=5000.0)
MODELS = {
    "llama": HybridConfig(vocab_size=V, d_model=32, pattern="*-*-", attention=ATTN, mlp=MLPConfig(d_ff=48)),
    "llama-bias-tied-llama3": HybridConfig(
        vocab_size=V, d_model=32, pattern="*-*-", tie_embeddings=True, norm_eps=1e-6,
        attention=dataclasses.replace(ATTN, n_kv_heads=4, head_dim=12, qkv_bias=True, out_bias=True, rope_scaling={
            "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16}),
        mlp=MLPConfig(d_ff=40, bias=True, activation="gelu_tanh")),
    "mistral": HybridConfig(vocab_size=V, d_model=32, pattern="*-*-",
                            attention=dataclasses.replace(ATTN, sliding_window=5), mlp=MLPConfig(d_ff=48)),
    "qwen2": HybridConfig(vocab_size=V, d_model=32, pattern="*-*-", attention=dataclasses.replace(ATTN, qkv_bias=True),
                          mlp=MLPConfig(d_ff=48)),
    "mamba2": HybridConfig(vocab_size=V, d_model=32, pattern="MM", mamba2=Mamba2Config(
        head_dim=16, d_state=8, n_groups=2, chunk_size=8, dt_limit=(0.0, 0.5))),
    "mamba": HybridConfig(vocab_size=V, d_model=32, pattern="mm", tie_embeddings=True,
                          mamba1=Mamba1Config(d_state=4, proj_bias=True)),
}


def _export_and_compare(cfg: HybridConfig, fmt: str, tmp_path) -> str:
    ours = randomize_(HybridLM(cfg)).eval()
    out = tmp_path / fmt
    hybrid.save_pretrained(ours, out, format=fmt)
    ref = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(0, V, (2, 19))
    with torch.no_grad():
        mine = ours(ids)
        assert rel_err(mine, ref(ids).logits) < LOGIT_TOL
        back = hybrid.from_pretrained(out)
        assert back.config == cfg
        assert torch.equal(back(ids), mine)
    for k, v in ours.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    return type(ref).__name__


@pytest.mark.parametrize("name", sorted(MODELS))
def test_export_loads_in_transformers_and_back(name, tmp_path):
    fmt = name.split("-")[0]
    arch = _export_and_compare(MODELS[name], fmt, tmp_path)
    assert arch == {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                    "mamba2": "Mamba2ForCausalLM", "mamba": "MambaForCausalLM"}[fmt]


@pytest.mark.parametrize("name, expected", [("llama", "llama"), ("mistral", "mistral"), ("qwen2", "qwen2"),
                                            ("mamba2", "mamba2"), ("mamba", "mamba")])
def test_hf_format_picks_an_exact_target(name, expected):
    assert hybrid.interop.pick_hf_format(MODELS[name]) == expected


def test_hf_format_writes_the_picked_target(tmp_path):
    assert _export_and_compare(MODELS["mistral"], "hf", tmp_path) == "MistralForCausalLM"


def test_hf_format_refuses_with_every_reason():
    # mamba_ssm's norm_before_gate=True gated norm: every HF Mamba-2 model computes norm(y * silu(z))
    cfg = HybridConfig(vocab_size=V, d_model=32, pattern="MM",
                       mamba2=Mamba2Config(head_dim=16, d_state=8, norm_before_gate=True))
    with pytest.raises(CheckpointError) as e:
        hybrid.save_pretrained(HybridLM(cfg), "unused", format="hf")
    msg = str(e.value)
    assert "no Hugging Face format represents this model exactly" in msg
    for fmt in ("llama", "mistral", "qwen2", "mamba2", "mamba"):
        assert f"{fmt}:" in msg
    assert "norm_before_gate=True" in msg


@pytest.mark.parametrize("cfg, fmt, why", [
    (HybridConfig(vocab_size=V, d_model=32, pattern="M-*-", attention=ATTN, mamba2=Mamba2Config(head_dim=16)),
     "llama", "pattern 'M-*-' is not '*-' * n"),
    (MODELS["mistral"], "llama", "use format='mistral'"),
    (MODELS["qwen2"], "llama", "use format='qwen2'"),
    (MODELS["llama"], "qwen2", "biases on q, k, v only"),
    (HybridConfig(vocab_size=V, d_model=32, pattern="*-", attention=dataclasses.replace(ATTN, rotary_fraction=0.5)),
     "llama", "rotary_fraction=0.5"),
    (HybridConfig(vocab_size=V, d_model=32, pattern="*-", attention=ATTN, mlp=MLPConfig(gated=False)),
     "llama", "gated=False"),
    (HybridConfig(vocab_size=V, d_model=32, pattern="MM", mamba2=Mamba2Config(head_dim=16, norm_before_gate=True)),
     "mamba2", "norm_before_gate=True"),
])
def test_export_refusals_name_the_reason(cfg, fmt, why, tmp_path):
    with pytest.raises(CheckpointError, match="cannot export this model as") as e:
        hybrid.save_pretrained(HybridLM(cfg), tmp_path, format=fmt)
    assert why in str(e.value)
    assert not (tmp_path / "config.json").exists()


def test_unknown_export_format():
    with pytest.raises(CheckpointError, match="unknown export format 'gguf'.*llama"):
        hybrid.save_pretrained(HybridLM(MODELS["llama"]), "unused", format="gguf")


def test_bf16_export_keeps_its_dtype(tmp_path):
    ours = HybridLM(MODELS["llama"]).to(torch.bfloat16)
    hybrid.save_pretrained(ours, tmp_path, format="llama")
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert ref.model.embed_tokens.weight.dtype == torch.bfloat16
    assert hybrid.from_pretrained(tmp_path).embed.weight.dtype == torch.bfloat16
