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

    p = sub.add_parser("doctor", help="which kernel backend each op uses here, and why not the others")
    p.set_defaults(func=cmd_doctor)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main(sys.argv[1:])
