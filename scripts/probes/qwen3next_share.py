"""Where the prefill time of the Qwen3-Next layout goes, ours and transformers' on the same weights (issue 27's
">= 2x transformers" goal): each side's forward timed by module kind (Gated DeltaNet mixer, attention, MLP / MoE,
the rest: embedding, norms, LM head), and the ratio ours / transformers could reach if our Gated DeltaNet layers
cost nothing (the bound the rest of the model sets).

    flock /tmp/bench.lock .venv/bin/python -m scripts.probes.qwen3next_share --length 2048 --repeats 2

Times are wall time inside each module's forward (forward pre- and post-hooks), summed per kind, median over the
repeats after one warm-up forward."""

from __future__ import annotations

import argparse
import collections
import statistics
import tempfile
import time

import torch

from benchmarks.interop import build_pair

KINDS = {"GatedDeltaNet": "gdn", "Qwen3NextGatedDeltaNet": "gdn", "Attention": "attention",
         "Qwen3NextAttention": "attention", "MLP": "mlp/moe", "MoE": "mlp/moe", "Qwen3NextMLP": "mlp/moe",
         "Qwen3NextSparseMoeBlock": "mlp/moe"}


def timed_kinds(model: torch.nn.Module) -> tuple[dict, list]:
    """Hooks that sum the seconds spent in each KINDS module (outermost only: a kind inside another is not
    counted twice) into the returned dict, and in the linear layers inside a Gated DeltaNet mixer under
    "gdn projections" (part of "gdn")."""
    acc: dict = collections.defaultdict(float)
    depth = [0]
    handles = []
    gdn_linears = {id(m) for parent in model.modules() if KINDS.get(type(parent).__name__) == "gdn"
                   for m in parent.modules() if isinstance(m, torch.nn.Linear)}
    for module in model.modules():
        kind = KINDS.get(type(module).__name__)
        if id(module) in gdn_linears:
            def pre_lin(m, _a):
                acc[("t0", id(m))] = time.perf_counter()

            def post_lin(m, _a, _o):
                acc["gdn projections"] += time.perf_counter() - acc[("t0", id(m))]

            handles += [module.register_forward_pre_hook(pre_lin), module.register_forward_hook(post_lin)]
        if kind is None:
            continue

        def pre(_m, _a, kind=kind):
            depth[0] += 1
            if depth[0] == 1:
                acc[("t0", kind)] = time.perf_counter()

        def post(_m, _a, _o, kind=kind):
            if depth[0] == 1:
                acc[kind] += time.perf_counter() - acc[("t0", kind)]
            depth[0] -= 1

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    return acc, handles


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as workdir:
        ours, theirs = build_pair("qwen3_next", workdir, getattr(torch, args.dtype))
    ids = torch.randint(0, ours.config.vocab_size, (1, args.length))
    runs = {"ours": lambda: ours(ids, logits_to_keep=1),
            "transformers": lambda: theirs(ids, use_cache=False, logits_to_keep=1).logits}
    split = {}
    for name, model in (("ours", ours), ("transformers", theirs)):
        acc, handles = timed_kinds(model)
        per = collections.defaultdict(list)
        for r in range(args.repeats + 1):
            for k in [k for k in acc if not isinstance(k, tuple)]:
                acc[k] = 0.0
            t0 = time.perf_counter()
            runs[name]()
            total = time.perf_counter() - t0
            if r:
                kinds = {k: v for k, v in acc.items() if not isinstance(k, tuple)}
                for k, v in kinds.items():
                    per[k].append(v)
                per["rest"].append(total - sum(v for k, v in kinds.items() if k != "gdn projections"))
                per["total"].append(total)
        for h in handles:
            h.remove()
        split[name] = {k: statistics.median(v) for k, v in per.items()}
    print(f"## Qwen3-Next layout (qwen3next-like-small), {args.length} tokens, {args.dtype}, {args.threads} threads: "
          f"seconds per forward by module kind (median of {args.repeats})")
    kinds = ["gdn", "gdn projections", "attention", "mlp/moe", "rest", "total"]
    print("| kind | ours s | transformers s | ours share | transformers share |\n|---|---|---|---|---|")
    for k in kinds:
        o, t = split["ours"].get(k, 0.0), split["transformers"].get(k, 0.0)
        print(f"| {k} | {o:.3f} | {t:.3f} | {o / split['ours']['total']:.0%} | "
              f"{t / split['transformers']['total']:.0%} |")
    o, t = split["ours"], split["transformers"]
    print(f"ratio ours / transformers (speed): {t['total'] / o['total']:.2f}; with our GDN layers free: "
          f"{t['total'] / (o['total'] - o['gdn']):.2f}; with transformers' GDN layers free too (the rest alone): "
          f"{(t['total'] - t['gdn']) / (o['total'] - o['gdn']):.2f}; with both sides' GDN recurrence and conv "
          f"free (only the GDN projections left of the mixers): "
          f"{(t['total'] - t['gdn'] + t['gdn projections']) / (o['total'] - o['gdn'] + o['gdn projections']):.2f}; "
          f"with ours free and transformers' as it is: "
          f"{t['total'] / (o['total'] - o['gdn'] + o['gdn projections']):.2f}")


if __name__ == "__main__":
    main()
