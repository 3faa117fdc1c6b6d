"""Replay a request trace against a running cluster over gRPC: one client task per request, each sent at its
arrival time, while a sampler records the cluster's KV usage and layout (for the TTFT-over-time plot).

Why one task per request (and not a bounded worker pool): an open-loop client is what makes queueing visible.
A closed loop would slow down with the server and hide exactly the tail latency the benchmark is about.
Prompts are random token ids (seeded per request) so that no tokenizer is needed and a rerun with the same
seed sends the same tokens; the ids lie in PROMPT_TOKEN_RANGE, which fits any vocabulary of 4096 or more.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import grpc

from kunserve import client
from kunserve.benchkit.stats import RequestResult
from kunserve.benchkit.trace import TraceRequest
from kunserve.cli.kunctl import status_groups
from kunserve.v1 import admin_pb2_grpc, common_pb2

PROMPT_TOKEN_RANGE = (300, 4000)  # clear of the byte range and special ids of the embedded model
CHANNELS = 4  # client connections the requests are spread over (HTTP/2 stream limits, one busy socket)
SAMPLE_INTERVAL_S = 0.25
CONNECT_TIMEOUT_S = 5.0


class ClusterUnreachable(RuntimeError):
    """The dispatcher did not answer: `bench` reports it in one line instead of N failed requests."""


@dataclass
class ClusterSample:
    """The cluster at one instant, as the admin service (memory manager) reports it."""

    t_s: float                 # since the bench start
    kv_blocks_used: int        # over serving units (a pipeline group's blocks counted once, at its head)
    kv_blocks_total: int
    queued_demand_blocks: int
    units: int                 # whole instances + pipeline groups
    pipelined_units: int       # units with more than one member: the cluster is in drop state
    workers: int               # the members of all units: workers - units is the number of merges in force
    epoch: int
    kv_blocks_undropped: int = 0  # over every worker, the blocks it has holding every layer: the capacity without a drop

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    def to_dict(self) -> dict:
        return {"t_s": self.t_s, "kv_blocks_used": self.kv_blocks_used, "kv_blocks_total": self.kv_blocks_total,
                "kv_usage": self.kv_usage, "queued_demand_blocks": self.queued_demand_blocks, "units": self.units,
                "pipelined_units": self.pipelined_units, "workers": self.workers, "epoch": self.epoch,
                "kv_blocks_undropped": self.kv_blocks_undropped}


@dataclass
class ReplayOutcome:
    results: list[RequestResult]          # one per request that was sent (interrupted ones marked so)
    duration_s: float                     # first send to last stream end (or to the interruption)
    samples: list[ClusterSample] = field(default_factory=list)
    interrupted: bool = False
    not_sent: int = 0                     # requests whose arrival time had not come when it was interrupted


def prompt_ids(index: int, length: int, seed: int) -> list[int]:
    rng = random.Random(seed * 1_000_003 + index)
    lo, hi = PROMPT_TOKEN_RANGE
    return [rng.randrange(lo, hi) for _ in range(length)]


def drop_periods(samples: Sequence[ClusterSample]) -> list[tuple[float, float]]:
    """Intervals during which some unit was a pipeline group (the shaded spans of the timeline plot)."""
    spans: list[tuple[float, float]] = []
    start: float | None = None
    for s in samples:
        if s.pipelined_units and start is None:
            start = s.t_s
        elif not s.pipelined_units and start is not None:
            spans.append((start, s.t_s))
            start = None
    if start is not None and samples:
        spans.append((start, samples[-1].t_s))
    return spans


def sample_from_status(status, t_s: float) -> ClusterSample:
    stats = {ws.stats.worker_id: ws.stats for ws in status.cluster.workers}
    units = status_groups(status)
    used = total = 0
    for u in units:
        head = stats.get(u.members[0][0])
        if head is not None:
            used += head.kv_blocks_used
            total += head.kv_blocks_total
    return ClusterSample(t_s=t_s, kv_blocks_used=used, kv_blocks_total=total,
                         queued_demand_blocks=status.cluster.queued_demand_blocks, units=len(units),
                         pipelined_units=sum(1 for u in units if len(u.members) > 1),
                         workers=sum(len(u.members) for u in units), epoch=status.layout.epoch,
                         kv_blocks_undropped=sum(s.kv_blocks_undropped or s.kv_blocks_total for s in stats.values()))


async def wait_reachable(address: str, timeout_s: float = CONNECT_TIMEOUT_S,
                         creds: client.Credentials | None = None) -> None:
    async with client.dispatcher_channel(address, creds) as ch:
        try:
            await asyncio.wait_for(ch.channel_ready(), timeout_s)
        except TimeoutError:
            raise ClusterUnreachable(f"cannot reach the dispatcher at {address} (no answer in {timeout_s:.0f} s)") from None


async def _sampler(admin_address: str, t0: float, out: list[ClusterSample], stop: asyncio.Event,
                   interval_s: float, creds: client.Credentials | None) -> None:
    """Poll the admin status until `stop`; a failing poll is skipped (the plot just has a gap)."""
    async with client.admin_channel(admin_address, creds) as ch:
        stub = admin_pb2_grpc.AdminStub(ch)
        while not stop.is_set():
            try:
                status = await stub.GetStatus(common_pb2.Empty(), timeout=2.0)
                out.append(sample_from_status(status, time.monotonic() - t0))
            except grpc.aio.AioRpcError:
                pass
            try:
                await asyncio.wait_for(stop.wait(), interval_s)
            except TimeoutError:
                pass


async def _one(ch: grpc.aio.Channel, req: TraceRequest, index: int, t0: float, seed: int, timeout_s: float,
               request_prefix: str) -> RequestResult:
    sent = time.monotonic()
    res = RequestResult(index=index, arrival_s=req.arrival_s, sent_s=sent - t0, prompt_tokens=req.prompt_tokens,
                        output_tokens=req.output_tokens)
    request = client.make_request(prompt_ids(index, req.prompt_tokens, seed), request_id=f"{request_prefix}{index}",
                                  max_tokens=req.output_tokens, ignore_eos=True)
    stream = client.GenerationResult()  # filled as tokens arrive: kept when the call fails or is cancelled
    try:
        await client.generate(ch, request, timeout=timeout_s, into=stream)
        res.e2e_s = time.monotonic() - sent
        res.ok = stream.finish_reason not in ("", "aborted")
        if not res.ok:
            res.error = f"stream ended without finishing ({stream.finish_reason or 'no finish reason'})"
    except grpc.aio.AioRpcError as exc:
        res.error = f"{exc.code().name}: {exc.details()}"
    except asyncio.CancelledError:
        res.error = "interrupted"
    res.ttft_s, res.token_times_s = stream.ttft_s, stream.token_times_s
    res.worker_id, res.finish_reason = stream.worker_id, stream.finish_reason
    return res


SendFn = Callable[[int, TraceRequest, float], Awaitable[RequestResult]]


async def open_loop(trace: Sequence[TraceRequest], send: SendFn, *, stop: asyncio.Event | None = None,
                    on_done: Callable[[RequestResult], None] | None = None,
                    t0: float | None = None) -> ReplayOutcome:
    """The open-loop schedule every replay shares, whatever carries the requests: one task per request sleeps
    until ``t0 + arrival_s`` (``t0``: now when None, on the monotonic clock) and then awaits ``send(index,
    request, t0)``, which must return the request's RequestResult even when cancelled mid-stream (marked
    ``interrupted``). `stop` being set cancels every task and returns what was measured: requests still waiting
    for their arrival are not in the results but counted in ``not_sent``."""
    stop = stop or asyncio.Event()
    start = time.monotonic() if t0 is None else t0

    async def at_arrival(index: int, req: TraceRequest) -> RequestResult:
        delay = start + req.arrival_s - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        return await send(index, req, start)

    tasks: list[asyncio.Task] = []
    try:
        for i, req in enumerate(trace):
            task = asyncio.ensure_future(at_arrival(i, req))
            if on_done is not None:
                task.add_done_callback(lambda t: t.cancelled() or on_done(t.result()))
            tasks.append(task)
        all_done = asyncio.ensure_future(asyncio.gather(*tasks, return_exceptions=True))
        stopper = asyncio.ensure_future(stop.wait())
        await asyncio.wait({all_done, stopper}, return_when=asyncio.FIRST_COMPLETED)
        interrupted = not all_done.done()
        stopper.cancel()
        end = time.monotonic()
        not_sent = 0
        if interrupted:
            not_sent = sum(1 for req in trace if start + req.arrival_s > end)
            for t in tasks:
                t.cancel()
        await asyncio.gather(all_done, return_exceptions=True)
        results = [t.result() for t in tasks if not t.cancelled()]  # a cancelled task was never sent
        return ReplayOutcome(results=results, duration_s=end - start, interrupted=interrupted, not_sent=not_sent)
    finally:
        for t in tasks:
            t.cancel()


async def replay(trace: Sequence[TraceRequest], address: str, *, admin_address: str | None = None, seed: int = 0,
                 timeout_s: float = 600.0, stop: asyncio.Event | None = None,
                 on_done: Callable[[RequestResult], None] | None = None,
                 sample_interval_s: float = SAMPLE_INTERVAL_S, request_prefix: str = "bench-",
                 creds: client.Credentials | None = None) -> ReplayOutcome:
    """Send every request at its arrival time and wait for all streams; `stop` being set interrupts the replay
    (in-flight streams are cancelled, which cancels them on the cluster) and returns what was measured."""
    await wait_reachable(address, creds=creds)
    t0 = time.monotonic()
    samples: list[ClusterSample] = []
    sampling_done = asyncio.Event()
    sampler = (asyncio.ensure_future(_sampler(admin_address, t0, samples, sampling_done, sample_interval_s,
                                                 creds))
               if admin_address else None)
    channels = [client.dispatcher_channel(address, creds) for _ in range(CHANNELS)]

    async def send(index: int, req: TraceRequest, start: float) -> RequestResult:
        return await _one(channels[index % CHANNELS], req, index, start, seed, timeout_s, request_prefix)

    try:
        outcome = await open_loop(trace, send, stop=stop, on_done=on_done, t0=t0)
        outcome.samples = samples
        return outcome
    finally:
        sampling_done.set()
        if sampler is not None:
            await asyncio.gather(sampler, return_exceptions=True)
        for ch in channels:
            await ch.close()


__all__ = ["ClusterSample", "ClusterUnreachable", "ReplayOutcome", "SendFn", "drop_periods", "open_loop", "prompt_ids", "replay",
           "sample_from_status", "wait_reachable", "PROMPT_TOKEN_RANGE"]
