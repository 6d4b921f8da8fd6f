"""The ``hybrid`` command line: one sub-command per job, one module per sub-command.

``main`` builds the parser from each module's ``add_parser`` and runs the chosen command's ``run``; a mistake
the user can fix (unknown recipe, missing folder, bad sampling value, CUDA asked for and absent, a missing
optional extra, any of the library's ValueErrors) is one line on stderr and exit code 2 (:mod:`.errors`)."""

from __future__ import annotations

import argparse
import sys

from . import bench, chat, convert, distill, doctor, generate, info, serve, tradeoff
from . import eval as eval_command
from .common import byte_size as _byte_size  # noqa: F401  (tests and callers use the old names)
from .engine_args import speculative_config as _speculative  # noqa: F401
from .errors import CLIExit, one_line, run_reporting

COMMANDS = (info, bench, eval_command, tradeoff, convert, generate, chat, serve, doctor, distill)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults shown after each option's help, except where there is nothing to show (None, a flag that is
    off) or the help already says what the default is."""

    def _get_help_string(self, action):
        text = action.help or ""
        nothing = action.default is None or action.default is False or action.default is argparse.SUPPRESS
        if nothing or "default" in text or not action.option_strings:
            return text
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse that reports a bad command line in one line (problem, then where the help is), exit code 2."""

    def __init__(self, *a, **k):
        k.setdefault("formatter_class", HelpFormatter)
        super().__init__(*a, **k)

    def error(self, message: str):
        line = f"{self.prog}: {one_line(message)} (see `{self.prog} --help`)"
        print(line, file=sys.stderr, flush=True)
        raise CLIExit(line)


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = Parser(prog="hybrid", description="Build, run, serve and evaluate hybrid attention / Mamba language "
                    "models. `hybrid COMMAND --help` lists a command's options.")
    parser.add_argument("--version", action="version", version=f"hybrid-lm {__version__}",
                        help="print the installed version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    from ..kernels.host_memory import keep_freed_memory

    args = build_parser().parse_args(argv)
    keep_freed_memory()  # the CLI owns its process: large temporaries reuse mapped memory (see host_memory)
    run_reporting(f"hybrid {args.command}", checked_run, args)


def checked_run(args) -> None:
    """The command, after the HYBRID_* variables it will read are checked against its device."""
    from .environment import check_environment

    check_environment(getattr(args, "device", None) or "cpu", backend_usable=args.command != "doctor")
    args.func(args)


if __name__ == "__main__":
    main(sys.argv[1:])
