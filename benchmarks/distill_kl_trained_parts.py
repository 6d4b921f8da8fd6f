"""Which parts the KL stage should train: the replacements alone, or the kept attention layers too.

From one finished alignment (``OUT/align/<mixer>``), for each share the same student is trained twice on the
same batches (``--steps`` KL steps of ``--batch`` x ``--seq-len`` tokens of the ``--data`` files, windows taken
in order from batch 1 on), once with the kept attention layers trained and once frozen at the teacher's
weights, and its mean KL(teacher || student) is measured before and after on ``--held-out`` batches far from
the trained ones (windows ``--held-out-at`` on). Run under ``flock /tmp/bench.lock`` on a shared machine.

    python -P benchmarks/distill_kl_trained_parts.py smollm2-135m-instruct --align OUT/align/mamba2 \\
        --data README.md docs/*.md --share 0.5 0.75 --steps 4
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch


def main() -> None:
    from hybrid import from_pretrained
    from hybrid.cli.distill import _file_batches
    from hybrid.distill.align import choose_attention_layers, load_replacements
    from hybrid.distill.kl import distill_kl, kl_divergence
    from hybrid.distill.pipeline import default_dtype
    from hybrid.distill.student import build_student
    from hybrid.pretrained_names import resolve

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("teacher")
    p.add_argument("--align", required=True, help="a finished alignment folder (OUT/align/<mixer>)")
    p.add_argument("--mixer", default="mamba2")
    p.add_argument("--data", nargs="+", required=True)
    p.add_argument("--share", type=float, nargs="+", default=[0.5, 0.75])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--held-out", type=int, default=2, help="held-out batches")
    p.add_argument("--held-out-at", type=int, default=50, help="batch number of the first held-out batch")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    teacher_dir = str(resolve(a.teacher))
    dtype = default_dtype()
    teacher = from_pretrained(teacher_dir, dtype=torch.float32).to(dtype).eval()
    teacher.requires_grad_(False)
    batches, _ = _file_batches(teacher_dir, a.data, a.seq_len, a.batch)
    held = [b for b, _ in zip(batches(a.held_out_at), range(a.held_out), strict=False)]
    losses = json.loads(open(f"{a.align}/losses.json").read())["losses"]
    reps = load_replacements(teacher.config, a.align, a.mixer)

    def held_kl(student) -> float:
        return sum(kl_divergence(student, teacher, b) for b in held) / len(held)

    out = {"dtype": str(dtype), "steps": a.steps, "tokens": a.steps * a.batch * a.seq_len, "rows": []}
    for share in a.share:
        kept = choose_attention_layers(losses, share, "worst")
        before = None
        for train_attention in (True, False):
            student = build_student(teacher, reps, kept, a.mixer)
            before = before if before is not None else held_kl(student)
            t0 = time.perf_counter()
            with tempfile.TemporaryDirectory() as tmp:
                rec, _ = distill_kl(student, teacher, f"{tmp}/kl.pt", batches=batches, start=1, steps=a.steps,
                                    lr=a.lr, train_attention=train_attention, progress=True,
                                    checkpoint_every=10 ** 9)
            row = {"share": share, "kept": len(kept), "train_attention": train_attention,
                   "held_out_kl_before": round(before, 4), "held_out_kl_after": round(held_kl(student), 4),
                   "train_kl": [round(h["loss"], 4) for h in rec["history"]],
                   "seconds": round(time.perf_counter() - t0, 1)}
            out["rows"].append(row)
            print(json.dumps(row), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
