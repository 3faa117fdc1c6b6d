"""PNG plots of bench results (matplotlib, headless Agg backend): the TTFT-over-time view of KunServe
Fig. 12/16/17 (each request's TTFT at its send time; the burst windows, drops, restores and the moment
requests start queueing marked; KV in use and KV capacity on a second axis; drop periods shaded) and latency
CDFs. Inputs are the JSON-able dicts `kunserve bench` writes, so a plot can be redrawn
from a saved result file.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # noqa: E402

POLICY_COLORS = {"kunserve": "tab:green", "recompute": "tab:red", "swap": "tab:orange", "migrate": "tab:purple",
                 "static-pp": "tab:blue", "queue": "tab:gray"}


def _color(policy: str, i: int) -> str:
    return POLICY_COLORS.get(policy, f"C{i % 10}")


def _timeline(ax, run: Mapping, title: str) -> None:
    """Each request's TTFT at its send time, with what explains it: the burst windows (grey band along the top),
    the drop state (shaded), each drop (green line) and restore (brown dashed line), the first moment a request
    of each window queued (red dotted line) and the memory limit (purple dash-dot line; holds.py), and on a
    second axis the KV in use and the KV capacity,
    both as a share of the undropped capacity (a drop raises the capacity line, Fig. 17's memory limit)."""
    reqs = [r for r in run["requests"] if r.get("ttft_s") is not None]
    failed = [r for r in run["requests"] if r.get("ttft_s") is None]
    for start, end in run.get("drop_periods", []):
        ax.axvspan(start, max(end, start + 0.05), color="tab:green", alpha=0.15, lw=0)
    holds = run.get("holds") or {}
    seen: set[str] = set()

    def once(label: str) -> str | None:
        """The legend names each kind of mark once."""
        first = label not in seen
        seen.add(label)
        return label if first else None

    for w in holds.get("windows", []):
        ax.axvspan(w["start_s"], w["end_s"], ymin=0.95, ymax=1.0, color="black", alpha=0.35, lw=0, label=once("burst"))
        if w.get("onset_s") is not None:
            ax.axvline(w["start_s"] + w["onset_s"], color="tab:red", ls=":", lw=1.2, label=once("queueing starts"))
    windows = holds.get("windows", [])
    if windows and holds.get("memory_hold_s") is not None and not holds.get("memory_held_through"):
        ax.axvline(windows[0]["start_s"] + holds["memory_hold_s"], color="tab:purple", ls="-.", lw=1.2,
                   label=once("KV full"))
    for e in run.get("layout_events", []):
        drop = e["op"] == "drop"
        ax.axvline(e["t_s"], color="tab:green" if drop else "tab:brown", ls="-" if drop else "--", lw=1.2,
                   label=once(e["op"]))
    if reqs:
        ax.scatter([r["sent_s"] for r in reqs], [r["ttft_s"] * 1000 for r in reqs], s=8, color="tab:blue",
                   label="TTFT")
        ax.set_yscale("log")
        # plain numbers at 1-2-5 steps only: within one decade matplotlib's minor labels crowd into each other
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
    if failed:
        ymax = max((r["ttft_s"] * 1000 for r in reqs), default=1000.0)
        ax.scatter([r["sent_s"] for r in failed], [ymax] * len(failed), marker="x", s=14, color="tab:red",
                   label="failed")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title(title, fontsize=10)
    handles, labels = ax.get_legend_handles_labels()
    samples = [s for s in run.get("samples", []) if s.get("kv_blocks_undropped")]
    if samples:
        kv = ax.twinx()
        t = [s["t_s"] for s in samples]
        used = [100 * s["kv_blocks_used"] / s["kv_blocks_undropped"] for s in samples]
        capacity = [100 * s["kv_blocks_total"] / s["kv_blocks_undropped"] for s in samples]
        kv.plot(t, used, color="tab:orange", lw=1, label="KV in use")
        kv.step(t, capacity, where="post", color="tab:olive", lw=1, ls="--", label="KV capacity")
        kv.set_ylim(0, 1.1 * max(100.0, *used, *capacity))
        kv.set_ylabel("KV (% of undropped capacity)", color="tab:orange")
        more, more_labels = kv.get_legend_handles_labels()
        handles, labels = handles + more, labels + more_labels
    if handles:
        ax.legend(handles, labels, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=len(handles),
                  frameon=False)


def _cdf(ax, values_by_policy: Mapping[str, Sequence[float]], xlabel: str) -> None:
    for i, (policy, values) in enumerate(values_by_policy.items()):
        v = np.sort(np.asarray([x for x in values if x is not None], dtype=float)) * 1000
        if len(v):
            ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=policy, color=_color(policy, i))
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("CDF")
    ax.grid(alpha=0.3)


def _values(run: Mapping, key: str) -> list[float]:
    return [r[key] for r in run["requests"] if r.get(key) is not None]


def plot_run(run: Mapping, out_dir: Path) -> list[Path]:
    """ttft_timeline.png and latency_cdf.png for one policy's run."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    fig, ax = plt.subplots(figsize=(10, 4.4))
    _timeline(ax, run, f"{run.get('policy', '?')}: TTFT over time (shaded: pipelined / drop state)")
    fig.tight_layout()
    paths.append(out_dir / "ttft_timeline.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    name = run.get("policy", "run")
    for ax, key, label in zip(axes, ("ttft_s", "tpot_s", "e2e_s"), ("TTFT (ms)", "TPOT (ms)", "end-to-end (ms)")):
        _cdf(ax, {name: _values(run, key)}, label)
    fig.tight_layout()
    paths.append(out_dir / "latency_cdf.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def plot_compare(runs: Mapping[str, Mapping], slo: Mapping[str, Mapping[str, Mapping[str, float]]],
                 path: Path) -> Path:
    """One figure: TTFT / TPOT CDFs and TTFT / TPOT SLO attainment across scales for every policy (top row),
    then each policy's TTFT timeline with KV usage and drop shading."""
    n = len(runs)
    fig = plt.figure(figsize=(16, 3.8 + 2.6 * n))
    grid = fig.add_gridspec(1 + n, 4, height_ratios=[1.4] + [1.0] * n)
    _cdf(fig.add_subplot(grid[0, 0]), {p: _values(r, "ttft_s") for p, r in runs.items()}, "TTFT (ms)")
    ax = fig.add_subplot(grid[0, 1])
    _cdf(ax, {p: _values(r, "tpot_s") for p, r in runs.items()}, "TPOT (ms)")
    ax.legend(fontsize=8)
    for col, metric in ((2, "ttft"), (3, "tpot")):
        ax = fig.add_subplot(grid[0, col])
        for i, (policy, att) in enumerate(slo.items()):
            curve = att.get(metric) or {}
            xs = [float(k) for k in curve]
            ax.plot(xs, [100 * (1 - curve[k]) for k in curve], marker="o", ms=3, label=policy,
                    color=_color(policy, i))
        ax.set_xlabel(f"SLO scale (x best p50 {metric.upper()})")
        ax.set_ylabel("SLO violation (%)")
        ax.grid(alpha=0.3)
    for row, (policy, run) in enumerate(runs.items(), start=1):
        _timeline(fig.add_subplot(grid[row, :]), run, f"{policy}: TTFT over time (shaded: drop state)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


__all__ = ["plot_run", "plot_compare"]
