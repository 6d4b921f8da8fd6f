"""Training throughput of the distillation stages against a plain bf16-autocast training step of the teacher.

One process, one machine state: the bf16 and fp32 matmul peaks (``hybrid.eval.timing.matmul_peak``), then on
the same [batch, seq_len] token batches
- the baseline: the teacher with fp32 weights under ``torch.autocast(bfloat16)``, next-token cross-entropy,
  forward and backward through every weight;
- the alignment pass (``hybrid.distill.align.align_layers``: teacher forward, every replacement forward and
  backward), in bf16 weights with fp32 masters;
- the KL stage (``hybrid.distill.kl.distill_kl``, all attention layers replaced) likewise;
each as tokens/s and model GFLOP/s (2 FLOPs a multiply-add; a backward counted at its matmuls: input gradients
about the forward again, weight gradients 2 per trained weight and token), the median of the timed steps with
their min and max, and the median's share of the peak in its dtype. Every stage runs one untimed step first
(warm-up; the KL stage's compiles its fused loss there). Run under ``flock /tmp/bench.lock`` on a shared
machine.

    python -P benchmarks/distill_step.py smollm2-135m-instruct --steps 3 --threads 1 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch


def _batches(vocab: int, batch: int, seq_len: int):
    def batches(start: int = 0):
        i = start
        while True:
            yield torch.randint(0, vocab, (batch, seq_len), generator=torch.Generator().manual_seed(i))
            i += 1
    return batches


def baseline(teacher_dir: str, batches, steps: int) -> tuple[list[float], float]:
    """(seconds of each timed step, FLOPs per token) of fp32 weights under bf16 autocast, CE forward + backward
    and AdamW (one warm-up step first)."""
    from hybrid import from_pretrained

    model = from_pretrained(teacher_dir, dtype=torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    stream = iter(batches(0))
    seconds = []
    for i in range(steps + 1):
        ids = next(stream)
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model.loss(ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i:
            seconds.append(time.perf_counter() - t0)
    return seconds, 3 * model.flops_per_token(ids.shape[1])


def main() -> None:
    from hybrid.eval.timing import matmul_peak_flops, set_threads

    from hybrid import from_pretrained
    from hybrid.distill.align import align_flops_per_token, align_layers
    from hybrid.distill.init import attention_positions, new_mixer
    from hybrid.distill.kl import distill_kl, kl_flops_per_token
    from hybrid.distill.pipeline import default_dtype
    from hybrid.distill.student import build_student

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("teacher")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=3, help="timed steps per stage (after one untimed)")
    p.add_argument("--mixer", default="mamba2")
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: one per core this process may use)")
    p.add_argument("--json")
    a = p.parse_args()
    threads = set_threads(a.threads)
    peaks = {"bf16": matmul_peak_flops("cpu", torch.bfloat16), "fp32": matmul_peak_flops("cpu", torch.float32)}
    teacher32 = from_pretrained(a.teacher, dtype=torch.float32)
    batches = _batches(teacher32.config.vocab_size, a.batch, a.seq_len)
    tokens = a.batch * a.seq_len
    rows = {}
    secs, fpt = baseline(a.teacher, batches, a.steps)
    rows["baseline_autocast_bf16"] = (secs, fpt, "bf16")
    dtype = default_dtype()
    dname = "bf16" if dtype == torch.bfloat16 else "fp32"
    teacher = teacher32.to(dtype)
    cfg = teacher.config
    with tempfile.TemporaryDirectory() as tmp:
        # steps + 1 and the first one's time left out: the same warm-up as the baseline
        rec = align_layers(teacher, f"{tmp}/align", mixer=a.mixer, batches=batches, held_out=next(batches(10 ** 6)),
                           start=0, steps=a.steps + 1, progress=False, checkpoint_every=10 ** 9)
        reps = {n: new_mixer(cfg, a.mixer).state_dict() for n in range(len(attention_positions(cfg)))}
    rows["align"] = (rec["step_seconds"][1:], align_flops_per_token(teacher, a.mixer, a.seq_len), dname)
    student = build_student(teacher, reps, [], a.mixer)
    with tempfile.TemporaryDirectory() as tmp:
        krec, masters = distill_kl(student, teacher, f"{tmp}/kl.pt", batches=batches, start=0, steps=a.steps + 1,
                                   progress=False, checkpoint_every=10 ** 9)
    trained = sum(p.numel() for n, p in student.named_parameters() if n in masters and p.dim() == 2)
    rows["kl_all_replaced"] = ([h["seconds"] for h in krec["history"]][1:],
                               kl_flops_per_token(student, teacher, a.seq_len, trained), dname)
    # the peak probed again after the stages: on a shared core the larger reading is the nearer to the truth
    peaks = {k: max(v, matmul_peak_flops("cpu", torch.bfloat16 if k == "bf16" else torch.float32))
             for k, v in peaks.items()}
    out = {"threads": threads, "batch": a.batch, "seq_len": a.seq_len, "steps": a.steps,
           "peak_GFLOP/s": {k: round(v / 1e9, 1) for k, v in peaks.items()}, "rows": {}}
    print(f"{threads} thread(s), {a.batch} x {a.seq_len} tokens a step, {a.steps} timed steps; matmul peak "
          + ", ".join(f"{k} {v / 1e9:.0f} GFLOP/s" for k, v in peaks.items()))
    for name, (secs, fpt, dn) in rows.items():
        g = sorted(tokens * fpt / s / 1e9 for s in secs)  # GFLOP/s of each step
        med = statistics.median(g)
        out["rows"][name] = {"tokens_per_s": round(med * 1e9 / fpt, 1), "GFLOP/s": round(med, 1),
                             "GFLOP/s_min": round(g[0], 1), "GFLOP/s_max": round(g[-1], 1), "dtype": dn,
                             "of_peak": round(med * 1e9 / peaks[dn], 3)}
        print(f"{name:24s} {med * 1e9 / fpt:8.1f} tok/s {med:8.1f} GFLOP/s (min {g[0]:.1f}, max {g[-1]:.1f}) "
              f"{100 * med * 1e9 / peaks[dn]:5.1f}% of the {dn} peak")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
