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
    print(format_table([model_facts(n, m, args.seq_len) for n, m in models.items()]))


def cmd_bench(args) -> None:
    import torch

    from .eval.prefill_bench import sweep
    from .report import format_table

    if args.threads:
        torch.set_num_threads(args.threads)
    models = _models_from_args(args)
    rows = sweep(models, args.lengths, batch=args.batch, warmup=args.warmup, repeats=args.repeats)
    print(f"# prefill on {args.device}, {torch.get_num_threads()} threads, dtype {args.dtype}, "
          f"median of {args.repeats}")
    print(format_table(rows))


def cmd_convert(args) -> None:
    import torch

    from . import CheckpointError, ConfigError, from_pretrained
    from .interop.io import copy_tokenizer_files

    try:
        model = from_pretrained(args.src, dtype=getattr(torch, args.dtype) if args.dtype else None)
        out = model.save_pretrained(args.dst, format=args.format)
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
                    max_seqs=1, max_batch_tokens=args.chunk, tokenizer=tokenizer)
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
    p.set_defaults(func=cmd_bench)

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
