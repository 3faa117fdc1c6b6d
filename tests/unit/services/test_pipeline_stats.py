"""Bubble accounting reaches the operator: WorkerStats carries busy / idle / bubble seconds and the
ratio, the worker fills them from its engine, and `kunctl status` shows a bubble column."""

from __future__ import annotations

import io
import sys

from kunserve.cli.kunctl import render_status
from kunserve.shared.engine.accounting import BusyIdle
from kunserve.shared.engine.api import EngineStats
from kunserve.shared.wire.cluster_state import busy_idle_fields, engine_stats_to_pb
from kunserve.v1 import admin_pb2, memory_manager_pb2, monitor_pb2


def _stats(**extra):
    es = EngineStats(kv_blocks_total=10, kv_blocks_used=2, block_size=16, num_running=1, num_waiting=0,
                     queued_demand_blocks=0, num_preemptions=0, prompt_tokens_total=5, generated_tokens_total=3)
    fields = {"worker_id": "worker-0", "address": "127.0.0.1:1", "layer_start": 0, "layer_end": 4,
              "num_layers_model": 4, **extra}
    return engine_stats_to_pb(es, **fields)


def test_worker_stats_carry_busy_idle_and_bubble():
    b = BusyIdle(busy_s=3.0, idle_s=7.0, bubble_s=1.0)
    s = _stats(**busy_idle_fields(b))
    assert (s.busy_seconds_total, s.idle_seconds_total, s.bubble_seconds_total) == (3.0, 7.0, 1.0)
    assert s.bubble_ratio == 0.25


def test_servicer_fills_them_from_the_engine():
    from kunserve.services.worker.servicer import WorkerIdentity, WorkerServicer
    from kunserve.shared.engine.engine import Engine
    from kunserve.shared.engine.loop import EngineLoop
    from kunserve.shared.model.architecture import TINY_CONFIG
    from kunserve.shared.model.weights import random_weights

    cfg = TINY_CONFIG.replace(num_layers=1, name="one")
    eng = Engine(cfg, random_weights(cfg, 0), num_kv_blocks=8, block_size=16)
    from kunserve.shared.engine.api import EngineRequest, SamplingParams

    eng.generate([EngineRequest("a", [1, 2, 3], SamplingParams(max_tokens=2))])

    class Instance:
        layer_range = (0, 1)

        def capacity_for(self, start: int, end: int) -> int:
            return 8

    ident = WorkerIdentity("w", "127.0.0.1:1", "one", 1, cfg.vocab_size, 64, "cpu", "float32")
    s = WorkerServicer(ident, EngineLoop(eng), Instance()).current_stats()
    assert s.busy_seconds_total > 0 and s.idle_seconds_total >= 0
    assert 0 <= s.bubble_seconds_total <= s.idle_seconds_total and 0 <= s.bubble_ratio < 1


def test_kunctl_status_shows_the_bubble_column(monkeypatch):
    status = admin_pb2.AdminStatus(
        cluster=monitor_pb2.ClusterStatus(workers=[
            monitor_pb2.WorkerStatus(stats=_stats(**busy_idle_fields(BusyIdle(3.0, 7.0, 1.0))), healthy=True),
            monitor_pb2.WorkerStatus(stats=_stats(worker_id="worker-1"), healthy=True)]),
        layout=memory_manager_pb2.ClusterLayout(epoch=1, num_layers_model=4, workers=[
            memory_manager_pb2.WorkerLayout(worker_id="worker-0", group_id="worker-0"),
            memory_manager_pb2.WorkerLayout(worker_id="worker-1", group_id="worker-1"),
            memory_manager_pb2.WorkerLayout(worker_id="worker-2", group_id="worker-2")]))
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    render_status(status)
    text = out.getvalue()
    assert "bubble %" in text and "25.0" in text
    lines = {line.split("│")[1].strip(): line for line in text.splitlines() if "worker-" in line and "│" in line}
    assert lines["worker-1"].rstrip("│ ").endswith("-")  # no busy time reported yet: no ratio
