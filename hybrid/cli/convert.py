"""``hybrid convert``: load any supported checkpoint folder and write it in another format."""

from __future__ import annotations

from .common import DTYPES, no_verify_flag


def add_parser(sub) -> None:
    p = sub.add_parser("convert", help="load any supported checkpoint folder and write it in another format")
    p.add_argument("src", help="checkpoint folder: ours, Hugging Face (Llama, Qwen2, Mistral, Mamba, Mamba2, ...) "
                               "or mamba_ssm; a llama.cpp .gguf file (llama, qwen2); or a model name "
                               "(smollm2-135m-instruct)")
    p.add_argument("dst", help="output folder")
    p.add_argument("--format", default="hybrid",
                   help="hybrid (ours), an export format (llama, mistral, qwen2, mamba, mamba2, ...), "
                        "or hf: the first Hugging Face format that represents the model exactly")
    p.add_argument("--dtype", default=None, choices=DTYPES,
                   help="cast the weights before writing (default: keep the checkpoint's)")
    no_verify_flag(p)
    p.set_defaults(func=run)


def run(args) -> None:
    import torch

    from .. import from_pretrained, save_pretrained
    from ..interop.gguf_file import is_gguf
    from ..interop.gguf_tokenizer import write_tokenizer_files
    from ..interop.io import copy_tokenizer_files
    from ..pretrained_names import resolve

    # CheckpointError / ConfigError are ValueErrors: one line "hybrid convert: ..." (see errors.run_reporting)
    src = resolve(args.src)
    model = from_pretrained(src, dtype=getattr(torch, args.dtype) if args.dtype else None, verify=args.verify)
    out = save_pretrained(model, args.dst, format=args.format)
    tok = write_tokenizer_files(src, out) if is_gguf(src) else copy_tokenizer_files(src, out)
    print(f"{args.src} -> {out} (format {args.format}; pattern {model.config.pattern!r}, "
          f"{model.num_parameters():,} parameters; tokenizer files: {', '.join(tok) or 'none'})")
