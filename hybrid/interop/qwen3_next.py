"""``Qwen3NextForCausalLM`` (Qwen's Gated DeltaNet / gated attention / mixture-of-experts hybrid) <-> ``HybridLM``.

A Qwen3-Next decoder layer is a mixer (Gated DeltaNet where ``layer_types[i] == "linear_attention"``, attention
where ``"full_attention"``) then a feed-forward (a mixture of experts with a gated shared expert unless ``i`` is
in ``mlp_only_layers``, ``num_experts == 0`` or ``(i + 1) % decoder_sparse_step``, else a SwiGLU MLP), each
pre-normed: two pattern symbols, ``G-``, ``GE``, ``*-`` or ``*E``. What maps onto our options:

- every RMSNorm but the Gated DeltaNet's output norm scales by ``1 + weight`` (our ``norm_offset = 1.0``);
- attention is gated (``q_proj`` gives each head's query then its gate rows: our ``output_gate``), has q/k
  RMSNorms over the head dim before RoPE (``qk_norm``), partial RoPE (``partial_rotary_factor``, 0.25 unless
  stated, as transformers defaults it) and one bias flag for q/k/v/o;
- the Gated DeltaNet's ``in_proj_qkvz`` / ``in_proj_ba`` hold their rows per key head (``[q, k, v, z]`` and
  ``[b, a]`` of each key head's group): they are regrouped into our one ``in_proj`` (all q, all k, all v, all z,
  all b, all a), a permutation of rows, so the round trip is exact; its conv over q/k/v, ``A_log``, ``dt_bias``
  and the per-head gated norm (norm, then ``silu(z)``) are ours as they are;
- the router is softmax over all experts then top ``num_experts_per_tok`` (renormalised when
  ``norm_topk_prob``), the shared expert a SwiGLU of ``shared_expert_intermediate_size`` times
  ``sigmoid(shared_expert_gate(x))`` (our ``moe.shared_d_ff`` / ``shared_gate``).

``hidden_act`` is the MLP/expert activation and the conv activation, so only ``silu`` maps. Experts are read
per expert (``experts.{e}.gate_proj.weight``, the hub layout, which we export) or fused
(``experts.gate_up_proj``, transformers' in-memory layout). The multi-token-prediction head (``mtp.*``) is
dropped, as transformers drops it. Every config key is mapped, known not to change the outputs, or refused.
"""

from __future__ import annotations

import torch

from ..checkpoint import CheckpointError
from ..config import AttentionConfig, GatedDeltaNetConfig, HybridConfig, MLPConfig, MoEConfig
from . import Converter, register
from .common import EXPORT_MAX_POSITIONS, refuse, rope_from_hf, rope_to_hf
from .rename import Chunk, Op, Rule, Stack, Table

ARCH = "Qwen3NextForCausalLM"
# Qwen3NextConfig's defaults (transformers 5.x) for keys a config.json may leave out.
DEFAULTS = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=48, num_attention_heads=16,
    num_key_value_heads=2, hidden_act="silu", initializer_range=0.02, rms_norm_eps=1e-6, tie_word_embeddings=False,
    attention_bias=False, head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32, decoder_sparse_step=1,
    moe_intermediate_size=512, shared_expert_intermediate_size=512, num_experts_per_tok=10, num_experts=512,
    norm_topk_prob=True, mlp_only_layers=None, layer_types=None, full_attention_interval=4,
)
DEFAULT_PARTIAL_ROTARY = 0.25  # Qwen3NextConfig.__post_init__ sets this when the config does not say
# Keys read into the HybridConfig (besides DEFAULTS): the RoPE settings and the sliding-window switch.
MAPPED = set(DEFAULTS) | {"rope_parameters", "rope_theta", "rope_scaling", "partial_rotary_factor",
                          "use_sliding_window"}
# Keys that do not change what the weights compute at inference: transformers' bookkeeping, token ids,
# training-only settings (dropout, router loss), the position limit (no RoPE type we accept reads it), and the
# sliding window, which transformers' Qwen3-Next never applies (``use_sliding_window`` is refused instead).
IGNORED = {
    "architectures", "model_type", "transformers_version", "_name_or_path", "dtype", "torch_dtype",
    "output_hidden_states", "output_attentions", "return_dict", "chunk_size_feed_forward", "is_encoder_decoder",
    "id2label", "label2id", "problem_type", "use_cache", "pad_token_id", "bos_token_id", "eos_token_id",
    "attention_dropout", "output_router_logits", "router_aux_loss_coef", "max_position_embeddings",
    "sliding_window", "max_window_layers",
}
LAYER_SYMBOL = {"linear_attention": "G", "full_attention": "*"}


def _hf(raw: dict) -> dict:
    """The config as transformers sees it: defaults for absent (or null) keys, unknown keys refused."""
    unknown = sorted(set(raw) - MAPPED - IGNORED)
    if unknown:
        raise refuse(ARCH, f"the config options {unknown} (known: {sorted(MAPPED | IGNORED)})")
    return {**DEFAULTS, **{k: v for k, v in raw.items() if not (v is None and k in DEFAULTS)}}


def _pattern(hf: dict) -> str:
    n = hf["num_hidden_layers"]
    types = hf["layer_types"]
    if types is None:  # transformers: attention every full_attention_interval-th layer
        interval = hf["full_attention_interval"]
        if not isinstance(interval, int) or interval < 1:
            raise refuse(ARCH, f"full_attention_interval={interval!r} (a positive int)")
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
    bad = [(i, t) for i, t in enumerate(types) if t not in LAYER_SYMBOL]
    if bad:
        raise refuse(ARCH, f"layer {bad[0][0]} of type {bad[0][1]!r} (known: {sorted(LAYER_SYMBOL)})")
    if len(types) != n:
        raise CheckpointError(f"{ARCH}: layer_types has {len(types)} entries for num_hidden_layers={n}")
    dense = set(hf["mlp_only_layers"] or [])
    outside = sorted(i for i in dense if not 0 <= i < n)
    if outside:
        raise refuse(ARCH, f"mlp_only_layers {outside} are outside the {n} layers")
    step = hf["decoder_sparse_step"]
    if hf["num_experts"] > 0 and (not isinstance(step, int) or step < 1):
        raise refuse(ARCH, f"decoder_sparse_step={step!r} (a positive int)")
    ffn = ["E" if i not in dense and hf["num_experts"] > 0 and (i + 1) % step == 0 else "-" for i in range(n)]
    return "".join(LAYER_SYMBOL[t] + f for t, f in zip(types, ffn, strict=True))


def config_from_hf(raw: dict) -> HybridConfig:
    hf = _hf(raw)
    if hf["hidden_act"] != "silu":  # also the Gated DeltaNet conv activation
        raise refuse(ARCH, f"hidden_act={hf['hidden_act']!r} (only 'silu')")
    if hf.get("use_sliding_window"):
        raise refuse(ARCH, "use_sliding_window=True (transformers' Qwen3-Next attention is full)")
    pattern = _pattern(hf)
    d, n_heads = hf["hidden_size"], hf["num_attention_heads"]
    nv, nk = hf["linear_num_value_heads"], hf["linear_num_key_heads"]
    if "G" in pattern and (nk < 1 or nv % nk):
        raise refuse(ARCH, f"linear_num_value_heads ({nv}) not a multiple of linear_num_key_heads ({nk})")
    n_kv = hf["num_key_value_heads"] or n_heads
    if "*" in pattern and n_heads % n_kv:
        raise refuse(ARCH, f"num_attention_heads ({n_heads}) not a multiple of num_key_value_heads ({n_kv})")
    rope_hf = {**hf, "partial_rotary_factor": hf.get("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY)}
    if isinstance(hf.get("rope_parameters"), dict):
        rope_hf["rope_parameters"] = {"partial_rotary_factor": rope_hf["partial_rotary_factor"],
                                      **hf["rope_parameters"]}
    theta, scaling, partial = rope_from_hf(ARCH, rope_hf)
    head_dim = hf["head_dim"] or d // n_heads
    if "*" in pattern and (partial <= 0 or int(head_dim * partial) % 2):
        raise refuse(ARCH, f"partial_rotary_factor={partial} with head_dim={head_dim} (the rotary dim "
                           f"int(head_dim x factor) must be even and > 0)")
    bias = bool(hf["attention_bias"])
    if "E" in pattern and hf["shared_expert_intermediate_size"] < 1:
        raise refuse(ARCH, f"shared_expert_intermediate_size={hf['shared_expert_intermediate_size']} "
                           "(Qwen3-Next's experts always have a shared expert)")
    # a section the pattern does not use keeps its defaults
    return HybridConfig(
        vocab_size=hf["vocab_size"], d_model=d, pattern=pattern,
        attention=AttentionConfig(n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim, rope_theta=theta,
                                  rotary_fraction=partial, rope_scaling=scaling, qkv_bias=bias, out_bias=bias,
                                  output_gate=True, qk_norm=True) if "*" in pattern else AttentionConfig(),
        gated_deltanet=GatedDeltaNetConfig(n_heads=nv, n_k_heads=nk, head_k_dim=hf["linear_key_head_dim"],
                                           head_v_dim=hf["linear_value_head_dim"],
                                           d_conv=hf["linear_conv_kernel_dim"], conv_bias=False, proj_bias=False)
        if "G" in pattern else GatedDeltaNetConfig(),
        mlp=MLPConfig(d_ff=hf["intermediate_size"], activation="silu", gated=True, bias=False)
        if "-" in pattern else MLPConfig(),
        moe=MoEConfig(n_experts=hf["num_experts"], top_k=hf["num_experts_per_tok"],
                      d_ff=hf["moe_intermediate_size"], activation="silu", gated=True,
                      normalize_top_k=bool(hf["norm_topk_prob"]),
                      shared_d_ff=hf["shared_expert_intermediate_size"], shared_gate=True)
        if "E" in pattern else MoEConfig(),
        norm_eps=float(hf["rms_norm_eps"]), tie_embeddings=bool(hf["tie_word_embeddings"]),
        initializer_range=float(hf["initializer_range"]), norm_offset=1.0,
    )


# ---- tensors -------------------------------------------------------------------------------------
def _gdn_sizes(cfg: HybridConfig) -> tuple[int, int, int, int]:
    """(key heads, head_k_dim, value rows per key head, value heads per key head)."""
    g = cfg.gated_deltanet
    r = g.n_heads // g.n_k_heads
    return g.n_k_heads, g.head_k_dim, r * g.head_v_dim, r


class _GroupedInProj(Op):
    """in_proj_qkvz [Hk*(2K + 2rV), D] and in_proj_ba [Hk*2r, D], grouped per key head <-> our in_proj
    [q | k | v | z | b | a] rows: a permutation of rows, so the round trip is exact."""

    def from_hf(self, theirs, cfg):
        qkvz, ba = theirs
        nk, hk, rv, r = _gdn_sizes(cfg)
        D = qkvz.shape[-1]
        if qkvz.shape != (nk * (2 * hk + 2 * rv), D) or ba.shape != (nk * 2 * r, D):
            raise CheckpointError(f"{ARCH}: in_proj_qkvz {tuple(qkvz.shape)} / in_proj_ba {tuple(ba.shape)} do not "
                                  f"fit the config's {cfg.gated_deltanet.n_k_heads} key and "
                                  f"{cfg.gated_deltanet.n_heads} value heads")
        q, k, v, z = qkvz.view(nk, 2 * hk + 2 * rv, D).split([hk, hk, rv, rv], dim=1)
        b, a = ba.view(nk, 2 * r, D).split([r, r], dim=1)
        return [torch.cat([t.reshape(-1, D) for t in (q, k, v, z, b, a)])]

    def to_hf(self, ours, cfg):
        (w,) = ours
        nk, hk, rv, r = _gdn_sizes(cfg)
        D = w.shape[-1]
        q, k, v, z, b, a = (t.view(nk, -1, D) for t in w.split([nk * hk, nk * hk, nk * rv, nk * rv, nk * r, nk * r]))
        return [torch.cat([q, k, v, z], dim=1).reshape(-1, D).contiguous(),
                torch.cat([b, a], dim=1).reshape(-1, D).contiguous()]


_MIX, _FFN, _HF = "layers.{2i}.mixer", "layers.{2i+1}.mixer", "model.layers.{i}"
# Experts are read per expert (the hub layout, which we export) or fused (transformers' in-memory layout,
# gate rows first); the dense MLP, shared_expert.* and shared_expert_gate are named as ours. The MTP head
# (mtp.*) is dropped, as transformers drops it.
TABLE = Table(ARCH, tied_head=("lm_head.weight", "model.embed_tokens.weight"), skip=("mtp.{any}",), rules=(
    Rule("embed.weight", "model.embed_tokens.weight"), Rule("norm_f.weight", "model.norm.weight"),
    Rule("lm_head.weight", "lm_head.weight"),
    Rule("layers.{2i}.norm.{rest}", f"{_HF}.input_layernorm.{{rest}}"),
    Rule("layers.{2i+1}.norm.{rest}", f"{_HF}.post_attention_layernorm.{{rest}}"),
    Rule(f"{_MIX}.{{rest}}", f"{_HF}.self_attn.{{rest}}", kinds="*"),
    Rule(f"{_MIX}.in_proj.weight", (f"{_HF}.linear_attn.in_proj_qkvz.weight", f"{_HF}.linear_attn.in_proj_ba.weight"),
         op=_GroupedInProj(), kinds="G"),
    Rule(f"{_MIX}.{{rest}}", f"{_HF}.linear_attn.{{rest}}", kinds="G"),
    Rule(f"{_FFN}.{{mat:gate_proj|up_proj|down_proj}}", f"{_HF}.mlp.experts.{{e}}.{{mat}}.weight", kinds="E",
         op=Stack("e", count=lambda cfg: cfg.moe.n_experts)),
    Rule((f"{_FFN}.gate_proj", f"{_FFN}.up_proj"), f"{_HF}.mlp.experts.gate_up_proj", op=Chunk(2, 1), export=False),
    Rule(f"{_FFN}.down_proj", f"{_HF}.mlp.experts.down_proj", export=False),
    Rule(f"{_FFN}.router.weight", f"{_HF}.mlp.gate.weight"),
    Rule(f"{_FFN}.{{rest}}", f"{_HF}.mlp.{{rest}}"),
))


def state_from_hf(state: dict, hf: dict, cfg: HybridConfig) -> dict:
    """The checkpoint's tensors under our names. Names nothing maps stay as they are, so the strict load
    reports them; a tied model's stored head must equal the embedding (it is dropped)."""
    return TABLE.from_hf(state, cfg)


# ---- export --------------------------------------------------------------------------------------
def export_refusal(cfg: HybridConfig) -> str | None:
    p = cfg.pattern
    pairs = [p[i:i + 2] for i in range(0, len(p), 2)]
    bad = [i for i, s in enumerate(pairs) if len(s) != 2 or s[0] not in "G*" or s[1] not in "-E"]
    if bad:
        return (f"every Qwen3-Next decoder layer is a mixer (G or *) followed by a feed-forward (- or E), so the "
                f"pattern must alternate them; in {p!r} decoder layer {bad[0]} would be {pairs[bad[0]]!r}")
    problems = []
    if "*" not in p:  # transformers' hybrid cache asks an attention layer for the sequence length
        problems.append("the model has no attention layer; transformers' Qwen3-Next cannot run without one")
    if cfg.norm_offset != 1.0:
        problems.append(f"norm_offset={cfg.norm_offset}; Qwen3-Next's RMSNorms scale by 1 + weight (norm_offset=1.0)")
    if "*" in p:
        a = cfg.attention
        if not (a.output_gate and a.qk_norm):
            problems.append("attention without output_gate and qk_norm; Qwen3-Next's attention has both")
        if a.sliding_window is not None:
            problems.append(f"attention.sliding_window={a.sliding_window}: Qwen3-Next's attention is full")
        if a.qkv_bias != a.out_bias:
            problems.append("attention.qkv_bias and attention.out_bias differ; Qwen3-Next has one bias flag")
        if a.rotary_fraction == 0.0:
            problems.append("attention has no RoPE; Qwen3-Next always rotates (partial_rotary_factor > 0)")
    if "G" in p:
        g = cfg.gated_deltanet
        if g.conv_bias or g.proj_bias:
            problems.append("gated_deltanet has biases; Qwen3-Next's conv and projections have none")
    ffns = [(cfg.mlp, "MLP")] * ("-" in p) + [(cfg.moe, "experts' MLP")] * ("E" in p)
    for sub, name in ffns:
        if not sub.gated or sub.activation != "silu" or getattr(sub, "bias", False):
            problems.append(f"the {name} is not a bias-free SwiGLU; Qwen3-Next's is (hidden_act is also the conv "
                            "activation)")
    if "E" in p and not (cfg.moe.shared_d_ff and cfg.moe.shared_gate):
        problems.append("the experts have no gated shared expert (moe.shared_d_ff, moe.shared_gate); "
                        "Qwen3-Next's always do")
    return "; ".join(problems) or None


def config_to_hf(cfg: HybridConfig) -> dict:
    p = cfg.pattern
    n = len(p) // 2
    a, g, moe = cfg.attention, cfg.gated_deltanet, cfg.moe
    has_moe = "E" in p
    out = {
        "architectures": [ARCH], "model_type": "qwen3_next", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model, "num_hidden_layers": n, "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings, "initializer_range": cfg.initializer_range,
        "max_position_embeddings": EXPORT_MAX_POSITIONS,
        "layer_types": ["linear_attention" if p[2 * i] == "G" else "full_attention" for i in range(n)],
        "intermediate_size": cfg.mlp.d_ff if "-" in p else moe.d_ff,
        "num_attention_heads": a.n_heads, "num_key_value_heads": a.n_kv_heads, "head_dim": a.head_dim,
        "attention_bias": a.qkv_bias,
        "rope_parameters": {**rope_to_hf(a.rope_theta, a.rope_scaling), "partial_rotary_factor": a.rotary_fraction},
        "linear_num_value_heads": g.n_heads, "linear_num_key_heads": g.n_k_heads,
        "linear_key_head_dim": g.head_k_dim, "linear_value_head_dim": g.head_v_dim,
        "linear_conv_kernel_dim": g.d_conv,
        # every layer sparse unless listed dense; no experts at all: num_experts=0 (every layer dense)
        "num_experts": moe.n_experts if has_moe else 0, "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(n) if p[2 * i + 1] == "-"] if has_moe else [],
        "num_experts_per_tok": moe.top_k if has_moe else 1, "moe_intermediate_size": moe.d_ff,
        "shared_expert_intermediate_size": moe.shared_d_ff if has_moe else 0,
        "norm_topk_prob": moe.normalize_top_k,
    }
    return out


def state_to_hf(state: dict[str, torch.Tensor], cfg: HybridConfig) -> dict[str, torch.Tensor]:
    return TABLE.to_hf(state, cfg)


register(Converter(name="qwen3_next", architectures=(ARCH,), config_from_hf=config_from_hf,
                   state_from_hf=state_from_hf, export_refusal=export_refusal, config_to_hf=config_to_hf,
                   state_to_hf=state_to_hf,
                   extensions=("norm_offset", "attention.output_gate", "attention.qk_norm", "moe.shared_d_ff")))
