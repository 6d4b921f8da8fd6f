"""Cache compression benchmark: capacity, decode speed and accuracy per (KV dtype, state dtype).

    python -m benchmarks.compression --threads 2 --output out/compression

Four tables (markdown on stdout, all rows in ``OUTPUT/compression.json``):

- ``capacity``: sequences of 4K and 32K tokens that fit in 4 GiB for ``llama-small``, ``hybrid-1to7-small``,
  ``jamba-small``, ``mamba2-small`` at each dtype pair, from the layers' cache specs (block and state scales
  included; what :class:`hybrid.cache.HybridCache` allocates, tested in tests/test_cache_compression.py),
  and the gain over (bf16 KV, fp32 state).
- ``decode``: decode tokens/s at batch 32 through the engine per recipe and dtype pair (every engine of a
  recipe built first, then ``--decode-repeats`` x ``--decode-steps`` steps each, one step of each engine
  in turn, so load from other work lands on all alike; median of all timed steps, min and max beside it; run it under
  ``flock /tmp/bench.lock``, the CPU is shared).
- ``accuracy``: small MQAR models trained here (``hybrid.eval.mqar.train`` with the explicit
  :data:`TRAIN` settings; 1:7 hybrid, pure Mamba-2, attention only) run teacher-forced through the paged
  cache with *every* token a decode step (the harshest case: each K/V token written alone into its block,
  the state quantised after every token). Per dtype pair: mean logit KL(uncompressed || compressed) and
  top-1 agreement over all positions, and MQAR accuracy next to the uncompressed cache's.
- ``kv_scale`` / ``state_rounding``: the measurements behind two choices: the storage dtype of the
  per-token K/V scales (fp16 against fp32), and nearest vs stochastic rounding of int8 / bf16 state.
- ``kv_write``: one attention layer's K/V write of a decode step (batch 32) per page dtype: the per-token
  quantised write against the per-block write it replaced (kept here, :func:`write_kv_block_scales_before`)
  and the bf16 ``index_copy_``, interleaved.
- ``pruning``: long-context recall under KV pruning (StreamingLLM, SnapKV at several budgets) on MQAR models
  trained with a long filler between the pairs and the queries (:mod:`.compression_accuracy`).

The uncompressed reference is the same model in fp32 with fp32 K/V and state.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch
from hybrid.kernels import kv_quant
from tqdm import tqdm

from hybrid import recipes
from hybrid.cache import HybridCache, cache_dtypes, sequences_that_fit
from hybrid.cache.manager import CacheManager
from hybrid.engine.packed_batch import SeqChunk, build_batch
from hybrid.model import HybridLM
from hybrid.report import format_table

from . import compression_accuracy as ca
from .common import interleaved_seconds
from .compression_accuracy import PAIRS

RECIPES = ["llama-small", "hybrid-1to7-small", "jamba-small", "mamba2-small"]


def capacity_rows(cache_gib: float = 4.0, lengths=(4096, 32768)) -> list[dict]:
    rows = []
    for name in RECIPES:
        cfg = recipes.get(name)
        base = {}
        for kv, state in PAIRS:
            d = cache_dtypes(torch.bfloat16, kv, state)
            row = {"model": name, "kv": kv, "state": state}
            for L in lengths:
                n = sequences_that_fit(cfg, int(cache_gib * 2**30), L, kv_dtype=d.kv, conv_dtype=d.conv,
                                       ssm_dtype=d.ssm)
                base.setdefault(L, n)
                row[f"seqs@{L // 1024}K"] = n
                row[f"x@{L // 1024}K"] = round(n / base[L], 2) if base[L] else math.inf
            rows.append(row)
    return rows


def decode_rows(batch: int, context: int, steps: int, dtype: torch.dtype, *, repeats: int = 3,
                names: list[str] | None = None, pairs: list[tuple[str, str]] | None = None) -> list[dict]:
    """Whole-engine decode tokens/s per recipe and (KV, state) dtype pair: a recipe's engines are all built
    first, then each takes ``repeats * steps`` timed steps, one step of each engine in turn (load from other
    work on a shared machine lands on every pair alike); min / median / max over its timed steps, and the
    median's speed relative to the first pair (bf16 K/V, fp32 state)."""
    import statistics

    from hybrid.eval.decode_timing import decode_engine

    rows = []
    for name in tqdm(names or RECIPES, desc="decode", unit="model"):
        torch.manual_seed(0)
        model = HybridLM(recipes.get(name)).to(dtype).eval()
        chosen = pairs or PAIRS
        engines = [decode_engine(model, batch, context, steps=steps * repeats, compile=False, warmup=1, kv_dtype=kv,
                                 state_dtype=state) for kv, state in chosen]
        times = [[] for _ in chosen]
        for _ in range(repeats * steps):  # one step of each engine in turn: a burst of load hits them all alike
            for e, ts in zip(engines, times, strict=True):
                t0 = time.perf_counter()
                e.step()
                ts.append(time.perf_counter() - t0)
        base = None
        for (kv, state), ts in zip(chosen, times, strict=True):
            ms = sorted(1e3 * t for t in ts)
            med = statistics.median(ms)
            tok_s = batch / (med / 1e3)
            base = base or tok_s
            rows.append({"model": name, "kv": kv, "state": state, "batch": batch, "context": context,
                         "steps": len(ms), "ms_min": round(ms[0], 2), "ms_med": round(med, 2),
                         "ms_max": round(ms[-1], 2), "decode_tok/s": round(tok_s, 1),
                         "vs_bf16": round(tok_s / base, 3)})
        del engines
    return rows


def layer_decode_rows(batch: int, context: int, repeats: int, dtype: torch.dtype) -> list[dict]:
    """One attention layer and one Mamba-2 layer of ``hybrid-1to7-small`` taking a decode step of ``batch``
    sequences at ``context`` tokens, per cache dtype: the minimum of ``repeats`` runs (the least disturbed
    by other work on a shared machine), the layer alone (no weights-bound MLP or head around it)."""
    cfg = recipes.get("hybrid-1to7-small")
    torch.manual_seed(0)
    model = HybridLM(cfg).to(dtype).eval()
    attn_i = next(i for i, k in enumerate(cfg.layer_kinds) if k == "attention")
    mamba_i = next(i for i, k in enumerate(cfg.layer_kinds) if k == "mamba2")
    rows = []
    for kv, state in PAIRS:
        d = cache_dtypes(dtype, kv, state)
        cache = HybridCache.for_model(model, num_blocks=batch * -(-(context + 1) // 16) + 1, block_size=16,
                                      max_seqs=batch, kv_dtype=d.kv, conv_dtype=d.conv, ssm_dtype=d.ssm)
        manager = CacheManager(cache)
        for b in range(batch):
            manager.admit(b, context + 1)
        chunks = [SeqChunk(b, [1], context) for b in range(batch)]
        pb = build_batch(manager, chunks)
        x = torch.randn(batch, cfg.d_model, dtype=dtype)
        row = {"kv": kv, "state": state, "batch": batch, "context": context}
        for name, i in (("attention", attn_i), ("mamba2", mamba_i)):
            mixer = model.layers[i].mixer
            times = []
            with torch.inference_mode():
                for _ in range(repeats + 1):
                    t0 = time.perf_counter()
                    mixer.forward_packed(x, pb.with_rope(None), cache.view(i))
                    times.append(time.perf_counter() - t0)
            row[f"{name}_ms_min"] = round(1e3 * min(times[1:]), 2)
        rows.append(row)
    for r in rows:
        r["attention_vs_bf16"] = round(rows[0]["attention_ms_min"] / r["attention_ms_min"], 3)
        r["mamba2_vs_fp32"] = round(rows[0]["mamba2_ms_min"] / r["mamba2_ms_min"], 3)
    return rows


# ---- per-op decode speed (interleaved) ---------------------------------------------------------------

def _spread_row(name: str, ts: list[float], base: float | None) -> dict:
    import statistics

    ms = sorted(1e3 * t for t in ts)
    med = statistics.median(ms)
    return {"variant": name, "ms_min": round(ms[0], 3), "ms_med": round(med, 3), "ms_max": round(ms[-1], 3),
            "vs_ref_med": round(base / med, 3) if base else 1.0}


def state_step_rows(batch: int = 32, repeats: int = 15, recipe: str = "hybrid-1to7-small") -> list[dict]:
    """One Mamba-2 layer's SSD decode step on its state pool at ``batch`` sequences, per state storage and
    path: fp32 in place (the reference speed), bf16 in place, int8 fused (torch), int8 fused compiled
    (``torch.compile``), and the paths this branch replaced (bf16 through ``ssd_step_ref``, int8 through
    dequantise / fp32 step / quantise), interleaved."""
    from hybrid.kernels import dispatch, ssd
    from hybrid.kernels.packing import step_on_slots, with_host_values

    from hybrid.cache import StatePool

    m = recipes.get(recipe).mamba2
    H, P, N, G = m.n_heads, m.head_dim, m.d_state, m.n_groups
    g = torch.Generator().manual_seed(0)
    x, dt = torch.randn(batch, H, P, generator=g).bfloat16(), torch.rand(batch, H, generator=g) * 0.1
    A, D = -torch.rand(H, generator=g) - 0.5, torch.randn(H, generator=g)
    B, C = torch.randn(batch, G, N, generator=g).bfloat16(), torch.randn(batch, G, N, generator=g).bfloat16()
    slots = with_host_values(torch.arange(batch), tuple(range(batch)))  # as the engine's decode batch has them
    start = torch.randn(batch + 1, H, P, N, generator=g) * 0.1
    pools = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("int8", torch.int8)):
        pools[name] = StatePool((H, P, N), dtype, batch + 1, H * P)
        pools[name].write(torch.arange(batch + 1), start)
    before_int8 = StatePool((H, P, N), torch.int8, batch + 1, H * P)
    before_int8.write(torch.arange(batch + 1), start)
    before_int8._fused_layout = lambda: False  # the generic dequantise / step / quantise path of before
    bf16_before = pools["bf16"].data.clone()
    args = (x, dt, A, B, C)

    def compiled_int8():
        with dispatch.use_backend("inductor"):
            pools["int8"].step(ssd.ssd_step, *args, D=D, slots=slots)

    variants = {
        "fp32 state, in place, tiled": lambda: pools["fp32"].step(ssd.ssd_step, *args, D=D, slots=slots),
        "bf16 state, tiled (now)": lambda: pools["bf16"].step(ssd.ssd_step, *args, D=D, slots=slots),
        "bf16 state, ssd_step_ref (before)": lambda: step_on_slots(ssd.ssd_step_ref, bf16_before, slots, *args,
                                                                   D=D),
        "int8 state, fused tiled torch (now)": lambda: pools["int8"].step(ssd.ssd_step, *args, D=D, slots=slots),
        "int8 state, fused compiled (opt-in)": compiled_int8,
        "int8 state, dequantise/step/quantise (before)": lambda: before_int8.step(ssd.ssd_step, *args, D=D,
                                                                                  slots=slots),
    }
    with torch.inference_mode():
        times = interleaved_seconds(variants, 1, repeats)
    import statistics

    base = statistics.median(1e3 * t for t in times["fp32 state, in place, tiled"])
    return [{"batch": batch, **_spread_row(k, v, base)} for k, v in times.items()]


def write_kv_block_scales_before(pool: torch.Tensor, scale: torch.Tensor, x: torch.Tensor,
                                 slot_mapping: torch.Tensor) -> None:
    """The per-block-scale write that per-token scales replaced (``scale [NB, Hkv]``: each block's running
    |max| / qmax; a block whose scale grows is re-quantised), kept only as the ``kv_write`` table's "before"."""
    dtype, m = pool.dtype, kv_quant.qmax(pool.dtype)
    bs = pool.shape[1]
    blk = slot_mapping // bs
    amax = x.float().abs().amax(-1)  # [T, Hkv]
    run = torch.cat([blk.new_zeros(1), (blk[1:] != blk[:-1]).long()]).cumsum(0)  # run index of each token
    run_max = torch.zeros_like(amax).scatter_reduce_(0, run[:, None].expand_as(amax), amax, "amax")[run]
    old = scale[blk]  # [T, Hkv]
    new = torch.where(run_max > old * m, run_max / m, old)
    pages = pool[blk]  # [T, BS, Hkv, D]
    ratio = torch.where(new > 0, old / torch.where(new > 0, new, torch.ones_like(new)), torch.zeros_like(new))
    requant = kv_quant.quantize(pages.float() * ratio[:, None, :, None], torch.ones((), device=x.device), dtype)
    kv_quant._bits(pool).index_copy_(0, blk, kv_quant._bits(requant))
    scale.index_copy_(0, blk, new)
    kv_quant._bits(pool).view(-1, *pool.shape[2:]).index_copy_(
        0, slot_mapping, kv_quant._bits(kv_quant.quantize(x, new[..., None], dtype)))


def _with_torch_round(fn):
    saved = kv_quant.round_nearest_
    kv_quant.round_nearest_ = torch.Tensor.round_
    try:
        fn()
    finally:
        kv_quant.round_nearest_ = saved


def kv_write_rows(batch: int = 32, context: int = 1024, repeats: int = 30, recipe: str = "hybrid-1to7-small",
                  compiled: bool = True) -> list[dict]:
    """One attention layer's K and V write of a decode step: ``batch`` sequences of ``context`` tokens each
    write their next token (bf16 keys and values) into a pool of ``batch * context`` tokens, per page dtype
    and write op, interleaved; ``compiled``: the per-token write also through ``torch.compile`` (Inductor,
    as the compiled decode step runs it). ``torch.round``: the per-token write rounding its int8 codes with
    ``torch.round`` instead of :func:`hybrid.kernels.kv_quant.round_nearest_` (the per-block write of before
    uses ``torch.round``, as it did)."""
    import statistics

    a = recipes.get(recipe).attention
    Hkv, Dh, BS = a.n_kv_heads, a.head_dim, 16
    per_seq = -(-(context + 1) // BS)
    nb = batch * per_seq + 1
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(batch, Hkv, Dh, generator=g).bfloat16() for _ in "kv")
    slots = torch.tensor([(1 + b * per_seq + context // BS) * BS + context % BS for b in range(batch)])
    variants = {}

    def pools(dtype, scale_shape):
        return [torch.zeros(nb, BS, Hkv, Dh, dtype=dtype) for _ in "kv"], [torch.zeros(scale_shape) for _ in "kv"]

    bf = pools(torch.bfloat16, ())[0]

    def bf16_write():
        for pool, x in zip(bf, (k, v), strict=True):
            pool.view(-1, Hkv, Dh).index_copy_(0, slots, x)

    variants["bfloat16 index_copy_"] = bf16_write
    for name, dt in (("int8", torch.int8), ("fp8", kv_quant.FP8)):
        (pb, sb), (pt, st) = pools(dt, (nb, Hkv)), pools(dt, ())
        st = [torch.zeros(nb, BS, Hkv, dtype=kv_quant.KV_SCALE_DTYPE) for _ in "kv"]

        def before(pb=pb, sb=sb):
            for pool, sc, x in zip(pb, sb, (k, v), strict=True):
                write_kv_block_scales_before(pool, sc, x, slots)

        def now(pt=pt, st=st, op=kv_quant.write_kv_quantized):
            for pool, sc, x in zip(pt, st, (k, v), strict=True):
                op(pool, sc, x, slots)

        variants[f"{name} per-block (before)"] = before
        variants[f"{name} per-token (now)"] = now
        if dt == torch.int8:  # the per-token write with torch.round for its codes (what before used)
            variants["int8 per-token, torch.round"] = lambda now=now: _with_torch_round(now)
        if compiled:
            op = torch.compile(kv_quant.write_kv_quantized, fullgraph=True, dynamic=False)
            variants[f"{name} per-token, compiled"] = lambda now=now, op=op: now(op=op)
    with torch.inference_mode():
        times = interleaved_seconds(variants, 1, repeats)
    base = statistics.median(1e3 * t for t in times["bfloat16 index_copy_"])
    return [{"batch": batch, "context": context, **_spread_row(n, t, base)} for n, t in times.items()]


def paged_decode_rows(batch: int = 32, context: int = 1024, repeats: int = 15,
                      recipe: str = "hybrid-1to7-small") -> list[dict]:
    """The torch paged decode attention of one layer of ``recipe`` over ``batch`` sequences of ``context``
    tokens, per page dtype (bf16 queries), interleaved: the walk as it runs (pages gathered and converted into
    reused buffers), the walk before it (``fresh temporaries``: a new tensor per pass, and fp8 through
    :func:`~hybrid.kernels.kv_quant.fp8_codes_as_fp16`), and ``fp8, native cast`` (``Tensor.float()``, element
    by element on CPU)."""
    import statistics

    from hybrid.kernels import kv_quant as kq
    from hybrid.kernels.packing import with_host_values
    from hybrid.kernels.paged_attention import paged_decode_attention

    a = recipes.get(recipe).attention
    Hq, Hkv, Dh, BS = a.n_heads, a.n_kv_heads, a.head_dim, 16
    nb = batch * -(-context // BS)
    g = torch.Generator().manual_seed(0)
    kf, vf = torch.randn(nb + 1, BS, Hkv, Dh, generator=g), torch.randn(nb + 1, BS, Hkv, Dh, generator=g)
    tables = torch.arange(1, nb + 1, dtype=torch.int32).view(batch, -1)
    lens = with_host_values(torch.full((batch,), context, dtype=torch.int32), (context,) * batch)
    q = torch.randn(batch, Hq, Dh, generator=g).bfloat16()
    pages = {"bfloat16": (kf.bfloat16(), vf.bfloat16(), None, None)}
    for name, dt in (("int8", torch.int8), ("fp8", kq.FP8)):
        (kc, ks), (vc, vs) = (kq.quantize_tokens(t.flatten(0, 1), dt) for t in (kf, vf))  # per token and head
        pages[name] = (kc.view(kf.shape), vc.view(vf.shape), ks.view(kf.shape[:3]), vs.view(vf.shape[:3]))

    def run(name):
        k, v, ks, vs = pages[name]
        return lambda: paged_decode_attention(q, k, v, lens, tables, k_scale=ks, v_scale=vs)

    def with_gather(name, gather):
        def go():
            saved = kq.gather_pages_as_float
            kq.gather_pages_as_float = gather
            try:
                run(name)()
            finally:
                kq.gather_pages_as_float = saved
        return go

    def fresh(pool, flat, role):  # the walk before reused buffers: a fresh temporary per pass
        return kq.codes_to_float(pool.index_select(0, flat))

    variants = {"bfloat16": run("bfloat16"), "int8": run("int8"), "fp8": run("fp8"),
                "bfloat16, fresh temporaries (before)": with_gather("bfloat16", fresh),
                "int8, fresh temporaries (before)": with_gather("int8", fresh),
                "fp8, fresh temporaries (before)": with_gather("fp8", fresh),
                "fp8, native cast": with_gather("fp8", lambda pool, flat, role: (pool.index_select(0, flat).float(),
                                                                                  1.0))}
    with torch.inference_mode():
        times = interleaved_seconds(variants, 1, repeats)
    base = statistics.median(1e3 * t for t in times["bfloat16"])
    return [{"batch": batch, "context": context, **_spread_row(k, v, base)} for k, v in times.items()]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", default="out/compression", help="folder for compression.json")
    p.add_argument("--models", default="out/compression/models", help="where the trained MQAR models are kept")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--sequences", type=int, default=128, help="MQAR sequences in the accuracy table")
    p.add_argument("--decode-batch", type=int, default=32)
    p.add_argument("--decode-ctx", type=int, default=256)
    p.add_argument("--decode-steps", type=int, default=8, help="timed decode steps per engine and round")
    p.add_argument("--decode-repeats", type=int, default=3, help="round-robin rounds over a recipe's engines")
    p.add_argument("--decode-recipes", nargs="*", default=RECIPES, choices=RECIPES)
    p.add_argument("--decode-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--skip", nargs="*", default=[],
                   choices=["capacity", "decode", "accuracy", "engine_decode", "pruning", "long_decode",
                            "op_decode", "layer_decode"])
    p.add_argument("--drift-models", default="out/state_drift/models",
                   help="where the long-decode accuracy keeps its trained MQAR family (trained if missing)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    train = {k: list(v) if isinstance(v, tuple) else v for k, v in ca.TRAIN.items()}
    result = {"settings": {**vars(args), "train": train,
                           "eval_pairs": ca.EVAL_PAIRS, "host_cpus": os.cpu_count(), "time": time.ctime()}}
    if "capacity" not in args.skip:
        result["capacity"] = capacity_rows()
        print("# sequences that fit in 4 GiB (from the specs; x = vs bf16 KV + fp32 state)\n")
        print(format_table(result["capacity"]))
    if "accuracy" not in args.skip:
        models = ca.train_models(Path(args.models))
        acc, scale, rounding = ca.accuracy_rows(models, args.sequences)
        result.update(accuracy=acc, kv_scale=scale, state_rounding=rounding)
        print(f"\n# accuracy vs the fp32 cache, {args.sequences} MQAR sequences of {ca.EVAL_PAIRS} pairs, every token "
              "a decode step\n")
        print(format_table(acc))
        print("\n# per-token K/V scale dtype (state fp32)\n")
        print(format_table(scale))
        print("\n# state rounding (K/V fp32)\n")
        print(format_table(rounding))
    if "long_decode" not in args.skip:
        result["long_decode_accuracy"], result["long_decode_kv_scale"] = ca.long_decode_accuracy_rows(
            Path(args.drift_models))
        print("\n# accuracy vs the fp32 cache on the trained MQAR family, 64 sequences of 64 pairs (256 decode "
              "steps each)\n")
        print(format_table(result["long_decode_accuracy"]))
        print("\n# the same, per-token K/V scales in fp16 (default) vs fp32, state fp32\n")
        print(format_table(result["long_decode_kv_scale"]))
    if "op_decode" not in args.skip:
        result["state_step"] = state_step_rows(args.decode_batch)
        print(f"\n# one Mamba-2 layer's SSD decode step, batch {args.decode_batch}, {args.threads} threads, "
              "interleaved (ms; vs = fp32 median / median)\n")
        print(format_table(result["state_step"]))
        result["kv_write"] = kv_write_rows(args.decode_batch, 4 * args.decode_ctx)
        print(f"\n# one attention layer's K/V write of a decode step, batch {args.decode_batch}, {args.threads} "
              "threads, interleaved (ms; vs = bf16 median / median)\n")
        print(format_table(result["kv_write"]))
        result["paged_decode"] = paged_decode_rows(args.decode_batch, 4 * args.decode_ctx)
        print(f"\n# torch paged decode attention, one layer, batch {args.decode_batch}, context "
              f"{4 * args.decode_ctx}, interleaved (vs = bf16 median / median)\n")
        print(format_table(result["paged_decode"]))
    if "pruning" not in args.skip:
        _pruning_scenario(result, Path(args.models) / "recall", args.sequences)
    if "decode" not in args.skip:
        result["decode"] = [] if "engine_decode" in args.skip else decode_rows(
            args.decode_batch, args.decode_ctx, args.decode_steps, getattr(torch, args.decode_dtype),
            repeats=args.decode_repeats, names=args.decode_recipes)
        print(f"\n# decode at batch {args.decode_batch}, context {args.decode_ctx}, model {args.decode_dtype}, "
              f"{args.threads} threads, {args.decode_repeats * args.decode_steps} steps each, interleaved step by "
              "step (ms per step: min / median / max)\n")
        print(format_table(result["decode"]))
    if "decode" not in args.skip and "layer_decode" not in args.skip:
        result["layer_decode"] = layer_decode_rows(args.decode_batch, 4 * args.decode_ctx, 20,
                                                   getattr(torch, args.decode_dtype))
        print(f"\n# one layer's decode step (min of 20), batch {args.decode_batch}, context {4 * args.decode_ctx}; "
              "vs = speed relative to (bf16 KV, fp32 state)\n")
        print(format_table(result["layer_decode"]))
    (out / "compression.json").write_text(json.dumps(result, indent=1, default=str))
    print(f"\nwrote {out / 'compression.json'}")


def _pruning_scenario(result: dict, models_dir: Path, sequences: int) -> None:
    result["pruning"] = ca.recall_rows(ca.train_recall_models(models_dir), sequences)
    result["settings"]["pruning"] = {"pairs": ca.RECALL_PAIRS, "filler": ca.FILLER,
                                     "prompt_queries": ca.PROMPT_QUERIES, "budgets": list(ca.BUDGETS),
                                     "train": ca.RECALL_TRAIN}
    print(f"\n# long-context recall under KV pruning: {sequences} sequences of {ca.RECALL_PAIRS} pairs, {ca.FILLER} "
          f"filler tokens, the last {ca.RECALL_PAIRS - ca.PROMPT_QUERIES} queries decoded (vs the unpruned cache)\n")
    print(format_table(result["pruning"]))

if __name__ == "__main__":
    main()
