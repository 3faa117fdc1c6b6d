"""Logprobs (OpenAI `logprobs`): per generated token, the log-softmax of the model's raw logits at the chosen
token and at the N most likely tokens, equal to the dense reference's; asking for them never changes a token
(greedy or seeded sampling, whole instance or pipeline group); the bound is validated naming the field."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from engine_testing import one_torch_thread, run_events, weights_for  # noqa: F401 - fixture

from kunserve.shared.engine.api import MAX_LOGPROBS, EngineRequest, InvalidRequest, SamplingParams, TokenEvent
from kunserve.shared.engine.engine import Engine, SchedulerConfig
from kunserve.shared.engine.local_link import local_group
from kunserve.shared.engine.sampler import sample_rows, token_logprobs
from kunserve.shared.model.architecture import TINY_CONFIG
from kunserve.shared.model.reference import reference_logits

CFG = TINY_CONFIG.replace(num_layers=2, name="two")
SCHED = SchedulerConfig(max_num_batched_tokens=32)  # long prompts prefill in chunks, batched with decodes
TOL = 2e-4  # paged, batched float32 forward vs the dense reference


def _requests(logprobs: dict[str, int | None]) -> list[EngineRequest]:
    """Greedy and seeded sampled requests (temperature, top-k, top-p) of different prompt lengths."""
    spec = {
        "g0": ([5, 6, 7], SamplingParams(max_tokens=6, ignore_eos=True)),
        "g1": (list(range(300, 370)), SamplingParams(max_tokens=5, ignore_eos=True)),
        "s2": (list(range(1000, 1040)), SamplingParams(max_tokens=6, temperature=0.8, top_k=40, top_p=0.9, seed=3,
                                                       ignore_eos=True)),
        "s3": ([9, 8], SamplingParams(max_tokens=4, temperature=1.5, seed=11, ignore_eos=True)),
    }
    return [EngineRequest(rid, prompt, dataclasses.replace(p, logprobs=logprobs.get(rid)))
            for rid, (prompt, p) in spec.items()]


def _whole() -> Engine:
    return Engine(CFG, weights_for(CFG), num_kv_blocks=64, block_size=8, scheduler_config=SCHED)


ASKED = {"g0": 5, "g1": 0, "s2": MAX_LOGPROBS}  # s3 asks for none


def _check_against_reference(req: EngineRequest, events: list[TokenEvent]) -> None:
    """Each event's logprobs equal torch.log_softmax of the reference's logits at that position (teacher-forced
    on the tokens the engine produced: one dense forward)."""
    prompt, gen = req.prompt_token_ids, [e.token_id for e in events]
    ref = torch.log_softmax(reference_logits(CFG, weights_for(CFG), prompt + gen[:-1])[len(prompt) - 1:], dim=-1)
    n = req.sampling.logprobs
    assert n is not None
    for i, ev in enumerate(events):
        assert ev.logprob is not None
        assert ev.logprob == pytest.approx(float(ref[i, ev.token_id]), abs=TOL)
        assert len(ev.top_logprobs) == n
        values = [t.logprob for t in ev.top_logprobs]
        assert values == sorted(values, reverse=True)
        # the reference's top-N values, and each id's own reference logprob (robust to near-ties swapping ids)
        assert values == pytest.approx(torch.topk(ref[i], n).values.tolist(), abs=TOL)
        for t in ev.top_logprobs:
            assert t.logprob == pytest.approx(float(ref[i, t.token_id]), abs=TOL)
        assert len({t.token_id for t in ev.top_logprobs}) == n


def test_logprobs_match_the_reference_log_softmax():
    events = run_events(_whole(), _requests(ASKED))
    for req in _requests(ASKED):
        if req.sampling.logprobs is not None:
            _check_against_reference(req, events[req.request_id])
    assert all(e.logprob is None and e.top_logprobs == () for e in events["s3"])
    # raw logprobs: the greedy pick is the top-1, and its logprob is the top-1's
    for ev in events["g0"]:
        assert ev.top_logprobs[0].token_id == ev.token_id and ev.top_logprobs[0].logprob == ev.logprob


def test_tokens_are_identical_with_and_without_logprobs():
    plain = run_events(_whole(), _requests({}))
    asked = run_events(_whole(), _requests({"g0": MAX_LOGPROBS, "g1": 3, "s2": 0, "s3": 7}))
    assert {r: [e.token_id for e in evs] for r, evs in asked.items()} == \
        {r: [e.token_id for e in evs] for r, evs in plain.items()}
    assert {r: [e.finish_reason for e in evs] for r, evs in asked.items()} == \
        {r: [e.finish_reason for e in evs] for r, evs in plain.items()}
    assert all(e.logprob is None for evs in plain.values() for e in evs)


def test_a_pipeline_group_carries_the_same_logprobs():
    """The group's last stage sends float32 logits back (serialized as between workers); the head samples."""
    whole = run_events(_whole(), _requests(ASKED))
    head, link = local_group(CFG, weights_for(CFG), [(0, 1), (1, 2)], num_kv_blocks=64, block_size=8,
                             scheduler_config=SCHED, wire=True)
    with link:
        group = run_events(head, _requests(ASKED))
    assert {r: [e.token_id for e in evs] for r, evs in group.items()} == \
        {r: [e.token_id for e in evs] for r, evs in whole.items()}
    for rid, evs in group.items():
        for g, w in zip(evs, whole[rid]):
            if w.logprob is None:
                assert g.logprob is None and g.top_logprobs == ()
                continue
            assert g.logprob == pytest.approx(w.logprob, abs=TOL)
            assert [t.logprob for t in g.top_logprobs] == pytest.approx([t.logprob for t in w.top_logprobs], abs=TOL)


def test_rows_that_did_not_ask_cost_nothing(monkeypatch):
    logits = torch.randn(3, 50)
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=1), SamplingParams()]
    gens = [None, torch.Generator().manual_seed(1), None]
    tokens = sample_rows(logits, params, gens)

    def boom(*a: object, **k: object) -> torch.Tensor:
        raise AssertionError("log_softmax computed for a batch where no request asked for logprobs")

    monkeypatch.setattr(torch, "log_softmax", boom)
    assert token_logprobs(logits, params, tokens) == [None, None, None]


def test_only_the_rows_that_asked_and_produced_a_token_get_logprobs():
    logits = torch.randn(4, 50)
    logits[2, 7] = float("nan")  # cannot be sampled: the engine fails that request, no logprobs for it
    params = [SamplingParams(logprobs=2), SamplingParams(), SamplingParams(logprobs=4), SamplingParams(logprobs=0)]
    tokens = sample_rows(logits, params, [None] * 4)
    assert tokens[2] is None
    got = token_logprobs(logits, params, tokens)
    assert got[1] is None and got[2] is None
    ref = torch.log_softmax(logits, dim=-1)
    for i, n in [(0, 2), (3, 0)]:
        entry = got[i]
        assert entry is not None
        chosen, top = entry
        assert chosen == pytest.approx(float(ref[i, tokens[i]]))
        assert [t.token_id for t in top] == torch.topk(ref[i], n).indices.tolist()[:n]
        assert [t.logprob for t in top] == pytest.approx(torch.topk(ref[i], n).values.tolist()[:n])


def test_more_alternatives_than_the_vocabulary_is_all_of_it():
    logits = torch.randn(1, 8)
    entry = token_logprobs(logits, [SamplingParams(logprobs=MAX_LOGPROBS)], [3])[0]
    assert entry is not None and len(entry[1]) == 8


@pytest.mark.parametrize("n", [-1, MAX_LOGPROBS + 1, 1000])
def test_the_bound_is_validated_naming_the_field(n):
    with pytest.raises(InvalidRequest) as e:
        _whole().add_request(EngineRequest("v", [1], SamplingParams(logprobs=n)))
    assert e.value.field == "sampling.logprobs"
    assert "sampling.logprobs" in str(e.value) and str(MAX_LOGPROBS) in str(e.value)


@pytest.mark.parametrize("n", [None, 0, MAX_LOGPROBS])
def test_the_bound_admits(n):
    SamplingParams(logprobs=n).validate(CFG.vocab_size)
