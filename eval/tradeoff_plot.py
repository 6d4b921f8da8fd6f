"""The tradeoff report's PNG: (a) accuracy vs prefill latency at the longest length every member was
timed at, (b) prefill latency vs context length, (c) cache bytes per sequence vs context length.
Error bars: seed min-max (MQAR) or the binomial standard error (lm-eval) for accuracy, min-max over the
timed runs for latency. A timing flagged wide (spread over the limit after a re-measure) is drawn as
an open red ring and its label gets a ``!``."""

from __future__ import annotations

from pathlib import Path

from .tradeoff_members import memory, timed


def _yerr(m: dict) -> tuple[list[float], list[float]] | None:
    if "accuracy_min" in m:
        return [m["accuracy"] - m["accuracy_min"]], [m["accuracy_max"] - m["accuracy"]]
    if m.get("stderr") is not None:
        return [m["stderr"]], [m["stderr"]]
    return None


def plot(result, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s, members = result.settings, result.members
    fig, (ax_acc, ax_len, ax_mem) = plt.subplots(1, 3, figsize=(17, 5.2))
    common = set.intersection(*(set(timed(m)) for m in members)) if members else set()
    longest = max(common) if common else None
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    acc_label = "MQAR accuracy (mean over seeds; bars: seed min-max)" if s.get("source") == "mqar" \
        else f"{s.get('tasks', ['acc'])[0]} accuracy (bars: ± binomial s.e.)"
    for i, m in enumerate(members):
        color = colors[i % len(colors)]
        t = timed(m)
        lengths = sorted(t)
        if longest is not None:
            r = t[longest]
            ms = r["prefill_ms"]
            ax_acc.errorbar([ms], [m["accuracy"]], yerr=_yerr(m),
                            xerr=([ms - r["prefill_min_ms"]], [r["prefill_max_ms"] - ms]),
                            fmt="o", color=color, capsize=4, markersize=7)
            if r["wide"]:
                ax_acc.plot([ms], [m["accuracy"]], "o", mfc="none", mec="red", markersize=14)
            ax_acc.annotate(m["model"] + (" !" if r["wide"] else ""), (ms, m["accuracy"]),
                            textcoords="offset points", xytext=(7, 5), fontsize=9)
        if lengths:
            med = [t[L]["prefill_ms"] for L in lengths]
            err = ([t[L]["prefill_ms"] - t[L]["prefill_min_ms"] for L in lengths],
                   [t[L]["prefill_max_ms"] - t[L]["prefill_ms"] for L in lengths])
            ax_len.errorbar(lengths, med, yerr=err, marker="o", color=color, capsize=3, label=m["model"])
            wide = [L for L in lengths if t[L]["wide"]]
            if wide:
                ax_len.plot(wide, [t[L]["prefill_ms"] for L in wide], "o", mfc="none", mec="red", markersize=12)
        mem = memory(m)
        mem_lengths = sorted(mem)
        ax_mem.plot(mem_lengths, [mem[L]["cache_bytes"] / 2**20 for L in mem_lengths], marker="s", color=color,
                    label=m["model"])
    speed_tag = f" ({s.get('speed_size')} width, d_model {members[0]['speed_model']['d_model']})" \
        if s.get("source") == "mqar" and members else ""
    ax_acc.set_xlabel(f"prefill latency at {longest} tokens (ms){speed_tag}" if longest else "prefill latency (ms)")
    ax_acc.set_ylabel(acc_label)
    ax_acc.set_title(f"(a) accuracy vs prefill latency at {longest} tokens")
    ax_acc.grid(True, alpha=0.3)
    ax_len.set_xscale("log", base=2)
    ax_len.set_yscale("log")
    ax_len.set_xlabel("context length (tokens)")
    ax_len.set_ylabel(f"prefill latency (ms, median; bars: min-max){speed_tag}")
    ax_len.set_title("(b) prefill latency vs context length")
    ax_len.grid(True, which="both", alpha=0.3)
    ax_len.legend(fontsize=8, title="attention share" if s.get("source") == "mqar" else None)
    ax_mem.set_xscale("log", base=2)
    ax_mem.set_yscale("log")
    ax_mem.set_xlabel("context length (tokens)")
    ax_mem.set_ylabel("cache per sequence (MiB: KV + Mamba state)")
    ax_mem.set_title("(c) cache bytes per sequence vs context length")
    ax_mem.grid(True, which="both", alpha=0.3)
    ax_mem.legend(fontsize=8)
    mach = s.get("machine", {})
    fig.suptitle(f"Attention-share tradeoff on {mach.get('cpu', s.get('device'))} ({s.get('device')}, "
                 f"{s.get('threads')} threads), {s.get('dtype')}, {str(s.get('date', ''))[:10]}"
                 + ("   ! = timing spread over limit" if any(r.get("wide") for m in members for r in m["prefill"])
                    else ""))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
