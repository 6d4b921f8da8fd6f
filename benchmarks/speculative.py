"""Speculative decoding benchmark: decode tokens/s with and without speculation, acceptance, and the verify
step's cost split into target forward / draft forwards / rollback.

    python -m benchmarks.speculative --threads 2 --lock /tmp/bench.lock --output out/spec_bench

Pairs that agree for a reason: a ``hybrid-1to7`` target at a small width and a much smaller draft, both
trained here for a few minutes on the same synthetic copy task (a random segment, a separator, the segment
again: the second half is predictable from the first). Drafts: the small model, the target itself (every
draft accepted: the upper bound of what the drafts can buy), and n-gram lookup (the output repeats the
prompt). Batch 1 and 8, k = 2, 4, 8. Every configuration runs in this one process, ``--repeats`` times, with
the plain engine timed in between; the table gives decode tokens/s as median [min, max] and the speedup of the
medians, and per verify step: the target forward, the drafter, the rejection rule with output processing
(accept) and the rollback (Mamba state write-back + KV give-back, target and draft), "rollback %" of their
sum. Trained checkpoints are kept in ``--output`` and reused. ``--lock PATH`` holds an exclusive flock on PATH
while timing (not while training), the lock ``flock(1) PATH cmd`` takes.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from hybrid.config import AttentionConfig, HybridConfig, Mamba2Config, MLPConfig
from hybrid.engine import Engine
from hybrid.engine.config import EngineConfig
from hybrid.model import HybridLM
from hybrid.pretrained import from_pretrained, save_pretrained
from hybrid.report import format_table
from hybrid.sampling import SamplingParams
from hybrid.speculative import SpeculativeConfig

from .common import add_lock, add_threads, timing_lock

VOCAB, SEP = 64, 1  # tokens 2..63 are content, 1 separates the segment from its copy
TARGET = HybridConfig(vocab_size=VOCAB, d_model=128, pattern="M-M-M-M-M-M-M-*-",
                      attention=AttentionConfig(n_heads=4, n_kv_heads=2),
                      mamba2=Mamba2Config(head_dim=32, chunk_size=16), mlp=MLPConfig(d_ff=256))
DRAFT = HybridConfig(vocab_size=VOCAB, d_model=32, pattern="M*-", attention=AttentionConfig(n_heads=2, n_kv_heads=1),
                     mamba2=Mamba2Config(head_dim=16, d_state=8, chunk_size=16), mlp=MLPConfig(d_ff=64))


def copy_batch(batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """[batch, 2 * length + 1]: a random segment, the separator, the segment again."""
    seg = torch.randint(2, VOCAB, (batch, length), generator=generator)
    return torch.cat([seg, torch.full((batch, 1), SEP), seg], 1)


def train_copy(cfg: HybridConfig, *, steps: int, length: int, seed: int, desc: str) -> HybridLM:
    """AdamW on the copy task; the loss counts only the copied half (the first half is noise)."""
    torch.manual_seed(seed)
    model = HybridLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    g = torch.Generator().manual_seed(seed)
    bar = tqdm(range(steps), desc=f"train {desc}")
    for step in bar:
        for group in opt.param_groups:  # warmup then cosine
            group["lr"] = 3e-3 * min(1.0, (step + 1) / 30) * 0.5 * (1 + math.cos(math.pi * step / steps))
        x = copy_batch(16, length, g)
        labels = x.clone()
        labels[:, :length + 1] = -100
        loss = model.loss(x, labels)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
    return model.eval()


def copy_accuracy(model: HybridLM, length: int) -> float:
    x = copy_batch(64, length, torch.Generator().manual_seed(123))
    with torch.no_grad():
        pred = model(x)[:, length:-1].argmax(-1)
    return float((pred == x[:, length + 1:]).float().mean())


def load_or_train(path: Path, cfg, *, steps, length, seed, desc) -> HybridLM:
    if (path / "config.json").exists():
        return from_pretrained(str(path)).eval()
    model = train_copy(cfg, steps=steps, length=length, seed=seed, desc=desc)
    save_pretrained(model, str(path))
    return model


def run_once(target, spec, prompts, new_tokens):
    engine = Engine(target, EngineConfig(num_blocks=64 * len(prompts), block_size=16, max_seqs=len(prompts),
                                         max_batch_tokens=1024, speculative=spec))
    for p in prompts:
        engine.add_request(p, SamplingParams(max_new_tokens=new_tokens))
    engine.run()
    outs = [r.output for r in engine.requests.values()]
    return engine.stats, outs


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_threads(ap, 2)
    ap.add_argument("--length", type=int, default=16, help="copy segment length (prompt = segment + separator)")
    ap.add_argument("--target-steps", type=int, default=250)
    ap.add_argument("--draft-steps", type=int, default=250)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--ks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output", default="out/spec_bench")
    add_lock(ap)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    target = load_or_train(out / "target", TARGET, steps=args.target_steps, length=args.length, seed=0, desc="target")
    draft = load_or_train(out / "draft", DRAFT, steps=args.draft_steps, length=args.length, seed=1, desc="draft")
    acc_t, acc_d = copy_accuracy(target, args.length), copy_accuracy(draft, args.length)
    print(f"target {target.num_parameters():,} params, copy accuracy {acc_t:.3f}; "
          f"draft {draft.num_parameters():,} params, copy accuracy {acc_d:.3f}")
    with timing_lock(args.lock):
        paths = verify_path_rows(target, args.ks, args.batches)
        print(format_table(paths), flush=True)
        rows, raw = measure(args, target, draft)
    table = format_table(rows)
    print(table)
    (out / "spec_bench.md").write_text(table + "\n\n" + format_table(paths) + "\n")
    (out / "spec_bench.json").write_text(json.dumps({"threads": args.threads, "length": args.length,
                                                     "target_copy_accuracy": acc_t, "draft_copy_accuracy": acc_d,
                                                     "rows": raw, "verify_paths": paths,
                                                     "time": time.ctime()}, indent=1))


def verify_path_rows(target, ks, batches, reps: int = 30) -> list[dict]:
    """One Mamba-2 layer's verify chunk: the closed form against k+1 step-op calls (median ms of ``reps``)."""
    from hybrid.cache.views import StateCacheView, StateRows
    from hybrid.speculative.verify_states import VerifyStates

    layer = next(b.mixer for b in target.layers if b.kind == "mamba2")
    m, rows = layer.cfg, []
    for batch in batches:
        for k in ks:
            lengths = [k + 1] * batch
            conv = torch.randn(batch + 1, m.conv_dim, m.d_conv - 1)
            ssm = torch.randn(batch + 1, layer.n_heads, layer.head_dim, layer.d_state)
            slots = torch.arange(batch)
            state = StateCacheView(("conv", "ssm"), (StateRows(conv), StateRows(ssm)))
            xBC, dt = torch.randn(sum(lengths), m.conv_dim), torch.randn(sum(lengths), layer.n_heads)
            times = {}
            for name in ("closed form", "step ops"):
                ts = []
                for _ in range(reps):
                    vs = VerifyStates(lengths, slots, "cpu")
                    t0 = time.perf_counter()
                    with torch.inference_mode():
                        if name == "closed form":
                            vs.run_chunk(state, (xBC, dt), layer.verify_chunk)
                        else:
                            vs.run(state, (xBC, dt), layer.step)
                    ts.append(time.perf_counter() - t0)
                times[name] = statistics.median(ts) * 1e3
            rows.append({"batch": batch, "k": k, "closed form ms": round(times["closed form"], 3),
                         "step ops ms": round(times["step ops"], 3)})
    return rows


def measure(args, target, draft):
    g = torch.Generator().manual_seed(7)
    rows, raw = [], []
    for batch in args.batches:
        prompts = [copy_batch(1, args.length, g)[0, :args.length + 1].tolist() for _ in range(batch)]
        configs = [(f"draft k={k}", SpeculativeConfig(method="draft", draft_model=draft, num_tokens=k))
                   for k in args.ks]
        configs += [(f"self k={k}", SpeculativeConfig(method="draft", draft_model=target, num_tokens=k))
                    for k in args.ks]
        configs += [(f"ngram k={k}", SpeculativeConfig(method="ngram", num_tokens=k)) for k in args.ks]
        run_once(target, None, prompts, 4)  # warm-up
        base_stats, base_out = run_once(target, None, prompts, args.length)
        for name, spec in tqdm(configs, desc=f"batch {batch}"):
            base, fast, stats = [], [], None
            for _ in range(args.repeats):  # plain and speculative alternate, so drifting load hits both alike
                s0, _ = run_once(target, None, prompts, args.length)
                base.append(s0.decode_tokens / s0.decode_seconds)
                stats, outs = run_once(target, spec, prompts, args.length)
                assert outs == base_out, f"{name}: speculative greedy output differs from plain"
                fast.append(stats.decode_tokens / stats.decode_seconds)
            v = max(stats.verify_steps, 1)
            row = {
                "batch": batch, "draft": name,
                "plain tok/s": _mmm(base), "spec tok/s": _mmm(fast),
                "speedup": round(statistics.median(fast) / statistics.median(base), 2),
                "accept": round(stats.acceptance_rate, 3),
                "acc/verify": round(stats.mean_accepted_length, 2),
                "target fwd ms/step": round(1e3 * stats.verify_forward_seconds / v, 2),
                "draft ms/step": round(1e3 * stats.draft_seconds / v, 2),
                "accept ms/step": round(1e3 * stats.accept_seconds / v, 2),
                "rollback ms/step": round(1e3 * stats.rollback_seconds / v, 2),
                "rollback %": round(100 * stats.rollback_seconds / max(1e-9, stats.verify_forward_seconds
                                                                       + stats.draft_seconds + stats.accept_seconds
                                                                       + stats.rollback_seconds), 1),
                "state scratch KiB": round(stats.verify_state_bytes / 1024, 1),
            }
            rows.append(row)
            raw.append({**row, "plain_runs": base, "spec_runs": fast})
            tqdm.write(format_table([row]))
    return rows, raw


def _mmm(xs: list[float]) -> str:
    return f"{statistics.median(xs):.1f} [{min(xs):.1f}, {max(xs):.1f}]"


if __name__ == "__main__":
    main()
