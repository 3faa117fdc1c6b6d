"""min_tokens (vLLM's and OpenAI-compatible servers' extra field): a request short of its minimum cannot end, so
the ids that would end it (EOS unless ignore_eos, its stop ids) are never sampled before then; past it, they end
it as usual. Other rows of the batch, and the logprobs, are untouched; the bound is validated."""

from __future__ import annotations

import pytest
from engine_testing import one_torch_thread, run_events, weights_for  # noqa: F401 - fixture

from kunserve.shared.engine.api import EngineRequest, FinishReason, InvalidRequest, SamplingParams, TokenEvent
from kunserve.shared.engine.engine import Engine, SchedulerConfig
from kunserve.shared.model.architecture import TINY_CONFIG

CFG = TINY_CONFIG.replace(num_layers=2, name="two")
PROMPT = [5, 6, 7]


def _engine(cfg=CFG) -> Engine:
    return Engine(cfg, weights_for(CFG), num_kv_blocks=64, block_size=8,
                  scheduler_config=SchedulerConfig(max_num_batched_tokens=32))


def _run(*reqs: EngineRequest) -> dict[str, list[TokenEvent]]:
    return run_events(_engine(), list(reqs))


def test_stop_ids_and_eos_cannot_end_a_request_before_min_tokens():
    free = _run(EngineRequest("free", PROMPT, SamplingParams(max_tokens=8, ignore_eos=True)))["free"]
    greedy = [e.token_id for e in free]
    # Stop on the token greedy decoding produces first, and on the one it produces third.
    stops = (greedy[0], greedy[2])
    out = _run(EngineRequest("plain", PROMPT, SamplingParams(max_tokens=8, stop_token_ids=stops, ignore_eos=True)),
               EngineRequest("min", PROMPT, SamplingParams(max_tokens=8, stop_token_ids=stops, ignore_eos=True,
                                                           min_tokens=4, logprobs=0)),
               EngineRequest("other", PROMPT, SamplingParams(max_tokens=8, ignore_eos=True)))
    assert [e.token_id for e in out["plain"]] == greedy[:1] and out["plain"][-1].finish_reason is FinishReason.STOP
    assert [e.token_id for e in out["other"]] == greedy, "a row without min_tokens is untouched by its neighbour's"
    held = out["min"]
    assert len(held) >= 4 and all(e.token_id not in stops for e in held[:4])
    assert held[0].token_id != greedy[0]  # the arg-max was a stop id: the next most likely token instead
    # logprobs are the raw model's: the banned arg-max is still the most likely token in them
    assert held[0].logprob is not None and held[0].top_logprobs == ()
    assert held[-1].finish_reason in (FinishReason.STOP, FinishReason.LENGTH)


def test_eos_is_held_back_unless_ignore_eos():
    free = [e.token_id for e in _run(EngineRequest("f", PROMPT, SamplingParams(max_tokens=1, ignore_eos=True)))["f"]]
    # a model whose greedy first token is its EOS: the request would end at once without min_tokens
    cfg_eos = CFG.replace(eos_token_id=free[0])
    out = run_events(_engine(cfg_eos), [EngineRequest("ends", PROMPT, SamplingParams(max_tokens=6)),
                                        EngineRequest("held", PROMPT, SamplingParams(max_tokens=6, min_tokens=3))])
    assert [e.finish_reason for e in out["ends"]] == [FinishReason.EOS]
    assert len(out["held"]) >= 3 and all(e.token_id != free[0] for e in out["held"][:3])


@pytest.mark.parametrize("bad", [-1, 9])
def test_min_tokens_must_be_within_max_tokens(bad):
    with pytest.raises(InvalidRequest, match=r"min_tokens: must be in \[0, max_tokens = 8\]"):
        SamplingParams(max_tokens=8, min_tokens=bad).validate(CFG.vocab_size)
