"""The native library's ops that Python calls, as ``torch.library`` custom ops with schemas (``torch.ops.hybrid.*``):
the state steps, paged decode attention, the linear-attention gates and chunk operands, and the Mamba-1 scan.

Per op, in one place:
- ``check_<op>``: the op's arguments validated (shapes, dtypes, devices, layouts) with a one-line error naming the
  argument, what it got and what it needs (:mod:`.arguments`), or None. Metadata only, so the fake (meta)
  implementation runs it too: torch.compile / torch.export see the same errors at trace time.
- ``_<op>_kernel``: the ctypes call into the library (the only place that call is made), on checked arguments;
- ``_<op>_fake``: the outputs' shapes and dtypes; :func:`_define` makes the op's CPU implementation the check then
  the kernel, and its fake (``register_fake``, for torch.compile and torch.export) the check then the fake;
- ``supports_<op>``: for the dispatch (kernels/dispatch.py), None when the native op takes the call, else why not
  (then the torch path runs): the check plus what only the dispatch cares about (autograd, tracing, row counts).
- ``<op>``: the wrapper the dispatch registers, with the op module's keyword signature, calling the op; for a
  decode step's ops its ``after_supports`` is the kernel, which the dispatch calls once ``supports_<op>`` passed
  (validated once, no second check, no dispatcher cost).

The ops are defined with ``torch.library.Library.define`` + ``impl`` rather than ``torch.library.custom_op``: the
latter's Python wrapper cost ~11 us a call against ~2 us for a plain dispatcher op (torch 2.13, one thread), and a
decode step without the whole-step program calls a state step per layer per token. The decode *program* (one native
call per step, kernels/native/program.c) is not made of these ops. Each op's math is its module's ``*_ref``
(kernels/ssd.py, conv1d.py, paged_attention.py, gated_delta.py, gla.py, selective.py); tests hold them to it."""

from __future__ import annotations

import torch

from . import DTYPE_CODES, MAX_ROWS, library
from .arguments import FLOATS, bad, contiguous, float_state, inner_rows, off_cpu, shape, strides

_F32 = (torch.float32,)
_LIB = torch.library.Library("hybrid", "FRAGMENT")


def _define(name: str, schema: str, check, kernel, fake) -> None:
    """The op ``hybrid::name``: its CPU implementation is ``check`` (raising its message) then ``kernel`` (the ctypes
    call), its fake one ``check`` then ``fake`` (the outputs' metadata)."""

    def cpu(*args):
        _raise(check(*args))
        return kernel(*args)

    def meta(*args):
        _raise(check(*args))
        return fake(*args)

    _LIB.define(name + schema)
    _LIB.impl(name, cpu, "CPU")
    torch.library.register_fake(f"hybrid::{name}", meta, lib=_LIB)


def _after_supports(wrapper, kernel):
    """The dispatch calls ``kernel`` for ``wrapper`` right after the op's supports_* (the op's check among its
    tests) passed on the same arguments (kernels/dispatch.py): a decode step's ops validated once, without the
    torch dispatcher's ~2 us a call. Everything else calling ``wrapper`` goes through the op."""
    wrapper.after_supports = kernel
    return wrapper


def _raise(why: str | None) -> None:
    if why is not None:
        raise ValueError(why)


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def _code(t: torch.Tensor | None) -> int:
    return -1 if t is None else DTYPE_CODES[t.dtype]


def _gates(state: torch.Tensor | None, tensors) -> str | None:
    """What only the dispatch refuses: a tensor subclass, tracing (torch.compile runs the torch path), autograd."""
    if state is not None and type(state) is not torch.Tensor:
        return f"state is a {type(state).__name__}"
    if torch.compiler.is_compiling():
        return "compiling"
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return "autograd"
    return None


def _dims(op: str, name: str, t: torch.Tensor, n: int, what: str) -> str | None:
    return None if t.dim() == n else bad(op, name, shape(t), what)


# ---- Mamba-2 SSD step ---------------------------------------------------------------------------------------------

def check_ssd_step(state, x, dt, A, B, C, D=None, slots=None) -> str | None:
    op = "ssd_step"
    why = off_cpu(op, "state x dt A B C D slots", state, x, dt, A, B, C, D, slots) \
        or _dims(op, "x", x, 3, "[n, heads, head_dim]") or _dims(op, "B", B, 3, "[n, groups, d_state]")
    if why:
        return why
    n, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    if not 0 < N <= 512:
        return bad(op, "B", shape(B), "a d_state of 1..512")
    if G < 1 or H % G:
        return bad(op, "B", shape(B), f"a number of groups that divides the {H} heads")
    why = inner_rows(op, "x", x, (n, H, P)) or inner_rows(op, "B", B, (n, G, N), (x.dtype,)) \
        or inner_rows(op, "C", C, (n, G, N), (x.dtype,)) or inner_rows(op, "dt", dt, (n, H), _F32) \
        or contiguous(op, "A", A, (H,), _F32) or (D is not None and contiguous(op, "D", D, (H,))) \
        or float_state(op, state, n, slots, (H, P, N))
    return why or None


def _ssd_step_kernel(state, x, dt, A, B, C, D=None, slots=None):
    n, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    y = torch.empty(n, H, P, dtype=x.dtype)
    library().hl_ssd_step(state.data_ptr(), DTYPE_CODES[state.dtype], _ptr(slots), x.data_ptr(), DTYPE_CODES[x.dtype],
                          x.stride(0), dt.data_ptr(), dt.stride(0), A.data_ptr(), B.data_ptr(), B.stride(0),
                          C.data_ptr(), C.stride(0), _ptr(D), _code(D), y.data_ptr(), n, H, P, N, G)
    return y


def _ssd_step_fake(state, x, dt, A, B, C, D=None, slots=None):
    return x.new_empty(x.shape)


_define("ssd_step", "(Tensor(a!) state, Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor? D=None, "
        "Tensor? slots=None) -> Tensor", check_ssd_step, _ssd_step_kernel, _ssd_step_fake)


def supports_ssd_step(state, x, dt, A, B, C, *, D=None, slots=None) -> str | None:
    """fp32/bf16 state, rows of x/B/C contiguous within a sequence, d_state <= 512"""
    return _gates(state, (state, x, dt, A, B, C, D)) or check_ssd_step(state, x, dt, A, B, C, D, slots)


def ssd_step(state, x, dt, A, B, C, *, D=None, slots=None) -> torch.Tensor:
    return torch.ops.hybrid.ssd_step.default(state, x, dt, A, B, C, D, slots)


_after_supports(ssd_step, lambda state, x, dt, A, B, C, *, D=None, slots=None:
                _ssd_step_kernel(state, x, dt, A, B, C, D, slots))


# ---- Gated DeltaNet step ------------------------------------------------------------------------------------------

def check_gdn_step(state, q, k, v, g, beta, scale=None, slots=None) -> str | None:
    op = "gdn_step"
    why = off_cpu(op, "state q k v g beta slots", state, q, k, v, g, beta, slots) \
        or _dims(op, "q", q, 3, "[n, key_heads, K]") or _dims(op, "v", v, 3, "[n, heads, V]")
    if why:
        return why
    n, Hk, K = q.shape
    H, V = v.shape[1], v.shape[2]
    if not (0 < K <= 512 and 0 < V <= 512):
        return bad(op, "q/v", f"have head dims K {K} and V {V}", "both in 1..512")
    if Hk < 1 or H % Hk:
        return bad(op, "v", shape(v), f"a number of heads that the {Hk} key heads divide")
    why = inner_rows(op, "q", q, (n, Hk, K)) or inner_rows(op, "k", k, (n, Hk, K), (q.dtype,)) \
        or (k.stride(0) != q.stride(0) and bad(op, "k", strides(k), f"q's row stride {q.stride(0)}")) \
        or inner_rows(op, "v", v, (n, H, V), (q.dtype,)) or inner_rows(op, "g", g, (n, H), _F32) \
        or inner_rows(op, "beta", beta, (n, H), _F32) \
        or (beta.stride(0) != g.stride(0) and bad(op, "beta", strides(beta), f"g's row stride {g.stride(0)}")) \
        or float_state(op, state, n, slots, (H, K, V))
    return why or None


def _gdn_step_kernel(state, q, k, v, g, beta, scale=None, slots=None):
    n, Hk, K = q.shape
    H, V = v.shape[1], v.shape[2]
    y = torch.empty(n, H, V, dtype=v.dtype)
    library().hl_gdn_step(state.data_ptr(), DTYPE_CODES[state.dtype], _ptr(slots), q.data_ptr(), k.data_ptr(),
                          q.stride(0), v.data_ptr(), DTYPE_CODES[v.dtype], v.stride(0), g.data_ptr(), beta.data_ptr(),
                          g.stride(0), K ** -0.5 if scale is None else float(scale), y.data_ptr(), n, H, Hk, K, V)
    return y


def _gdn_step_fake(state, q, k, v, g, beta, scale=None, slots=None):
    return v.new_empty(v.shape)


_define("gdn_step", "(Tensor(a!) state, Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float? scale=None, "
        "Tensor? slots=None) -> Tensor", check_gdn_step, _gdn_step_kernel, _gdn_step_fake)


def supports_gdn_step(state, q, k, v, g, beta, *, scale=None, slots=None) -> str | None:
    """fp32/bf16 state, q/k/v rows contiguous within a sequence and of one dtype, g/beta fp32, K and V <= 512"""
    return _gates(state, (state, q, k, v)) or check_gdn_step(state, q, k, v, g, beta, scale, slots)


def gdn_step(state, q, k, v, g, beta, *, scale=None, slots=None) -> torch.Tensor:
    return torch.ops.hybrid.gdn_step.default(state, q, k, v, g, beta, scale, slots)


_after_supports(gdn_step, lambda state, q, k, v, g, beta, *, scale=None, slots=None:
                _gdn_step_kernel(state, q, k, v, g, beta, scale, slots))


# ---- causal conv1d step -------------------------------------------------------------------------------------------

def check_conv_step(state, x, weight, bias=None, activation=None, slots=None) -> str | None:
    op = "conv_step"
    why = off_cpu(op, "state x weight bias slots", state, x, weight, bias, slots) \
        or _dims(op, "x", x, 2, "[n, channels]")
    if why:
        return why
    n, C = x.shape
    if activation not in (None, "silu"):
        return bad(op, "activation", f"is {activation!r}", "None or 'silu'")
    if weight.dim() not in (2, 3) or weight.shape[0] != C or weight.shape[-1] < 1 or weight.numel() != C * \
            weight.shape[-1]:
        return bad(op, "weight", shape(weight), f"[{C}, width] or [{C}, 1, width]")
    K = weight.shape[-1]
    why = inner_rows(op, "x", x, (n, C)) or contiguous(op, "weight", weight, tuple(weight.shape)) \
        or (bias is not None and contiguous(op, "bias", bias, (C,))) \
        or float_state(op, state, n, slots, (C, K - 1))
    return why or None


def _conv_step_kernel(state, x, weight, bias=None, activation=None, slots=None):
    n, C = x.shape
    y = torch.empty(n, C, dtype=x.dtype)
    library().hl_conv_step(state.data_ptr(), DTYPE_CODES[state.dtype], _ptr(slots), x.data_ptr(),
                           DTYPE_CODES[x.dtype], x.stride(0), weight.data_ptr(), DTYPE_CODES[weight.dtype],
                           _ptr(bias), _code(bias), int(activation == "silu"), y.data_ptr(), n, C, weight.shape[-1])
    return y


def _conv_step_fake(state, x, weight, bias=None, activation=None, slots=None):
    return x.new_empty(x.shape)


_define("conv_step", "(Tensor(a!) state, Tensor x, Tensor weight, Tensor? bias=None, str? activation=None, "
        "Tensor? slots=None) -> Tensor", check_conv_step, _conv_step_kernel, _conv_step_fake)


def supports_conv_step(state, x, weight, bias=None, *, activation=None, slots=None) -> str | None:
    """fp32/bf16 state, x's channels contiguous, SiLU or no activation"""
    return _gates(state, (state, x, weight, bias)) or check_conv_step(state, x, weight, bias, activation, slots)


def conv_step(state, x, weight, bias=None, *, activation=None, slots=None) -> torch.Tensor:
    return torch.ops.hybrid.conv_step.default(state, x, weight, bias, activation, slots)


_after_supports(conv_step, lambda state, x, weight, bias=None, *, activation=None, slots=None:
                _conv_step_kernel(state, x, weight, bias, activation, slots))


# ---- paged decode attention ---------------------------------------------------------------------------------------

def check_paged_decode(q, k_pool, v_pool, seq_lens, block_tables, window=None, scale=None) -> str | None:
    op = "paged_decode"
    why = off_cpu(op, "q k_pool v_pool seq_lens block_tables", q, k_pool, v_pool, seq_lens, block_tables) \
        or _dims(op, "q", q, 3, "[batch, q_heads, head_dim]") \
        or _dims(op, "k_pool", k_pool, 4, "[blocks, block_size, kv_heads, head_dim]")
    if why:
        return why
    B, Hq, D = q.shape
    Hkv = k_pool.shape[2]
    if k_pool.shape[3] != D:
        return bad(op, "k_pool", shape(k_pool), f"q's head_dim {D} last")
    if Hkv < 1 or Hq % Hkv or Hq // Hkv > 64:
        return bad(op, "k_pool", shape(k_pool), f"a number of KV heads dividing the {Hq} query heads, at most 64 "
                                                "query heads each")
    why = contiguous(op, "q", q, (B, Hq, D)) or contiguous(op, "k_pool", k_pool, tuple(k_pool.shape)) \
        or contiguous(op, "v_pool", v_pool, tuple(k_pool.shape), (k_pool.dtype,)) \
        or contiguous(op, "seq_lens", seq_lens, (B,), (torch.int32,)) \
        or _dims(op, "block_tables", block_tables, 2, f"[{B}, blocks per sequence]") \
        or inner_rows(op, "block_tables", block_tables, (B, block_tables.shape[1]), (torch.int32,))
    if why:
        return why
    if window is not None and window < 0:
        return bad(op, "window", f"is {window}", "None, 0 (none) or a positive number of tokens")
    return None


def _paged_decode_kernel(q, k_pool, v_pool, seq_lens, block_tables, window=None, scale=None):
    B, Hq, D = q.shape
    out = torch.empty_like(q)
    scale = D ** -0.5 if scale is None else scale
    library().hl_paged_decode(q.data_ptr(), DTYPE_CODES[q.dtype], k_pool.data_ptr(), v_pool.data_ptr(),
                              DTYPE_CODES[k_pool.dtype], seq_lens.data_ptr(), block_tables.data_ptr(),
                              block_tables.stride(0), out.data_ptr(), B, Hq, k_pool.shape[2], D, k_pool.shape[1],
                              window or 0, float(scale))
    return out


def _paged_decode_fake(q, k_pool, v_pool, seq_lens, block_tables, window=None, scale=None):
    return torch.empty_like(q)


_define("paged_decode", "(Tensor q, Tensor k_pool, Tensor v_pool, Tensor seq_lens, Tensor block_tables, "
        "int? window=None, float? scale=None) -> Tensor", check_paged_decode, _paged_decode_kernel, _paged_decode_fake)


def supports_paged_decode(q, k_pool, v_pool, seq_lens, block_tables, *, window=None, scale=None, k_scale=None,
                          v_scale=None) -> str | None:
    """fp32/bf16 pools, contiguous, at most 64 query heads per KV head"""
    if k_scale is not None or v_scale is not None:
        return "quantised pages"
    return _gates(None, (q, k_pool)) or check_paged_decode(q, k_pool, v_pool, seq_lens, block_tables, window, scale)


def paged_decode(q, k_pool, v_pool, seq_lens, block_tables, *, window=None, scale=None, k_scale=None,
                 v_scale=None) -> torch.Tensor:
    if k_scale is not None or v_scale is not None:
        raise ValueError("hybrid::paged_decode: k_scale/v_scale are given; it needs fp32/bf16 pages (quantised "
                         "pages run the torch path)")
    return torch.ops.hybrid.paged_decode.default(q, k_pool, v_pool, seq_lens, block_tables, window, scale)


_after_supports(paged_decode, lambda q, k_pool, v_pool, seq_lens, block_tables, *, window=None, scale=None,
                k_scale=None, v_scale=None: _paged_decode_kernel(q, k_pool, v_pool, seq_lens, block_tables, window,
                                                                 scale))


# the activations of the native library's fused ops (sublayer.c; the decode program, hybrid/decode/builder.py,
# passes them)
ACTIVATIONS = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "relu": 3, "relu2": 4}


# ---- GLA step -----------------------------------------------------------------------------------------------------

def check_gla_step(state, q, k, v, g, scale=None, slots=None) -> str | None:
    op = "gla_step"
    why = off_cpu(op, "state q k v g slots", state, q, k, v, g, slots) or _dims(op, "q", q, 3, "[n, heads, K]") \
        or _dims(op, "v", v, 3, "[n, heads, V]")
    if why:
        return why
    n, H, K = q.shape
    V = v.shape[2]
    if not (0 < V <= 512 and K > 0):
        return bad(op, "v", shape(v), "a value head dim of 1..512")
    why = inner_rows(op, "q", q, (n, H, K)) or inner_rows(op, "k", k, (n, H, K), (q.dtype,)) \
        or inner_rows(op, "v", v, (n, H, V), (q.dtype,)) or inner_rows(op, "g", g, (n, H, K), _F32) \
        or float_state(op, state, n, slots, (H, K, V))
    return why or None


def _gla_step_kernel(state, q, k, v, g, scale=None, slots=None):
    n, H, K = q.shape
    V = v.shape[2]
    y = torch.empty(n, H, V, dtype=v.dtype)
    rc = library().hl_gla_step(state.data_ptr(), DTYPE_CODES[state.dtype], _ptr(slots), q.data_ptr(), q.stride(0),
                               k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), DTYPE_CODES[v.dtype],
                               g.data_ptr(), g.stride(0), K ** -0.5 if scale is None else float(scale), y.data_ptr(),
                               n, H, H, K, V)
    if rc:
        raise RuntimeError(f"hl_gla_step refused H={H} K={K} V={V} (a bug: check_gla_step passed it)")
    return y


def _gla_step_fake(state, q, k, v, g, scale=None, slots=None):
    return v.new_empty(v.shape)


_define("gla_step", "(Tensor(a!) state, Tensor q, Tensor k, Tensor v, Tensor g, float? scale=None, "
        "Tensor? slots=None) -> Tensor", check_gla_step, _gla_step_kernel, _gla_step_fake)


def supports_gla_step(state, q, k, v, g, *, scale=None, slots=None) -> str | None:
    """fp32/bf16 state, q/k/v rows contiguous within a sequence and of one dtype, g fp32, V <= 512"""
    return _gates(state, (state, q, k, v)) or check_gla_step(state, q, k, v, g, scale, slots)


def gla_step(state, q, k, v, g, *, scale=None, slots=None) -> torch.Tensor:
    """kernels.gla.gla_step_ref's step in the native GLA loop (linear_attention.c): one pass over the state."""
    return torch.ops.hybrid.gla_step.default(state, q, k, v, g, scale, slots)


_after_supports(gla_step, lambda state, q, k, v, g, *, scale=None, slots=None:
                _gla_step_kernel(state, q, k, v, g, scale, slots))


# ---- the linear-attention layers' gates and norms (a decode step's few rows) ---------------------------------------

def _decode_rows(rows: int, tensors) -> str | None:
    """The gate / norm loops are single-threaded and scalar, for a decode step's few rows (prefill keeps torch's
    vectorised, threaded ops)."""
    if rows > MAX_ROWS:
        return f"{rows} rows (a decode step's loop: at most {MAX_ROWS})"
    return _gates(None, tensors)


def check_l2norm_heads(x, eps=1e-6) -> str | None:
    op = "l2norm_heads"
    return off_cpu(op, "x", x) or _dims(op, "x", x, 3, "[n, heads, K]") or inner_rows(op, "x", x, tuple(x.shape))


def _l2norm_heads_kernel(x, eps=1e-6):
    n, heads, K = x.shape
    y = torch.empty(n, heads, K, dtype=x.dtype)
    library().hl_l2norm_heads(x.data_ptr(), x.stride(0), DTYPE_CODES[x.dtype], y.data_ptr(), heads * K, n, heads, K,
                              eps)
    return y


def _l2norm_heads_fake(x, eps=1e-6):
    return x.new_empty(x.shape)


_define("l2norm_heads", "(Tensor x, float eps=1e-06) -> Tensor", check_l2norm_heads, _l2norm_heads_kernel,
        _l2norm_heads_fake)


def supports_l2norm_heads(x, eps=1e-6) -> str | None:
    """x [n, heads, K] fp32/bf16 (n <= 64), each row's heads contiguous"""
    return _decode_rows(x.shape[0] if x.dim() == 3 else MAX_ROWS + 1, (x,)) or check_l2norm_heads(x, eps)


def l2norm_heads(x, eps=1e-6) -> torch.Tensor:
    return torch.ops.hybrid.l2norm_heads.default(x, eps)


_after_supports(l2norm_heads, _l2norm_heads_kernel)


def check_gdn_gates(b, a, A_log, dt_bias) -> str | None:
    op = "gdn_gates"
    why = off_cpu(op, "b a A_log dt_bias", b, a, A_log, dt_bias) or _dims(op, "b", b, 2, "[n, heads]")
    if why:
        return why
    n, H = b.shape
    why = inner_rows(op, "b", b, (n, H)) or inner_rows(op, "a", a, (n, H), (b.dtype,)) \
        or contiguous(op, "A_log", A_log, (H,)) or contiguous(op, "dt_bias", dt_bias, (H,))
    return why or None


def _gdn_gates_kernel(b, a, A_log, dt_bias):
    n, H = b.shape
    g, beta = torch.empty(n, H), torch.empty(n, H)
    library().hl_gdn_gates(b.data_ptr(), b.stride(0), a.data_ptr(), a.stride(0), DTYPE_CODES[b.dtype], A_log.data_ptr(),
                           DTYPE_CODES[A_log.dtype], dt_bias.data_ptr(), DTYPE_CODES[dt_bias.dtype], g.data_ptr(),
                           beta.data_ptr(), n, H)
    return g, beta


def _gdn_gates_fake(b, a, A_log, dt_bias):
    return b.new_empty(b.shape, dtype=torch.float32), b.new_empty(b.shape, dtype=torch.float32)


_define("gdn_gates", "(Tensor b, Tensor a, Tensor A_log, Tensor dt_bias) -> (Tensor, Tensor)", check_gdn_gates,
        _gdn_gates_kernel, _gdn_gates_fake)


def supports_gdn_gates(b, a, A_log, dt_bias) -> str | None:
    """b, a [n, H] (n <= 64) of one fp32/bf16 dtype, each row contiguous; A_log, dt_bias [H] contiguous"""
    return _decode_rows(b.shape[0] if b.dim() == 2 else MAX_ROWS + 1, (b, a, A_log, dt_bias)) \
        or check_gdn_gates(b, a, A_log, dt_bias)


def gdn_gates(b, a, A_log, dt_bias) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ops.hybrid.gdn_gates.default(b, a, A_log, dt_bias)


_after_supports(gdn_gates, _gdn_gates_kernel)


def check_gla_decay(x, normalizer, clamp_min=None) -> str | None:
    op = "gla_decay"
    return off_cpu(op, "x", x) or contiguous(op, "x", x, tuple(x.shape)) \
        or (normalizer == 0 and bad(op, "normalizer", "is 0", "a non-zero divisor")) or None


def _gla_decay_kernel(x, normalizer, clamp_min=None):
    g = torch.empty(x.shape)
    library().hl_gla_decay(x.data_ptr(), DTYPE_CODES[x.dtype], g.data_ptr(), x.numel(), float(normalizer),
                           0.0 if clamp_min is None else float(clamp_min), int(clamp_min is not None))
    return g


def _gla_decay_fake(x, normalizer, clamp_min=None):
    return x.new_empty(x.shape, dtype=torch.float32)


_define("gla_decay", "(Tensor x, float normalizer, float? clamp_min=None) -> Tensor", check_gla_decay,
        _gla_decay_kernel, _gla_decay_fake)


def supports_gla_decay(x, normalizer, clamp_min=None) -> str | None:
    """contiguous fp32/bf16 x [n, width] (n <= 64)"""
    return _decode_rows(x.shape[0] if x.dim() == 2 else MAX_ROWS + 1, (x,)) or check_gla_decay(x, normalizer, clamp_min)


def gla_decay(x, normalizer, clamp_min=None) -> torch.Tensor:
    return torch.ops.hybrid.gla_decay.default(x, float(normalizer), clamp_min)


_after_supports(gla_decay,
                lambda x, normalizer, clamp_min=None: _gla_decay_kernel(x, float(normalizer), clamp_min))


# ---- Gated DeltaNet prefill: the UT solve and a chunk's operands ---------------------------------------------------

def check_gdn_ut_solve(A, X) -> str | None:
    op = "gdn_ut_solve"
    why = off_cpu(op, "A X", A, X)
    if why:
        return why
    if A.dim() < 2 or A.shape[-1] != A.shape[-2]:
        return bad(op, "A", shape(A), "[..., C, C]")
    if X.dim() != A.dim() or X.shape[:-1] != A.shape[:-1]:
        return bad(op, "X", shape(X), f"{[*A.shape[:-1], 'W']} (A's leading dims and chunk)")
    return contiguous(op, "A", A, tuple(A.shape), _F32) or contiguous(op, "X", X, tuple(X.shape), _F32)


def _gdn_ut_solve_kernel(A, X):
    C, W = X.shape[-2:]
    library().hl_gdn_ut_solve(A.data_ptr(), X.data_ptr(), X.numel() // (C * W) if C * W else 0, C, W)


def _gdn_ut_solve_fake(A, X):
    return None


_define("gdn_ut_solve", "(Tensor A, Tensor(a!) X) -> ()", check_gdn_ut_solve, _gdn_ut_solve_kernel,
        _gdn_ut_solve_fake)


def supports_gdn_ut_solve(A, X) -> str | None:
    """contiguous fp32 A [..., C, C] and X [..., C, W] on the CPU, no autograd"""
    return _gates(None, (A, X)) or check_gdn_ut_solve(A, X)


def gdn_ut_solve(A, X) -> torch.Tensor:
    """X overwritten by the solution (returned)."""
    torch.ops.hybrid.gdn_ut_solve.default(A, X)
    return X


def check_gdn_chunk_prep(q, k, kk, qk, c, beta, v) -> str | None:
    op = "gdn_chunk_prep"
    why = off_cpu(op, "q k kk qk c beta v", q, k, kk, qk, c, beta, v) or _dims(op, "q", q, 4, "[n, Hk, C, K]") \
        or _dims(op, "v", v, 4, "[n, H, C, V]")
    if why:
        return why
    n, Hk, C, K = q.shape
    H, V = v.shape[1], v.shape[3]
    if not 0 < C <= 128:
        return bad(op, "q", shape(q), "chunks of 1..128 tokens")
    if Hk < 1 or H % Hk:
        return bad(op, "v", shape(v), f"a number of heads that the {Hk} key heads divide")
    why = contiguous(op, "q", q, (n, Hk, C, K), _F32) or contiguous(op, "k", k, (n, Hk, C, K), _F32) \
        or contiguous(op, "kk", kk, (n, Hk, C, C), _F32) or contiguous(op, "qk", qk, (n, Hk, C, C), _F32) \
        or contiguous(op, "c", c, (n, H, C), _F32) or contiguous(op, "beta", beta, (n, H, C), _F32) \
        or contiguous(op, "v", v, (n, H, C, V), _F32)
    return why or None


def _gdn_chunk_prep_kernel(q, k, kk, qk, c, beta, v):
    n, Hk, C, K = q.shape
    H, V = v.shape[1], v.shape[-1]
    W, qe, kend = (torch.empty(n, H, C, K) for _ in range(3))
    attn = torch.empty(n, H, C, C)
    rc = library().hl_gdn_chunk_prep(q.data_ptr(), k.data_ptr(), kk.data_ptr(), qk.data_ptr(), c.data_ptr(),
                                     beta.data_ptr(), v.data_ptr(), W.data_ptr(), qe.data_ptr(), kend.data_ptr(),
                                     attn.data_ptr(), n, Hk, H // Hk, C, K, V)
    if rc != 0:
        raise RuntimeError(f"hl_gdn_chunk_prep refused chunks of {C} (a bug: check_gdn_chunk_prep passed it)")
    return W, qe, kend, attn


def _gdn_chunk_prep_fake(q, k, kk, qk, c, beta, v):
    n, Hk, C, K = q.shape
    H = v.shape[1]
    return (*(q.new_empty(n, H, C, K) for _ in range(3)), q.new_empty(n, H, C, C))


_define("gdn_chunk_prep", "(Tensor q, Tensor k, Tensor kk, Tensor qk, Tensor c, Tensor beta, Tensor(a!) v) -> "
        "(Tensor, Tensor, Tensor, Tensor)", check_gdn_chunk_prep, _gdn_chunk_prep_kernel, _gdn_chunk_prep_fake)


def supports_gdn_chunk_prep(q, k, kk, qk, c, beta, v) -> str | None:
    """contiguous fp32 operands on the CPU, no autograd, chunks of at most 128"""
    return _gates(None, (q, k, kk, qk, c, beta, v)) or check_gdn_chunk_prep(q, k, kk, qk, c, beta, v)


def gdn_chunk_prep(q, k, kk, qk, c, beta, v):
    """linear_attention.c's hl_gdn_chunk_prep: q/k [n, Hk, C, K], kk/qk [n, Hk, C, C], c/beta [n, H, C], v
    [n, H, C, V] (overwritten by U) -> (U, W, qe, kend [n, H, C, K], attn [n, H, C, C])."""
    W, qe, kend, attn = torch.ops.hybrid.gdn_chunk_prep.default(q, k, kk, qk, c, beta, v)
    return v, W, qe, kend, attn


# ---- Mamba-1 selective scan (prefill; kernels/native/scan.c) ------------------------------------------------------

SCAN_MAX_STATE = 64  # scan.c's SCAN_NMAX: a channel block's states live on the stack (Mamba-1 models use 16)


def check_selective_scan(x, dt, A, B, C, cu_seqlens, D=None, initial_states=None) -> str | None:
    op = "selective_scan"
    why = off_cpu(op, "x dt A B C cu_seqlens D initial_states", x, dt, A, B, C, cu_seqlens, D, initial_states) \
        or _dims(op, "x", x, 2, "[tokens, d_inner] (packed)") or _dims(op, "A", A, 2, "[d_inner, d_state]") \
        or _dims(op, "cu_seqlens", cu_seqlens, 1, "[sequences + 1]")
    if why:
        return why
    T, Dm = x.shape
    N = A.shape[1]
    nseq = cu_seqlens.shape[0] - 1
    if not 0 < N <= SCAN_MAX_STATE:
        return bad(op, "A", shape(A), f"a d_state of 1..{SCAN_MAX_STATE}")
    if nseq < 1:
        return bad(op, "cu_seqlens", shape(cu_seqlens), "at least 2 offsets (one sequence)")
    why = inner_rows(op, "x", x, (T, Dm)) or inner_rows(op, "dt", dt, (T, Dm)) \
        or inner_rows(op, "B", B, (T, N)) or inner_rows(op, "C", C, (T, N)) \
        or contiguous(op, "A", A, (Dm, N), _F32) \
        or contiguous(op, "cu_seqlens", cu_seqlens, (nseq + 1,), (torch.int64,)) \
        or (D is not None and contiguous(op, "D", D, (Dm,), _F32)) \
        or (initial_states is not None and tuple(initial_states.shape) != (nseq, Dm, N)
            and bad(op, "initial_states", shape(initial_states), str([nseq, Dm, N])))
    return why or None


def check_offsets(cu: list[int], tokens: int) -> str | None:
    """Values, so the CPU implementation's alone (fake tensors have none): offsets that rise from 0 to the tokens."""
    if cu[0] != 0 or cu[-1] != tokens or any(b < a for a, b in zip(cu, cu[1:], strict=False)):
        return bad("selective_scan", "cu_seqlens", f"is {cu}", f"offsets rising from 0 to the {tokens} tokens")
    return None


def _selective_scan_kernel(x, dt, A, B, C, cu_seqlens, D=None, initial_states=None):
    T, Dm = x.shape
    N, nseq = A.shape[1], cu_seqlens.shape[0] - 1
    _raise(check_offsets(cu_seqlens.tolist(), T))
    h = torch.zeros(nseq, Dm, N) if initial_states is None else \
        initial_states.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    y = torch.empty(T, Dm, dtype=x.dtype)
    rc = library().hl_selective_scan(x.data_ptr(), DTYPE_CODES[x.dtype], x.stride(0), dt.data_ptr(),
                                     DTYPE_CODES[dt.dtype], dt.stride(0), A.data_ptr(), B.data_ptr(),
                                     DTYPE_CODES[B.dtype], B.stride(0), C.data_ptr(), DTYPE_CODES[C.dtype], C.stride(0),
                                     _ptr(D), h.data_ptr(), y.data_ptr(), DTYPE_CODES[y.dtype], y.stride(0),
                                     cu_seqlens.data_ptr(), nseq, Dm, N)
    if rc != 0:
        raise RuntimeError(f"hl_selective_scan refused d_state {N} (a bug: check_selective_scan passed it)")
    return y, h


def _selective_scan_fake(x, dt, A, B, C, cu_seqlens, D=None, initial_states=None):
    return x.new_empty(x.shape), x.new_empty(cu_seqlens.shape[0] - 1, x.shape[1], A.shape[1], dtype=torch.float32)


_define("selective_scan", "(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor cu_seqlens, Tensor? D=None, "
        "Tensor? initial_states=None) -> (Tensor, Tensor)", check_selective_scan, _selective_scan_kernel,
        _selective_scan_fake)


def _scan_gates(x, dt, A, B, C, D, init) -> str | None:
    why = _gates(None, (x, dt, A, B, C, D, init))
    if why:
        return why
    if any(t.dtype not in FLOATS for t in (x, dt, B, C)):
        return f"input dtypes {x.dtype}/{dt.dtype}/{B.dtype}/{C.dtype} (the native scan reads fp32 and bf16)"
    if A.dim() != 2 or not 0 < A.shape[1] <= SCAN_MAX_STATE:
        return f"d_state {A.shape[-1]} (the native scan takes 1..{SCAN_MAX_STATE})"
    return off_cpu("selective_scan", "x dt A B C D", x, dt, A, B, C, D)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., W] as [rows, W] with contiguous rows (a view where the strides allow it)."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.shape[1] <= 1 or t.stride(1) == 1 else t.contiguous()


def supports_selective_scan(x, dt, A, B, C, *, D=None, initial_state=None) -> str | None:
    """fp32/bf16 inputs, d_state <= 64, inference (any layout: the wrapper packs the batch's rows)"""
    return _scan_gates(x, dt, A, B, C, D, initial_state)


def selective_scan(x, dt, A, B, C, *, D=None, initial_state=None) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels.selective.selective_scan's contract (x, dt [b, L, D], B/C [b, L, N]) through the packed op: the
    batch's sequences as L-token pieces of one packed batch."""
    b, L, Dm = x.shape
    cu = torch.arange(0, b * L + 1, L, dtype=torch.int64) if L else torch.zeros(b + 1, dtype=torch.int64)
    y, h = torch.ops.hybrid.selective_scan.default(
        _rows(x), _rows(dt), A.float().contiguous(), _rows(B), _rows(C), cu,
        None if D is None else D.float().contiguous(), initial_state)
    return y.view(b, L, Dm), h


def supports_selective_varlen_scan(x, dt, A, B, C, cu_seqlens, *, D=None, initial_states=None) -> str | None:
    """fp32/bf16 inputs, d_state <= 64, inference"""
    return _scan_gates(x, dt, A, B, C, D, initial_states)


def selective_varlen_scan(x, dt, A, B, C, cu_seqlens, *, D=None, initial_states=None):
    """kernels.selective.selective_varlen_scan's contract (x, dt [T, D], B/C [T, N]): one native call for every
    sequence (the boundaries validated by the caller, kernels.packing.check_cu_seqlens)."""
    from ..packing import host_values

    cu = torch.tensor(host_values(cu_seqlens), dtype=torch.int64)
    return torch.ops.hybrid.selective_scan.default(_rows(x), _rows(dt), A.float().contiguous(), _rows(B), _rows(C),
                                                   cu, None if D is None else D.float().contiguous(), initial_states)

