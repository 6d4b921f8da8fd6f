"""benchmarks/mmlu_parity.py's comparison: choices per question from logged lm-eval samples, disagreements named."""

from benchmarks.mmlu_parity import compare


def _sample(doc_id, lls, target, choices=("a", "bb", "ccc", "dddd")):
    return {"doc_id": doc_id, "doc": {"choices": list(choices)}, "target": target,
            "filtered_resps": [(ll, False) for ll in lls]}


def test_compare_counts_agreements_and_names_disagreements():
    task = "mmlu_local_cloze_x"
    hf = [_sample(0, [-1.0, -2.0, -3.0, -4.0], 0), _sample(1, [-5.0, -1.0, -1.0005, -9.0], 1)]
    ours = [_sample(0, [-1.0, -2.0, -3.0, -4.0], 0), _sample(1, [-5.0, -1.0006, -1.0, -9.0], 1)]
    report = compare({"hf": {"samples": {task: hf}}, "hybrid": {"samples": {task: ours}}}, [task])[task]
    acc = report["acc"]
    assert acc["questions"] == 2 and acc["agree"] == 1 and acc["hf_acc"] == 1.0 and acc["hybrid_acc"] == 0.5
    (d,) = acc["disagreements"]
    assert (d["doc_id"], d["hf_choice"], d["hybrid_choice"], d["near_tie"]) == (1, 1, 2, True)
    assert abs(acc["max_abs_ll_diff"] - 0.0006) < 1e-9
    # acc_norm divides by the continuation's bytes (" " + choice): doc 0's choice moves with it
    assert report["acc_norm"]["questions"] == 2


def test_multiple_choice_tasks_have_acc_only():
    task = "mmlu_local_x"
    s = [_sample(0, [-1.0, -2.0, -3.0, -4.0], 0)]
    report = compare({"hf": {"samples": {task: s}}, "hybrid": {"samples": {task: s}}}, [task])[task]
    assert set(report) == {"acc"} and report["acc"]["agree"] == 1
