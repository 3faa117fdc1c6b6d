"""The correctness oracle: greedy tokens of the paged, batched, chunked engine equal an independent
dense reference forward, whatever the batch composition, chunk size, block size or preemption."""

from __future__ import annotations

import functools
import random

import pytest

from kunserve.shared.engine.api import EngineRequest, SamplingParams
from kunserve.shared.engine.engine import Engine, SchedulerConfig
from kunserve.shared.model.config import TINY_CONFIG
from kunserve.shared.model.reference import reference_greedy
from kunserve.shared.model.weights import random_weights
from oracle import compare_greedy

SMALL = TINY_CONFIG.replace(num_layers=2, name="small")


@functools.lru_cache(maxsize=4)
def weights_for(cfg):
    return random_weights(cfg, seed=0)


@functools.lru_cache(maxsize=512)
def reference(cfg, prompt: tuple[int, ...], n: int):
    return reference_greedy(cfg, weights_for(cfg), list(prompt), n)


def run_mix(cfg, seed: int):
    """One random mix: prompts, output lengths, staggered arrivals, block size, budget, cache size."""
    rng = random.Random(seed)
    n_req = rng.randint(1, 7)
    prompts = [tuple(rng.randrange(cfg.vocab_size) for _ in range(rng.randint(1, 200))) for _ in range(n_req)]
    outs = [rng.randint(1, 12) for _ in range(n_req)]
    block_size = rng.choice([1, 4, 8, 16, 32])
    budget = rng.choice([1, 7, 32, 64, 256, 1024])
    need = max(-(-(len(p) + o) // block_size) for p, o in zip(prompts, outs))
    total_need = sum(-(-(len(p) + o) // block_size) for p, o in zip(prompts, outs))
    tight = rng.random() < 0.4
    num_blocks = need + (rng.randint(0, 3) if tight else total_need)
    eng = Engine(cfg, weights_for(cfg), num_kv_blocks=num_blocks, block_size=block_size,
                 scheduler_config=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=rng.choice([2, 64])))
    arrivals = sorted(rng.randint(0, 10) for _ in range(n_req))
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(n_req)}
    step, added = 0, 0
    while added < n_req or eng.has_work():
        while added < n_req and arrivals[added] <= step:
            eng.add_request(EngineRequest(f"r{added}", list(prompts[added]),
                                          SamplingParams(max_tokens=outs[added], ignore_eos=True)))
            added += 1
        for ev in eng.step():
            got[ev.request_id].append(ev.token_id)
        step += 1
        assert step < 20_000
    assert eng.allocator.num_used == 0, "finished requests must free every block"
    near_ties = 0
    for i in range(n_req):
        ref, margins = reference(cfg, prompts[i], outs[i])
        near_ties += compare_greedy(got[f"r{i}"], ref, margins)
    return near_ties, eng.scheduler.num_preemptions, n_req


def test_twenty_four_random_mixes_match_the_reference():
    near_ties = preemptions = requests = 0
    for seed in range(24):
        t, p, n = run_mix(SMALL, seed)
        near_ties += t
        preemptions += p
        requests += n
    assert preemptions > 0, "the mixes must exercise preemption"
    assert near_ties <= max(2, requests // 10)


@pytest.mark.parametrize("seed", [100, 101])
def test_full_tiny_model_mixes(seed):
    run_mix(TINY_CONFIG, seed)


def test_qwen2_style_bias_and_tied_embeddings():
    for cfg in (SMALL.replace(qkv_bias=True, model_type="qwen2", name="q"),
                SMALL.replace(tie_word_embeddings=True, name="t")):
        run_mix(cfg, 7)


def test_eos_stops_unless_ignored():
    w = weights_for(SMALL)
    prompt = [5, 6, 7]
    ref, _ = reference(SMALL, tuple(prompt), 6)
    cfg = SMALL.replace(eos_token_id=ref[2], name="eos")
    eng = Engine(cfg, w, num_kv_blocks=16, block_size=4)
    out = eng.generate([EngineRequest("a", prompt, SamplingParams(max_tokens=6)),
                        EngineRequest("b", prompt, SamplingParams(max_tokens=6, ignore_eos=True))])
    assert out["a"] == ref[:3] and out["b"] == ref
