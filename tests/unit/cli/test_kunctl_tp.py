"""`kunctl tp` / `kunctl tp-split` (kunserve/cli/kunctl.py): arguments, the request they send and the report."""

from __future__ import annotations

import pytest

from kunserve.cli import kunctl
from kunserve.v1 import memory_manager_pb2


def report(**kw) -> memory_manager_pb2.TPReport:
    base = dict(
        op="tp",
        completed=True,
        members=["w0", "w1"],
        degree=2,
        epoch=7,
        port=5000,
        handed_over=1,
        total_seconds=4.25,
        before=[
            memory_manager_pb2.TPInstance(members=["w0"], kv_blocks=80, kv_tokens=1280),
            memory_manager_pb2.TPInstance(members=["w1"], kv_blocks=80, kv_tokens=1280),
        ],
        after=[memory_manager_pb2.TPInstance(members=["w0", "w1"], kv_blocks=352, kv_tokens=5632)],
    )
    base.update(kw)
    return memory_manager_pb2.TPReport(**base)


def test_the_report_names_the_instances_before_and_after():
    text = kunctl.format_tp_report(report())
    assert text.splitlines() == [
        "tp completed: TP2 over w0, w1; layout epoch 7",
        "before: w0: 80 KV blocks (1280 tokens); w1: 80 KV blocks (1280 tokens)",
        "after:  w0+w1 (TP2): 352 KV blocks (5632 tokens)",
        "cold re-form (weights reloaded, no KV kept): 1 running request handed over to re-prefill, rendezvous port 5000; total 4250.0 ms",
    ]
    failed = kunctl.format_tp_report(report(completed=False, healed=True, error="w1: UNAVAILABLE: gone", after=[]))
    assert failed.startswith(
        "tp FAILED (healed: every member is a whole instance again): TP2 over w0, w1; layout epoch 7: w1: UNAVAILABLE: gone"
    )


def test_arguments(monkeypatch, capsys):
    sent = []

    def fake_rpc(args, fn):
        class Stub:
            def TransformTP(self, req, timeout):
                sent.append(req)
                return report()

            def SplitTP(self, req, timeout):
                sent.append(req)
                return report(op="tp-split", completed=False, error="boom")

        return fn(Stub())

    monkeypatch.setattr(kunctl, "_mm_rpc", fake_rpc)
    kunctl.main(["tp", "--group", "w0,w1"])
    assert sent[-1] == memory_manager_pb2.TransformTPRequest(worker_ids=["w0", "w1"], degree=0)
    assert "tp completed" in capsys.readouterr().out
    kunctl.main(["tp", "--group", "w0,w1,w2,w3", "--degree", "4", "--json"])
    assert sent[-1].degree == 4 and '"degree": 2' in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        kunctl.main(["tp-split", "--group", "w1"])
    assert e.value.code == 1 and sent[-1] == memory_manager_pb2.SplitTPRequest(worker_id="w1")
    assert "kunctl: tp-split not completed: boom" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        kunctl.main(["tp", "--group", "w0,w1", "--degree", "3"])
    assert e.value.code == 2
