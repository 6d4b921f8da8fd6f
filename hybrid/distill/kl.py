"""End-to-end distillation (MOHAWK's stage 3): the student trained on the teacher's next-token distributions.

The loss is the forward KL over the vocabulary, ``KL(p_teacher || p_student)`` per token, averaged over tokens,
from teacher logits computed on the fly. Neither model's full [tokens, vocab] logits exist at once: both models
run to their final hidden states, then :func:`chunked_kl_backward` takes ``chunk`` tokens at a time through the
LM heads, the KL and its backward into the student's hidden state (a detached leaf that gathers the gradient),
and one backward from there runs through the student's layers. A chunk of 256 tokens over a 49152-word vocab is
~50 MB of fp32 logits per model instead of 400 MB each for 2048 tokens.

By default only the mixers (the replacements and the kept attention layers) train; the MLPs, norms and
embeddings stay the teacher's (``train_all`` trains everything).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.nn.functional as F

from ..config import SUBCONFIGS
from ..model import HybridLM
from .ddp import World
from .trainer import MasterAdamW, train

CHUNK_TOKENS = 256


def final_hidden(model: HybridLM, ids: torch.Tensor) -> torch.Tensor:
    """ids [B, L] -> the last block's output [B, L, d_model] (before the final norm and LM head)."""
    h = model.embed(ids)
    for layer in model.layers:
        h = layer(h)
    return h


def _kl_chunk(student: HybridLM, teacher: HybridLM, hs: torch.Tensor, ht: torch.Tensor) -> torch.Tensor:
    """Summed forward KL of a chunk of tokens: hs (student, with grad) and ht (teacher) [n, d_model]."""
    lp_s = F.log_softmax(student.logits(hs).float(), dim=-1)
    with torch.no_grad():
        lp_t = F.log_softmax(teacher.logits(ht).float(), dim=-1)
    return (lp_t.exp() * (lp_t - lp_s)).sum()


def chunked_kl_backward(student: HybridLM, teacher: HybridLM, h_student: torch.Tensor, h_teacher: torch.Tensor,
                        chunk: int = CHUNK_TOKENS) -> float:
    """Mean per-token forward KL of the two final hidden states [B, L, d] and its backward through the student
    (gradients accumulate in its parameters). Returns the KL."""
    n = h_student.shape[0] * h_student.shape[1]
    leaf = h_student.detach().reshape(n, -1).requires_grad_()
    ht = h_teacher.reshape(n, -1)
    total = 0.0
    for s in range(0, n, chunk):
        kl = _kl_chunk(student, teacher, leaf[s:s + chunk], ht[s:s + chunk]) / n
        kl.backward()
        total += float(kl.detach())
    h_student.backward(leaf.grad.view_as(h_student))
    return total


@torch.no_grad()
def kl_divergence(student: HybridLM, teacher: HybridLM, ids: torch.Tensor, chunk: int = CHUNK_TOKENS) -> float:
    """Mean per-token forward KL(teacher || student) on ``ids`` [B, L], no training."""
    hs, ht = final_hidden(student, ids), final_hidden(teacher, ids)
    n = ids.numel()
    hs, ht = hs.reshape(n, -1), ht.reshape(n, -1)
    return sum(float(_kl_chunk(student, teacher, hs[s:s + chunk], ht[s:s + chunk])) for s in range(0, n, chunk)) / n


def kl_flops_per_token(student: HybridLM, teacher: HybridLM, seq_len: int, trained_weights: int) -> float:
    """Model FLOPs per token of a KL step: the teacher's forward, the student's forward, its backward to the
    inputs (about its forward again) and the weight gradients of the ``trained_weights`` matrix entries (2 per
    weight and token)."""
    return teacher.flops_per_token(seq_len) + 2 * student.flops_per_token(seq_len) + 2.0 * trained_weights


def trained_parameters(student: HybridLM, train_all: bool = False) -> list[torch.nn.Parameter]:
    """The parameters the KL stage trains (the others get ``requires_grad=False``): every mixer's by default."""
    student.requires_grad_(train_all)
    if not train_all:
        for block in student.layers:
            if SUBCONFIGS[block.kind].mixer:
                block.mixer.requires_grad_(True)
    return [p for p in student.parameters() if p.requires_grad]


def distill_kl(student: HybridLM, teacher: HybridLM, state_path: str | Path, *,
               batches: Callable[[int], Iterable[torch.Tensor]], start: int, steps: int, lr: float = 3e-4,
               train_all: bool = False, progress: bool = True, world: World | None = None, desc: str = "kl",
               checkpoint_every: int = 50) -> tuple[dict, dict[str, torch.Tensor]]:
    """Train ``student`` (in place) on ``steps`` batches ``batches(start + i)`` against ``teacher``; resumable
    through ``state_path``. Returns the record (``history``: per step ``{"loss": KL}``; ``tokens``; ``seconds``)
    and the trained parameters' fp32 master weights by name (the student itself holds them rounded to its
    dtype)."""
    world = world or World()
    teacher.requires_grad_(False)
    params = trained_parameters(student, train_all)
    names = {id(p): n for n, p in student.named_parameters()}
    opt = MasterAdamW(params, lr=lr)

    def step_fn(batch: torch.Tensor) -> dict:
        with torch.no_grad():
            ht = final_hidden(teacher, batch)
        hs = final_hidden(student, batch)
        return {"loss": chunked_kl_backward(student, teacher, hs, ht)}

    student.train()
    try:
        record = train(opt=opt, step_fn=step_fn, batches=batches, start=start, steps=steps, lr=lr,
                       state_path=Path(state_path), world=world, record={}, desc=desc, progress=progress,
                       checkpoint_every=checkpoint_every)
    finally:
        student.eval()
    return record, {names[id(p)]: m.detach() for p, m in zip(params, opt.masters, strict=True)}
