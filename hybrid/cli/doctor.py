"""``hybrid doctor``: which kernel backend each op uses here, and why not the others."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("doctor", help="which kernel backend each op uses here, and why not the others")
    p.set_defaults(func=run)


def run(args) -> None:
    from ..kernels.doctor import report

    print(report())
