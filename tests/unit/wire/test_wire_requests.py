"""Request wire conversions: sampling parameters survive the round trip (logprobs unset stays unset, 0 stays 0),
and a token event's logprobs fill the worker's and the client's event messages alike."""

from __future__ import annotations

import pytest

from kunserve.shared.engine.api import SamplingParams, TokenEvent, TokenLogprob
from kunserve.shared.wire.requests import logprobs_to_pb, sampling_from_pb, sampling_to_pb
from kunserve.v1 import common_pb2, generation_pb2, worker_pb2


@pytest.mark.parametrize("p", [
    SamplingParams(),
    # float values exact in float32 (the proto's float fields)
    SamplingParams(max_tokens=7, temperature=0.5, top_k=3, top_p=0.75, seed=4, stop_token_ids=(1, 2), ignore_eos=True),
    SamplingParams(logprobs=0),
    SamplingParams(logprobs=20, temperature=1.0, seed=1),
])
def test_sampling_round_trip(p):
    assert sampling_from_pb(sampling_to_pb(p)) == p


def test_logprobs_unset_and_zero_differ_on_the_wire():
    assert sampling_from_pb(common_pb2.SamplingParams()).logprobs is None
    assert sampling_from_pb(common_pb2.SamplingParams(logprobs=0)).logprobs == 0
    assert not sampling_to_pb(SamplingParams()).HasField("logprobs")
    assert sampling_to_pb(SamplingParams(logprobs=0)).HasField("logprobs")


@pytest.mark.parametrize("msg_type", [worker_pb2.WorkerTokenEvent, generation_pb2.GenerateEvent])
def test_token_event_logprobs_fill_the_message(msg_type):
    ev = TokenEvent("r", 9, 0, logprob=-0.25, top_logprobs=(TokenLogprob(9, -0.25), TokenLogprob(4, -1.5)))
    msg = msg_type()
    logprobs_to_pb(ev, msg)
    assert msg.HasField("logprob") and msg.logprob == -0.25
    assert [(t.token_id, t.logprob) for t in msg.top_logprobs] == [(9, -0.25), (4, -1.5)]
    chosen_only = msg_type()
    logprobs_to_pb(TokenEvent("r", 9, 0, logprob=0.0), chosen_only)
    assert chosen_only.HasField("logprob") and chosen_only.logprob == 0.0 and not chosen_only.top_logprobs
    none = msg_type()
    logprobs_to_pb(TokenEvent("r", 9, 0), none)
    assert not none.HasField("logprob") and not none.top_logprobs


@pytest.mark.parametrize("offline", [False, True])
def test_the_request_class_survives_a_transition_snapshot(offline):
    from kunserve.shared.engine.api import EngineRequest, SeqSnapshot
    from kunserve.shared.wire.transitions import snapshot_from_pb, snapshot_to_pb

    snap = SeqSnapshot(EngineRequest("r", [1, 2], SamplingParams(), 10.0, offline=offline), [3], 2, [0], b"", 0)
    back = snapshot_from_pb(snapshot_to_pb(snap, "w0", now=12.0), now=12.0)
    assert back.request.offline is offline
