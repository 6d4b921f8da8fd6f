"""End-to-end distillation (MOHAWK's stage 3): the student trained on the teacher's next-token distributions.

The loss is the forward KL over the vocabulary, ``KL(p_teacher || p_student)`` per token, averaged over tokens,
from teacher logits computed on the fly. Neither model's full [tokens, vocab] logits exist at once: both models
run to their final hidden states, then :func:`chunked_kl_backward` takes ``chunk`` tokens at a time through the
LM heads and the KL with its closed-form gradient (:mod:`.fused_kl`), and one backward from the student's final
hidden state runs through its layers. A chunk of 256 tokens over a 49152-word vocab is ~50 MB of fp32 logits
per model instead of 400 MB each for 2048 tokens.

By default the mixers train (the replacements and the kept attention layers: :data:`TRAIN_ATTENTION`); the MLPs,
norms and embeddings stay the teacher's (``train_attention=False`` keeps the attention layers the teacher's too,
``train_all`` trains everything).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from ..config import SUBCONFIGS
from ..model import HybridLM
from ..pattern import SYMBOLS
from .compiled import compile_for_training, restore_eager
from .ddp import World
from .fused_kl import CHUNK_TOKENS, linear_kl_sum
from .init import MIXERS
from .trainer import MasterAdamW, train

# whether the KL stage trains the kept attention layers beside the replacements. Trained: on SmolLM2-135M at the
# medium budget (64K KL tokens, the same data and kept layers) the share-0.5 student ended at held-out KL 0.576
# / perplexity 7.54 with its attention trained and 0.721 / 8.66 with it frozen, from a slightly better start;
# the 8K-token probe in docs/distill.md had shown no clear winner. Frozen (--kl-attention freeze) keeps the
# kept layers exactly the teacher's and skips their weight gradients
TRAIN_ATTENTION = True


def final_hidden(model: HybridLM, ids: torch.Tensor) -> torch.Tensor:
    """ids [B, L] -> the last block's output [B, L, d_model] (before the final norm and LM head)."""
    h = model.embed(ids)
    for layer in model.layers:
        h = layer(h)
    return h


def head_weight(model: HybridLM) -> torch.Tensor:
    """The LM head's weight [V, d] (the embedding when tied)."""
    if model.lm_head is None:
        return model.embed.weight
    if getattr(model.lm_head, "bias", None) is not None:
        raise ValueError("the KL stage's fused loss takes LM heads without a bias; this model's head has one")
    return model.lm_head.weight


def chunked_kl_backward(student: HybridLM, teacher: HybridLM, h_student: torch.Tensor, h_teacher: torch.Tensor,
                        chunk: int = CHUNK_TOKENS, compiled: bool | None = None) -> float:
    """Mean per-token forward KL of the two final hidden states [B, L, d] and its backward through the student
    (gradients accumulate in its parameters). Returns the KL. The LM heads and the KL run fused, ``chunk``
    tokens at a time (:func:`.fused_kl.linear_kl_sum`)."""
    n = h_student.shape[0] * h_student.shape[1]
    hs = student.norm_f(h_student).reshape(n, -1)
    with torch.no_grad():
        ht = teacher.norm_f(h_teacher).reshape(n, -1)
    kl = linear_kl_sum(hs, head_weight(student), ht, head_weight(teacher), chunk, compiled) / n
    kl.backward()
    return float(kl.detach())


@torch.no_grad()
def kl_divergence(student: HybridLM, teacher: HybridLM, ids: torch.Tensor, chunk: int = CHUNK_TOKENS,
                  compiled: bool | None = None) -> float:
    """Mean per-token forward KL(teacher || student) on ``ids`` [B, L], no training."""
    n = ids.numel()
    hs = student.norm_f(final_hidden(student, ids)).reshape(n, -1)
    ht = teacher.norm_f(final_hidden(teacher, ids)).reshape(n, -1)
    return float(linear_kl_sum(hs, head_weight(student).detach(), ht, head_weight(teacher), chunk, compiled)) / n


def kl_flops_per_token(student: HybridLM, teacher: HybridLM, seq_len: int, trained_weights: int) -> float:
    """Model FLOPs per token of a KL step: the teacher's forward, the student's forward, its backward to the
    inputs (about its forward again) and the weight gradients of the ``trained_weights`` matrix entries (2 per
    weight and token)."""
    return teacher.flops_per_token(seq_len) + 2 * student.flops_per_token(seq_len) + 2.0 * trained_weights


def trained_parameters(student: HybridLM, train_all: bool = False,
                       train_attention: bool = TRAIN_ATTENTION) -> list[torch.nn.Parameter]:
    """The parameters the KL stage trains (the others get ``requires_grad=False``): the mixers' (with
    ``train_attention=False`` the replacements' alone, the kept attention layers frozen at the teacher's
    weights); ``train_all``: everything."""
    student.requires_grad_(train_all)
    if not train_all:
        for block in student.layers:
            if SUBCONFIGS[block.kind].mixer and (train_attention or block.kind != "attention"):
                block.mixer.requires_grad_(True)
    return [p for p in student.parameters() if p.requires_grad]


def distill_kl(student: HybridLM, teacher: HybridLM, state_path: str | Path, *,
               batches: Callable[[int], Iterable[torch.Tensor]], start: int, steps: int, lr: float = 3e-4,
               train_all: bool = False, train_attention: bool = TRAIN_ATTENTION, progress: bool = True,
               world: World | None = None, desc: str = "kl",
               checkpoint_every: int = 50, compile: bool | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """Train ``student`` (in place) on ``steps`` batches ``batches(start + i)`` against ``teacher``; resumable
    through ``state_path``. Returns the record (``history``: per step ``{"loss": KL}``; ``tokens``; ``seconds``)
    and the trained parameters' fp32 master weights by name (the student itself holds them rounded to its
    dtype). ``compile``: the replaced mixers' training forward and backward through ``torch.compile``
    (:mod:`hybrid.distill.compiled`; None: on unless ``HYBRID_DISTILL_COMPILE=0``, where Inductor can run)."""
    world = world or World()
    teacher.requires_grad_(False)
    params = trained_parameters(student, train_all, train_attention)
    names = {id(p): n for n, p in student.named_parameters()}
    opt = MasterAdamW(params, lr=lr)

    def step_fn(batch: torch.Tensor) -> dict:
        with torch.no_grad():
            ht = final_hidden(teacher, batch)
        hs = final_hidden(student, batch)
        return {"loss": chunked_kl_backward(student, teacher, hs, ht)}

    replaced = {SYMBOLS[symbol] for symbol in MIXERS.values()}  # the kinds that replace attention
    mixers = [layer.mixer for layer in student.layers if getattr(layer.mixer, "kind", None) in replaced]
    compile_for_training(mixers, compile)
    student.train()
    try:
        record = train(opt=opt, step_fn=step_fn, batches=batches, start=start, steps=steps, lr=lr,
                       state_path=Path(state_path), world=world, record={}, desc=desc, progress=progress,
                       checkpoint_every=checkpoint_every)
    finally:
        student.eval()
        restore_eager(mixers)
    return record, {names[id(p)]: m.detach() for p, m in zip(params, opt.masters, strict=True)}
