"""Static facts of a model (size, compute, cache memory) as rows for tables."""

from __future__ import annotations

import torch

from .model import HybridLM
from .pattern import attention_share


def model_facts(name: str, model: HybridLM, seq_len: int = 2048) -> dict:
    cfg = model.config
    return {
        "model": name,
        "pattern": cfg.pattern if len(cfg.pattern) <= 24 else cfg.pattern[:21] + "...",
        "attn_share": round(attention_share(cfg.pattern), 3),
        "params_M": round(model.num_parameters() / 1e6, 2),
        f"GFLOP/token@{seq_len}": round(model.flops_per_token(seq_len) / 1e9, 4),
        # as a bf16 engine stores them: K/V and conv state bf16, SSM state fp32 (from the layers' cache specs)
        "KV_bytes/token(bf16)": model.kv_bytes_per_token(torch.bfloat16),
        "state_bytes/seq(fp32 ssm, bf16 conv)": model.state_bytes_per_sequence(torch.float32, torch.bfloat16),
    }


def format_table(rows: list[dict]) -> str:
    """A markdown table of ``rows``: the union of their keys in first-seen order, blank where a row has none."""
    if not rows:
        return "(no rows)"
    keys = list(dict.fromkeys(k for r in rows for k in r))
    cells = [[str(r.get(k, "")) for k in keys] for r in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    line = lambda vals: "| " + " | ".join(v.ljust(w) for v, w in zip(vals, widths, strict=True)) + " |"  # noqa: E731
    return "\n".join([line(keys), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, cells)])
