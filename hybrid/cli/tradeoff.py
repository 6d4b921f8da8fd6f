"""``hybrid tradeoff``: prefill speed vs accuracy over attention shares (MQAR by default)."""

from __future__ import annotations

from .common import DTYPES, device_arg, non_negative_int, positive_int
from .engine_args import add_engine_args
from .errors import CLIError


def add_parser(sub) -> None:
    # MQAR defaults live in hybrid.eval.mqar.TrainConfig (imported only when the command runs); the report
    # and its JSON record the values used
    p = sub.add_parser("tradeoff", help="prefill speed vs accuracy over attention shares (MQAR by default; "
                                        "--teacher: a real model's distilled family)")
    p.add_argument("--teacher", help="a Llama-family checkpoint folder or model name (smollm2-135m-instruct): "
                                     "distil it into its hybrid family (attention "
                                     "shares 1, 1/2, 1/4, 1/8, 0 with Mamba-2; 1/4 and 0 with Gated DeltaNet) and "
                                     "measure every member (MMLU cloze + MC, perplexity, agreement, recall, speed)")
    p.add_argument("--budget", default="default", choices=["default", "medium", "large"],
                   help="with --teacher: token and sample sizes of every stage (default: ~20 min on 2 quiet cores; "
                        "medium: 8x its training, 3x its questions, ~2 h; large: the papers' direction, many hours)")
    p.add_argument("--no-speed", action="store_true",
                   help="with --teacher: stop after the accuracy stage (train and score only; a busy machine is fine); "
                        "run again without it to time the members on a quiet machine and write the report")
    p.add_argument("--text-files", nargs="*", default=[],
                   help="with --teacher: local UTF-8 text files added to the teacher-written training data")
    p.add_argument("--mmlu-limit", type=positive_int,
                   help="with --teacher: MMLU questions per subject (default: the budget's)")
    p.add_argument("--subjects", nargs="+", help="with --teacher: MMLU subjects (default: the budget's ten)")
    p.add_argument("--data-tokens", type=non_negative_int,
                   help="with --teacher: teacher-written training tokens (default: the budget's)")
    p.add_argument("--align-tokens", type=non_negative_int, help="with --teacher: layer-alignment tokens per mixer")
    p.add_argument("--kl-tokens", type=non_negative_int, help="with --teacher: end-to-end KL tokens per student")
    p.add_argument("--checkpoints", nargs="+", help="checkpoint folders scored with lm-eval --tasks (and timed "
                                                     "themselves) instead of training the MQAR family")
    p.add_argument("--tasks", nargs="+", default=["mmlu_local"], help="lm-eval tasks for --checkpoints")
    p.add_argument("--num-fewshot", type=int, default=5, help="few-shot examples for --tasks")
    p.add_argument("--limit", type=float, default=None, help="questions per lm-eval task (quick runs; default: all)")
    p.add_argument("--mmlu-dir", help="MMLU folder for mmlu_local (default $HYBRID_MMLU_DIR, or in a source "
                                      "checkout ../shared/data/mmlu)")
    p.add_argument("--batch-size", type=positive_int, default=8, help="lm-eval batch size")
    p.add_argument("--size", default="tiny", help="width of the MQAR models (recipes.attention_family size)")
    p.add_argument("--speed-size", default="small",
                   help="width the same patterns are timed and sized at (recipes.attention_family size)")
    p.add_argument("--n-blocks", type=positive_int, default=4,
                   help="mixers per family member (timed models: blocks of mixer + MLP; MQAR models: mixers only)")
    from ..recipes import FAMILY_MIXER_NAMES, FAMILY_MIXERS  # the table of mixers a family can be built with

    p.add_argument("--mixer", default="mamba2", choices=sorted(FAMILY_MIXERS),
                   help="the family's constant-state mixer (recipes.FAMILY_MIXERS): " + ", ".join(
                       f"{FAMILY_MIXER_NAMES[m]} ({s})" for m, s in FAMILY_MIXERS.items()))
    p.add_argument("--shares", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0],
                   help="attention shares of the family members")
    p.add_argument("--seeds", type=non_negative_int, nargs="+", default=[0, 1], help="MQAR training seeds per member")
    p.add_argument("--steps", type=positive_int, help="MQAR training steps per model (default: TrainConfig's)")
    p.add_argument("--train-tokens", type=positive_int, help="MQAR tokens per training step (default: TrainConfig's)")
    p.add_argument("--train-batch", type=positive_int, help="fixed MQAR sequences per step instead of --train-tokens")
    p.add_argument("--init-std", type=float, help="weight init std of the MQAR models (default: TrainConfig's)")
    p.add_argument("--lr", type=float, help="MQAR peak learning rate (default: TrainConfig's)")
    p.add_argument("--mamba-lr-scale", type=float,
                   help="lr of the Mamba mixers relative to --lr in models with attention (default: TrainConfig's)")
    p.add_argument("--state-lr-scale", type=float,
                   help="lr of the other constant-state mixers (Gated DeltaNet, GLA) relative to --lr in models with "
                        "attention (default: TrainConfig's)")
    p.add_argument("--mqar-vocab", type=positive_int,
                   help="MQAR tokens = the MQAR models' vocabulary (default: TrainConfig's)")
    p.add_argument("--train-kv-pairs", type=positive_int, nargs="+",
                   help="key-value pair counts to train on (default: TrainConfig's)")
    p.add_argument("--kv-pairs", type=positive_int, nargs="+",
                   help="key-value pair counts to score (default: TrainConfig's)")
    p.add_argument("--eval-sequences", type=positive_int,
                   help="held-out MQAR sequences per pair count (default: TrainConfig's)")
    p.add_argument("--curriculum", type=float,
                   help="share of the MQAR steps over which the trained pair counts grow from the smallest to all "
                        "(0: all from the start; default: TrainConfig's)")
    p.add_argument("--lengths", type=positive_int, nargs="+", default=[2048, 8192],
                   help="prefill context lengths timed for every member")
    p.add_argument("--long-lengths", type=positive_int, nargs="*", default=[32768],
                   help="longer prefill lengths, timed only for --long-shares (an all-attention prefill there "
                        "takes minutes on a CPU)")
    p.add_argument("--long-shares", type=float, nargs="*", default=[0.0, 1.0],
                   help="members timed at --long-lengths (with checkpoints: all)")
    add_engine_args(p, ("max_batch_tokens",), max_batch_tokens=2048)  # the timed engine's prefill chunk (--chunk)
    p.add_argument("--repeats", type=positive_int, default=3, help="timed runs per length")
    p.add_argument("--long-repeats", type=positive_int, default=1, help="timed runs per long length")
    p.add_argument("--warmup", type=non_negative_int, default=1, help="untimed runs before each member's first length")
    p.add_argument("--max-spread", type=float, default=0.25,
                   help="re-measure a timing whose (max-min)/median exceeds this, then flag it")
    p.add_argument("--cache-gib", type=float, default=4.0, help="cache budget the sequences-that-fit column counts")
    p.add_argument("--kv-dtype", default=None,
                   help="memory columns: K/V storage (bfloat16, float16, float32, int8, fp8; default: --dtype)")
    p.add_argument("--state-dtype", default=None,
                   help="memory columns: Mamba state storage (float32, bfloat16, int8; default: float32)")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="weight and activation dtype")
    p.add_argument("--device", default="cpu", type=device_arg, help="where the models run (cpu, cuda, cuda:N)")
    p.add_argument("--threads", type=non_negative_int, default=0,
                   help="torch threads (0: one per CPU core this process may use)")
    p.add_argument("--output", help="folder for tradeoff.{json,csv,md,png} (default: out/tradeoff, with --teacher "
                                    "out/tradeoff_real)")
    p.add_argument("--lock", help="file to hold an exclusive flock on while timing (not while training), e.g. "
                                  "/tmp/bench.lock on a machine shared with other benchmarks")
    p.set_defaults(func=run)


def run(args) -> None:
    if args.teacher:
        return run_teacher(args)
    from ..eval import mqar
    from ..eval.tables import markdown
    from ..eval.tradeoff import run as run_tradeoff
    from ..eval.tradeoff_report import claim_lines, summary_table

    if args.checkpoints:
        from .eval import check_mmlu_dir

        check_mmlu_dir(args.tasks, args.mmlu_dir)
    given = {"steps": args.steps, "tokens_per_step": args.train_tokens, "batch_size": args.train_batch, "lr": args.lr,
             "mamba_lr_scale": args.mamba_lr_scale, "state_lr_scale": args.state_lr_scale,
             "vocab_size": args.mqar_vocab, "init_std": args.init_std,
             "train_kv_pairs": tuple(args.train_kv_pairs) if args.train_kv_pairs else None,
             "eval_kv_pairs": tuple(args.kv_pairs) if args.kv_pairs else None, "eval_sequences": args.eval_sequences,
             "curriculum": args.curriculum}
    try:
        train = mqar.TrainConfig(**{k: v for k, v in given.items() if v is not None})
        result, paths = run_tradeoff(
            checkpoints=args.checkpoints, tasks=args.tasks, num_fewshot=args.num_fewshot, limit=args.limit,
            mmlu_dir=args.mmlu_dir, eval_batch_size=args.batch_size, size=args.size, speed_size=args.speed_size,
            n_blocks=args.n_blocks, shares=tuple(args.shares), train=train, seeds=tuple(args.seeds),
            lengths=tuple(args.lengths), long_lengths=tuple(args.long_lengths), long_shares=tuple(args.long_shares),
            chunk=args.max_batch_tokens, repeats=args.repeats, long_repeats=args.long_repeats, warmup=args.warmup,
            max_spread=args.max_spread, cache_budget=int(args.cache_gib * 2**30), device=args.device,
            dtype=args.dtype, threads=args.threads, output=args.output or "out/tradeoff", lock=args.lock,
            kv_dtype=args.kv_dtype,
            state_dtype=args.state_dtype, mixer=args.mixer)
    except KeyError as e:  # recipes.attention_family's unknown --size / --speed-size; any other KeyError is a bug
        if not (e.args and str(e.args[0]).startswith("unknown size")):
            raise
        raise CLIError(f"{e.args[0]} (--size / --speed-size)") from e
    s = result.settings
    print(f"# {s['date']} UTC, {s['machine']['cpu']}, {s['threads']} threads, {s['dtype']}, wall {s['wall_s']} s")
    print(markdown(summary_table(result.members, s)))
    print("\n".join(["", *claim_lines(result.members, s), ""]))
    for kind, path in paths.items():
        print(f"wrote {kind}: {path}")


def run_teacher(args) -> None:
    """``--teacher``: the real family's report (hybrid.eval.real_tradeoff)."""
    import dataclasses
    from pathlib import Path

    from ..eval.real_tradeoff import BUDGETS
    from ..eval.real_tradeoff import run as run_real
    from ..eval.real_tradeoff_report import summary_table
    from ..eval.tables import markdown
    from ..pretrained_names import resolve
    from .eval import check_mmlu_dir

    args.teacher = str(resolve(args.teacher))  # a model name (smollm2-135m-instruct) -> its converted folder
    if not (Path(args.teacher) / "config.json").is_file():
        raise CLIError(f"--teacher {args.teacher} is not a checkpoint folder (no config.json); give a Llama-family "
                       f"folder, e.g. one transformers' save_pretrained wrote")
    check_mmlu_dir(["mmlu_local"], args.mmlu_dir)
    changes = {k: v for k, v in {"mmlu_limit": args.mmlu_limit, "data_tokens": args.data_tokens,
                                 "align_tokens": args.align_tokens, "kl_tokens": args.kl_tokens,
                                 "mmlu_subjects": tuple(args.subjects) if args.subjects else None}.items()
               if v is not None}
    budget = dataclasses.replace(BUDGETS[args.budget], **changes)
    result, paths = run_real(args.teacher, output=args.output or "out/tradeoff_real", budget=budget,
                             mmlu_dir=args.mmlu_dir, text_files=tuple(args.text_files), lock=args.lock,
                             threads=args.threads, speed=not args.no_speed)
    s = result["settings"]
    if args.no_speed:
        print(f"# accuracy measured for {len(result['members'])} members in {s['wall_s']} s (budget {budget.name}); "
              f"run the same command without --no-speed on a quiet machine to time them and write the report")
        return
    print(f"# {s['date']} UTC, {s['machine']['cpu']}, {s['threads']} threads, budget {budget.name}, "
          f"wall {s['wall_s']} s")
    print(markdown(summary_table(result["members"], list(budget.prefill_lengths))))
    for kind, path in paths.items():
        print(f"wrote {kind}: {path}")
