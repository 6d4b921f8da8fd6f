"""The compiled decode backend: a ``torch.compile``-d decode forward (``Engine(compile=True)``).

The batch is padded to a bucket size (1, 2, 4, ..., ``max_seqs``) and the block tables to a power-of-two width, so
a handful of static shapes cover every step; padded rows write their K/V into the null block and update the
scratch state slot, touching no live sequence. The decode inputs live in persistent buffers per shape (what CUDA
graphs need: ``mode="reduce-overhead"`` on GPU). Compile time is measured on its own and kept out of the
tokens/s (``compile_seconds``, the first call of each shape).
"""

from __future__ import annotations

import time

import torch

from ..cache import NULL_BLOCK
from ..engine.packed_batch import PackedBatch, SeqGroup, observed_rows
from .backend import DecodeBackend


def pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class DecodeBuffers:
    """Persistent input tensors of one compiled decode shape (batch bucket x block-table width)."""

    def __init__(self, batch: int, width: int, device: torch.device):
        def z(*shape, dtype):
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.tokens = z(batch, dtype=torch.long)
        self.positions = z(batch, dtype=torch.long)
        self.slot_mapping = z(batch, dtype=torch.long)
        self.seq_lens = z(batch, dtype=torch.int32)
        self.block_tables = z(batch, width, dtype=torch.int32)
        self.state_slots = z(batch, dtype=torch.long)

    def fill(self, tokens, positions, slot_mapping, seq_lens, tables, state_slots) -> None:
        for buf, values in ((self.tokens, tokens), (self.positions, positions), (self.slot_mapping, slot_mapping),
                            (self.seq_lens, seq_lens), (self.state_slots, state_slots)):
            buf.copy_(torch.tensor(values, dtype=buf.dtype))
        table = torch.full(tuple(self.block_tables.shape), NULL_BLOCK, dtype=torch.int32)
        for b, t in enumerate(tables):
            table[b, :len(t)] = torch.tensor(t, dtype=torch.int32)
        self.block_tables.copy_(table)


class CompiledBackend(DecodeBackend):
    """``enabled`` with the engine's ``compile=True``; ``buckets`` the padded batch sizes."""

    name = "compiled"

    def __init__(self, model, cache, buckets: list[int], *, enabled: bool, backend: str = "inductor",
                 mode: str | None = None):
        self.model, self.cache, self.buckets, self.enabled = model, cache, buckets, enabled
        self.device = cache.device
        self._buffers: dict[tuple[int, int], DecodeBuffers] = {}
        self.compile_seconds = 0.0  # first call of each compiled shape (tracing + codegen), never in tokens/s
        self.compiled_shapes: list[tuple[int, int]] = []
        self._decode = None
        if enabled:
            import torch._dynamo

            # one compiled graph per (bucket, width): allow enough of them before dynamo gives up
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
            if mode is None and backend == "inductor" and self.device.type == "cuda":
                mode = "reduce-overhead"  # CUDA graphs: one launch per decode step
            self._decode = torch.compile(self._decode_forward, backend=backend, mode=mode, dynamic=False)

    def supports(self, model, cache, shape) -> str | None:
        if not self.enabled:
            return "off (Engine(compile=True) / --compile turns it on)"
        if not 0 < shape.rows <= self.buckets[-1]:
            return f"{shape.rows} rows: the compiled shapes take up to max_seqs={self.buckets[-1]}"
        return None

    def _decode_forward(self, tokens, positions, slot_mapping, seq_lens, block_tables, state_slots):
        n = tokens.shape[0]
        cu = torch.arange(n + 1, dtype=torch.int32, device=tokens.device)
        group = SeqGroup(slice(0, n), cu, seq_lens, block_tables, state_slots)
        batch = PackedBatch(tokens, positions, slot_mapping, torch.arange(n, device=tokens.device), group, None)
        return self.model.forward_packed(batch, self.cache)

    def run(self, runner, chunks) -> torch.Tensor | None:
        m, n = runner.manager, len(chunks)
        if observed_rows(m, chunks) is not None:  # SnapKV's window queries this step: the eager layers capture them
            return None
        bucket = next(b for b in self.buckets if b >= n)
        tables = [m.block_table(c.seq_id) if m.kv.enabled else [] for c in chunks]
        width = pow2_at_least(max(1, max(len(t) for t in tables)))
        key = (bucket, width)
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = DecodeBuffers(bucket, width, self.device)
        pad = bucket - n
        # padded rows: token 0 at position 0, K/V into the null block's first slot, state in the scratch row
        buf.fill([c.tokens[0] for c in chunks] + [0] * pad, [c.start for c in chunks] + [0] * pad,
                 [m.pool_slots(c.seq_id, c.start, c.start + 1)[0] for c in chunks] + [NULL_BLOCK] * pad,
                 [m.kv_length(c.seq_id, c.start + 1) for c in chunks] + [1] * pad, tables,
                 [m.state_slot(c.seq_id) for c in chunks] + [self.cache.ssm.scratch_slot] * pad)
        first = key not in self.compiled_shapes
        t0 = time.perf_counter()
        logits = self._decode(buf.tokens, buf.positions, buf.slot_mapping, buf.seq_lens, buf.block_tables,
                              buf.state_slots)
        if first:
            self.compiled_shapes.append(key)
            self.compile_seconds += time.perf_counter() - t0
        return logits[:n]
