"""What the drop / restore integration tests share: seeded prompts, a greedy generation that reports its progress,
waiting for mid-decode, a pair drop, and the reference check of every result."""

from __future__ import annotations

import asyncio
import contextlib
import random

import grpc
from helpers import admin_channel, check_against_reference

from kunserve import client
from kunserve.cli.launcher import LocalCluster
from kunserve.v1 import memory_manager_pb2, memory_manager_pb2_grpc


def prompts_for(n: int, seed: int, lo: int = 8, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 4000) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


@contextlib.asynccontextmanager
async def memory_manager(c: LocalCluster):
    """A MemoryManager stub on a channel that is closed afterwards."""
    async with admin_channel(c) as ch:
        yield memory_manager_pb2_grpc.MemoryManagerStub(ch)


async def generate_all(c: LocalCluster, prompts, max_tokens: int, progress: dict):
    """Greedy generations of every prompt at once; progress[i] counts request i's tokens as they arrive."""
    return await generate_until(c, prompts, max_tokens, progress, asyncio.Event())


async def generate_until(c: LocalCluster, prompts, budget: int, progress: dict, stop: asyncio.Event):
    """Greedy generations of every prompt at once (progress[i] counts request i's tokens), with a token budget the
    requests do not reach while the test takes its steps, however slow the machine: once `stop` is set, those still
    running are cancelled on the connection that sent them. The results in order (a cancelled request's: the tokens it
    had, finish reason "aborted"); `check_prefixes` checks them."""
    async with client.insecure_channel(c.cfg.dispatcher.address) as ch:
        async def one(i, p):
            def seen(ev):
                progress[i] = progress.get(i, 0) + (ev.token_id >= 0)
            return await client.generate(ch, client.make_request(p, request_id=f"r{i}", max_tokens=budget),
                                         timeout=240, on_event=seen)

        async def cancel_on_stop() -> None:
            await stop.wait()
            for i in range(len(prompts)):
                try:
                    await client.cancel(ch, f"r{i}")
                except grpc.aio.AioRpcError as exc:  # it finished before the cancel: nothing to stop
                    assert exc.code() == grpc.StatusCode.NOT_FOUND, exc

        canceller = asyncio.create_task(cancel_on_stop())
        try:
            return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        finally:
            canceller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await canceller


def check_prefixes(prompts, results, budget: int) -> None:
    """Every token each request had when it was cancelled (or all `budget` of them) is the reference's."""
    for p, r in zip(prompts, results):
        assert r.finish_reason == "aborted" or len(r.token_ids) == budget, r
        check_against_reference(p, r.token_ids, len(r.token_ids))


async def wait_tokens(progress: dict, n: int, at_least: int, gen: asyncio.Task, timeout: float = 120,
                      since: dict | None = None) -> None:
    """Until n requests produced at_least tokens (counting from the `since` snapshot). Fails at once when the
    generation `gen` has already ended: the step the test is about would then not be mid-decode."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    since = since or {}
    while sum(1 for k, v in progress.items() if v - since.get(k, 0) >= at_least) < n:
        if gen.done():
            gen.result()  # a generation that failed raises its own error here
            raise AssertionError(f"the requests ended before the test's step: {progress} (since {since})")
        assert loop.time() < end, f"requests made no progress: {progress} (since {since})"
        await asyncio.sleep(0.05)


async def start_decoding(c: LocalCluster, prompts, max_tokens: int, progress: dict, at_least: int = 2) -> asyncio.Task:
    """Stream every prompt (progress[i] counts request i's tokens) and return once each has at_least tokens: the
    requests hold KV, so a transition now moves all of them. The task gives the results."""
    gen = asyncio.create_task(generate_all(c, prompts, max_tokens, progress))
    await wait_tokens(progress, len(prompts), at_least, gen)
    return gen


async def drop_pair(c: LocalCluster, head: str = "worker-0", stage: str = "worker-1"):
    async with memory_manager(c) as mm:
        return await mm.Drop(memory_manager_pb2.DropRequest(groups=[
            memory_manager_pb2.GroupMembers(worker_ids=[head, stage])], reason="manual"), timeout=120)


async def drop_then_kill(c: LocalCluster, prompts, budget: int, victim: str):
    """Stream every prompt with a budget it does not reach (`generate_until`), drop worker-0 + worker-1 into a pair
    mid-decode, kill `victim` while the pair decodes, and cancel the requests once each has decoded past the kill:
    the results of every request (`check_prefixes` checks them)."""
    progress: dict = {}
    stop = asyncio.Event()
    gen = asyncio.create_task(generate_until(c, prompts, budget, progress, stop))
    await wait_tokens(progress, len(prompts), 2, gen)
    drop = await drop_pair(c)
    assert drop.completed, drop.error
    await wait_tokens(progress, 2, 2, gen, since=dict(progress))
    c.kill(victim)
    await wait_tokens(progress, len(prompts), 2, gen, since=dict(progress))  # every request lives on after it
    stop.set()
    return await gen


def check_all(prompts, results, max_tokens: int) -> None:
    for p, r in zip(prompts, results):
        check_against_reference(p, r.token_ids, max_tokens)
