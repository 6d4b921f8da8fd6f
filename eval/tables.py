"""Result rows (lists of flat dicts) to markdown, CSV and JSON."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from ..report import format_table


def columns(rows: list[dict]) -> list[str]:
    """Every key that any row has, in first-seen order."""
    keys: dict[str, None] = {}
    for r in rows:
        keys.update(dict.fromkeys(r))
    return list(keys)


def markdown(rows: list[dict]) -> str:
    """A markdown table of ``rows``; keys a row lacks show as empty cells."""
    keys = columns(rows)
    return format_table([{k: r.get(k, "") for k in keys} for r in rows])


def write_csv(rows: list[dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns(rows), restval="")
        writer.writeheader()
        writer.writerows(rows)
    return path


def write_rows(rows: list[dict], path: str | Path, **header) -> Path:
    """``rows`` as ``.csv`` or ``.json`` (chosen by the suffix; JSON also stores ``header``)."""
    path = Path(path)
    if path.suffix == ".csv":
        return write_csv(rows, path)
    if path.suffix == ".json":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**header, "rows": rows}, indent=2) + "\n")
        return path
    raise ValueError(f"output {path} must end in .json or .csv")
