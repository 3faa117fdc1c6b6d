"""Is a simulated overload a memory overload or a compute overload? Reads `kunserve simulate` result.json files.

KunServe's parameter drop frees KV memory; it adds no compute. So it can only shorten TTFTs when requests wait
for memory while the GPUs could prefill them: the burst's prompt tokens per second stay within what the cluster
prefills, while the KV in use reaches the capacity. For each run this prints, per time window: the prompt tokens
that arrived per second over the cluster's prefill capacity (the time model's own KunServe cost model: a
max_num_batched_tokens chunk on each instance, every iteration), the KV in use and the prompts waiting as a share
of the undropped capacity, the pipelined instances, and the median / p99 TTFT of the requests that arrived in it.

    python bench/sim_regime.py results/fig13/recompute/result.json results/fig13/kunserve/result.json --window 5
    python bench/sim_regime.py results/fig13          # every */run-1/result.json under it
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.policy.costmodel import KunServeCostModel  # noqa: E402


def prefill_capacity(result: dict[str, Any], chunk: int) -> float:
    """Prompt tokens per second the whole cluster prefills when every iteration is one `chunk`-token chunk."""
    model = KunServeCostModel.from_dict(result["simulation"]["time_model"]["kunserve"])
    return result["cluster"]["instances"] * chunk / model.chunk_cost(chunk, 0)


def quantile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def windows(result: dict[str, Any], width: float, chunk: int) -> list[dict[str, Any]]:
    cap = prefill_capacity(result, chunk)
    reqs = result["requests"]
    samples = result["samples"]
    end = max(s["t_s"] for s in samples)
    rows = []
    t = 0.0
    while t < end:
        arrived = [r for r in reqs if t <= r["arrival_s"] < t + width]
        inside = [s for s in samples if t <= s["t_s"] < t + width]
        total = [s["kv_blocks_undropped"] for s in inside]
        ttfts = [r["ttft_s"] for r in arrived if r.get("ttft_s") is not None]
        rows.append(
            {
                "t0": t,
                "arrived": len(arrived),
                "prefill_load": sum(r["prompt_tokens"] for r in arrived) / width / cap,
                "kv_used": max((s["kv_blocks_used"] / n for s, n in zip(inside, total)), default=0.0),
                "kv_waiting": max((s["queued_demand_blocks"] / n for s, n in zip(inside, total)), default=0.0),
                "kv_total": max((s["kv_blocks_total"] / n for s, n in zip(inside, total)), default=0.0),
                "pipelined": max((s["pipelined_units"] for s in inside), default=0),
                "ttft_p50": quantile(ttfts, 0.5),
                "ttft_p99": quantile(ttfts, 0.99),
            }
        )
        t += width
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="+", help="result.json files, or directories holding */result.json or */run-1/result.json")
    p.add_argument("--window", type=float, default=5.0, help="window width (simulated s)")
    p.add_argument("--chunk", type=int, default=2048, help="prefill chunk per iteration (engine.max_num_batched_tokens)")
    args = p.parse_args()
    files: list[Path] = []
    for raw in args.paths:
        path = Path(raw)
        files += sorted([*path.glob("*/result.json"), *path.glob("*/run-1/result.json")]) if path.is_dir() else [path]
    for f in files:
        result = json.loads(f.read_text())
        s = result["summary"]
        print(
            f"== {f.parent} ({result['policy']}): {s['requests']} requests, TTFT p50 {s['ttft']['p50']:.2f} s p99 "
            f"{s['ttft']['p99']:.2f} s, TPOT p50 {s['tpot']['p50'] * 1e3:.0f} ms, drops {result['drops']}, prefill "
            f"capacity {prefill_capacity(result, args.chunk):,.0f} tok/s"
        )
        heads = (("t (s)", 7), ("arrived", 7), ("prefill load", 12), ("KV used", 7), ("waiting", 7), ("KV total", 8), ("piped", 5))
        print(" ".join(f"{h:>{n}}" for h, n in (*heads, ("TTFT p50", 8), ("TTFT p99", 8))))
        for w in windows(result, args.window, args.chunk):
            print(
                f"{w['t0']:>7.0f} {w['arrived']:>7} {w['prefill_load']:>12.2f} {w['kv_used']:>7.2f} {w['kv_waiting']:>7.2f} "
                f"{w['kv_total']:>8.2f} {w['pipelined']:>5} {w['ttft_p50']:>8.2f} {w['ttft_p99']:>8.2f}"
            )


if __name__ == "__main__":
    main()
