"""The ``hybrid`` command line: one sub-command per job."""

from __future__ import annotations

import argparse
import dataclasses
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
    print(format_table([model_facts(n, m, args.seq_len) for n, m in models.items()]))


def cmd_bench(args) -> None:
    import torch

    from .eval.prefill_bench import matmul_peak_flops, sweep, time_decode
    from .eval.tables import markdown, write_rows

    if args.threads:
        torch.set_num_threads(args.threads)
    models = _models_from_args(args)
    if args.prefix_caching:  # the prefix-cache benchmark instead: shared system prompt and a chat, cache off vs on
        import json

        from .eval.prefix_bench import run_models

        print(json.dumps(run_models(models, ["shared", "chat"], ["--shared", str(args.lengths[-1])]), indent=1))
        return
    dtype = getattr(torch, args.dtype)
    peak = matmul_peak_flops(args.device, dtype) if args.peak else None
    rows = sweep(models, args.lengths, batch=args.batch, warmup=args.warmup, repeats=args.repeats, peak_flops=peak)
    decode = [{"model": name, **time_decode(model, args.decode_ctx, args.decode_tokens, batch=args.batch,
                                            warmup=args.warmup, repeats=args.repeats)}
              for name, model in models.items()] if args.decode_tokens else []
    header = {"device": args.device, "threads": torch.get_num_threads(), "dtype": args.dtype,
              "repeats": args.repeats, "matmul_peak_GFLOP/s": round(peak / 1e9, 2) if peak else None}
    print(f"# prefill on {args.device}, {header['threads']} threads, dtype {args.dtype}, median of {args.repeats}"
          + (f"; matmul peak {header['matmul_peak_GFLOP/s']} GFLOP/s" if peak else ""))
    print(markdown(rows))
    if decode:
        print(f"\n# decode through the engine: {args.decode_tokens} tokens after a {args.decode_ctx}-token prompt")
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
    import torch

    from .eval import mqar
    from .eval.tables import markdown
    from .eval.tradeoff import run

    if args.threads:
        torch.set_num_threads(args.threads)
    train = mqar.TrainConfig(steps=args.steps, batch_size=args.train_batch, lr=args.lr, vocab_size=args.mqar_vocab,
                             train_kv_pairs=tuple(args.kv_pairs), eval_kv_pairs=tuple(args.kv_pairs),
                             eval_sequences=args.eval_sequences, seed=args.seed)
    result, paths = run(checkpoints=args.checkpoints, tasks=args.tasks, num_fewshot=args.num_fewshot,
                        limit=args.limit, mmlu_dir=args.mmlu_dir, eval_batch_size=args.batch_size, size=args.size,
                        n_blocks=args.n_blocks, shares=tuple(args.shares), train=train, lengths=tuple(args.lengths),
                        repeats=args.repeats, warmup=args.warmup, device=args.device, dtype=args.dtype,
                        seed=args.seed, output=args.output)
    print(markdown([{k: v for k, v in r.items() if k != "pattern"} for r in result.rows]))
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


def cmd_generate(args) -> None:
    import torch

    from . import from_pretrained, recipes
    from .engine import Engine
    from .model import HybridLM
    from .sampling import SamplingParams
    from .tokenizer import load_tokenizer

    if (args.model is None) == (args.recipe is None):
        raise SystemExit("give exactly one of --model DIR or --recipe NAME")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    if args.recipe:
        torch.manual_seed(0 if args.seed is None else args.seed)  # a recipe has random weights
        model = HybridLM(recipes.get(args.recipe)).to(device=args.device, dtype=dtype)
        tokenizer = load_tokenizer(None)
    else:
        model = from_pretrained(args.model, dtype=dtype, device=args.device)
        tokenizer = load_tokenizer(args.model)
    prompt = tokenizer.encode(args.prompt)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                            seed=args.seed, stop=tuple(args.stop or ()))
    block_size = 16
    engine = Engine(model, num_blocks=-(-(len(prompt) + args.max_new_tokens) // block_size), block_size=block_size,
                    max_seqs=1, max_batch_tokens=args.chunk, tokenizer=tokenizer, prefix_caching=args.prefix_caching)
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
          f"({s.decode_tokens / max(s.decode_seconds, 1e-9):.1f} tok/s)", file=sys.stderr)
    if args.prefix_caching:
        r = engine.cache.report()
        print(f"prefix cache: {s.prefix_hit_tokens} of {s.prompt_tokens} prompt tokens served; tree holds "
              f"{r.prefix_blocks} KV blocks, {r.prefix_checkpoints} state checkpoints ({r.prefix_state_bytes} bytes)",
              file=sys.stderr)


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
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("bench", help="prefill latency and tokens/s at a sweep of context lengths")
    _add_model_args(p)
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--decode-tokens", type=int, default=0,
                   help="also time decoding this many tokens per sequence through the engine (0: skip)")
    p.add_argument("--decode-ctx", type=int, default=512, help="prompt length before the timed decode")
    p.add_argument("--no-peak", dest="peak", action="store_false",
                   help="skip measuring the matmul peak that achieved FLOP/s is compared with")
    p.add_argument("--output", help="also write the rows to this .json or .csv file")
    p.add_argument("--prefix-caching", action="store_true",
                   help="run the prefix-cache benchmark instead (shared system prompt of --lengths[-1] tokens, "
                        "a chat; cache off vs on; see hybrid.eval.prefix_bench)")
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

    from .eval.mqar import TrainConfig  # its defaults are the command's (shown in --help)

    MQAR_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    p = sub.add_parser("tradeoff", help="prefill speed vs accuracy over attention shares (MQAR by default)")
    p.add_argument("--checkpoints", nargs="+", help="checkpoint folders scored with lm-eval --tasks instead of "
                                                     "training the MQAR family")
    p.add_argument("--tasks", nargs="+", default=["mmlu_local"], help="lm-eval tasks for --checkpoints")
    p.add_argument("--num-fewshot", type=int, default=5)
    p.add_argument("--limit", type=float, default=None)
    p.add_argument("--mmlu-dir")
    p.add_argument("--batch-size", type=int, default=8, help="lm-eval batch size")
    p.add_argument("--size", default="tiny", help="width of the MQAR family (recipes.attention_family size)")
    p.add_argument("--n-blocks", type=int, default=8)
    p.add_argument("--shares", type=float, nargs="+", default=[0.0, 0.125, 0.25, 0.5, 1.0])
    p.add_argument("--steps", type=int, default=MQAR_DEFAULTS["steps"], help="MQAR training steps per model")
    p.add_argument("--train-batch", type=int, default=MQAR_DEFAULTS["batch_size"])
    p.add_argument("--lr", type=float, default=MQAR_DEFAULTS["lr"])
    p.add_argument("--mqar-vocab", type=int, default=MQAR_DEFAULTS["vocab_size"])
    p.add_argument("--kv-pairs", type=int, nargs="+", default=list(MQAR_DEFAULTS["train_kv_pairs"]),
                   help="numbers of key-value pairs to train and score on")
    p.add_argument("--eval-sequences", type=int, default=MQAR_DEFAULTS["eval_sequences"])
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192], help="prefill context lengths")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="out/tradeoff", help="folder for tradeoff.{json,csv,md,png}")
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
    p.add_argument("--prefix-caching", action="store_true", help="engine with the prefix cache on (reports its hits)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("doctor", help="which kernel backend each op uses here, and why not the others")
    p.set_defaults(func=cmd_doctor)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main(sys.argv[1:])
