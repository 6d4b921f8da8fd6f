"""Tiles and scratch for the eager one-token Mamba state steps (``ssd_step``, ``selective_step`` and their int8
versions): work a few sequences at a time so the fp32 rows of an update stay in the CPU cache between its passes.

At batch 32 one Mamba-2 layer of ``mamba2-small`` holds a 25 MB fp32 state (24 heads x 64 x 128 per sequence). A
step makes several elementwise / reduction passes over it (decay, rank-1 update, mat-vec; for int8 also the cast
in, |max|, rescale, round, cast out); over the whole batch each pass goes to memory, over a tile of about
:data:`TILE_BYTES` only the first read and the last write do. The int8 steps tile by :func:`row_tiles`: chunks of a
sequence's rows when one sequence's fp32 rows alone would spill out of L2. The per-tile mat-vec is also a handful
of large ``bmm`` calls (one per sequence and B/C group) instead of one over every head (measured: 40 us per
sequence in cache against 13-17 ms for the whole batch at once). One fp32 scratch buffer per device and role is
reused across steps and layers (a fresh 25 MB temporary per step was page faults as well).
"""

from __future__ import annotations

import threading

import torch

TILE_BYTES = 1 << 20  # about a CPU core's L2 (512 KB - 1 MB on the machines measured), one tile per step pass
_scratch = threading.local()  # per thread: two engines stepping in two threads never share a buffer


def scratch(numel: int, device: torch.device, role: object = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A reused buffer of ``numel`` elements of ``dtype`` (contents undefined), one per thread, device, dtype
    and ``role`` (which tells apart buffers a step needs at the same time)."""
    if torch.compiler.is_compiling():  # inside a compiled graph: its own temporary (Inductor plans the memory)
        return torch.empty(numel, device=device, dtype=dtype)
    buffers = _scratch.__dict__
    key = (torch.device(device), dtype, role)
    buf = buffers.get(key)
    if buf is None or buf.numel() < numel:
        with torch.inference_mode(False):  # a normal tensor: usable in and out of inference mode alike
            buf = buffers[key] = torch.empty(numel, device=device, dtype=dtype)
    return buf[:numel]


def tile_budget() -> int:
    """Bytes of fp32 rows per tile: TILE_BYTES for each intra-op thread, since the elementwise passes of a
    tile split it across the threads and each core has its own L2 (measured at 2 threads, ``mamba2-small``
    int8 step: 12.7 ms with 2 MB tiles, 17.6 ms with 1 MB ones, 20.7 ms with 0.5 MB)."""
    return TILE_BYTES * max(1, torch.get_num_threads())


def tile_rows(n: int, row_numel: int) -> int:
    """Sequences per tile: as many state rows of ``row_numel`` fp32 values as fit in TILE_BYTES, at least one
    (everything at once off the CPU, where the cache argument does not hold and launches cost)."""
    return max(1, min(n, TILE_BYTES // (4 * row_numel)))


def tiles(n: int, row_numel: int, device: torch.device) -> list[tuple[int, int]]:
    """The ``(start, end)`` sequence ranges of one step: one range off the CPU and under torch.compile (the
    compiled decode step: Inductor fuses the passes itself, and a loop would be unrolled into the graph)."""
    on_cpu = torch.device(device).type == "cpu" and not torch.compiler.is_compiling()
    t = tile_rows(n, row_numel) if on_cpu else n
    return [(i, min(n, i + t)) for i in range(0, n, t)]


def update_in_fp32_tiles(rows: torch.Tensor, update) -> None:
    """Run ``update(i, j, f)`` over the :func:`tiles` of ``rows`` (a contiguous [n, ...] state), ``f`` being
    ``rows[i:j]`` itself when the state is fp32, else an fp32 copy of it in the scratch buffer that is rounded back
    into ``rows[i:j]`` once ``update`` has changed it in place: a bf16 / fp16 state computed in fp32 and rounded
    once per step, as the references do."""
    n, shape = rows.shape[0], rows.shape[1:]
    row_numel = rows[0].numel() if n else 0
    low = rows.dtype != torch.float32
    for i, j in tiles(n, row_numel, rows.device):
        f = scratch((j - i) * row_numel, rows.device).view(j - i, *shape).copy_(rows[i:j]) if low else rows[i:j]
        update(i, j, f)
        if low:
            rows[i:j].copy_(f)


def row_tiles(blocks: int, block_rows: int, row_numel: int, device: torch.device) -> tuple[int, int]:
    """How an int8 step tiles ``blocks`` blocks of ``block_rows`` state rows of ``row_numel`` values (a block:
    the rows of one sequence that share B and C): ``(k, t)``, ``k`` rows per chunk (a divisor of
    ``block_rows``: the largest whose fp32 rows fit TILE_BYTES) and ``t`` chunks per tile. A block larger
    than a tile is cut into chunks instead of taking a whole tile that spills out of L2 (measured: 1.5 MB
    tiles ran the ``mamba2-small`` step 1.5x slower than 0.75 MB ones). One tile off the CPU and under
    torch.compile, as :func:`tiles`."""
    on_cpu = torch.device(device).type == "cpu" and not torch.compiler.is_compiling()
    k = block_rows
    if on_cpu:
        fit = max(1, tile_budget() // (4 * row_numel))
        k = max(d for d in range(1, block_rows + 1) if block_rows % d == 0 and d <= fit)
    chunks = blocks * (block_rows // k)
    return k, (max(1, min(chunks, tile_budget() // (4 * row_numel * k))) if on_cpu else chunks)
