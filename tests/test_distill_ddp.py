"""Two gloo processes on halves of each global batch follow one process's loss curve on the whole batch.

Each process's loss is the mean over its half; the gradients are averaged over the two (one all-reduce), which
is the gradient of the whole batch's mean loss. The two runs differ only in the order of the fp32 sums (two
half-batch means averaged vs one mean; the gradient reduced in a flat buffer), a relative difference of ~1e-7 per
step that AdamW's normalised steps carry into the weights at about that size: over 6 steps the losses agree to
well within 1e-5 relative, and a wrong shard or a missing average would differ at 1e-2 and more."""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from distill_helpers import tiny_teacher, token_stream

from hybrid.distill.ddp import World
from hybrid.distill.init import attention_positions, replacement_from_attention
from hybrid.distill.kl import distill_kl
from hybrid.distill.student import build_student

STEPS = 6


def _run(world: World, out_dir: str) -> dict:
    torch.set_num_threads(1)
    teacher = tiny_teacher()
    reps = {n: replacement_from_attention(teacher.config, teacher.layers[p].mixer, "mamba2").state_dict()
            for n, p in enumerate(attention_positions(teacher.config))}
    student = build_student(teacher, reps, [2], "mamba2")
    rec, _ = distill_kl(student, teacher, os.path.join(out_dir, f"state{world.size}.pt"), batches=token_stream(),
                        start=1, steps=STEPS, lr=3e-3, progress=False, world=world, checkpoint_every=10 ** 9)
    return {"losses": [h["loss"] for h in rec["history"]],
            "weight": student.layers[0].mixer.in_proj.weight.sum().item(), "tokens": rec["tokens"]}


def _worker(rank: int, port: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        result = _run(World(rank, 2), out_dir)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built into this torch")
def test_two_gloo_processes_follow_one_process(tmp_path):
    one = _run(World(), str(tmp_path))
    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0] == ranks[1]  # the processes hold one model
    assert ranks[0]["tokens"] == one["tokens"]  # global tokens counted once
    for a, b in zip(ranks[0]["losses"], one["losses"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (ranks[0]["losses"], one["losses"])
    assert abs(ranks[0]["weight"] - one["weight"]) <= 1e-5 * abs(one["weight"]) + 1e-6
    assert one["losses"][-1] < one["losses"][0]  # it trained at all
