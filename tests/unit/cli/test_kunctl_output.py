"""kunctl for machines and people: --json keeps 64-bit integers numbers, a reader that closes the pipe early ends
kunctl quietly, and `kunctl watch` refreshes the status (redrawn on a terminal, appended when piped), riding out an
unreachable admin port. Against an in-process fake admin service (no cluster)."""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
from concurrent import futures

import grpc
import pytest
from rich.console import Console

from kunserve import client
from kunserve.cli import kunctl
from kunserve.v1 import admin_pb2, admin_pb2_grpc, common_pb2, monitor_pb2, worker_pb2
from kunserve.v1 import memory_manager_pb2 as mm

pytestmark = pytest.mark.timeout(60)
TOKEN = "unit-test-admin-token-0123456789"


def admin_status(epoch: int = 7) -> admin_pb2.AdminStatus:
    stats = common_pb2.WorkerStats(worker_id="w0", layer_start=0, layer_end=4, num_layers_model=4, group_id="w0",
                                   group_members=["w0"], kv_blocks_total=2**40, kv_blocks_used=3, serving=True)
    return admin_pb2.AdminStatus(
        cluster=monitor_pb2.ClusterStatus(workers=[monitor_pb2.WorkerStatus(healthy=True, stats=stats)],
                                          kv_blocks_total=2**40),
        layout=mm.ClusterLayout(epoch=epoch, num_layers_model=4, workers=[
            mm.WorkerLayout(worker_id="w0", layer_start=0, layer_end=4, group_id="w0", serving=True)]))


def test_json_prints_64_bit_integers_as_numbers_everywhere_in_the_message():
    d = kunctl.message_dict(admin_status())
    assert d["layout"]["epoch"] == 7                                        # uint64, nested
    assert d["cluster"]["kv_blocks_total"] == 2**40                         # int64
    assert d["cluster"]["workers"][0]["stats"]["kv_blocks_total"] == 2**40  # in a repeated message
    assert d["cluster"]["workers"][0]["stats"]["num_running"] == 0          # defaults are printed too
    assert d["cluster"]["workers"][0]["stats"]["group_members"] == ["w0"]
    rep = kunctl.message_dict(mm.TransitionReport(op="drop", epoch=2**62 - 1, kv_bytes_moved=12))
    assert rep["epoch"] == 2**62 - 1 and rep["kv_bytes_moved"] == 12 and rep["completed"] is False
    links = kunctl.message_dict(worker_pb2.PeerLinks(linked=["a"], failed={"b": "unreachable"}))
    assert links == {"linked": ["a"], "failed": {"b": "unreachable"}}
    assert json.loads(kunctl.message_json(admin_status()))["layout"]["epoch"] == 7


class FakeAdmin(admin_pb2_grpc.AdminServicer):
    def __init__(self) -> None:
        self.calls = 0
        self.fail_first = 0  # answer UNAVAILABLE to this many calls first

    def GetStatus(self, request, context):
        self.calls += 1
        if self.calls <= self.fail_first:
            context.abort(grpc.StatusCode.UNAVAILABLE, "memory manager restarting")
        return admin_status(epoch=self.calls)


@pytest.fixture
def fake_admin(monkeypatch):
    monkeypatch.setenv("KUNSERVE_ADMIN_TOKEN", TOKEN)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    fake = FakeAdmin()
    admin_pb2_grpc.add_AdminServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield fake, f"127.0.0.1:{port}"
    finally:
        server.stop(0)


def test_status_json_over_the_wire_has_numbers(fake_admin, capsys):
    _, addr = fake_admin
    kunctl.main(["--address", addr, "status", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["layout"]["epoch"] == 1 and out["cluster"]["kv_blocks_total"] == 2**40


def target(addr: str) -> kunctl.Target:
    return kunctl.Target(addr, client.Credentials(admin_token=TOKEN))


def test_watch_piped_prints_each_refresh_and_shows_an_unreachable_admin_port(fake_admin, capsys):
    fake, addr = fake_admin
    fake.fail_first = 1
    asyncio.run(kunctl.watch(target(addr), interval=0.01, timeout=5.0, rounds=3))
    out = capsys.readouterr().out
    assert f"kunctl: UNAVAILABLE: memory manager restarting (admin address {addr}); retrying" in out
    assert "layout epoch 2" in out and "layout epoch 3" in out  # two tables, one after the other
    assert fake.calls == 3


def test_watch_on_a_terminal_redraws_in_place(fake_admin, monkeypatch):
    fake, addr = fake_admin
    screen = io.StringIO()
    monkeypatch.setattr(kunctl, "_console", lambda: Console(file=screen, force_terminal=True, width=200))
    asyncio.run(kunctl.watch(target(addr), interval=0.01, timeout=5.0, rounds=2))
    out = screen.getvalue()
    assert "layout epoch 1" in out and "layout epoch 2" in out
    assert "\x1b[" in out and "\x1b[2K" in out  # cursor moves: the second table replaced the first


def test_watch_refuses_a_non_positive_interval(capsys):
    with pytest.raises(SystemExit) as exc:
        kunctl.main(["watch", "--interval", "0"])
    assert exc.value.code == 2 and "--interval must be > 0" in capsys.readouterr().err


@pytest.mark.parametrize("args", [["status", "--json"], ["status", "--window", "0"],
                                  ["watch", "--interval", "0.05"]])
def test_a_reader_that_closes_the_pipe_ends_kunctl_quietly(fake_admin, args):
    """The pipe's read end is closed before kunctl writes (as `head` does once it has its lines): no traceback, no
    message, status 1; watch stops instead of refreshing into the void."""
    _, addr = fake_admin
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run([sys.executable, "-m", "kunserve.cli.kunctl", "--address", addr, *args], stdout=write,
                              stderr=subprocess.PIPE, timeout=60, env={**os.environ, "KUNSERVE_ADMIN_TOKEN": TOKEN})
    finally:
        os.close(write)
    assert proc.returncode == 1 and proc.stderr == b""
