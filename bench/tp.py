"""Elastic tensor parallelism (README "Elastic tensor parallelism (Gyges)"): what the page-aligned MLP shards cost, and
(`--mixed`) what elastic TP does for a mixed trace in a real cluster, and (`--transform`) what an in-place
transformation of running engines costs.

Printed as tables and written as JSON (`--out`: "padding", "mixed" with `--mixed`, "transform" with `--transform`):

padding — pure arithmetic with the layout the pool uses with `padded_mlp` (shared/model/tp_padding.py): for each
          model shape shipped with the simulator (kunserve/sim/models/*) and the embedded one, the MLP's gate, up
          and down^T rows of each of four shards (the TP1/2/4 split points) side by side in one page-aligned unit,
          at the CUDA pool's 2 MiB pages
          and at a 64 KiB page. Reported: the bytes the gaps add per layer, as a share of the layer's MLP and of
          its whole weights (attention included), beside what the paper's Eq. 2 row padding (each shard rounded to
          a whole number of page-sized rows) would add, and the pages one member releases in place when a TP1
          instance becomes TP2 and TP4 (the MLP pages it no longer keeps).

mixed   — (bench/tp_mixed.py) after Gyges §6.2.4: short requests (64-200 prompt tokens, 32 output, greedy, ignore_eos)
          at a steady open-loop `--rate` for `--duration` s, and `--longs` long requests at even fractions of the
          duration, each a little more than a whole instance's KV and well within the TP2 instance's
          (kv_tokens_by_degree of the pools). The same trace goes through a fresh 2-worker LocalCluster (the embedded
          model saved with an 8192-token context, 26 MiB pools of 256 KiB pages) in three configurations: `elastic`
          (dispatcher.elastic_tp: the two whole instances merge into TP2 when a long request arrives and split back
          once idle for `--idle-split-s`), `static-tp1` (two whole instances, elastic off: long requests are refused
          with INVALID_ARGUMENT) and `static-tp2` (one [[tensor_parallel]] instance from the config). Reported per
          configuration: the shorts completed, their output tokens/s and requests/s over the window from the first
          arrival to the last short's end, TTFT p50/p99 and TPOT p50 (client clock); the long requests served /
          refused / failed, each one's TTFT, and whether every served long request's greedy tokens equal the dense
          reference's (teacher-forced, kunserve.shared.model.reference; a divergence after a top-2 margin below 1e-3
          counts as equal, the project's oracle); the shorts are checked the same way (JSON). For `elastic` the
          transformations are the memory manager's `tp_reform_done` events (their own duration, from the re-form's
          start to every member serving): each scale-up and split, their total as a share of the run's wall time
          (trace start to the last request's or transformation's end; after the trace the bench waits for the merged
          instance to split back) and how long the cluster served as the merged instance.

transform — (bench/tp_transform_bench.py) the in-place transformation itself (shared/engine/tp_transform.py), in this
          process: 2 or 4 PooledInstances (the pool's "host" backend) on threads over a real gloo group, one torch
          thread, each filled with running requests to about 25% and 75% of its KV blocks (the embedded model at TP2, a
          larger random model, hidden 512 and 8 layers of 8 KV heads, at TP2 and TP4; `--quick`: the embedded model
          at TP2 and 50%). Reported per row: the time of scale_up and of scale_down (the slowest member's) and each as
          a multiple of the merged instance's decode step, the TP step beside a whole instance's, the sub-blocks sent
          per layer, the most one member held staged (the extra memory of the move) beside the KV bytes in use per
          layer, the pool pages mapped before, while merged and after (equal: nothing is mapped or released), and
          whether every request's greedy tokens across the merge and the split equal the dense reference's.

The paper (Gyges §4.2) reports 0-14% padding overhead across its models. The cluster's elastic TP (`--mixed`) does not
use the in-place transformation `--transform` measures: it changes the TP degree by re-forming its members (README),
which re-executes them and reloads weights rather than releasing pages in place, so the scale-up and split times of
`--mixed` are those of a cold re-form (seconds, mostly process start and model load), not Gyges' milliseconds;
requests running during one are handed over and re-prefill. On a 2-core CPU the all-reduce between the TP2 members
gives no speed-up (they share the cores), so the mixed trace shows whether the long requests get served and what the
shorts pay for it, not TP's compute gain; the figures move with the machine's load (rerun the configurations together
to compare them).

    python bench/tp.py
    python bench/tp.py --out bench/results/tp.json
    python bench/tp.py --mixed --duration 60 --out bench/results/tp_mixed.json
    python bench/tp.py --transform --out bench/results/tp_transform.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from kunserve.shared.model.architecture import TINY_CONFIG, ModelConfig  # noqa: E402
from kunserve.shared.model.tp_padding import SHARDS, FFNShardLayout  # noqa: E402
from kunserve.sim.shapes import SHIPPED, load_model_config  # noqa: E402

MIB = 1 << 20
PAGE_SIZES = (2 * MIB, 64 * 1024)
MIXED_CONFIGS = ("elastic", "static-tp1", "static-tp2")  # tp_mixed.CONFIGS, named here so bad input fails before imports
DEFAULT_RATE = 20.0  # short requests per second: about half what two whole instances of the embedded model take on 2 cores
MAX_LONGS = 8  # each long request is 64 tokens longer than the one before: 8 stay within half the TP2 instance's KV


def _itemsize(cfg: ModelConfig) -> int:
    return 4 if cfg.dtype == "float32" else 2


def _layer_weight_bytes(cfg: ModelConfig) -> tuple[int, int]:
    """(MLP bytes, all weight bytes) of one decoder layer, unpadded."""
    size = _itemsize(cfg)
    head_dim = cfg.head_dim
    q = cfg.hidden_size * cfg.num_heads * head_dim
    kv = 2 * cfg.hidden_size * cfg.num_kv_heads * head_dim
    o = cfg.num_heads * head_dim * cfg.hidden_size
    mlp = 3 * cfg.hidden_size * cfg.intermediate_size
    norms = 2 * cfg.hidden_size
    return mlp * size, (q + kv + o + mlp + norms) * size


def _row_padding_bytes(layout: FFNShardLayout) -> int:
    """Eq. 2 read literally: every shard padded with zero rows up to a whole number of pages (rows of `hidden`)."""
    row = layout.hidden * layout.itemsize
    step = layout.page_bytes
    # the fewest rows whose bytes are a multiple of the page: lcm(row, page) / row
    rows_per_unit = math.lcm(row, step) // row
    padded_rows = -(-layout.shard_rows // rows_per_unit) * rows_per_unit
    return (padded_rows - layout.shard_rows) * row * layout.shards


def padding_row(cfg: ModelConfig, page: int) -> dict[str, Any]:
    size = _itemsize(cfg)
    layout = FFNShardLayout(cfg.intermediate_size, cfg.hidden_size, size, page)
    # the pool's unit per shard: gate, up and down^T rows side by side, R x 3*hidden (tp_padding.shards_shape)
    units = FFNShardLayout(cfg.intermediate_size, 3 * cfg.hidden_size, size, page)
    mlp_bytes, layer_bytes = _layer_weight_bytes(cfg)
    gap = units.padding_bytes
    rows = 3 * _row_padding_bytes(layout)
    per_shard_pages = units.stride_bytes // page
    return {
        "model": cfg.name,
        "dtype": cfg.dtype,
        "page_bytes": page,
        "hidden": cfg.hidden_size,
        "intermediate": cfg.intermediate_size,
        "layers": cfg.num_layers,
        "mlp_bytes_per_layer": mlp_bytes,
        "gap_bytes_per_layer": gap,
        "gap_share_of_mlp": gap / mlp_bytes,
        "gap_share_of_layer": gap / layer_bytes,
        "eq2_row_bytes_per_layer": rows,
        "eq2_row_share_of_mlp": rows / mlp_bytes,
        # one member's MLP pages released in place per layer, TP1 -> TP2 and TP1 -> TP4 (three matrices)
        "released_pages_tp2": per_shard_pages * (SHARDS - SHARDS // 2),
        "released_pages_tp4": per_shard_pages * (SHARDS - SHARDS // 4),
        "released_bytes_tp2_all_layers": per_shard_pages * (SHARDS - SHARDS // 2) * page * cfg.num_layers,
    }


def padding_rows() -> list[dict[str, Any]]:
    shapes = [TINY_CONFIG.replace(name="embedded")] + [load_model_config(name, dtype="bfloat16") for name in SHIPPED]
    return [
        padding_row(cfg, page)
        for cfg in shapes
        for page in PAGE_SIZES
        if cfg.intermediate_size % SHARDS == 0 and page % _itemsize(cfg) == 0
    ]


def print_padding(rows: list[dict[str, Any]]) -> None:
    t = Table(title="Page-aligned MLP shards (4 units of gate, up, down^T: the TP1/2/4 split points); per layer")
    for col in (
        "model",
        "dtype",
        "page",
        "MLP MiB",
        "gap KiB",
        "gap / MLP",
        "gap / layer",
        "Eq.2 rows / MLP",
        "pages freed TP1->2",
        "TP1->4",
    ):
        t.add_column(col, justify="left" if col in ("model", "dtype") else "right")
    for r in rows:
        page = f"{r['page_bytes'] // MIB} MiB" if r["page_bytes"] >= MIB else f"{r['page_bytes'] // 1024} KiB"
        t.add_row(
            r["model"],
            r["dtype"],
            page,
            f"{r['mlp_bytes_per_layer'] / MIB:,.1f}",
            f"{r['gap_bytes_per_layer'] / 1024:,.0f}",
            f"{100 * r['gap_share_of_mlp']:.2f}%",
            f"{100 * r['gap_share_of_layer']:.2f}%",
            f"{100 * r['eq2_row_share_of_mlp']:.2f}%",
            str(r["released_pages_tp2"]),
            str(r["released_pages_tp4"]),
        )
    Console(width=160).print(t)


def _seconds(r: dict[str, Any] | None, key: str) -> str:
    v = None if r is None else r.get(key)
    return "-" if v is None else f"{v:.2f}"


def print_mixed(mixed: dict[str, Any]) -> None:
    trace = mixed["trace"]
    longs = ", ".join(f"{r['tokens']} tok at {r['at_s']:.0f} s" for r in trace["long_requests"]) or "none"
    kv = mixed["pool"]["kv_tokens_by_degree"]
    t = Table(
        title=f"Mixed trace: shorts at {trace['short_rate_per_s']:g}/s for {trace['duration_s']:g} s "
        f"({trace['short_prompt_tokens'][0]}-{trace['short_prompt_tokens'][1]} + {trace['short_output_tokens']} "
        f"tokens); long: {longs}; KV tokens TP1 {kv['1']}, TP2 {kv['2']}"
    )
    for col in (
        "config",
        "short done",
        "short tok/s",
        "short req/s",
        "TTFT p50 s",
        "TTFT p99 s",
        "TPOT p50 ms",
        "long served",
        "refused",
        "failed",
        "long TTFT s",
        "= reference",
        "scale-up s",
        "split s",
        "transform share",
        "at TP2 / wall s",
    ):
        t.add_column(col, justify="left" if col in ("config", "= reference") else "right")
    for r in mixed["configs"]:
        s, lg, tr = r["short"], r["long"], r["transformations"]
        ttfts = ", ".join(_seconds(q, "ttft_s") for q in lg["requests"] if q["status"] == "served") or "-"
        equal = {None: "-", True: "yes", False: "no"}[lg["tokens_equal_reference"]]
        t.add_row(
            r["config"],
            f"{s['completed']}/{s['sent']}",
            _num(s["tokens_per_s"], 1),
            _num(s["requests_per_s"], 2),
            _seconds(s["ttft_s"], "p50"),
            _seconds(s["ttft_s"], "p99"),
            _num(None if s["tpot_s"]["p50"] is None else 1e3 * s["tpot_s"]["p50"], 1),
            f"{lg['served']}/{lg['sent']}",
            str(lg["refused"]),
            str(lg["failed"]),
            ttfts,
            equal,
            ", ".join(f"{x:.1f}" for x in tr["scale_up_s"]) or "-",
            ", ".join(f"{x:.1f}" for x in tr["split_s"]) or "-",
            "-" if tr["share_of_wall"] is None or not tr["events"] else f"{100 * tr['share_of_wall']:.1f}%",
            f"{tr['merged_s']:.0f} / {r['wall_s']:.0f}" if tr["events"] else "-",
        )
    t.caption = "greedy tokens equal to the dense reference's (near-ties allowed), shorts: " + ", ".join(
        f"{r['config']} {r['short']['reference']['equal'] + r['short']['reference']['near-tie']}/{r['short']['completed']}"
        for r in mixed["configs"]
    )
    Console(width=220).print(t)


def _num(v: float | None, digits: int) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the results as JSON to this path")
    ap.add_argument("--mixed", action="store_true", help="also replay the mixed trace through elastic, static TP1 and TP2")
    ap.add_argument("--transform", action="store_true", help="also time in-place TP scale-up / scale-down of running engines")
    ap.add_argument("--quick", action="store_true", help="--mixed: 20 s and one long request unless given; --transform: one row")
    ap.add_argument("--duration", type=float, help="--mixed: seconds of short arrivals per configuration (60; --quick 20)")
    ap.add_argument("--rate", type=float, default=DEFAULT_RATE, help="--mixed: short requests per second")
    ap.add_argument("--longs", type=int, help="--mixed: long requests, at even fractions of the duration (3; --quick 1)")
    ap.add_argument("--idle-split-s", type=float, default=3.0, help="--mixed: memory_manager.tp_idle_split_s (elastic)")
    ap.add_argument("--configs", default=",".join(MIXED_CONFIGS), help="--mixed: which of " + ", ".join(MIXED_CONFIGS))
    ap.add_argument("--seed", type=int, default=0, help="--mixed: the trace's seed")
    args = ap.parse_args(argv)
    if args.duration is None:
        args.duration = 20.0 if args.quick else 60.0
    if args.longs is None:
        args.longs = 1 if args.quick else 3
    configs = list(dict.fromkeys(c.strip() for c in args.configs.split(",") if c.strip()))
    unknown = sorted(set(configs) - set(MIXED_CONFIGS))
    if unknown or not configs:
        ap.error(f"--configs: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(MIXED_CONFIGS)}")
    if not (args.duration > 0 and math.isfinite(args.duration)):
        ap.error(f"--duration must be > 0 seconds, got {args.duration:g}")
    if not (args.rate > 0 and math.isfinite(args.rate)) or args.duration * args.rate < 1:
        ap.error(f"--rate must be > 0 and give at least one short request in --duration, got {args.rate:g}")
    if not 0 <= args.longs <= MAX_LONGS:
        ap.error(f"--longs must be 0 to {MAX_LONGS}, got {args.longs}")
    if not (args.idle_split_s > 0 and math.isfinite(args.idle_split_s)):
        ap.error(f"--idle-split-s must be > 0 seconds, got {args.idle_split_s:g}")
    rows = padding_rows()
    print_padding(rows)
    result: dict[str, Any] = {"padding": rows}
    if args.mixed:
        sys.path.insert(0, str(Path(__file__).resolve().parent))  # harness.py and tp_mixed.py beside this script
        import tp_mixed

        result["mixed"] = tp_mixed.run_mixed(args.duration, args.rate, args.longs, args.idle_split_s, args.seed, configs)
        print_mixed(result["mixed"])
    if args.transform:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import tp_transform_bench

        result["transform"] = tp_transform_bench.run_transform(quick=args.quick)
        tp_transform_bench.print_transform(result["transform"])
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1, allow_nan=False))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
