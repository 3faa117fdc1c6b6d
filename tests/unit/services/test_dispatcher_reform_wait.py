"""The dispatcher's side of a worker's tensor-parallel re-form (services/dispatcher/servicer.py WorkerPool): a stats
poll or a refusal that says `reforming` makes the router wait for the worker while it re-executes (bounded by the
re-form's timeout), a worker that merely timed out a poll and then died is not waited for, and a worker that left is
forgotten."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from helpers import make_config

from kunserve.services.dispatcher import servicer as dispatcher
from kunserve.services.dispatcher.servicer import WorkerPool
from kunserve.shared.rpc import REFORMING
from kunserve.v1 import common_pb2, memory_manager_pb2

pytestmark = pytest.mark.timeout(30)


def rpc_error(code: grpc.StatusCode, trailer: tuple = ()) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailer), details=code.name)


class Stats:
    """A worker's GetStats: `answer` (a WorkerStats) or `error`."""

    def __init__(self) -> None:
        self.answer = common_pb2.WorkerStats(
            kv_blocks_total=100, block_size=16, serving=True, layer_start=0, layer_end=4, num_layers_model=4
        )
        self.error: grpc.aio.AioRpcError | None = None

    async def GetStats(self, request, timeout=None):
        if self.error is not None:
            raise self.error
        return self.answer


def pool_with_fakes(n: int = 2) -> tuple[WorkerPool, dict[str, Stats]]:
    pool = WorkerPool(make_config(n))
    fakes = {w: Stats() for w in pool.stubs}
    pool.stubs.update(fakes)  # type: ignore[arg-type]
    return pool, fakes


def test_a_poll_that_says_reforming_makes_requests_wait_until_the_reform_deadline():
    async def scenario() -> None:
        pool, fakes = pool_with_fakes()
        await pool.refresh()
        assert pool.router.choose() is not None
        for f in fakes.values():  # both re-form: a poll sees it, then they answer nothing while they re-execute
            f.answer.reforming, f.answer.serving = True, False
        await pool.refresh()
        for f in fakes.values():
            f.error = rpc_error(grpc.StatusCode.UNAVAILABLE)
        await pool.refresh()
        now = time.monotonic()
        assert pool.router.choose() is None and pool.router.may_become_routable(now=now)
        assert pool.reform_wait_s > make_config(2).memory_manager.transition_timeout_s
        assert not pool.router.may_become_routable(now=now + pool.reform_wait_s)  # never came back: fail, not wait
        for f in fakes.values():  # back, serving
            f.error, f.answer.reforming, f.answer.serving = None, False, True
        await pool.refresh()
        assert pool.router.choose() is not None
        await pool.close()

    asyncio.run(scenario())


def test_a_worker_that_timed_out_a_poll_and_then_died_is_not_waited_for():
    async def scenario() -> None:
        pool, fakes = pool_with_fakes(1)
        await pool.refresh()
        (f,) = fakes.values()
        f.error = rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED)
        await pool.refresh()
        f.error = rpc_error(grpc.StatusCode.UNAVAILABLE)
        await pool.refresh()
        assert not pool.router.may_become_routable(now=time.monotonic())
        await pool.close()

    asyncio.run(scenario())


def test_a_refusal_with_the_reforming_trailer_marks_the_worker_coming_back():
    assert dispatcher._reforming(rpc_error(grpc.StatusCode.FAILED_PRECONDITION, ((REFORMING, "1"),)))
    assert not dispatcher._reforming(rpc_error(grpc.StatusCode.FAILED_PRECONDITION))
    assert not dispatcher._reforming(None)


def test_a_worker_that_left_is_forgotten_by_the_router():
    async def scenario() -> None:
        cfg = make_config(2)
        pool = WorkerPool(cfg)
        seeds = [memory_manager_pb2.WorkerLayout(worker_id=w.id, address=w.address) for w in cfg.workers]
        joined = memory_manager_pb2.WorkerLayout(worker_id="joined-7", address="127.0.0.1:1")
        pool.apply_layout(memory_manager_pb2.ClusterLayout(workers=[*seeds, joined], members_version=2, members_settled=True))
        fake = Stats()
        fake.answer.reforming = True
        pool.stubs["joined-7"] = fake  # type: ignore[assignment]
        await pool.refresh_one("joined-7")
        assert "joined-7" in pool.router.workers
        pool.apply_layout(memory_manager_pb2.ClusterLayout(workers=seeds, members_version=3, members_settled=True))
        r = pool.router
        assert all("joined-7" not in d for d in (r.workers, r._pending, r._refused_at, r._back_by))
        await pool.close()

    asyncio.run(scenario())
