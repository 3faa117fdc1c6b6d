"""TransferService over the in-process transport: framing, reassembly, priorities, failures, close."""

import asyncio

import numpy as np
import pytest
import torch

from kunserve.shared.transfer import (
    ACTIVATION,
    CHECKPOINT,
    CONTROL,
    KV_EXCHANGE,
    WEIGHTS,
    MemoryTransport,
    TransferConfig,
    TransferError,
    TransferService,
)
from kunserve.shared.transfer.framing import TAG_HEADER

MiB = 1 << 20
SECRET = b"test-cluster-secret-0123456789"
pytestmark = pytest.mark.timeout(60)


async def pair(bandwidth_bps=None, **cfg):
    registry = {}
    config = TransferConfig(trace_len=10_000, **cfg)
    a = TransferService("a", MemoryTransport(registry, bandwidth_bps), config, secret=SECRET)
    b = TransferService("b", MemoryTransport(registry, bandwidth_bps), config, secret=SECRET)
    await a.start()
    port = await b.start()
    assert await a.connect("mem", port, timeout=5) == "b"
    await b.wait_for_peer("a", timeout=5)
    return a, b


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_tensors_of_every_dtype_arrive_identical_with_metadata():
    async def main():
        a, b = await pair(min_chunk_bytes=4096, max_chunk_bytes=64 * 1024)
        sent = [torch.randn(7, 33), torch.randn(2, 3, 4).to(torch.bfloat16), torch.randint(-9, 9, (1000,)),
                torch.tensor(True), torch.empty(0, 5), torch.arange(300_000, dtype=torch.int32),  # multi-chunk
                np.arange(12, dtype=np.float16).reshape(3, 4)]
        for i, t in enumerate(sent):
            await a.send("b", ACTIVATION, t, request_ids=[f"r{i}", "x"], layer_start=2, layer_end=4, epoch=9,
                         name=f"t{i}", timeout=5)
        for i, t in enumerate(sent):
            r = await b.recv(ACTIVATION, timeout=5)
            ref = torch.from_numpy(t) if isinstance(t, np.ndarray) else t
            assert r.peer == "a" and r.data.dtype == ref.dtype and torch.equal(r.data, ref)
            h = r.header
            assert (list(h.request_ids), h.layer_start, h.layer_end, h.epoch, h.name, h.source) == \
                   ([f"r{i}", "x"], 2, 4, 9, f"t{i}", "a")
        big = [e for e in b.trace if e.op == "recv" and e.nbytes == 64 * 1024]
        assert len(big) >= 18  # the 1.2 MB tensor came in 64 KiB chunks
        await a.close()
        await b.close()

    run(main())


def test_bytes_and_both_directions_and_allocator_into_a_preallocated_buffer():
    async def main():
        a, b = await pair(min_chunk_bytes=4096, max_chunk_bytes=8192)
        cache = torch.zeros(4, 4096)  # "the KV cache": messages land in its rows

        def alloc(peer, header):
            assert header.name.startswith("row")
            return cache[int(header.name[3:])]

        b.set_allocator(KV_EXCHANGE, alloc)
        row = torch.randn(4096)
        await a.send("b", KV_EXCHANGE, row, name="row2", timeout=5)
        r = await b.recv(KV_EXCHANGE, timeout=5)
        assert r.data.data_ptr() == cache[2].data_ptr() and torch.equal(cache[2], row)
        await b.send("a", CONTROL, b'{"hello": 1}', name="report", timeout=5)
        r = await a.recv(CONTROL, timeout=5)
        assert bytes(r.data.numpy()) == b'{"hello": 1}' and r.peer == "b"
        await a.close()
        await b.close()

    run(main())


def test_activation_overtakes_a_kv_exchange_within_one_chunk_on_a_slow_link():
    async def main():
        # 100 MB/s simulated link, 256 KiB chunks (2.6 ms each): a 16 MiB exchange takes ~170 ms
        a, b = await pair(bandwidth_bps=100e6, min_chunk_bytes=256 * 1024, max_chunk_bytes=256 * 1024)
        kv = a.submit("b", KV_EXCHANGE, torch.zeros(4 * MiB))
        ckpt = a.submit("b", CHECKPOINT, torch.zeros(MiB))
        wts = a.submit("b", WEIGHTS, torch.zeros(MiB))
        acts = []
        for k in (2, 10, 30):
            await kv.wait_chunks(k, timeout=5)
            acts.append(a.submit("b", ACTIVATION, torch.ones(1024)))
        for h in acts:
            await h.wait(timeout=5)
        await kv.wait(timeout=10)
        await wts.wait(timeout=10)
        await ckpt.wait(timeout=10)
        order = [(e.kind, e.message_id) for e in a.trace if e.op in ("submit", "send")]
        sends = [e for e in a.trace if e.op == "send"]
        for h in acts:
            i_sub = next(i for i, e in enumerate(a.trace) if e.op == "submit" and e.message_id == h.message_id)
            i_sent = next(i for i, e in enumerate(a.trace) if e.op == "send" and e.message_id == h.message_id)
            between = [e for e in list(a.trace)[i_sub + 1:i_sent] if e.op == "send"]
            assert len(between) <= 1, between  # at most the chunk already on the wire
        # the receiver saw the same: every activation arrived before the KV exchange ended
        recv = [e for e in b.trace if e.op == "recv"]
        kv_last = next(i for i, e in enumerate(recv) if e.message_id == kv.message_id and e.last)
        assert all(next(i for i, e in enumerate(recv) if e.message_id == h.message_id) < kv_last for h in acts)
        # lower classes only after the higher ones: KV, then weights, then checkpoint
        last_send = {e.message_id: i for i, e in enumerate(sends)}
        first_send = {}
        for i, e in enumerate(sends):
            first_send.setdefault(e.message_id, i)
        assert last_send[kv.message_id] < first_send[wts.message_id] < first_send[ckpt.message_id]
        assert order
        await a.close()
        await b.close()

    run(main())


def test_clean_close_is_reported_without_error_and_sends_then_fail_naming_the_peer():
    async def main():
        a, b = await pair()
        lost = asyncio.Queue()
        a.on_peer_lost(lambda peer, err: lost.put_nowait((peer, err)))
        await b.close()
        peer, err = await asyncio.wait_for(lost.get(), 5)
        assert peer == "b" and err is None
        assert a.peers == []
        with pytest.raises(TransferError, match="peer b"):
            a.submit("b", ACTIVATION, torch.zeros(4))
        await a.close()

    run(main())


def test_link_failure_fails_queued_sends_with_the_peer_name():
    async def main():
        a, b = await pair(bandwidth_bps=50e6, min_chunk_bytes=64 * 1024, max_chunk_bytes=64 * 1024)
        lost = asyncio.Queue()
        a.on_peer_lost(lambda peer, err: lost.put_nowait((peer, err)))
        h = a.submit("b", KV_EXCHANGE, torch.zeros(MiB))
        await h.wait_chunks(1, timeout=5)
        for ep in b._peers["a"].endpoints:  # the peer dies: its end of the link goes away
            await ep.close()
        with pytest.raises(TransferError, match="peer b"):
            await h.wait(timeout=5)
        peer, err = await asyncio.wait_for(lost.get(), 5)
        assert peer == "b" and isinstance(err, TransferError)
        await a.close()
        await b.close()

    run(main())


def test_garbage_on_the_wire_is_a_protocol_error_naming_the_peer():
    async def main():
        a, b = await pair()
        lost = asyncio.Queue()
        b.on_peer_lost(lambda peer, err: lost.put_nowait((peer, err)))
        await a._peers["b"].endpoint.send(np.frombuffer(b"not a frame at all", np.uint8), TAG_HEADER)
        peer, err = await asyncio.wait_for(lost.get(), 5)
        assert peer == "a" and "magic" in str(err) and "peer a" in str(err)
        await a.close()
        await b.close()

    run(main())


def test_connect_errors_name_the_address_and_recv_waits_are_bounded():
    async def main():
        svc = TransferService("x", MemoryTransport({}), TransferConfig(), secret=SECRET)
        await svc.start()
        with pytest.raises(TransferError, match="mem:1234"):
            await svc.connect("mem", 1234, timeout=1)
        with pytest.raises(TimeoutError, match="ACTIVATION"):
            await svc.recv(ACTIVATION, timeout=0.05)
        with pytest.raises(TransferError, match="not connected"):
            svc.submit("nobody", ACTIVATION, torch.zeros(1))
        await svc.close()

    run(main())


def test_callbacks_replace_the_queue():
    async def main():
        a, b = await pair()
        got = []
        b.on_message(WEIGHTS, got.append)
        await a.send("b", WEIGHTS, torch.arange(10), name="layers.3.mlp", layer_start=3, layer_end=4, timeout=5)
        await a.send("b", CONTROL, b"", name="sync", timeout=5)  # same link, later: WEIGHTS already delivered
        await b.recv(CONTROL, timeout=5)
        assert len(got) == 1 and got[0].header.name == "layers.3.mlp" and torch.equal(got[0].data, torch.arange(10))
        assert b.recv_nowait(WEIGHTS) is None
        await a.close()
        await b.close()

    run(main())
