"""``hybrid eval``: lm-eval tasks (e.g. ``mmlu_local``, offline MMLU) on a checkpoint or a recipe."""

from __future__ import annotations

from pathlib import Path

from ..quantize import METHODS
from .common import DTYPES, device_arg, no_verify_flag, non_negative_int, positive_float, positive_int
from .environment import check_backend
from .errors import CLIError

MMLU_HELP = "MMLU folder (dev/, test/) for mmlu_local; default $HYBRID_MMLU_DIR (or, in a source checkout, " \
            "../shared/data/mmlu beside it)"


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="lm-eval tasks (e.g. mmlu_local, offline MMLU) on a checkpoint or recipe")
    p.add_argument("--model", help="checkpoint folder")
    p.add_argument("--recipe", help="recipe name (random weights; for checking the pipeline)")
    p.add_argument("--tasks", nargs="+", default=["mmlu_local"], help="lm-eval task or group names")
    p.add_argument("--num-fewshot", type=non_negative_int, default=None,
                   help="few-shot examples per question (default: each task's own, which for mmlu_local is 0, as "
                        "for lm-eval's mmlu; MMLU is usually reported 5-shot: --num-fewshot 5)")
    p.add_argument("--limit", type=positive_float, default=None,
                   help="questions per task: a count, or a fraction below 1 (for quick checks; default: all)")
    p.add_argument("--mmlu-dir", help=MMLU_HELP)
    p.add_argument("--batch-size", type=positive_int, default=8, help="distinct inputs per forward")
    p.add_argument("--max-length", type=positive_int, default=2048,
                   help="longest input; longer contexts are cut on the left")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="weight and activation dtype")
    p.add_argument("--device", default="cpu", type=device_arg, help="where the model runs (cpu, cuda, cuda:N)")
    p.add_argument("--backend", choices=["torch", "triton", "cuda"],
                   help="force a kernel backend (default: the best available, see `hybrid doctor`)")
    p.add_argument("--quantize", choices=list(METHODS), default=None,
                   help="torchao quantisation of the linear layers (hybrid.quantize: int8wo, int4wo, int8dq, 8da4w)")
    p.add_argument("--output", default="out/eval", help="folder for lm-eval's results JSON")
    no_verify_flag(p)
    p.set_defaults(func=run)


def check_mmlu_dir(tasks: list[str], mmlu_dir: str | None) -> None:
    """Name a missing MMLU folder before lm-eval starts (it would otherwise fail deep in dataset loading)."""
    if any(t.startswith("mmlu_local") for t in tasks):
        from ..eval.tasks.mmlu_local_data import resolve_dir

        resolve_dir(mmlu_dir)  # MMLUDataError (a ValueError): one line naming --mmlu-dir / $HYBRID_MMLU_DIR


def run(args) -> None:
    if (args.model is None) == (args.recipe is None):
        raise CLIError("give exactly one of --model DIR (a checkpoint folder) or --recipe NAME")
    if args.model is not None and not Path(args.model).is_dir():
        raise CLIError(f"--model {args.model}: no such folder; give a checkpoint folder (or --recipe NAME)")
    check_backend("--backend", args.backend, args.device)
    import lm_eval  # noqa: F401  (a missing eval extra is named before anything loads)

    from ..eval.lm_eval_run import run as run_tasks
    from ..eval.lm_eval_run import write_results
    from .common import recipe_config

    if args.recipe:
        recipe_config(args.recipe)
    check_mmlu_dir(args.tasks, args.mmlu_dir)
    from lm_eval.utils import make_table

    results = run_tasks(args.model, recipe=args.recipe, tasks=args.tasks, num_fewshot=args.num_fewshot,
                        limit=args.limit, mmlu_dir=args.mmlu_dir, batch_size=args.batch_size, device=args.device,
                        dtype=args.dtype, max_length=args.max_length, backend=args.backend,
                        **({"quantize": args.quantize} if args.quantize else {}),
                        **({} if args.verify else {"verify": False}))
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    name = args.model or args.recipe
    print(f"wrote {write_results(results, args.output, name.rstrip('/').split('/')[-1])}")
