"""Printed table and PNG plot of the scheduler benchmark records."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..common import format_table
from .stack import STRATEGIES

COLUMNS = [
    ("scenario", "scenario"), ("load_pct", "load %"), ("strategy", "strategy"),
    ("offered_rps", "offered/s"), ("p50_s", "p50 s"), ("p99_s", "p99 s"),
    ("ttft_p90_s", "TTFT p90 s"), ("ttft_p99_s", "TTFT p99 s"), ("timeout_pct", "timeouts %"),
    ("error_pct", "errors %"),
    ("sent_rps", "sent/s"), ("goodput_rps", "goodput/s"), ("imbalance", "imbalance"),
]


def table_rows(records: Sequence[dict]) -> list[dict]:
    """Records with the derived columns of :data:`COLUMNS` (percentages 0-100)."""
    rows = []
    for r in records:
        row = dict(r)
        row["load_pct"] = int(round(r["load_fraction"] * 100))
        row["timeout_pct"] = round(r["timeout_rate"] * 100, 1)
        row["error_pct"] = round(r.get("error_rate", 0.0) * 100, 1)
        rows.append(row)
    return rows


def table(records: Sequence[dict]) -> str:
    """The results as a Markdown table."""
    return format_table(table_rows(records), COLUMNS)


COLORS = {"round_robin": "tab:red", "least_conn": "tab:blue", "infergate": "tab:green"}


def plot(records: Sequence[dict], path: str | Path, title: str = "") -> Path:
    """Write the PNG: p99 and p50 latency, timeout rate (and timeouts + errors), goodput
    and imbalance against load for the ``steady`` scenario, and timeout rate / goodput per strategy for the fault
    scenarios (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steady = [r for r in records if r["scenario"] == "steady"]
    faults = sorted({r["scenario"] for r in records if r["scenario"] != "steady"})
    ncols = 3 if faults else 2
    fig, axes = plt.subplots(2, ncols, figsize=(5.2 * ncols, 8.0), squeeze=False)
    panels = [("p99_s", "end-to-end latency (s, wall): p99 solid, p50 dashed"),
              ("timeout_rate", "timeout rate (solid), timeouts + errors (dashed)"),
              ("goodput_rps", "goodput (ok requests/s, wall)"),
              ("imbalance", "utilisation imbalance (max - min)")]
    cells = [axes[0][0], axes[0][1], axes[1][0], axes[1][1]]
    for ax, (key, label) in zip(cells, panels):
        for s in STRATEGIES:
            pts = sorted((r["load_fraction"], r[key]) for r in steady
                         if r["strategy"] == s and r.get(key) is not None)
            if pts:
                ax.plot([p[0] * 100 for p in pts], [p[1] for p in pts], marker="o",
                        label=s, color=COLORS.get(s))
        extra = {"p99_s": lambda r: r.get("p50_s"),
                 "timeout_rate": lambda r: r["timeout_rate"] + (r.get("error_rate") or 0.0)}
        if key in extra:
            for s in STRATEGIES:
                pts = sorted((r["load_fraction"], extra[key](r)) for r in steady
                             if r["strategy"] == s and extra[key](r) is not None)
                if pts:
                    ax.plot([p[0] * 100 for p in pts], [p[1] for p in pts], marker=".",
                            linestyle="--", color=COLORS.get(s), alpha=0.7)
        if key == "goodput_rps":
            pts = sorted({(r["load_fraction"], r.get("sent_rps") or r["offered_rps"])
                          for r in steady})
            if pts:
                ax.plot([p[0] * 100 for p in pts], [p[1] for p in pts], linestyle=":",
                        color="grey", label="sent")
        ax.set_xlabel("offered load (% of pool capacity)")
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
    cells[0].legend(fontsize=8)
    cells[2].legend(fontsize=8)
    if faults:
        for ax, (key, label) in zip((axes[0][2], axes[1][2]),
                                    [("timeout_rate", "timeout rate"),
                                     ("goodput_rps", "goodput (ok requests/s)")]):
            width = 0.8 / len(STRATEGIES)
            for i, s in enumerate(STRATEGIES):
                vals = []
                for sc in faults:
                    m = [r[key] for r in records if r["scenario"] == sc and r["strategy"] == s]
                    vals.append(m[0] if m and m[0] is not None else 0.0)
                ax.bar([j + i * width for j in range(len(faults))], vals, width=width, label=s,
                       color=COLORS.get(s))
            loads = {r["scenario"]: r["load_fraction"] for r in records if r["scenario"] in faults}
            ax.set_xticks([j + width for j in range(len(faults))])
            ax.set_xticklabels([f"{sc}\n@{loads[sc] * 100:.0f}%" for sc in faults], fontsize=8)
            ax.set_title(f"one fast node faulty mid-run: {label}", fontsize=10)
            ax.grid(alpha=0.3, axis="y")
        axes[0][2].legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p
