"""mamba_ssm's own ``MambaLMHeadModel`` folders (config.json with ``d_model``, ``n_layer``, ``ssm_cfg``, ...)
-> ``HybridLM``, hybrids with ``attn_layer_idx`` / ``attn_cfg`` included.

mamba_ssm's ``Block`` is (norm, mixer) plus, when ``d_intermediate > 0``, (norm2, mlp): one or two of
our pre-norm sub-layers. Its fused add+norm path (``fused_add_norm=True``, the default every published
checkpoint uses) is the plain pre-norm residual we compute. The mixers:

- ``Mamba`` / ``Mamba2``: the same parameter names as ours. mamba_ssm's Mamba-2 gated RMSNorm uses
  eps 1e-5 and groups of ``d_ssm // ngroups``; its block norms use eps 1e-5 too (MambaLMHeadModel
  never passes ``norm_epsilon``), so one ``norm_eps=1e-5`` is exact.
- ``MHA``: ``in_proj`` packs rows as [q (H*D), k (Hkv*D), v (Hkv*D)], ``out_proj`` is our ``o_proj``;
  ``rotary_emb_dim`` rotates the first channels of each head (flash-attn's RotaryEmbedding, base
  ``rotary_emb_base``). Interleaved rotary (pairs 2i, 2i+1) is rotate-half rotary (pairs i, i + r/2) on
  channels reordered the same way in q and k, which leaves q.k unchanged: we load it by permuting the q and
  k rows, exactly.
- ``GatedMLP``: ``fc1`` packs [up, gate] (``up * silu(gate)``), width ``d_intermediate`` rounded up to a
  multiple of 128; ``fc2`` is ``down_proj``.

``residual_in_fp32`` keeps mamba_ssm's residual stream in fp32 under bf16; at fp32 it changes nothing.
The vocabulary is padded up to ``pad_vocab_size_multiple`` as mamba_ssm does (the extra rows are in the
checkpoint). Options that only shape the initialisation (dt_min/max/init/scale/init_floor, A_init_range,
conv_init) or the kernels used (use_fast_path, use_mem_eff_path, sequence_parallel) are ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import torch

from ..checkpoint import CheckpointError
from ..config import AttentionConfig, HybridConfig, Mamba1Config, Mamba2Config, MLPConfig
from . import MAMBA_SSM, Converter, register
from .common import refuse
from .rename import Chunk, Rule, Split, Table

ARCH = "mamba_ssm MambaLMHeadModel"
NORM_EPS = 1e-5
MLP_MULTIPLE = 128  # GatedMLP's multiple_of
_CONFIG_KEYS = {"d_model", "d_intermediate", "n_layer", "vocab_size", "ssm_cfg", "attn_layer_idx", "attn_cfg",
                "rms_norm", "residual_in_fp32", "fused_add_norm", "pad_vocab_size_multiple", "tie_embeddings"}
_METADATA_KEYS = {"transformers_version", "_name_or_path", "torch_dtype", "dtype"}
# Options each module accepts that do not change what trained weights compute.
_MAMBA1_IGNORED = {"dt_min", "dt_max", "dt_init", "dt_scale", "dt_init_floor", "use_fast_path"}
_MAMBA1_KEYS = {"d_state", "d_conv", "expand", "dt_rank", "conv_bias", "bias"} | _MAMBA1_IGNORED
_MAMBA2_IGNORED = {"conv_init", "A_init_range", "dt_min", "dt_max", "dt_init_floor", "use_mem_eff_path",
                   "sequence_parallel"}
_MAMBA2_KEYS = {"d_state", "d_conv", "expand", "headdim", "d_ssm", "ngroups", "D_has_hdim", "rmsnorm",
                "norm_before_gate", "dt_limit", "bias", "conv_bias", "chunk_size"} | _MAMBA2_IGNORED
_MHA_KEYS = {"num_heads", "num_heads_kv", "head_dim", "mlp_dim", "qkv_proj_bias", "out_proj_bias", "softmax_scale",
             "causal", "d_conv", "rotary_emb_dim", "rotary_emb_base", "rotary_emb_interleaved"}


def _unknown(where: str, given: dict, known: set[str]) -> None:
    bad = sorted(set(given) - known)
    if bad:
        raise refuse(ARCH, f"the {where} options {bad} (known: {sorted(known)})")


def _mamba1(ssm: dict, d: int) -> Mamba1Config:
    _unknown("ssm_cfg (Mamba1)", ssm, _MAMBA1_KEYS)
    rank = ssm.get("dt_rank", "auto")
    return Mamba1Config(d_state=ssm.get("d_state", 16), d_conv=ssm.get("d_conv", 4),
                        d_inner=int(ssm.get("expand", 2) * d), dt_rank=math.ceil(d / 16) if rank == "auto" else rank,
                        conv_bias=ssm.get("conv_bias", True), proj_bias=ssm.get("bias", False))


def _mamba2(ssm: dict, d: int) -> Mamba2Config:
    _unknown("ssm_cfg (Mamba2)", ssm, _MAMBA2_KEYS)
    d_inner = ssm.get("expand", 2) * d
    if ssm.get("d_ssm") not in (None, d_inner):
        raise refuse(ARCH, f"Mamba2 d_ssm={ssm['d_ssm']} < d_inner={d_inner} (a gated MLP inside the mixer)")
    if ssm.get("D_has_hdim", False):
        raise refuse(ARCH, "Mamba2 D_has_hdim=True (a D per channel rather than per head)")
    if not ssm.get("rmsnorm", True):
        raise refuse(ARCH, "Mamba2 rmsnorm=False (gating without the gated RMSNorm)")
    lo, hi = ssm.get("dt_limit", (0.0, math.inf))
    return Mamba2Config(d_state=ssm.get("d_state", 128), d_conv=ssm.get("d_conv", 4), d_inner=d_inner,
                        head_dim=ssm.get("headdim", 64), n_groups=ssm.get("ngroups", 1),
                        chunk_size=ssm.get("chunk_size", 256), dt_limit=(float(lo), float(hi)),
                        conv_bias=ssm.get("conv_bias", True), proj_bias=ssm.get("bias", False),
                        norm_before_gate=ssm.get("norm_before_gate", False))


def _attention(attn: dict, d: int) -> AttentionConfig:
    _unknown("attn_cfg", attn, _MHA_KEYS)
    if "num_heads" not in attn:
        raise CheckpointError(f"{ARCH}: attn_cfg has no num_heads")
    h = attn["num_heads"]
    head_dim = attn.get("head_dim") or d // h
    if not attn.get("causal", False):
        raise refuse(ARCH, "attn_cfg causal=False (bidirectional attention; mamba_ssm's MHA defaults to it, "
                           "language models set causal=true)")
    for key in ("mlp_dim", "d_conv"):
        if attn.get(key, 0):
            raise refuse(ARCH, f"attn_cfg {key}={attn[key]} (MHA with a fused MLP / a conv on qkv)")
    scale = attn.get("softmax_scale")
    if scale is not None and not math.isclose(scale, head_dim ** -0.5, rel_tol=1e-6):
        raise refuse(ARCH, f"attn_cfg softmax_scale={scale} (only 1/sqrt(head_dim))")
    rot = attn.get("rotary_emb_dim", 0)
    if rot > head_dim or rot % 2:
        raise CheckpointError(f"{ARCH}: attn_cfg rotary_emb_dim={rot} must be even and <= head_dim={head_dim}")
    return AttentionConfig(n_heads=h, n_kv_heads=attn.get("num_heads_kv") or h, head_dim=head_dim,
                           rope_theta=float(attn.get("rotary_emb_base", 10000.0)), rotary_fraction=rot / head_dim,
                           qkv_bias=attn.get("qkv_proj_bias", True), out_bias=attn.get("out_proj_bias", True))


def config_from_hf(raw: dict) -> HybridConfig:
    _unknown("config", raw, _CONFIG_KEYS | _METADATA_KEYS)
    d, n = raw["d_model"], raw["n_layer"]
    if not raw.get("rms_norm", True):
        raise refuse(ARCH, "rms_norm=False (LayerNorm blocks)")
    d_mlp = raw.get("d_intermediate", 0)
    if not raw.get("fused_add_norm", True) and d_mlp:
        raise refuse(ARCH, "fused_add_norm=False with d_intermediate > 0 (mamba_ssm's unfused Block feeds the MLP "
                           "the un-normalised mixer output, unlike its fused path)")
    ssm = dict(raw.get("ssm_cfg") or {})
    layer = ssm.pop("layer", "Mamba1")
    if layer not in ("Mamba1", "Mamba2"):
        raise refuse(ARCH, f"ssm_cfg layer={layer!r} (Mamba1 and Mamba2 are supported)")
    attn_idx = set(raw.get("attn_layer_idx") or [])
    if not attn_idx <= set(range(n)):
        raise CheckpointError(f"{ARCH}: attn_layer_idx {sorted(attn_idx)} has layers outside 0..{n - 1}")
    mixer = "M" if layer == "Mamba2" else "m"
    pattern = "".join(("*" if i in attn_idx else mixer) + ("-" if d_mlp else "") for i in range(n))
    mult = raw.get("pad_vocab_size_multiple", 8)
    kw = {}
    if len(attn_idx) < n:
        kw["mamba2" if layer == "Mamba2" else "mamba1"] = (_mamba2 if layer == "Mamba2" else _mamba1)(ssm, d)
    if attn_idx:
        kw["attention"] = _attention(raw.get("attn_cfg") or {}, d)
    if d_mlp:
        kw["mlp"] = MLPConfig(d_ff=MLP_MULTIPLE * math.ceil(d_mlp / MLP_MULTIPLE), activation="silu", gated=True)
    return HybridConfig(vocab_size=mult * math.ceil(raw["vocab_size"] / mult), d_model=d, pattern=pattern,
                        norm_eps=NORM_EPS, tie_embeddings=raw.get("tie_embeddings", True), **kw)


def _rotary_deinterleave(w: torch.Tensor, n_heads: int, head_dim: int, rot: int) -> torch.Tensor:
    """Reorder the rows of a q or k projection (weight or bias) so each head's first ``rot`` channels go
    from pairs (2i, 2i+1) to pairs (i, i + rot/2)."""
    perm = torch.cat([torch.arange(0, rot, 2), torch.arange(1, rot, 2), torch.arange(rot, head_dim)])
    return w.view(n_heads, head_dim, *w.shape[1:])[:, perm].reshape(w.shape)


def _qkv_rows(cfg: HybridConfig) -> list[int]:
    a = cfg.attention
    return [a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim, a.n_kv_heads * a.head_dim]


@dataclass(frozen=True)
class _InterleavedQKV(Split):
    """MHA's ``in_proj`` with interleaved rotary: split into q, k, v, then q's and k's rotated channels
    reordered to rotate-half pairs (see the module docstring). Import only: we do not write mamba_ssm."""

    def from_hf(self, theirs, cfg):
        q, k, v = super().from_hf(theirs, cfg)
        a = cfg.attention
        if a.rotary_dim:
            q = _rotary_deinterleave(q, a.n_heads, a.head_dim, a.rotary_dim)
            k = _rotary_deinterleave(k, a.n_kv_heads, a.head_dim, a.rotary_dim)
        return [q, k, v]

    def to_hf(self, ours, cfg):
        raise NotImplementedError("mamba_ssm checkpoints are read, not written")


@cache
def _table(mlp: bool, interleaved: bool) -> Table:
    """mamba_ssm's names: a ``Block`` is our layer i, or, with an MLP (``d_intermediate > 0``), our layers
    2i (norm, mixer) and 2i + 1 (norm2, mlp). Attention and Mamba mixers share the name ``in_proj``, so
    the attention rules check the layer kind on import."""
    mix, ffn = ("layers.{2i}", "layers.{2i+1}") if mlp else ("layers.{i}", None)
    hf = "backbone.layers.{i}"
    qkv = _InterleavedQKV(_qkv_rows) if interleaved else Split(_qkv_rows)
    mlp_rules = (
        Rule(f"{ffn}.norm.{{rest}}", f"{hf}.norm2.{{rest}}"),
        # GatedMLP's fc1 packs [up, gate]; fc2 is down_proj
        Rule((f"{ffn}.mixer.up_proj.{{rest}}", f"{ffn}.mixer.gate_proj.{{rest}}"), f"{hf}.mlp.fc1.{{rest}}",
             op=Chunk(2)),
        Rule(f"{ffn}.mixer.down_proj.{{rest}}", f"{hf}.mlp.fc2.{{rest}}"),
        Rule(f"{ffn}.mixer.{{rest}}", f"{hf}.mlp.{{rest}}"),
    ) if mlp else ()
    return Table(ARCH, tied_head=("lm_head.weight", "backbone.embedding.weight"), rules=(
        Rule("embed.weight", "backbone.embedding.weight"), Rule("norm_f.weight", "backbone.norm_f.weight"),
        Rule("lm_head.weight", "lm_head.weight"),
        Rule(f"{mix}.norm.{{rest}}", f"{hf}.norm.{{rest}}"),
        # MHA: in_proj packs rows [q, k, v]; out_proj is our o_proj
        Rule((f"{mix}.mixer.q_proj.{{rest}}", f"{mix}.mixer.k_proj.{{rest}}", f"{mix}.mixer.v_proj.{{rest}}"),
             f"{hf}.mixer.in_proj.{{rest}}", op=qkv, kinds="*", import_kinds=True),
        Rule(f"{mix}.mixer.o_proj.{{rest}}", f"{hf}.mixer.out_proj.{{rest}}", kinds="*", import_kinds=True),
        Rule(f"{mix}.mixer.{{rest}}", f"{hf}.mixer.{{rest}}"),  # Mamba / Mamba2: named as ours
        *mlp_rules,
    ))


def state_from_hf(state: dict, raw: dict, cfg: HybridConfig) -> dict:
    interleaved = bool((raw.get("attn_cfg") or {}).get("rotary_emb_interleaved", False))
    return _table(bool(raw.get("d_intermediate", 0)), interleaved).from_hf(state, cfg)


register(Converter(name=MAMBA_SSM, architectures=(MAMBA_SSM,), config_from_hf=config_from_hf,
                   state_from_hf=state_from_hf))
