"""The training loop both distillation stages share: mixed precision with fp32 master weights, gradient averaging
over processes, a resumable checkpoint, tqdm progress.

Mixed precision: the model's weights may be bf16 (forward and backward run in bf16 matmuls, several times the
fp32 rate on a CPU with AMX). AdamW then keeps an fp32 master copy of each trained weight, steps on it with the
fp32 gradient and writes the rounded result back, so updates smaller than a bf16 weight's rounding step still
accumulate. For fp32 weights the master is the weight itself.

Resuming: every ``checkpoint_every`` steps and at the end, the step count, the master weights, AdamW's state and the
stage's own record (loss history) go to one file (``torch.save``; read back with ``weights_only=True``), written
beside and renamed over the old one so an interrupted write never leaves half a checkpoint. A rerun of the
same command loads it and continues from the next batch of the stream (``batches(start + step)``), so the result
equals an uninterrupted run's.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from .ddp import World


def lr_at(step: int, total: int, lr: float) -> float:
    """Linear warm-up over the first 5% of steps (at least 1), then cosine down to a tenth: a function of the step
    alone, so a resumed run follows the same schedule."""
    warm = max(1, total // 20)
    if step < warm:
        return lr * (step + 1) / warm
    frac = (step - warm) / max(1, total - warm)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


class MasterAdamW:
    """AdamW over fp32 masters of ``params`` (the model's trained tensors, any float dtype).

    ``clip``: the gradient norm is clipped to it, over all ``params`` at once, or with ``clip_groups`` (lists of
    indices into ``params``, covering each once) over each group alone: parts trained independently (the
    alignment's replacements, each on its own loss) are then not scaled down by another part's large gradient.
    """

    def __init__(self, params: list[torch.nn.Parameter], lr: float, weight_decay: float = 0.0,
                 clip: float | None = 1.0, clip_groups: list[list[int]] | None = None):
        self.params = params
        self.masters = [p if p.dtype == torch.float32 else p.detach().float().clone().requires_grad_()
                        for p in params]
        self.lr, self.clip = lr, clip
        if clip_groups is not None and sorted(i for g in clip_groups for i in g) != list(range(len(params))):
            raise ValueError("clip_groups must cover every parameter index exactly once")
        self.clip_groups = clip_groups or [list(range(len(params)))]
        self.opt = torch.optim.AdamW(self.masters, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay,
                                     foreach=True)

    @torch.no_grad()
    def step(self, world: World, lr: float) -> None:
        grads = []
        for p, m in zip(self.params, self.masters, strict=True):
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            m.grad = g.float() if m is not p else g
            grads.append(m.grad)
        world.average(grads)
        if self.clip:
            for group in self.clip_groups:
                torch.nn.utils.clip_grad_norm_([self.masters[i] for i in group], self.clip, foreach=True)
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()
        for p, m in zip(self.params, self.masters, strict=True):
            if m is not p:
                p.copy_(m)
            p.grad = None
            m.grad = None

    def state_dict(self) -> dict:
        return {"masters": [m.detach() for m in self.masters], "opt": self.opt.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        for p, m, saved in zip(self.params, self.masters, state["masters"], strict=True):
            m.copy_(saved)
            if m is not p:
                p.copy_(saved)
        self.opt.load_state_dict(state["opt"])


def save_state(path: Path, step: int, opt: MasterAdamW, record: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"step": step, "optimizer": opt.state_dict(), "record": record}, tmp)
    os.replace(tmp, path)


def load_state(path: Path) -> dict | None:
    return torch.load(path, weights_only=True) if path.is_file() else None


def train(*, opt: MasterAdamW, step_fn: Callable[[torch.Tensor], dict], batches: Callable[[int], Iterable],
          start: int, steps: int, lr: float, state_path: Path, world: World, record: dict,
          desc: str, progress: bool = True, checkpoint_every: int = 50) -> dict:
    """Run ``steps`` optimizer steps on batches ``batches(start + i)`` (global batches, each process training on
    its shard), resuming from ``state_path`` when it holds an earlier run's state.

    ``step_fn(shard)`` computes the loss on this process's rows, calls backward, and returns a dict of floats
    (``"loss"`` and any per-part numbers); with the step's wall seconds (``"seconds"``: step_fn and the optimizer
    step) and averaged over processes, they are appended to ``record["history"]``.
    Returns ``record`` with ``"history"``, ``"tokens"`` (global tokens trained on) and ``"seconds"``.
    """
    from tqdm.auto import tqdm

    done = 0
    if (saved := load_state(state_path)) is not None:
        done = int(saved["step"])
        opt.load_state_dict(saved["optimizer"])
        record = saved["record"]
    record.setdefault("history", [])
    record.setdefault("tokens", 0)
    record.setdefault("seconds", 0.0)
    if done >= steps:
        return record
    bar = tqdm(total=steps, initial=done, desc=desc, unit="step", disable=not (progress and world.main),
               dynamic_ncols=True)
    stream = iter(batches(start + done))
    t0, tok0 = time.perf_counter(), record["tokens"]
    secs0 = record["seconds"]
    for step in range(done, steps):
        batch = next(stream)
        t_step = time.perf_counter()
        out = step_fn(world.shard(batch))
        opt.step(world, lr_at(step, steps, lr))
        out["seconds"] = time.perf_counter() - t_step
        out = {k: world.mean(v) if isinstance(v, float) else v for k, v in out.items()}
        record["history"].append(out)
        record["tokens"] += batch.numel()
        record["seconds"] = secs0 + time.perf_counter() - t0
        rate = (record["tokens"] - tok0) / max(1e-9, time.perf_counter() - t0)
        bar.set_postfix(loss=f"{out['loss']:.4g}", tok_s=f"{rate:.0f}")
        bar.update(1)
        if (step + 1) % checkpoint_every == 0 or step + 1 == steps:
            if world.main:
                save_state(state_path, step + 1, opt, record)
            world.barrier()
    bar.close()
    return record
