"""From attention to a linear-recurrent mixer: the student's config and MambaInLlama's weight mapping.

A teacher's GQA attention layer (``*``: q/k/v/o projections) becomes a Mamba-2 (``M``) or Gated DeltaNet (``G``)
mixer of the same widths (Wang et al. 2024, "The Mamba in the Llama"): attention's ``softmax(q k^T) v`` and
the SSM's ``C_t^T sum_s (decay) B_s x_s^T`` have the same shape, so ``x <- v``, ``B <- k``, ``C <- q``,
``out_proj <- o_proj`` (Gated DeltaNet: ``q <- q``, ``k <- k``, ``v <- v``). The mixer keeps attention's heads:
``Hq`` heads of ``D`` channels, a ``D``-wide state, and one B/C group per query head — C differs per query head,
so fewer groups could not hold q; k and v rows are repeated per GQA group (query head ``h`` reads kv head
``h // (Hq / Hkv)``, as attention's ``repeat_interleave``). The rest starts so the layer is close to (decayed)
linear attention; :func:`init_from_attention` says why each value.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from ..config import GatedDeltaNetConfig, HybridConfig, Mamba2Config
from ..layers.attention import Attention
from ..layers.gated_deltanet import GatedDeltaNet
from ..layers.mamba2 import Mamba2

MIXERS = {"mamba2": "M", "gdn": "G"}  # the CLI's names -> pattern symbols
# z's bias at init (its weights start at 0): a constant gate silu(4) ~ 3.93 on every channel. Mamba-2's gated
# norm is norm(y * silu(z)), which a constant gate leaves unchanged (RMSNorm is scale-invariant up to eps),
# and Gated DeltaNet's norm(o) * silu(z) has its norm weight set to 1 / silu(4): either way the gate starts
# as the identity yet, unlike a zero gate (silu(0) = 0), passes gradient to z's weights from the first step.
_Z_BIAS = 4.0
# The decay of each head's state per token, exp(-A) with dt = 1: log-spaced from 1/8 to 1/512 over the heads,
# memory horizons of ~8 to ~512 tokens (ALiBi's idea of one slope per head): softmax attention heads differ in
# how far back they look, and the alignment pass moves each head's A from there.
_A_RANGE = (1.0 / 512, 1.0 / 8)


class TeacherError(ValueError):
    """A teacher this distillation cannot map (not a Llama-family transformer)."""


def check_teacher(cfg: HybridConfig) -> None:
    """Refuse, in one line, a teacher whose attention layers the mapping cannot carry over."""
    if set(cfg.pattern) != {"*", "-"} or cfg.pattern != "*-" * (len(cfg.pattern) // 2):
        raise TeacherError(f"the teacher must be a Llama-family transformer (pattern '*-' repeated), got pattern "
                           f"{cfg.pattern!r}; give a checkpoint of a plain attention model")
    a = cfg.attention
    if a.output_gate or a.qk_norm:
        raise TeacherError("the teacher's attention has an output gate or q/k norms (Qwen3-Next / Qwen3 style), "
                           "which the q/k/v -> C/B/x mapping does not carry; give a Llama-family teacher")


def attention_positions(cfg: HybridConfig) -> list[int]:
    """Block indices of the attention sub-layers, in order (the n-th is attention layer n)."""
    return [i for i, kind in enumerate(cfg.layer_kinds) if kind == "attention"]


def mixer_sections(cfg: HybridConfig, mixer: str) -> dict:
    """The config section (``mamba2=`` or ``gated_deltanet=``) of a ``mixer`` with the teacher's attention
    widths."""
    if mixer not in MIXERS:
        raise ValueError(f"unknown mixer {mixer!r}; choose one of {sorted(MIXERS)}")
    a = cfg.attention
    H, D = a.n_heads, a.head_dim
    if mixer == "mamba2":
        # proj_bias: z's constant start (see _Z_BIAS) lives in in_proj's bias; out_proj's bias starts at 0
        return {"mamba2": Mamba2Config(d_state=D, d_conv=4, d_inner=H * D, head_dim=D, n_groups=H, norm_groups=H,
                                       proj_bias=True, conv_bias=True, norm_before_gate=False)}
    return {"gated_deltanet": GatedDeltaNetConfig(n_heads=H, n_k_heads=H, head_k_dim=D, head_v_dim=D, d_conv=4,
                                                  conv_bias=True, proj_bias=True)}


def student_config(teacher_cfg: HybridConfig, attention_layers, mixer: str = "mamba2") -> HybridConfig:
    """The teacher's config with every attention layer not in ``attention_layers`` (attention-layer numbers,
    0..n_attention-1) replaced by ``mixer`` ("mamba2" -> ``M``, "gdn" -> ``G``); MLPs and norms untouched."""
    check_teacher(teacher_cfg)
    positions = attention_positions(teacher_cfg)
    keep = set(attention_layers)
    bad = sorted(i for i in keep if not 0 <= i < len(positions))
    if bad:
        raise ValueError(f"attention layers {bad} do not exist: the teacher has {len(positions)} (0.."
                         f"{len(positions) - 1})")
    pattern = list(teacher_cfg.pattern)
    for n, pos in enumerate(positions):
        if n not in keep:
            pattern[pos] = MIXERS[mixer]
    return dataclasses.replace(teacher_cfg, pattern="".join(pattern), **mixer_sections(teacher_cfg, mixer))


def _kv_rows(t: torch.Tensor, n_kv: int, rep: int) -> torch.Tensor:
    """kv rows [Hkv * D, ...] -> one copy per query head [Hq * D, ...] (head h reads kv head h // rep)."""
    return t.reshape(n_kv, -1, *t.shape[1:]).repeat_interleave(rep, dim=0).reshape(-1, *t.shape[1:])


def _qkv_rows(attn: Attention):
    """(weight, bias) of q, k, v with k and v repeated per query head; biases zero when attention has none."""
    rep = attn.n_heads // attn.n_kv_heads
    out = []
    for proj, repeat in ((attn.q_proj, False), (attn.k_proj, True), (attn.v_proj, True)):
        w = proj.weight.detach().float()
        b = proj.bias.detach().float() if proj.bias is not None else torch.zeros(w.shape[0])
        out.append((_kv_rows(w, attn.n_kv_heads, rep), _kv_rows(b, attn.n_kv_heads, rep)) if repeat else (w, b))
    return out


def _identity_conv(conv: torch.nn.Conv1d) -> None:
    """The causal conv passes each channel's current input through (its last tap is the current token)."""
    conv.weight.zero_()
    conv.weight[:, 0, -1] = 1.0
    if conv.bias is not None:
        conv.bias.zero_()


def _decays(n_heads: int) -> torch.Tensor:
    lo, hi = _A_RANGE
    return torch.exp(torch.linspace(math.log(lo), math.log(hi), n_heads))


@torch.no_grad()
def init_from_attention(attn: Attention, mixer: Mamba2 | GatedDeltaNet) -> None:
    """Set ``mixer``'s weights from the attention layer ``attn`` (in place), its config from
    :func:`mixer_sections`.

    Mamba-2 (in_proj rows ``[z, x, B, C, dt]``): x <- v, B <- k, C <- q (projections and biases), out_proj <-
    o_proj; the conv is the identity on its last tap (the layer's SiLU stays: x, B, C start as silu(v), silu(k),
    silu(q)); dt's rows 0 and dt_bias = softplus^-1(1), so dt = 1; A per head log-spaced (``_A_RANGE``); D = 0 (no
    skip path: attention has none); z's weights 0 and bias ``_Z_BIAS`` (a constant gate, which the gated norm
    ignores); the norm per head (one group per head) plays the part of softmax's denominator, which linear
    attention lacks, so q/k need no 1/sqrt(D) scale either. With the conv, gate and decay off this is exactly
    causal linear attention of the teacher's un-rotated q/k/v (tests/test_distill_init.py).

    Gated DeltaNet (in_proj rows ``[q, k, v, z, b, a]``): q <- q, k <- k, v <- v, out_proj <- o_proj; identity
    conv; a's rows 0 with dt_bias = softplus^-1(1) and A_log as Mamba-2's A, so the log decay g = -A; b's rows
    0 and bias 0 (beta = 1/2, fla's default start); z's rows 0, bias ``_Z_BIAS`` and the norm weight
    1 / silu(_Z_BIAS), so norm(o) * w * silu(z) = norm(o). The delta rule is not linear attention for any beta
    > 0; it tends to it (o / beta) as beta -> 0, which is what the test checks.
    """
    if not isinstance(attn, Attention):
        raise TypeError(f"init_from_attention needs an Attention layer, got {type(attn).__name__}")
    (qw, qb), (kw, kb), (vw, vb) = _qkv_rows(attn)
    dev = mixer.in_proj.weight.device
    W = torch.zeros_like(mixer.in_proj.weight, dtype=torch.float32, device="cpu")
    b = torch.zeros(W.shape[0])
    if isinstance(mixer, Mamba2):
        Hq, D = attn.n_heads, attn.head_dim
        if (mixer.n_heads, mixer.head_dim, mixer.n_groups, mixer.d_state) != (Hq, D, Hq, D):
            raise ValueError(f"the Mamba-2 mixer must have the attention's widths (heads {Hq}, head_dim {D}, "
                             f"groups {Hq}, d_state {D}); build it from hybrid.distill.init.student_config")
        d = Hq * D
        rows = {"x": (d, vw, vb), "B": (2 * d, kw, kb), "C": (3 * d, qw, qb)}
        z_rows = slice(0, d)
    elif isinstance(mixer, GatedDeltaNet):
        if (mixer.n_heads, mixer.n_k_heads, mixer.head_k_dim, mixer.head_v_dim) != \
                (attn.n_heads, attn.n_heads, attn.head_dim, attn.head_dim):
            raise ValueError("the Gated DeltaNet mixer must have the attention's widths (n_heads = n_k_heads = "
                             "attention heads, head dims = attention head_dim); build it from student_config")
        d = attn.n_heads * attn.head_dim
        rows = {"q": (0, qw, qb), "k": (d, kw, kb), "v": (2 * d, vw, vb)}
        z_rows = slice(3 * d, 4 * d)
    else:
        raise TypeError(f"no attention mapping for a {type(mixer).__name__} mixer; mixers: Mamba2, GatedDeltaNet")
    for start, w, bias in rows.values():
        W[start:start + w.shape[0]] = w
        b[start:start + w.shape[0]] = bias
    b[z_rows] = _Z_BIAS
    mixer.in_proj.weight.copy_(W.to(dev))
    mixer.in_proj.bias.copy_(b.to(dev))
    mixer.out_proj.weight.copy_(attn.o_proj.weight)
    mixer.out_proj.bias.copy_(attn.o_proj.bias if attn.o_proj.bias is not None else torch.zeros(1, device=dev))
    _identity_conv(mixer.conv1d)
    mixer.dt_bias.fill_(math.log(math.expm1(1.0)))  # softplus(0 + dt_bias) = 1
    mixer.A_log.copy_(torch.log(_decays(attn.n_heads)))
    if isinstance(mixer, Mamba2):
        mixer.D.zero_()
        mixer.norm.weight.fill_(1.0)
    else:
        mixer.norm.weight.fill_(1.0 / F.silu(torch.tensor(_Z_BIAS)).item())


def new_mixer(cfg: HybridConfig, mixer: str) -> Mamba2 | GatedDeltaNet:
    """An uninitialised replacement mixer for a teacher of config ``cfg`` (fp32, on the CPU)."""
    sections = mixer_sections(cfg, mixer)
    if mixer == "mamba2":
        return Mamba2(cfg.d_model, sections["mamba2"].resolved(cfg.d_model), cfg.norm_eps)
    return GatedDeltaNet(cfg.d_model, sections["gated_deltanet"].resolved(cfg.d_model), cfg.norm_eps)


def replacement_from_attention(cfg: HybridConfig, attn: Attention, mixer: str) -> Mamba2 | GatedDeltaNet:
    """A ``mixer`` for one teacher attention layer, initialised from it."""
    m = new_mixer(cfg, mixer)
    init_from_attention(attn, m)
    return m
