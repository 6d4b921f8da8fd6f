"""Flags and helpers several sub-commands share: which model (recipe or checkpoint folder), dtype and
device, threads, byte sizes (the engine's own flags: :mod:`.engine_args`). Validation happens here, so a wrong
value is one line naming the flag (see :mod:`.errors`), never a traceback from deep inside torch."""

from __future__ import annotations

import argparse
import difflib
import sys

from .errors import CLIError

DTYPES = ["float32", "bfloat16", "float16"]


def device_arg(text: str) -> str:
    """``--device``: a torch device string this machine can run on (checked when the flags are parsed)."""
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device; give cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        why = "was built without CUDA" if torch.version.cuda is None else "sees no CUDA device"
        raise argparse.ArgumentTypeError(f"{text}: this torch ({torch.__version__}) {why}; use --device cpu or "
                                         "install a CUDA build of torch")
    return text


def _parsed(text: str, cast, what: str):
    """``text`` as ``cast`` (int or float), or argparse's one-line error naming ``what`` it is not."""
    try:
        return cast(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None


def positive_int(text: str) -> int:
    value = _parsed(text, int, "an integer")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = _parsed(text, int, "an integer")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    value = _parsed(text, float, "a number")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = _parsed(text, float, "a number")
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def port_number(text: str) -> int:
    """``--port``: a TCP port, 0 (any free one) to 65535."""
    value = _parsed(text, int, "a port number")
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0-65535, got {value}")
    return value


def add_dtype_device(p: argparse.ArgumentParser, *, device_help: str = "where the model runs (cpu, cuda, cuda:N)"):
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="weight and activation dtype")
    p.add_argument("--device", default="cpu", type=device_arg, help=device_help)
    from ..quantize import METHODS

    p.add_argument("--quantize", choices=list(METHODS), default=None,
                   help="torchao quantisation of the linear layers (hybrid.quantize): weight-only int8wo / int4wo "
                        "(int4wo on a CPU: torchao's prototype int4 format), int8 activations too int8dq / 8da4w")
    no_verify_flag(p)


def no_verify_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="load checkpoint folders without checking their weights' checksums and finite values "
                        "(a damaged file is refused by default; see docs/checkpoints.md)")


def quantized(model, args, where: str = "the model"):
    """``model`` quantised as ``--quantize`` asks (in place), or as it is. A checkpoint folder saved quantised
    loads quantised without the flag; a ``--quantize`` naming another method is refused."""
    method = getattr(args, "quantize", None)
    done = getattr(model, "quantization", None)
    if done is not None and method and method != done:
        raise CLIError(f"{where} is already {done}-quantised, so --quantize {method} cannot apply: drop "
                       f"--quantize (it loads as {done}), or give the unquantised checkpoint")
    if not method or done == method:
        return model
    from ..quantize import quantize

    try:
        return quantize(model, method)
    except ImportError as e:
        raise CLIError(f"--quantize needs torchao: pip install 'hybrid-lm[quant]' ({e})") from None
    except ValueError as e:
        raise CLIError(str(e)) from None


def recipe_config(name: str):
    """The recipe's HybridConfig, or one line naming the closest recipe names."""
    from .. import recipes

    known = recipes.names()
    if name not in known:
        close = difflib.get_close_matches(name, known, n=3)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise CLIError(f"unknown recipe {name!r}; {hint}`hybrid info --list` lists them")
    return recipes.get(name)


def models_from_args(args) -> dict:
    """The models of ``--recipe`` (random weights; ``all-small``: every small recipe) and ``--model`` folders."""
    import torch

    from .. import from_pretrained, recipes
    from ..model import HybridLM

    drop_compile_on_cpu(args)
    dtype = getattr(torch, args.dtype)
    models = {}
    names = recipes.names() if args.recipe == ["all-small"] else args.recipe or []
    if args.recipe == ["all-small"]:
        names = [n for n in names if n.endswith("-small")]
    for name in progress(names, "building models"):
        config = recipe_config(name)
        with torch.device(args.device):
            models[name] = quantized(HybridLM(config).to(dtype).eval(), args)
    for path in args.model or []:
        model = from_pretrained(path, dtype=dtype, device=args.device, verify=args.verify)
        models[path] = quantized(model, args, f"--model {path}")
    if not models:
        raise CLIError("give --recipe NAME (or all-small) and/or --model DIR")
    return models


def progress(items, desc: str):
    """``items`` with a tqdm bar on stderr when there are several (``all-small`` builds a dozen models and
    takes tens of seconds); a single item goes without one."""
    from tqdm import tqdm

    items = list(items)
    return tqdm(items, desc=desc, unit="model", file=sys.stderr, disable=len(items) < 3, leave=False)


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--recipe", nargs="*", help="recipe names (see `hybrid info --list`), or all-small")
    p.add_argument("--model", nargs="*", help="checkpoint folders")
    add_dtype_device(p)


def engine_model(args, *, seed: int):
    """The model and tokenizer of ``generate`` / ``serve``: a checkpoint folder (its tokenizer.json if any,
    else bytes) or a recipe with random weights drawn from ``seed`` (byte tokenizer); threads set."""
    import torch

    from .. import from_pretrained
    from ..model import HybridLM
    from ..tokenizer import ByteTokenizer, load_tokenizer

    if (args.model is None) == (args.recipe is None):
        raise CLIError("give exactly one of --model DIR or --recipe NAME")
    if args.threads:
        torch.set_num_threads(args.threads)
    drop_compile_on_cpu(args)
    dtype = getattr(torch, args.dtype)
    if args.recipe:
        config = recipe_config(args.recipe)
        torch.manual_seed(seed)  # a recipe has random weights; the seed makes them reproducible
        return quantized(HybridLM(config).to(device=args.device, dtype=dtype).eval(), args), load_tokenizer(None)
    model = from_pretrained(args.model, dtype=dtype, device=args.device, verify=args.verify)
    tokenizer = load_tokenizer(args.model)
    if isinstance(tokenizer, ByteTokenizer) and model.config.vocab_size > ByteTokenizer.vocab_size:
        print(f"note: {args.model} has no tokenizer.json, so the prompt is read as UTF-8 bytes and generated ids "
              f"past them show as <unk:ID>; copy the model's tokenizer.json into the folder for text", file=sys.stderr)
    return quantized(model, args, f"--model {args.model}"), tokenizer


def drop_compile_on_cpu(args) -> None:
    """``--compile`` on a CPU: ignored, with a one-line note. The default CPU decode runs the native C step
    (kernels/native), which torch.compile's graphs do not reach: a compiled step there is slower, recompiles per
    batch and block-table shape, and costs tens of seconds of compiling. On CUDA --compile stays."""
    import torch

    if getattr(args, "compile", False) and torch.device(args.device).type == "cpu":
        print("note: --compile is ignored on a CPU: the default native decode step is faster there; it applies "
              "with --device cuda", file=sys.stderr, flush=True)
        args.compile = False


def byte_size(text: str) -> int:
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


def threads_flag(p: argparse.ArgumentParser, zero: str = "torch's default") -> None:
    p.add_argument("--threads", type=non_negative_int, default=0, help=f"torch threads (0: {zero})")
