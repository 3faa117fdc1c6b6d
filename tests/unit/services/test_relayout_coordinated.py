"""The coordinated exchange (KunServe §4.2) in the worker's transition runner, on the in-process cluster of
test_relayout_runner (real engines, a fake transfer service): members resume at the commit and the KV lands
afterwards. The fake network holds or loses the KV-exchange messages, so "in flight" and "never arrives" are
states the test controls, not timings.

Oracle: requests whose life spans the transitions finish with the dense reference's greedy tokens, every
token once; a request whose KV is in flight produces nothing, a new one runs meanwhile."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import pytest
from engine_testing import one_torch_thread  # noqa: F401 - fixture
from test_relayout_runner import NUM_LAYERS, FakeNetwork, Requests, Worker, cluster, group_of, pause, plan, start_requests, with_blocks

from kunserve.services.worker.kv_exchange import ExportStaging
from kunserve.shared.policy.cluster import Unit
from kunserve.shared.transfer.framing import KV_EXCHANGE
from kunserve.shared.transfer.service import Received
from kunserve.shared.wire.transitions import unit_to_pb
from kunserve.v1 import worker_pb2

MAX_TOKENS = 40


class KVGate:
    """The KV-exchange messages delivered to some workers pass, are held until ``release``, or are lost."""

    def __init__(self, net: FakeNetwork, to: list[str]) -> None:
        self.mode = "pass"
        self.held: list[tuple[Callable[[Received], None], Received]] = []
        self.seen = 0  # messages held or lost
        for wid in to:
            svc = net.services[wid]
            svc.deliver = self._wrap(svc.deliver)  # type: ignore[method-assign]

    def _wrap(self, deliver: Callable[[Received], None]) -> Callable[[Received], None]:
        def gated(msg: Received) -> None:
            if msg.header.kind != KV_EXCHANGE or self.mode == "pass":
                deliver(msg)
                return
            self.seen += 1
            if self.mode == "hold":
                self.held.append((deliver, msg))
        return gated

    def hold(self) -> KVGate:
        self.mode = "hold"
        return self

    def lose(self) -> KVGate:
        self.mode = "lose"
        return self

    def release(self) -> None:
        """Deliver what was held, in order, and let everything pass from now on."""
        self.mode = "pass"
        held, self.held = self.held, []
        for deliver, msg in held:
            deliver(msg)


async def coordinated(workers: dict[str, Worker], epoch: int, op: str, old: list[Unit],
                      new: list[Unit]) -> dict[str, worker_pb2.TransitionDone]:
    """One transition as the orchestrator runs it with memory_manager.coordinated_exchange (background_kv)."""
    pause(workers)
    spec = worker_pb2.TransitionSpec(epoch=epoch, op=op, old_units=[unit_to_pb(u) for u in old],
                                     new_units=[unit_to_pb(u) for u in new], lease_s=30.0, background_kv=True)
    names = sorted(workers)
    prepared = dict(zip(names, await asyncio.gather(*(workers[w].runner.prepare(spec) for w in names))))
    spec = plan(spec, prepared, op, old, new)
    done = await asyncio.gather(*(workers[w].runner.execute(spec) for w in names))
    for w in names:
        await workers[w].runner.commit(epoch)
    return dict(zip(names, done))


async def drop(workers: dict[str, Worker]) -> None:
    await coordinated(workers, 1, "drop", [workers[w].single() for w in sorted(workers)], [group_of(workers)])


async def restore(workers: dict[str, Worker], epoch: int) -> None:
    await coordinated(workers, epoch, "restore", [with_blocks(group_of(workers), workers)],
                      [workers[w].single() for w in sorted(workers)])


async def until(cond: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"never: {what}"
        await asyncio.sleep(0.01)


async def progress(reqs: Requests, n: int) -> None:
    """Every request still running makes `n` more tokens."""
    seen = {rid: len(t) for rid, t in reqs.tokens.items() if len(t) < reqs.max_tokens}
    await until(lambda: all(len(reqs.tokens[rid]) >= min(seen[rid] + n, reqs.max_tokens) for rid in seen),
                f"{n} more tokens each")


def test_a_new_request_runs_while_the_moved_requests_wait_for_their_kv_then_all_keep_the_reference_tokens():
    async def main() -> None:
        async with cluster() as (net, workers):
            w0, w1 = workers["w0"], workers["w1"]
            reqs = start_requests(workers, max_tokens=MAX_TOKENS)
            await reqs.until_each_has(3)
            gate = KVGate(net, ["w0", "w1"]).hold()
            await drop(workers)
            assert gate.seen == 2, "the KV went both ways, after the commit"
            assert w0.runner.role is not None and w0.runner.role.is_head and not w0.runner.transitioning
            frozen = {rid: len(t) for rid, t in reqs.tokens.items()}
            reqs.submit("w0", "fresh", [(31 * k + 7) % 3800 + 100 for k in range(24)], MAX_TOKENS)
            await until(lambda: len(reqs.tokens["fresh"]) >= 3, "the new request decodes")
            assert {rid: len(reqs.tokens[rid]) for rid in frozen} == frozen, "a request ran before its KV landed"
            assert w0.loop.engine.kv_landing and w0.loop.engine.landing_epoch == 1
            gate.release()
            await until(lambda: not w0.loop.engine.kv_landing, "every member reported its KV landed")
            await progress(reqs, 3)
            gate.hold()  # the restore lands its KV after the commit as well
            await restore(workers, 2)
            assert w0.loop.engine.kv_landing and w1.loop.engine.kv_landing
            gate.release()
            await reqs.finish()
            assert not w0.loop.engine.kv_landing and not w1.loop.engine.kv_landing

    asyncio.run(main())


def test_a_drop_lends_the_staging_kept_warm_and_gets_it_back_once_its_kv_has_landed():
    """keep_staging_warm faults the outgoing KV's buffer in while the engines serve; the drop then allocates
    nothing at Prepare, and the buffer returns to the reserve only after every send and landing is done."""
    async def main() -> None:
        async with cluster() as (net, workers):
            reqs = start_requests(workers, max_tokens=MAX_TOKENS)
            await reqs.until_each_has(3)
            warming = [asyncio.create_task(w.runner.keep_staging_warm(0.01)) for w in workers.values()]
            await until(lambda: all(w.runner.staging.idle is not None for w in workers.values()), "staging warmed")
            for t in warming:
                t.cancel()
            allocations = {wid: w.runner.staging.allocations for wid, w in workers.items()}
            gate = KVGate(net, ["w0", "w1"]).hold()
            await drop(workers)
            assert {wid: w.runner.staging.allocations for wid, w in workers.items()} == allocations, "a cold staging"
            assert all(w.runner.staging.lent and w.runner.staging.idle is None for w in workers.values())
            gate.release()
            await until(lambda: not any(w.runner.staging.lent for w in workers.values()), "staging given back")
            assert all(w.runner.staging.idle is not None for w in workers.values())
            await reqs.finish()

    asyncio.run(main())


def test_kv_lost_on_the_way_to_the_head_breaks_the_group_and_loses_no_request():
    async def main() -> None:
        async with cluster(timeout_s=6.0) as (net, workers):
            w0, w1 = workers["w0"], workers["w1"]
            reqs = start_requests(workers, max_tokens=MAX_TOKENS)
            await reqs.until_each_has(3)
            KVGate(net, ["w0"]).lose()
            await drop(workers)
            await until(lambda: w0.runner.role is None and w1.runner.role is None, "both members healed")
            await reqs.finish()
            assert w0.inst.layer_range == (0, NUM_LAYERS) and not w0.loop.engine.kv_landing
            assert not w0.runner.staging.lent and w0.runner.staging.idle is None, "a buffer a send may still read"

    asyncio.run(main())


def test_a_restore_whose_peer_kv_never_lands_re_prefills_the_held_requests():
    """After a restore each member is a whole instance: there is no group to break when the KV its requests
    wait for never comes, so it re-prefills them itself (and the next transition is not refused)."""
    async def main() -> None:
        async with cluster(timeout_s=6.0) as (net, workers):
            w0 = workers["w0"]
            reqs = start_requests(workers, max_tokens=MAX_TOKENS)
            await reqs.until_each_has(3)
            await drop(workers)
            await progress(reqs, 3)
            gate = KVGate(net, ["w0"]).lose()
            await restore(workers, 2)
            assert gate.seen == 1 and w0.loop.engine.kv_landing
            await until(lambda: not w0.loop.engine.kv_landing, "the held requests given up on")
            assert w0.runner.role is None and w0.loop.engine.landing_epoch is None
            await reqs.finish()

    asyncio.run(main())


@pytest.mark.parametrize("how", ["raises", "cancelled"])
def test_a_cold_staging_that_fails_at_prepare_leaves_nothing_lent_and_the_next_drop_goes_through(how):
    """Prepare finds no warm staging and allocates one cold; that allocation raises (out of host memory) or the
    Prepare is cancelled meanwhile. The reserve must not stay lent: it would never grow a warm buffer again."""
    async def main() -> None:
        async with cluster() as (_, workers):
            w0 = workers["w0"]
            reqs = start_requests(workers, max_tokens=MAX_TOKENS)
            await reqs.until_each_has(2)
            cold = w0.runner.staging.allocate
            entered, release = threading.Event(), threading.Event()

            def failing(nbytes: int) -> ExportStaging:
                entered.set()
                if how == "raises":
                    raise MemoryError("no host memory for the staging")
                release.wait(30)
                return cold(nbytes)

            w0.runner.staging.allocate = failing  # type: ignore[method-assign]
            spec = worker_pb2.TransitionSpec(epoch=1, op="drop", old_units=[unit_to_pb(workers[w].single())
                                                                           for w in sorted(workers)],
                                             new_units=[unit_to_pb(group_of(workers))], lease_s=30.0)
            task = asyncio.create_task(w0.runner.prepare(spec))
            await until(entered.is_set, "the cold allocation started")
            if how == "cancelled":
                task.cancel()
            with pytest.raises(MemoryError if how == "raises" else asyncio.CancelledError):
                await task
            release.set()
            assert not w0.runner.staging.lent, "the failed Prepare still holds the reserve"
            assert w0.runner.staging.wants(1 << 20, 1 << 22) > 0, "keep_staging_warm could never grow it again"
            assert not w0.runner.transitioning and not w0.loop.paused
            w0.runner.staging.allocate = cold  # type: ignore[method-assign]
            await drop(workers)
            assert w0.runner.role is not None and w0.runner.role.is_head
            await reqs.finish()

    asyncio.run(main())
