"""`kunctl tp` / `kunctl tp-split` --in-place / --cold (kunserve/cli/kunctl.py): the flags exclude each other, set the
request's mode ("" = the cluster's memory_manager.tp_mode), and the report says how the change happened."""

from __future__ import annotations

import pytest
from test_kunctl_tp import report

from kunserve.cli import kunctl
from kunserve.v1 import memory_manager_pb2


@pytest.fixture
def sent(monkeypatch) -> list:
    """The requests kunctl sends, each answered with a completed report."""
    got: list = []

    def fake_rpc(args, fn):
        class Stub:
            def TransformTP(self, req, timeout):
                got.append(req)
                return report()

            def SplitTP(self, req, timeout):
                got.append(req)
                return report(op="tp-split")

        return fn(Stub())

    monkeypatch.setattr(kunctl, "_mm_rpc", fake_rpc)
    return got


@pytest.mark.parametrize("flags,mode", [([], ""), (["--in-place"], "in-place"), (["--cold"], "cold")])
def test_the_flags_set_the_requests_mode(sent, capsys, flags, mode):
    kunctl.main(["tp", "--group", "w0,w1", *flags])
    assert sent[-1] == memory_manager_pb2.TransformTPRequest(worker_ids=["w0", "w1"], degree=0, mode=mode)
    kunctl.main(["tp-split", "--group", "w1", *flags])
    assert sent[-1] == memory_manager_pb2.SplitTPRequest(worker_id="w1", mode=mode)
    capsys.readouterr()


@pytest.mark.parametrize("command", [["tp", "--group", "w0,w1"], ["tp-split", "--group", "w0"]])
def test_in_place_and_cold_exclude_each_other(sent, capsys, command):
    with pytest.raises(SystemExit) as e:
        kunctl.main([*command, "--in-place", "--cold"])
    assert e.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
    assert sent == []


def test_the_report_says_in_place_or_cold():
    in_place = kunctl.format_tp_report(report(mode="in-place")).splitlines()[-1]
    assert in_place == (
        "in place (running requests kept running with their KV; the pool keeps the whole model), rendezvous port 5000; total 4250.0 ms"
    )
    for mode in ("cold", ""):
        cold = kunctl.format_tp_report(report(mode=mode)).splitlines()[-1]
        assert cold.startswith("cold re-form (weights reloaded, no KV kept): 1 running request handed over"), cold
    split = kunctl.format_tp_report(report(op="tp-split", mode="in-place", port=0)).splitlines()[-1]
    assert split == "in place (running requests kept running with their KV; the pool keeps the whole model); total 4250.0 ms"
