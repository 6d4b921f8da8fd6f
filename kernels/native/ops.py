"""The Python side of ``decode.c``'s one-token ops: argument checks (``supports_*``: None when the native op
takes the call, else why not; the dispatch hands other calls to torch) and the ctypes calls. Each op's math
is its module's ``*_ref`` (kernels/ssd.py, conv1d.py, paged_attention.py); tests hold them to it."""

from __future__ import annotations

import torch

from . import DTYPE_CODES, library

_FLOATS = (torch.float32, torch.bfloat16)


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def _code(t: torch.Tensor | None) -> int:
    return -1 if t is None else DTYPE_CODES[t.dtype]


def _common(state: torch.Tensor, tensors, slots) -> str | None:
    if type(state) is not torch.Tensor:
        return f"state is a {type(state).__name__}"
    if state.device.type != "cpu":
        return "not on the CPU"
    if torch.compiler.is_compiling():
        return "compiling"
    if state.dtype not in _FLOATS or not state.is_contiguous():
        return f"a {state.dtype} state"
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (state, *tensors)):
        return "autograd"
    if any(t is not None and t.dtype not in _FLOATS for t in tensors):
        return "input dtypes"
    if slots is not None and (slots.dtype != torch.int64 or not slots.is_contiguous()):
        return "slots not contiguous int64"
    return None


def supports_ssd_step(state, x, dt, A, B, C, *, D=None, slots=None) -> str | None:
    """fp32/bf16 state, rows of x/B/C contiguous within a sequence, d_state <= 512"""
    why = _common(state, (x, dt, A, B, C, D), slots)
    if why:
        return why
    n, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    if N > 512 or H % G:
        return f"d_state {N} or groups {G}"
    if x.stride(2) != 1 or x.stride(1) != P or B.stride(2) != 1 or B.stride(1) != N or C.stride(2) != 1 \
            or C.stride(1) != N or C.dtype != x.dtype or B.dtype != x.dtype:
        return "x/B/C layout"
    if dt.dtype != torch.float32 or dt.stride(1) != 1 or A.dtype != torch.float32 or not A.is_contiguous():
        return "dt / A not fp32"
    if D is not None and not D.is_contiguous():
        return "D layout"
    return None


def ssd_step(state, x, dt, A, B, C, *, D=None, slots=None) -> torch.Tensor:
    n, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    y = torch.empty(n, H, P, dtype=x.dtype)
    library().hl_ssd_step(state.data_ptr(), DTYPE_CODES[state.dtype], _ptr(slots), x.data_ptr(), DTYPE_CODES[x.dtype],
                          x.stride(0), dt.data_ptr(), dt.stride(0), A.data_ptr(), B.data_ptr(), B.stride(0),
                          C.data_ptr(), C.stride(0), _ptr(D), _code(D), y.data_ptr(), n, H, P, N, G)
    return y


def supports_conv_step(state, x, weight, bias=None, *, activation=None, slots=None) -> str | None:
    """fp32/bf16 state, x's channels contiguous, SiLU or no activation"""
    why = _common(state, (x, weight, bias), slots)
    if why:
        return why
    if activation not in (None, "silu"):
        return f"activation {activation!r}"
    if x.stride(1) != 1 or not weight.is_contiguous() or (bias is not None and not bias.is_contiguous()):
        return "layout"
    return None


def conv_step(state, x, weight, bias=None, *, activation=None, slots=None) -> torch.Tensor:
    n, C = x.shape
    y = torch.empty(n, C, dtype=x.dtype)
    library().hl_conv_step(state.data_ptr(), DTYPE_CODES[state.dtype], _ptr(slots), x.data_ptr(),
                           DTYPE_CODES[x.dtype], x.stride(0), weight.data_ptr(), DTYPE_CODES[weight.dtype],
                           _ptr(bias), _code(bias), int(activation == "silu"), y.data_ptr(), n, C, weight.shape[-1])
    return y


def supports_paged_decode(q, k_pool, v_pool, seq_lens, block_tables, *, window=None, scale=None, k_scale=None,
                          v_scale=None) -> str | None:
    """fp32/bf16 pools, contiguous, at most 64 query heads per KV head"""
    if k_scale is not None or v_scale is not None:
        return "quantised pages"
    if q.device.type != "cpu":
        return "not on the CPU"
    if torch.is_grad_enabled() and (q.requires_grad or k_pool.requires_grad):
        return "autograd"
    if torch.compiler.is_compiling():
        return "compiling"
    if k_pool.dtype not in _FLOATS or v_pool.dtype != k_pool.dtype or q.dtype not in _FLOATS:
        return f"a {k_pool.dtype} pool"
    if not (q.is_contiguous() and k_pool.is_contiguous() and v_pool.is_contiguous()):
        return "layout"
    if seq_lens.dtype != torch.int32 or block_tables.dtype != torch.int32 or block_tables.stride(1) != 1 \
            or not seq_lens.is_contiguous():
        return "lengths / tables not int32"
    if q.shape[1] // k_pool.shape[2] > 64:
        return "more than 64 query heads per KV head"
    return None


def paged_decode(q, k_pool, v_pool, seq_lens, block_tables, *, window=None, scale=None, k_scale=None,
                 v_scale=None) -> torch.Tensor:
    B, Hq, D = q.shape
    out = torch.empty_like(q)
    scale = D ** -0.5 if scale is None else scale
    library().hl_paged_decode(q.data_ptr(), DTYPE_CODES[q.dtype], k_pool.data_ptr(), v_pool.data_ptr(),
                              DTYPE_CODES[k_pool.dtype], seq_lens.data_ptr(), block_tables.data_ptr(),
                              block_tables.stride(0), out.data_ptr(), B, Hq, k_pool.shape[2], D, k_pool.shape[1],
                              window or 0, float(scale))
    return out


# ---- the pieces of a fused decode sub-layer (hybrid/layers/fused_decode.py strings them together) ----------
ACTIVATIONS = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "relu": 3, "relu2": 4}


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """hybrid.layers.norm.RMSNorm of contiguous rows x [n, d]."""
    y = torch.empty_like(x)
    library().hl_rmsnorm(x.data_ptr(), DTYPE_CODES[x.dtype], weight.data_ptr(), DTYPE_CODES[weight.dtype],
                         float(eps), y.data_ptr(), x.shape[0], x.shape[1])
    return y


def gated_up(x: torch.Tensor, gate, up, gate_bias, up_bias, activation: str) -> torch.Tensor:
    """act(x @ Wg.T + bg) * (x @ Wu.T + bu): ``gate``, ``up`` = (weight [N, K], row scales [N] of int8 codes or
    None); x [n, K] -> [n, N]."""
    (wg, sg), (wu, su) = gate, up
    N, K = wu.shape
    y = torch.empty(x.shape[0], N, dtype=x.dtype)
    library().hl_gated_up(wg.data_ptr(), _ptr(sg), _ptr(gate_bias), wu.data_ptr(), _ptr(su), _ptr(up_bias),
                          DTYPE_CODES[wu.dtype], _code(up_bias), x.data_ptr(), DTYPE_CODES[x.dtype], y.data_ptr(),
                          ACTIVATIONS[activation], x.shape[0], N, K)
    return y


def qkv_rope(x: torch.Tensor, attn, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
             cos: torch.Tensor | None, sin: torch.Tensor | None) -> torch.Tensor:
    """An Attention layer's q/k/v projections and RoPE for rows x [n, d_model]: returns q [n, Hq, D], writes k and
    v into their ``slots`` of the pools."""
    n = x.shape[0]
    q = torch.empty(n, attn.n_heads, attn.head_dim, dtype=x.dtype)
    rot = attn.rope.rotary_dim
    library().hl_qkv_rope(attn.q_proj.weight.data_ptr(), _ptr(attn.q_proj.bias), attn.k_proj.weight.data_ptr(),
                          _ptr(attn.k_proj.bias), attn.v_proj.weight.data_ptr(), _ptr(attn.v_proj.bias),
                          None, None, None, DTYPE_CODES[attn.q_proj.weight.dtype], _code(attn.q_proj.bias), x.data_ptr(),
                          DTYPE_CODES[x.dtype], q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(),
                          DTYPE_CODES[k_pool.dtype], slots.data_ptr(), _ptr(cos), _ptr(sin), rot, n, attn.n_heads,
                          attn.n_kv_heads, attn.head_dim, x.shape[1])
    return q


def gated_rmsnorm(y: torch.Tensor, z: torch.Tensor, norm) -> torch.Tensor:
    """hybrid.layers.norm.GatedRMSNorm of y [n, d] (contiguous) gated by z [n, d] (rows may be strided)."""
    out = torch.empty_like(y)
    library().hl_gated_rmsnorm(y.data_ptr(), z.data_ptr(), z.stride(0), DTYPE_CODES[y.dtype], norm.weight.data_ptr(),
                               DTYPE_CODES[norm.weight.dtype], float(norm.eps), norm.groups, int(norm.norm_before_gate),
                               out.data_ptr(), y.shape[0], y.shape[1])
    return out


def mamba2_dt(dt_raw: torch.Tensor, layer) -> tuple[torch.Tensor, torch.Tensor]:
    """hybrid.layers.mamba2.Mamba2.dt_A for decode rows dt_raw [n, H] (rows may be strided): (dt [n, H], A [H]),
    fp32."""
    n, H = dt_raw.shape
    dt, A = torch.empty(n, H), torch.empty(H)
    lo, hi = layer.cfg.dt_limit
    clamp = lo > 0.0 or hi != float("inf")
    library().hl_mamba2_dt(dt_raw.data_ptr(), DTYPE_CODES[dt_raw.dtype], dt_raw.stride(0), layer.dt_bias.data_ptr(),
                           DTYPE_CODES[layer.dt_bias.dtype], layer.A_log.data_ptr(), DTYPE_CODES[layer.A_log.dtype],
                           float(lo), float(min(hi, 3.0e38)), int(clamp), dt.data_ptr(), A.data_ptr(), n, H)
    return dt, A
