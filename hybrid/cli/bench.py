"""``hybrid bench``: prefill latency and tokens/s at a sweep of context lengths (and, optionally, decode
through the engine, or the prefix-cache benchmark)."""

from __future__ import annotations

from .common import (
    CLIError,
    add_model_args,
    models_from_args,
    non_negative_int,
    positive_float,
    positive_int,
    threads_flag,
)
from .engine_args import add_engine_args


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="prefill latency and tokens/s at a sweep of context lengths")
    add_model_args(p)
    p.add_argument("--lengths", type=positive_int, nargs="+", default=[512, 2048], help="prompt lengths to time")
    p.add_argument("--batch", type=positive_int, default=1, help="sequences per forward")
    p.add_argument("--warmup", type=non_negative_int, default=1, help="untimed runs before each length")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="timed runs per length (min / median / max reported)")
    threads_flag(p, zero="one per CPU core this process may use")
    p.add_argument("--max-spread", type=positive_float, default=0.25,
                   help="re-measure a timing whose (max-min)/median exceeds this, then mark it wide")
    p.add_argument("--logits", choices=["last", "all"], default="last",
                   help="last: the last position's logits only (what a prompt needs; llama-bench -p), all: every "
                        "position's (as scoring); FLOP/s counts the LM head only where it runs")
    p.add_argument("--decode-tokens", type=non_negative_int, default=0,
                   help="also time decoding this many tokens per sequence through the engine (0: skip)")
    p.add_argument("--decode-ctx", type=positive_int, default=512, help="prompt length before the timed decode")
    p.add_argument("--compile", action="store_true",
                   help="time the compiled decode step (torch.compile; compile time reported apart)")
    p.add_argument("--no-peak", dest="peak", action="store_false",
                   help="skip measuring the matmul peak that achieved FLOP/s is compared with")
    p.add_argument("--output", help="also write the rows to this .json or .csv file")
    p.add_argument("--prefix-caching", action="store_true",
                   help="run the prefix-cache benchmark instead (shared system prompt of --lengths[-1] tokens, "
                        "a chat; cache off vs on; see benchmarks/prefix.py)")
    add_engine_args(p, ("kv_dtype", "state_dtype"))
    p.set_defaults(func=run)


def run(args) -> None:
    import torch

    from ..eval.decode_timing import decode_engine, decode_speed
    from ..eval.tables import markdown, write_rows
    from ..eval.timing import matmul_peak, peak_exceeded, set_threads, sweep

    threads = set_threads(args.threads)
    models = models_from_args(args)
    if args.prefix_caching:  # the prefix-cache benchmark instead: shared system prompt and a chat, cache off vs on
        import json
        import sys
        from pathlib import Path

        sys.path.append(str(Path(__file__).resolve().parents[2]))  # a checkout's benchmarks/ (never installed)
        try:
            from benchmarks.prefix import run_models
        except ImportError:
            raise CLIError("hybrid bench --prefix-caching runs benchmarks/prefix.py, which is not installed: run it "
                           "from a checkout of the repo (python -m benchmarks.prefix --help)") from None

        print(json.dumps(run_models(models, ["shared", "chat"], ["--shared", str(args.lengths[-1])]), indent=1))
        return
    dtype = getattr(torch, args.dtype)
    probe = matmul_peak(args.device, dtype) if args.peak else None
    peak = probe.flops if probe else None
    rows = sweep(models, args.lengths, batch=args.batch, warmup=args.warmup, repeats=args.repeats, peak_flops=peak,
                 max_spread=args.max_spread, logits=args.logits)
    decode, engine_configs = [], {}
    for name, model in models.items() if args.decode_tokens else ():
        # one engine per model: compiled shapes compile in the warm-up steps, never inside the timed ones
        engine = decode_engine(model, args.batch, args.decode_ctx, steps=args.decode_tokens, compile=args.compile,
                               warmup=max(args.warmup, 1), kv_dtype=args.kv_dtype, state_dtype=args.state_dtype)
        row, _ = decode_speed(engine, args.decode_tokens)
        engine_configs[name] = engine.config.to_dict()  # the exact engine, for the --output record
        r = engine.cache.report()
        decode.append({"model": name, "decode_ctx": args.decode_ctx, "mode": "compiled" if args.compile else "eager",
                       "kv_dtype": r.kv_dtype, "state_dtype": r.ssm_dtype, **row,
                       "compile_s": round(engine.stats.compile_seconds, 1)})
    header = {"device": args.device, "threads": threads, "dtype": args.dtype, "logits": args.logits,
              "repeats": args.repeats,
              "max_spread": args.max_spread, "matmul_peak_GFLOP/s": round(peak / 1e9, 2) if peak else None,
              "matmul_peak_shape": list(probe.shape) if probe else None,
              **({"engine_configs": engine_configs} if engine_configs else {})}
    print(f"# prefill (plain forward, {args.logits}-position logits{'' if args.logits == 'all' else ' only'}) on "
          f"{args.device}, {threads} threads, dtype {args.dtype}; min / median / max "
          f"of {args.repeats} runs, spread = (max-min)/median, re-measured once above {args.max_spread:.0%}, "
          f"wide = still above" + (f"; matmul peak {probe.describe()} (best of {len(probe.per_shape)} shapes)"
                                   if probe else ""))
    print(markdown(rows))
    if peak_exceeded(rows):
        print("warning: a model achieved more than the matmul peak measured before the sweep (of_peak > 1): the "
              "machine was busier while the probe ran; its shares of peak read high, rerun on a quiet machine")
    if any(r.get("wide") for r in rows):
        print("warning: rows marked wide=True kept a spread above the limit after a re-measure; "
              "the machine was busy, rerun them on a quiet one")
    if decode:
        print(f"\n# decode through the engine: {args.decode_tokens} timed steps after a {args.decode_ctx}-token "
              "prompt (median [min, max] step; compile time apart)")
        print(markdown(decode))
    if args.output:
        print(f"wrote {write_rows(rows + decode, args.output, **header)}")
