"""Does StreamingLLM's position re-numbering matter? A model trained in a short context, run 4x past it.

Setup (cheap, and a model that has learned something): the MQAR family's all-attention member
(``mqar.build_model("tiny", 1.0, 4)``: 4 GQA attention mixers with RoPE, d_model 64, residual outputs zeroed)
trained with ``mqar.train`` (plain MQAR, its pair curriculum over ``pairs``) for ``TrainSetup.steps`` steps,
so on sequences of at most ``context = 4 * max(pairs)`` tokens. Then sequences of ``factor * context`` tokens
made of MQAR *segments* (:func:`segment_batch`: each segment its own key-value pairs and then its queries,
keys distinct over the sequence), so every lookup is local, inside any window that covers a segment, run
through the engine's cache path (:func:`.pruning_recall.pruned_logits`: a short prompt
prefilled, every further token one decode step, StreamingLLM trims after each) with

- the full cache (every key visible, distances up to the whole length: past what training saw),
- StreamingLLM(sinks, window) with ``renumber=True`` (the paper: distances to the sinks at most
  ``sinks + window - 1``, inside the trained context),
- the same with ``renumber=False`` (the sinks at their real distances, up to the whole length),
- window only (``sinks=0``, the same budget: the paper's "window attention" baseline).

Reported per cache: MQAR accuracy and mean NLL of the queried values inside the trained context
(positions ``< context``) and past it, and top-1 agreement with the full cache there. ``python -m
hybrid.eval.streaming_positions --threads 2`` (wrap it in ``flock /tmp/bench.lock`` on a shared machine).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

import torch

from ..kv_pruning import StreamingLLM
from . import mqar
from .pruning_recall import pruned_logits


@dataclass(frozen=True)
class TrainSetup:
    context: int = 32  # the trained sequence length: MQAR of up to 8 pairs
    pairs: tuple[int, ...] = (2, 4, 8)  # the pair curriculum of training
    eval_pairs: int = 4  # pairs of an evaluated segment (16 tokens: inside the window)
    steps: int = 300
    factor: int = 4  # evaluated sequences are factor * context tokens long
    sinks: int = 4
    window: int = 24  # covers a segment; sinks + window - 1 = 27 < context
    sequences: int = 128
    prompt: int = 8  # tokens prefilled before the decode steps


def segment_batch(n: int, length: int, pairs: int, vocab: int, *, generator: torch.Generator) -> mqar.MQARBatch:
    """``n`` sequences of ``length`` tokens (a multiple of ``4 * pairs``): MQAR segments of ``pairs`` key-value
    pairs each followed by its queries (each of its keys once, in random order); keys are distinct across the
    whole sequence, so a lookup has one answer, in its own segment. Labels on the queried values."""
    per = 4 * pairs
    segs = length // per
    if length % per:
        raise ValueError(f"segment_batch: length {length} is not a multiple of a segment's {per} tokens")
    base = mqar.make_batch(n, pairs * segs, vocab, generator=generator)  # distinct keys, their values
    kv = base.inputs[:, :2 * pairs * segs].view(n, segs, pairs, 2)
    order = torch.rand(n, segs, pairs, generator=generator).argsort(-1)
    queries = kv.gather(2, order[..., None].expand(-1, -1, -1, 2))
    inputs = torch.cat([kv.reshape(n, segs, 2 * pairs), queries.reshape(n, segs, 2 * pairs)], -1).reshape(n, -1)
    labels = torch.full_like(inputs, mqar.IGNORE).view(n, segs, per)
    labels[:, :, 2 * pairs + 1::2] = queries[..., 1]
    return mqar.MQARBatch(inputs, labels.reshape(n, -1), pairs)


def train_model(setup: TrainSetup, progress: bool = True):
    """Plain MQAR (``mqar.train``'s batches and curriculum) on sequences of at most ``context`` tokens."""
    cfg = mqar.TrainConfig(steps=setup.steps, seed=0, train_kv_pairs=setup.pairs)
    if 4 * max(setup.pairs) != setup.context:
        raise ValueError(f"the trained context is 4 * the largest pair count, {4 * max(setup.pairs)}")
    torch.manual_seed(cfg.seed)
    model = mqar.build_model("tiny", 1.0, 4, cfg)
    losses = mqar.train(model, cfg, desc="train MQAR", progress=progress)
    return model.float().eval(), losses


def score(logits: torch.Tensor, labels: torch.Tensor, full: torch.Tensor, mask: torch.Tensor) -> dict:
    """``logits``/``full`` [B, n, V] predicting ``labels [B, n]``; the positions where ``mask`` is set."""
    keep = mask & (labels != mqar.IGNORE)  # the queried values
    nll = torch.nn.functional.cross_entropy(logits[keep], labels[keep])
    return {"acc_%": round(100 * float((logits.argmax(-1)[keep] == labels[keep]).float().mean()), 2),
            "nll": round(float(nll), 4),
            "agree_full_%": round(100 * float((logits.argmax(-1)[keep] == full.argmax(-1)[keep]).float().mean()), 2)}


def run(setup: TrainSetup, progress: bool = True) -> dict:
    t0 = time.perf_counter()
    model, losses = train_model(setup, progress)
    train_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(1234)
    L = setup.factor * setup.context
    batch = segment_batch(setup.sequences, L, setup.eval_pairs, mqar.TrainConfig().vocab_size, generator=g)
    labels = batch.labels[:, setup.prompt:]  # the logits after tokens prompt-1 .. L-2 predict these
    pos = torch.arange(setup.prompt, L).expand_as(labels)
    inside, past = pos < setup.context, pos >= setup.context
    full, _, _ = pruned_logits(model, batch.inputs, setup.prompt, None)
    caches = {"full cache": None,
              f"StreamingLLM sinks={setup.sinks} window={setup.window} renumber=1":
                  StreamingLLM(setup.sinks, setup.window, renumber=True),
              f"StreamingLLM sinks={setup.sinks} window={setup.window} renumber=0":
                  StreamingLLM(setup.sinks, setup.window, renumber=False),
              f"window only (sinks=0, window={setup.window + setup.sinks})":
                  StreamingLLM(0, setup.window + setup.sinks)}
    rows = []
    for name, policy in caches.items():
        out = full if policy is None else pruned_logits(model, batch.inputs, setup.prompt, policy)[0]
        rows.append({"cache": name, **{f"inside {k}": v for k, v in score(out, labels, full, inside).items()},
                     **{f"past {k}": v for k, v in score(out, labels, full, past).items()}})
    return {"setup": setup.__dict__, "train_seconds": round(train_s, 1), "final_train_loss": round(losses[-1], 4),
            "rows": rows}


def markdown(result: dict) -> str:
    cols = list(result["rows"][0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in result["rows"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=TrainSetup.steps)
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = run(TrainSetup(steps=args.steps))
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
    print(markdown(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
