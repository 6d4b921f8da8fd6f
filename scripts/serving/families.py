"""The small models scripts/check_serving.sh exports: one per family we can export, each with the
export format every engine gets (a format per engine: e.g. vLLM has no Bamba model, while llama.cpp's
GraniteMoeHybrid conversion drops RoPE, so a RoPE hybrid goes to vLLM as granitemoehybrid and to
llama.cpp as bamba).

Sizes are chosen for the engines, not for quality: head size 64 (vLLM's CPU attention supports 32, 64,
80, ...; our ``*-tiny`` recipes use 16), d_model 128, vocab 512, a few MB of fp32 weights.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import hybrid
from hybrid import AttentionConfig, GatedDeltaNetConfig, HybridConfig, Mamba1Config, Mamba2Config, MLPConfig, MoEConfig

ENGINES = ("vllm", "llama.cpp")
BASE = dict(vocab_size=512, d_model=128, tie_embeddings=False,
            attention=AttentionConfig(n_heads=2, n_kv_heads=1, head_dim=64),
            mamba2=Mamba2Config(d_state=32, head_dim=64, chunk_size=64),
            mamba1=Mamba1Config(d_state=16),
            mlp=MLPConfig(d_ff=256))
NOPE = AttentionConfig(n_heads=2, n_kv_heads=1, head_dim=64, rotary_fraction=0.0)
# vLLM 0.32 turns prefix caching on by default and then runs Mamba-2 layers in its "align" cache mode, which
# crashes on the CPU (IndexError in mamba_mixer2.py conv_ssm_forward); every Mamba-2 family runs with it off,
# NemotronH and pure Mamba-2 also with the default, to show it.
NO_PC = ["--no-prefix-caching"]
BOTH = {"vllm": [[], NO_PC]}
OFF = {"vllm": [NO_PC]}


@dataclass(frozen=True)
class Family:
    name: str
    what: str
    config: HybridConfig
    formats: dict[str, str]  # engine -> export format
    # engine -> extra runner flags (each a separate run, e.g. vLLM with and without prefix caching)
    variants: dict[str, list[list[str]]] = field(default_factory=dict)


def _cfg(pattern: str, **changes) -> HybridConfig:
    return HybridConfig(pattern=pattern, **{**BASE, **changes})


FAMILIES = [
    Family("llama", "attention only (GQA, RoPE, SwiGLU)", _cfg("*-*-"), {"vllm": "llama", "llama.cpp": "llama"}),
    Family("mistral-swa", "attention only, sliding window 32",
           _cfg("*-*-", attention=dataclasses.replace(BASE["attention"], sliding_window=32)),
           {"vllm": "mistral", "llama.cpp": "mistral"}),
    Family("mamba2", "Mamba-2 only", _cfg("MMMM"), {"vllm": "mamba2", "llama.cpp": "mamba2"}, variants=BOTH),
    Family("hybrid-rope", "Mamba-2 + attention (RoPE) + SwiGLU, as hybrid-1to7", _cfg("M-*-M-M-"),
           {"vllm": "granitemoehybrid", "llama.cpp": "bamba"}, variants={"vllm": [NO_PC, NO_PC + ["--tp", "2"]]}),
    Family("hybrid-rope-bamba", "the same model written as Bamba", _cfg("M-*-M-M-"),
           {"vllm": "bamba", "llama.cpp": "granitemoehybrid"}),
    Family("hybrid-nope", "Mamba-2 + attention without RoPE + SwiGLU (Granite-4.0-H)", _cfg("M-*-M-M-", attention=NOPE),
           {"vllm": "granitemoehybrid", "llama.cpp": "granitemoehybrid"}, variants=OFF),
    Family("hybrid-moe", "Mamba-2 + attention, top-2 of 4 experts in every block",
           _cfg("ME*EMEME", attention=NOPE, moe=MoEConfig(n_experts=4, top_k=2, d_ff=128, normalize_top_k=True)),
           {"vllm": "granitemoehybrid", "llama.cpp": "granitemoehybrid"}, variants=OFF),
    Family("nemotronh", "NemotronH: M / * / squared-ReLU MLP, tied embeddings",
           _cfg("M-M*-M-", attention=NOPE, mlp=MLPConfig(d_ff=256, activation="relu2", gated=False),
                tie_embeddings=True),
           {"vllm": "nemotron_h", "llama.cpp": "nemotron_h"},
           variants=BOTH),
    Family("mamba1", "Mamba-1 only", _cfg("mmmm"), {"vllm": "mamba", "llama.cpp": "mamba"}),
    Family("jamba", "Jamba: Mamba-1 (dt/B/C norms) + attention + experts",
           _cfg("m-mE*-mE", attention=NOPE, mamba1=Mamba1Config(d_state=16, inner_norms=True),
                moe=MoEConfig(n_experts=4, top_k=2, d_ff=256)),
           {"vllm": "jamba", "llama.cpp": "jamba"}),
    Family("samba", "Samba: Mamba-1 + sliding-window attention", _cfg(
        "m-*-m-*-", attention=dataclasses.replace(BASE["attention"], sliding_window=32)),
        {"vllm": "hf", "llama.cpp": "hf"}),
    # experts in every block, as Qwen3-Next ships (llama.cpp's qwen3next has no dense-MLP form)
    Family("qwen3next", "Qwen3-Next: Gated DeltaNet 3 : gated attention 1 (q/k norms, partial RoPE), top-2 of 4 "
           "experts + a gated shared expert", _cfg("GEGEGE*E", norm_offset=1.0,
                moe=MoEConfig(n_experts=4, top_k=2, d_ff=128, normalize_top_k=True, shared_d_ff=128,
                              shared_gate=True),
                attention=dataclasses.replace(BASE["attention"], output_gate=True, qk_norm=True, rotary_fraction=0.25),
                gated_deltanet=GatedDeltaNetConfig(n_heads=4, n_k_heads=2, head_k_dim=64, head_v_dim=64)),
           # vLLM's CPU Gated DeltaNet runs in bf16 only ("CPU GDN attention requires BF16"): both, to show it
           {"vllm": "qwen3_next", "llama.cpp": "qwen3_next"}, variants={"vllm": [[], ["--dtype", "bfloat16"]]}),
]


def build(family: Family, seed: int = 0) -> hybrid.HybridLM:
    """The family's model with seeded random weights, fp32, eval mode. The embedding (and so a tied
    head) is scaled up so next-token logits are well separated: greedy tokens then test the engines'
    arithmetic, not which of two near-equal logits rounding happens to favour."""
    import torch
    torch.manual_seed(seed)
    model = hybrid.HybridLM(family.config).eval()
    with torch.no_grad():
        model.embed.weight.mul_(25.0)
        if model.lm_head is not None:
            model.lm_head.weight.mul_(25.0)
    return model
