"""Does StreamingLLM's position re-numbering matter? A model trained in a short context, run 4x past it.

Setup (cheap, and a model that has learned something positional): the MQAR family's all-attention member
(``mqar.build_model("tiny", 1.0, 4)``: 4 GQA attention mixers with RoPE, d_model 64, residual outputs zeroed)
trained with ``mqar.train`` for ``TrainSetup.steps`` steps on *periodic sequences* of ``context`` tokens: a
random pattern of P distinct tokens (P drawn from ``periods``) repeated; every token after the first period is
predictable from the one P back. Then sequences of ``factor * context`` tokens run through the engine's cache
path (:func:`.pruning_recall.pruned_logits`: a short prompt prefilled, every further token one decode step,
StreamingLLM trims after each) with

- the full cache (every key visible, distances up to the whole length: past what training saw),
- StreamingLLM(sinks, window) with ``renumber=True`` (the paper: distances to the sinks at most
  ``sinks + window - 1``, inside the trained context),
- the same with ``renumber=False`` (the sinks at their real distances, up to the whole length),
- window only (``sinks=0``: the paper's "window attention" baseline).

Reported per cache: next-token accuracy and mean NLL on the predictable tokens past the trained context
(positions ``>= context``) and inside it, and top-1 agreement with the full cache. ``python -m
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
    context: int = 64  # the trained sequence length
    periods: tuple[int, int] = (2, 24)  # pattern lengths drawn from this range (inclusive)
    steps: int = 300
    factor: int = 4  # evaluated sequences are factor * context tokens long
    sinks: int = 4
    window: int = 28  # sinks + window = 32: half the trained context
    sequences: int = 64
    prompt: int = 8  # tokens prefilled before the decode steps


def periodic_batch(n: int, length: int, periods: tuple[int, int], vocab: int, *, generator: torch.Generator):
    """``n`` sequences of ``length`` tokens, each a pattern of P distinct tokens (P in ``periods``) repeated;
    labels are the tokens that the one P back predicts (the first period is IGNORE)."""
    inputs = torch.empty(n, length, dtype=torch.long)
    labels = torch.full((n, length), mqar.IGNORE, dtype=torch.long)
    for i in range(n):
        p = int(torch.randint(periods[0], periods[1] + 1, (1,), generator=generator))
        pattern = torch.randperm(vocab - 1, generator=generator)[:p] + 1
        inputs[i] = pattern.repeat(-(-length // p))[:length]
        labels[i, p:] = inputs[i, p:]
    return mqar.MQARBatch(inputs, labels, 0)


def train_model(setup: TrainSetup, progress: bool = True):
    cfg = mqar.TrainConfig(steps=setup.steps, seed=0, curriculum=0.0)
    torch.manual_seed(cfg.seed)
    model = mqar.build_model("tiny", 1.0, 4, cfg)

    def draw(_pairs: int, g: torch.Generator) -> mqar.MQARBatch:
        return periodic_batch(cfg.tokens_per_step // setup.context, setup.context, setup.periods, cfg.vocab_size,
                              generator=g)

    losses = mqar.train(model, cfg, desc="train periodic", progress=progress, batch_fn=draw)
    return model.float().eval(), losses


def score(logits: torch.Tensor, labels: torch.Tensor, full: torch.Tensor, mask: torch.Tensor) -> dict:
    """``logits``/``full`` [B, n, V] predicting ``labels [B, n]``; the positions where ``mask`` is set."""
    keep = mask & (labels != mqar.IGNORE)
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
    batch = periodic_batch(setup.sequences, L, setup.periods, mqar.TrainConfig().vocab_size, generator=g)
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
