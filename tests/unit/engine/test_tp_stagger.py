"""Layer-staggered in-place scale-down (shared/engine/tp_stagger.py): a TP instance splits back into whole engines one
layer at a time, last layer first, while it goes on decoding between the layers' moves; every request keeps its KV
(nothing re-prefills), its greedy tokens are the dense reference's, a request that arrives meanwhile waits for the
split to finish and is then served, and a member failing part-way heals every member. Each member runs on its own
thread over a real gloo group, rank 0 leading its followers through the same messages a worker's do."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
from test_tp_transform import (
    BLOCK,
    assert_pool_back,
    assert_reference_tokens,
    decode_merged,
    model,
    padded_instances,
    pool_state,
    start_decoding,
    step_until,
)

from kunserve.benchkit.tp_members import TokenLog, free_port, on_ranks, staggered_split
from kunserve.shared.engine.api import EngineRequest, InvalidRequest, SamplingParams
from kunserve.shared.engine.engine import Engine, SchedulerConfig, TPHealed
from kunserve.shared.engine.tensor_parallel import TPFollower, TPGroup, TPLeader
from kunserve.shared.engine.tp_stagger import StaggeredSplit
from kunserve.shared.engine.tp_transform import MemberWeights, TransformReport, scale_up
from kunserve.shared.model.tp_degree import shard_config
from kunserve.shared.model.tp_padding import shards_of
from kunserve.shared.model.tp_shard import shard_weights
from kunserve.shared.model.weights import Weights

pytestmark = pytest.mark.timeout(240)
BLOCKS = 24


def merged(degree: int, cfg, weights: Weights, engines: list[Engine], tokens: TokenLog,
           requests: dict[str, list[int]], shard: Callable[[int], Weights | MemberWeights]
           ) -> tuple[list[TPGroup], TPLeader]:
    """The engines merged into one TP instance (in place), decoding a few more tokens."""
    port = free_port()
    groups = on_ranks(degree, lambda r: TPGroup(r, degree, "127.0.0.1", port, timeout_s=30, rendezvous_timeout_s=60))
    on_ranks(degree, lambda r: scale_up(engines[r], groups[r], shard_config(cfg, degree), shard(r)))
    leader = decode_merged(groups, engines, tokens, tokens.at_least(6, requests))
    return groups, leader


@pytest.mark.parametrize("name,degree", [("tiny", 2), ("kv4", 4)], ids=["tiny-tp2", "kv4-tp4"])
def test_requests_decode_through_a_layer_by_layer_split_and_keep_their_kv(name, degree):
    torch.set_num_threads(1)
    cfg, weights = model(name)
    # a small token budget: a long prompt is prefilled in chunks, across the layers' moves
    engines = [Engine(cfg, weights, num_kv_blocks=BLOCKS, block_size=BLOCK,
                      scheduler_config=SchedulerConfig(max_num_batched_tokens=32)) for _ in range(degree)]
    requests, tokens = start_decoding(engines)
    groups, leader = merged(degree, cfg, weights, engines, tokens, requests, lambda r: shard_weights(weights, r, degree))
    e0 = engines[0]
    short = EngineRequest("short", list(range(40, 52)), SamplingParams(max_tokens=3, ignore_eos=True))
    e0.add_request(short)  # admitted before the split, finishes while the layers split
    decode_merged(groups, engines, tokens, lambda: "short" in tokens.by_request, leader)
    chunked = EngineRequest("chunked", list(range(100, 190)), SamplingParams(max_tokens=6, ignore_eos=True))
    e0.add_request(chunked)
    decode_merged(groups, engines, tokens, lambda: e0.seqs["chunked"].num_computed > 0, leader)
    assert e0.seqs["chunked"].num_computed < len(chunked.prompt_token_ids)  # the split begins mid-prefill
    requests["chunked"] = chunked.prompt_token_ids
    late = EngineRequest("late", list(range(60, 75)), SamplingParams(max_tokens=5, ignore_eos=True))
    requests |= {"short": short.prompt_token_ids, "late": late.prompt_token_ids}

    def arrive() -> None:  # a request arriving once the split began waits for it to finish
        e0.add_request(late)
        # one the merged instance holds but no whole engine: refused, since it would stay on rank 0
        big = EngineRequest("big", list(range(3, 3 + BLOCKS * BLOCK)), SamplingParams(max_tokens=8, ignore_eos=True))
        e0.validate(big)
        with pytest.raises(InvalidRequest, match="once its tensor-parallel instance has split"):
            e0.add_request(big)

    reports, splits = staggered_split(groups, leader, engines, tokens, cfg, lambda r: weights, before_first_layer=arrive)
    for g in groups:
        g.close()
    down: list[TransformReport] = reports  # type: ignore[assignment]
    assert all(isinstance(r, TransformReport) for r in down), reports
    s0 = splits[0]
    assert s0 is not None and len(s0.stats.layer_seconds) == cfg.num_layers
    assert all(n == 2 for n in s0.stats.steps_between)  # the instance computed between every two layers' moves
    assert "short" in tokens.finished  # finished while the layers split
    assert "late" not in tokens.by_request  # not admitted while the layers split
    assert sum(r.requests for r in down) == len(set(requests) - tokens.finished)  # each unfinished one on one member
    assert all(r.blocks_after == BLOCKS for r in down)
    assert all(s is not None and s.stats.compacted_blocks == 0 for s in splits)
    assert sum(r.received_subblocks for r in down) > 0
    for e in engines:
        assert e.runner.reduce is None and e.step_plan is None and e.kv.kv_heads_per_block == cfg.num_kv_heads
        step_until(e, tokens, lambda: False)
    assert tokens.finished == set(requests)
    assert_reference_tokens(cfg, weights, {k: v for k, v in requests.items() if k not in ("short", "late", "chunked")},
                            tokens)
    assert_reference_tokens(cfg, weights, {"chunked": requests["chunked"]}, tokens, 6)
    assert_reference_tokens(cfg, weights, {"short": requests["short"]}, tokens, 3)
    assert_reference_tokens(cfg, weights, {"late": requests["late"]}, tokens, 5)


def test_a_padded_pool_takes_its_mlp_shards_back_first_and_then_splits_layer_by_layer():
    """The padded MLP's released pages come back (from the KV tails, after compacting the used blocks below the
    whole capacity) before the first layer moves; no page is mapped beyond the pool's; the tokens are the
    reference's."""
    torch.set_num_threads(1)
    cfg, weights = model("tiny")
    degree = 2
    insts = padded_instances(degree)
    try:
        engines = [i.engine for i in insts]
        requests, tokens = start_decoding(engines)
        before = pool_state(insts)
        blocks = [state[2] for state in before]
        groups, leader = merged(degree, cfg, weights, engines, tokens, requests, lambda r: insts[r])
        assert all(i.layout.kept_shards == shards_of(r, degree) for r, i in enumerate(insts))
        # a long request fills the merged instance's high blocks, which the whole capacity does not reach
        long = EngineRequest("long", list(range(5, 5 + 2 * blocks[0] * BLOCK - 40)), SamplingParams(max_tokens=2,
                                                                                                   ignore_eos=True))
        engines[0].add_request(long)
        decode_merged(groups, engines, tokens, lambda: "long" in tokens.finished, leader)
        requests["long"] = long.prompt_token_ids
        reports, splits = staggered_split(groups, leader, engines, tokens, cfg, lambda r: insts[r])
        for g in groups:
            g.close()
        assert all(isinstance(r, TransformReport) for r in reports), reports
        assert all(s is not None and s.stats.compacted_blocks > 0 for s in splits)
        assert_pool_back(insts, before)
        for e in engines:
            step_until(e, tokens, lambda: False)
        assert tokens.finished == set(requests)
        assert_reference_tokens(cfg, weights, {k: v for k, v in requests.items() if k != "long"}, tokens)
        assert_reference_tokens(cfg, weights, {"long": requests["long"]}, tokens, 2)
    finally:
        for i in insts:
            i.close()


def test_a_member_failing_part_way_heals_every_member_with_its_requests_recomputed():
    """Rank 1's part of the second layer's move fails after its exchange went through (rank 0's part succeeded):
    the vote that ends every layer makes both heal to whole engines, rank 0 with every request, re-prefilled; their
    tokens are still the reference's (a recompute preemption), and every member computes alone again."""
    torch.set_num_threads(1)
    cfg, weights = model("tiny")
    degree = 2
    engines = [Engine(cfg, weights, num_kv_blocks=BLOCKS, block_size=BLOCK) for _ in range(degree)]
    requests, tokens = start_decoding(engines)
    groups, leader = merged(degree, cfg, weights, engines, tokens, requests, lambda r: shard_weights(weights, r, degree))

    def broken(sends: dict, recvs: dict, tag: int) -> None:
        groups[1].exchange(sends, recvs, tag)
        if tag == 1:  # the second layer split
            raise RuntimeError("injected fault")

    reports, splits = staggered_split(groups, leader, engines, tokens, cfg, lambda r: weights,
                                      exchange=lambda r: broken if r == 1 else None)
    for g in groups:
        g.close()
    assert all(isinstance(r, TPHealed) for r in reports), reports
    assert "injected fault" in str(reports[1])
    assert len(engines[0].seqs) == 2 * degree and not engines[1].seqs
    for e in engines:
        assert e.runner.reduce is None and e.kv.kv_heads_per_block == cfg.num_kv_heads
        step_until(e, tokens, lambda: False)
    assert tokens.finished == set(requests)
    assert_reference_tokens(cfg, weights, requests, tokens)


def test_a_split_the_whole_instances_cannot_hold_is_refused_on_every_member_and_changes_nothing():
    torch.set_num_threads(1)
    cfg, weights = model("tiny")
    degree = 2
    engines = [Engine(cfg, weights, num_kv_blocks=BLOCKS, block_size=BLOCK) for _ in range(degree)]
    requests, tokens = start_decoding(engines)
    groups, leader = merged(degree, cfg, weights, engines, tokens, requests, lambda r: shard_weights(weights, r, degree))
    big = EngineRequest("big", list(range(3, 3 + BLOCKS * BLOCK)), SamplingParams(max_tokens=40, ignore_eos=True))
    engines[0].add_request(big)  # more than one whole engine holds at its whole life
    decode_merged(groups, engines, tokens, lambda: len(tokens.by_request.get("big", [])) >= 1, leader)
    tables = engines[0].block_tables()
    refusals: list[ValueError] = []

    def begin(r: int) -> StaggeredSplit:
        try:
            return StaggeredSplit.begin(engines[r], groups[r], cfg, weights)
        except ValueError as exc:
            refusals.append(exc)
            raise

    # the followers hear STAGGER in their loops, are refused with rank 0 and go on following its steps
    followers = [TPFollower(groups[r], engines[r], begin_stagger=functools.partial(begin, r)) for r in range(1, degree)]
    for f in followers:
        f.start()
    leader.stagger()
    with pytest.raises(ValueError, match="do not fit"):
        begin(0)
    assert engines[0].block_tables() == tables and engines[0].kv.kv_heads_per_block == cfg.num_kv_heads // degree
    step_until(engines[0], tokens, lambda: "big" in tokens.finished)  # still one TP instance
    leader.stop()
    assert all(f.join(30) and f.stopped and f.staggered is None for f in followers)
    assert len(refusals) == degree and all("do not fit" in str(x) for x in refusals)
    for g in groups:
        g.close()
