"""Where prefill time goes: the torch profiler over a model's prefill, split per layer kind and per op.

Every aten op's self time is charged to the innermost label around it: the layer kind of the residual
sub-layer it runs in (``mamba2``, ``mamba1``, ``attention``, ``mlp``, ``moe``; ``outside layers`` is the
embedding, final norm and LM head), then inside it the named parts — each ``nn.Linear`` by its attribute
name (``in_proj``, ``q_proj``, ...), the gated RMSNorm, the conv1d, the SSD stages (``ssd.intra_chunk``,
``ssd.chunk_states``, ``ssd.state_passing``, ``ssd.state_output``), the
selective scan, the MoE routing and experts, the attention op. What no label claims inside a layer is
listed as that layer's ``other`` (element-wise glue: splits, dt softplus, gating, RoPE, residual adds).

    python -m benchmarks.profile --recipe mamba2-small hybrid-1to7-small --lengths 2048 8192
    python -m benchmarks.profile --recipe hybrid-1to7-small --lengths 32768 --engine-chunk 2048
    python -m benchmarks.profile --recipe family:small:0:4 family:small:1:4 --engine-chunk 2048

``family:SIZE:SHARE:BLOCKS`` is ``recipes.attention_family(SIZE, SHARE, BLOCKS)``, the tradeoff report's
timed members (``family:small:0:4`` is its pure Mamba-2 member ``M-M-M-M-``).

``--engine-chunk N`` profiles a prompt through ``hybrid.Engine`` (the packed varlen path) in chunks of N
tokens instead of one ``model(ids)`` forward. Each (recipe, length) also reports the process's peak
resident memory growth during that run (``--isolate`` runs each in its own process so the peaks do not
mask each other). Profiler timings carry some overhead per op; the totals come from a separate untimed-
profiler run.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import resource
import subprocess
import sys
import time

import torch
from torch import nn
from tqdm import tqdm

from .common import REPO, add_threads

LAYER_KINDS = ("mamba2", "mamba1", "attention", "mlp", "moe")


class _Restore:
    """Undoes :func:`_label_modules`'s instance-level ``forward_packed`` wrapper (a hook-like handle)."""

    def __init__(self, mixer: nn.Module):
        self.mixer = mixer

    def remove(self) -> None:
        del self.mixer.forward_packed


def _label_modules(model: nn.Module) -> list:
    """Forward hooks that open a profiler label around each sub-layer and each named part."""
    from hybrid.layers.norm import GatedRMSNorm, RMSNorm

    handles = []

    def wrap(module: nn.Module, label: str) -> None:
        stack = []

        def pre(_m, _args):
            rf = torch.profiler.record_function(label)
            rf.__enter__()
            stack.append(rf)

        def post(_m, _args, _out):
            stack.pop().__exit__(None, None, None)

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))

    def wrap_packed(mixer: nn.Module, label: str) -> None:
        """The engine calls ``forward_packed`` directly (no module hooks): label it on the instance."""
        inner = mixer.forward_packed

        def labelled(*args, **kwargs):
            with torch.profiler.record_function(label):
                return inner(*args, **kwargs)

        mixer.forward_packed = labelled
        handles.append(_Restore(mixer))

    for block in model.layers:
        wrap(block.mixer, f"layer.{block.kind}")
        if hasattr(block.mixer, "forward_packed"):
            wrap_packed(block.mixer, f"layer.{block.kind}")
        wrap(block.norm, "rmsnorm")
        for name, sub in block.mixer.named_modules():
            if isinstance(sub, nn.Linear):
                wrap(sub, f"linear.{name}")
            elif isinstance(sub, GatedRMSNorm):
                wrap(sub, "gated_rmsnorm")
            elif isinstance(sub, RMSNorm):
                wrap(sub, "rmsnorm")
    return handles


def _run_fn(model, seq_len: int, engine_chunk: int | None, logits: str = "last"):
    """The prefill to profile: one forward (the last position's logits, or with ``logits="all"`` every
    position's), or one prompt through the engine in chunks of ``engine_chunk`` (last-token logits)."""
    device = next(model.parameters()).device
    ids = torch.randint(0, model.config.vocab_size, (1, seq_len), device=device)
    if engine_chunk is None:
        keep = 1 if logits == "last" else 0
        return lambda: model(ids, logits_to_keep=keep)
    from hybrid import Engine, EngineConfig, SamplingParams

    config = EngineConfig(max_seqs=1, max_batch_tokens=engine_chunk, cache_bytes=_engine_cache_bytes(model, seq_len))

    def run():
        engine = Engine(model, config)
        engine.add_request(ids[0].tolist(), SamplingParams(max_new_tokens=1))
        while engine.has_unfinished():
            engine.step()
    return run


def _engine_cache_bytes(model, seq_len: int) -> int:
    dtype = next(model.parameters()).dtype
    return int(model.kv_bytes_per_token(dtype) * (seq_len + 256) * 1.1
               + model.state_bytes_per_sequence(torch.float32) * 2 + 2**20)


# aten ops that name their part themselves when no label of ours is around them
_OP_PARTS = {"aten::scaled_dot_product_attention": "attention op (sdpa)",
             "aten::_scaled_dot_product_flash_attention_for_cpu": "attention op (sdpa)",
             "aten::mkldnn_convolution": "conv1d", "aten::convolution": "conv1d"}


def _label_of(event) -> str | None:
    name = event.name
    if name.startswith(("layer.", "linear.", "ssd.", "selective.", "moe.", "attention.")) \
            or name in ("rmsnorm", "gated_rmsnorm", "conv1d"):
        return name
    return None


def _charge(ev) -> str:
    """'<layer kind> / <part>' that ``ev``'s self time belongs to."""
    inner = _label_of(ev)
    if inner is not None and inner.startswith("layer."):
        return f"{inner[len('layer.'):]} / python and glue"
    layer = None
    p = ev.cpu_parent
    while p is not None:
        lab = _label_of(p)
        if lab is not None:
            if lab.startswith("layer."):
                layer = lab[len("layer."):]
                break
            if inner is None:
                inner = lab
        p = p.cpu_parent
    if inner is None:
        inner = _OP_PARTS.get(ev.name)
    if layer is None:
        if inner == "rmsnorm":
            return "pre-norms / rmsnorm"
        return f"outside layers / {inner or 'embed, final norm, lm_head'}"
    return f"{layer} / {inner or 'other (element-wise glue)'}"


def breakdown(prof) -> dict[str, float]:
    """Self time (ms) of every profiled event charged to '<layer kind> / <innermost part>'."""
    out: dict[str, float] = collections.defaultdict(float)
    for ev in prof.events():
        if ev.self_cpu_time_total > 0:
            out[_charge(ev)] += ev.self_cpu_time_total / 1e3
    return dict(out)


def top_ops(prof, n: int = 12) -> list[tuple[str, float, int]]:
    rows = [(e.key, e.self_cpu_time_total / 1e3, e.count) for e in prof.key_averages() if e.key.startswith("aten::")]
    return sorted(rows, key=lambda r: -r[1])[:n]


@torch.inference_mode()
def profile_one(model, seq_len: int, *, engine_chunk: int | None = None, repeats: int = 1,
                logits: str = "last") -> dict:
    from hybrid.eval.timing import prefill_flops

    fn = _run_fn(model, seq_len, engine_chunk, logits)
    _run_fn(model, min(seq_len, 256), engine_chunk, logits)()  # warm-up (one-time setup) at a short length
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak_mb = (rss1 - rss0) / 1024
    handles = _label_modules(model)
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            fn()
    finally:
        for h in handles:
            h.remove()
    flops = prefill_flops(model, seq_len, 1, "last" if engine_chunk else logits)
    best = min(times)
    parts = breakdown(prof)
    total = sum(parts.values())
    return {"seq_len": seq_len, "engine_chunk": engine_chunk, "logits": "last" if engine_chunk else logits,
            "seconds": [round(t, 4) for t in times],
            "tokens_per_s": round(seq_len / best, 1), "GFLOP/s": round(flops / best / 1e9, 2),
            "peak_rss_growth_MB": round(peak_mb, 1), "peak_rss_MB": round(rss1 / 1024, 1),
            "profiled_ms": round(total, 1),
            "parts_ms": {k: round(v, 2) for k, v in sorted(parts.items(), key=lambda kv: -kv[1])},
            "top_ops": [(k, round(ms, 2), c) for k, ms, c in top_ops(prof)]}


def format_report(name: str, dtype: str, row: dict) -> str:
    total = row["profiled_ms"] or 1.0
    how = (f"engine, chunks of {row['engine_chunk']}" if row["engine_chunk"]
           else f"forward, {row.get('logits', 'all')}-position logits")
    lines = [f"## {name}, {row['seq_len']} tokens, {dtype}, {how}: {row['tokens_per_s']} tok/s, "
             f"{row['GFLOP/s']} GFLOP/s, peak RSS {row['peak_rss_MB']} MB (+{row['peak_rss_growth_MB']} MB in this "
             f"run; runs {row['seconds']} s)",
             "", "| layer kind / part | ms | share |", "|---|---:|---:|"]
    by_kind: dict[str, float] = collections.defaultdict(float)
    for key, ms in row["parts_ms"].items():
        by_kind[key.split(" / ")[0]] += ms
    for kind, ms in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        lines.append(f"| **{kind}** | **{ms:.1f}** | **{ms / total:.1%}** |")
        for key, pms in row["parts_ms"].items():
            if key.startswith(kind + " / ") and pms / total >= 0.002:
                lines.append(f"| &nbsp;&nbsp;{key.split(' / ')[1]} | {pms:.1f} | {pms / total:.1%} |")
    lines += ["", "top aten ops (self ms, calls): " + ", ".join(f"{k} {ms} ({c})" for k, ms, c in row["top_ops"])]
    return "\n".join(lines)


def _config(name: str):
    """A recipe name, or ``family:SIZE:SHARE:BLOCKS`` for a member of ``recipes.attention_family``."""
    from hybrid import recipes
    if not name.startswith("family:"):
        return recipes.get(name)
    parts = name.split(":")[1:]
    if len(parts) != 3:
        raise ValueError(f"{name!r}: a family member is family:SIZE:SHARE:BLOCKS, e.g. family:small:0:4")
    try:
        share, blocks = float(parts[1]), int(parts[2])
    except ValueError:
        raise ValueError(f"{name!r}: SHARE must be a number in 0..1 and BLOCKS an integer") from None
    return recipes.attention_family(parts[0], share, blocks)


def _build(name: str, dtype: torch.dtype):
    from hybrid.model import HybridLM
    torch.manual_seed(0)
    return HybridLM(_config(name)).to(dtype).eval()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", nargs="+", required=True,
                   help="recipe names, all-small, or family:SIZE:SHARE:BLOCKS (an attention_family member)")
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    add_threads(p, 2)
    p.add_argument("--repeats", type=int, default=1, help="timed runs after the warm-up (the best is reported)")
    p.add_argument("--engine-chunk", type=int, default=None, help="prefill through the engine in chunks of N")
    p.add_argument("--logits", choices=["last", "all"], default="last",
                   help="the forward computes the last position's logits only (default) or every position's")
    p.add_argument("--isolate", action="store_true", help="each (recipe, length) in its own process")
    p.add_argument("--json", help="also write the rows here (JSON lines)")
    args = p.parse_args(argv)
    from hybrid.kernels import host_memory

    from hybrid import recipes

    host_memory.keep_freed_memory()  # this process is the benchmark's: reuse freed large blocks
    names = [n for n in recipes.names() if n.endswith("-small")] if args.recipe == ["all-small"] else args.recipe
    for n in names:
        _config(n)  # unknown names fail here, before any work
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    todo = [(n, L) for n in names for L in sorted(args.lengths)]
    sink = open(args.json, "a") if args.json else contextlib.nullcontext()  # noqa: SIM115
    with sink as f:
        model_name, model = None, None
        for name, L in tqdm(todo, desc="profile", unit="run"):
            if args.isolate:
                row = _in_subprocess(name, L, args)
            else:
                if name != model_name:
                    model_name, model = name, _build(name, dtype)
                row = profile_one(model, L, engine_chunk=args.engine_chunk, repeats=args.repeats, logits=args.logits)
            tqdm.write(format_report(name, args.dtype, row) + "\n")
            if args.json:
                f.write(json.dumps({"model": name, "dtype": args.dtype, "threads": args.threads, **row}) + "\n")
                f.flush()


def _in_subprocess(name: str, L: int, args) -> dict:
    from hybrid.kernels import host_memory

    cmd = [sys.executable, "-c",
           "import json, sys, torch\n"
           "from benchmarks.profile import _build, profile_one\n"
           "from hybrid.kernels.host_memory import keep_freed_memory\n"
           f"keep_freed_memory() if {host_memory.keeping()} else None\n"
           f"torch.set_num_threads({args.threads})\n"
           f"m = _build({name!r}, torch.{args.dtype})\n"
           f"print('ROW' + json.dumps(profile_one(m, {L}, engine_chunk={args.engine_chunk!r}, "
           f"repeats={args.repeats}, logits={args.logits!r})))\n"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO).stdout  # imports benchmarks
    return json.loads(next(line[3:] for line in out.splitlines() if line.startswith("ROW")))


if __name__ == "__main__":
    main()
