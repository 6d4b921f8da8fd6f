"""How the ``hybrid`` command reports a mistake: one line on stderr naming the problem and the fix, exit
code 2, no traceback (``HYBRID_DEBUG=1`` re-raises instead, for a developer who wants the stack)."""

from __future__ import annotations

import os
import sys

EXIT_USAGE = 2  # argparse's code for a bad command line; every mistake the user can fix exits with it
DEBUG_ENV = "HYBRID_DEBUG"

# optional dependency (top-level module) -> the extra that installs it
EXTRAS = {"lm_eval": "eval", "matplotlib": "eval", "datasets": "eval", "fastapi": "serve", "uvicorn": "serve",
          "jinja2": "serve", "prometheus_client": "serve", "transformers": "hf", "tokenizers": "hf",
          "triton": "triton", "mamba_ssm": "cuda", "causal_conv1d": "cuda", "flash_attn": "cuda", "torchao": "quant"}


class CLIError(Exception):
    """A mistake on the command line that the user can fix; the message names it and the fix."""


class CLIExit(SystemExit):
    """Exit code 2 with the message kept: ``str()`` is the message (what a caller of ``main`` in-process
    matches), ``code`` is 2 (what a shell sees; the line itself was already printed)."""

    def __init__(self, message: str):
        super().__init__(EXIT_USAGE)
        self.message = message

    def __str__(self) -> str:
        return self.message


def one_line(text: str) -> str:
    """A multi-line library message (e.g. a checkpoint's list of mismatched tensors) as one line."""
    return "; ".join(part.strip() for part in str(text).splitlines() if part.strip())


def fail(prog: str, message: str) -> CLIExit:
    """Print ``prog: message`` as one line on stderr; the exception to raise."""
    line = f"{prog}: {one_line(message)}"
    print(line, file=sys.stderr, flush=True)
    return CLIExit(line)


def missing_extra(e: ModuleNotFoundError) -> str | None:
    """The install hint for an optional dependency that is absent, or None if ``e`` is not one."""
    top = (e.name or "").split(".")[0]
    if top not in EXTRAS:
        return None
    return f"this needs {top}, which is not installed: pip install 'hybrid-lm[{EXTRAS[top]}]'"


def library_errors() -> tuple[type[BaseException], ...]:
    """The library's own errors a person can act on (all ValueErrors: configs, patterns, checkpoints,
    sampling values, cache sizes, MMLU folders), and the CLI's."""
    return (CLIError, ValueError)


def run_reporting(prog: str, func, args) -> None:
    """Run a sub-command; a mistake the user can fix becomes one line and exit code 2."""
    if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
        func(args)
        return
    try:
        func(args)
    except ModuleNotFoundError as e:
        hint = missing_extra(e)
        if hint is None:
            raise
        raise fail(prog, hint) from None
    except library_errors() as e:
        raise fail(prog, str(e)) from None
