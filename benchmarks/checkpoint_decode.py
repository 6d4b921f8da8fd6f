"""Batch-1 (or batch-B) decode speed of a real checkpoint folder through the engine, per quantisation scheme:
what ``benchmarks/decode.py`` measures for the seed-0 recipes, on the weights users run.

    python -m benchmarks.checkpoint_decode smollm2-135m-instruct \\
        --schemes none int8dq int8wo int4wo 8da4w --dtype float32 --threads 2

Each scheme loads the folder afresh, quantises it (``hybrid.quantize``), holds ``--batch`` sequences at
``--context`` tokens and times ``--steps`` decode steps after ``--warmup`` (min / median / max ms, tok/s at the
median), with the bytes a step reads of its weights (``decode_bytes``: codes and scales where quantised, the LM
head included) and how much of the step is the native program (``native``: the whole step runs as one).
"""

from __future__ import annotations

import argparse
import json

import torch
from hybrid.eval.decode_timing import decode_engine, decode_speed
from tqdm import tqdm

import hybrid
from hybrid.decode import program as decode_program
from hybrid.quantize import METHODS, decode_bytes


def weight_bytes(model) -> int:
    """Bytes of weights a decode step reads (the decode program's own count: every linear layer, the tied head)."""
    return decode_program._decode_weight_bytes(model)


def run_scheme(folder: str, scheme: str, dtype: torch.dtype, batch: int, context: int, steps: int,
               warmup: int, *, tied_head: bool = False) -> dict:
    """One row. ``tied_head``: after quantising, the tied model's head is the embedding's matrix in the model's
    dtype again (what ``hybrid.quantize`` did before it quantised a tied head): the A/B's other side."""
    model = hybrid.from_pretrained(folder, dtype=dtype).eval()
    if scheme != "none":
        hybrid.quantize(model, scheme)
        if tied_head and model.config.tie_embeddings:
            model.lm_head = None
    with torch.inference_mode():
        engine = decode_engine(model, batch, context, steps=steps, compile=False, warmup=warmup)
        row, split = decode_speed(engine, steps)
        whole = engine.runner.decode_backend(batch).name == "native_program"
    head = model.lm_head.weight if model.lm_head is not None else model.embed.weight
    return {"scheme": scheme + ("+fp head" if tied_head else ""), "dtype": str(dtype).removeprefix("torch."),
            **row, "weight_MB": round(weight_bytes(model) / 1e6, 1), "head_MB": round(decode_bytes(head) / 1e6, 1),
            "native_whole_step": whole}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.checkpoint_decode", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", help="a checkpoint folder hybrid.from_pretrained loads")
    ap.add_argument("--schemes", nargs="+", default=["none", *METHODS], choices=["none", *METHODS])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=16, help="tokens each sequence holds when the timing starts")
    ap.add_argument("--steps", type=int, default=64, help="timed decode steps")
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--ab", action="store_true",
                    help="also time each quantised scheme with its tied head left in the model's dtype (as before "
                         "hybrid.quantize quantised tied heads), alternating with the quantised head")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of the whole list (rows per round)")
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    rows = []
    runs = [(s, tied) for _ in range(args.rounds) for s in args.schemes
            for tied in ((False, True) if args.ab and s != "none" else (False,))]
    for scheme, tied in tqdm(runs, desc="rows", unit="row"):
        rows.append(run_scheme(args.folder, scheme, dtype, args.batch, args.context, args.steps, args.warmup,
                               tied_head=tied))
        tqdm.write(json.dumps(rows[-1]))
    print(f"{'scheme':15} {'dtype':9} {'batch':>5} {'tok/s':>8} {'ms min/med/max':>22} {'weights MB':>10} "
          f"{'head MB':>8} native")
    for r in rows:
        print(f"{r['scheme']:15} {r['dtype']:9} {r['batch']:5d} {r['decode_tok/s']:8.1f} "
              f"{r['ms_min']:6.2f} /{r['ms_med']:6.2f} /{r['ms_max']:6.2f} {r['weight_MB']:10.1f} "
              f"{r['head_MB']:8.1f} {r['native_whole_step']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
