"""One request must never take an engine down (issue 12, defect 1).

* Sampling is numerically safe: no finite logits and no valid sampling parameters may give a non-finite
  probability (the defect: temperature = 1e-40 overflowed logits / T, softmax gave NaN, multinomial
  raised, the engine thread died). Checked as a property over the whole parameter space.
* A request whose computation does fail (non-finite logits for its row, or a forward pass that raises;
  injected here, the only way to make a correct model fail) ends alone with an ERROR event; the others
  keep their reference tokens and the engine keeps serving. Only an engine whose batches keep failing
  stops (so its worker can report NOT_SERVING).
"""

from __future__ import annotations

import threading

import pytest
import torch
from engine_testing import one_torch_thread, weights_for  # noqa: F401 - fixture
from hypothesis import given, settings
from hypothesis import strategies as st

from kunserve.shared.engine.api import EngineRequest, FinishReason, InvalidRequest, SamplingParams, TokenEvent
from kunserve.shared.engine.engine import Engine
from kunserve.shared.engine.loop import MAX_FAILED_STEPS, EngineBroken, EngineLoop, EngineStopped
from kunserve.shared.engine.sampler import SamplingFailed, probabilities, sample, sample_rows
from kunserve.shared.model.architecture import TINY_CONFIG

CFG = TINY_CONFIG.replace(num_layers=1, name="one")
TIMEOUT = 30.0
F32_MAX = float(torch.finfo(torch.float32).max)

finite_f32 = st.floats(min_value=-F32_MAX, max_value=F32_MAX, allow_nan=False, allow_infinity=False, width=32)
temperatures = st.one_of(
    st.floats(min_value=0.0, max_value=F32_MAX, allow_nan=False, allow_infinity=False, exclude_min=True),
    st.sampled_from([1e-40, 1e-45, 5e-324, 1e-300, 1e-38, 1.0, 1e38, 1e300]),
)
top_ps = st.one_of(st.floats(min_value=0.0, max_value=1.0, exclude_min=True), st.sampled_from([1e-30, 1e-7, 1.0]))


@settings(max_examples=300, deadline=None)
@given(logits=st.lists(finite_f32, min_size=1, max_size=40), temperature=temperatures,
       top_k=st.integers(min_value=0, max_value=50), top_p=top_ps)
def test_no_finite_input_gives_a_non_finite_probability(logits, temperature, top_k, top_p):
    p = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    p.validate(vocab_size=len(logits))
    probs = probabilities(torch.tensor(logits, dtype=torch.float32), p)
    assert torch.isfinite(probs).all() and (probs >= 0).all()
    assert abs(float(probs.sum()) - 1.0) < 1e-4
    plain = probabilities(torch.tensor(logits, dtype=torch.float32), SamplingParams(temperature=temperature))
    assert (plain[probs > 0] == plain.max()).any()  # a most likely token always survives top-k / top-p
    tok = sample(torch.tensor([logits], dtype=torch.float32), [p], [torch.Generator().manual_seed(0)])[0]
    assert 0 <= tok < len(logits) and probs[tok] > 0


@pytest.mark.parametrize("temperature", [1e-40, 1e-45, 5e-324, 1e-30])
def test_a_tiny_temperature_is_greedy(temperature):
    logits = torch.randn(4, 300) * 30
    params = [SamplingParams(temperature=temperature, seed=i) for i in range(4)]
    got = sample(logits, params, [torch.Generator().manual_seed(i) for i in range(4)])
    assert got == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("temperature", [float("inf"), float("-inf"), float("nan"), -1e-40])
def test_non_finite_or_negative_temperature_is_refused(temperature):
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(temperature=temperature).validate(10)
    assert e.value.field == "temperature"


def test_a_row_with_non_finite_logits_fails_alone():
    logits = torch.randn(3, 20)
    logits[1, 4] = float("nan")
    rows = sample_rows(logits, [SamplingParams(), SamplingParams(), SamplingParams(temperature=1.0, seed=1)],
                       [None, None, torch.Generator().manual_seed(1)])
    assert rows[0] == int(logits[0].argmax()) and rows[1] is None and isinstance(rows[2], int)
    with pytest.raises(SamplingFailed, match="row 1"):
        sample(logits, [SamplingParams()] * 3, [None] * 3)


def _reference(prompts: dict[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
    eng = Engine(CFG, weights_for(CFG), num_kv_blocks=64, block_size=8)
    return eng.generate([EngineRequest(r, p, SamplingParams(max_tokens=max_tokens)) for r, p in prompts.items()])


POISON = 4000  # a token id only the poisoned request's prompt holds


def _poison_rows(engine: Engine, mode: str) -> None:
    """Injected fault: the batch holding the poisoned prompt gets NaN logits for that request's row
    ("nan"), or its forward pass raises ("raise")."""
    real = engine.runner.forward

    def forward(ids, positions, kv, meta, rows):
        out = real(ids, positions, kv, meta, rows)
        if POISON in ids.tolist():
            if mode == "raise":
                raise RuntimeError("injected fault in the forward pass")
            picked = ids if rows is None else ids[rows]
            out = out.clone()
            out[picked == POISON] = float("nan")
        return out

    engine.runner.forward = forward  # type: ignore[method-assign]


def test_nan_logits_fail_that_request_and_its_batch_mates_keep_their_tokens():
    prompts = {"a": [5, 6, 7], "b": [9, 10, 11, 12]}
    ref = _reference(prompts, 6)
    eng = Engine(CFG, weights_for(CFG), num_kv_blocks=64, block_size=8)
    _poison_rows(eng, "nan")
    for rid, prompt in prompts.items():
        eng.add_request(EngineRequest(rid, prompt, SamplingParams(max_tokens=6)))
    eng.add_request(EngineRequest("poison", [3, POISON], SamplingParams(max_tokens=6)))
    events: list[TokenEvent] = []
    while eng.has_work():
        events += eng.step()
    bad = [e for e in events if e.request_id == "poison"]
    assert len(bad) == 1 and bad[0].finish_reason is FinishReason.ERROR and "non-finite logits" in bad[0].error
    for rid in prompts:
        assert [e.token_id for e in events if e.request_id == rid] == ref[rid]
    assert eng.allocator.num_used == 0


class Collector:
    def __init__(self) -> None:
        self.events: list[TokenEvent] = []
        self.done = threading.Event()

    def __call__(self, ev: TokenEvent) -> None:
        self.events.append(ev)
        if ev.finished:
            self.done.set()


def test_a_forward_that_raises_fails_its_batch_and_the_loop_goes_on():
    ref = _reference({"next": [5, 6, 7]}, 5)
    eng = Engine(CFG, weights_for(CFG), num_kv_blocks=64, block_size=8)
    _poison_rows(eng, "raise")
    lp = EngineLoop(eng, num_threads=1)
    lp.start()
    try:
        bad = Collector()
        lp.submit(EngineRequest("poison", [3, POISON], SamplingParams(max_tokens=4)), bad)
        assert bad.done.wait(TIMEOUT)
        assert bad.events[-1].finish_reason is FinishReason.ERROR and "injected fault" in bad.events[-1].error
        good = Collector()
        lp.submit(EngineRequest("next", [5, 6, 7], SamplingParams(max_tokens=5)), good)
        assert good.done.wait(TIMEOUT)
        assert [e.token_id for e in good.events] == ref["next"]
        assert lp.running and lp.error is None and eng.consecutive_failed_steps == 0
    finally:
        lp.stop(timeout=TIMEOUT)


def test_an_engine_whose_batches_keep_failing_stops_with_the_reason():
    eng = Engine(CFG, weights_for(CFG), num_kv_blocks=256, block_size=8)
    _poison_rows(eng, "raise")
    lp = EngineLoop(eng, num_threads=1)
    lp.start()
    try:
        collectors = []
        for i in range(MAX_FAILED_STEPS):
            c = Collector()
            lp.submit(EngineRequest(f"p{i}", [3, POISON], SamplingParams(max_tokens=2)), c)
            assert c.done.wait(TIMEOUT)  # one at a time: each step's batch is one poisoned request
            collectors.append(c)
        assert all(c.events[-1].finish_reason is FinishReason.ERROR for c in collectors)
        lp._thread.join(TIMEOUT)  # type: ignore[union-attr]
        assert not lp.running and isinstance(lp.error, EngineBroken)
        with pytest.raises(EngineStopped, match="failed"):
            lp.submit(EngineRequest("late", [5]), Collector())
    finally:
        lp.stop(timeout=TIMEOUT)
