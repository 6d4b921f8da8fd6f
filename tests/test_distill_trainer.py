"""The shared trainer's optimizer (hybrid.distill.trainer.MasterAdamW): gradient clipping over all parameters
or per group."""

from __future__ import annotations

import pytest
import torch

from hybrid.distill.ddp import World
from hybrid.distill.trainer import MasterAdamW


def _grads_after_clip(clip_groups):
    small = torch.nn.Parameter(torch.zeros(4))
    big = torch.nn.Parameter(torch.zeros(4))
    opt = MasterAdamW([small, big], lr=0.0, clip=1.0, clip_groups=clip_groups)
    small.grad, big.grad = torch.full((4,), 0.1), torch.full((4,), 100.0)
    seen = {}
    step = opt.opt.step
    opt.opt.step = lambda: seen.update(small=small.grad.clone(), big=big.grad.clone()) or step()
    opt.step(World(), lr=0.0)
    return seen


def test_one_clip_over_all_scales_every_gradient_by_the_largest():
    g = _grads_after_clip(None)
    total = (4 * 0.1 ** 2 + 4 * 100.0 ** 2) ** 0.5
    assert torch.allclose(g["small"], torch.full((4,), 0.1 / total), rtol=1e-5)
    assert torch.allclose(g["big"].norm(), torch.tensor(1.0), rtol=1e-5)


def test_per_group_clip_leaves_a_small_gradient_alone():
    g = _grads_after_clip([[0], [1]])
    assert torch.equal(g["small"], torch.full((4,), 0.1))  # norm 0.2 < 1: untouched
    assert torch.allclose(g["big"].norm(), torch.tensor(1.0), rtol=1e-5)


def test_clip_groups_must_cover_every_parameter_once():
    p = [torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]
    with pytest.raises(ValueError, match="exactly once"):
        MasterAdamW(p, lr=1e-3, clip_groups=[[0], [1]])
    with pytest.raises(ValueError, match="exactly once"):
        MasterAdamW(p, lr=1e-3, clip_groups=[[0, 1], [1, 2]])
