"""Elastic tensor parallelism (README "Elastic tensor parallelism (Gyges)"): what the page-aligned MLP shards cost.

Printed as a table and written as JSON (`--out`):

padding — pure arithmetic with the layout the pool would use (shared/model/tp_padding.py): for each model shape
          shipped with the simulator (kunserve/sim/models/*) and the embedded one, the MLP's gate, up and down
          matrices stored as four page-aligned shards (the TP1/2/4 split points), at the CUDA pool's 2 MiB pages
          and at a 64 KiB page. Reported: the bytes the gaps add per layer, as a share of the layer's MLP and of
          its whole weights (attention included), beside what the paper's Eq. 2 row padding (each shard rounded to
          a whole number of page-sized rows) would add, and the pages one member releases in place when a TP1
          instance becomes TP2 and TP4 (the MLP pages it no longer keeps).

The paper (Gyges §4.2) reports 0-14% padding overhead across its models. What is not measured here: the time
of an in-place transformation. This cluster changes the TP degree by re-forming its members (README), which
reloads weights rather than releasing pages in place, so there is no in-place move to time.

    python bench/tp.py
    python bench/tp.py --out bench/results/tp.json
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
    mlp_bytes, layer_bytes = _layer_weight_bytes(cfg)
    gap = 3 * layout.padding_bytes
    rows = 3 * _row_padding_bytes(layout)
    per_shard_pages = layout.stride_bytes // page
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
        "released_pages_tp2": 3 * per_shard_pages * (SHARDS - SHARDS // 2),
        "released_pages_tp4": 3 * per_shard_pages * (SHARDS - SHARDS // 4),
        "released_bytes_tp2_all_layers": 3 * per_shard_pages * (SHARDS - SHARDS // 2) * page * cfg.num_layers,
    }


def padding_rows() -> list[dict[str, Any]]:
    shapes = [TINY_CONFIG.replace(name="embedded")] + [load_model_config(name, dtype="bfloat16") for name in SHIPPED]
    return [padding_row(cfg, page) for cfg in shapes for page in PAGE_SIZES
            if cfg.intermediate_size % SHARDS == 0 and page % _itemsize(cfg) == 0]


def print_padding(rows: list[dict[str, Any]]) -> None:
    t = Table(title="Page-aligned MLP shards (4 per matrix: the TP1/2/4 split points); per layer")
    for col in ("model", "dtype", "page", "MLP MiB", "gap KiB", "gap / MLP", "gap / layer", "Eq.2 rows / MLP",
                "pages freed TP1->2", "TP1->4"):
        t.add_column(col, justify="left" if col in ("model", "dtype") else "right")
    for r in rows:
        page = f"{r['page_bytes'] // MIB} MiB" if r["page_bytes"] >= MIB else f"{r['page_bytes'] // 1024} KiB"
        t.add_row(r["model"], r["dtype"], page, f"{r['mlp_bytes_per_layer'] / MIB:,.1f}",
                  f"{r['gap_bytes_per_layer'] / 1024:,.0f}", f"{100 * r['gap_share_of_mlp']:.2f}%",
                  f"{100 * r['gap_share_of_layer']:.2f}%", f"{100 * r['eq2_row_share_of_mlp']:.2f}%",
                  str(r["released_pages_tp2"]), str(r["released_pages_tp4"]))
    Console(width=160).print(t)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the results as JSON to this path")
    args = ap.parse_args(argv)
    rows = padding_rows()
    print_padding(rows)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"padding": rows}, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
