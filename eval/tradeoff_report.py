"""The tradeoff report's outputs: the table (markdown and stdout), the check of the seed's headline
claim, ``tradeoff.csv`` (one flat row per member), ``tradeoff.json`` (everything) and the plot.

Every reduction is relative to the *reference* member, the one with the most attention (the
all-attention member of the default family): ``cut = 1 - mine / reference``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

from .tables import markdown, write_csv
from .tradeoff_members import memory, reference, timed
from .tradeoff_plot import plot

CLAIM = ("Mamba cuts prefill latency by 80-90% and memory by 70-80% at a cost of 5-10 MMLU points "
         "(the seed's table)")
TARGET_CUT = 0.8


def _cache_dtypes(s: dict) -> str:
    d = s.get("cache_dtypes", {"kv": s["dtype"], "conv": s["dtype"], "ssm": "float32"})
    return f"K/V in {d['kv']}, conv state in {d['conv']}, SSM state in {d['ssm']}"


def _k(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _bytes(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def cuts(member: dict, ref: dict) -> dict[str, dict[int, float]]:
    """Prefill-latency and memory reductions of ``member`` relative to ``ref`` at each length both have."""
    mine, theirs = timed(member), timed(ref)
    pre = {L: 1 - mine[L]["prefill_ms"] / theirs[L]["prefill_ms"] for L in sorted(mine) if L in theirs}
    mem_mine, mem_ref = memory(member), memory(ref)
    mem = {L: 1 - mem_mine[L]["cache_bytes"] / mem_ref[L]["cache_bytes"] for L in sorted(mem_mine)
           if L in mem_ref and mem_ref[L]["cache_bytes"]}
    return {"prefill": pre, "memory": mem}


def crossing(cut_by_len: dict[int, float], target: float = TARGET_CUT) -> tuple[int | None, float | None]:
    """(first measured length whose cut reaches ``target``, the length where the cut crosses it by
    log-linear interpolation from the measured length before it); (None, None) if never reached."""
    lengths = sorted(cut_by_len)
    for i, L in enumerate(lengths):
        if cut_by_len[L] >= target:
            if i == 0:
                return L, None
            L0, c0, c1 = lengths[i - 1], cut_by_len[lengths[i - 1]], cut_by_len[L]
            x = math.log2(L0) + (target - c0) / (c1 - c0) * (math.log2(L) - math.log2(L0))
            return L, 2**x
    return None, None


def claim_lines(members: list[dict], settings: dict) -> list[str]:
    """The seed's claim next to this run's own measurements, one statement per line."""
    ref = reference(members)
    lows = [m for m in members if m["attn_share"] == 0.0]
    lines = [f"Claim: {CLAIM}.", ""]
    if ref["attn_share"] == 0.0:
        return lines + ["No member has attention: there is nothing to compare with."]
    where = "the `" + settings.get("speed_size", "") + "` width" if settings.get("source") == "mqar" \
        else "the checkpoints themselves"
    lines.append(f"Measured on this machine ({where}, reductions relative to `{ref['model']}`):")
    lines.append("")
    for m in members:
        if m is ref:
            continue
        c = cuts(m, ref)
        pre = ", ".join(f"{100 * v:.0f}% at {_k(L)}" for L, v in c["prefill"].items()) or "no common length"
        mem = ", ".join(f"{100 * v:.0f}% at {_k(L)}" for L, v in c["memory"].items())
        lines.append(f"- `{m['model']}`: prefill latency cut {pre}; memory cut {mem}.")
    lines.append("")
    if lows:
        low = lows[0]
        c = cuts(low, ref)
        first, interp = crossing(c["prefill"])
        longest = max(c["prefill"]) if c["prefill"] else None
        from ..recipes import FAMILY_MIXER_NAMES  # checkpoints' reports (no mixer setting) read as Mamba-2's

        pure = "Pure " + FAMILY_MIXER_NAMES.get(settings.get("mixer") or "mamba2", "Mamba-2")
        if first is None:
            at = f" ({100 * c['prefill'][longest]:.0f}% at {_k(longest)})" if longest else ""
            lines.append(f"{pure} (`{low['model']}`) does not reach an {TARGET_CUT:.0%} prefill-latency "
                         f"reduction within {_k(longest) if longest else 'the timed lengths'} tokens{at}.")
        else:
            est = f" (about {interp / 1024:.1f}K by log-linear interpolation)" if interp else ""
            lines.append(f"{pure} (`{low['model']}`) reaches an {TARGET_CUT:.0%} prefill-latency reduction "
                         f"at {_k(first)} tokens{est}.")
        mfirst, _ = crossing(c["memory"], 0.7)
        lines.append(f"Its memory cut reaches 70% at {_k(mfirst)} tokens." if mfirst else
                     "Its memory cut stays under 70% at every timed length.")
    if settings.get("source") == "mqar":
        lines.append("Accuracy: this run measures recall (MQAR), a proxy for what attention buys, not MMLU points; "
                     "`hybrid tradeoff --checkpoints ... --tasks mmlu_local` measures those on trained checkpoints.")
    else:
        for m in members:
            if m is not ref:
                lines.append(f"- `{m['model']}`: {100 * (m['accuracy'] - ref['accuracy']):+.1f} accuracy points "
                             f"vs `{ref['model']}` on {settings['tasks'][0]}.")
    return lines


def flat_row(member: dict, ref: dict) -> dict:
    """One member as a flat CSV row: accuracy (and its seed spread or stderr), every timing with its
    spread, memory, and the cuts relative to ``ref``."""
    row = {"model": member["model"], "attn_share": member["attn_share"], "pattern": member["speed_model"]["pattern"]}
    metric = member["metric"]
    row[metric] = round(member["accuracy"], 4)
    if "accuracy_min" in member:
        row[f"{metric}_seed_min"] = round(member["accuracy_min"], 4)
        row[f"{metric}_seed_max"] = round(member["accuracy_max"], 4)
        for n, v in member["per_kv"].items():
            row[f"{metric}@{n}kv"] = round(v, 4)
            row[f"{metric}@{n}kv_seed_min"] = round(member["per_kv_min"][n], 4)
            row[f"{metric}@{n}kv_seed_max"] = round(member["per_kv_max"][n], 4)
        row["accuracy_params"] = member["params"]
        row["accuracy_pattern"] = member.get("acc_pattern", "")
        row["accuracy_state_bytes"] = member.get("acc_state_bytes", "")
    if member.get("stderr") is not None:
        row[f"{metric}_stderr"] = round(member["stderr"], 4)
    for task, value in member.get("per_task", {}).items():
        row[task] = round(value, 4)
    row["speed_params"] = member["speed_model"]["params"]
    for r in member["prefill"]:
        L = r["seq_len"]
        if "prefill_ms" not in r:
            row[f"prefill_ms@{L}"] = r.get("skipped", "not timed")
            continue
        for key in ("prefill_ms", "prefill_min_ms", "prefill_max_ms", "spread", "runs", "wide"):
            row[f"{key}@{L}"] = r[key]
    c = cuts(member, ref)
    for L, v in c["prefill"].items():
        row[f"prefill_cut@{L}"] = round(v, 4)
    for r in member["memory"]:
        row[f"cache_bytes@{r['seq_len']}"] = r["cache_bytes"]
        row[f"seqs_in_budget@{r['seq_len']}"] = r["seqs_in_budget"]
    for L, v in c["memory"].items():
        row[f"memory_cut@{L}"] = round(v, 4)
    return row


def _timing_cell(r: dict | None) -> str:
    if r is None:
        return "-"
    if "prefill_ms" not in r:
        return r.get("skipped", "-")
    one = " (1 run)" if r["runs"] == 1 else ""
    flag = " !" if r["wide"] else ""
    return f"{r['prefill_ms']:.0f} [{r['prefill_min_ms']:.0f}-{r['prefill_max_ms']:.0f}]{one}{flag}"


def _acc_cell(m: dict) -> str:
    if "accuracy_min" in m:
        return f"{m['accuracy']:.3f} [{m['accuracy_min']:.3f}-{m['accuracy_max']:.3f}]"
    return f"{m['accuracy']:.3f}" + (f" ± {m['stderr']:.3f}" if m.get("stderr") is not None else "")


def summary_table(members: list[dict], settings: dict) -> list[dict]:
    """The report's main table: one row per member, accuracy, prefill per length, cut, memory."""
    ref = reference(members)
    lengths = sorted({r["seq_len"] for m in members for r in m["prefill"]})
    src = settings.get("source")
    acc_col = (f"MQAR acc, mean [seed min-max] ({settings.get('size')} width)" if src == "mqar"
               else f"{settings.get('tasks', ['acc'])[0]} acc")
    speed_tag = f" ({settings.get('speed_size')} width)" if src == "mqar" else ""
    rows = []
    for m in members:
        t, mem, c = timed(m), memory(m), cuts(m, ref)
        # MQAR: the accuracy models are the mixers alone, the timed ones the same mixers with MLPs
        pattern = m["speed_model"]["pattern"] if "acc_pattern" not in m else \
            f"{m['acc_pattern']} / {m['speed_model']['pattern']}"
        row = {"member": m["model"], "pattern" if "acc_pattern" not in m else "pattern (accuracy / speed)": pattern,
               acc_col: _acc_cell(m)}
        if "per_kv" in m:
            top = max(m["per_kv"])
            row[f"acc @{top} pairs"] = f"{m['per_kv'][top]:.3f}"
        for group in m.get("groups", []):
            if group != settings["tasks"][0]:
                row[group.removeprefix(settings["tasks"][0] + "_")] = f"{m['per_task'][group]:.3f}"
        for L in lengths:
            row[f"prefill ms @{_k(L)}{speed_tag}"] = _timing_cell(t.get(L)) if L in t else next(
                (r.get("skipped", "-") for r in m["prefill"] if r["seq_len"] == L), "not timed")
        for L in lengths:
            if m is not ref and L in c["prefill"]:
                row[f"prefill cut @{_k(L)}"] = f"{100 * c['prefill'][L]:.0f}%"
            else:
                row[f"prefill cut @{_k(L)}"] = "ref" if m is ref else "-"
        longest = max(mem)
        row[f"cache/seq @{_k(longest)}"] = _bytes(mem[longest]["cache_bytes"])
        row[f"seqs in {settings.get('cache_budget_GiB', 4):g} GiB @{_k(longest)}"] = mem[longest]["seqs_in_budget"]
        row[f"memory cut @{_k(longest)}"] = "ref" if m is ref else f"{100 * c['memory'].get(longest, 0):.0f}%"
        rows.append(row)
    return rows


def memory_table(members: list[dict], settings: dict) -> list[dict]:
    rows = []
    budget = settings.get("cache_budget_GiB", 4)
    for m in members:
        row = {"member": m["model"], "KV bytes/token": m["speed_model"]["kv_bytes_per_token"],
               "state bytes/seq": m["speed_model"]["state_bytes_per_sequence"]}
        for r in m["memory"]:
            row[f"cache/seq @{_k(r['seq_len'])}"] = _bytes(r["cache_bytes"])
            row[f"seqs in {budget:g} GiB @{_k(r['seq_len'])}"] = r["seqs_in_budget"]
        rows.append(row)
    return rows


def accuracy_table(members: list[dict]) -> list[dict]:
    """MQAR: per member and pair count, the mean over seeds and each seed's accuracy; lm-eval: every
    task, group and subject per checkpoint (rows are tasks)."""
    if "per_kv" in members[0]:
        rows = []
        for m in members:
            row = {"member": m["model"], "params": m["params"]}
            for n in m["per_kv"]:
                row[f"@{n} pairs"] = (f"{m['per_kv'][n]:.3f} [{m['per_kv_min'][n]:.3f}-"
                                      f"{m['per_kv_max'][n]:.3f}]")
            for s in m["seeds"]:
                row[f"seed {s['seed']} mean"] = f"{s['accuracy']:.3f}"
                row[f"seed {s['seed']} loss"] = f"{s['final_loss']:.3f}"
                row[f"seed {s['seed']} train s"] = s["train_s"]
            rows.append(row)
        return rows
    tasks = list(members[0]["per_task"])
    return [{"task": t, **{m["model"]: f"{m['per_task'].get(t, float('nan')):.4f}" for m in members}} for t in tasks]


def header_lines(s: dict) -> list[str]:
    mach = s["machine"]
    lines = [f"Run {s['date']} (UTC), wall time {s['wall_s'] / 60:.1f} min (accuracy {s.get('accuracy_s')} s, "
             f"prefill {s.get('speed_s')} s). Machine: {mach['cpu']}, {mach['cores']} cores, {mach['os']}, "
             f"torch {mach['torch']}; device {s['device']}, {s['threads']} threads, dtype {s['dtype']}; "
             f"matmul peak {s['matmul_peak_GFLOP/s']} GFLOP/s; load average (1/5/15 min) {s.get('load_before')} "
             f"at the start, {s.get('load_at_timing')} when timing began, {s.get('load_after')} at the end"
             + (f"; waited {s['lock_wait_s']} s for the timing lock" if "lock_wait_s" in s else "") + ".", ""]
    if s.get("source") == "mqar":
        t = s["train"]
        per_step = f"{t['batch_size']} sequences" if t["batch_size"] else f"{t['tokens_per_step']} tokens"
        lines += [f"Accuracy columns: {s['accuracy_model']}; {t['steps']} steps of {per_step}, "
                  f"lr {t['lr']}, vocab {t['vocab_size']}, trained on {t['train_kv_pairs']} key-value pairs"
                  + (f" (added one at a time over the first {t['curriculum']:.0%} of the steps)" if t.get("curriculum")
                     else "") + ", "
                  f"scored on {t['eval_sequences']} held-out sequences at each of {t['eval_kv_pairs']} pairs; seeds "
                  f"{s['seeds']}.", "",
                  f"Prefill and memory columns: {s['speed_model']}.", ""]
    else:
        lines += [f"Accuracy: lm-eval {s['tasks']}, {s['num_fewshot']}-shot, limit {s['limit']}; prefill and memory: "
                  "the checkpoints themselves.", ""]
    long = f"; {_k(s['long_lengths'][0])}+: {s['long_repeats']} run(s)" if s.get("long_lengths") else ""
    lines += [f"Prefill: one prompt through `hybrid.Engine` (chunks of {s['chunk']} tokens, paged KV, state slots, "
              f"last-token logits); median [min-max] ms of {s['repeats']} runs{long}; a timing whose spread "
              f"(max-min)/median exceeds {s['max_spread']:.0%} is re-measured once and marked `!` if it stays wide. "
              f"Memory: bytes one sequence holds in the engine's cache (KV blocks + Mamba conv/SSM state, from the "
              f"layers' cache specs, scales included; {_cache_dtypes(s)}).", ""]
    return lines


def markdown_report(result) -> str:
    s, members = result.settings, result.members
    title = "Prefill speed vs MQAR recall" if s.get("source") == "mqar" else f"Prefill speed vs {s['tasks'][0]}"
    md = [f"# {title} across attention shares", "", *header_lines(s), markdown(summary_table(members, s)), "",
          "## The seed's claim, tested", "", *claim_lines(members, s), "",
          "## Accuracy", "", markdown(accuracy_table(members)), "",
          "## Memory per sequence", "", markdown(memory_table(members, s)), "",
          "## Prefill runs", ""]
    runs = [{"member": m["model"], **r} for m in members for r in m["prefill"]]
    md += [markdown(runs), ""]
    return "\n".join(md)


def write_report(result, output: Path) -> dict[str, Path]:
    """``tradeoff.json`` (everything), ``tradeoff.csv`` (one row per member), ``tradeoff.md`` and
    ``tradeoff.png`` under ``output``."""
    output.mkdir(parents=True, exist_ok=True)
    paths = {"json": output / "tradeoff.json", "csv": output / "tradeoff.csv", "md": output / "tradeoff.md",
             "png": output / "tradeoff.png"}
    ref = reference(result.members)
    body = asdict(result)
    body["claim"] = claim_lines(result.members, result.settings)
    paths["json"].write_text(json.dumps(body, indent=2, default=str) + "\n")
    write_csv([flat_row(m, ref) for m in result.members], paths["csv"])
    paths["md"].write_text(markdown_report(result))
    plot(result, paths["png"])
    return paths
