"""Layer-wise preemption's costs and reaction time (ConServe §4.3, issue 16's targets), on one engine in-process.

Three measurements on the larger shape of bench/engine.py (8 layers, hidden 1024) and the embedded one, one
torch thread, safepoints every layer (engine.safepoint_layers = 1):

1. **overhead, online only** — the same decode iterations with safepoints on and off. With no offline row in a
   batch no safepoint is even built, so this is the cost of finding that out (target: <= 2% of step time);
2. **overhead, mixed** — decode iterations with offline rows, safepoints on (the online rows' metadata built
   before every pass, the flag read between layers) against off;
3. **reaction** — an online arrival raised during layer 0 of a mixed prefill iteration (by wrapping that
   layer's first projection, as tests/unit/engine/test_layerwise_preemption.py does): the time from the flag
   to the end of the cut iteration, against the whole iteration uncut and one layer's time. The target is
   "within one layer group": the cut comes at the next safepoint, so the offline rows stop after at most one
   more layer.

Each figure is the median of --repeats timed runs after a warm-up. Prints a table and writes JSON.

    python bench/safepoint.py --quick
    python bench/safepoint.py --out bench/results/safepoint.json
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import time
from typing import Any

import torch
from engine import LARGER_CONFIG  # bench/engine.py
from harness import write_json

from kunserve.shared.engine.api import EngineRequest, SamplingParams  # noqa: E402
from kunserve.shared.engine.engine import Engine, SchedulerConfig  # noqa: E402
from kunserve.shared.model.architecture import TINY_CONFIG, ModelConfig  # noqa: E402
from kunserve.shared.model.weights import random_weights  # noqa: E402

BS = 16


def _reqs(cfg: ModelConfig, n: int, prompt: int, max_tokens: int, offline: bool, seed: int, tag: str) -> list[EngineRequest]:
    rng = random.Random(seed)
    return [EngineRequest(f"{tag}{i}", [rng.randrange(258, cfg.vocab_size) for _ in range(prompt)],
                          SamplingParams(max_tokens=max_tokens, ignore_eos=True), offline=offline) for i in range(n)]


def _engine(cfg: ModelConfig, weights: dict, safepoints: bool) -> Engine:
    eng = Engine(cfg, weights, num_kv_blocks=1024, block_size=BS,
                 scheduler_config=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=128,
                                                  offline_free_watermark=0.0))
    if safepoints:
        eng.enable_layerwise_preemption(1, ttft_s=1e-3)  # any arrival would miss it: cut whenever flagged
    return eng


def _decode_step_s(cfg: ModelConfig, weights: dict, safepoints: bool, online: int, offline: int, steps: int) -> float:
    """Median time of `steps` pure-decode iterations of online + offline requests (prefilled first)."""
    eng = _engine(cfg, weights, safepoints)
    for r in _reqs(cfg, online, 128, steps + 8, False, 1, "on") + _reqs(cfg, offline, 128, steps + 8, True, 2, "off"):
        eng.add_request(r)
    while any(s.num_computed < len(s.tokens) - 1 for s in eng.seqs.values()):  # prefill everything
        eng.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def _reaction(cfg: ModelConfig, weights: dict) -> dict[str, float]:
    """A mixed prefill iteration (online decodes + offline prompts): uncut, and cut by an arrival in layer 0."""
    def setup(arrive: bool) -> tuple[Engine, list[float]]:
        eng = _engine(cfg, weights, safepoints=True)
        for r in _reqs(cfg, 4, 64, 4, False, 3, "on"):
            eng.add_request(r)
        eng.step()  # the online requests decode from now on
        for r in _reqs(cfg, 4, 384, 2, True, 4, "off"):
            eng.add_request(r)
        flagged: list[float] = []
        if arrive:
            layer = eng.runner.layers[eng.runner.start]
            inner = layer.qkv

            def qkv(x: torch.Tensor, inner=inner) -> torch.Tensor:
                if not flagged:
                    flagged.append(time.perf_counter())
                    eng.online_arrived(16)
                return inner(x)
            layer.qkv = qkv  # type: ignore[assignment]
        return eng, flagged

    eng, _ = setup(arrive=False)
    t0 = time.perf_counter()
    eng.step()
    whole = time.perf_counter() - t0
    eng, flagged = setup(arrive=True)
    eng.step()
    end = time.perf_counter()
    assert eng.layerwise_preemptions == 1, "the arrival did not cut the iteration"
    return {"uncut_step_s": whole, "flag_to_end_s": end - flagged[0], "layer_s": whole / cfg.num_layers}


def run(cfg: ModelConfig, repeats: int, steps: int) -> dict[str, Any]:
    torch.manual_seed(0)
    weights = random_weights(cfg, seed=0)
    out: dict[str, Any] = {"model": cfg.name, "layers": cfg.num_layers}
    for name, online, offline in (("online_only", 32, 0), ("mixed", 16, 16)):
        off = [_decode_step_s(cfg, weights, False, online, offline, steps) for _ in range(repeats)]
        on = [_decode_step_s(cfg, weights, True, online, offline, steps) for _ in range(repeats)]
        out[name] = {"off_s": statistics.median(off), "on_s": statistics.median(on),
                     "overhead": statistics.median(on) / statistics.median(off) - 1}
    rs = [_reaction(cfg, weights) for _ in range(repeats)]
    out["reaction"] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the embedded shape only, 3 repeats, 10 steps")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20, help="decode iterations timed per run")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    torch.set_num_threads(1)
    shapes = [TINY_CONFIG] if args.quick else [TINY_CONFIG, LARGER_CONFIG]
    repeats, steps = (3, 10) if args.quick else (args.repeats, args.steps)
    rows = [run(cfg, repeats, steps) for cfg in shapes]
    print(f"layer-wise preemption, one torch thread, safepoints every layer ({platform.node()}, {os.cpu_count()} cpus)")
    print(f"{'model':<16} {'decode online-only ms':>22} {'overhead':>9} {'decode mixed ms':>16} {'overhead':>9} "
          f"{'uncut step ms':>14} {'flag->end ms':>13} {'one layer ms':>13}")
    for r in rows:
        o, m, x = r["online_only"], r["mixed"], r["reaction"]
        print(f"{r['model']:<16} {o['off_s'] * 1e3:>10.2f} / {o['on_s'] * 1e3:<9.2f} {o['overhead']:>+8.1%} "
              f"{m['off_s'] * 1e3:>7.2f} / {m['on_s'] * 1e3:<6.2f} {m['overhead']:>+8.1%} "
              f"{x['uncut_step_s'] * 1e3:>14.1f} {x['flag_to_end_s'] * 1e3:>13.1f} {x['layer_s'] * 1e3:>13.1f}")
    if args.out:
        write_json(args.out, {"meta": {"host": platform.node(), "cpus": os.cpu_count(), "repeats": repeats,
                                       "steps": steps}, "rows": rows})
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
