"""mamba_ssm ``MambaLMHeadModel`` folders, written by hand with mamba_ssm's config keys and tensor names
(mamba_ssm itself needs CUDA to import), load with logits matching an independent model holding the
same weights:

- pure Mamba-1 / Mamba-2: transformers' MambaForCausalLM / Mamba2ForCausalLM;
- Mamba-2 + MHA (half rotary) + GatedMLP hybrids: transformers' BambaForCausalLM, which has exactly that
  structure (Bamba rotates half of each head, one bias flag for q, k, v and o);
- Mamba-1 + MHA hybrids: transformers has no such model class (Jamba's Mamba has inner norms and always
  an MLP), so the reference is assembled from transformers' own MambaMixer and Qwen2Attention modules.
"""

import json

import pytest
import torch
from conftest import rel_err
from interop_helpers import LOGIT_TOL, assert_matches_hf, forward_greedy, ours_greedy, randomize_
from safetensors.torch import save_file

import hybrid
from hybrid import AttentionConfig, HybridConfig, Mamba1Config

transformers = pytest.importorskip("transformers")


def write_mamba_ssm(path, config: dict, state: dict, as_bin: bool = False) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    state = {k: v.contiguous() for k, v in state.items()}
    if as_bin:  # what mamba_ssm's own save_pretrained writes
        torch.save(state, path / "pytorch_model.bin")
    else:
        save_file(state, str(path / "model.safetensors"))


def hf_mamba_to_mamba_ssm(sd: dict) -> dict:
    """transformers Mamba/Mamba2 names -> mamba_ssm names (only the prefixes differ)."""
    return {k.replace("backbone.embeddings.", "backbone.embedding."): v for k, v in sd.items()}


@pytest.mark.parametrize("tied", [True, False])
def test_pure_mamba1_matches_transformers(tmp_path, tied):
    # vocab 125 padded to 128 by pad_vocab_size_multiple=8, as mamba_ssm does; the tensors hold 128 rows
    ref = randomize_(transformers.MambaForCausalLM(transformers.MambaConfig(
        vocab_size=128, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, layer_norm_epsilon=1e-5,
        tie_word_embeddings=tied))).eval()
    # tied: a pytorch_model.bin holding lm_head.weight as well, as mamba_ssm's own save_pretrained writes it
    write_mamba_ssm(tmp_path, {"d_model": 32, "n_layer": 2, "vocab_size": 125, "ssm_cfg": {"d_state": 8},
                               "rms_norm": True, "residual_in_fp32": True, "fused_add_norm": True,
                               "pad_vocab_size_multiple": 8, "tie_embeddings": tied},
                    hf_mamba_to_mamba_ssm(ref.state_dict()), as_bin=tied)
    ours = hybrid.from_pretrained(tmp_path)
    assert (ours.config.vocab_size, ours.config.pattern, ours.config.tie_embeddings) == (128, "mm", tied)
    assert_matches_hf(ours, ref, 125, length=19)


@pytest.mark.parametrize("ngroups", [1, 2])
def test_pure_mamba2_matches_transformers(tmp_path, ngroups):
    ref = randomize_(transformers.Mamba2ForCausalLM(transformers.Mamba2Config(
        vocab_size=96, hidden_size=32, num_heads=4, head_dim=16, state_size=8, n_groups=ngroups,
        num_hidden_layers=2, chunk_size=8, layer_norm_epsilon=1e-5, tie_word_embeddings=False))).eval()
    write_mamba_ssm(tmp_path, {
        "d_model": 32, "d_intermediate": 0, "n_layer": 2, "vocab_size": 96, "attn_layer_idx": [], "attn_cfg": {},
        "ssm_cfg": {"layer": "Mamba2", "d_state": 8, "headdim": 16, "ngroups": ngroups, "chunk_size": 8},
        "rms_norm": True, "residual_in_fp32": True, "fused_add_norm": True, "pad_vocab_size_multiple": 8,
        "tie_embeddings": False}, hf_mamba_to_mamba_ssm(ref.state_dict()))
    ours = hybrid.from_pretrained(tmp_path)
    assert ours.config.mamba2.n_groups == ngroups
    assert_matches_hf(ours, ref, 96, length=19)


def _interleave_rotary(w: torch.Tensor, n_heads: int, head_dim: int, rot: int) -> torch.Tensor:
    """Rows of a rotate-half q/k projection -> the interleaved-rotary rows computing the same scores:
    interleaved channel 2i holds rotate-half channel i, channel 2i+1 holds channel i + rot/2."""
    heads = w.view(n_heads, head_dim, *w.shape[1:])
    out = heads.clone()
    for i in range(rot // 2):
        out[:, 2 * i] = heads[:, i]
        out[:, 2 * i + 1] = heads[:, i + rot // 2]
    return out.reshape(w.shape)


def bamba_to_mamba_ssm(sd: dict, n_layer: int, attn_idx: list[int], heads: int, kv_heads: int, head_dim: int,
                       interleaved: bool) -> dict:
    out = {"backbone.embedding.weight": sd["model.embed_tokens.weight"],
           "backbone.norm_f.weight": sd["model.final_layernorm.weight"], "lm_head.weight": sd["lm_head.weight"]}
    for i in range(n_layer):
        src, dst = f"model.layers.{i}.", f"backbone.layers.{i}."
        out[dst + "norm.weight"] = sd[src + "input_layernorm.weight"]
        out[dst + "norm2.weight"] = sd[src + "pre_ff_layernorm.weight"]
        out[dst + "mlp.fc1.weight"] = torch.cat([sd[src + "feed_forward.up_proj.weight"],
                                                 sd[src + "feed_forward.gate_proj.weight"]])
        out[dst + "mlp.fc2.weight"] = sd[src + "feed_forward.down_proj.weight"]
        if i in attn_idx:
            for kind in ("weight", "bias"):
                q, k, v = (sd.get(f"{src}self_attn.{p}_proj.{kind}") for p in "qkv")
                if q is None:
                    continue
                if interleaved:
                    q = _interleave_rotary(q, heads, head_dim, head_dim // 2)
                    k = _interleave_rotary(k, kv_heads, head_dim, head_dim // 2)
                out[f"{dst}mixer.in_proj.{kind}"] = torch.cat([q, k, v])
                out[f"{dst}mixer.out_proj.{kind}"] = sd[f"{src}self_attn.o_proj.{kind}"]
        else:
            for k, v in sd.items():
                if k.startswith(src + "mamba."):
                    out[dst + "mixer." + k[len(src + "mamba."):]] = v
    return out


BAMBA_CASES = {
    # n_layer, attention layers, q heads, kv heads, attention biases, interleaved rotary, Mamba-2 groups
    "attn-middle-gqa": (3, [1], 4, 2, False, False, 1),
    "attn-first-last-mha-bias-interleaved-groups2": (4, [0, 3], 2, 2, True, True, 2),
}


@pytest.mark.parametrize("case", sorted(BAMBA_CASES))
def test_mamba2_attention_mlp_hybrid_matches_bamba(tmp_path, case):
    n_layer, attn_idx, heads, kv_heads, bias, interleaved, groups = BAMBA_CASES[case]
    d, head_dim, d_mlp = 32, 32 // heads, 200  # GatedMLP rounds 200 up to 256
    ref = randomize_(transformers.BambaForCausalLM(transformers.BambaConfig(
        vocab_size=112, hidden_size=d, intermediate_size=256, num_hidden_layers=n_layer, num_attention_heads=heads,
        num_key_value_heads=kv_heads, attn_layer_indices=attn_idx, attention_bias=bias, mamba_n_heads=4,
        mamba_d_head=16, mamba_n_groups=groups, mamba_d_state=8, mamba_chunk_size=8, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0}, tie_word_embeddings=False))).eval()
    ref.config._attn_implementation = "eager"
    state = bamba_to_mamba_ssm(ref.state_dict(), n_layer, attn_idx, heads, kv_heads, head_dim, interleaved)
    write_mamba_ssm(tmp_path, {
        "d_model": d, "d_intermediate": d_mlp, "n_layer": n_layer, "vocab_size": 112,
        "ssm_cfg": {"layer": "Mamba2", "d_state": 8, "headdim": 16, "ngroups": groups, "chunk_size": 8},
        "attn_layer_idx": attn_idx,
        "attn_cfg": {"causal": True, "num_heads": heads, "num_heads_kv": kv_heads, "head_dim": head_dim,
                     "rotary_emb_dim": head_dim // 2, "rotary_emb_base": 1000.0,
                     "rotary_emb_interleaved": interleaved, "qkv_proj_bias": bias, "out_proj_bias": bias},
        "rms_norm": True, "residual_in_fp32": True, "fused_add_norm": True, "pad_vocab_size_multiple": 16,
        "tie_embeddings": False}, state)
    ours = hybrid.from_pretrained(tmp_path)
    expected = "".join(("*" if i in attn_idx else "M") + "-" for i in range(n_layer))
    assert (ours.config.pattern, ours.config.mlp.d_ff) == (expected, 256)
    # transformers' Bamba generate() disagrees with its own forward when mamba_n_groups > 1 (its cached
    # path); there the greedy reference is its forward re-run per token.
    assert_matches_hf(ours, ref, 112, length=20, greedy="generate" if groups == 1 else "forward")


class Mamba1AttentionReference(torch.nn.Module):
    """A Mamba-1 + attention hybrid assembled from transformers' own modules: MambaRMSNorm + MambaMixer
    blocks, and Qwen2RMSNorm + Qwen2Attention (bias on q, k, v only; RoPE from Qwen2RotaryEmbedding) with
    SDPA's causal mask. transformers has no such model class (Jamba's Mamba adds inner norms and always an
    MLP), so this is the independent reference."""

    def __init__(self, pattern: str, vocab: int, d: int, mamba_kw: dict, attn_kw: dict, rope: bool):
        super().__init__()
        self.rope = rope
        from transformers.models.mamba.modeling_mamba import MambaMixer, MambaRMSNorm
        from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention, Qwen2RotaryEmbedding

        mcfg = transformers.MambaConfig(hidden_size=d, num_hidden_layers=len(pattern), **mamba_kw)
        qcfg = transformers.Qwen2Config(hidden_size=d, num_hidden_layers=len(pattern), **attn_kw)
        qcfg._attn_implementation = "sdpa"
        self.embed = torch.nn.Embedding(vocab, d)
        self.norms = torch.nn.ModuleList(MambaRMSNorm(d, eps=1e-5) for _ in pattern)
        self.mixers = torch.nn.ModuleList(
            Qwen2Attention(qcfg, i) if s == "*" else MambaMixer(mcfg, i) for i, s in enumerate(pattern))
        self.norm_f = MambaRMSNorm(d, eps=1e-5)
        self.rotary = Qwen2RotaryEmbedding(qcfg)

    def forward(self, ids):
        x = self.embed(ids)
        cos, sin = self.rotary(x, torch.arange(ids.shape[1])[None])
        cos_sin = (cos, sin) if self.rope else (torch.ones_like(cos), torch.zeros_like(sin))  # no RoPE: identity
        for norm, mixer in zip(self.norms, self.mixers, strict=True):
            h = norm(x)
            x = x + (mixer(h, position_embeddings=cos_sin, attention_mask=None)[0]
                     if hasattr(mixer, "q_proj") else mixer(h))
        return torch.nn.functional.linear(self.norm_f(x), self.embed.weight)


@pytest.mark.parametrize("attn_idx, rope", [([0], True), ([1, 2], True), ([1], False)])
def test_mamba1_attention_hybrid_matches_transformers_modules(tmp_path, attn_idx, rope):
    n_layer, d = 3, 32
    pattern = "".join("*" if i in attn_idx else "m" for i in range(n_layer))
    ref = Mamba1AttentionReference(pattern, 64, d, dict(state_size=4, expand=2, time_step_rank=3),
                                   dict(num_attention_heads=4, num_key_value_heads=1, head_dim=8, rope_theta=500.0),
                                   rope)
    randomize_(ref).eval()
    state = {"backbone.embedding.weight": ref.embed.weight, "backbone.norm_f.weight": ref.norm_f.weight}
    for i, (norm, mixer) in enumerate(zip(ref.norms, ref.mixers, strict=True)):
        state[f"backbone.layers.{i}.norm.weight"] = norm.weight
        if pattern[i] == "*":  # mamba_ssm's MHA: in_proj packs [q, k, v]; out_proj has no bias here
            for kind in ("weight", "bias"):
                state[f"backbone.layers.{i}.mixer.in_proj.{kind}"] = torch.cat(
                    [getattr(getattr(mixer, f"{p}_proj"), kind) for p in "qkv"])
            state[f"backbone.layers.{i}.mixer.out_proj.weight"] = mixer.o_proj.weight
        else:
            state.update({f"backbone.layers.{i}.mixer.{k}": v for k, v in mixer.state_dict().items()})
    write_mamba_ssm(tmp_path, {
        "d_model": d, "d_intermediate": 0, "n_layer": n_layer, "vocab_size": 60,
        "ssm_cfg": {"layer": "Mamba1", "d_state": 4, "dt_rank": 3}, "attn_layer_idx": attn_idx,
        "attn_cfg": {"causal": True, "num_heads": 4, "num_heads_kv": 1, "rotary_emb_dim": 8 if rope else 0,
                     "rotary_emb_base": 500,
                     "qkv_proj_bias": True, "out_proj_bias": False},
        "rms_norm": True, "residual_in_fp32": True, "fused_add_norm": True, "pad_vocab_size_multiple": 16,
        "tie_embeddings": True}, {k: v.detach() for k, v in state.items()})
    ours = hybrid.from_pretrained(tmp_path)
    assert ours.config == HybridConfig(
        vocab_size=64, d_model=d, norm_eps=1e-5, tie_embeddings=True, pattern=pattern,
        attention=AttentionConfig(n_heads=4, n_kv_heads=1, head_dim=8, rope_theta=500.0, qkv_bias=True,
                                  rotary_fraction=1.0 if rope else 0.0),
        mamba1=Mamba1Config(d_state=4, d_inner=64, dt_rank=3))
    ids = torch.randint(0, 60, (2, 17))
    with torch.no_grad():
        assert rel_err(ours(ids), ref(ids)) < LOGIT_TOL
        assert torch.equal(ours_greedy(ours, ids[:1, :6]), forward_greedy(ref, ids[:1, :6]))
