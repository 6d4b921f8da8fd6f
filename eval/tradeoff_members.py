"""Reading a tradeoff member's rows: the reference member, its timed prefill rows and its memory rows by
length. The report (tables, claim) and the plot both read members through these, so neither imports the other
for them."""

from __future__ import annotations


def reference(members: list[dict]) -> dict:
    """The member with the largest attention share (ties: the first)."""
    return max(members, key=lambda m: m["attn_share"])


def timed(member: dict) -> dict[int, dict]:
    """The member's prefill rows that were measured (not skipped), by length."""
    return {r["seq_len"]: r for r in member["prefill"] if "prefill_ms" in r}


def memory(member: dict) -> dict[int, dict]:
    return {r["seq_len"]: r for r in member["memory"]}
