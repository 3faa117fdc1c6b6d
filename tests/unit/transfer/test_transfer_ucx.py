"""The transfer service over real UCX (ucxx over TCP) between two processes on 127.0.0.1.

The peer is ``python -m kunserve.shared.transfer.peer`` in a subprocess: it echoes messages named "echo"
and reports its receive trace on request. Assertions are about bytes and ordering, never wall-clock.
"""

import asyncio
import json
import os
import subprocess
import sys
import threading

import pytest
import torch

from kunserve.shared.transfer import ACTIVATION, CONTROL, KV_EXCHANGE, WEIGHTS, TransferConfig, TransferError, TransferService
from kunserve.shared.transfer.peer import READY
from kunserve.shared.transfer.ucx import ucx_available

MiB = 1 << 20
CHUNK = 1 * MiB  # fixed chunk size on both sides: deterministic chunk counts
SECRET = "ucx-test-cluster-secret-0123456789"

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not ucx_available(), reason="ucxx is not installed")]


def spawn_peer():
    env = dict(os.environ, UCX_TLS="tcp", UCXPY_PROGRESS_MODE="blocking", UCX_WARN_UNUSED_ENV_VARS="n",
               OMP_NUM_THREADS="1", KUNSERVE_CLUSTER_SECRET=SECRET)
    return subprocess.Popen(
        [sys.executable, "-m", "kunserve.shared.transfer.peer", "--name", "peer",
         "--min-chunk-bytes", str(CHUNK), "--max-chunk-bytes", str(CHUNK)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)


def wait_ready(proc):
    lines = []
    reader = threading.Thread(target=lambda: lines.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(30)
    try:
        line = lines[0].decode() if lines else ""
        if not line.startswith(READY):
            proc.kill()
            raise RuntimeError(f"transfer peer did not start: {line!r} {proc.stderr.read(4000)!r}")
        return json.loads(line[len(READY):])["port"]
    except BaseException:
        proc.kill()
        proc.wait(10)
        raise


@pytest.fixture(scope="module")
def peer():
    proc = spawn_peer()
    try:
        yield wait_ready(proc)
    finally:
        proc.kill()
        proc.wait(10)


@pytest.fixture
def doomed_peer():
    proc = spawn_peer()
    try:
        yield proc, wait_ready(proc)
    finally:
        proc.kill()
        proc.wait(10)


async def connect(port, **cfg):
    svc = TransferService("driver", config=TransferConfig(trace_len=100_000, **cfg), secret=SECRET.encode())
    await svc.start()
    assert await svc.connect("127.0.0.1", port, timeout=10) == "peer"
    return svc


async def report(svc):
    await svc.send("peer", CONTROL, b"", name="report", timeout=10)
    msg = await svc.recv(CONTROL, timeout=10)
    assert msg.header.name == "report"
    return json.loads(bytes(msg.data.numpy()))


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 50))


def test_tensors_arrive_identical_over_ucx(peer):
    async def main():
        svc = await connect(peer, min_chunk_bytes=CHUNK, max_chunk_bytes=CHUNK)
        g = torch.Generator().manual_seed(0)
        tensors = [
            torch.randn(16, 512, generator=g),                                    # an fp32 activation
            torch.randn(3, 2, 8, 16, 64, generator=g).to(torch.bfloat16),         # KV blocks in bf16
            torch.randn(5, 7, generator=g).to(torch.float16),
            torch.randint(-2**62, 2**62, (33,), generator=g),                     # int64
            torch.randint(0, 255, (1000,), dtype=torch.uint8, generator=g),
            torch.tensor([True, False, True]),
            torch.empty(0, 4),
            torch.randint(-2**31, 2**31 - 1, (4 * MiB,), dtype=torch.int32, generator=g),  # 16 MiB, 16 chunks
        ]
        kinds = [ACTIVATION, KV_EXCHANGE, WEIGHTS, ACTIVATION, KV_EXCHANGE, ACTIVATION, ACTIVATION, KV_EXCHANGE]
        for i, (kind, t) in enumerate(zip(kinds, tensors)):
            await svc.send("peer", kind, t, name="echo", request_ids=[f"req-{i}"], layer_start=i, layer_end=i + 1,
                           epoch=5, timeout=20)
            back = await svc.recv(kind, timeout=20)
            assert back.data.dtype == t.dtype and back.data.shape == t.shape
            assert torch.equal(back.data.view(-1).view(torch.uint8) if t.numel() else back.data,
                               t.view(-1).view(torch.uint8) if t.numel() else t)
            h = back.header
            assert (list(h.request_ids), h.layer_start, h.epoch, h.name) == ([f"req-{i}"], i, 5, "echo-reply")
        rep = await report(svc)
        big = [r for r in rep["recv"] if r[4] == CHUNK]
        assert len(big) == 16  # the 16 MiB tensor crossed as 16 chunks
        await svc.close()

    run(main())


def test_activations_overtake_a_64mib_kv_exchange_within_one_chunk(peer):
    async def main():
        svc = await connect(peer, min_chunk_bytes=CHUNK, max_chunk_bytes=CHUNK)
        kv = svc.submit("peer", KV_EXCHANGE, torch.zeros(16 * MiB), name="kv")  # 64 MiB, 64 chunks
        acts = []
        for k in (1, 8, 20, 40):
            await kv.wait_chunks(k, timeout=20)
            acts.append(svc.submit("peer", ACTIVATION, torch.full((4096,), float(k)), name="act"))
            await acts[-1].wait(timeout=20)
        await kv.wait(timeout=30)
        trace = list(svc.trace)
        rep = await report(svc)
        await svc.close()

        # sender side: between an activation's submit and its send, at most one KV chunk went on the wire
        for h in acts:
            i_sub = next(i for i, e in enumerate(trace) if e.op == "submit" and e.message_id == h.message_id)
            i_snd = next(i for i, e in enumerate(trace) if e.op == "send" and e.message_id == h.message_id)
            assert sum(e.op == "send" for e in trace[i_sub + 1:i_snd]) <= 1
        # receiver side: each activation arrived right behind at most one more KV chunk than had been sent
        # when it was submitted, and long before the end of the exchange
        recv = rep["recv"]
        for h in acts:
            sent_before = sum(1 for e in trace[:next(i for i, e in enumerate(trace)
                                                     if e.op == "submit" and e.message_id == h.message_id)]
                              if e.op == "send" and e.message_id == kv.message_id)
            pos = next(i for i, r in enumerate(recv) if r[2] == h.message_id)
            kv_before = sum(1 for r in recv[:pos] if r[2] == kv.message_id)
            assert kv_before <= sent_before + 1, (h.message_id, kv_before, sent_before)
        kv_chunks = [r for r in recv if r[2] == kv.message_id]
        assert len(kv_chunks) == 64 and sum(r[4] for r in kv_chunks) == 64 * MiB and kv_chunks[-1][5]
        last_act = max(next(i for i, r in enumerate(recv) if r[2] == h.message_id) for h in acts)
        assert sum(1 for r in recv[last_act:] if r[2] == kv.message_id) >= 64 - 42

    run(main())


def test_a_dead_peer_fails_pending_sends_naming_it(doomed_peer):
    proc, port = doomed_peer

    async def main():
        svc = await connect(port, min_chunk_bytes=CHUNK, max_chunk_bytes=CHUNK, chunk_timeout_s=10)
        lost = asyncio.Queue()
        svc.on_peer_lost(lambda peer, err: lost.put_nowait((peer, err)))
        kv = svc.submit("peer", KV_EXCHANGE, torch.zeros(64 * MiB))  # 256 MiB: still sending when killed
        await kv.wait_chunks(2, timeout=20)
        proc.kill()
        with pytest.raises(TransferError, match="peer peer"):
            await kv.wait(timeout=20)
        peer, err = await asyncio.wait_for(lost.get(), 20)
        assert peer == "peer" and isinstance(err, TransferError)
        with pytest.raises(TransferError, match="peer peer"):
            svc.submit("peer", ACTIVATION, torch.zeros(4))
        await asyncio.wait_for(svc.close(), 20)

    run(main())
