"""Whether the alignment should clip each replacement's gradient alone or one norm over all of them.

Two alignment runs of ``--steps`` steps from the same start (the attention-weight mapping, calibrated on the
first batch), on the same ``--data`` batches: one gradient-norm clip over all replacements, then a clip per
replacement; each layer's normalised MSE on a held-out batch far from the trained ones (batch ``--held-out-at``)
after each, and their mean. Run under ``flock /tmp/bench.lock`` on a shared machine.

    python -P benchmarks/distill_align_clip.py smollm2-135m-instruct --data README.md docs/*.md --steps 6
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch


def main() -> None:
    from hybrid import from_pretrained
    from hybrid.cli.distill import _file_batches
    from hybrid.distill.align import align_layers
    from hybrid.distill.pipeline import default_dtype
    from hybrid.pretrained_names import resolve

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("teacher")
    p.add_argument("--data", nargs="+", required=True)
    p.add_argument("--mixer", default="mamba2")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--held-out-at", type=int, default=50)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    teacher_dir = str(resolve(a.teacher))
    teacher = from_pretrained(teacher_dir, dtype=torch.float32).to(default_dtype()).eval()
    batches, _ = _file_batches(teacher_dir, a.data, a.seq_len, a.batch)
    held = next(batches(a.held_out_at))
    out = {"steps": a.steps, "tokens": a.steps * a.batch * a.seq_len, "rows": {}}
    for per_layer in (False, True):
        with tempfile.TemporaryDirectory() as tmp:
            r = align_layers(teacher, f"{tmp}/align", mixer=a.mixer, batches=batches, held_out=held, start=1,
                             steps=a.steps, lr=a.lr, progress=True, checkpoint_every=10 ** 9,
                             per_layer_clip=per_layer)
        name = "per_layer_clip" if per_layer else "global_clip"
        out["rows"][name] = {"mean_held_out": round(sum(r["losses"]) / len(r["losses"]), 4),
                             "mean_initial": round(sum(r["initial_losses"]) / len(r["initial_losses"]), 4),
                             "held_out": [round(x, 4) for x in r["losses"]],
                             "train": [round(x, 4) for x in r["loss_history"]]}
        print(name, json.dumps(out["rows"][name]), flush=True)
    g, q = (out["rows"][k]["held_out"] for k in ("global_clip", "per_layer_clip"))
    out["layers_better_per_layer"] = sum(b < a_ for a_, b in zip(g, q, strict=True))
    print(f"per-layer clip lower on {out['layers_better_per_layer']} of {len(g)} layers")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
