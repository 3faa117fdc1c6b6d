"""Shared helpers for the engine tests: one torch thread, cached weights, the teacher-forced oracle.

One thread: on the 2-core CI machine several test processes (and the services they start) run at
once; oversubscribed OpenMP threads make small torch ops 10-20x slower (seen here), and the results
do not depend on the thread count anyway.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from kunserve.shared.engine.api import EngineRequest, SamplingParams, TokenEvent
from kunserve.shared.engine.engine import Engine
from kunserve.shared.model.architecture import ModelConfig
from kunserve.shared.model.reference import reference_scores
from kunserve.shared.model.weights import Weights, random_weights

NEAR_TIE = 1e-3  # DESIGN.md: compare greedy tokens where the reference's top-2 margin is clear

# 8 heads / 4 KV heads so TP4 splits the KV heads too; Llama's attention_bias puts biases on q/k/v and o_proj.
TP4_CONFIG = ModelConfig(
    vocab_size=512,
    hidden_size=128,
    num_layers=2,
    num_heads=8,
    num_kv_heads=4,
    intermediate_size=256,
    head_dim=16,
    qkv_bias=True,
    o_bias=True,
    bos_token_id=1,
    eos_token_id=2,
    name="tp-test",
)


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@functools.lru_cache(maxsize=8)
def weights_for(cfg: ModelConfig, seed: int = 0) -> Weights:
    return random_weights(cfg, seed)


def check_greedy(cfg: ModelConfig, weights: Weights, prompt: list[int], got: list[int]) -> bool:
    """Assert the engine's greedy tokens equal the dense reference's wherever its margin is clear.
    Returns True when a near-tie divergence ended the comparison (after which the sequences may
    legitimately differ). Teacher-forced: one reference forward over prompt + got."""
    ref, margins = reference_scores(cfg, weights, prompt, got)
    for i, (g, r) in enumerate(zip(got, ref)):
        if g != r:
            assert margins[i] < NEAR_TIE, (
                f"token {i}: engine {g}, reference {r} with a clear margin {margins[i]:.4g}\n"
                f"prompt={prompt}\ngot={got}")
            return True
    return False


# Five requests that, under a 48-token budget, leave some decoding while others still prefill or wait after
# a dozen steps (greedy and one seeded sampled): the state every carry-over test starts from.
MID_DECODE_REQS = [
    EngineRequest("g0", list(range(300, 337)), SamplingParams(max_tokens=30, ignore_eos=True)),
    EngineRequest("s1", list(range(500, 521)), SamplingParams(max_tokens=25, temperature=0.9, top_k=50, seed=7,
                                                              ignore_eos=True)),
    EngineRequest("g2", list(range(900, 1010)), SamplingParams(max_tokens=20, ignore_eos=True)),
    EngineRequest("g3", list(range(1200, 1290)), SamplingParams(max_tokens=12, ignore_eos=True)),
    EngineRequest("g4", list(range(2000, 2050)), SamplingParams(max_tokens=15, ignore_eos=True)),
]


def clone(r: EngineRequest) -> EngineRequest:
    """A fresh copy of a request (an engine owns the requests it is given)."""
    return dataclasses.replace(r, prompt_token_ids=list(r.prompt_token_ids))


def run_until_mid_decode(eng: Engine, reqs: list[EngineRequest], steps: int = 12) -> dict[str, list[int]]:
    """Add `reqs` and step until some decode while others still prefill or wait: the state a drop, swap or
    relayout must carry over. Returns the tokens so far per request."""
    for r in reqs:
        eng.add_request(clone(r))
    out: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    for _ in range(steps):
        for ev in eng.step():
            out[ev.request_id].append(ev.token_id)
    assert any(s.generated and s.block_table for s in eng.seqs.values())
    assert any(not s.generated for s in eng.seqs.values())
    return out


def finish(eng: Engine, out: dict[str, list[int]]) -> dict[str, list[int]]:
    """Step to the end, appending to `out`; every KV block is free afterwards."""
    while eng.has_work():
        for ev in eng.step():
            out[ev.request_id].append(ev.token_id)
    assert eng.allocator.num_used == 0 and not eng.seqs
    return out


def run_events(eng: Engine, reqs: list[EngineRequest]) -> dict[str, list[TokenEvent]]:
    """Add the requests and step to the end: every event of each request, in order."""
    for r in reqs:
        eng.add_request(r)
    out: dict[str, list[TokenEvent]] = {r.request_id: [] for r in reqs}
    while eng.has_work():
        for ev in eng.step():
            out[ev.request_id].append(ev)
    return out
