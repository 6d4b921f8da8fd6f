"""``hybrid distill``: a pretrained transformer distilled into hybrid students (one per attention share).

The data: text the teacher writes itself (:mod:`hybrid.distill.data`, ``--teacher-tokens``, cached under
``OUT/data``) plus the ``--data`` files; with ``--teacher-tokens 0`` the ``--data`` text files alone, tokenised
by the teacher's tokenizer, joined with EOS and cut into windows.
``torchrun --nproc-per-node N -m hybrid.cli distill ...`` splits each global batch over N processes."""

from __future__ import annotations

import math
import os
from pathlib import Path

from .common import non_negative_int, positive_int
from .errors import CLIError


def add_parser(sub) -> None:
    p = sub.add_parser("distill", help="distil a transformer checkpoint into Mamba-2 / Gated DeltaNet hybrids")
    p.add_argument("teacher", help="a Llama-family transformer: checkpoint folder or model name "
                                   "(smollm2-135m-instruct)")
    p.add_argument("--share", type=float, nargs="+", required=True,
                   help="attention shares to make students for, each in [0, 1] (1 is the teacher itself)")
    p.add_argument("--mixer", choices=("mamba2", "gdn"), default="mamba2", help="what replaces attention")
    p.add_argument("--out", required=True, help="output folder (students, alignment, manifest.json)")
    p.add_argument("--data", nargs="*", default=[], help="local text files to train on")
    p.add_argument("--teacher-tokens", type=non_negative_int, default=None,
                   help="tokens of teacher-written text (default: what the budget needs; "
                        "0: the --data files alone)")
    p.add_argument("--align-tokens", type=non_negative_int, default=65536,
                   help="tokens of layer alignment (once for all shares)")
    p.add_argument("--kl-tokens", type=non_negative_int, default=32768, help="tokens of end-to-end KL per student")
    p.add_argument("--keep", choices=("worst", "even"), default="worst",
                   help="which attention layers stay: where the replacement aligned worst, or evenly spaced")
    p.add_argument("--seq-len", type=positive_int, default=512, help="tokens per sequence")
    p.add_argument("--batch", type=positive_int, default=4, help="sequences per step (global, over all processes)")
    p.add_argument("--threads", type=non_negative_int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                   help="training dtype; auto: bf16 (fp32 master weights) where the CPU has native bf16")
    p.add_argument("--train-all", action="store_true", help="KL stage trains MLPs, norms and embeddings too")
    p.add_argument("--kl-attention", choices=("train", "freeze"), default=None,
                   help="whether the KL stage trains the kept attention layers or keeps them the teacher's "
                        "(default: hybrid.distill.kl.TRAIN_ATTENTION, chosen by measurement; docs/distill.md)")
    p.add_argument("--align-clip", choices=("global", "per-layer"), default=None,
                   help="alignment gradient clip: one norm over all replacements, or each alone "
                        "(default: hybrid.distill.align.PER_LAYER_CLIP; docs/distill.md)")
    p.add_argument("--align-lr", type=float, default=1e-3, help="peak learning rate of the alignment")
    p.add_argument("--kl-lr", type=float, default=3e-4, help="peak learning rate of the KL stage")
    p.add_argument("--no-peak", action="store_true", help="skip the matmul peak probe (no share of peak reported)")
    p.add_argument("--no-compile", action="store_true",
                   help="train the mixers eagerly, not through torch.compile (default: compiled where a C++ "
                        "compiler is found; HYBRID_DISTILL_COMPILE=0 does the same)")
    p.set_defaults(func=run)


def _file_batches(teacher: str, files: list[str], seq_len: int, batch: int):
    """``batches(start)`` over the text files alone: tokenised, joined with EOS, cut into ``seq_len`` windows
    taken in order, wrapping around (batch ``s`` is the same for every call)."""
    import torch

    from ..tokenizer import load_tokenizer

    tok = load_tokenizer(teacher)
    ids: list[int] = []
    for f in files:
        ids += tok.encode(Path(f).read_text(encoding="utf-8"), add_special_tokens=False) + [tok.eos_token_id]
    windows = len(ids) // seq_len
    if windows < batch:
        raise ValueError(f"the --data files hold {len(ids)} tokens, fewer than one batch of {batch} x {seq_len}; "
                         f"give more text or a smaller --batch / --seq-len")
    grid = torch.tensor(ids[:windows * seq_len], dtype=torch.int64).view(windows, seq_len)

    def batches(start: int = 0):
        step = start
        while True:
            rows = [(step * batch + i) % windows for i in range(batch)]
            yield grid[rows]
            step += 1
    return batches, len(ids)


def _teacher_batches(args, needed: int):
    from ..distill import data

    source = data.build_token_source(args.teacher, cache_dir=Path(args.out) / "data", n_tokens=needed,
                                     text_files=args.data)

    def batches(start: int = 0):
        return data.token_batches(source, seq_len=args.seq_len, batch_size=args.batch, start=start)
    return batches, len(source)


def run(args) -> None:
    import torch

    from ..distill.pipeline import default_dtype, distill_family
    from ..pretrained_names import resolve

    args.teacher = str(resolve(args.teacher))  # a model name -> its converted folder
    if not Path(args.teacher).is_dir():
        raise CLIError(f"teacher {args.teacher} is not a checkpoint folder; give a Llama-family checkpoint folder "
                       f"or a model name (hybrid.NAMED_MODELS)")
    per_step = args.batch * args.seq_len
    needed = (1 + math.ceil(args.align_tokens / per_step) + math.ceil(args.kl_tokens / per_step)) * per_step
    teacher_tokens = args.teacher_tokens if args.teacher_tokens is not None else needed
    if teacher_tokens > 0:
        batches, n = _teacher_batches(args, teacher_tokens)
    elif args.data:
        batches, n = _file_batches(args.teacher, args.data, args.seq_len, args.batch)
    else:
        raise ValueError("no data: give --data FILE ... (local text) or --teacher-tokens N > 0")
    dtype = {"auto": None, "bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    if args.threads:
        torch.set_num_threads(args.threads)
    peaks = None
    if not args.no_peak:
        from ..eval.timing import training_peaks  # the CLI may use eval; the library does not

        peaks = training_peaks(dtype or default_dtype())
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"data: {n:,} tokens; {needed:,} needed for the budget "
              f"({'wrapping around' if n < needed else 'one pass'})")
    m = distill_family(args.teacher, args.out, shares=args.share, mixer=args.mixer, batches=batches,
                       align_tokens=args.align_tokens, kl_tokens=args.kl_tokens, keep=args.keep, dtype=dtype,
                       train_all=args.train_all, align_lr=args.align_lr, kl_lr=args.kl_lr, peak_flops=peaks,
                       train_attention=None if args.kl_attention is None else args.kl_attention == "train",
                       per_layer_clip=None if args.align_clip is None else args.align_clip == "per-layer",
                       compile=False if args.no_compile else None)
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun, rank 0 reports
        return
    b = m.budget
    print(f"alignment ({b['dtype']}): {b['align']['tokens']:,} tokens, {b['align']['tokens_per_s']} tok/s, "
          f"{b['align']['GFLOP/s']} GFLOP/s ({_pct(b['align']['of_peak'])} of peak); per-layer loss "
          + " ".join(f"{x:.3f}" for x in m.align_losses))
    for share, folder in m.students.items():
        kl, stage = m.kl.get(share), b["kl"].get(f"{share:g}")
        if kl is None:
            print(f"share {share:g}: {folder} (the teacher)")
            continue
        print(f"share {share:g}: {folder} kept attention {m.kept_layers[share]}; KL {kl['kl_before']:.4f} -> "
              f"{kl['kl_after']:.4f} on held-out; {stage['tokens_per_s']} tok/s, {stage['GFLOP/s']} GFLOP/s "
              f"({_pct(stage['of_peak'])} of peak)")
    print(f"manifest: {Path(args.out) / 'manifest.json'}")


def _pct(x) -> str:
    return f"{100 * x:.1f}%" if x is not None else "n/a"
