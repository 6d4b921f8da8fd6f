"""Why an int8 Mamba state drifts over a long decode, and which int8 state format holds up.

    flock /tmp/bench.lock python -m hybrid.eval.state_drift_bench --threads 2 --output out/state_drift

The accuracy models are the tradeoff report's MQAR family, which trains well (``attention_family("tiny",
share, n, mlp=False)``, the pair curriculum up to 64 pairs, ``TrainConfig.mamba_lr_scale``): ``MMM*``,
``M***`` and a 1:7 hybrid (8 mixers, one attention), trained here once (``train_models``; safetensors in
``--models``). Each test sequence has 64 pairs, 256 tokens, and every token after the first is a decode
step through the paged cache (``compression_bench.teacher_forced_logits``), so the state is stored and
re-read 255 times.

Tables (markdown on stdout, every row in ``OUTPUT/state_drift.json``):

- ``drift``: per model and state format, logit KL(fp32 cache || compressed), top-1 agreement over all
  positions and at the answers, MQAR accuracy and its loss against the fp32 cache, over the first and last
  128 decode steps (does the error grow with the steps?), and the state bytes per sequence of the format.
- ``diagnosis``: for one trained model, the SSM state of one int8 format against the fp32 one along the
  decode: relative error, the share of entries whose stored code did not move in a step although the fp32
  state did by more than a tenth of a quantum (updates rounded away: the state freezing), and the share of
  the per-step change that was lost.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ..model import HybridLM
from ..report import format_table
from . import mqar

# (name, attention share, mixers) of mqar.family_config("tiny", ...): the tradeoff report's members
DRIFT_FAMILY = [("MMM*", 0.25, 4), ("M***", 0.75, 4), ("hybrid-1to7", 0.125, 8)]
DRIFT_PAIRS = 64  # 256 tokens: 255 decode steps
TRAIN_STEPS = {"MMM*": 300, "M***": 300, "hybrid-1to7": 600}


# ---- candidate state formats, simulated ----------------------------------------------------------------
# Each codec turns fp32 state rows into what a format would store and back (the exact round trip of that
# storage), so every candidate runs through the same decode loop; the one chosen is then also measured
# through the real StatePool (kv_quant / hybrid.cache) and must give the same numbers.

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


class Stochastic(Nearest):
    name = "int8 row, stochastic rounding"

    def round(self, y):
        return torch.floor(y + torch.rand_like(y))


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


class MuLaw(Nearest):
    """int8 codes of a mu-law (log-like) companding of x / |max|: finer steps near zero, coarser near the max."""

    name, mu = "int8 row, mu-law code (mu=255)", 255.0

    def roundtrip(self, x, groups, side):
        g = _grouped(x, groups)
        _, safe = _amax_scale(g, 1.0)
        y = g / safe
        c = torch.sign(y) * torch.log1p(self.mu * y.abs()) / torch.log1p(torch.tensor(self.mu))
        c = torch.round(c * 127).clamp_(-127, 127) / 127
        back = torch.sign(c) * torch.expm1(c.abs() * torch.log1p(torch.tensor(self.mu))) / self.mu
        return (back * safe).view(x.shape), side


class Fp8(Nearest):
    """fp8 e4m3 codes with one fp32 scale per group (|max| -> 448): 3 mantissa bits, relative precision."""

    name = "fp8 e4m3 row scale"

    def roundtrip(self, x, groups, side):
        g = _grouped(x, groups)
        _, safe = _amax_scale(g, 448.0)
        return ((g / safe).to(torch.float8_e4m3fn).float() * safe).view(x.shape), side


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


class Bf16(Codec):
    name, bits = "bfloat16", 16.0

    def roundtrip(self, x, groups, side):
        return x.to(torch.bfloat16).float(), side


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


CODECS = [Codec(), Bf16(), Nearest(), Nearest(per_head=True), Nearest(group_size=8), Stochastic(), KeptScale(),
          MuLaw(), Fp8(), ErrorFeedback(2), ErrorFeedback(4), ErrorFeedback(None)]

# the conv state [conv_dim, d_conv - 1]: a group of 48 values is 16 channels
CONV_CODECS = [("int8 per head (before)", Nearest(per_head=True)), ("int8 per 16 channels", Nearest(group_size=48)),
               ("bfloat16", Bf16())]


@torch.inference_mode()
def decode_logits(model: HybridLM, inputs: torch.Tensor, ssm_codec: Codec, conv_codec: Codec | None = None, *,
                  kv: str = "float32", record: dict | None = None) -> torch.Tensor:
    """Logits [B, L, V] with the first token a prefill and each further one a decode step of all B
    sequences, the SSM state stored as ``ssm_codec`` stores it (the conv state as ``conv_codec``, default
    fp32). ``record[layer]`` collects what each write of that layer's SSM state asked for and stored."""
    from ..cache import HybridCache
    from ..cache_manager import CacheManager
    from ..packed_batch import SeqChunk, build_batch

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


def _sig(x: torch.Tensor) -> float:
    return float(f"{float(x):.2g}")


def metrics(ref: torch.Tensor, out: torch.Tensor, batch: mqar.MQARBatch) -> dict:
    """KL(ref || out) over all positions and over the last quarter of the decode, top-1 agreement over all
    positions and at the answers, MQAR accuracy."""
    lp, lq = torch.log_softmax(ref, -1), torch.log_softmax(out, -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    target = batch.labels[:, 1:]
    asked = target != mqar.IGNORE
    agree = ref.argmax(-1) == out.argmax(-1)
    acc = (out[:, :-1].argmax(-1)[asked] == target[asked]).float().mean()
    L = ref.shape[1]
    return {"kl_mean": _sig(kl.mean()), "kl_first_quarter": _sig(kl[:, :L // 4].mean()),
            "kl_last_quarter": _sig(kl[:, -(L // 4):].mean()),
            "top1_agree_%": round(100 * float(agree.float().mean()), 2),
            "top1_agree_answers_%": round(100 * float(agree[:, :-1][asked].float().mean()), 2),
            "mqar_acc_%": round(100 * float(acc), 2)}


def capacity(codec: Codec, conv_int8: bool = True, recipe: str = "hybrid-1to7-small", seq_len: int = 4096,
             budget: int = 4 * 2**30) -> dict:
    """State bytes per sequence of ``recipe`` with its SSM state in ``codec``'s format (conv int8 per head, as
    the int8 state does, unless ``conv_int8`` is False: bf16), int8 K/V, and the 4K-token sequences of
    ``budget`` against bf16 K/V + fp32 state."""
    import math

    from .. import recipes
    from ..cache import cache_dtypes, sequences_that_fit
    from ..layers.registry import cache_specs
    from ..specs import SCALE_BYTES

    cfg = recipes.get(recipe)
    spec = cache_specs(cfg, cache_dtypes(torch.bfloat16, "int8", "int8"))
    ssm = 0
    for s in spec.mamba.values():
        n = math.prod(s.ssm_shape)
        groups = s.ssm_shape[0] if getattr(codec, "per_head", False) else (
            n // codec.group_size if codec.group_size else s.ssm_groups)
        ssm += n * codec.bits / 8 + (groups * SCALE_BYTES if codec.scales_per_row_group else 0)
        ssm += (math.prod(s.conv_shape) + s.conv_groups * SCALE_BYTES) if conv_int8 else 2 * math.prod(s.conv_shape)
    kv_blocks = -(-seq_len // 16)
    per_seq = kv_blocks * spec.kv_bytes_per_block(16) + ssm
    base = sequences_that_fit(cfg, budget, seq_len, kv_dtype="bfloat16", ssm_dtype="float32")
    fit = int((budget - spec.kv_bytes_per_block(16) - ssm) // per_seq)
    return {"state_bytes/seq (1to7-small)": int(ssm), "seqs@4K": fit, "x@4K": round(fit / base, 2)}


def drift_rows(models: dict[str, HybridLM], sequences: int, codecs=None) -> list[dict]:
    g = torch.Generator().manual_seed(4242)
    batch = mqar.make_batch(sequences, DRIFT_PAIRS, 256, generator=g)
    rows = []
    for name, model in models.items():
        ref = decode_logits(model, batch.inputs, Codec())
        base = metrics(ref, ref, batch)["mqar_acc_%"]
        for codec in tqdm(CODECS if codecs is None else codecs, desc=f"drift {name}", unit="format"):
            torch.manual_seed(0)
            m = metrics(ref, decode_logits(model, batch.inputs, codec), batch)
            rows.append({"model": name, "ssm_state": codec.name, **m, "mqar_ref_%": base,
                         "mqar_loss_pts": round(base - m["mqar_acc_%"], 2), **capacity(codec)})
        # the conv state alone (SSM state fp32): int8 per head (one scale for a head's slice of the x, B and C
        # channels, as before), int8 per 16 channels, bf16
        for label, conv in CONV_CODECS:
            m = metrics(ref, decode_logits(model, batch.inputs, Codec(), conv), batch)
            rows.append({"model": name, "ssm_state": f"fp32, conv state {label}", **m, "mqar_ref_%": base,
                         "mqar_loss_pts": round(base - m["mqar_acc_%"], 2)})
    return rows


def diagnosis_rows(model: HybridLM, sequences: int, codec: Codec, buckets: int = 4) -> list[dict]:
    """Along the decode, for every Mamba layer together: the stored state's relative error against the fp32
    run's state at the same step, the share of entries a write left unchanged although the fp32 update
    moved them by over a tenth of a quantum (frozen), and the share of the asked-for change that was lost."""
    g = torch.Generator().manual_seed(4242)
    batch = mqar.make_batch(sequences, DRIFT_PAIRS, 256, generator=g)
    ref_rec, rec = {}, {}
    decode_logits(model, batch.inputs, Codec(), record=ref_rec)
    decode_logits(model, batch.inputs, codec, record=rec)
    steps = len(next(iter(rec.values())))
    rows = []
    for k in range(buckets):
        lo, hi = k * steps // buckets, (k + 1) * steps // buckets
        err = ref_n = frozen = moved = lost = asked = 0.0
        for layer, writes in rec.items():
            for t in range(max(lo, 1), hi):  # write 0 is the prefill
                prev, want, stored = writes[t]
                ref_state = ref_rec[layer][t][2]
                err += float((stored - ref_state).pow(2).sum())
                ref_n += float(ref_state.pow(2).sum())
                groups = prev.reshape(prev.shape[0], -1, prev.shape[-1])
                quantum = (groups.abs().amax(-1, keepdim=True) / 127).expand_as(groups).reshape(prev.shape)
                d_want, d_stored = want - prev, stored - prev
                big = d_want.abs() > 0.1 * quantum
                moved += float(big.sum())
                frozen += float((big & (d_stored == 0)).sum())
                lost += float((d_want - d_stored).pow(2).sum())
                asked += float(d_want.pow(2).sum())
        rows.append({"codec": codec.name, "steps": f"{max(lo, 1)}-{hi - 1}",
                     "state_rel_err_%": round(100 * (err / max(ref_n, 1e-30)) ** 0.5, 3),
                     "frozen_entries_%": round(100 * frozen / max(moved, 1), 2),
                     "update_lost_%": round(100 * (lost / max(asked, 1e-30)) ** 0.5, 2)})
    return rows


def train_models(directory: Path, progress: bool = True) -> dict[str, HybridLM]:
    """The models of :data:`DRIFT_FAMILY` with the tradeoff report's training (``mqar.TrainConfig()``
    defaults, seed 0, :data:`TRAIN_STEPS` steps), trained once and kept in ``directory``."""
    from ..pretrained import from_pretrained, save_pretrained

    models = {}
    for name, share, n in DRIFT_FAMILY:
        path = directory / name.replace("*", "A")
        if not (path / "config.json").exists():
            cfg = mqar.TrainConfig(steps=TRAIN_STEPS[name], seed=0)
            torch.manual_seed(cfg.seed)
            model = mqar.build_model("tiny", share, n, cfg)
            mqar.train(model, cfg, desc=f"train {name}", progress=progress)
            acc = mqar.evaluate(model, cfg)
            save_pretrained(model, path)
            (path / "mqar_eval.json").write_text(json.dumps({str(k): v for k, v in acc.items()}))
        models[name] = from_pretrained(path).float().eval()
    return models


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", default="out/state_drift")
    p.add_argument("--models", default="out/state_drift/models")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--sequences", type=int, default=64)
    p.add_argument("--train-only", action="store_true")
    p.add_argument("--diagnose", default="MMM*", help="the model of the diagnosis table")
    p.add_argument("--diag-sequences", type=int, default=16)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    models = train_models(Path(args.models))
    if args.train_only:
        return
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    result = {"settings": {**vars(args), "pairs": DRIFT_PAIRS, "host_cpus": os.cpu_count(), "time": time.ctime()}}
    diag_model = models[args.diagnose]
    result["diagnosis"] = [r for c in (Nearest(), Stochastic(), KeptScale(), ErrorFeedback(4))
                           for r in diagnosis_rows(diag_model, args.diag_sequences, c)]
    print(f"# diagnosis: {args.diagnose}, {args.diag_sequences} sequences of {DRIFT_PAIRS} pairs\n")
    print(format_table(result["diagnosis"]))
    result["drift"] = drift_rows(models, args.sequences)
    print(f"\n# SSM state formats, {args.sequences} sequences of {DRIFT_PAIRS} pairs, K/V and conv fp32\n")
    print(format_table(result["drift"]))
    (out / "state_drift.json").write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
