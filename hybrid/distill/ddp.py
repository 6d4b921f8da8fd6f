"""Data parallelism for the distillation stages over ``torch.distributed`` (gloo on a CPU, nccl on GPUs).

Launched by ``torchrun --nproc-per-node N -m hybrid.cli distill ...``: every process gets the same global batch
from the stream, keeps its own contiguous slice of the rows (:meth:`World.shard`), and after backward the
gradients are averaged over the processes (:meth:`World.average`) before each optimizer step. With equal slices
the average of the per-process mean losses' gradients is the gradient of the global batch's mean loss, so N
processes follow one process's curve on the same global batch (up to the order of the fp32 sums). One process
(``size == 1``) is the same code with nothing to reduce. Only rank 0 writes files and shows progress.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    def shard(self, batch: torch.Tensor) -> torch.Tensor:
        """This process's rows of a global batch [B, L] (B must divide evenly: unequal slices would weigh the
        processes' tokens unequally in the averaged gradient)."""
        if self.size == 1:
            return batch
        if batch.shape[0] % self.size:
            raise ValueError(f"a global batch of {batch.shape[0]} rows does not split over {self.size} processes; "
                             f"give --batch a multiple of the process count")
        n = batch.shape[0] // self.size
        return batch[self.rank * n:(self.rank + 1) * n]

    def average(self, tensors: list[torch.Tensor]) -> None:
        """Average ``tensors`` over the processes in place, as one flat fp32 buffer (one all-reduce)."""
        if self.size == 1 or not tensors:
            return
        flat = torch.cat([t.reshape(-1).float() for t in tensors])
        dist.all_reduce(flat)
        flat /= self.size
        offset = 0
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()

    def mean(self, value: float) -> float:
        """A scalar averaged over the processes (the logged loss of the global batch)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t) / self.size

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()


def world_from_env() -> World:
    """The process group torchrun describes (``WORLD_SIZE``, ``RANK``), joined once; a plain run is one process."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1:
        return World()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return World(rank=dist.get_rank(), size=dist.get_world_size())
