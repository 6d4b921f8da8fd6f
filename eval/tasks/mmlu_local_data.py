"""Reads MMLU questions from local files for the ``mmlu_local`` tasks (no dataset hub).

lm-eval imports this file on its own (not as part of the package), so it uses only the standard
library and ``datasets``. A folder in MMLU's layout holds, per subject, ``dev/<subject>_dev.csv``
(the few-shot examples) and ``test/<subject>_test.csv``, or the same names ending in ``.jsonl``.
CSV rows are ``question,choice0,choice1,choice2,choice3,answer``, with or without that header
row (the original release has none); ``answer`` is the index 0-3 or the letter A-D. JSON lines
carry ``question``, ``choices`` (four strings) or ``choice0``..``choice3``, and ``answer``.
Every field is read as text: some choices are literally ``None``.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
from pathlib import Path

import datasets
from datasets.table import InMemoryTable

ENV_VAR = "HYBRID_MMLU_DIR"
# A source checkout keeps MMLU beside the repository: <repo>/../shared/data/mmlu. An installed package has no
# such neighbour (site-packages/shared/... would be a guess), so there the folder must be given.
_REPO = Path(__file__).resolve().parents[2]
DEFAULT_DIR = _REPO / ".." / "shared" / "data" / "mmlu" if (_REPO / "pyproject.toml").is_file() else None
HEADER = ["question", "choice0", "choice1", "choice2", "choice3", "answer"]
LETTERS = "ABCD"


class MMLUDataError(ValueError):
    """An MMLU folder or file that cannot be read as MMLU questions."""


def resolve_dir(mmlu_dir: str | os.PathLike | None = None) -> Path:
    """The MMLU folder: ``mmlu_dir`` if given, else $HYBRID_MMLU_DIR, else (in a source checkout only)
    ../shared/data/mmlu beside the repository."""
    chosen = mmlu_dir or os.environ.get(ENV_VAR) or DEFAULT_DIR
    if chosen is None:
        raise MMLUDataError(
            f"no MMLU folder given: pass `hybrid eval --mmlu-dir DIR` (a folder holding dev/ and test/), set "
            f"${ENV_VAR}, or with lm_eval --metadata '{{\"mmlu_dir\": \"DIR\"}}'")
    path = Path(chosen).expanduser().resolve()
    if not path.is_dir():
        raise MMLUDataError(
            f"MMLU folder {path} does not exist; point to one holding dev/ and test/ with "
            f"`hybrid eval --mmlu-dir DIR`, lm_eval --metadata '{{\"mmlu_dir\": \"DIR\"}}' or ${ENV_VAR}")
    return path


def _answer_index(raw: str, where: str) -> int:
    raw = raw.strip()
    if raw in ("0", "1", "2", "3"):
        return int(raw)
    if raw.upper() in LETTERS and len(raw) == 1:
        return LETTERS.index(raw.upper())
    raise MMLUDataError(f"{where}: answer {raw!r} is neither an index 0-3 nor a letter A-D")


def _doc(question: str, choices: list[str], answer: str, subject: str, where: str) -> dict:
    if len(choices) != 4:
        raise MMLUDataError(f"{where}: expected 4 choices, got {len(choices)}")
    return {"question": question, "subject": subject, "choices": [str(c) for c in choices],
            "answer": _answer_index(str(answer), where)}


def read_csv(path: Path, subject: str) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))
    if rows and [c.strip() for c in rows[0]] == HEADER:
        rows = rows[1:]
    docs = []
    for i, row in enumerate(rows, start=1):
        where = f"{path} row {i}"
        if len(row) != 6:
            raise MMLUDataError(f"{where}: expected 6 fields ({','.join(HEADER)}), got {len(row)}")
        docs.append(_doc(row[0], row[1:5], row[5], subject, where))
    return docs


def read_jsonl(path: Path, subject: str) -> list[dict]:
    docs = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path} line {i}"
            rec = json.loads(line)
            choices = rec["choices"] if "choices" in rec else [rec.get(f"choice{k}") for k in range(4)]
            if "question" not in rec or "answer" not in rec or any(c is None for c in choices):
                raise MMLUDataError(f"{where}: needs question, choices (or choice0..choice3) and answer")
            docs.append(_doc(str(rec["question"]), choices, rec["answer"], subject, where))
    return docs


def read_split(root: Path, subject: str, split: str) -> list[dict]:
    for ext, reader in ((".csv", read_csv), (".jsonl", read_jsonl)):
        path = root / split / f"{subject}_{split}{ext}"
        if path.is_file():
            docs = reader(path, subject)
            if not docs:
                raise MMLUDataError(f"{path} holds no questions")
            return docs
    raise MMLUDataError(f"no {split}/{subject}_{split}.csv or .jsonl under {root}")


def load_subject(subject: str, mmlu_dir: str | None = None, **task_metadata) -> dict[str, datasets.Dataset]:
    """The ``test`` and ``dev`` splits of one subject. lm-eval calls this with every task metadata
    entry (version, model args, ...) as keywords; only ``mmlu_dir`` matters here."""
    root = resolve_dir(mmlu_dir)
    return {split: as_dataset(read_split(root, subject, split)) for split in ("test", "dev")}


def as_dataset(docs: list[dict]) -> datasets.Dataset:
    """``datasets.Dataset.from_list(docs)``, named by a digest of the rows. ``from_list`` names a new dataset by
    pickling its rows through dill (for the 114 splits of all of MMLU, a sixth of a short ``hybrid eval`` run);
    the rows' JSON digest identifies them as well (the fingerprint names the dataset in ``datasets``' caches)."""
    table = InMemoryTable.from_pylist(docs)
    digest = hashlib.sha256(json.dumps(docs, sort_keys=True).encode()).hexdigest()[:16]
    return datasets.Dataset(table, fingerprint=f"mmlu_local-{digest}")
