"""The Python side of the native library's one-token ops: argument checks (``supports_*``: None when the native op
takes the call, else why not; the dispatch hands other calls to torch) and the ctypes calls. Each op's math
is its module's ``*_ref`` (kernels/ssd.py, conv1d.py, paged_attention.py); tests hold them to it."""

from __future__ import annotations

import torch

from . import DTYPE_CODES, MAX_ROWS, library

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


def supports_gdn_step(state, q, k, v, g, beta, *, scale=None, slots=None) -> str | None:
    """fp32/bf16 state, q/k/v rows contiguous within a sequence and of one dtype, g/beta fp32, K and V <= 512"""
    why = _common(state, (q, k, v), slots)
    if why:
        return why
    n, Hk, K = q.shape
    H, V = v.shape[1], v.shape[2]
    if K > 512 or V > 512 or H % Hk or state.shape[1:] != (H, K, V):
        return f"heads {H}/{Hk} or dims {K}x{V}"
    if q.stride(2) != 1 or q.stride(1) != K or k.stride() != q.stride() or v.stride(2) != 1 or v.stride(1) != V \
            or not (q.dtype == k.dtype == v.dtype):
        return "q/k/v layout"
    if g.dtype != torch.float32 or beta.dtype != torch.float32 or g.stride(1) != 1 or beta.stride() != g.stride():
        return "g / beta not fp32"
    return None


def gdn_step(state, q, k, v, g, beta, *, scale=None, slots=None) -> torch.Tensor:
    n, Hk, K = q.shape
    H, V = v.shape[1], v.shape[2]
    y = torch.empty(n, H, V, dtype=v.dtype)
    library().hl_gdn_step(state.data_ptr(), DTYPE_CODES[state.dtype], _ptr(slots), q.data_ptr(), k.data_ptr(),
                          q.stride(0), v.data_ptr(), DTYPE_CODES[v.dtype], v.stride(0), g.data_ptr(), beta.data_ptr(),
                          g.stride(0), K ** -0.5 if scale is None else float(scale), y.data_ptr(), n, H, Hk, K, V)
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


# the activations of the native library's fused ops (sublayer.c; the decode program, hybrid/decode/builder.py,
# passes them)
ACTIVATIONS = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "relu": 3, "relu2": 4}


def supports_gla_step(state, q, k, v, g, *, scale=None, slots=None) -> str | None:
    """fp32/bf16 state, q/k/v rows contiguous within a sequence and of one dtype, g fp32, V <= 512"""
    why = _common(state, (q, k, v), slots)
    if why:
        return why
    n, H, K = q.shape
    V = v.shape[2]
    if V > 512 or state.shape[1:] != (H, K, V) or k.shape != q.shape or g.shape != q.shape or v.shape[1] != H:
        return f"heads {H} or dims {K}x{V}"
    if any(t.stride(2) != 1 or t.stride(1) != t.shape[2] for t in (q, k, v)) or not (q.dtype == k.dtype == v.dtype):
        return "q/k/v layout"
    if g.dtype != torch.float32 or g.stride(2) != 1 or g.stride(1) != K:
        return "g not fp32"
    return None


def gla_step(state, q, k, v, g, *, scale=None, slots=None) -> torch.Tensor:
    """kernels.gla.gla_step_ref's step in the native GLA loop (linear_attention.c): one pass over the state."""
    n, H, K = q.shape
    V = v.shape[2]
    y = torch.empty(n, H, V, dtype=v.dtype)
    rc = library().hl_gla_step(state.data_ptr(), DTYPE_CODES[state.dtype], _ptr(slots), q.data_ptr(), q.stride(0),
                               k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), DTYPE_CODES[v.dtype],
                               g.data_ptr(), g.stride(0), K ** -0.5 if scale is None else float(scale), y.data_ptr(),
                               n, H, H, K, V)
    if rc:
        raise RuntimeError(f"hl_gla_step refused H={H} K={K} V={V} (a bug: supports_gla_step passed it)")
    return y


def _elementwise(rows: int, *tensors) -> str | None:
    """The linear-attention layers' gate / norm loops: single-threaded and scalar, for a decode step's few rows
    (prefill keeps torch's vectorised, threaded ops)."""
    if rows > MAX_ROWS:
        return f"{rows} rows (a decode step's loop: at most {MAX_ROWS})"
    if any(t.device.type != "cpu" for t in tensors):
        return "not on the CPU"
    if torch.compiler.is_compiling():
        return "compiling"
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return "autograd"
    if any(t.dtype not in _FLOATS for t in tensors):
        return "input dtypes"
    return None


def supports_l2norm_heads(x, eps=1e-6) -> str | None:
    """x [n, heads, K] fp32/bf16 (n <= 64), each row's heads contiguous"""
    why = _elementwise(x.shape[0] if x.dim() == 3 else MAX_ROWS + 1, x)
    if why:
        return why
    if x.dim() != 3 or x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        return "layout"
    return None


def l2norm_heads(x, eps=1e-6) -> torch.Tensor:
    n, heads, K = x.shape
    y = torch.empty(n, heads, K, dtype=x.dtype)
    library().hl_l2norm_heads(x.data_ptr(), x.stride(0), DTYPE_CODES[x.dtype], y.data_ptr(), heads * K, n, heads, K,
                              eps)
    return y


def supports_gdn_gates(b, a, A_log, dt_bias) -> str | None:
    """b, a [n, H] (n <= 64) of one fp32/bf16 dtype, each row contiguous; A_log, dt_bias [H] contiguous"""
    why = _elementwise(b.shape[0] if b.dim() == 2 else MAX_ROWS + 1, b, a, A_log, dt_bias)
    if why:
        return why
    if b.dim() != 2 or a.shape != b.shape or b.stride(1) != 1 or a.stride(1) != 1 or a.dtype != b.dtype \
            or not (A_log.is_contiguous() and dt_bias.is_contiguous()) or A_log.shape != b.shape[1:] \
            or dt_bias.shape != b.shape[1:]:
        return "layout"
    return None


def gdn_gates(b, a, A_log, dt_bias) -> tuple[torch.Tensor, torch.Tensor]:
    n, H = b.shape
    g, beta = torch.empty(n, H), torch.empty(n, H)
    library().hl_gdn_gates(b.data_ptr(), b.stride(0), a.data_ptr(), a.stride(0), DTYPE_CODES[b.dtype], A_log.data_ptr(),
                           DTYPE_CODES[A_log.dtype], dt_bias.data_ptr(), DTYPE_CODES[dt_bias.dtype], g.data_ptr(),
                           beta.data_ptr(), n, H)
    return g, beta


def supports_gla_decay(x, normalizer, clamp_min=None) -> str | None:
    """contiguous fp32/bf16 x [n, width] (n <= 64)"""
    why = _elementwise(x.shape[0] if x.dim() == 2 else MAX_ROWS + 1, x)
    if why:
        return why
    return None if x.is_contiguous() else "layout"


def gla_decay(x, normalizer, clamp_min=None) -> torch.Tensor:
    g = torch.empty(x.shape)
    library().hl_gla_decay(x.data_ptr(), DTYPE_CODES[x.dtype], g.data_ptr(), x.numel(), float(normalizer),
                           0.0 if clamp_min is None else float(clamp_min), int(clamp_min is not None))
    return g


def supports_gdn_ut_solve(A, X) -> str | None:
    """contiguous fp32 A [..., C, C] and X [..., C, W] on the CPU, no autograd"""
    if A.device.type != "cpu" or torch.compiler.is_compiling():
        return "not on the CPU"
    if torch.is_grad_enabled() and (A.requires_grad or X.requires_grad):
        return "autograd"
    if A.dtype != torch.float32 or X.dtype != torch.float32 or not (A.is_contiguous() and X.is_contiguous()):
        return "not contiguous fp32"
    if A.shape[-1] != A.shape[-2] or X.shape[:-1] != A.shape[:-1]:
        return "shapes"
    return None


def gdn_ut_solve(A, X) -> torch.Tensor:
    C, W = X.shape[-2:]
    library().hl_gdn_ut_solve(A.data_ptr(), X.data_ptr(), X.numel() // (C * W) if C * W else 0, C, W)
    return X


def supports_gdn_chunk_prep(q, k, kk, qk, c, beta, v) -> str | None:
    """contiguous fp32 operands on the CPU, no autograd, chunks of at most 128"""
    ts = (q, k, kk, qk, c, beta, v)
    if q.device.type != "cpu" or torch.compiler.is_compiling():
        return "not on the CPU"
    if torch.is_grad_enabled() and any(t.requires_grad for t in ts):
        return "autograd"
    if any(t.dtype != torch.float32 or not t.is_contiguous() for t in ts):
        return "not contiguous fp32"
    if q.shape[-2] > 128:
        return f"chunks of {q.shape[-2]}"
    return None


def gdn_chunk_prep(q, k, kk, qk, c, beta, v):
    """linear_attention.c's hl_gdn_chunk_prep: q/k [n, Hk, C, K], kk/qk [n, Hk, C, C], c/beta [n, H, C], v
    [n, H, C, V] (overwritten by U) -> (U, W, qe, kend [n, H, C, K], attn [n, H, C, C])."""
    n, Hk, C, K = q.shape
    H, V = v.shape[1], v.shape[-1]
    W, qe, kend = (torch.empty(n, H, C, K) for _ in range(3))
    attn = torch.empty(n, H, C, C)
    rc = library().hl_gdn_chunk_prep(q.data_ptr(), k.data_ptr(), kk.data_ptr(), qk.data_ptr(), c.data_ptr(),
                                     beta.data_ptr(), v.data_ptr(), W.data_ptr(), qe.data_ptr(), kend.data_ptr(),
                                     attn.data_ptr(), n, Hk, H // Hk, C, K, V)
    if rc != 0:
        raise RuntimeError(f"hl_gdn_chunk_prep refused chunks of {C}")
    return v, W, qe, kend, attn
