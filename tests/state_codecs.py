"""Simulated Mamba state storage formats, the stand-ins of the (retired) int8 state drift study: each codec
turns fp32 state rows into what a format would store and back (the exact round trip of that storage), and
:class:`CodecStatePool` holds them where a :class:`hybrid.cache.StatePool` would, so a decode runs through the
real cache with any candidate format. The study's findings are in docs/notes/int8-state.md; the tests keep
the codecs that check the shipped int8 state against its alternatives (a scale kept between writes, error
feedback) and that the stand-in is the real cache when it stores fp32."""

from __future__ import annotations

import torch

from hybrid.cache import HybridCache
from hybrid.cache.manager import CacheManager
from hybrid.engine.packed_batch import SeqChunk, build_batch
from hybrid.model import HybridLM


def _grouped(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x.float().reshape(x.shape[0], groups, -1)


def _amax_scale(g: torch.Tensor, qmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    scale = g.abs().amax(-1, keepdim=True) / qmax
    return scale, torch.where(scale > 0, scale, torch.ones_like(scale))


class Codec:
    """A state storage format: ``roundtrip(x, groups, side)`` -> (what is read back, new side state).
    ``side`` is the per-row companion the format keeps between writes (a kept scale, a residual)."""

    name = "fp32"
    bits = 32.0  # storage bits per state value (companions included, scales not)
    scales_per_row_group = 0  # fp32 scales per group of the spec (0: none)
    group_size: int | None = None  # values per scale when finer than the spec's groups

    def init_side(self, rows: int, shape, groups: int) -> dict[str, torch.Tensor]:
        return {}

    def roundtrip(self, x, groups, side):
        return x.float(), side


class Nearest(Codec):
    """int8, one scale per group recomputed from the group's |max| at every write, round to nearest (today)."""

    name, bits, scales_per_row_group = "int8 row, nearest (before)", 8.0, 1

    def __init__(self, group_size: int | None = None, per_head: bool = False):
        self.group_size, self.per_head = group_size, per_head
        if group_size:
            self.name = f"int8 groups of {group_size}, nearest"
        if per_head:
            self.name = "int8 per head, nearest"

    def _groups(self, x, groups):
        if self.per_head:
            return x.shape[1] if x.dim() == 4 else groups
        if self.group_size:
            return x[0].numel() // self.group_size
        return groups

    def scales(self, x, groups):
        return self._groups(x, groups)

    def roundtrip(self, x, groups, side):
        g = _grouped(x, self._groups(x, groups))
        _, safe = _amax_scale(g, 127.0)
        return (self.round(g / safe).clamp_(-127, 127) * safe).view(x.shape), side

    def round(self, y):
        return y.round()


class KeptScale(Nearest):
    """int8 with the scale kept between writes (grows only when a value would not fit): decay is then
    rounded into the codes instead of riding on the scale."""

    name = "int8 row, scale kept (grows only)"

    def init_side(self, rows, shape, groups):
        return {"scale": torch.zeros(rows, groups, 1)}

    def roundtrip(self, x, groups, side):
        g = _grouped(x, groups)
        need, _ = _amax_scale(g, 127.0)
        scale = torch.maximum(side["scale"], need)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        return (torch.round(g / safe).clamp_(-127, 127) * safe).view(x.shape), {"scale": scale}


class ErrorFeedback(Nearest):
    """int8 codes plus the rounding error carried to the next write (sigma-delta): the residual is kept in
    ``residual_bits`` bits per value (a signed code of the residual in units of the int8 quantum; None: fp32,
    the unaffordable upper bound). What is read back is codes x scale + residual: the residual is a
    low-precision companion of the codes, so this is also an (8 + residual_bits)-bit fixed-point format."""

    def __init__(self, residual_bits: int | None):
        self.residual_bits = residual_bits
        self.bits = 8.0 + (32 if residual_bits is None else residual_bits)
        self.name = f"int8 + error feedback ({'fp32' if residual_bits is None else residual_bits}-bit residual)"
        self.group_size = None
        self.per_head = False

    def roundtrip(self, x, groups, side):
        g = _grouped(x, groups)
        _, safe = _amax_scale(g, 127.0)
        codes = torch.round(g / safe).clamp_(-127, 127)
        err = g / safe - codes  # in quanta, |err| <= 1/2
        if self.residual_bits is not None:
            levels = 2 ** (self.residual_bits - 1)  # residual code r / (2 * levels) quanta
            err = torch.round(err * 2 * levels).clamp_(-levels, levels - 1) / (2 * levels)
        return ((codes + err) * safe).view(x.shape), side


class CodecStatePool:
    """A stand-in for :class:`hybrid.cache.StatePool` whose rows hold what ``codec`` would store (fp32 copies
    of the round trip), with the codec's companions beside them. ``record`` keeps, per write, the stored
    rows' change against the change the fp32 update asked for (the diagnosis)."""

    def __init__(self, base, codec: Codec, record: list | None = None):
        rows, *shape = base.data.shape
        self.data = torch.zeros(rows, *shape)
        self.groups = base.groups
        self.codec = codec
        self.side = codec.init_side(rows, shape, base.groups)
        self.record = record

    dtype = torch.float32

    @property
    def shape(self):
        return self.data.shape

    def read(self, slots):
        return self.data[slots]

    def write(self, slots, value):
        side = {k: v[slots] for k, v in self.side.items()}
        stored, side = self.codec.roundtrip(value.float(), self.groups, side)
        if self.record is not None:
            self.record.append((self.data[slots].clone(), value.float().clone(), stored.clone()))
        self.data[slots] = stored
        for k, v in side.items():
            self.side[k][slots] = v

    __getitem__ = read
    __setitem__ = write

    def step(self, op, *args, slots, **kw):
        rows = self.read(slots).clone()
        y = op(rows, *args, **kw)
        self.write(slots, rows)
        return y

    def zero_(self, slot):
        self.data[slot].zero_()
        for v in self.side.values():
            v[slot].zero_()

    def copy_row(self, src, dst):
        self.data[dst].copy_(self.data[src])
        for v in self.side.values():
            v[dst].copy_(v[src])


@torch.inference_mode()
def decode_logits(model: HybridLM, inputs: torch.Tensor, ssm_codec: Codec, conv_codec: Codec | None = None, *,
                  kv: str = "float32", record: dict | None = None) -> torch.Tensor:
    """Logits [B, L, V] with the first token a prefill and each further one a decode step of all B
    sequences, the SSM state stored as ``ssm_codec`` stores it (the conv state as ``conv_codec``, default
    fp32). ``record[layer]`` collects what each write of that layer's SSM state asked for and stored."""
    B, L = inputs.shape
    cache = HybridCache.for_model(model, num_blocks=B * -(-L // 16) + 1, block_size=16, max_seqs=B, kv_dtype=kv,
                                  conv_dtype=torch.float32, ssm_dtype=torch.float32)
    for i, (conv, ssm) in list(cache.ssm.state_pools.items()):
        rec = None if record is None else record.setdefault(i, [])
        pools = (CodecStatePool(conv, conv_codec or Codec()), CodecStatePool(ssm, ssm_codec, rec))
        cache.ssm.set_stores(i, pools)
    manager = CacheManager(cache)
    rows = inputs.tolist()
    for b in range(B):
        manager.admit(b, 1)
    out = torch.empty(B, L, model.config.vocab_size)
    out[:, 0] = model.forward_packed(build_batch(manager, [SeqChunk(b, rows[b][:1], 0) for b in range(B)]),
                                     cache).float()
    for t in range(1, L):
        for b in range(B):
            manager.grow(b, t + 1)
        out[:, t] = model.forward_packed(build_batch(manager, [SeqChunk(b, [rows[b][t]], t) for b in range(B)]),
                                         cache).float()
    return out
