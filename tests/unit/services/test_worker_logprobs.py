"""The worker's token stream carries logprobs: a request that asked for sampling.logprobs gets `logprob` and
`top_logprobs` on every WorkerTokenEvent (what the engine computed, sorted descending); one that did not gets
neither (logprob unset); an out-of-range ask is INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from engine_testing import one_torch_thread  # noqa: F401 - fixture
from worker_servicer_fakes import Aborted, Context, Instance

from kunserve.services.worker.servicer import WorkerIdentity, WorkerServicer
from kunserve.shared.engine.api import EngineRequest, SamplingParams, TokenEvent
from kunserve.shared.engine.engine import Engine
from kunserve.shared.engine.loop import EngineLoop
from kunserve.shared.model.architecture import TINY_CONFIG
from kunserve.shared.model.weights import random_weights
from kunserve.v1 import common_pb2, worker_pb2

CFG = TINY_CONFIG.replace(num_layers=1, name="one")
W = random_weights(CFG, 0)
PROMPT = [5, 6, 7]





def _engine() -> Engine:
    return Engine(CFG, W, num_kv_blocks=64, block_size=8)


def _engine_events(p: SamplingParams) -> list[TokenEvent]:
    """The same request on an engine of its own: what the stream must carry."""
    eng = _engine()
    eng.add_request(EngineRequest("x", PROMPT, p))
    out: list[TokenEvent] = []
    while eng.has_work():
        out += eng.step()
    return out


async def _stream(servicer: WorkerServicer, rid: str, sampling: common_pb2.SamplingParams) -> list[worker_pb2.WorkerTokenEvent]:
    req = worker_pb2.WorkerGenerateRequest(request_id=rid, prompt_token_ids=PROMPT, sampling=sampling)
    return [ev async for ev in servicer.Generate(req, Context())]


def test_token_events_carry_the_engines_logprobs():
    expected = _engine_events(SamplingParams(max_tokens=4, logprobs=3))
    loop = EngineLoop(_engine())
    loop.start()
    servicer = WorkerServicer(WorkerIdentity("w", "127.0.0.1:1", "one", 1, CFG.vocab_size, 2048, "cpu", "float32"),
                              loop, Instance())

    async def scenario() -> tuple[list[worker_pb2.WorkerTokenEvent], list[worker_pb2.WorkerTokenEvent]]:
        return await asyncio.gather(_stream(servicer, "lp", common_pb2.SamplingParams(max_tokens=4, logprobs=3)),
                                    _stream(servicer, "plain", common_pb2.SamplingParams(max_tokens=4)))

    try:
        asked, plain = asyncio.run(scenario())
        with pytest.raises(Aborted) as e:
            asyncio.run(_stream(servicer, "bad", common_pb2.SamplingParams(max_tokens=4, logprobs=21)))
    finally:
        assert loop.stop(5.0)
    assert e.value.code is grpc.StatusCode.INVALID_ARGUMENT and "sampling.logprobs" in e.value.details
    assert [ev.token_id for ev in asked] == [ev.token_id for ev in plain] == [ev.token_id for ev in expected]
    assert asked[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    for got, want in zip(asked, expected):
        assert got.HasField("logprob") and want.logprob is not None
        # batched with another request here, alone there: float32 sums in another order
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [t.token_id for t in got.top_logprobs] == [t.token_id for t in want.top_logprobs]
        assert [t.logprob for t in got.top_logprobs] == pytest.approx([t.logprob for t in want.top_logprobs], abs=1e-4)
        assert len(got.top_logprobs) == 3
    assert not any(ev.HasField("logprob") or ev.top_logprobs for ev in plain)

