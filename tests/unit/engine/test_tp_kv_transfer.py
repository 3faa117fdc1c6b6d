"""An in-place TP change's KV moves over the transfer service's KV-exchange class (services/worker/tp_kv_transfer.py):
real TransferServices over the in-process transport on one event loop thread, members calling the exchange from their
own threads as their engine threads would. Each phase's sub-blocks arrive where they belong, a peer's message that
comes before its call is kept for it, another change's message is dropped, and a peer that sends nothing or the wrong
size breaks the change (InstanceBroken, which the transform heals); whole engines merge and split over it with the
reference's tokens."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from test_tp_transform import assert_reference_tokens, decode_merged, decoding_engines, model

from kunserve.benchkit.tp_members import free_port, on_ranks
from kunserve.services.worker.tp_in_place import InPlaceTP
from kunserve.services.worker.tp_kv_transfer import TransferSubBlocks
from kunserve.shared.engine.engine import InstanceBroken
from kunserve.shared.engine.tensor_parallel import TPGroup
from kunserve.shared.engine.tp_transform import scale_down, scale_up
from kunserve.shared.model.tp_degree import shard_config
from kunserve.shared.model.tp_shard import shard_weights
from kunserve.shared.transfer import KV_EXCHANGE, MemoryTransport, TransferConfig, TransferService

pytestmark = pytest.mark.timeout(120)
SECRET = b"test-cluster-secret-0123456789"


class Net:
    """`n` linked transfer services (w0, w1, ...) on an event loop of their own thread."""

    def __init__(self, n: int) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.names = [f"w{i}" for i in range(n)]
        self.svcs: list[TransferService] = self.call(self._start())

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    async def _start(self) -> list[TransferService]:
        registry: dict = {}
        svcs = [TransferService(name, MemoryTransport(registry), TransferConfig(), secret=SECRET) for name in self.names]
        ports = [await s.start() for s in svcs]
        for i, a in enumerate(svcs):
            for j in range(i + 1, len(svcs)):
                assert await a.connect("mem", ports[j], timeout=5) == self.names[j]
                await svcs[j].wait_for_peer(self.names[i], timeout=5)
        return svcs

    def exchange(self, rank: int, change: str = "tp-kv:1:up", timeout_s: float = 10.0) -> TransferSubBlocks:
        ex = TransferSubBlocks.between(self.svcs[rank], self.loop, self.names, rank, change, timeout_s)
        assert ex is not None
        return ex

    def close(self) -> None:
        async def stop() -> None:
            for s in self.svcs:
                await s.close()

        self.call(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture()
def net3() -> Iterator[Net]:
    net = Net(3)
    yield net
    net.close()


def test_each_phase_arrives_where_it_belongs_in_lockstep(net3):
    """Every member calls every tag and hears from every other one (nothing where it sends nothing), so none runs
    more than one phase ahead."""
    pairs = [(src, dst, tag) for tag in (0, 1, 2) for src in range(3) for dst in range(3) if src != dst]
    sent = {k: torch.randn(4, 2, 8) for k in pairs if sum(k) % 3}  # some pairs move nothing at some tags
    got: dict[tuple[int, int, int], torch.Tensor] = {}

    def member(rank: int) -> None:
        ex = net3.exchange(rank)
        for tag in (0, 1, 2):
            recvs = {src: torch.empty(4, 2, 8) for (src, dst, t) in sent if dst == rank and t == tag}
            ex({dst: t for (src, dst, tg), t in sent.items() if src == rank and tg == tag}, recvs, tag)
            got.update({(src, rank, tag): t for src, t in recvs.items()})

    on_ranks(3, member)
    assert got.keys() == sent.keys() and all(torch.equal(got[k], sent[k]) for k in sent)


def test_a_message_one_phase_ahead_waits_for_its_call(net3):
    """Rank 2's tag-1 message reaches rank 0 while rank 0 still waits for rank 1's tag 0: kept, and used at tag 1."""
    net = net3
    queue = net.svcs[0]._queue(KV_EXCHANGE)
    a0, a1, b0, b1 = (torch.full((3,), float(v)) for v in (10, 11, 20, 21))
    net.call(_submit(net.svcs[2], "w0", b0, "c:0"))
    net.call(_submit(net.svcs[2], "w0", b1, "c:1"))
    deadline = time.monotonic() + 10
    while queue.qsize() < 2:  # both of rank 2's messages wait at rank 0 before rank 1's first one is sent
        assert time.monotonic() < deadline
        time.sleep(0.01)
    net.call(_submit(net.svcs[1], "w0", a0, "c:0"))
    net.call(_submit(net.svcs[1], "w0", a1, "c:1"))
    ex = net.exchange(0, change="c")
    for tag, (want1, want2) in enumerate([(a0, b0), (a1, b1)]):
        recvs = {1: torch.empty(3), 2: torch.empty(3)}
        ex({}, recvs, tag)
        assert torch.equal(recvs[1], want1) and torch.equal(recvs[2], want2)
    assert ex.kept_early == 1


def test_another_changes_message_is_dropped(net3):
    net = net3
    net.call(_submit(net.svcs[1], "w0", torch.ones(3), "tp-kv:9:down:0"))  # a stale change's, same tag

    def member(rank: int) -> None:
        recvs = {1: torch.empty(3)} if rank == 0 else {}
        net.exchange(rank)({0: torch.full((3,), 7.0)} if rank == 1 else {}, recvs, 0)
        if rank == 0:
            assert torch.equal(recvs[1], torch.full((3,), 7.0))

    on_ranks(3, member)


async def _submit(svc: TransferService, peer: str, t: torch.Tensor, name: str) -> None:
    await svc.send(peer, KV_EXCHANGE, t, name=name, timeout=5)


def test_a_peer_that_sends_nothing_or_the_wrong_size_breaks_the_change(net3):
    with pytest.raises(InstanceBroken, match="no sub-blocks from w1"):
        net3.exchange(0, timeout_s=0.5)({}, {1: torch.empty(3)}, 0)

    def member(rank: int) -> object:
        try:
            net3.exchange(rank, change="tp-kv:2:up")({0: torch.ones(5)} if rank == 1 else {},
                                                     {1: torch.empty(3)} if rank == 0 else {}, 0)
        except InstanceBroken as exc:
            return exc
        return None

    outcomes = on_ranks(3, member)
    assert isinstance(outcomes[0], InstanceBroken) and "5" in str(outcomes[0]) and outcomes[1:] == [None, None]


def test_a_worker_without_a_link_to_every_member_moves_its_kv_over_gloo(net3):
    assert TransferSubBlocks.between(None, net3.loop, net3.names, 0, "c", 1.0) is None
    assert TransferSubBlocks.between(net3.svcs[0], net3.loop, [*net3.names, "w9"], 0, "c", 1.0) is None


def test_whole_engines_merge_and_split_with_their_kv_over_the_transfer_service():
    torch.set_num_threads(1)
    cfg, weights = model("tiny")
    degree = 2
    net = Net(degree)
    try:
        engines, requests, tokens = decoding_engines(cfg, weights, degree)
        port = free_port()
        groups = on_ranks(degree, lambda r: TPGroup(r, degree, "127.0.0.1", port, timeout_s=60, rendezvous_timeout_s=60))
        ups = [net.exchange(r, "tp-kv:7:up") for r in range(degree)]
        downs = [net.exchange(r, "tp-kv:7:down") for r in range(degree)]

        def no_gloo(*args, **kwargs):
            raise AssertionError("the KV must not move over gloo")

        for g in groups:
            g.exchange = no_gloo  # type: ignore[attr-defined]
        on_ranks(degree, lambda r: scale_up(engines[r], groups[r], shard_config(cfg, degree),
                                            shard_weights(weights, r, degree), max_phase_subblocks=4,
                                            exchange=ups[r]))
        assert all(x.sent_bytes > 0 and x.received_bytes > 0 for x in ups)
        decode_merged(groups, engines, tokens, tokens.at_least(8, requests))
        on_ranks(degree, lambda r: scale_down(engines[r], groups[r], cfg, weights, exchange=downs[r]))
        assert sum(x.sent_bytes for x in downs) > 0
        for g in groups:
            g.close()  # type: ignore[attr-defined]
        for e in engines:
            while e.has_work():
                tokens.add(e.step())
        assert tokens.finished == set(requests)
        assert_reference_tokens(cfg, weights, requests, tokens)
    finally:
        net.close()


def test_the_members_agree_on_one_channel_and_one_name_for_the_change(net3):
    """Every member over the transfer service, under a name carrying rank 0's nonce (fresh per change), or every
    member over gloo when one has no link."""
    port = free_port()
    groups: list[TPGroup] = on_ranks(2, lambda r: TPGroup(r, 2, "127.0.0.1", port, timeout_s=30, rendezvous_timeout_s=30))  # type: ignore[assignment]
    tp = InPlaceTP(None, None, None, lambda rid: False)  # type: ignore[arg-type]
    try:
        first = on_ranks(2, lambda r: tp._agreed(groups[r], net3.exchange(r, "tp-kv:5:up"), "up"))
        again = on_ranks(2, lambda r: tp._agreed(groups[r], net3.exchange(r, "tp-kv:5:up"), "up"))
        names = [[x.change for x in xs] for xs in (first, again)]  # type: ignore[union-attr]
        assert names[0][0] == names[0][1] and names[1][0] == names[1][1] and names[0][0] != names[1][0]
        assert names[0][0].startswith("tp-kv:5:up:")
        mixed = on_ranks(2, lambda r: tp._agreed(groups[r], net3.exchange(r, "tp-kv:5:up") if r == 0 else None, "up"))
        assert mixed == [None, None]
    finally:
        for g in groups:
            g.close()
