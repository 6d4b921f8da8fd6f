"""The ``hybrid`` command line: one sub-command per job."""

from __future__ import annotations

import argparse
import sys


def _models_from_args(args) -> dict:
    import torch

    from . import from_pretrained, recipes
    from .model import HybridLM

    dtype = getattr(torch, args.dtype)
    models = {}
    names = recipes.names() if args.recipe == ["all-small"] else args.recipe or []
    if args.recipe == ["all-small"]:
        names = [n for n in names if n.endswith("-small")]
    for name in names:
        with torch.device(args.device):
            models[name] = HybridLM(recipes.get(name)).to(dtype).eval()
    for path in args.model or []:
        models[path] = from_pretrained(path, dtype=dtype, device=args.device)
    if not models:
        raise SystemExit("give --recipe NAME (or all-small) and/or --model DIR")
    return models


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--recipe", nargs="*", help="recipe names (see `hybrid info --list`), or all-small")
    p.add_argument("--model", nargs="*", help="checkpoint folders")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")


def cmd_info(args) -> None:
    from . import recipes
    from .report import format_table, model_facts

    if args.list:
        print("\n".join(recipes.names()))
        return
    models = _models_from_args(args)
    rows = [model_facts(n, m, args.seq_len) for n, m in models.items()]
    if args.kv_dtype or args.state_dtype:
        for row, model in zip(rows, models.values(), strict=True):
            row.update(_compressed_facts(model, args.kv_dtype, args.state_dtype, args.seq_len))
    print(format_table(rows))


def _compressed_facts(model, kv_dtype, state_dtype, seq_len: int) -> dict:
    """Cache bytes per token and per sequence of ``model`` at the given cache dtypes (block and state scales
    included), from the layers' cache specs, as the engine would allocate them (blocks of 16)."""
    from .cache import cache_dtypes
    from .kernels.kv_quant import dtype_name

    d = cache_dtypes(next(model.parameters()).dtype, kv_dtype, state_dtype)
    spec = model.cache_spec(kv_dtype=d.kv, conv_dtype=d.conv, ssm_dtype=d.ssm)
    tag = f"{dtype_name(d.kv)}/{dtype_name(d.ssm)}"
    return {f"KV_bytes/token({tag})": round(spec.kv_bytes_per_token_with_scales(16), 2),
            f"state_bytes/seq({tag})": spec.state_bytes_per_sequence,
            f"cache_MiB/seq@{seq_len}({tag})": round(spec.bytes_per_sequence(seq_len, block_size=16) / 2**20, 3)}


def _add_cache_dtype_args(p: argparse.ArgumentParser) -> None:
    from .kernels.kv_quant import KV_DTYPES, STATE_DTYPES

    p.add_argument("--kv-dtype", choices=sorted(KV_DTYPES),
                   help="K/V cache storage (int8 / fp8: per-token, per-KV-head scales; default: the model's dtype)")
    p.add_argument("--state-dtype", choices=sorted(STATE_DTYPES),
                   help="Mamba SSM + conv state storage (int8: per-head scales; default: fp32 SSM state)")


def _kv_pruning(text: str):
    from .kv_pruning import parse_policy

    try:
        return parse_policy(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_pruning_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-pruning", type=_kv_pruning, default=None, metavar="POLICY",
                   help="prune the KV cache: snapkv:budget=N[,window=32,kernel=7,pooling=max|avg] (prompt "
                        "compression) or streaming:sinks=4,window=1020[,renumber=1] (attention sinks + recent window; "
                        "renumber=1, the default, numbers positions within the cache as the paper does, 0 keeps "
                        "the real positions)")


def cmd_bench(args) -> None:
    import torch

    from .eval.engine_bench import decode_engine, decode_speed
    from .eval.tables import markdown, write_rows
    from .eval.timing import matmul_peak, peak_exceeded, set_threads, sweep

    threads = set_threads(args.threads)
    models = _models_from_args(args)
    if args.prefix_caching:  # the prefix-cache benchmark instead: shared system prompt and a chat, cache off vs on
        import json
        from pathlib import Path

        sys.path.append(str(Path(__file__).resolve().parents[1]))  # a checkout's benchmarks/ (never installed)
        try:
            from benchmarks.prefix import run_models
        except ImportError:
            raise SystemExit("hybrid bench --prefix-caching runs benchmarks/prefix.py: run it from a checkout of "
                             "the repo (cd REPO; python -m benchmarks.prefix --help)") from None

        print(json.dumps(run_models(models, ["shared", "chat"], ["--shared", str(args.lengths[-1])]), indent=1))
        return
    dtype = getattr(torch, args.dtype)
    probe = matmul_peak(args.device, dtype) if args.peak else None
    peak = probe.flops if probe else None
    rows = sweep(models, args.lengths, batch=args.batch, warmup=args.warmup, repeats=args.repeats, peak_flops=peak,
                 max_spread=args.max_spread, logits=args.logits)
    decode = []
    for name, model in models.items() if args.decode_tokens else ():
        # one engine per model: compiled shapes compile in the warm-up steps, never inside the timed ones
        engine = decode_engine(model, args.batch, args.decode_ctx, steps=args.decode_tokens, compile=args.compile,
                               warmup=max(args.warmup, 1), kv_dtype=args.kv_dtype, state_dtype=args.state_dtype)
        row, _ = decode_speed(engine, args.decode_tokens)
        r = engine.cache.report()
        decode.append({"model": name, "decode_ctx": args.decode_ctx, "mode": "compiled" if args.compile else "eager",
                       "kv_dtype": r.kv_dtype, "state_dtype": r.ssm_dtype, **row,
                       "compile_s": round(engine.stats.compile_seconds, 1)})
    header = {"device": args.device, "threads": threads, "dtype": args.dtype, "logits": args.logits,
              "repeats": args.repeats,
              "max_spread": args.max_spread, "matmul_peak_GFLOP/s": round(peak / 1e9, 2) if peak else None,
              "matmul_peak_shape": list(probe.shape) if probe else None}
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


def cmd_eval(args) -> None:
    from .eval.lm_eval_run import run, write_results

    if (args.model is None) == (args.recipe is None):
        raise SystemExit("give exactly one of --model DIR (a checkpoint folder) or --recipe NAME")
    from lm_eval.utils import make_table

    results = run(args.model, recipe=args.recipe, tasks=args.tasks, num_fewshot=args.num_fewshot, limit=args.limit,
                  mmlu_dir=args.mmlu_dir, batch_size=args.batch_size, device=args.device, dtype=args.dtype,
                  max_length=args.max_length, backend=args.backend)
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    name = args.model or args.recipe
    print(f"wrote {write_results(results, args.output, name.rstrip('/').split('/')[-1])}")


def cmd_tradeoff(args) -> None:
    from .eval import mqar
    from .eval.tables import markdown
    from .eval.tradeoff import run
    from .eval.tradeoff_report import claim_lines, summary_table

    given = {"steps": args.steps, "tokens_per_step": args.train_tokens, "batch_size": args.train_batch, "lr": args.lr,
             "vocab_size": args.mqar_vocab, "init_std": args.init_std,
             "train_kv_pairs": tuple(args.train_kv_pairs) if args.train_kv_pairs else None,
             "eval_kv_pairs": tuple(args.kv_pairs) if args.kv_pairs else None, "eval_sequences": args.eval_sequences,
             "curriculum": args.curriculum}
    try:
        train = mqar.TrainConfig(**{k: v for k, v in given.items() if v is not None})
        result, paths = run(checkpoints=args.checkpoints, tasks=args.tasks, num_fewshot=args.num_fewshot,
                            limit=args.limit, mmlu_dir=args.mmlu_dir, eval_batch_size=args.batch_size,
                            size=args.size, speed_size=args.speed_size, n_blocks=args.n_blocks,
                            shares=tuple(args.shares), train=train, seeds=tuple(args.seeds),
                            lengths=tuple(args.lengths), long_lengths=tuple(args.long_lengths),
                            long_shares=tuple(args.long_shares), chunk=args.chunk, repeats=args.repeats,
                            long_repeats=args.long_repeats, warmup=args.warmup, max_spread=args.max_spread,
                            cache_budget=int(args.cache_gib * 2**30), device=args.device, dtype=args.dtype,
                            threads=args.threads, output=args.output, lock=args.lock, kv_dtype=args.kv_dtype,
                            state_dtype=args.state_dtype)
    except ValueError as e:
        raise SystemExit(f"hybrid tradeoff: {e}") from e
    s = result.settings
    print(f"# {s['date']} UTC, {s['machine']['cpu']}, {s['threads']} threads, {s['dtype']}, wall {s['wall_s']} s")
    print(markdown(summary_table(result.members, s)))
    print("\n".join(["", *claim_lines(result.members, s), ""]))
    for kind, path in paths.items():
        print(f"wrote {kind}: {path}")


def cmd_convert(args) -> None:
    import torch

    from . import CheckpointError, ConfigError, from_pretrained, save_pretrained
    from .interop.io import copy_tokenizer_files

    try:
        model = from_pretrained(args.src, dtype=getattr(torch, args.dtype) if args.dtype else None)
        out = save_pretrained(model, args.dst, format=args.format)
    except (CheckpointError, ConfigError) as e:
        raise SystemExit(f"hybrid convert: {e}") from e
    tok = copy_tokenizer_files(args.src, out)
    print(f"{args.src} -> {out} (format {args.format}; pattern {model.config.pattern!r}, "
          f"{model.num_parameters():,} parameters; tokenizer files: {', '.join(tok) or 'none'})")


def _engine_model(args, *, seed: int):
    """The model and tokenizer of ``generate`` / ``serve``: a checkpoint folder (its tokenizer.json if any,
    else bytes) or a recipe with random weights drawn from ``seed`` (byte tokenizer); threads set."""
    import torch

    from . import from_pretrained, recipes
    from .model import HybridLM
    from .tokenizer import load_tokenizer

    if (args.model is None) == (args.recipe is None):
        raise SystemExit("give exactly one of --model DIR or --recipe NAME")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    if args.recipe:
        torch.manual_seed(seed)  # a recipe has random weights; the seed makes them reproducible
        return HybridLM(recipes.get(args.recipe)).to(device=args.device, dtype=dtype).eval(), load_tokenizer(None)
    return from_pretrained(args.model, dtype=dtype, device=args.device), load_tokenizer(args.model)


def _speculative(args, model):
    """The SpeculativeConfig of ``--draft-model DIR`` / ``--ngram`` (``--num-draft-tokens k``), or None."""
    if args.draft_model is None and not args.ngram:
        return None
    from . import from_pretrained
    from .speculative import SpeculativeConfig

    if args.draft_model is not None and args.ngram:
        raise SystemExit("give one of --draft-model DIR or --ngram, not both")
    try:
        if args.ngram:
            return SpeculativeConfig(method="ngram", num_tokens=args.num_draft_tokens)
        p = next(model.parameters())
        draft = from_pretrained(args.draft_model, dtype=p.dtype, device=p.device)
        return SpeculativeConfig(method="draft", draft_model=draft, num_tokens=args.num_draft_tokens)
    except ValueError as e:
        raise SystemExit(f"speculative decoding: {e}") from e


def _add_speculative_flags(p) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--draft-model", help="speculative decoding with this draft checkpoint folder (same vocabulary)")
    g.add_argument("--ngram", action="store_true", help="speculative decoding with n-gram prompt lookup drafts")
    p.add_argument("--num-draft-tokens", type=int, default=4, help="draft tokens checked per step (with "
                   "--draft-model or --ngram)")


def cmd_generate(args) -> None:

    from .engine import Engine
    from .sampling import SamplingParams

    model, tokenizer = _engine_model(args, seed=0 if args.seed is None else args.seed)
    prompt = tokenizer.encode(args.prompt)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                            seed=args.seed, stop=tuple(args.stop or ()))
    block_size = 16
    try:
        engine = Engine(model, num_blocks=-(-(len(prompt) + args.max_new_tokens) // block_size),
                        block_size=block_size, max_seqs=1, max_batch_tokens=args.chunk, tokenizer=tokenizer,
                        compile=args.compile, prefix_caching=args.prefix_caching,
                        speculative=_speculative(args, model), kv_dtype=args.kv_dtype,
                        state_dtype=args.state_dtype, kv_pruning=args.kv_pruning)
    except ValueError as e:
        raise SystemExit(f"hybrid generate: {e}") from e
    engine.add_request(prompt, params)
    sys.stdout.write(args.prompt)
    while engine.has_unfinished():
        for out in engine.step():
            sys.stdout.write(out.text)
            sys.stdout.flush()
    s = engine.stats
    print(file=sys.stdout, flush=True)
    print(f"prefill: {s.prefill_tokens} tokens in {s.prefill_seconds:.3f} s "
          f"({s.prefill_tokens / max(s.prefill_seconds, 1e-9):.1f} tok/s); "
          f"decode: {s.decode_tokens} tokens in {s.decode_seconds:.3f} s "
          f"({s.decode_tokens / max(s.decode_seconds, 1e-9):.1f} tok/s)"
          + (f"; compile: {s.compile_seconds:.1f} s (not counted)" if args.compile else ""), file=sys.stderr)
    if engine.speculative is not None:
        print(f"speculative ({engine.speculative.method}, k={engine.speculative.num_tokens}): "
              f"{s.draft_tokens_accepted} of {s.draft_tokens_proposed} draft tokens accepted "
              f"(rate {s.acceptance_rate:.2f}, {s.mean_accepted_length:.2f} per verify step)", file=sys.stderr)
    if args.kv_pruning is not None:
        r = engine.cache.report()
        print(f"kv pruning {r.kv_pruning}: {r.kv_blocks_pruned} KV blocks given back, "
              f"{r.kv_sequences_compressed} prompts compressed", file=sys.stderr)
    if args.prefix_caching:
        r = engine.cache.report()
        print(f"prefix cache: {s.prefix_hit_tokens} of {s.prompt_tokens} prompt tokens served; tree holds "
              f"{r.prefix_blocks} KV blocks, {r.prefix_checkpoints} state checkpoints ({r.prefix_state_bytes} bytes)",
              file=sys.stderr)


def _byte_size(text: str) -> int:
    """``268435456``, ``256MiB``, ``2GiB``, ``512MB`` -> bytes."""
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
    t = text.strip().lower()
    num = t.rstrip("abgikm")
    unit = t[len(num):]
    try:
        value = float(num) * units[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 268435456, 256MiB or 2GiB") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"a size must be positive, got {text!r}")
    return int(value)


def cmd_serve(args) -> None:
    import logging
    from pathlib import Path


    try:
        from .server import ServerSettings, create_app, load_chat_template, run
    except ImportError as e:
        raise SystemExit(f"hybrid serve needs the serve extra: pip install 'hybrid-lm[serve]' ({e})") from e
    from .engine import Engine

    model, tokenizer = _engine_model(args, seed=args.seed)
    template = load_chat_template(args.model)  # None for a recipe: the documented default
    name = args.served_model_name or args.recipe or Path(args.model).resolve().name
    engine_options = {"compile": args.compile, "prefix_caching": args.prefix_caching,
                      "speculative": _speculative(args, model), "kv_pruning": args.kv_pruning,
                      "kv_dtype": args.kv_dtype, "state_dtype": args.state_dtype}
    try:
        engine = Engine(model, cache_bytes=args.cache_bytes, max_seqs=args.max_seqs,
                        max_batch_tokens=args.max_batch_tokens, tokenizer=tokenizer, **engine_options)
    except ValueError as e:
        raise SystemExit(f"hybrid serve: {e}") from e
    settings = ServerSettings(model_name=name, max_body_bytes=args.max_body_bytes,
                              default_chat_tokens=args.default_max_tokens, shutdown_timeout=args.shutdown_timeout)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    report = engine.cache.report()
    chat = "ChatML default" if template.is_default else "the checkpoint's"
    print(f"hybrid serve: {name!r} ({model.num_parameters():,} parameters, pattern {model.config.pattern!r}) on "
          f"http://{args.host}:{args.port}/v1; cache {report.bytes_total / 2**20:.0f} MiB: "
          f"{report.token_capacity:g} KV tokens, {report.max_sequences} sequences; chat template: "
          f"{chat}", flush=True)
    run(create_app(engine, tokenizer, settings, template), args.host, args.port, log_level=args.log_level,
        shutdown_timeout=args.shutdown_timeout)


def cmd_doctor(args) -> None:
    from .kernels.doctor import report

    print(report())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybrid", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="parameters, FLOPs/token and cache bytes of recipes or checkpoints")
    _add_model_args(p)
    p.add_argument("--seq-len", type=int, default=2048, help="context length for FLOPs/token")
    p.add_argument("--list", action="store_true", help="list recipe names")
    _add_cache_dtype_args(p)
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("bench", help="prefill latency and tokens/s at a sweep of context lengths")
    _add_model_args(p)
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: one per CPU core this process may use)")
    p.add_argument("--max-spread", type=float, default=0.25,
                   help="re-measure a timing whose (max-min)/median exceeds this, then mark it wide")
    p.add_argument("--logits", choices=["last", "all"], default="last",
                   help="last: the last position's logits only (what a prompt needs; llama-bench -p), all: every "
                        "position's (as scoring); FLOP/s counts the LM head only where it runs")
    p.add_argument("--decode-tokens", type=int, default=0,
                   help="also time decoding this many tokens per sequence through the engine (0: skip)")
    p.add_argument("--decode-ctx", type=int, default=512, help="prompt length before the timed decode")
    p.add_argument("--compile", action="store_true",
                   help="time the compiled decode step (torch.compile; compile time reported apart)")
    p.add_argument("--no-peak", dest="peak", action="store_false",
                   help="skip measuring the matmul peak that achieved FLOP/s is compared with")
    p.add_argument("--output", help="also write the rows to this .json or .csv file")
    p.add_argument("--prefix-caching", action="store_true",
                   help="run the prefix-cache benchmark instead (shared system prompt of --lengths[-1] tokens, "
                        "a chat; cache off vs on; see benchmarks/prefix.py)")
    _add_cache_dtype_args(p)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("eval", help="lm-eval tasks (e.g. mmlu_local, offline MMLU) on a checkpoint or recipe")
    p.add_argument("--model", help="checkpoint folder")
    p.add_argument("--recipe", help="recipe name (random weights; for checking the pipeline)")
    p.add_argument("--tasks", nargs="+", default=["mmlu_local"], help="lm-eval task or group names")
    p.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples (mmlu: 5)")
    p.add_argument("--limit", type=float, default=None, help="questions per task (for quick checks)")
    p.add_argument("--mmlu-dir", help="MMLU folder (dev/, test/) for mmlu_local; default $HYBRID_MMLU_DIR "
                                      "or ../shared/data/mmlu")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--backend", choices=["torch", "triton", "cuda"], help="force a kernel backend")
    p.add_argument("--output", default="out/eval", help="folder for lm-eval's results JSON")
    p.set_defaults(func=cmd_eval)

    # MQAR defaults live in hybrid.eval.mqar.TrainConfig (imported only when the command runs); the report
    # and its JSON record the values used
    p = sub.add_parser("tradeoff", help="prefill speed vs accuracy over attention shares (MQAR by default)")
    p.add_argument("--checkpoints", nargs="+", help="checkpoint folders scored with lm-eval --tasks (and timed "
                                                     "themselves) instead of training the MQAR family")
    p.add_argument("--tasks", nargs="+", default=["mmlu_local"], help="lm-eval tasks for --checkpoints")
    p.add_argument("--num-fewshot", type=int, default=5)
    p.add_argument("--limit", type=float, default=None, help="questions per lm-eval task (quick runs)")
    p.add_argument("--mmlu-dir", help="MMLU folder for mmlu_local (default $HYBRID_MMLU_DIR or ../shared/data/mmlu)")
    p.add_argument("--batch-size", type=int, default=8, help="lm-eval batch size")
    p.add_argument("--size", default="tiny", help="width of the MQAR models (recipes.attention_family size)")
    p.add_argument("--speed-size", default="small",
                   help="width the same patterns are timed and sized at (recipes.attention_family size)")
    p.add_argument("--n-blocks", type=int, default=4,
                   help="mixers per family member (timed models: blocks of mixer + MLP; MQAR models: mixers only)")
    p.add_argument("--shares", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0],
                   help="attention shares of the family members")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="MQAR training seeds per member")
    p.add_argument("--steps", type=int, help="MQAR training steps per model (default: TrainConfig's)")
    p.add_argument("--train-tokens", type=int, help="MQAR tokens per training step (default: TrainConfig's)")
    p.add_argument("--train-batch", type=int, help="fixed MQAR sequences per step instead of --train-tokens")
    p.add_argument("--init-std", type=float, help="weight init std of the MQAR models (default: TrainConfig's)")
    p.add_argument("--lr", type=float, help="MQAR peak learning rate (default: TrainConfig's)")
    p.add_argument("--mqar-vocab", type=int, help="MQAR tokens = the MQAR models' vocabulary (default: TrainConfig's)")
    p.add_argument("--train-kv-pairs", type=int, nargs="+", help="key-value pair counts to train on")
    p.add_argument("--kv-pairs", type=int, nargs="+", help="key-value pair counts to score")
    p.add_argument("--eval-sequences", type=int, help="held-out MQAR sequences per pair count")
    p.add_argument("--curriculum", type=float,
                   help="share of the MQAR steps over which the trained pair counts grow from the smallest to all "
                        "(0: all from the start; default: TrainConfig's)")
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192],
                   help="prefill context lengths timed for every member")
    p.add_argument("--long-lengths", type=int, nargs="*", default=[32768],
                   help="longer prefill lengths, timed only for --long-shares (an all-attention prefill there "
                        "takes minutes on a CPU)")
    p.add_argument("--long-shares", type=float, nargs="*", default=[0.0, 1.0],
                   help="members timed at --long-lengths (with checkpoints: all)")
    p.add_argument("--chunk", type=int, default=2048, help="engine prefill chunk (max_batch_tokens)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per length")
    p.add_argument("--long-repeats", type=int, default=1, help="timed runs per long length")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs before each member's first length")
    p.add_argument("--max-spread", type=float, default=0.25,
                   help="re-measure a timing whose (max-min)/median exceeds this, then flag it")
    p.add_argument("--cache-gib", type=float, default=4.0, help="cache budget the sequences-that-fit column counts")
    p.add_argument("--kv-dtype", default=None,
                   help="memory columns: K/V storage (bfloat16, float16, float32, int8, fp8)")
    p.add_argument("--state-dtype", default=None, help="memory columns: Mamba state storage (float32, bfloat16, int8)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: one per CPU core this process may use)")
    p.add_argument("--output", default="out/tradeoff", help="folder for tradeoff.{json,csv,md,png}")
    p.add_argument("--lock", help="file to hold an exclusive flock on while timing (not while training), e.g. "
                                  "/tmp/bench.lock on a machine shared with other benchmarks")
    p.set_defaults(func=cmd_tradeoff)

    p = sub.add_parser("convert", help="load any supported checkpoint folder and write it in another format")
    p.add_argument("src", help="checkpoint folder: ours, Hugging Face (Llama, Qwen2, Mistral, Mamba, Mamba2, ...) "
                               "or mamba_ssm")
    p.add_argument("dst", help="output folder")
    p.add_argument("--format", default="hybrid",
                   help="hybrid (ours, default), an export format (llama, mistral, qwen2, mamba, mamba2, ...), "
                        "or hf: the first Hugging Face format that represents the model exactly")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="cast the weights before writing (default: keep the checkpoint's)")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("generate", help="stream a continuation of a prompt; prefill and decode tokens/s at the end")
    p.add_argument("--model", help="checkpoint folder (its tokenizer.json is used if present, else bytes)")
    p.add_argument("--recipe", help="recipe name (random weights, byte tokenizer)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 is off")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="1 is off")
    p.add_argument("--stop", nargs="*", help="stop when the text contains any of these strings")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk (tokens per step)")
    p.add_argument("--compile", action="store_true", help="compile the decode step (torch.compile)")
    p.add_argument("--prefix-caching", action="store_true", help="engine with the prefix cache on (reports its hits)")
    _add_cache_dtype_args(p)
    _add_pruning_flag(p)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    _add_speculative_flags(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (completions, chat, metrics) over the engine")
    p.add_argument("--model", help="checkpoint folder (its tokenizer.json and chat template are used if present)")
    p.add_argument("--recipe", help="recipe name (random weights from --seed, byte tokenizer)")
    p.add_argument("--served-model-name", help="the name clients ask for (default: the recipe or folder name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--cache-bytes", type=_byte_size, default=256 * 2**20,
                   help="KV blocks + Mamba state slots, e.g. 256MiB (default) or 8GiB")
    p.add_argument("--max-seqs", type=int, default=32, help="sequences in flight (state slots)")
    p.add_argument("--max-batch-tokens", type=int, default=512, help="token budget per engine step (prefill chunk)")
    p.add_argument("--compile", action="store_true", help="torch.compile the engine's decode step")
    p.add_argument("--prefix-caching", action="store_true",
                   help="share prompt prefixes between requests (KV blocks + Mamba state checkpoints)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0, help="initialises a --recipe's random weights")
    p.add_argument("--default-max-tokens", type=int, default=256,
                   help="max_tokens of a chat request that gives none (completions default to 16, as OpenAI)")
    p.add_argument("--max-body-bytes", type=_byte_size, default=8 * 2**20,
                   help="refuse request bodies larger than this (413) before parsing them")
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds in-flight requests get to finish on SIGINT/SIGTERM before they are aborted")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    _add_cache_dtype_args(p)
    _add_pruning_flag(p)
    _add_speculative_flags(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("doctor", help="which kernel backend each op uses here, and why not the others")
    p.set_defaults(func=cmd_doctor)
    return parser


def main(argv: list[str] | None = None) -> None:
    from .kernels.host_memory import keep_freed_memory

    args = build_parser().parse_args(argv)
    keep_freed_memory()  # the CLI owns its process: large temporaries reuse mapped memory (see host_memory)
    args.func(args)


if __name__ == "__main__":
    main(sys.argv[1:])
