"""The sampling flags ``generate`` and ``chat`` share. A flag left out takes the checkpoint's default (its
generation_config.json: temperature, top_k, top_p, min_p, repetition_penalty, max_new_tokens), else the
fallback named in its help (greedy, filters off)."""

from __future__ import annotations

import argparse

from .errors import CLIError


def add_sampling_flags(p: argparse.ArgumentParser, *, max_new_tokens: int) -> None:
    p.set_defaults(max_new_tokens_fallback=max_new_tokens)
    model = "default: the model's generation_config.json, else"
    p.add_argument("--max-new-tokens", type=int, default=None, help=f"tokens to generate at most ({model} "
                                                                    f"{max_new_tokens})")
    p.add_argument("--temperature", type=float, default=None, help=f"0 is greedy ({model} 0)")
    p.add_argument("--top-k", type=int, default=None, help=f"keep the k most likely tokens, 0 is off ({model} 0)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling: keep the most likely tokens whose "
                                                             f"probabilities sum to p, in (0, 1] ({model} 1: off)")
    p.add_argument("--min-p", type=float, default=None, help="drop tokens less likely than min_p x the most likely, "
                                                             f"in [0, 1] ({model} 0: off)")
    p.add_argument("--repetition-penalty", type=float, default=None, help=f"1 is off ({model} 1)")
    p.add_argument("--stop", nargs="*", help="stop when the text contains any of these strings")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (and a --recipe's weights; default: 0 for "
                                                          "the weights, a random draw for sampling)")


def sampling_params(args, tokenizer, extra_stop: tuple[str, ...] = ()):
    """The SamplingParams of the flags, the checkpoint's defaults (``tokenizer.sampling_defaults``) filling
    those left out; a bad value is one line naming it."""
    from ..generation import sampling_values
    from ..sampling import SamplingParams

    values = sampling_values(tokenizer, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                             min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                             max_new_tokens=args.max_new_tokens)
    values.setdefault("max_new_tokens", args.max_new_tokens_fallback)
    try:
        return SamplingParams(seed=args.seed, stop=tuple(args.stop or ()) + extra_stop, **values)
    except ValueError as e:
        raise CLIError(str(e)) from None


def check_sampling_flags(args) -> None:
    """Refuse a bad sampling flag before any model is loaded (with the fallbacks for what is left out)."""
    from ..generation import SAMPLING_FALLBACKS

    class Fallbacks:
        sampling_defaults = SAMPLING_FALLBACKS

    sampling_params(args, Fallbacks)
