"""The real-family report's PNG: (a) MMLU-cloze accuracy against prefill speed-up over the teacher at the
longest length every member was timed at, one point per member labelled by attention share and mixer, with
the 95% interval as the error bar; (b) top-1 agreement with the teacher and the recall probe's digit accuracy
against the attention share, per mixer."""

from __future__ import annotations

from pathlib import Path


def _prefill(m: dict) -> dict[int, float]:
    return {r["seq_len"]: r["prefill_ms"] for r in m.get("prefill", []) if "prefill_ms" in r}


def plot(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .tradeoff import share_label

    members = result["members"]
    fig, (ax_a, ax_b) = plt.subplots(1, 2, figsize=(13, 5))
    teacher = next((m for m in members if m["mixer"] == "attention"), None)
    timed = [set(_prefill(m)) for m in members]
    common = set.intersection(*timed) if timed and teacher else set()
    L = max(common) if common else None
    markers = {"attention": "s", "mamba2": "o", "gdn": "^"}
    colors = {"attention": "black", "mamba2": "tab:blue", "gdn": "tab:orange"}
    offsets = {"attention": (7, 4), "mamba2": (7, 4), "gdn": (7, -12)}  # gdn's labels below: shares coincide
    for m in members:
        acc = (m.get("mmlu_cloze") or {}).get("acc")
        if acc is None:
            continue
        x = _prefill(teacher)[L] / _prefill(m)[L] if L else 1.0
        lo, hi = m["mmlu_cloze"]["acc_ci95"]
        mixer = m["mixer"]
        ax_a.errorbar([x], [100 * acc], yerr=[[100 * (acc - lo)], [100 * (hi - acc)]], fmt=markers.get(mixer, "o"),
                      color=colors.get(mixer), capsize=4, markersize=8, label=mixer)
        ax_a.annotate(share_label(m["attn_share"]), (x, 100 * acc), textcoords="offset points",
                      xytext=offsets.get(mixer, (7, 4)), fontsize=9, color=colors.get(mixer))
    ax_a.axhline(25, color="grey", linestyle=":", linewidth=1, label="chance (25%)")
    handles, labels = ax_a.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    ax_a.legend(unique.values(), unique.keys(), fontsize=8)
    ax_a.set_xlabel(f"prefill speed-up over the teacher at {L} tokens (x)" if L else "prefill speed-up (not timed)")
    ax_a.set_ylabel("MMLU cloze acc % (0-shot; bars: 95% Wilson)")
    ax_a.set_title("(a) accuracy vs prefill speed-up")
    ax_a.grid(True, alpha=0.3)
    for mixer in sorted({m["mixer"] for m in members if m["mixer"] != "attention"}):
        ms = sorted([m for m in members if m["mixer"] in (mixer, "attention")], key=lambda m: m["attn_share"])
        xs = [m["attn_share"] for m in ms]
        style = dict(marker=markers.get(mixer, "o"), color=colors.get(mixer))
        if all(m.get("heldout") for m in ms):
            ax_b.plot(xs, [100 * m["heldout"]["top1_agreement"] for m in ms], linestyle="-", **style,
                      label=f"{mixer}: top-1 agreement")
        lengths = sorted({k for m in ms for k in (m.get("recall") or {})}, key=int)
        for length, dash in zip(lengths, ("--", ":", "-."), strict=False):  # at most three line styles
            # the digits' accuracy, not the whole-number exact match: at 135M the exact match is near 0 even for
            # the teacher, the digits separate retrieval (teacher ~45-60%) from chance (10%)
            ax_b.plot(xs, [100 * (m.get("recall") or {}).get(length, {}).get("token_acc", float("nan")) for m in ms],
                      linestyle=dash, **style, label=f"{mixer}: recall@{int(length) // 1024}K, digits right")
    ax_b.set_xlabel("attention share (1 = the teacher)")
    ax_b.axhline(10, color="grey", linestyle=":", linewidth=1, label="recall chance (10% of digits)")
    ax_b.set_ylabel("%")
    ax_b.set_title("(b) agreement with the teacher and recall vs attention share")
    ax_b.grid(True, alpha=0.3)
    ax_b.legend(fontsize=8)
    s = result["settings"]
    fig.suptitle(f"{Path(s['teacher']).name}: distilled family, budget {s['budget']['name']}, "
                 f"{s.get('machine', {}).get('cpu', '')} ({s.get('threads')} threads), {str(s.get('date', ''))[:10]}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
