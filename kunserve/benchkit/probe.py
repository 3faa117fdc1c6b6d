"""Measure what calibration needs from a running cluster: its undropped KV capacity (the workers' stats, through
the admin service) and one instance's prefill and decode speed (a few requests through the dispatcher).

The probe is short on purpose (about a second on a 2-core CPU): a warm-up request, a few lone prefills of the
trace's mean prompt length (TTFT = prefill time, queueing excluded), then ``concurrency`` requests per instance
with prompts of that length decoding together: about the number an instance holds when its KV memory is full
(the caller keeps it short of overloading the instance), with contexts of the trace's size, since that is the
regime the burst's requests run in (a decode step over 8 contexts of 200 tokens is ~40% slower than over 8 of 32
on the embedded model). Its requests carry the ids ``probe-<n>``, apart from the replay's ``bench-<n>``.
"""

from __future__ import annotations

import asyncio
import statistics
from dataclasses import dataclass

import grpc

from kunserve import client
from kunserve.benchkit.calibrate import Speeds
from kunserve.benchkit.replay import prompt_ids, wait_reachable
from kunserve.v1 import admin_pb2_grpc, common_pb2

PREFILL_RUNS = 3
MAX_CONCURRENCY = 16  # per instance
STATS_WAIT_S = 10.0
PROBE_TIMEOUT_S = 300.0
_PROBE_INDEX = 1_000_000  # prompt seeds apart from the replay's (index = position in the trace)


class ProbeError(RuntimeError):
    """The cluster did not give what calibration needs (one line, for the CLI)."""


@dataclass(frozen=True)
class Capacity:
    """The cluster's KV capacity with every worker holding every layer (its undropped capacity)."""

    tokens: int
    workers: int
    block_size: int

    @property
    def per_instance_tokens(self) -> int:
        return self.tokens // max(1, self.workers)

    def to_dict(self) -> dict[str, int]:
        return {"tokens": self.tokens, "workers": self.workers, "block_size": self.block_size}


async def cluster_capacity(admin_address: str, creds: client.Credentials | None, *, workers: int | None,
                           wait_s: float = STATS_WAIT_S) -> Capacity:
    """Sum over the workers of ``kv_blocks_undropped x block_size`` (``kv_blocks_total`` for a worker that does not
    report it), once ``workers`` of them (None: any) have reported; ProbeError after ``wait_s`` without them."""
    want = max(1, workers or 0)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    seen = 0
    async with client.admin_channel(admin_address, creds) as ch:
        stub = admin_pb2_grpc.AdminStub(ch)
        while True:
            try:
                status = await stub.GetStatus(common_pb2.Empty(), timeout=2.0)
            except grpc.aio.AioRpcError as exc:
                raise ProbeError(f"the admin service at {admin_address} did not answer: {exc.code().name}") from None
            stats = [ws.stats for ws in status.cluster.workers if ws.stats.kv_blocks_total > 0]
            seen = len(stats)
            if seen >= want:
                tokens = sum((s.kv_blocks_undropped or s.kv_blocks_total) * s.block_size for s in stats)
                return Capacity(tokens=tokens, workers=seen, block_size=stats[0].block_size)
            if loop.time() > deadline:
                raise ProbeError(f"only {seen} of {want} workers reported KV stats within {wait_s:g} s")
            await asyncio.sleep(0.2)


async def _one(ch: grpc.aio.Channel, index: int, prompt_tokens: int, max_tokens: int, seed: int) -> client.GenerationResult:
    request = client.make_request(prompt_ids(_PROBE_INDEX + index, prompt_tokens, seed), request_id=f"probe-{index}",
                                  max_tokens=max_tokens, ignore_eos=True)
    try:
        res = await client.generate(ch, request, timeout=PROBE_TIMEOUT_S)
    except grpc.aio.AioRpcError as exc:
        raise ProbeError(f"probe request failed: {exc.code().name}: {exc.details()}") from None
    if res.ttft_s is None or len(res.token_times_s) < max_tokens:
        raise ProbeError(f"probe request ended after {len(res.token_times_s)} of {max_tokens} tokens "
                         f"({res.finish_reason or 'no finish reason'})")
    return res


async def probe_speeds(address: str, creds: client.Credentials | None, *, prompt_tokens: int, concurrency: int,
                       workers: int, seed: int = 0, decode_tokens: int = 32) -> Speeds:
    """One instance's speeds: the median TTFT of PREFILL_RUNS lone ``prompt_tokens`` prefills (after a warm-up),
    and the median TPOT of ``concurrency x workers`` requests of ``prompt_tokens`` decoding ``decode_tokens`` each
    at once (the dispatcher spreads them over the instances)."""
    k = max(1, min(MAX_CONCURRENCY, concurrency))
    await wait_reachable(address, creds=creds)
    async with client.dispatcher_channel(address, creds) as ch:
        await _one(ch, 0, prompt_tokens, 1, seed)
        ttfts = []
        for i in range(1, PREFILL_RUNS + 1):
            ttfts.append((await _one(ch, i, prompt_tokens, 1, seed)).ttft_s or 0.0)
        batch = await asyncio.gather(*(_one(ch, PREFILL_RUNS + 1 + j, prompt_tokens, decode_tokens, seed)
                                       for j in range(k * max(1, workers))))
    tpots = [r.mean_tpot_s for r in batch if r.mean_tpot_s]
    if not tpots or min(ttfts) <= 0:
        raise ProbeError("the probe measured no prefill or no decode time")
    return Speeds(prefill_tokens_per_s=prompt_tokens / statistics.median(ttfts), tpot_s=statistics.median(tpots),
                  concurrency=k, source="probe")


__all__ = ["Capacity", "ProbeError", "cluster_capacity", "probe_speeds"]
