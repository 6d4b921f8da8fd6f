"""MQAR probes of one family member outside ``hybrid tradeoff``'s defaults: a longer budget, another lr or lr scale,
or a Gated DeltaNet with more value heads (its state matched to Mamba-2's at the ``tiny`` width). One JSON line per
(member, seed) is appended to ``--jsonl``; nothing is timed, so it may run beside other work.

    python -m benchmarks.mqar_probe --mixer gdn --share 0 --steps 1200 --seeds 0 1
    python -m benchmarks.mqar_probe --mixer gdn --share 0 --gdn-heads 8 --seeds 0 1   # 8 x 16 x 16 = Mamba-2's

Each line: the pattern, the settings, parameter count, mean loss of the last 10 steps, held-out accuracy at each
scored pair count (the tradeoff's ``mqar.evaluate``), and the wall time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch
from hybrid.eval import mqar
from hybrid.recipes import FAMILY_MIXERS
from tqdm import tqdm

from benchmarks.common import add_threads
from hybrid.model import HybridLM


def probe_config(mixer: str, share: float, n_mixers: int, cfg: mqar.TrainConfig, gdn_heads: int | None):
    """The member's accuracy config; ``gdn_heads``: that many Gated DeltaNet value heads (half as many key heads)."""
    mc = mqar.family_config("tiny", share, n_mixers, cfg.vocab_size, cfg.init_std, mixer)
    if gdn_heads:
        if gdn_heads % 2:
            raise SystemExit(f"--gdn-heads must be even (key heads are half the value heads), got {gdn_heads}")
        mc = dataclasses.replace(mc, gated_deltanet=dataclasses.replace(
            mc.gated_deltanet, n_heads=gdn_heads, n_k_heads=gdn_heads // 2))
    return mc


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mixer", default="mamba2", choices=sorted(FAMILY_MIXERS), help="constant-state mixer")
    ap.add_argument("--share", type=float, default=0.0, help="attention share of the mixers")
    ap.add_argument("--n-mixers", type=int, default=4, help="mixers in the member")
    ap.add_argument("--steps", type=int, default=mqar.TrainConfig.steps, help="training steps")
    ap.add_argument("--lr", type=float, default=mqar.TrainConfig.lr, help="peak learning rate")
    ap.add_argument("--mamba-lr-scale", type=float, default=mqar.TrainConfig.mamba_lr_scale,
                    help="Mamba mixers' lr relative to --lr beside attention")
    ap.add_argument("--state-lr-scale", type=float, default=mqar.TrainConfig.state_lr_scale,
                    help="other constant-state mixers' lr relative to --lr beside attention")
    ap.add_argument("--gdn-heads", type=int, default=None, help="Gated DeltaNet value heads (tiny recipe: 4)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="training seeds")
    ap.add_argument("--jsonl", default="out/mqar_probe.jsonl", help="file the result lines are appended to")
    add_threads(ap, 2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.jsonl)
    out.parent.mkdir(parents=True, exist_ok=True)
    for seed in tqdm(args.seeds, desc="seeds", unit="model"):
        cfg = mqar.TrainConfig(steps=args.steps, lr=args.lr, mamba_lr_scale=args.mamba_lr_scale,
                               state_lr_scale=args.state_lr_scale, seed=seed)
        torch.manual_seed(seed)
        mc = probe_config(args.mixer, args.share, args.n_mixers, cfg, args.gdn_heads)
        model = mqar.zero_residual_outputs(HybridLM(mc))
        start = time.perf_counter()
        losses = mqar.train(model, cfg, desc=f"{mc.pattern} seed {seed}")
        acc = mqar.evaluate(model, cfg)
        line = {"mixer": args.mixer, "pattern": mc.pattern, "share": args.share, "steps": args.steps, "lr": args.lr,
                "mamba_lr_scale": args.mamba_lr_scale, "state_lr_scale": args.state_lr_scale,
                "gdn_heads": args.gdn_heads, "seed": seed, "params": sum(p.numel() for p in model.parameters()),
                "final_loss": round(sum(losses[-10:]) / len(losses[-10:]), 3),
                "acc": {str(k): round(v, 3) for k, v in acc.items()},
                "wall_s": round(time.perf_counter() - start, 1)}
        print(json.dumps(line), flush=True)
        with out.open("a") as f:
            f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
