"""Causal depthwise conv1d (the short conv in front of every Mamba mixer) and its one-step form.

Layouts: ``x: [B, L, C]`` (channels last, as in the model), ``weight: [C, K]``, ``bias: [C]``,
conv state ``[B, C, K-1]``: the last K-1 inputs, oldest first.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from . import cuda_backend, dispatch, native, triton_support
from .compute_dtype import matmul_dtype
from .native import ops as native_ops
from .packing import check_cu_seqlens, sequences, step_on_slots
from .triton_support import INTERPRET, jit, needs_grad, next_pow2, tl, triton

_ACTIVATIONS = {None: lambda t: t, "silu": F.silu}


def causal_conv1d_ref(x, weight, bias=None, *, initial_state=None, activation=None):
    """Explicit sum over taps, the reference. Returns (y [B, L, C], final_state [B, C, K-1])."""
    b, L, Cn = x.shape
    K = weight.shape[1]
    prev = x.new_zeros(b, Cn, K - 1) if initial_state is None else initial_state.to(x.dtype)
    xs = torch.cat([prev, x.transpose(1, 2)], dim=-1).float()  # [B, C, K-1+L]
    y = sum(xs[:, :, k:k + L] * weight[:, k, None].float() for k in range(K))
    if bias is not None:
        y = y + bias.float()[:, None]
    y = _ACTIVATIONS[activation](y)
    return y.transpose(1, 2).to(x.dtype), xs[:, :, xs.shape[-1] - (K - 1):].to(x.dtype)


@functools.cache
def _onednn_conv_available() -> bool:
    """oneDNN's fused convolution + activation op (``mkldnn::_convolution_pointwise``), in torch's x86 and
    aarch64 CPU builds."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        return torch.ops.mkldnn._convolution_pointwise.default is not None
    except (AttributeError, RuntimeError):
        return False


def _conv_onednn(x4, w4, bias, left_pad, activation):
    return torch.ops.mkldnn._convolution_pointwise(x4, w4, bias, [0, left_pad], [1, 1], [1, 1], x4.shape[1],
                                                   "swish" if activation == "silu" else "none", [], "")


def _causal_conv1d_onednn(x, weight, bias, initial_state, activation):
    """oneDNN's depthwise convolution with the activation fused (inference, fp32 or native bf16).

    [B, L, C] read as [B, C, 1, L] is a channels-last (NHWC) image, so oneDNN convolves the tensor where it lies
    (the in_proj output's column slice, no copy) and writes a channels-last output whose first L columns are
    [B, L, C] rows: one pass in, one out, silu applied before the single rounding. 2 threads, a mamba2-small
    layer's [2048, 1792] slice: fp32 9.9 -> 2.5 ms, bf16 18.5 -> 1.4 ms against the K shifted multiply-adds
    (bf16 elementwise ops convert every element both ways). Zero padding on the left; with a state, the first
    K-1 outputs are recomputed from the state's taps (a [K-1+r, C] convolution) instead of copying the input
    behind the state."""
    b, L, Cn = x.shape
    K = weight.shape[1]
    w4 = weight.to(x.dtype)[:, None, None, :]
    bias = None if bias is None else bias.to(x.dtype)
    y = _conv_onednn(x.transpose(1, 2).unsqueeze(2), w4, bias, K - 1, activation)[:, :, 0, :L].transpose(1, 2)
    if initial_state is not None:
        r = min(K - 1, L)
        head = torch.cat([initial_state.to(x.dtype).transpose(1, 2), x[:, :r]], 1)  # [B, K-1+r, C]
        y[:, :r] = _conv_onednn(head.transpose(1, 2).unsqueeze(2), w4, bias, 0, activation)[:, :, 0].transpose(1, 2)
    return y, _final_conv_state(x, initial_state, K)


def _causal_conv1d_torch(x, weight, bias=None, *, initial_state=None, activation=None):
    """K shifted multiply-adds in the model's channels-last layout [B, L, C]; in inference, oneDNN's fused
    depthwise convolution where the CPU computes the dtype natively (:func:`_causal_conv1d_onednn`).

    A depthwise conv has K multiply-adds per element: it is bound by memory, not arithmetic. Called as a 1-D
    conv, oneDNN's grouped conv wants channels first, so it paid a transpose of the input and of the output
    (and ran a slow depthwise kernel): ~10x the time of these K contiguous passes; called as the 2-D
    channels-last conv the layout already is, it is 4-13x faster than them (:func:`_causal_conv1d_onednn`).
    The taps remain for autograd and for dtypes the CPU does not compute natively; there they read the input
    where it lies (no concatenated copy of state and input) and the bias rides on the first multiply-add: K
    passes and the activation, where the concatenated form made K + 3.
    """
    b, L, Cn = x.shape
    K = weight.shape[1]
    cd = matmul_dtype(x.dtype, x.device)  # bf16 arithmetic only where the CPU has it
    grad = needs_grad(x, weight, bias, initial_state)
    if not grad and x.device.type == "cpu" and cd == x.dtype and _onednn_conv_available():
        return _causal_conv1d_onednn(x, weight, bias, initial_state, activation)
    w = weight.to(cd).t()  # [K, C]
    if grad:
        return _causal_conv1d_concat(x, w, bias, initial_state, activation, cd)
    xc = x.to(cd)
    prev = None if initial_state is None else initial_state.to(cd).transpose(1, 2)  # [B, K-1, C]
    # tap K-1 is the token itself; tap k reads the token K-1-k back, from the state for the first rows
    y = xc * w[K - 1] if bias is None else torch.addcmul(bias.to(cd), xc, w[K - 1])
    for k in range(K - 1):
        back = K - 1 - k
        if back < L:
            y[:, back:].addcmul_(xc[:, :L - back], w[k])
        if prev is not None:
            rows = min(back, L)
            y[:, :rows].addcmul_(prev[:, k:k + rows], w[k])
    if activation == "silu":
        y = F.silu(y, inplace=True)
    return y.to(x.dtype), _final_conv_state(x, initial_state, K)


def _final_conv_state(x, initial_state, K):
    """The last K-1 inputs (oldest first) of state followed by x: [B, C, K-1] in x's dtype."""
    b, L, Cn = x.shape
    tail = x[:, max(0, L - (K - 1)):]
    if tail.shape[1] < K - 1:  # a prompt shorter than the window: the state's newest entries come first
        prev = (x.new_zeros(b, K - 1, Cn) if initial_state is None
                else initial_state.to(x.dtype).transpose(1, 2))
        tail = torch.cat([prev, tail], 1)[:, -(K - 1):]
    return tail.transpose(1, 2).contiguous()


def _causal_conv1d_concat(x, w, bias, initial_state, activation, cd):
    """The out-of-place form autograd records: state and input concatenated, then the K taps."""
    b, L, Cn = x.shape
    K = w.shape[0]
    prev = x.new_zeros(b, K - 1, Cn) if initial_state is None else initial_state.to(x.dtype).transpose(1, 2)
    xs = torch.cat([prev, x], dim=1).to(cd)  # [B, K-1+L, C]: the taps before the start come from the state
    y = xs[:, :L] * w[0]
    for k in range(1, K):
        y = y + xs[:, k:k + L] * w[k]
    if bias is not None:
        y = y + bias.to(cd)
    if activation == "silu":
        y = F.silu(y)
    final = xs[:, xs.shape[1] - (K - 1):].transpose(1, 2).to(x.dtype).contiguous()  # [B, C, K-1]
    return y.to(x.dtype), final


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  initial_state: torch.Tensor | None = None,
                  activation: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv1d. x [B, L, C] -> (y [B, L, C], final conv state [B, C, K-1])."""
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[0] != x.shape[2]:
        raise ValueError(f"causal_conv1d: need x [B, L, C] and weight [C, K]; "
                         f"got {tuple(x.shape)}, {tuple(weight.shape)}")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"causal_conv1d: activation must be one of {list(_ACTIVATIONS)}, got {activation!r}")
    _, fn = dispatch.choose("causal_conv1d", x.device.type)
    with torch.profiler.record_function("conv1d"):
        return fn(x, weight, bias, initial_state=initial_state, activation=activation)


def causal_conv1d_step_ref(state, x, weight, bias=None, *, activation=None):
    """One token: state [B, C, K-1] (shifted in place), x [B, C] -> y [B, C]."""
    window = torch.cat([state, x[:, :, None].to(state.dtype)], dim=-1)  # [B, C, K]
    y = (window.float() * weight.float()).sum(-1)
    if bias is not None:
        y = y + bias.float()
    state.copy_(window[:, :, 1:])
    return _ACTIVATIONS[activation](y).to(x.dtype)


def _causal_conv1d_step_torch(state, x, weight, bias=None, *, activation=None, slots=None):
    return step_on_slots(causal_conv1d_step_ref, state, slots, x, weight, bias, activation=activation)


def causal_conv1d_step(state: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None = None, *, activation: str | None = None,
                       slots: torch.Tensor | None = None) -> torch.Tensor:
    """One decode step of the causal conv, shifting the state in place: ``state`` [B, C, K-1], or
    with ``slots`` a pool [S, C, K-1] whose rows ``slots`` belong to the batch. x [B, C] -> y [B, C]."""
    _, fn = dispatch.choose("causal_conv1d_step", x.device.type)
    return fn(state, x, weight, bias, activation=activation, slots=slots)


def _varlen(conv, x, weight, bias, cu_seqlens, initial_states, activation):
    y = torch.empty_like(x)
    finals = []
    for b, s in sequences(cu_seqlens):
        init = None if initial_states is None else initial_states[b:b + 1]
        yb, fb = conv(x[None, s], weight, bias, initial_state=init, activation=activation)
        y[s] = yb[0]
        finals.append(fb)
    return y, torch.cat(finals)


def causal_conv1d_varlen_ref(x, weight, bias, cu_seqlens, *, initial_states=None, activation=None):
    return _varlen(causal_conv1d_ref, x, weight, bias, cu_seqlens, initial_states, activation)


def _causal_conv1d_varlen_torch(x, weight, bias, cu_seqlens, *, initial_states=None, activation=None):
    return _varlen(_causal_conv1d_torch, x, weight, bias, cu_seqlens, initial_states, activation)


def causal_conv1d_varlen(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         cu_seqlens: torch.Tensor, *, initial_states: torch.Tensor | None = None,
                         activation: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal conv over a packed batch: x [T, C], cu_seqlens [B+1], initial_states [B, C, K-1] or
    None. Returns (y [T, C], final_states [B, C, K-1]); no tap reaches across a sequence boundary."""
    check_cu_seqlens(cu_seqlens, x.shape[0], "causal_conv1d_varlen")
    _, fn = dispatch.choose("causal_conv1d_varlen", x.device.type)
    with torch.profiler.record_function("conv1d"):
        return fn(x, weight, bias, cu_seqlens, initial_states=initial_states, activation=activation)


dispatch.register("causal_conv1d", "torch", _causal_conv1d_torch)
dispatch.register("causal_conv1d_varlen", "torch", _causal_conv1d_varlen_torch)
dispatch.register("causal_conv1d_step", "torch", _causal_conv1d_step_torch)
dispatch.register("causal_conv1d_step", "native", native_ops.conv_step, native.available, native_ops.supports_conv_step)


# --- Triton ----------------------------------------------------------------------------------------
# Packed forward: grid (token blocks, channel blocks) over the flat batch. Each token finds its
# sequence (a per-token index built from cu_seqlens) and sums its K taps; a tap that reaches before the
# sequence's first token reads the sequence's initial conv state instead (or zero), so no tap crosses a
# boundary. A second small kernel writes each sequence's last K-1 inputs as its final state.

@jit
def _conv1d_varlen_kernel(X, W, Bias, S0, Y, cu, seq_of_token, stride_xt, stride_wc, stride_wk, stride_s0b,
                          stride_s0c, stride_s0k, stride_yt, T, C, K: tl.constexpr, BLOCK_T: tl.constexpr,
                          BLOCK_C: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_S0: tl.constexpr, SILU: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    t_valid = rows < T
    c_valid = offs_c < C
    seq = tl.load(seq_of_token + rows, mask=t_valid, other=0)
    start = tl.load(cu + seq, mask=t_valid, other=0)
    acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
    for k in tl.static_range(K):
        src = rows - (K - 1) + k
        inside = src >= start
        xv = tl.load(X + src.to(tl.int64)[:, None] * stride_xt + offs_c[None, :],
                     mask=(t_valid & inside)[:, None] & c_valid[None, :], other=0.0).to(tl.float32)
        if HAS_S0:  # tap before the sequence start: column K-1 + (src - start) of its initial state
            xv += tl.load(S0 + seq[:, None] * stride_s0b + offs_c[None, :] * stride_s0c
                          + (src - start + K - 1)[:, None] * stride_s0k,
                          mask=(t_valid & ~inside)[:, None] & c_valid[None, :], other=0.0).to(tl.float32)
        w = tl.load(W + offs_c * stride_wc + k * stride_wk, mask=c_valid, other=0.0).to(tl.float32)
        acc += xv * w[None, :]
    if HAS_BIAS:
        acc += tl.load(Bias + offs_c, mask=c_valid, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(Y + rows.to(tl.int64)[:, None] * stride_yt + offs_c[None, :], acc.to(Y.dtype.element_ty),
             mask=t_valid[:, None] & c_valid[None, :])


@jit
def _conv1d_final_state_kernel(X, S0, SF, cu, stride_xt, stride_s0b, stride_s0c, stride_s0k, stride_sfb,
                               stride_sfc, stride_sfk, C, K: tl.constexpr, BLOCK_C: tl.constexpr,
                               HAS_S0: tl.constexpr):
    b = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_valid = offs_c < C
    start = tl.load(cu + b)
    end = tl.load(cu + b + 1)
    for j in tl.static_range(K - 1):
        src = end - (K - 1) + j + tl.zeros([BLOCK_C], tl.int32)  # as a vector: masks must be blocks
        inside = src >= start
        v = tl.load(X + src.to(tl.int64) * stride_xt + offs_c, mask=c_valid & inside, other=0.0)
        if HAS_S0:
            v += tl.load(S0 + b * stride_s0b + offs_c * stride_s0c + (src - start + K - 1) * stride_s0k,
                         mask=c_valid & ~inside, other=0.0).to(v.dtype)
        tl.store(SF + b * stride_sfb + offs_c * stride_sfc + j * stride_sfk, v.to(SF.dtype.element_ty), mask=c_valid)


def causal_conv1d_varlen_triton(x, weight, bias, cu_seqlens, *, initial_states=None, activation=None):
    """Launch both kernels. Same contract as :func:`causal_conv1d_varlen`."""
    T, Cn = x.shape
    K = weight.shape[1]
    nseq = cu_seqlens.numel() - 1
    x = x if x.stride(-1) == 1 else x.contiguous()
    cu = cu_seqlens.to(torch.int32)
    seq_of_token = torch.repeat_interleave(torch.arange(nseq, device=x.device, dtype=torch.int32),
                                           (cu[1:] - cu[:-1]).long(), output_size=T)
    y = torch.empty_like(x)
    final = torch.empty(nseq, Cn, K - 1, device=x.device, dtype=x.dtype)
    s0 = initial_states
    s0_strides = s0.stride() if s0 is not None else (0, 0, 0)
    block_c = min(next_pow2(Cn, 16), 128)
    dummy = y
    _conv1d_varlen_kernel[(triton.cdiv(T, 32 if INTERPRET else 64), triton.cdiv(Cn, block_c))](
        x, weight, bias if bias is not None else dummy, s0 if s0 is not None else dummy, y, cu, seq_of_token,
        x.stride(0), weight.stride(0), weight.stride(1), *s0_strides, y.stride(0), T, Cn, K=K,
        BLOCK_T=32 if INTERPRET else 64, BLOCK_C=block_c, HAS_BIAS=bias is not None, HAS_S0=s0 is not None,
        SILU=activation == "silu",
    )
    if K > 1:
        _conv1d_final_state_kernel[(nseq, triton.cdiv(Cn, block_c))](
            x, s0 if s0 is not None else dummy, final, cu, x.stride(0), *s0_strides, *final.stride(), Cn, K=K,
            BLOCK_C=block_c, HAS_S0=s0 is not None,
        )
    return y, final


def _causal_conv1d_varlen_triton(x, weight, bias, cu_seqlens, *, initial_states=None, activation=None):
    if needs_grad(x, weight, bias, initial_states):  # forward-only kernels: training uses the torch path
        return _causal_conv1d_varlen_torch(x, weight, bias, cu_seqlens, initial_states=initial_states,
                                           activation=activation)
    return causal_conv1d_varlen_triton(x, weight, bias, cu_seqlens, initial_states=initial_states,
                                       activation=activation)


def _causal_conv1d_triton(x, weight, bias=None, *, initial_state=None, activation=None):
    if needs_grad(x, weight, bias, initial_state):
        return _causal_conv1d_torch(x, weight, bias, initial_state=initial_state, activation=activation)
    b, L, Cn = x.shape
    cu = torch.arange(b + 1, device=x.device, dtype=torch.int32) * L
    y, final = causal_conv1d_varlen_triton(x.reshape(b * L, Cn), weight, bias, cu, initial_states=initial_state,
                                           activation=activation)
    return y.view(b, L, Cn), final


# Decode: grid (sequences, channel blocks); each program reads its slot's K-1 past inputs, sums the taps
# with the new input and shifts the state left in place (oldest out, new input in at the end).

@jit
def _conv1d_step_kernel(S, X, W, Bias, Y, slots, stride_ss, stride_sc, stride_sk, stride_xb, stride_wc, stride_wk,
                        stride_yb, C, K: tl.constexpr, BLOCK_C: tl.constexpr, HAS_BIAS: tl.constexpr,
                        HAS_SLOTS: tl.constexpr, SILU: tl.constexpr):
    b = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_valid = offs_c < C
    if HAS_SLOTS:
        row = tl.load(slots + b).to(tl.int64)
    else:
        row = b.to(tl.int64)
    s_row = S + row * stride_ss + offs_c * stride_sc
    x = tl.load(X + b * stride_xb + offs_c, mask=c_valid, other=0.0)
    acc = x.to(tl.float32) * tl.load(W + offs_c * stride_wc + (K - 1) * stride_wk, mask=c_valid).to(tl.float32)
    for k in tl.static_range(K - 1):
        past = tl.load(s_row + k * stride_sk, mask=c_valid, other=0.0)
        acc += past.to(tl.float32) * tl.load(W + offs_c * stride_wc + k * stride_wk, mask=c_valid).to(tl.float32)
        if k + 1 < K - 1:  # ascending k: entry k+1 is read here before it is overwritten next iteration
            shifted = tl.load(s_row + (k + 1) * stride_sk, mask=c_valid, other=0.0)
        else:
            shifted = x.to(past.dtype)
        tl.store(s_row + k * stride_sk, shifted, mask=c_valid)
    if HAS_BIAS:
        acc += tl.load(Bias + offs_c, mask=c_valid, other=0.0).to(tl.float32)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(Y + b * stride_yb + offs_c, acc.to(Y.dtype.element_ty), mask=c_valid)


def causal_conv1d_step_triton(state, x, weight, bias=None, *, activation=None, slots=None):
    """Launch the step kernel. Same contract as :func:`causal_conv1d_step`."""
    Bn, Cn = x.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    y = torch.empty_like(x)
    block_c = min(next_pow2(Cn, 16), 256)
    _conv1d_step_kernel[(Bn, triton.cdiv(Cn, block_c))](
        state, x, weight, bias if bias is not None else y, y, slots if slots is not None else y,
        *state.stride(), x.stride(0), weight.stride(0), weight.stride(1), y.stride(0), Cn, K=weight.shape[1],
        BLOCK_C=block_c, HAS_BIAS=bias is not None, HAS_SLOTS=slots is not None, SILU=activation == "silu",
    )
    return y


def _causal_conv1d_step_triton(state, x, weight, bias=None, *, activation=None, slots=None):
    if needs_grad(x, weight, bias):
        return _causal_conv1d_step_torch(state, x, weight, bias, activation=activation, slots=slots)
    return causal_conv1d_step_triton(state, x, weight, bias, activation=activation, slots=slots)


dispatch.register("causal_conv1d", "triton", _causal_conv1d_triton, triton_support.probe)
dispatch.register("causal_conv1d_varlen", "triton", _causal_conv1d_varlen_triton, triton_support.probe)
dispatch.register("causal_conv1d_step", "triton", _causal_conv1d_step_triton, triton_support.probe)

_conv = cuda_backend.probe("causal_conv1d")
dispatch.register("causal_conv1d", "cuda", cuda_backend.causal_conv1d, _conv, cuda_backend.supports_conv)
dispatch.register("causal_conv1d_varlen", "cuda", cuda_backend.causal_conv1d_varlen, _conv,
                  cuda_backend.supports_conv_varlen)
dispatch.register("causal_conv1d_step", "cuda", cuda_backend.causal_conv1d_step, _conv, cuda_backend.supports_conv_step)
