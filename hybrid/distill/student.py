"""A student: the teacher with some attention layers swapped for their aligned replacements, as a normal
:class:`hybrid.HybridLM` (its config says ``M``/``G`` where attention was), so saving, loading, the engine,
the server, the exports and lm-eval take it like any other model."""

from __future__ import annotations

from pathlib import Path

import torch

from ..model import HybridLM
from .init import MIXERS, attention_positions, student_config


def build_student(teacher: HybridLM, replacements: dict[int, dict[str, torch.Tensor]], keep, mixer: str) -> HybridLM:
    """The teacher's weights everywhere but at the attention layers not in ``keep`` (attention-layer numbers),
    which take ``replacements[n]`` (a ``mixer`` state dict, e.g. from
    :func:`hybrid.distill.align.load_replacements`). Same dtype as the teacher; its tokenizer attached."""
    keep = set(keep)
    cfg = student_config(teacher.config, keep, mixer)
    positions = attention_positions(teacher.config)
    # copies: the student trains in place, and must never write into the teacher's tensors
    state = {k: v.clone() for k, v in teacher.state_dict().items()}
    dtype = teacher.embed.weight.dtype
    for n, pos in enumerate(positions):
        if n in keep:
            continue
        if n not in replacements:
            raise ValueError(f"no replacement for attention layer {n}: align every layer before building students")
        prefix = f"layers.{pos}.mixer."
        for k in [k for k in state if k.startswith(prefix)]:
            del state[k]
        # copies too: several students are built from one set of replacements, each trained in place
        state.update({prefix + k: v.to(dtype, copy=True) for k, v in replacements[n].items()})
    with torch.device("meta"):
        student = HybridLM(cfg)
    student.load_state_dict(state, strict=True, assign=True)
    student.tokenizer = teacher.tokenizer
    return student.eval()


def student_name(mixer: str, share: float) -> str:
    """The folder name of a student: ``mamba2-share0.25``."""
    if mixer not in MIXERS:
        raise ValueError(f"unknown mixer {mixer!r}; choose one of {sorted(MIXERS)}")
    return f"{mixer}-share{share:g}"


def save_student(student: HybridLM, directory: str | Path, teacher_dir: str | Path | None) -> Path:
    """Write a student as a normal checkpoint folder, the teacher's tokenizer files copied beside it."""
    from ..interop.io import copy_tokenizer_files
    from ..pretrained import save_pretrained

    out = save_pretrained(student, directory)
    if teacher_dir is not None:
        copy_tokenizer_files(teacher_dir, out)
    return out
