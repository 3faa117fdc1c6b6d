"""How fast the simulator runs: simulated seconds per wall second, by cluster size and arrival rate.

Each cell simulates --duration seconds of a BurstGPT-shaped load (Gamma arrivals, CV 2, BurstGPT lengths: mean 642
in / 262 out) on N instances of Qwen-2.5-14B on A800s (the KunServe Fig. 13 cluster, roofline time model) under the
kunserve policy, at a per-instance rate, and reports the wall and CPU seconds it took, the simulated seconds per wall
second, the requests and generated tokens per wall second, and the wall time a simulated hour would take at that
speed. Token times are not kept (the speed of the simulation, not of writing result.json, is measured).

    python bench/simulate.py
    python bench/simulate.py --instances 8,16,32,64 --rates 1,2 --duration 60 --out bench/results/simulate.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kunserve.benchkit.trace import generate_trace  # noqa: E402
from kunserve.cli.simulate import row_config  # noqa: E402
from kunserve.shared.config import load_config  # noqa: E402
from kunserve.shared.log import configure_logging  # noqa: E402
from kunserve.sim.cluster import Simulation  # noqa: E402
from kunserve.sim.scenario import ClusterSpec, build_setup  # noqa: E402


def cell(instances: int, rate_per_instance: float, duration_s: float, seed: int) -> dict:
    cfg = row_config(load_config(None, environ={}), "kunserve", 600.0)
    cfg.engine.block_size, cfg.engine.max_num_batched_tokens, cfg.engine.max_num_seqs = 64, 2048, 256
    setup = build_setup(
        cfg, ClusterSpec(instances=instances, model="qwen2.5-14b", accelerator="A800", network_gbps=200.0), label="kunserve"
    )
    trace = generate_trace(
        rate=rate_per_instance * instances, cv=2.0, duration_s=duration_s, profile="burstgpt", seed=seed, max_prompt=4096, max_output=1024
    )
    wall0, cpu0 = time.perf_counter(), time.process_time()
    out = Simulation(setup, trace, record_token_times=False).run()
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    results = out.replay.results
    tokens = sum(r.output_tokens for r in results if r.ok)
    return {
        "instances": instances,
        "rate_per_instance": rate_per_instance,
        "requests": len(results),
        "completed": sum(r.ok for r in results),
        "simulated_s": out.window_s,
        "wall_s": wall,
        "cpu_s": cpu,
        "simulated_s_per_wall_s": out.window_s / wall,
        "simulated_s_per_cpu_s": out.window_s / cpu,
        "requests_per_wall_s": len(results) / wall,
        "tokens_per_wall_s": tokens / wall,
        "iterations": out.counters["iterations"],
        "drops": out.counters.get("policy", {}).get("drops", 0),
        "hour_wall_min": 3600 / (out.window_s / wall) / 60,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--instances", default="8,16,32,64", help="comma-separated cluster sizes")
    p.add_argument("--rates", default="1,2", help="comma-separated arrival rates per instance (req/s)")
    p.add_argument("--duration", type=float, default=30.0, help="simulated seconds of arrivals per cell")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the table as JSON here")
    args = p.parse_args()
    configure_logging("bench-simulate", fmt="console", level="error")
    rows = []
    print(
        f"{'instances':>9} {'req/s/inst':>10} {'requests':>8} {'sim s':>7} {'wall s':>7} {'cpu s':>7} "
        f"{'sim s/wall s':>12} {'tok/wall s':>10} {'1 h takes':>10}"
    )
    for n in (int(x) for x in args.instances.split(",")):
        for rate in (float(x) for x in args.rates.split(",")):
            r = cell(n, rate, args.duration, args.seed)
            rows.append(r)
            print(
                f"{n:>9} {rate:>10g} {r['requests']:>8} {r['simulated_s']:>7.1f} {r['wall_s']:>7.1f} {r['cpu_s']:>7.1f} "
                f"{r['simulated_s_per_wall_s']:>12.2f} {r['tokens_per_wall_s']:>10.0f} {r['hour_wall_min']:>8.1f} m",
                flush=True,
            )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"duration_s": args.duration, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
