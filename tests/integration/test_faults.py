"""Faults with real processes: a worker killed mid-stream, services stopped with streams in flight."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time

import grpc
import pytest
from helpers import check_against_reference, generate_many, kunctl_argv, run

from kunserve import client

pytestmark = pytest.mark.integration


async def _start_long_stream(ch, rid: str, n_first: int = 2, max_tokens: int = 1500):
    got: list = []
    task = asyncio.create_task(client.generate(
        ch, client.make_request([7, 8, 9], request_id=rid, max_tokens=max_tokens, ignore_eos=True), timeout=120,
        on_event=got.append))
    while len(got) < n_first:
        if task.done():
            await task
        await asyncio.sleep(0.01)
    return task, got


def kunctl(cluster, *args):
    out = subprocess.run(kunctl_argv(cluster, *args), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out


def test_worker_killed_mid_stream_is_resumed_on_the_other_worker(fresh_cluster):
    """KunServe §4.4: the dispatcher re-prefills prompt + emitted tokens on a healthy instance; the client
    stream goes on without an error and (greedy) with exactly the reference tokens."""
    c = fresh_cluster(2)
    n = 512  # long enough that the kill lands mid-stream, however slowly the kill is delivered

    async def scenario():
        async with client.insecure_channel(c.cfg.dispatcher.address) as ch:
            task, got = await _start_long_stream(ch, "victim", max_tokens=n)
            victim = got[0].worker_id
            await asyncio.to_thread(c.kill, victim, signal.SIGKILL)
            return victim, await task, got

    victim, res, events = run(scenario())
    check_against_reference([7, 8, 9], res.token_ids, n)
    assert res.finish_reason == "length"
    tokens = [e for e in events if e.token_id >= 0]
    assert [e.index for e in tokens] == list(range(n))
    survivors = [e.worker_id for e in tokens if e.worker_id != victim]
    assert survivors, "the stream finished before the kill: nothing was resumed"
    assert tokens[-1].worker_id != victim
    assert "request_resuming" in c.child("dispatcher").log_path.read_text()
    # The dispatcher keeps serving; new requests go to the healthy worker and are still correct.
    prompts = [[11, 12, 13 + i] for i in range(4)]
    results = run(generate_many(c.cfg.dispatcher.address,
                                [client.make_request(p, max_tokens=5, ignore_eos=True) for p in prompts]))
    for p, r in zip(prompts, results):
        assert not isinstance(r, BaseException), r
        assert r.worker_id != victim
        check_against_reference(p, r.token_ids, 5)
    assert c.child("dispatcher").proc.poll() is None


def test_request_waits_for_a_routable_worker_and_cancel_while_waiting(fresh_cluster):
    """Workers that dropped layers are alive but not routable: a request waits for one (it does not fail),
    a Cancel while it waits ends its stream with ABORTED, and a worker that serves again picks it up."""
    c = fresh_cluster(2)
    for w in ("worker-0", "worker-1"):
        kunctl(c, "drop-layers", w, "2-3")

    async def scenario():
        async with client.insecure_channel(c.cfg.dispatcher.address) as ch:
            parked = asyncio.create_task(client.generate(
                ch, client.make_request([5, 6, 7], request_id="parked", max_tokens=4, ignore_eos=True), timeout=60))
            waiting = asyncio.create_task(client.generate(
                ch, client.make_request([5, 6, 8], request_id="waiting", max_tokens=4, ignore_eos=True), timeout=60))
            await asyncio.sleep(1.0)
            assert not parked.done() and not waiting.done()  # waiting, not failed
            assert await client.cancel(ch, "parked")
            cancelled = await asyncio.wait_for(parked, 10)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await client.cancel(ch, "parked")
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
            await asyncio.to_thread(kunctl, c, "restore-layers", "worker-1", "2-3")
            return cancelled, await waiting

    cancelled, served = run(scenario())
    assert cancelled.finish_reason == "aborted" and cancelled.token_ids == []
    assert served.worker_id == "worker-1"
    check_against_reference([5, 6, 8], served.token_ids, 4)


@pytest.mark.parametrize("service", ["dispatcher", "worker"])
def test_sigterm_ends_in_flight_streams_with_unavailable(fresh_cluster, service):
    c = fresh_cluster(1)

    async def scenario():
        async with client.insecure_channel(c.cfg.dispatcher.address) as ch:
            task, got = await _start_long_stream(ch, "in-flight")
            name = "dispatcher" if service == "dispatcher" else got[0].worker_id
            c.child(name).proc.send_signal(signal.SIGTERM)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await task
            return name, e.value

    name, err = run(scenario())
    assert err.code() == grpc.StatusCode.UNAVAILABLE, err
    assert "shutting down" in err.details()
    assert c.child(name).proc.wait(timeout=30) == 0  # a clean exit, not a crash


def test_malformed_config_is_a_one_line_cli_error(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[engine]\nblock_size = 'big'\n")
    for out in _side_by_side([["-m", "kunserve.cli.main", "--config", str(bad), "up"],
                              ["-m", "kunserve.services.worker", "--config", str(bad), "--worker-id", "worker-0"],
                              ["-m", "kunserve.cli.kunctl", "--config", str(bad), "status"]]):
        assert out.returncode != 0
        assert "engine.block_size: expected an integer" in out.stderr
        assert "Traceback" not in out.stderr


def _side_by_side(argvs: list[list[str]], env: dict[str, str] | None = None) -> list[subprocess.CompletedProcess]:
    """`python *argv` for every argv, the processes running at once (most of each is the interpreter's start and its
    imports); every one is killed if any outlives 60 s."""
    procs = [subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env) for argv in argvs]
    try:
        outputs = [p.communicate(timeout=60) for p in procs]
        return [subprocess.CompletedProcess(p.args, p.returncode, out, err) for p, (out, err) in zip(procs, outputs)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_unreachable_cluster_is_a_one_line_cli_error():
    from kunserve.cli.launcher import free_port

    addr = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "KUNSERVE_ADMIN_TOKEN": "an-admin-token-for-nobody-0123456789"}
    for out in _side_by_side([["-m", "kunserve.cli.main", "generate", "--address", addr, "--timeout", "3", "hi"],
                              ["-m", "kunserve.cli.kunctl", "--address", addr, "--timeout", "3", "status"]], env=env):
        assert out.returncode == 1 and "UNAVAILABLE" in out.stderr and "Traceback" not in out.stderr


def _kunserve_up_demo(tmp_path, demo_tokens: int, until: str) -> tuple[subprocess.Popen, list[str]]:
    """`kunserve up --demo` as the README runs it; returns the process and its output up to the first line
    containing `until` (or to its end / 180 s)."""
    proc = subprocess.Popen([sys.executable, "-m", "kunserve.cli.main", "up", "--free-ports", "--run-dir",
                             str(tmp_path), "--demo", "--demo-tokens", str(demo_tokens)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "COLUMNS": "200", "KUNSERVE_HOME": str(tmp_path / "home")})
    lines: list[str] = []
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if until in line:
            break
    return proc, lines


def _all_children_stopped_cleanly(output: str) -> bool:
    stopped = [ln for ln in output.splitlines() if ln.startswith("Stopped:")]
    return bool(stopped) and all(part.endswith("=0") for part in stopped[0][len("Stopped: "):].split(", "))


def test_kunserve_up_serves_and_stops_cleanly_on_ctrl_c(tmp_path):
    """The README's launcher: health-checked start, endpoints printed, Ctrl-C stops every child with exit 0."""
    proc, lines = _kunserve_up_demo(tmp_path, 4, until="Press Ctrl-C")
    try:
        assert any("Press Ctrl-C" in ln for ln in lines), "".join(lines)
        assert any("finish: length" in ln for ln in lines), "".join(lines)  # the demo streamed
        # The printed kunctl command works as is: `kunserve up` wrote the admin token where kunctl looks.
        admin = re.search(r"kunctl --address (\S+) status", "".join(lines)).group(1)
        env = {k: v for k, v in os.environ.items() if k not in ("KUNSERVE_ADMIN_TOKEN", "KUNSERVE_CONFIG")}
        status = subprocess.run([sys.executable, "-m", "kunserve.cli.kunctl", "--address", admin, "status", "--json"],
                                capture_output=True, text=True, timeout=60, env={**env, "KUNSERVE_HOME": str(tmp_path / "home")})
        assert status.returncode == 0, status.stderr
        assert (tmp_path / "home" / "admin-token").stat().st_mode & 0o777 == 0o600
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == 0, rest
    assert _all_children_stopped_cleanly(rest), rest


def test_kunserve_up_ctrl_c_during_the_demo_stops_the_cluster(tmp_path):
    """Ctrl-C while the demo generation streams ends it at once and stops every child cleanly."""
    proc, lines = _kunserve_up_demo(tmp_path, 1900, until="Demo")
    try:
        assert any("Demo" in ln for ln in lines), "".join(lines)
        time.sleep(1.0)  # the generation is streaming (1900 tokens take far longer)
        interrupted = time.monotonic()
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
        took = time.monotonic() - interrupted
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == 130, rest
    assert "interrupted" in rest and "Press Ctrl-C" not in rest and "finish:" not in rest, rest
    assert _all_children_stopped_cleanly(rest), rest
    assert took < 30, took
