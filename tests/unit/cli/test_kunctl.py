"""kunctl: --require / --group parsing, plan / report / status formatting on hand-built protos, and the
plan / drop / restore commands against an in-process fake memory manager (no cluster)."""

import argparse
import json
from concurrent import futures

import grpc
import pytest

from kunserve.cli import kunctl
from kunserve.cli.kunctl import (
    Requirement,
    build_parser,
    format_groups,
    format_plan,
    format_report,
    parse_group,
    parse_requirement,
    status_groups,
)
from kunserve.v1 import admin_pb2, common_pb2, memory_manager_pb2_grpc, monitor_pb2
from kunserve.v1 import memory_manager_pb2 as mm

# --- --require -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,expected", [
    ("1200", Requirement(blocks=1200)),
    ("1200blocks", Requirement(blocks=1200)),
    (" 7 block ", Requirement(blocks=7)),
    ("512MiB", Requirement(bytes=512 * 2**20)),
    ("1.5GiB", Requirement(bytes=3 * 2**29)),
    ("64KiB", Requirement(bytes=65536)),
    ("64kib", Requirement(bytes=65536)),
    ("2 GB", Requirement(bytes=2 * 10**9)),
    ("4096B", Requirement(bytes=4096)),
    ("1TiB", Requirement(bytes=2**40)),
    ("0.1KiB", Requirement(bytes=103)),          # 102.4 bytes round up
    (".5MiB", Requirement(bytes=2**19)),
])
def test_parse_requirement(text, expected):
    assert parse_requirement(text) == expected


@pytest.mark.parametrize("text,why", [
    ("", "expected a number of KV blocks"),
    ("abc", "expected a number of KV blocks"),
    ("-5", "expected a number of KV blocks"),
    ("12.5", "whole number"),
    ("0", "> 0"),
    ("0MiB", "> 0"),
    ("5 XB", "unknown unit 'XB'"),
    ("5M", "unknown unit"),                      # ambiguous: say MiB or MB
    ("1e3", "expected a number of KV blocks"),
    ("1.5 GiB extra", "expected"),
])
def test_parse_requirement_rejects_with_the_accepted_forms(text, why):
    with pytest.raises(argparse.ArgumentTypeError) as err:
        parse_requirement(text)
    assert why in str(err.value)
    if "> 0" not in why:
        assert "512MiB, 1.5GiB, 64KiB" in str(err.value)


def test_bad_require_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["plan", "--require", "lots"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --require" in err and "512MiB" in err and "KV blocks" in err


def test_requirement_str():
    assert str(Requirement(blocks=5)) == "5 KV blocks" and str(Requirement(bytes=3 * 2**29)) == "1.5 GiB"


# --- --group ---------------------------------------------------------------------------------------------------

def test_parse_group_and_drop_request():
    assert parse_group("w0, w1") == ["w0", "w1"] and parse_group("w3") == ["w3"]
    for bad in ("", "w0,", ",w1", "w0,w0"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_group(bad)
    args = build_parser().parse_args(["drop", "--group", "w0,w1", "--group", "w2,w3", "--require", "64KiB"])
    req = kunctl.drop_request(args.require, args.group)
    assert [list(g.worker_ids) for g in req.groups] == [["w0", "w1"], ["w2", "w3"]]
    assert req.required_bytes == 65536 and req.required_blocks == 0 and req.reason == "manual"
    assert kunctl.drop_request(Requirement(blocks=9), None).required_blocks == 9
    empty = kunctl.drop_request(None, None)
    assert (empty.required_blocks, empty.required_bytes, len(empty.groups)) == (0, 0, 0)
    with pytest.raises(ValueError, match="w1 is in two"):
        kunctl.drop_request(None, [["w0", "w1"], ["w1", "w2"]])


def test_worker_in_two_groups_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        kunctl.main(["--address", "127.0.0.1:1", "drop", "--group", "w0,w1", "--group", "w1,w2"])
    assert exc.value.code == 2 and "w1 is in two --group lists" in capsys.readouterr().err


# --- formatting ------------------------------------------------------------------------------------------------

def wl(wid, a, b, gid, serving=False):
    return mm.WorkerLayout(worker_id=wid, layer_start=a, layer_end=b, group_id=gid, serving=serving,
                           address=f"h:{wid}", reachable=True)


def test_format_plan_met():
    plan = mm.DropPlanReply(met=True, required_bytes=512 * 2**20, freed_bytes=768 * 2**20, freed_blocks=384, epoch=3,
                            groups=[mm.PlannedGroup(group_id="g0", changed=True,
                                                    members=[wl("w0", 0, 2, "g0"), wl("w1", 2, 4, "g0")]),
                                    mm.PlannedGroup(group_id="w2", members=[wl("w2", 0, 4, "w2")])])
    text = format_plan(plan)
    assert text.splitlines() == [
        "drop plan on layout epoch 3 (dry run)",
        "requirement: 512.0 MiB; frees 768.0 MiB (384 KV blocks)",
        "requirement met",
        "autoscale needed: no",
        "groups:",
        "  g0 (group of 2, changed): w0 [0, 2) -> w1 [2, 4)",
        "  w2 (instance): w2 [0, 4)",
    ]


def test_format_plan_not_met():
    text = format_plan(mm.DropPlanReply(met=False, autoscale_needed=True, fallback="kv_centric",
                                        required_bytes=2**34, freed_bytes=2**30, freed_blocks=10))
    assert "requirement NOT met; fallback: kv_centric" in text and "autoscale needed: yes" in text
    assert "16.0 GiB" in text and "frees 1.0 GiB (10 KV blocks)" in text
    assert "none (merge as far" in format_plan(mm.DropPlanReply(epoch=1))


def test_format_report_completed_and_failed():
    rep = mm.TransitionReport(op="drop", epoch=4, completed=True, requests_moved=3, kv_bytes_moved=12 * 2**20,
                              plan_seconds=0.0012, prepare_seconds=0.0034, exchange_seconds=0.02,
                              remap_seconds=0.0005, total_seconds=0.03, pause_seconds=0.025, kv_in_background=True,
                              weight_bytes_from_peers=2 * 2**20, weight_bytes_from_checkpoint=2**20,
                              groups=[mm.PlannedGroup(group_id="g0", changed=True,
                                                      members=[wl("w0", 0, 2, "g0", True), wl("w1", 2, 4, "g0")])])
    assert format_report(rep).splitlines() == [
        "drop completed: layout epoch 4",
        "groups after:",
        "  g0 (group of 2, changed): w0 [0, 2) -> w1 [2, 4)",
        "moved 3 requests, 12.0 MiB of KV",
        "weights restored: 2.0 MiB from peers, 1.0 MiB from the checkpoint",
        "timings: plan 1.2 ms, prepare 3.4 ms, exchange 20.0 ms (remap 0.5 ms), total 30.0 ms; serving paused 25.0 ms; "
        "the moved KV lands after the commit while serving",
    ]
    bad = format_report(mm.TransitionReport(op="restore", epoch=4, rolled_back=True, error="worker w1 unreachable",
                                            requests_moved=1))
    assert bad.splitlines()[0] == "restore FAILED (rolled back): layout epoch 4: worker w1 unreachable"
    assert "moved 1 request," in bad
    assert "autoscale needed" in format_report(mm.TransitionReport(op="drop", autoscale_needed=True))


def stats(wid, a, b, gid, members, total, undropped=1000, **kw):
    return monitor_pb2.WorkerStatus(healthy=True, stats=common_pb2.WorkerStats(
        worker_id=wid, layer_start=a, layer_end=b, num_layers_model=4, group_id=gid, group_members=members,
        kv_blocks_total=total, kv_blocks_undropped=undropped, serving=kw.pop("serving", False), **kw))


def admin_status():
    return admin_pb2.AdminStatus(
        cluster=monitor_pb2.ClusterStatus(workers=[
            stats("w0", 2, 4, "g1", ["w1", "w0"], 2400),
            stats("w1", 0, 2, "g1", ["w1", "w0"], 2400, serving=True),
            stats("w2", 0, 4, "w2", ["w2"], 1000, serving=True, transitioning=True),
        ]),
        layout=mm.ClusterLayout(epoch=7, num_layers_model=4, workers=[
            wl("w0", 2, 4, "g1"), wl("w1", 0, 2, "g1", serving=True), wl("w2", 0, 4, "w2", serving=True),
            wl("w3", 0, 4, "w3", serving=True)]))


def test_status_groups():
    gs = status_groups(admin_status())
    assert [g.group_id for g in gs] == ["g1", "w2", "w3"]
    g1 = gs[0]
    assert g1.members == [("w1", 0, 2), ("w0", 2, 4)]          # pipeline order from group_members
    assert g1.serving and g1.kv_blocks_total == 2400 and g1.kv_blocks_undropped == 2000
    assert gs[1].transitioning and gs[1].kv_blocks_total == 1000
    assert gs[2].kv_blocks_total is None                       # in the layout, no stats
    assert format_groups(admin_status()) == [
        "g1 (pipeline group of 2, serving): w1 [0, 2) -> w0 [2, 4); KV capacity 2400 blocks, undropped 2000",
        "w2 (instance, serving, transitioning): w2 [0, 4); KV capacity 1000 blocks",
        "w3 (instance, serving): w3 [0, 4); KV capacity ? blocks",
    ]


def test_groups_show_their_pipeline_bubble():
    """A group had work for its head's busy + bubble seconds (10 s); its two members computed 8 s and 6 s of
    that: 30% of the group's stage time was bubble. A whole instance shows its own bubble ratio."""
    status = admin_pb2.AdminStatus(cluster=monitor_pb2.ClusterStatus(workers=[
        stats("w1", 0, 2, "g1", ["w1", "w0"], 2400, serving=True, busy_seconds_total=8.0, bubble_seconds_total=2.0),
        stats("w0", 2, 4, "g1", ["w1", "w0"], 2400, busy_seconds_total=6.0, bubble_seconds_total=0.0),
        stats("w2", 0, 4, "w2", ["w2"], 1000, serving=True, busy_seconds_total=9.0, bubble_seconds_total=1.0,
              bubble_ratio=0.1),
        stats("w3", 0, 4, "w3", ["w3"], 1000, serving=True),  # never had work: no ratio
    ]))
    g1, w2, w3 = status_groups(status)
    assert g1.bubble_ratio == pytest.approx(0.3) and w2.bubble_ratio == pytest.approx(0.1) and w3.bubble_ratio is None
    assert format_groups(status)[0] == ("g1 (pipeline group of 2, serving): w1 [0, 2) -> w0 [2, 4); KV capacity "
                                        "2400 blocks, undropped 2000; bubble 30.0%")
    assert kunctl.group_bubble_ratio(["w1", "gone"], {"w1": status.cluster.workers[0].stats}) is None


def test_a_windowed_bubble_counts_only_the_time_between_two_samples():
    """Since start the group looks busy (mostly whole-instance time before the drop); over the window its head had
    work for 2 s while the later stage computed only 1 s of it: 25% bubble. A member that restarted within the
    window (its counters went back) gives no ratio."""
    def sample(head_busy: float, head_bubble: float, stage_busy: float):
        return admin_pb2.AdminStatus(cluster=monitor_pb2.ClusterStatus(workers=[
            stats("w1", 0, 2, "g1", ["w1", "w0"], 2400, serving=True, busy_seconds_total=head_busy,
                  bubble_seconds_total=head_bubble),
            stats("w0", 2, 4, "g1", ["w1", "w0"], 2400, busy_seconds_total=stage_busy)]))

    before, after = sample(100.0, 0.0, 100.0), sample(102.0, 0.0, 101.0)
    assert status_groups(after)[0].bubble_ratio == pytest.approx(1 - 203 / 204)
    assert status_groups(after, before)[0].bubble_ratio == pytest.approx(0.25)
    assert "bubble 25.0%" in format_groups(after, before)[0]
    assert status_groups(sample(1.0, 0.0, 1.0), before)[0].bubble_ratio is None


def test_render_status_shows_groups_serving_and_epoch(capsys):
    kunctl.render_status(admin_status())
    out = capsys.readouterr().out
    assert "layout epoch 7" in out and "serving" in out
    assert "groups (layout epoch 7):" in out
    assert "g1 (pipeline group of 2, serving): w1 [0, 2) -> w0 [2, 4); KV capacity 2400 blocks" in out


def test_status_shows_each_instance_tp_degree_and_members(capsys):
    """A TP2 instance is one line (rank 0's KV), its follower folded into it; a whole instance shows degree 1."""
    tp = {"tp_degree": 2, "tp_members": ["w0", "w1"]}
    status = admin_pb2.AdminStatus(cluster=monitor_pb2.ClusterStatus(workers=[
        stats("w0", 0, 4, "w0", ["w0"], 3000, serving=True, **tp),
        stats("w1", 0, 4, "w1", ["w1"], 3000, **tp),
        stats("w2", 0, 4, "w2", ["w2"], 1000, serving=True, tp_degree=1, tp_members=["w2"]),
    ]))
    assert format_groups(status) == [
        "w0 (tensor-parallel instance, TP2, serving): w0 (rank 0) + w1 (rank 1) [0, 4); KV capacity 3000 blocks",
        "w2 (instance, serving): w2 [0, 4); KV capacity 1000 blocks",
    ]
    assert [kunctl.tp_cell(w.stats) for w in status.cluster.workers] == ["2 (rank 0)", "2 (rank 1)", "1"]
    kunctl.render_status(status)
    out = capsys.readouterr().out
    assert "TP" in out and "2 (rank 1)" in out
    assert json.loads(kunctl.message_json(status))["cluster"]["workers"][1]["stats"]["tp_members"] == ["w0", "w1"]


# --- commands against an in-process fake memory manager ---------------------------------------------------------

class FakeMemoryManager(memory_manager_pb2_grpc.MemoryManagerServicer):
    def __init__(self):
        self.requests = []
        self.drop_reply = mm.TransitionReport(op="drop", epoch=2, completed=True, requests_moved=1)

    def PlanDrop(self, request, context):
        self.requests.append(("plan", request))
        return mm.DropPlanReply(met=True, epoch=1, required_bytes=request.required_bytes, freed_bytes=2**30)

    def Drop(self, request, context):
        self.requests.append(("drop", request))
        if request.reason != "manual":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "reason: expected manual")
        return self.drop_reply

    def Restore(self, request, context):
        self.requests.append(("restore", request))
        if request.group_id == "busy":
            context.abort(grpc.StatusCode.ABORTED, "a transition is in progress")
        return mm.TransitionReport(op="restore", epoch=3, completed=True)


@pytest.fixture
def fake_mm(monkeypatch):
    monkeypatch.setenv("KUNSERVE_ADMIN_TOKEN", "unit-test-admin-token-0123456789")  # kunctl needs one to call
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    fake = FakeMemoryManager()
    memory_manager_pb2_grpc.add_MemoryManagerServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield fake, f"127.0.0.1:{port}"
    finally:
        server.stop(0)


def test_plan_command(fake_mm, capsys):
    fake, addr = fake_mm
    kunctl.main(["--address", addr, "plan", "--require", "512MiB"])
    out = capsys.readouterr().out
    assert "drop plan on layout epoch 1" in out and "requirement met" in out
    assert fake.requests[-1][1].required_bytes == 512 * 2**20
    kunctl.main(["--address", addr, "plan", "--require", "300", "--json"])
    assert fake.requests[-1][1].required_blocks == 300
    assert json.loads(capsys.readouterr().out)["met"] is True


def test_drop_command_exit_codes(fake_mm, capsys):
    fake, addr = fake_mm
    kunctl.main(["--address", addr, "drop", "--group", "w0,w1"])
    assert "drop completed: layout epoch 2" in capsys.readouterr().out
    assert [list(g.worker_ids) for g in fake.requests[-1][1].groups] == [["w0", "w1"]]
    fake.drop_reply = mm.TransitionReport(op="drop", epoch=2, rolled_back=True, error="worker w1 died")
    with pytest.raises(SystemExit) as exc:
        kunctl.main(["--address", addr, "drop", "--require", "1GiB", "--json"])
    assert exc.value.code == 1
    cap = capsys.readouterr()
    assert json.loads(cap.out)["rolled_back"] is True
    assert cap.err.strip() == "kunctl: drop not completed: worker w1 died"


def test_restore_command_and_grpc_errors(fake_mm, capsys):
    fake, addr = fake_mm
    kunctl.main(["--address", addr, "restore"])
    assert "restore completed: layout epoch 3" in capsys.readouterr().out and fake.requests[-1][1].group_id == ""
    with pytest.raises(SystemExit) as exc:
        kunctl.main(["--address", addr, "restore", "--group", "busy"])
    assert exc.value.code == 1
    err = capsys.readouterr().err.strip()
    assert err == f"kunctl: ABORTED: a transition is in progress (admin address {addr})"
