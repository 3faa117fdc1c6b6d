"""bench/tp.py --transform --quick: running engines (padded-MLP pools) merge into TP2 and split back in place, the JSON
says what it measured, no page is mapped beyond the pool's (the released MLP pages go to the KV and come back), and
every request's tokens equal the dense reference's."""

from __future__ import annotations

import json

import pytest
from scripts_loader import load_script

pytestmark = pytest.mark.timeout(120)


def test_quick_transform_writes_its_rows_and_keeps_the_pages(tmp_path, capsys):
    out = tmp_path / "tp.json"
    assert load_script("bench/tp.py", "bench_tp_transform").main(["--transform", "--quick", "--out", str(out)]) == 0
    assert "In-place TP transformation" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert "padding" in result and "mixed" not in result
    rows = result["transform"]["rows"]
    assert len(rows) == 1
    r = rows[0]
    assert r["degree"] == 2 and r["requests"] == 8 and r["padded_mlp"] is True
    assert r["weight_pages_released"] > 0 and r["kv_subblocks_merged"] > 2 * r["kv_blocks_per_member"]
    assert 0 < r["kv_used_share"] < 1 and r["kv_used_blocks"] > 0
    assert r["pages_mapped_before"] == r["pages_mapped_merged"] == r["pages_mapped_after"] > 0
    assert r["pages_unchanged"] is True
    assert r["up_sent_subblocks_per_layer"] > 0 and r["down_sent_subblocks_per_layer"] > 0
    assert r["moved_requests_up"] == 4  # rank 1's requests go to rank 0
    assert 0 < r["up_staging_bytes"] and 0 < r["down_staging_bytes"]
    assert r["kv_bytes_in_use_per_layer"] > 0
    for key in ("scale_up_ms", "scale_down_ms", "tp_step_ms", "whole_step_ms", "scale_up_steps", "scale_down_steps"):
        assert r[key] > 0, key
    assert r["scale_up_steps"] == pytest.approx(r["scale_up_ms"] / r["tp_step_ms"])
    # the same requests split layer by layer: one step between every two layers' moves
    assert r["stagger_steps_between"] == r["layers"] and r["stagger_layer_ms_total"] >= r["stagger_layer_ms_max"] > 0
    assert r["stagger_begin_ms"] > 0
    assert r["tokens"]["differs"] == 0 and r["tokens"]["equal"] + r["tokens"]["near-tie"] == r["requests"]
