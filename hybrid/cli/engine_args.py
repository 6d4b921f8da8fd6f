"""The engine's command-line flags, defined once: :func:`add_engine_args` adds the ones a sub-command offers (with
its own defaults), :func:`engine_config` turns the parsed flags into a :class:`hybrid.EngineConfig`. Each flag's
``dest`` is the config field's name, which is how :meth:`EngineConfig.from_args` finds it; a value argparse
accepts but the config refuses (e.g. ``--max-prompt-tokens`` >= ``--max-model-len``) is one line naming the flag.

Speculative decoding is three flags (``--draft-model`` / ``--ngram``, ``--num-draft-tokens``) whose config needs the
loaded target model (the draft loads in its dtype and device): :func:`engine_config` takes the model for them."""

from __future__ import annotations

import argparse

from .common import byte_size, positive_int
from .errors import CLIError


def _kv_dtype(p, default):
    from ..kernels.kv_quant import KV_DTYPES

    p.add_argument("--kv-dtype", choices=sorted(KV_DTYPES), default=default,
                   help="K/V cache storage (int8 / fp8: per-token, per-KV-head scales; default: the model's dtype)")


def _state_dtype(p, default):
    from ..kernels.kv_quant import STATE_DTYPES

    p.add_argument("--state-dtype", choices=sorted(STATE_DTYPES), default=default,
                   help="Mamba SSM + conv state storage (int8: per-head scales; default: fp32 SSM state)")


def kv_pruning_arg(text: str):
    from ..cache.pruning import parse_policy

    try:
        return parse_policy(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _kv_pruning(p, default):
    p.add_argument("--kv-pruning", type=kv_pruning_arg, default=default, metavar="POLICY",
                   help="prune the KV cache: snapkv:budget=N[,window=32,kernel=7,pooling=max|avg] (prompt "
                        "compression) or streaming:sinks=4,window=1020[,renumber=1] (attention sinks + recent window; "
                        "renumber=1, the default, numbers positions within the cache as the paper does, 0 keeps "
                        "the real positions; default: no pruning)")


def _speculative(p, default):
    g = p.add_mutually_exclusive_group()
    g.add_argument("--draft-model", help="speculative decoding with this draft checkpoint folder (same vocabulary)")
    g.add_argument("--ngram", action="store_true", help="speculative decoding with n-gram prompt lookup drafts")
    p.add_argument("--num-draft-tokens", type=positive_int, default=4 if default is None else default,
                   help="draft tokens checked per step (with --draft-model or --ngram)")


def _int_flag(flag: str, help: str, *, metavar: str = "N", type=positive_int):
    def add(p, default):
        p.add_argument(flag, type=type, default=default, metavar=metavar, help=help)
    return add


def _switch(flag: str, help: str):
    def add(p, default):
        p.add_argument(flag, action="store_true", help=help)
    return add


def _max_batch_tokens(p, default):
    # --chunk: generate's and the tradeoff's older name for the same budget
    p.add_argument("--max-batch-tokens", "--chunk", dest="max_batch_tokens", type=positive_int, default=default,
                   metavar="N", help="token budget per engine step, shared by decodes, new requests and a chunk of a "
                                     "long prompt (longer prompts are prefilled in chunks of it)")


def _multi_step(p, default):
    p.add_argument("--multi-step", type=positive_int, default=default, metavar="K",
                   help=f"up to K greedy decode steps in one native call on a CPU (their tokens stream together; "
                        f"the same tokens as 1, one step a call; default {default})")


# field of EngineConfig -> how its flag is added; the order is the order of --help
FLAGS = {
    "max_seqs": _int_flag("--max-seqs", "sequences in flight (state slots)"),
    "max_batch_tokens": _max_batch_tokens,
    "long_prefill_tokens": _int_flag(
        "--long-prefill-tokens", "a prompt with more than N tokens left to prefill takes, each step, only the budget "
                                 "that decodes and newly arrived requests leave (default: --max-batch-tokens)"),
    "multi_step": _multi_step,
    "cache_bytes": _int_flag("--cache-bytes", "KV blocks + Mamba state slots, e.g. 256MiB or 8GiB", metavar="SIZE",
                             type=byte_size),
    "kv_dtype": _kv_dtype,
    "state_dtype": _state_dtype,
    "kv_pruning": _kv_pruning,
    "prefix_caching": _switch("--prefix-caching", "share prompt prefixes between requests (KV blocks + Mamba state "
                                                  "checkpoints; the same outputs)"),
    "compile": _switch("--compile", "torch.compile the engine's decode step (ignored on a CPU, where the native "
                                    "step is faster)"),
    "max_model_len": _int_flag(
        "--max-model-len", "the most tokens (prompt + new tokens) a request may have; longer ones are refused "
                           "(default: what the KV cache holds for one sequence; serve: at most the checkpoint's "
                           "max_position_embeddings)"),
    "max_prompt_tokens": _int_flag("--max-prompt-tokens", "refuse longer prompts (default: --max-model-len - 1)"),
    "speculative": _speculative,
}
# the flags' names as the config's error messages should say them
FLAG_NAMES = {"max_batch_tokens": "--max-batch-tokens", "speculative": "--draft-model / --ngram"}


def add_engine_args(p: argparse.ArgumentParser, names=tuple(FLAGS), **defaults) -> None:
    """Add the flags of the EngineConfig fields ``names`` to ``p``; ``defaults``: the sub-command's own defaults
    (otherwise EngineConfig's)."""
    from ..engine.config import EngineConfig

    unknown = sorted(set(names) - set(FLAGS)) + sorted(set(defaults) - set(names))
    if unknown:
        raise ValueError(f"add_engine_args: no engine flag for {unknown}; the flags are {sorted(FLAGS)}")
    base = EngineConfig()
    for name in names:
        FLAGS[name](p, defaults.get(name, None if name == "speculative" else getattr(base, name)))


def flag_name(field: str) -> str:
    return FLAG_NAMES.get(field, "--" + field.replace("_", "-"))


def engine_config(args, model=None, **overrides):
    """The EngineConfig of the parsed flags, ``overrides`` on top (what the sub-command decides itself); with
    ``model`` the speculative flags too. A value the config refuses is a CLIError naming the flag."""
    from ..engine.config import EngineConfig

    if "speculative" not in overrides and hasattr(args, "ngram"):
        if model is None:  # a sub-command offering the flags must pass its model, or they would be dropped silently
            raise TypeError("engine_config(args, model): the speculative flags need the target model")
        overrides["speculative"] = speculative_config(args, model)
    try:
        return EngineConfig.from_args(args, **overrides)
    except ValueError as e:
        text = str(e).replace("EngineConfig ", "")
        for field in FLAGS:  # `max_seqs=0` -> `--max-seqs 0`, where the flag was given
            if hasattr(args, field):
                text = text.replace(f"{field}=", f"{flag_name(field)} ")
        raise CLIError(text) from None


def speculative_config(args, model):
    """The SpeculativeConfig of ``--draft-model DIR`` / ``--ngram`` (``--num-draft-tokens k``), or None."""
    if args.draft_model is None and not args.ngram:
        return None
    from .. import from_pretrained
    from ..speculative import SpeculativeConfig

    if args.draft_model is not None and args.ngram:
        raise CLIError("give one of --draft-model DIR or --ngram, not both")
    try:
        if args.ngram:
            return SpeculativeConfig(method="ngram", num_tokens=args.num_draft_tokens)
        p = next(model.parameters())
        draft = from_pretrained(args.draft_model, dtype=p.dtype, device=p.device, verify=args.verify)
        return SpeculativeConfig(method="draft", draft_model=draft, num_tokens=args.num_draft_tokens)
    except ValueError as e:
        raise CLIError(f"speculative decoding: {e}") from e
