"""bench/tp.py's padding arithmetic on a shape worked by hand: Qwen2.5-14B (hidden 5120, intermediate 13824, bf16)."""

from __future__ import annotations

from scripts_loader import load_script

from kunserve.sim.shapes import load_model_config

MIB = 1 << 20


def _bench():
    return load_script("bench/tp.py", "bench_tp")


def test_qwen14b_gaps_and_released_pages_at_2mib():
    row = _bench().padding_row(load_model_config("qwen2.5-14b", dtype="bfloat16"), 2 * MIB)
    # a shard's unit (gate, up, down^T rows) is 3456 rows x 3 x 5120 x 2 B = 101.25 MiB -> 51 pages of 2 MiB: 0.75 MiB
    # of gap per shard, 4 shards
    assert row["gap_bytes_per_layer"] == 4 * 3 * MIB // 4
    # Eq. 2 rows: 10,240-byte rows come in whole pages every 1,024 rows -> 3456 rows padded to 4096
    assert row["eq2_row_bytes_per_layer"] == 3 * 4 * 640 * 10240
    # TP1 -> TP2 releases 2 of the 4 units (51 pages each); TP1 -> TP4 three of them
    assert (row["released_pages_tp2"], row["released_pages_tp4"]) == (2 * 51, 3 * 51)


def test_a_shape_whose_shards_fill_whole_pages_has_no_gap():
    row = _bench().padding_row(load_model_config("llama-3.1-8b", dtype="bfloat16"), 2 * MIB)
    assert row["gap_bytes_per_layer"] == 0 and row["gap_share_of_mlp"] == 0.0
