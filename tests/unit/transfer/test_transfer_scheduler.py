"""The transfer service's pure parts: priority chunk scheduling, chunk sizing, framing."""

import math

import numpy as np
import pytest
import torch

from kunserve.shared.transfer import (
    ACTIVATION,
    CHECKPOINT,
    CONTROL,
    KV_EXCHANGE,
    WEIGHTS,
    ChunkSizer,
    FramingError,
    OutgoingMessage,
    PriorityScheduler,
    framing,
)
from kunserve.v1 import transfer_pb2

MiB = 1 << 20


def fixed(size):
    return ChunkSizer(min_bytes=size, max_bytes=size, align=1)


def drain(sched, seconds=0.001):
    out = []
    while (c := sched.next_chunk()) is not None:
        sched.complete(c, seconds)
        out.append(c)
    return out


def test_activation_waits_behind_at_most_one_chunk_of_a_kv_exchange():
    sched = PriorityScheduler(fixed(1 * MiB))
    kv = OutgoingMessage(KV_EXCHANGE, 64 * MiB, 1)
    sched.enqueue(kv)
    sent = []
    for step in range(10):
        c = sched.next_chunk()
        sent.append((c.message.kind, c.index))
        if step in (3, 7):  # an activation arrives while a KV chunk is on the wire
            sched.enqueue(OutgoingMessage(ACTIVATION, 16 * 1024, 100 + step))
        sched.complete(c, 0.001)
    # each activation went right after the KV chunk that was on the wire when it arrived
    assert sent[:6] == [(KV_EXCHANGE, 0), (KV_EXCHANGE, 1), (KV_EXCHANGE, 2), (KV_EXCHANGE, 3), (ACTIVATION, 0),
                        (KV_EXCHANGE, 4)]
    assert sent[7:] == [(KV_EXCHANGE, 6), (ACTIVATION, 0), (KV_EXCHANGE, 7)]
    rest = drain(sched)
    assert [c.message.kind for c in rest] == [KV_EXCHANGE] * (64 - 8)
    assert rest[-1].last and rest[-1].index == 63 and rest[-1].count == 64


def test_classes_are_strict_priorities_and_fifo_within_a_class():
    sched = PriorityScheduler(fixed(MiB))
    order = [(CHECKPOINT, 1), (WEIGHTS, 2), (KV_EXCHANGE, 3), (ACTIVATION, 4), (KV_EXCHANGE, 5), (CONTROL, 6),
             (ACTIVATION, 7), (WEIGHTS, 8)]
    for kind, mid in order:
        sched.enqueue(OutgoingMessage(kind, 2 * MiB, mid))
    got = [c.message.message_id for c in drain(sched)]
    # 2 chunks each; a message's chunks are consecutive; control rides with activations, FIFO
    assert got == [4, 4, 6, 6, 7, 7, 3, 3, 5, 5, 2, 2, 8, 8, 1, 1]


def test_a_message_is_finished_before_the_next_of_its_class_starts():
    sched = PriorityScheduler(fixed(MiB))
    sched.enqueue(OutgoingMessage(KV_EXCHANGE, 3 * MiB, 1))
    c = sched.next_chunk()
    sched.enqueue(OutgoingMessage(KV_EXCHANGE, MiB, 2))
    sched.complete(c, 0.001)
    assert [c.message.message_id for c in drain(sched)] == [1, 1, 2]


def test_chunks_tile_the_message_exactly():
    sched = PriorityScheduler(ChunkSizer(min_bytes=4096, max_bytes=MiB, initial_bps=300e6, target_s=0.001))
    total = 10 * MiB + 123
    sched.enqueue(OutgoingMessage(WEIGHTS, total, 9))
    chunks = drain(sched, seconds=0.002)
    assert sum(c.nbytes for c in chunks) == total
    assert all(a.offset + a.nbytes == b.offset for a, b in zip(chunks, chunks[1:]))
    assert [c.index for c in chunks] == list(range(len(chunks)))
    assert chunks[-1].last and chunks[-1].count == len(chunks) and not any(c.last for c in chunks[:-1])


def test_empty_message_is_one_empty_chunk():
    sched = PriorityScheduler()
    sched.enqueue(OutgoingMessage(CONTROL, 0, 1))
    (c,) = drain(sched)
    assert c.nbytes == 0 and c.last and c.count == 1


def test_one_chunk_in_flight_at_a_time():
    sched = PriorityScheduler()
    sched.enqueue(OutgoingMessage(KV_EXCHANGE, 10 * MiB, 1))
    c = sched.next_chunk()
    with pytest.raises(RuntimeError):
        sched.next_chunk()
    sched.complete(c, 0.001)
    assert sched.next_chunk() is not None


def test_remove_only_unstarted_and_drain():
    sched = PriorityScheduler(fixed(MiB))
    a, b = OutgoingMessage(KV_EXCHANGE, 2 * MiB, 1), OutgoingMessage(KV_EXCHANGE, 2 * MiB, 2)
    sched.enqueue(a)
    sched.enqueue(b)
    sched.complete(sched.next_chunk(), 0.001)
    assert not sched.remove(a) and sched.remove(b)
    assert sched.drain() == [a] and len(sched) == 0


def test_chunk_size_converges_to_the_target_time():
    """Simulated link: a chunk of c bytes takes lat + c / B. The sizer's fixed point is c = B (target - lat)."""
    bandwidth, lat, target = 800e6, 100e-6, 0.005
    sizer = ChunkSizer(target_s=target, initial_bps=50e6, min_bytes=4096, max_bytes=256 * MiB)
    sched = PriorityScheduler(sizer)
    sched.enqueue(OutgoingMessage(KV_EXCHANGE, 4096 * MiB, 1))
    sizes = []
    for _ in range(40):
        c = sched.next_chunk()
        sched.complete(c, lat + c.nbytes / bandwidth)
        sizes.append(c.nbytes)
    assert sizes[0] < sizes[-1]  # grew from the pessimistic initial guess
    chunk_time = lat + sizes[-1] / bandwidth
    assert chunk_time == pytest.approx(target, rel=0.05)
    # the link slows down 4x: chunks shrink to keep about the same time
    for _ in range(40):
        c = sched.next_chunk()
        sched.complete(c, lat + c.nbytes / (bandwidth / 4))
    assert lat + c.nbytes / (bandwidth / 4) == pytest.approx(target, rel=0.05)


def test_small_messages_do_not_drag_the_throughput_estimate_down():
    sizer = ChunkSizer(target_s=0.005, initial_bps=1e9)
    before = sizer.chunk_bytes()
    for _ in range(100):
        assert not sizer.observe(16 * 1024, 200e-6)  # activations: latency-bound samples
    assert sizer.chunk_bytes() == before


def test_chunk_size_is_clamped_and_aligned():
    sizer = ChunkSizer(target_s=0.005, min_bytes=64 * 1024, max_bytes=8 * MiB, initial_bps=1e12)
    assert sizer.chunk_bytes() == 8 * MiB
    sizer = ChunkSizer(target_s=0.005, min_bytes=64 * 1024, max_bytes=8 * MiB, initial_bps=1e3)
    assert sizer.chunk_bytes() == 64 * 1024
    sizer = ChunkSizer(target_s=0.001, initial_bps=1e9 + 12345)
    assert sizer.chunk_bytes() % 4096 == 0
    with pytest.raises(ValueError):
        ChunkSizer(min_bytes=10, max_bytes=5)


# ------------------------------------------------------------------ framing


def test_header_frame_round_trip_through_a_larger_buffer():
    h = transfer_pb2.TransferHeader(kind=KV_EXCHANGE, message_id=7, chunk_index=0, chunk_count=3, total_bytes=96,
                                    dtype="bfloat16", shape=[2, 3, 8], request_ids=["r1", "r2"], layer_start=4,
                                    layer_end=8, epoch=11, name="kv", source="w0")
    buf = np.zeros(framing.FRAME_MAX, np.uint8)
    frame = framing.encode_frame(h)
    buf[:len(frame)] = np.frombuffer(frame, np.uint8)
    assert framing.decode_frame(buf) == (h, None)
    framing.validate_first_chunk(h)


def test_inline_payload_rides_in_the_frame():
    payload = np.arange(96, dtype=np.uint8)
    h = transfer_pb2.TransferHeader(kind=ACTIVATION, message_id=3, chunk_bytes=96, total_bytes=96, dtype="uint8",
                                    shape=[96])
    frame = framing.encode_frame(h, payload)
    buf = np.zeros(framing.FRAME_MAX, np.uint8)
    buf[:len(frame)] = np.frombuffer(frame, np.uint8)
    got, inline = framing.decode_frame(buf)
    assert got.payload_inline and bytes(inline) == payload.tobytes()
    with pytest.raises(FramingError, match="inline"):
        framing.encode_frame(transfer_pb2.TransferHeader(chunk_bytes=10), payload)


def test_bad_frames_are_rejected():
    with pytest.raises(FramingError, match="magic"):
        framing.decode_frame(b"XXXX\x00\x00\x00\x00")
    with pytest.raises(FramingError, match="exceeds"):
        framing.decode_frame(b"KTX1\xff\x00\x00\x00")
    with pytest.raises(FramingError, match="bytes"):
        framing.validate_first_chunk(transfer_pb2.TransferHeader(kind=ACTIVATION, dtype="float32", shape=[4],
                                                                  total_bytes=15))
    with pytest.raises(FramingError, match="dtype"):
        framing.validate_first_chunk(transfer_pb2.TransferHeader(kind=ACTIVATION, dtype="complex7", shape=[1]))
    with pytest.raises(FramingError, match="request ids"):
        framing.encode_frame(transfer_pb2.TransferHeader(request_ids=["x" * 100] * 1000))
    with pytest.raises(FramingError, match="offset"):
        framing.validate_chunk(transfer_pb2.TransferHeader(offset=10, chunk_bytes=5), 100, 0)
    with pytest.raises(FramingError, match="overruns"):
        framing.validate_chunk(transfer_pb2.TransferHeader(offset=0, chunk_bytes=101), 100, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8,
                                   torch.uint8, torch.bool])
def test_byte_views_share_memory(dtype):
    t = torch.zeros(3, 5, dtype=dtype)
    name, shape, nbytes = framing.tensor_meta(t)
    assert framing.torch_dtype(name) == dtype and shape == [3, 5] and nbytes == 15 * t.element_size()
    v = framing.byte_view(t)
    assert isinstance(v, np.ndarray) and v.dtype == np.uint8 and v.nbytes == nbytes
    v[:] = 1
    assert t.view(torch.uint8).reshape(-1).eq(1).all()
    assert math.prod(shape) * framing.itemsize(name) == nbytes


def test_byte_view_refuses_non_contiguous():
    with pytest.raises(ValueError, match="contiguous"):
        framing.byte_view(torch.zeros(4, 4).t())
