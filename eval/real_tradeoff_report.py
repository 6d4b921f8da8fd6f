"""The real-family tradeoff report's files: ``tradeoff.md`` (the table, the budget, how it was made),
``tradeoff.csv`` (one flat row per member), ``tradeoff.json`` (everything) and ``tradeoff.png`` (accuracy
against prefill speed-up over the teacher, one point per member labelled by its attention share and mixer).

Speed-ups are the teacher's engine prefill time over the member's at the same length; bytes are one
sequence's KV cache + constant state at 32K tokens, from the layers' cache specs."""

from __future__ import annotations

import json
from pathlib import Path

from .tables import markdown, write_csv


def _pct(x: float | None) -> str:
    return "" if x is None else f"{100 * x:.1f}"


def _ci(d: dict | None, metric: str) -> str:
    if not d or metric not in d:
        return ""
    lo, hi = d[f"{metric}_ci95"]
    return f"{100 * d[metric]:.1f} [{100 * lo:.1f}, {100 * hi:.1f}]"


def _prefill(m: dict) -> dict[int, dict]:
    return {r["seq_len"]: r for r in m.get("prefill", []) if "prefill_ms" in r}


def _share(m: dict) -> str:
    from fractions import Fraction

    return str(Fraction(m["attn_share"]).limit_denominator(64))


def _mib(n: int | None) -> str:
    return "" if n is None else f"{n / 2**20:.1f}"


def flat_row(m: dict, lengths: list[int]) -> dict:
    """One member as a flat dict of plain numbers (the CSV row)."""
    row = {"model": m["model"], "attn_share": m["attn_share"], "mixer": m["mixer"], "params": m.get("params")}
    for kind, metrics in (("mmlu_cloze", ("acc", "acc_norm")), ("mmlu_mc", ("acc",))):
        d = m.get(kind) or {}
        for metric in metrics:
            if metric in d:
                row[f"{kind}_{metric}"] = round(d[metric], 4)
                row[f"{kind}_{metric}_lo"], row[f"{kind}_{metric}_hi"] = (round(x, 4) for x in d[f"{metric}_ci95"])
        if d:
            row[f"{kind}_questions"] = d["questions"]
    h = m.get("heldout") or {}
    row["ppl"] = round(h["ppl"], 3) if "ppl" in h else None
    row["top1_agreement"] = round(h["top1_agreement"], 4) if "top1_agreement" in h else None
    for L, r in sorted((m.get("recall") or {}).items(), key=lambda kv: int(kv[0])):
        row[f"recall_{L}"] = round(r["exact"], 4)
        row[f"recall_{L}_digits"] = round(r["token_acc"], 4) if "token_acc" in r else None
    pre = _prefill(m)
    for L in lengths:
        row[f"prefill_{L}_ms"] = pre[L]["prefill_ms"] if L in pre else None
    d = m.get("decode") or {}
    row["decode_tok_s"] = d.get("decode_tok/s")
    mem = m.get("memory") or {}
    row["bytes_at_32K"] = mem.get("cache_bytes")
    return row


def summary_table(members: list[dict], lengths: list[int]) -> list[dict]:
    """The table a reader looks at: accuracies in % with 95% intervals, speed-ups over the teacher."""
    teacher = next((m for m in members if m["mixer"] == "attention"), None)
    ref = _prefill(teacher) if teacher else {}
    ref_decode = (teacher or {}).get("decode", {}).get("decode_tok/s")
    rows = []
    for m in members:
        pre = _prefill(m)
        row = {"member": m["model"], "attn": _share(m), "mixer": m["mixer"],
               "cloze acc % [95% CI]": _ci(m.get("mmlu_cloze"), "acc"),
               "cloze acc_norm %": _ci(m.get("mmlu_cloze"), "acc_norm"),
               "MC acc %": _ci(m.get("mmlu_mc"), "acc"),
               "ppl": f"{m['heldout']['ppl']:.2f}" if m.get("heldout") else "",
               "top-1 agree %": _pct((m.get("heldout") or {}).get("top1_agreement"))}
        for L, r in sorted((m.get("recall") or {}).items(), key=lambda kv: int(kv[0])):
            row[f"recall@{int(L) // 1024}K % (digits %)"] = f"{_pct(r['exact'])} ({_pct(r.get('token_acc'))})"
        for L in lengths:
            if L in pre:
                speedup = f" ({ref[L]['prefill_ms'] / pre[L]['prefill_ms']:.2f}x)" if L in ref else ""
                row[f"prefill {L // 1024}K s"] = f"{pre[L]['prefill_ms'] / 1e3:.2f}{speedup}"
            else:
                row[f"prefill {L // 1024}K s"] = "not timed"
        d = (m.get("decode") or {}).get("decode_tok/s")
        row["decode tok/s"] = "" if d is None else f"{d:.1f}" + (f" ({d / ref_decode:.2f}x)" if ref_decode else "")
        row["MiB at 32K"] = _mib((m.get("memory") or {}).get("cache_bytes"))
        rows.append(row)
    return rows


def budget_table(settings: dict) -> list[dict]:
    """Tokens and wall seconds per stage."""
    st = settings.get("stages", {})
    rows = []
    if "data" in st:
        made = st["data"].get("made", {})
        rows.append({"stage": "data (teacher writes)", "tokens": st["data"]["tokens"] + st["data"]["heldout_tokens"],
                     "wall s": st["data"]["seconds"],
                     "note": f"{made.get('samples', '?')} samples, {made.get('dropped_by_guard', 0)} dropped by the "
                             f"MMLU guard, {made.get('generated_tok_s', '?')} generated tok/s (0 s: cached)"})
    for mixer, d in st.get("distill", {}).items():
        b = d.get("budget") or {}
        for stage in ("align", "kl"):
            part = b.get(stage)
            if isinstance(part, dict) and "tokens" in part:
                rows.append({"stage": f"distill {mixer}: {stage}", "tokens": part["tokens"],
                             "wall s": part.get("seconds"), "note": ""})
            elif isinstance(part, dict):  # per share
                for share, p in part.items():
                    rows.append({"stage": f"distill {mixer}: {stage} attn={share}", "tokens": p.get("tokens"),
                                 "wall s": p.get("seconds"), "note": ""})
        rows.append({"stage": f"distill {mixer} (all)", "tokens": "", "wall s": d["seconds"], "note": ""})
    for stage in ("measure_accuracy", "measure_speed"):
        if stage in st:
            rows.append({"stage": stage.replace("_", " "), "tokens": "", "wall s": st[stage]["seconds"],
                         "note": f"{st[stage].get('members_reused', 0)} members reused" if "members_reused" in
                         st[stage] else ""})
    rows.append({"stage": "total", "tokens": "", "wall s": settings.get("wall_s"), "note": ""})
    return rows


def markdown_report(result: dict, lengths: list[int]) -> str:
    s, members = result["settings"], result["members"]
    b = s["budget"]
    mach = s.get("machine", {})
    q = next((m["mmlu_cloze"]["questions"] for m in members if m.get("mmlu_cloze")), "?")
    lines = [
        f"# Attention share vs prefill speed and accuracy: {Path(s['teacher']).name} and its distilled family", "",
        f"{s['date']} UTC, {mach.get('cpu', '?')}, {s['threads']} threads, fp32; budget `{b['name']}`; load "
        f"{s.get('load_before')} before, {s.get('load_at_timing')} at timing, {s.get('load_after')} after.", "",
        markdown(summary_table(members, lengths)), "",
        f"- MMLU: 0-shot, {len(b['mmlu_subjects'])} subjects x {b['mmlu_limit'] or 'all'} questions ({q} in all), "
        "question-weighted; cloze = lm-eval's `mmlu_continuation` format (acc: summed log-likelihood of the "
        "choice's text; acc_norm: per byte), MC = the `mmlu` letter format. Brackets: 95% Wilson score interval.",
        f"- ppl / top-1 agree: on {b['heldout_tokens']} held-out teacher-written tokens (never trained on), windows "
        f"of {min(b['seq_len'], b['heldout_tokens'])}; agreement = share of positions whose argmax is the teacher's.",
        f"- recall: phonebook lookup in natural language, greedy exact match of the number's four random digits "
        f"(chance 10^-4), and in brackets the share of digits right (chance ~10%); "
        f"{b['recall_queries'] * b['recall_contexts']} queries per length.",
        "- prefill: engine prefill time (median of the timed runs) and the speed-up over the teacher; decode: "
        f"batch-1 tok/s at {b['decode_context']} tokens of context; MiB at 32K: KV cache + constant state one "
        "sequence holds at 32768 tokens (fp32 K/V, fp32 state).",
        "- Timings on a shared machine are noisy: compare members measured in the same run only.", "",
        "## Budget", "", markdown(budget_table(s)), "",
    ]
    return "\n".join(lines)


def write_report(result: dict, output: Path) -> dict[str, Path]:
    from .real_tradeoff_plot import plot

    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    lengths = sorted({r["seq_len"] for m in result["members"] for r in m.get("prefill", [])}
                     | set(result["settings"]["budget"]["prefill_lengths"]))
    paths = {"md": output / "tradeoff.md", "csv": output / "tradeoff.csv", "json": output / "tradeoff.json",
             "png": output / "tradeoff.png"}
    paths["md"].write_text(markdown_report(result, lengths))
    write_csv([flat_row(m, lengths) for m in result["members"]], paths["csv"])
    paths["json"].write_text(json.dumps(result, indent=1, default=str) + "\n")
    plot(result, paths["png"])
    return paths
