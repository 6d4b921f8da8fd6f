"""Does our lm-eval model choose what lm-eval's own ``hf`` model chooses, question by question, on the same weights?

Runs the same MMLU tasks (cloze ``mmlu_local_cloze_*`` and/or multiple-choice ``mmlu_local_*``, 0-shot, from the
local CSVs) through lm-eval twice, on a transformers checkpoint folder: once with ``model="hf"``
(transformers' forward) and once with our ``hybrid`` model (``from_pretrained`` of the same folder), both with
samples logged; then compares, per question, the choice each makes (argmax of the log-likelihoods for acc, of
the log-likelihoods per byte of the choice for acc_norm) and prints every disagreement with both models' margin
between the two choices. A disagreement on a near-tie (margin within fp32 noise) is reported as such.

    python -m benchmarks.mmlu_parity --model /path/to/hf-folder --limit 20   # from the repo root, without -P
    python -m benchmarks.mmlu_parity --model DIR --subjects astronomy nutrition --kinds cloze mc --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from hybrid.eval.real_tradeoff_measure import DEFAULT_SUBJECTS

from benchmarks.common import add_threads, set_threads

NEAR_TIE = 1e-3  # nats: below this two choices' log-likelihoods are within fp32 reduction-order noise


def _choices(samples: list[dict], choices_of) -> dict[int, dict]:
    """doc_id -> the acc and acc_norm choices and the per-choice log-likelihoods."""
    out = {}
    for s in samples:
        lls = [float(r[0]) for r in s["filtered_resps"]]
        lengths = [len(c.encode("utf-8")) for c in choices_of(s["doc"])]
        norm = [ll / n for ll, n in zip(lls, lengths, strict=True)]
        out[s["doc_id"]] = {"acc": max(range(len(lls)), key=lls.__getitem__),
                            "acc_norm": max(range(len(norm)), key=norm.__getitem__), "ll": lls, "norm": norm,
                            "target": s["target"]}
    return out


def run_both(model: str, tasks: list[str], *, limit: int | None, mmlu_dir: str | None, batch_size: int) -> dict:
    import lm_eval
    from hybrid.eval.lm_eval_run import run as run_hybrid
    from hybrid.eval.tasks import TASKS_DIR
    from lm_eval.tasks import TaskManager

    metadata = {"mmlu_dir": mmlu_dir} if mmlu_dir else None
    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False, metadata=metadata)
    out = {}
    t0 = time.perf_counter()
    out["hf"] = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={model},dtype=float32,device=cpu",
                                        tasks=tasks, num_fewshot=0, limit=limit, task_manager=manager,
                                        log_samples=True, bootstrap_iters=0, batch_size=batch_size)
    out["hf_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    out["hybrid"] = run_hybrid(model, tasks=tasks, num_fewshot=0, limit=limit, mmlu_dir=mmlu_dir,
                               batch_size=batch_size, log_samples=True)
    out["hybrid_s"] = time.perf_counter() - t0
    return out


def compare(results: dict, tasks: list[str]) -> dict:
    """Per task and metric: questions, agreements, both accuracies, and the disagreements."""
    report = {}
    for task in tasks:
        cloze = "_cloze_" in task
        choices_of = (lambda d: [" " + c for c in d["choices"]]) if cloze else (lambda d: [" A", " B", " C", " D"])
        hf = _choices(results["hf"]["samples"][task], choices_of)
        ours = _choices(results["hybrid"]["samples"][task], choices_of)
        entry = {}
        for metric in ("acc", "acc_norm") if cloze else ("acc",):
            key = "ll" if metric == "acc" else "norm"
            diffs = []
            for doc_id in sorted(hf):
                a, b = hf[doc_id], ours[doc_id]
                if a[metric] != b[metric]:
                    i, j = a[metric], b[metric]
                    diffs.append({"doc_id": doc_id, "hf_choice": i, "hybrid_choice": j, "target": a["target"],
                                  "hf_margin": a[key][i] - a[key][j], "hybrid_margin": b[key][j] - b[key][i],
                                  "near_tie": min(a[key][i] - a[key][j], b[key][j] - b[key][i]) < NEAR_TIE})
            n = len(hf)
            entry[metric] = {"questions": n, "agree": n - len(diffs),
                             "hf_acc": sum(hf[d][metric] == hf[d]["target"] for d in hf) / n,
                             "hybrid_acc": sum(ours[d][metric] == ours[d]["target"] for d in ours) / n,
                             "max_abs_ll_diff": max(abs(x - y) for d in hf for x, y in zip(hf[d][key], ours[d][key],
                                                                                          strict=True)),
                             "disagreements": diffs}
        report[task] = entry
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a transformers checkpoint folder (both models load it)")
    p.add_argument("--subjects", nargs="+", default=list(DEFAULT_SUBJECTS), help="MMLU subjects")
    p.add_argument("--kinds", nargs="+", default=["cloze", "mc"], choices=["cloze", "mc"])
    p.add_argument("--limit", type=int, default=None, help="questions per subject (default: all)")
    p.add_argument("--mmlu-dir", default=None, help="MMLU folder (default: $HYBRID_MMLU_DIR or ../shared/data/mmlu)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--json", default=None, help="write the comparison here")
    add_threads(p, 0)
    args = p.parse_args(argv)
    threads = set_threads(args.threads)
    tasks = [("mmlu_local_cloze_" if k == "cloze" else "mmlu_local_") + s for k in args.kinds for s in args.subjects]
    results = run_both(args.model, tasks, limit=args.limit, mmlu_dir=args.mmlu_dir, batch_size=args.batch_size)
    report = compare(results, tasks)
    total = {}
    for task, entry in report.items():
        for metric, e in entry.items():
            t = total.setdefault(f"{'cloze' if '_cloze_' in task else 'mc'} {metric}",
                                 {"questions": 0, "agree": 0, "hf": 0.0, "hybrid": 0.0, "max_ll_diff": 0.0})
            t["questions"] += e["questions"]
            t["agree"] += e["agree"]
            t["hf"] += e["hf_acc"] * e["questions"]
            t["hybrid"] += e["hybrid_acc"] * e["questions"]
            t["max_ll_diff"] = max(t["max_ll_diff"], e["max_abs_ll_diff"])
            for d in e["disagreements"]:
                print(f"DISAGREE {task} {metric} doc {d['doc_id']}: hf chose {d['hf_choice']} (margin "
                      f"{d['hf_margin']:.2e}), hybrid chose {d['hybrid_choice']} (margin {d['hybrid_margin']:.2e}), "
                      f"target {d['target']}{' [near tie]' if d['near_tie'] else ''}")
    print(f"# {args.model}, 0-shot, {args.limit or 'all'} questions per subject, {len(args.subjects)} subjects, "
          f"{threads} threads; hf {results['hf_s']:.0f} s, hybrid {results['hybrid_s']:.0f} s")
    for name, t in total.items():
        n = t["questions"]
        print(f"{name}: {t['agree']}/{n} same choice; acc hf {t['hf'] / n:.4f} hybrid {t['hybrid'] / n:.4f}; "
              f"largest log-likelihood difference {t['max_ll_diff']:.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "limit": args.limit, "subjects": args.subjects, "total": total,
                       "tasks": report}, f, indent=1)
    return 0 if all(t["agree"] == t["questions"] for t in total.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
