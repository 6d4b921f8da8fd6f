"""The ``cuda`` backend: thin wrappers over the CUDA packages (flash-attn, mamba-ssm, causal-conv1d, fla-core).

Each package is imported once, on first use; a failure (not installed, or installed without its
compiled CUDA module, which raises at import) is remembered with its reason, which the probes
return and ``hybrid doctor`` prints. The wrappers only convert layouts:

- flash-attn takes our packed ``[T, H, D]`` and paged ``[blocks, block_size, Hkv, D]`` layouts as they
  are; its causal mask is aligned bottom-right, as ours (new tokens are the last positions), and our
  ``window`` (which counts the query itself) is its ``window_size=(window - 1, 0)``.
- mamba-ssm gets dt already softplus'd (``dt_softplus=False``, no dt_bias); Mamba-2 decode ties A, dt
  and D across the head dim with stride-0 views, as its kernel expects.
- causal-conv1d is channel-first ``[B, C, L]``: our channel-last ``[B, L, C]`` is passed as a transposed
  view (its channel-last path, the one that takes initial states and returns final states).

What a package cannot take (FA2's paged KV needs blocks of 256 tokens, mamba-ssm's packed scan takes no
per-sequence initial states, ...) is said by the ``supports_*`` checks, which dispatch runs per call.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .packing import host_values

# package -> (distribution name, {our name: "module:attribute"})
PACKAGES = {
    "flash_attn": ("flash-attn", {
        "varlen": "flash_attn:flash_attn_varlen_func",
        "kvcache": "flash_attn:flash_attn_with_kvcache",
    }),
    "mamba_ssm": ("mamba-ssm", {
        "chunk_scan": "mamba_ssm.ops.triton.ssd_combined:mamba_chunk_scan_combined",
        "state_update": "mamba_ssm.ops.triton.selective_state_update:selective_state_update",
        "selective_scan": "mamba_ssm.ops.selective_scan_interface:selective_scan_fn",
    }),
    "causal_conv1d": ("causal-conv1d", {
        "fn": "causal_conv1d:causal_conv1d_fn",
        "update": "causal_conv1d:causal_conv1d_update",
    }),
    # flash-linear-attention's Triton kernels (distribution fla-core): the gated delta rule
    "fla": ("fla-core", {
        "chunk": "fla.ops.gated_delta_rule:chunk_gated_delta_rule",
        "recurrent": "fla.ops.gated_delta_rule:fused_recurrent_gated_delta_rule",
    }),
    # the same distribution's GLA kernels, loaded apart so a version without them leaves the delta rule usable
    "fla_gla": ("fla-core", {
        "chunk": "fla.ops.gla:chunk_gla",
        "recurrent": "fla.ops.gla:fused_recurrent_gla",
    }),
}
_loaded: dict[str, dict[str, Callable] | str] = {}  # package -> its functions, or why it failed


def _load(package: str) -> dict[str, Callable] | str:
    if package not in _loaded:
        try:
            fns = {}
            for name, target in PACKAGES[package][1].items():
                module, attr = target.split(":")
                fns[name] = getattr(importlib.import_module(module), attr)
            _loaded[package] = fns
        except Exception as e:  # ImportError, or the package's CUDA extension failing to load
            _loaded[package] = f"{package} does not import ({type(e).__name__}: {e})".replace("\n", " ")
    return _loaded[package]


def _fns(package: str) -> dict[str, Callable]:
    fns = _load(package)
    if isinstance(fns, str):
        raise RuntimeError(fns)
    return fns


def fla(name: str) -> Callable:
    """flash-linear-attention's ``chunk`` or ``recurrent`` gated delta rule (imported on first use)."""
    return _fns("fla")[name]


def fla_gla(name: str) -> Callable:
    """flash-linear-attention's ``chunk`` or ``recurrent`` gated linear attention (imported on first use)."""
    return _fns("fla_gla")[name]


def probe(package: str) -> Callable[[], str | None]:
    """A dispatch probe: None when ``package`` imports with its CUDA code, else the remembered reason."""
    def check() -> str | None:
        if not torch.cuda.is_available():
            return "no CUDA device"
        loaded = _load(package)
        return loaded if isinstance(loaded, str) else None

    check.__name__ = f"probe_{package}"
    return check


def versions() -> dict[str, str]:
    """Installed version of each CUDA package, or why it is not usable (for ``hybrid doctor``)."""
    out = {}
    for package, (dist, _) in PACKAGES.items():
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "not installed"
            continue
        loaded = _load(package) if torch.cuda.is_available() else "not imported (no CUDA device)"
        line = version if not isinstance(loaded, str) else f"{version}, {loaded}"
        if dist not in out or out[dist] == version:  # fla-core has two groups: a failure of either shows
            out[dist] = line
    return out


@functools.cache
def _accepts(fn: Callable, param: str) -> bool:
    # reflected once per (function, parameter), not per call: this sits on the decode path
    try:
        return param in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _on_slots(run: Callable, state: torch.Tensor, slots: torch.Tensor | None) -> torch.Tensor:
    """For package versions without slot indices: gather the rows, step them, scatter them back."""
    if slots is None:
        return run(state)
    rows = state[slots]
    y = run(rows)
    state[slots] = rows
    return y


# --- flash-attn -------------------------------------------------------------------------------------

_FA_DTYPES = (torch.float16, torch.bfloat16)
_FA_PAGE = 256  # FA2: "Paged KV cache block size must be divisible by 256"


def _window(window: int | None) -> tuple[int, int]:
    return (-1, -1) if window is None else (window - 1, 0)


def supports_flash(q, *args, **kwargs) -> str | None:
    """flash-attn needs fp16/bf16 and head_dim <= 256, a multiple of 8"""
    if q.dtype not in _FA_DTYPES:
        return f"flash-attn takes fp16/bf16, got {q.dtype}"
    if q.shape[-1] > 256 or q.shape[-1] % 8:
        return f"flash-attn takes head_dim <= 256 and a multiple of 8, got {q.shape[-1]}"
    return None


def supports_flash_paged(q, k_pool, *args, **kwargs) -> str | None:
    """flash-attn (FA2) paged KV needs block_size % 256 == 0, fp16/bf16, head_dim <= 256 and % 8 == 0"""
    if k_pool.shape[1] % _FA_PAGE:
        return f"flash-attn's paged KV needs block_size % {_FA_PAGE} == 0, the pool has blocks of {k_pool.shape[1]}"
    if not _accepts(_fns("flash_attn")["varlen"], "block_table"):
        return "the installed flash-attn's flash_attn_varlen_func has no block_table (needs flash-attn >= 2.6)"
    return supports_flash(q)


def varlen_attention(q, k, v, cu_seqlens, *, window=None, scale=None):
    bounds = host_values(cu_seqlens)
    cu = cu_seqlens.to(torch.int32)
    max_len = max(b - a for a, b in zip(bounds, bounds[1:], strict=False))
    return _fns("flash_attn")["varlen"](q, k, v, cu, cu, max_len, max_len, softmax_scale=scale, causal=True,
                                        window_size=_window(window))


def paged_prefill_attention(q, k_pool, v_pool, cu_seqlens_q, seq_lens, block_tables, *, window=None, scale=None):
    bounds = host_values(cu_seqlens_q)
    cu_q = cu_seqlens_q.to(torch.int32)
    cu_k = F.pad(torch.cumsum(seq_lens, 0, dtype=torch.int32), (1, 0))
    max_q = max(b - a for a, b in zip(bounds, bounds[1:], strict=False))
    return _fns("flash_attn")["varlen"](
        q, k_pool, v_pool, cu_q, cu_k, max_q, max(host_values(seq_lens)), softmax_scale=scale,
        causal=True, window_size=_window(window), block_table=block_tables.to(torch.int32))


def paged_decode_attention(q, k_pool, v_pool, seq_lens, block_tables, *, window=None, scale=None):
    out = _fns("flash_attn")["kvcache"](q[:, None], k_pool, v_pool, cache_seqlens=seq_lens.to(torch.int32),
                                        block_table=block_tables.to(torch.int32), softmax_scale=scale, causal=True,
                                        window_size=_window(window))
    return out[:, 0]


def causal_attention(q, k, v, *, window=None, scale=None):
    B, Lq, Hq, D = q.shape
    Lk = k.shape[1]
    steps = torch.arange(B + 1, device=q.device, dtype=torch.int32)
    out = _fns("flash_attn")["varlen"](q.reshape(B * Lq, Hq, D), k.reshape(B * Lk, *k.shape[2:]),
                                       v.reshape(B * Lk, *v.shape[2:]), steps * Lq, steps * Lk, Lq, Lk,
                                       softmax_scale=scale, causal=True, window_size=_window(window))
    return out.view(B, Lq, Hq, D)


# --- mamba-ssm --------------------------------------------------------------------------------------

def supports_packed_ssd(x, dt, A, B, C, cu_seqlens, *, chunk_size, D=None, initial_states=None) -> str | None:
    """mamba-ssm's packed scan takes initial states only for a single sequence"""
    if initial_states is not None and cu_seqlens.numel() > 2:
        return "mamba_chunk_scan_combined takes one initial state for the whole packed row, not one per sequence"
    return None


def ssd_chunk_scan(x, dt, A, B, C, *, chunk_size, D=None, initial_state=None):
    y, final = _fns("mamba_ssm")["chunk_scan"](x, dt, A, B, C, chunk_size, D=D, initial_states=initial_state,
                                               dt_softplus=False, return_final_states=True)
    return y, final.float()


def ssd_varlen_scan(x, dt, A, B, C, cu_seqlens, *, chunk_size, D=None, initial_states=None):
    cu = cu_seqlens.to(torch.int32)
    seq_idx = torch.repeat_interleave(torch.arange(cu.numel() - 1, device=x.device, dtype=torch.int32),
                                      (cu[1:] - cu[:-1]).long(), output_size=x.shape[0])
    y, states = _fns("mamba_ssm")["chunk_scan"](x[None], dt[None], A, B[None], C[None], chunk_size, D=D,
                                                initial_states=initial_states, seq_idx=seq_idx[None], cu_seqlens=cu,
                                                dt_softplus=False, return_varlen_states=True)
    return y[0], states.float()


def _state_update(state, x, dt, A, B, C, D, slots):
    fn = _fns("mamba_ssm")["state_update"]
    if slots is not None and _accepts(fn, "state_batch_indices"):
        return fn(state, x, dt, A, B, C, D=D, state_batch_indices=slots.to(torch.int32))
    return _on_slots(lambda s: fn(s, x, dt, A, B, C, D=D), state, slots)


def ssd_step(state, x, dt, A, B, C, *, D=None, slots=None):
    H, P = x.shape[1:]
    N = state.shape[-1]
    # stride-0 views: one decay, one dt and one skip per head, tied across P (and N for A)
    A_hpn = A[:, None, None].expand(H, P, N)
    dt_bhp = dt[:, :, None].expand(*dt.shape, P)
    D_hp = None if D is None else D[:, None].expand(H, P)
    return _state_update(state, x, dt_bhp, A_hpn, B, C, D_hp, slots)


def selective_step(state, x, dt, A, B, C, *, D=None, slots=None):
    return _state_update(state, x, dt, A, B, C, D, slots)


def supports_no_initial_state(*args, initial_state=None, initial_states=None, **kwargs) -> str | None:
    """mamba-ssm's selective_scan_fn takes no initial state"""
    if initial_state is not None or initial_states is not None:
        return "selective_scan_fn takes no initial state"
    return None


def selective_scan(x, dt, A, B, C, *, D=None, initial_state=None):
    y, last = _fns("mamba_ssm")["selective_scan"](
        x.transpose(1, 2), dt.transpose(1, 2), A, B.transpose(1, 2), C.transpose(1, 2),
        D=None if D is None else D.float(), delta_softplus=False, return_last_state=True)
    return y.transpose(1, 2), last.float()


def selective_varlen_scan(x, dt, A, B, C, cu_seqlens, *, D=None, initial_states=None):
    y = torch.empty_like(x)
    finals = []
    cu = host_values(cu_seqlens)
    for start, end in zip(cu, cu[1:], strict=False):  # selective_scan_fn has no packed form
        yb, fb = selective_scan(x[None, start:end], dt[None, start:end], A, B[None, start:end], C[None, start:end], D=D)
        y[start:end] = yb[0]
        finals.append(fb)
    return y, torch.cat(finals)


# --- causal-conv1d ----------------------------------------------------------------------------------

def supports_conv(x, weight, *args, **kwargs) -> str | None:
    """causal-conv1d takes kernel widths 2 to 4"""
    if not 2 <= weight.shape[1] <= 4:
        return f"causal-conv1d takes kernel widths 2..4, got {weight.shape[1]}"
    return None


def supports_conv_varlen(x, weight, bias, cu_seqlens, *, initial_states=None, activation=None) -> str | None:
    """causal-conv1d with sequence boundaries takes no initial states; widths 2 to 4"""
    if initial_states is not None:
        return "causal_conv1d_fn with seq_idx takes no initial states"
    return supports_conv(x, weight)


def supports_conv_step(state, x, weight, *args, **kwargs) -> str | None:
    """causal_conv1d_update needs the conv state in the input's dtype; widths 2 to 4"""
    if state.dtype != x.dtype:
        return f"causal_conv1d_update needs the state in the input's dtype ({x.dtype}), got {state.dtype}"
    return supports_conv(x, weight)


def _channel_last(t: torch.Tensor) -> torch.Tensor:
    """[B, C, K] with the C axis contiguous, the layout causal-conv1d's channel-last kernel reads."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def causal_conv1d(x, weight, bias=None, *, initial_state=None, activation=None):
    x = x if x.stride(-1) == 1 else x.contiguous()
    init = None if initial_state is None else _channel_last(initial_state.to(x.dtype))
    y, final = _fns("causal_conv1d")["fn"](x.transpose(1, 2), weight, bias, initial_states=init,
                                           return_final_states=True, activation=activation)
    return y.transpose(1, 2), final.contiguous()


def causal_conv1d_varlen(x, weight, bias, cu_seqlens, *, initial_states=None, activation=None):
    x = x if x.stride(-1) == 1 else x.contiguous()
    cu = cu_seqlens.to(torch.int32)
    nseq, K = cu.numel() - 1, weight.shape[1]
    seq_idx = torch.repeat_interleave(torch.arange(nseq, device=x.device, dtype=torch.int32),
                                      (cu[1:] - cu[:-1]).long(), output_size=x.shape[0])
    y = _fns("causal_conv1d")["fn"](x.T[None], weight, bias, seq_idx=seq_idx[None], activation=activation)
    return y[0].T, last_inputs(x, cu, K - 1)


def last_inputs(x: torch.Tensor, cu_seqlens: torch.Tensor, n: int) -> torch.Tensor:
    """The final conv states the package does not return with seq_idx: each sequence's last ``n``
    inputs, zeros before its start. x [T, C] -> [B, C, n]."""
    src = cu_seqlens[1:, None].long() - n + torch.arange(n, device=x.device)  # [B, n]
    inside = src >= cu_seqlens[:-1, None]
    return (x[src.clamp(min=0)] * inside[..., None]).transpose(1, 2).contiguous()


def causal_conv1d_step(state, x, weight, bias=None, *, activation=None, slots=None):
    fn = _fns("causal_conv1d")["update"]
    if slots is not None and _accepts(fn, "conv_state_indices"):
        return fn(x, state, weight, bias, activation, conv_state_indices=slots.to(torch.int32))
    return _on_slots(lambda s: fn(x, s, weight, bias, activation), state, slots)
