"""The figure of `kunserve bench coserve` (matplotlib, headless Agg backend), after ConServe Fig. 7 and 6: online
p99 TTFT, online p99 TBT and offline tokens/s over time windows, one line per policy (each policy's median run),
conserve's SLOs as red lines; below, each policy's medians over its runs with their range (Fig. 6's three panels at
one load). Input: the JSON-able documents the command writes, so a figure can be redrawn from coserve.json.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

POLICY_COLORS = {"online-only": "tab:gray", "non-preemptive": "tab:orange", "preemptive": "tab:red",
                 "conserve": "tab:green"}


def _color(policy: str, i: int) -> str:
    return POLICY_COLORS.get(policy, f"C{i % 10}")


def plot_coserve(runs: Mapping[str, Mapping[str, Any]], medians: Mapping[str, Mapping[str, Mapping[str, Any]]],
                 slo: Mapping[str, float], path: Path) -> Path:
    """`runs`: policy -> its representative run's document (with "timeline"); `medians`: the comparison's
    policy -> metric -> spread; `slo`: conserve's ttft_ms and tbt_ms (none drawn when empty)."""
    fig = plt.figure(figsize=(14, 10))
    grid = fig.add_gridspec(4, 3, height_ratios=[1, 1, 1, 1.1])
    series = (("ttft_p99_s", "online p99 TTFT (ms)", 1000.0, slo.get("ttft_ms")),
              ("tbt_p99_s", "online p99 TBT (ms)", 1000.0, slo.get("tbt_ms")),
              ("offline_tokens_per_s", "offline tokens/s", 1.0, None))
    shared = None
    for row, (key, label, scale, line) in enumerate(series):
        ax = fig.add_subplot(grid[row, :], sharex=shared)
        shared = shared or ax
        for i, (policy, run) in enumerate(runs.items()):
            points = [(w["t_s"], w[key]) for w in run["timeline"] if w.get(key) is not None]
            if key == "offline_tokens_per_s" and not any(v for _, v in points):
                continue  # online-only: no offline work
            if points:
                ax.plot([t for t, _ in points], [v * scale for _, v in points], marker="o", ms=2.5, lw=1.2,
                        label=policy, color=_color(policy, i), drawstyle="steps-post")
        if line is not None:
            ax.axhline(line, color="red", lw=1, ls="--", label="SLO")
        if key != "offline_tokens_per_s":
            ax.set_yscale("log")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if row == 0:  # above the panel: inside, it would hide the top of the lines
            ax.legend(fontsize=8, ncol=len(runs) + 1, loc="lower left", bbox_to_anchor=(0.0, 1.0), frameon=False)
        if row == len(series) - 1:
            ax.set_xlabel("time since start (s), windows of the median run of each policy")
    bars = (("ttft_p99_s", "p99 TTFT (ms)", 1000.0, slo.get("ttft_ms")), ("tbt_p99_s", "p99 TBT (ms)", 1000.0,
                                                                         slo.get("tbt_ms")),
            ("offline_tokens_per_s", "offline tokens/s", 1.0, None))
    names = list(medians)
    for col, (metric, label, scale, line) in enumerate(bars):
        ax = fig.add_subplot(grid[3, col])
        for i, policy in enumerate(names):
            m = medians[policy][metric]
            if m["median"] is None:
                continue
            lo, hi = m["min"] * scale, m["max"] * scale
            mid = m["median"] * scale
            ax.bar(i, mid, color=_color(policy, i), yerr=[[mid - lo], [hi - mid]], capsize=3)
        if line is not None:
            ax.axhline(line, color="red", lw=1, ls="--")
        ax.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


__all__ = ["plot_coserve"]
