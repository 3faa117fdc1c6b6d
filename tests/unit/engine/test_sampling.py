"""Sampling: greedy, temperature / top-k / top-p with per-request seeded generators, stop conditions,
and request validation that names the offending field."""

from __future__ import annotations

import pytest
import torch
from engine_testing import one_torch_thread  # noqa: F401 - fixture

from kunserve.shared.engine.api import EngineRequest, FinishReason, InvalidRequest, SamplingParams
from kunserve.shared.engine.engine import Engine
from kunserve.shared.engine.sampler import sample
from kunserve.shared.model.architecture import TINY_CONFIG
from kunserve.shared.model.weights import random_weights

CFG = TINY_CONFIG.replace(num_layers=1, name="one")
W = random_weights(CFG, 0)


def engine(**kw):
    return Engine(CFG, W, num_kv_blocks=kw.pop("blocks", 64), block_size=8, **kw)


def test_seed_is_reproducible_regardless_of_batch():
    p = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=42)
    alone = engine().generate([EngineRequest("x", [1, 2, 3], p)])["x"]
    others = [EngineRequest(f"o{i}", [9, i + 1], SamplingParams(max_tokens=7, temperature=0.7, seed=i)) for i in range(4)]
    batched = engine().generate([*others, EngineRequest("x", [1, 2, 3], p)])["x"]
    assert alone == batched
    different = engine().generate([EngineRequest("x", [1, 2, 3], SamplingParams(max_tokens=10, temperature=1.0,
                                                                                 top_p=0.9, seed=43))])["x"]
    assert different != alone


def test_seeded_rows_do_not_depend_on_their_neighbours():
    logits = torch.randn(3, 50)
    p = SamplingParams(temperature=1.3, top_k=20, top_p=0.8, seed=7)
    alone = sample(logits[1:2], [p], [torch.Generator().manual_seed(7)])
    mixed = sample(logits, [SamplingParams(), p, SamplingParams(temperature=1.0, seed=1)],
                   [None, torch.Generator().manual_seed(7), torch.Generator().manual_seed(1)])
    assert mixed[1] == alone[0] and mixed[0] == int(logits[0].argmax())


def test_top_p_and_top_k_restrict_the_support():
    logits = torch.tensor([[5.0, 4.0, 0.0, -1.0, -2.0]])
    g = torch.Generator().manual_seed(0)
    seen = {sample(logits, [SamplingParams(temperature=1.0, top_p=0.5)], [g])[0] for _ in range(50)}
    assert seen == {0}  # p(0) ~ 0.71 >= 0.5: the nucleus is token 0 alone
    seen = {sample(logits, [SamplingParams(temperature=1.0, top_k=2)], [g])[0] for _ in range(200)}
    assert seen == {0, 1}
    seen = {sample(logits, [SamplingParams(temperature=100.0)], [g])[0] for _ in range(200)}
    assert seen == {0, 1, 2, 3, 4}


def test_top_k_one_is_greedy():
    greedy = engine().generate([EngineRequest("g", [4, 5], SamplingParams(max_tokens=8))])["g"]
    topk = engine().generate([EngineRequest("k", [4, 5], SamplingParams(max_tokens=8, temperature=2.0, top_k=1,
                                                                        seed=1))])["k"]
    assert greedy == topk


def test_stop_tokens_and_finish_reasons():
    greedy = engine().generate([EngineRequest("g", [4, 5], SamplingParams(max_tokens=8))])["g"]
    eng = engine()
    eng.add_request(EngineRequest("s", [4, 5], SamplingParams(max_tokens=8, stop_token_ids=(greedy[3],))))
    events = []
    while eng.has_work():
        events += eng.step()
    assert [e.token_id for e in events] == greedy[:greedy.index(greedy[3]) + 1]
    assert events[-1].finish_reason is FinishReason.STOP
    eng.add_request(EngineRequest("l", [4, 5], SamplingParams(max_tokens=2)))
    events = []
    while eng.has_work():
        events += eng.step()
    assert [e.finish_reason for e in events] == [FinishReason.NONE, FinishReason.LENGTH]


@pytest.mark.parametrize("params, field", [
    (SamplingParams(max_tokens=0), "max_tokens"),
    (SamplingParams(temperature=-0.1), "temperature"),
    (SamplingParams(top_k=-1), "top_k"),
    (SamplingParams(top_p=0.0), "top_p"),
    (SamplingParams(top_p=1.01), "top_p"),
    (SamplingParams(stop_token_ids=(CFG.vocab_size,)), "stop_token_ids"),
    (SamplingParams(temperature=float("nan")), "temperature"),
])
def test_validation_names_the_field(params, field):
    with pytest.raises(InvalidRequest) as e:
        engine().add_request(EngineRequest("v", [1], params))
    assert e.value.field == field


def test_request_validation():
    eng = engine(blocks=4)
    for req, field in [(EngineRequest("a", []), "prompt"), (EngineRequest("a", [CFG.vocab_size]), "prompt_token_ids"),
                       (EngineRequest("a", [1] * 2040, SamplingParams(max_tokens=20)), "max_tokens"),
                       (EngineRequest("a", [1] * 40), "prompt"),  # 40 tokens > 4 blocks x 8
                       (EngineRequest("a", [1] * 20, SamplingParams(max_tokens=20)), "max_tokens")]:
        with pytest.raises(InvalidRequest) as e:
            eng.add_request(req)
        assert e.value.field == field, req


def test_abort_frees_blocks():
    eng = engine()
    eng.add_request(EngineRequest("a", list(range(1, 30)), SamplingParams(max_tokens=50)))
    eng.step()
    assert eng.allocator.num_used > 0
    assert eng.abort("a") and not eng.abort("a")
    assert eng.allocator.num_used == 0 and not eng.has_work()


def test_eos_stops_unless_ignored():
    prompt = [5, 6, 7]
    ref = engine().generate([EngineRequest("r", prompt, SamplingParams(max_tokens=6, ignore_eos=True))])["r"]
    cfg = CFG.replace(eos_token_id=ref[2], name="eos")
    eng = Engine(cfg, W, num_kv_blocks=16, block_size=4)
    eng.add_request(EngineRequest("a", prompt, SamplingParams(max_tokens=6)))
    eng.add_request(EngineRequest("b", prompt, SamplingParams(max_tokens=6, ignore_eos=True)))
    events = []
    while eng.has_work():
        events += eng.step()
    a = [e for e in events if e.request_id == "a"]
    b = [e for e in events if e.request_id == "b"]
    first_eos = ref.index(ref[2])
    assert [e.token_id for e in a] == ref[:first_eos + 1] and a[-1].finish_reason is FinishReason.EOS
    assert [e.token_id for e in b] == ref and b[-1].finish_reason is FinishReason.LENGTH
    assert [e.index for e in b] == list(range(6))


def test_duplicate_request_id_is_rejected():
    eng = engine()
    eng.add_request(EngineRequest("d", [1, 2]))
    with pytest.raises(InvalidRequest) as e:
        eng.add_request(EngineRequest("d", [3]))
    assert e.value.field == "request_id"
