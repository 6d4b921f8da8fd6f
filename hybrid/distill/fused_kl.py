"""The KL stage's loss fused with both LM heads: ``sum_rows KL(softmax(ht Wtᵀ) || softmax(hs Wsᵀ))`` chunk by
chunk, with its gradient computed in the same pass (the "fused linear cross-entropy" trick, for a KL).

Why: over a 49152-word vocabulary the logits dominate the loss's memory and its element-wise work. Autograd
through ``log_softmax`` keeps the [n, V] fp32 log-probabilities for the backward and runs ~10 passes over them
per chunk (casts, two log-softmaxes, exp, sub, mul, sum, then mul, neg and the log-softmax backward). The KL's
gradient with respect to the student's logits is closed-form, ``softmax(z_s) - p_t``, so each chunk is done
in one go: both heads' logits, the KL row sums, that gradient, and its product with the head weight, then
the chunk's [n, V] buffers are dropped. Nothing of size V·n outlives a chunk, and the backward is a scale of
the stored [n, d] (and, when the head trains, [V, d]) gradients.

The chunk's element-wise math (two log-sum-exps, the KL rows, the gradient) is one ``torch.compile``-d
function for large vocabularies where Inductor can compile (eager otherwise): fused into a few loops it runs ~10x
faster than eager's passes (at 1 thread, [256, 49152]: ~50 ms against ~530 ms, the two head matmuls ~60 ms each).

Invariants: the KL of a row is ``Σ p_t (log p_t - z_s) + logsumexp(z_s)`` (Σ p_t = 1), exact in fp32; the
logits are the heads' products in the weights' dtype (bf16 in bf16 training, as the unfused path computes
them) and everything after is fp32.
"""

from __future__ import annotations

import functools

import torch

CHUNK_TOKENS = 256
# vocabularies at least this large have their chunk math compiled by default (when Inductor can run here):
# compiling costs ~20 s once per process and shape, and at 49152 words it cuts the chunk's element-wise
# work ~10x (all of it is passes over [chunk, V] buffers that outgrow the caches; fused, each is read ~3 times)
COMPILE_MIN_VOCAB = 8192


def _chunk_kl_and_grad(zs: torch.Tensor, zt: torch.Tensor, grad_dtype: torch.dtype):
    """Per row the KL of softmax(zt) to softmax(zs) and d KL / d zs = softmax(zs) - softmax(zt) in
    ``grad_dtype``, both from logits zs, zt [c, V] (any float dtype; computed in fp32)."""
    zs, zt = zs.float(), zt.float()
    lse_s = torch.logsumexp(zs, -1, keepdim=True)
    lp_t = torch.log_softmax(zt, -1)
    p_t = lp_t.exp()
    kl = (p_t * (lp_t - zs)).sum(-1) + lse_s[:, 0]
    grad = (torch.exp(zs - lse_s) - p_t).to(grad_dtype)
    return kl, grad


@functools.cache
def _compiled_chunk_math():
    return torch.compile(_chunk_kl_and_grad, dynamic=False, fullgraph=True)


def compile_available() -> bool:
    from ..kernels import inductor_backend
    return inductor_backend.probe() is None


class _LinearKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hs, ws, ht, wt, chunk, compiled):
        n = hs.shape[0]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hs) if need_h else None
        grad_w = torch.zeros(ws.shape, dtype=torch.float32) if need_w else None
        math = _compiled_chunk_math() if compiled else _chunk_kl_and_grad
        total = torch.zeros((), dtype=torch.float64)
        for s in range(0, n, chunk):
            a = hs[s:s + chunk]
            kl, g = math(a @ ws.T, ht[s:s + chunk] @ wt.T, ws.dtype)
            total += kl.sum(dtype=torch.float64)
            if need_h:
                torch.mm(g, ws, out=grad_h[s:s + chunk])
            if need_w:  # the product in the weights' dtype (as autograd's would be), summed in fp32
                grad_w.add_(g.T @ a)
        ctx.w_dtype = ws.dtype
        ctx.save_for_backward(grad_h, grad_w)
        return total.to(torch.float32)

    @staticmethod
    def backward(ctx, g):
        grad_h, grad_w = ctx.saved_tensors
        gh = grad_h * g.to(grad_h.dtype) if grad_h is not None else None
        gw = (grad_w * g).to(ctx.w_dtype) if grad_w is not None else None
        return gh, gw, None, None, None, None


def linear_kl_sum(h_student: torch.Tensor, w_student: torch.Tensor, h_teacher: torch.Tensor,
                  w_teacher: torch.Tensor, chunk: int = CHUNK_TOKENS, compiled: bool | None = None) -> torch.Tensor:
    """Summed forward KL over rows of the teacher's distributions ``softmax(h_teacher @ w_teacher.T)`` to the
    student's ``softmax(h_student @ w_student.T)``: h [n, d] (the final-normed hidden states), w [V, d] (the LM
    heads, no bias). Differentiable in ``h_student`` and ``w_student`` (an fp32 scalar); the teacher side is
    constant. ``chunk`` rows at a time; ``compiled``: the chunk math through ``torch.compile`` (default: for
    vocabularies of :data:`COMPILE_MIN_VOCAB` words and more, where Inductor can compile)."""
    if h_student.dim() != 2 or h_teacher.shape != h_student.shape or w_student.shape != w_teacher.shape \
            or w_student.shape[1] != h_student.shape[1]:
        raise ValueError(f"linear_kl_sum: need h [n, d] for both models and heads [V, d]; got "
                         f"{tuple(h_student.shape)}, {tuple(h_teacher.shape)}, {tuple(w_student.shape)}, "
                         f"{tuple(w_teacher.shape)}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    if compiled is None:
        compiled = w_student.shape[0] >= COMPILE_MIN_VOCAB and compile_available()
    return _LinearKL.apply(h_student, w_student, h_teacher.detach(), w_teacher.detach(), chunk, compiled)
