"""mmlu_local: MMLU questions from local CSV / jsonl files, with lm-eval's mmlu prompt."""

import json
import os

import pytest
from hybrid.eval.tasks import TASKS_DIR
from hybrid.eval.tasks.mmlu_local_data import DEFAULT_DIR, ENV_VAR, MMLUDataError, as_dataset, load_subject

ROWS = [
    ["What is 1 + 1?", "1", "2", "3", "None", "1"],
    ['A "quoted", comma question?', "None", "yes, really", "no", "maybe", "0"],
]


def write_csv(root, subject, rows, header=True, test_rows=None):
    """MMLU's CSV layout: ``rows`` as the dev split (the few-shot examples) and as the test split, or ``test_rows``
    there where given."""
    for split in ("dev", "test"):
        (root / split).mkdir(parents=True, exist_ok=True)
        lines = ["question,choice0,choice1,choice2,choice3,answer"] if header else []
        for r in (test_rows if split == "test" and test_rows is not None else rows):
            lines.append(",".join('"' + c.replace('"', '""') + '"' if ("," in c or '"' in c) else c for c in r))
        (root / split / f"{subject}_{split}.csv").write_text("\n".join(lines) + "\n")


def test_reads_mmlu_csv_layout_with_literal_none(tmp_path):
    write_csv(tmp_path, "toy", ROWS)
    data = load_subject("toy", mmlu_dir=str(tmp_path), version=1.0)  # lm-eval passes extra metadata
    test = list(data["test"])
    assert [d["question"] for d in test] == [ROWS[0][0], ROWS[1][0]]
    assert test[0]["choices"] == ["1", "2", "3", "None"] and test[0]["answer"] == 1
    assert test[1]["choices"] == ["None", "yes, really", "no", "maybe"] and test[1]["answer"] == 0
    assert len(data["dev"]) == 2 and test[0]["subject"] == "toy"


def test_a_split_is_the_dataset_from_list_makes_named_by_its_rows(tmp_path):
    import datasets

    write_csv(tmp_path, "toy", ROWS, test_rows=ROWS[:1])
    data = load_subject("toy", mmlu_dir=str(tmp_path))
    want = datasets.Dataset.from_list(list(data["test"]))
    assert data["test"].features == want.features and data["test"].to_list() == want.to_list()
    assert data["test"]._fingerprint == as_dataset(list(data["test"]))._fingerprint  # the same rows, the same name
    assert data["test"]._fingerprint != data["dev"]._fingerprint  # other rows, another name


def test_reads_headerless_csv_with_letter_answers(tmp_path):
    write_csv(tmp_path, "toy", [r[:5] + ["B"] for r in ROWS], header=False)
    assert [d["answer"] for d in load_subject("toy", mmlu_dir=str(tmp_path))["test"]] == [1, 1]


def test_reads_jsonl(tmp_path):
    for split in ("dev", "test"):
        (tmp_path / split).mkdir()
        recs = [{"question": "Q1", "choices": ["a", "b", "None", "d"], "answer": 2},
                {"question": "Q2", "choice0": "w", "choice1": "x", "choice2": "y", "choice3": "z", "answer": "3"}]
        (tmp_path / split / f"toy_{split}.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    test = list(load_subject("toy", mmlu_dir=str(tmp_path))["test"])
    assert test[0]["choices"] == ["a", "b", "None", "d"] and test[0]["answer"] == 2
    assert test[1]["choices"] == ["w", "x", "y", "z"] and test[1]["answer"] == 3


def test_bad_inputs_say_what_is_wrong(tmp_path, monkeypatch):
    monkeypatch.delenv("HYBRID_MMLU_DIR", raising=False)
    with pytest.raises(MMLUDataError, match="--mmlu-dir"):
        load_subject("toy", mmlu_dir=str(tmp_path / "missing"))
    write_csv(tmp_path, "toy", [ROWS[0][:5] + ["7"]])
    with pytest.raises(MMLUDataError, match="answer '7'"):
        load_subject("toy", mmlu_dir=str(tmp_path))
    with pytest.raises(MMLUDataError, match="no test/other_test.csv or .jsonl"):
        load_subject("other", mmlu_dir=str(tmp_path))
    write_csv(tmp_path, "toy", ROWS)
    monkeypatch.setenv("HYBRID_MMLU_DIR", str(tmp_path))
    assert len(load_subject("toy")["test"]) == 2  # the environment variable names the folder


def test_task_prompt_matches_lm_eval_mmlu(tmp_path):
    from lm_eval.tasks import TaskManager

    write_csv(tmp_path, "anatomy", ROWS)
    tm = TaskManager(include_path=str(TASKS_DIR), include_defaults=False, metadata={"mmlu_dir": str(tmp_path)})
    assert {"mmlu_local", "mmlu_local_stem", "mmlu_local_anatomy"} <= set(tm.all_tasks)
    assert sum(t.startswith("mmlu_local_") and not t.startswith("mmlu_local_cloze") and t.count("_") >= 2
               for t in tm.all_subtasks) == 57
    task = tm.load(["mmlu_local_anatomy"])["tasks"]["mmlu_local_anatomy"]
    task.set_config(key="num_fewshot", value=1)
    doc = task.test_docs()[1]
    prompt = task.fewshot_context(doc, num_fewshot=1)
    assert prompt == ("The following are multiple choice questions (with answers) about anatomy.\n\n"
                      "What is 1 + 1?\nA. 1\nB. 2\nC. 3\nD. None\nAnswer: B\n\n"
                      'A "quoted", comma question?\nA. None\nB. yes, really\nC. no\nD. maybe\nAnswer:')
    assert task.doc_to_choice(doc) == ["A", "B", "C", "D"] and task.doc_to_target(doc) == 0


REAL_MMLU = os.environ.get(ENV_VAR) or (str(DEFAULT_DIR) if DEFAULT_DIR.is_dir() else None)


@pytest.mark.skipif(REAL_MMLU is None, reason=f"no MMLU under ../shared/data/mmlu or ${ENV_VAR}")
def test_reads_the_real_mmlu_files():
    data = load_subject("abstract_algebra", mmlu_dir=REAL_MMLU)
    assert len(data["dev"]) == 5 and len(data["test"]) == 100
    assert all(len(d["choices"]) == 4 and 0 <= d["answer"] <= 3 for d in data["test"])
