"""Prefill speed of our model against transformers on the same weights, side by side in one process.

Each entry takes one of our ``*-small`` recipes (randomly initialised, ~100M parameters), exports it
with ``hybrid.save_pretrained(model, dir, format=...)`` and loads that folder with transformers, so both hold identical
weights; a short forward checks the logits agree before anything is timed. Then, with the same
thread count, it times the forward (no cache) at each length, both sides interleaved run by run: min /
median / max of the repeats, tokens/s at the median, and the ratio ours / transformers. ``--logits last``
(the default) asks both for the last position's logits only (``logits_to_keep=1``, which transformers'
Llama, Mamba2, Bamba, NemotronH and Jamba forwards all take): what a prompt needs; ``--logits all`` for
every position's, as scoring computes them.

    python -m benchmarks.interop --lengths 2048 8192 --threads 8 --plot interop_bench.png
    python -m benchmarks.interop --dtype bfloat16     # both sides in bf16 (the same rounded weights)

An architecture whose exporter is missing (or refuses the recipe) is skipped with the reason; adding one
is one line in ``ENTRIES``.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import statistics
import tempfile
from collections.abc import Callable

import torch
from hybrid.eval.timing import LOGITS
from hybrid.kernels import host_memory
from hybrid.recipes import get as get_recipe
from tqdm import tqdm

from hybrid.config import HybridConfig
from hybrid.model import HybridLM
from hybrid.pretrained import save_pretrained
from hybrid.report import format_table

from .common import add_json, interleaved_seconds, record


def _bamba_like(cfg: HybridConfig) -> HybridConfig:
    # Bamba checkpoints rotate half of each head (transformers' default for them)
    return dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, rotary_fraction=0.5))


def _untied(cfg: HybridConfig) -> HybridConfig:
    # transformers' NemotronH never ties the LM head to the embeddings
    return dataclasses.replace(cfg, tie_embeddings=False)


def _jamba_like(cfg: HybridConfig) -> HybridConfig:
    # Jamba has no RoPE and normalises dt, B and C inside its Mamba layers (as our jamba-moe recipe does)
    return dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, rotary_fraction=0.0),
                               mamba1=dataclasses.replace(cfg.mamba1, inner_norms=True))


def _qwen3_next_like(cfg: HybridConfig) -> HybridConfig:
    # Qwen3-Next's RMSNorms scale by 1 + weight, its attention is gated, q/k-normed and rotates a quarter of each
    # head (transformers' default partial_rotary_factor); the Gated DeltaNet layers are gdn-small's as they are
    return dataclasses.replace(cfg, norm_offset=1.0, attention=dataclasses.replace(
        cfg.attention, output_gate=True, qk_norm=True, rotary_fraction=0.25))


# name -> (our recipe, export format, adjustment making the recipe representable in that format)
ENTRIES: dict[str, tuple[str, str, Callable[[HybridConfig], HybridConfig] | None]] = {
    "llama": ("llama-small", "llama", None),
    "mamba2": ("mamba2-small", "mamba2", None),
    "bamba": ("hybrid-1to7-small", "bamba", _bamba_like),
    "nemotron_h": ("nemotronh-small", "nemotron_h", _untied),
    "jamba": ("jamba-small", "jamba", _jamba_like),
    # the 3:1 layout (9 Gated DeltaNet layers of gdn-small's shape, 3 attention, an MLP after each): transformers'
    # Qwen3-Next cannot run without an attention layer, so a GDN-only model has no transformers twin.
    # Without flash-linear-attention and causal-conv1d installed transformers takes its torch path
    # (torch_chunk_gated_delta_rule), the one a CPU has.
    "qwen3_next": ("qwen3next-like-small", "qwen3_next", _qwen3_next_like),
}


def build_pair(name: str, workdir: str, dtype: torch.dtype = torch.float32) -> tuple[HybridLM, torch.nn.Module]:
    """Our model and the transformers model loaded from its export: the same weights, both in ``dtype``."""
    import transformers

    from hybrid.interop import export_formats

    recipe, fmt, adjust = ENTRIES[name]
    if fmt not in export_formats():
        raise LookupError(f"no exporter for format {fmt!r} yet (have: {export_formats()})")
    cfg = get_recipe(recipe)
    cfg = adjust(cfg) if adjust else cfg
    ours = HybridLM(cfg).eval()
    save_pretrained(ours, f"{workdir}/{name}", format=fmt)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(f"{workdir}/{name}", dtype=dtype).eval()
    return ours.to(dtype), theirs


@torch.inference_mode()
def logit_gap(ours: HybridLM, theirs: torch.nn.Module, length: int = 64) -> float:
    ids = torch.randint(0, ours.config.vocab_size, (1, length))
    a, b = ours(ids).float(), theirs(ids, use_cache=False).logits.float()
    return float((a - b).abs().max() / b.abs().max())


def _check_takes_logits_to_keep(name: str, theirs: torch.nn.Module) -> None:
    if "logits_to_keep" not in inspect.signature(theirs.forward).parameters:
        raise LookupError(f"transformers' {type(theirs).__name__}.forward takes no logits_to_keep, so it cannot "
                          f"compute last-position logits only; compare {name} with --logits all")


@torch.inference_mode()
def bench(names: list[str], lengths: list[int], warmup: int, repeats: int, logits: str = "last",
          dtype: torch.dtype = torch.float32) -> list[dict]:
    if logits not in LOGITS:
        raise ValueError(f"logits must be one of {LOGITS}, got {logits!r}")
    keep = 1 if logits == "last" else 0
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        pairs = {}
        for name in names:
            try:
                pairs[name] = build_pair(name, workdir, dtype)
                _check_takes_logits_to_keep(name, pairs[name][1])
            except (LookupError, ValueError) as e:  # missing exporter, or it refuses the recipe
                pairs.pop(name, None)
                print(f"# skipping {name}: {e}")
        todo = [(n, L) for n in pairs for L in lengths]
        for name, L in tqdm(todo, desc="prefill", unit="run"):
            ours, theirs = pairs[name]
            ids = torch.randint(0, ours.config.vocab_size, (1, L))
            t = interleaved_seconds({"ours": lambda: ours(ids, logits_to_keep=keep),  # noqa: B023
                                      "hf": lambda: theirs(ids, use_cache=False,  # noqa: B023
                                                           logits_to_keep=keep).logits},
                                     warmup, repeats)
            t_ours, t_hf = statistics.median(t["ours"]), statistics.median(t["hf"])
            rows.append({"model": name, "params_M": round(ours.num_parameters() / 1e6, 1), "seq_len": L,
                         "dtype": str(dtype).removeprefix("torch."), "logits": logits,
                         "ours_tok_s": round(L / t_ours, 1),
                         "ours_ms_min_med_max": "/".join(f"{1e3 * v:.0f}" for v in
                                                         (min(t["ours"]), t_ours, max(t["ours"]))),
                         "transformers_tok_s": round(L / t_hf, 1),
                         "transformers_ms_min_med_max": "/".join(f"{1e3 * v:.0f}" for v in
                                                                 (min(t["hf"]), t_hf, max(t["hf"]))),
                         "ratio": round(t_hf / t_ours, 2), "logit_gap": f"{logit_gap(ours, theirs):.1e}"})
    return rows


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['model']}\n{r['seq_len']}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(rows)), 4))
    ax.bar([i - 0.2 for i in x], [r["ours_tok_s"] for r in rows], width=0.4, label="hybrid-lm")
    ax.bar([i + 0.2 for i in x], [r["transformers_tok_s"] for r in rows], width=0.4, label="transformers")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("prefill tokens/s")
    dtype = rows[0]["dtype"] if rows else "float32"
    ax.set_title(f"Prefill, same weights, {dtype}, {torch.get_num_threads()} threads")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(ENTRIES), choices=list(ENTRIES))
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--threads", type=int, default=0, help="torch threads for both (0: torch's default)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--logits", choices=list(LOGITS), default="last",
                   help="last: both compute the last position's logits only (logits_to_keep=1); all: every position's")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="both models' weights and activations (bf16: the same weights rounded once, on both sides)")
    p.add_argument("--plot", default=None, help="write a PNG bar chart here")
    add_json(p)
    args = p.parse_args(argv)
    host_memory.keep_freed_memory()  # this process is the benchmark's: reuse freed large blocks
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = bench(args.models, args.lengths, args.warmup, args.repeats, args.logits, getattr(torch, args.dtype))
    print(f"# prefill, batch 1, {args.dtype}, {args.logits}-position logits, {torch.get_num_threads()} threads, "
          f"the two sides interleaved, median of {args.repeats}; ratio = ours tokens/s / transformers tokens/s")
    print(format_table(rows))
    record(args.json, "interop", rows, threads=torch.get_num_threads(), dtype=args.dtype, logits=args.logits)
    if args.plot and rows:
        plot(rows, args.plot)
        print(f"# plot: {args.plot}")


if __name__ == "__main__":
    main()
