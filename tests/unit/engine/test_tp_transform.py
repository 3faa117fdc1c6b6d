"""In-place tensor-parallel transformation of running engines (shared/engine/tp_transform.py): whole engines decoding
requests merge into one TP instance mid-decode, keep decoding, and split back mid-decode; every request keeps its KV
throughout (nothing re-prefills), and every request's greedy tokens equal the dense reference's. Each member runs
on its own thread over a real gloo group (as it would in its own worker process)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from engine_testing import TP4_CONFIG
from oracle import compare_greedy

from kunserve.benchkit.tp_members import TokenLog, free_port, on_ranks
from kunserve.shared.engine.api import EngineRequest, InvalidRequest, SamplingParams
from kunserve.shared.engine.engine import Engine, HealFailed, InstanceBroken, SchedulerConfig, TPHealed
from kunserve.shared.engine.pooled import PooledInstance
from kunserve.shared.engine.tensor_parallel import TPFollower, TPGroup, TPLeader
from kunserve.shared.engine.tp_transform import TransformReport, scale_down, scale_up
from kunserve.shared.model.architecture import ModelConfig
from kunserve.shared.model.reference import reference_greedy
from kunserve.shared.model.tp_degree import shard_config
from kunserve.shared.model.tp_padding import shards_of
from kunserve.shared.model.tp_shard import shard_weights
from kunserve.shared.model.weights import Weights, load_model_source, random_weights

pytestmark = pytest.mark.timeout(240)
BLOCK = 8
BLOCKS = 24  # per whole engine: 192 tokens
SCHED = SchedulerConfig(max_num_batched_tokens=64)
MAX_TOKENS = 32


def model(name: str) -> tuple[ModelConfig, Weights]:
    if name == "tiny":
        src = load_model_source(None)
        return src.config, src.load_weights()
    return TP4_CONFIG, random_weights(TP4_CONFIG, seed=3)


def prompts(member: int) -> list[list[int]]:
    """Two requests per member, of different lengths, so blocks are used unevenly."""
    base = 20 + 37 * member
    return [list(range(base, base + 9 + 5 * member)), list(range(base + 3, base + 30 + 3 * member))]


def step_until(engine: Engine, tokens: TokenLog, done: Callable[[], bool], limit: int = 400) -> None:
    for _ in range(limit):
        if done() or not engine.has_work():
            return
        tokens.add(engine.step())
    raise AssertionError("the engine did not get there in time")


def decoding_engines(cfg: ModelConfig, weights: Weights, degree: int) -> tuple[list[Engine], dict[str, list[int]], TokenLog]:
    """`degree` whole engines, each with two requests (`prompts(m)`) a few tokens into their decode."""
    engines = [Engine(cfg, weights, num_kv_blocks=BLOCKS, block_size=BLOCK, scheduler_config=SCHED) for _ in range(degree)]
    requests, tokens = start_decoding(engines)
    return engines, requests, tokens


def assert_reference_tokens(cfg: ModelConfig, weights: Weights, requests: dict[str, list[int]], tokens: TokenLog,
                            max_tokens: int = MAX_TOKENS) -> None:
    """Every request's greedy tokens are the dense reference's (within the oracle's near-tie rule)."""
    for rid, prompt in requests.items():
        ref, margins = reference_greedy(cfg, weights, prompt, max_tokens)
        compare_greedy(tokens.by_request[rid], ref, margins)


def start_decoding(engines: list[Engine]) -> tuple[dict[str, list[int]], TokenLog]:
    """Two requests (`prompts(m)`) on each engine m, stepped a few tokens into their decode."""
    requests: dict[str, list[int]] = {}
    tokens = TokenLog()
    for m, e in enumerate(engines):
        for i, p in enumerate(prompts(m)):
            requests[f"m{m}-r{i}"] = p
            e.add_request(EngineRequest(f"m{m}-r{i}", p, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)))
        step_until(e, tokens, tokens.at_least(3, e.seqs))
    return requests, tokens


def decode_merged(groups: list, engines: list[Engine], tokens: TokenLog, done: Callable[[], bool],
                  leader: TPLeader | None = None) -> TPLeader:
    """Rank 0 steps the merged instance until `done` while the other ranks follow its plans on their threads, then
    stops them (STOP). Returns rank 0's leader, attached once: give it back to decode again."""
    if leader is None:
        leader = TPLeader(groups[0])
        leader.attach(engines[0])
    followers = [TPFollower(g, e) for g, e in zip(groups[1:], engines[1:], strict=True)]
    for f in followers:
        f.start()
    step_until(engines[0], tokens, done)
    leader.stop()
    assert all(f.join(30) and f.stopped for f in followers)
    return leader


@pytest.mark.parametrize("name,degree", [("tiny", 2), ("kv4", 4)], ids=["tiny-tp2", "kv4-tp4"])
def test_requests_live_through_a_scale_up_and_a_scale_down_mid_decode(name, degree):
    torch.set_num_threads(1)
    cfg, weights = model(name)
    shard_cfg = shard_config(cfg, degree)
    engines = [Engine(cfg, weights, num_kv_blocks=BLOCKS, block_size=BLOCK, scheduler_config=SCHED) for _ in range(degree)]
    for e in engines:  # a ConServe worker's features, which act on one member's heads alone: off while merged
        e.enable_layerwise_preemption(1, 1.0)
        e.enable_kv_checkpoint(1 << 20)
    requests: dict[str, list[int]] = {}
    for m, e in enumerate(engines):
        for i, p in enumerate(prompts(m)):
            rid = f"m{m}-r{i}"
            requests[rid] = p
            e.add_request(EngineRequest(rid, p, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)))
    tokens = TokenLog()
    for e in engines:  # every request prefilled and a few tokens into its decode
        step_until(e, tokens, tokens.at_least(3, e.seqs))
    assert all(len(tokens.by_request.get(rid, [])) >= 3 for rid in requests)

    # A request no whole engine holds: refused at TP1, served after the scale-up.
    long_prompt = list(range(7, 7 + BLOCKS * BLOCK + 20))
    long_req = EngineRequest("long", long_prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    with pytest.raises(InvalidRequest):
        engines[0].validate(long_req)

    port = free_port()
    groups = on_ranks(degree, lambda r: TPGroup(r, degree, "127.0.0.1", port, timeout_s=60, rendezvous_timeout_s=60))
    reports = on_ranks(degree, lambda r: scale_up(engines[r], groups[r], shard_cfg, shard_weights(weights, r, degree),
                                                    max_phase_subblocks=3))
    up: list[TransformReport] = reports  # type: ignore[assignment]
    assert up[0].requests == 2 * degree and all(r.requests == 0 for r in up[1:])
    assert up[0].moved_requests == 2 * (degree - 1)
    assert all(r.blocks_after == BLOCKS * degree for r in up)  # the same pages hold degree x the blocks
    assert all(r.sent_subblocks > 0 and r.received_subblocks > 0 for r in up)
    assert all(e.safepoint_every == 0 and e.kv_checkpoint is None for e in engines)
    e0 = engines[0]
    assert not e0.kv_landing and len(e0.seqs) == 2 * degree
    # every request decodes on the TP instance with the KV it had
    leader = decode_merged(groups, engines, tokens, tokens.at_least(7, requests))
    e0.validate(long_req)
    e0.add_request(long_req)
    decode_merged(groups, engines, tokens, lambda: "long" in tokens.finished, leader)
    assert not tokens.finished & set(requests)  # the others still decode: the split comes mid-decode
    down: list[TransformReport] = on_ranks(degree, lambda r: scale_down(engines[r], groups[r], cfg, weights))  # type: ignore[assignment]
    assert sum(r.requests for r in down) == 2 * degree
    assert all(r.blocks_after == BLOCKS for r in down)
    for g in groups:
        g.close()  # type: ignore[attr-defined]
    for e in engines:
        assert e.runner.reduce is None and e.step_plan is None  # whole again: nothing to sum or broadcast
        assert e.safepoint_every == 1 and e.kv_checkpoint is not None  # and its own features back
        step_until(e, tokens, lambda: False)
    assert tokens.finished == set(requests) | {"long"}
    for rid, prompt in [*requests.items(), ("long", long_prompt)]:
        n = 4 if rid == "long" else MAX_TOKENS
        ref, margins = reference_greedy(cfg, weights, prompt, n)
        compare_greedy(tokens.by_request[rid], ref, margins)


def test_a_split_the_whole_instances_cannot_hold_is_refused_and_changes_nothing():
    torch.set_num_threads(1)
    cfg, weights = model("tiny")
    degree = 2
    engines = [Engine(cfg, weights, num_kv_blocks=BLOCKS, block_size=BLOCK, scheduler_config=SCHED) for _ in range(degree)]
    port = free_port()
    groups = on_ranks(degree, lambda r: TPGroup(r, degree, "127.0.0.1", port, timeout_s=60, rendezvous_timeout_s=60))
    on_ranks(degree, lambda r: scale_up(engines[r], groups[r], shard_config(cfg, degree), shard_weights(weights, r, degree)))
    e0 = engines[0]
    long_prompt = list(range(7, 7 + BLOCKS * BLOCK + 20))
    e0.add_request(EngineRequest("long", long_prompt, SamplingParams(max_tokens=30, ignore_eos=True)))
    tokens = TokenLog()
    leader = decode_merged(groups, engines, tokens, tokens.at_least(2, ["long"]))
    with pytest.raises(ValueError, match="do not fit 2 whole instances"):
        on_ranks(degree, lambda r: scale_down(engines[r], groups[r], cfg, weights))
    # nothing changed: the instance resumes at TP2 and finishes the request with the reference's tokens
    assert e0.kv.kv_heads_per_block == cfg.num_kv_heads // degree and list(e0.seqs) == ["long"]
    decode_merged(groups, engines, tokens, lambda: "long" in tokens.finished, leader)
    for g in groups:
        g.close()  # type: ignore[attr-defined]
    ref, margins = reference_greedy(cfg, weights, long_prompt, 30)
    compare_greedy(tokens.by_request["long"], ref, margins)


def test_pooled_instances_change_parallelism_in_place_with_no_page_mapped_or_released():
    """Two workers' pooled instances (the memory pool's layout holds the KV): the head split and its exchange, and
    the gather back, map and unmap no page; the KV tokens the same pages hold grow by the degree while merged."""
    torch.set_num_threads(1)
    src = load_model_source(None)
    cfg, weights = src.config, src.load_weights()
    degree = 2
    insts = [PooledInstance(src, layer_range=(0, cfg.num_layers), pool_bytes=24 << 20, page_size=256 << 10, block_size=BLOCK,
                            backend="host", scheduler_config=SCHED) for _ in range(degree)]
    try:
        engines = [i.engine for i in insts]
        requests, tokens = start_decoding(engines)
        mapped = [i.pool.mapped_count for i in insts]
        blocks = [e.kv.num_blocks for e in engines]
        port = free_port()
        groups = on_ranks(degree, lambda r: TPGroup(r, degree, "127.0.0.1", port, timeout_s=60, rendezvous_timeout_s=60))
        shard_cfg = shard_config(cfg, degree)
        up: list[TransformReport] = on_ranks(  # type: ignore[assignment]
            degree, lambda r: scale_up(engines[r], groups[r], shard_cfg, shard_weights(weights, r, degree), max_phase_subblocks=4)
        )
        assert [i.pool.mapped_count for i in insts] == mapped
        assert all(e.kv.num_blocks >= degree * b for e, b in zip(engines, blocks, strict=True))
        block_bytes = insts[0].layout.kv_spec.block_bytes  # a sub-block's, after the split
        assert all(r.staging_bytes <= 2 * 4 * block_bytes for r in up)  # one phase: at most 4 received + 4 sent
        decode_merged(groups, engines, tokens, tokens.at_least(8, requests))
        on_ranks(degree, lambda r: scale_down(engines[r], groups[r], cfg, insts[r].layout.weights()))
        for g in groups:
            g.close()  # type: ignore[attr-defined]
        assert [i.pool.mapped_count for i in insts] == mapped and [e.kv.num_blocks for e in engines] == blocks
        for e in engines:
            step_until(e, tokens, lambda: False)
        assert tokens.finished == set(requests)
        assert_reference_tokens(cfg, weights, requests, tokens)
    finally:
        for i in insts:
            i.close()


def padded_instances(degree: int) -> list[PooledInstance]:
    """Whole pooled instances of the embedded model whose pools hold the padded MLP (64 KiB pages: small gaps)."""
    src = load_model_source(None)
    return [PooledInstance(src, layer_range=(0, src.config.num_layers), pool_bytes=22 << 20, page_size=64 << 10,
                           block_size=BLOCK, backend="host", scheduler_config=SCHED, padded_mlp=True)
            for _ in range(degree)]


def pool_state(insts: list[PooledInstance]) -> list[tuple[int, int, int]]:
    """Each padded member's (pool pages mapped, weight pages, KV blocks): what a change that ends whole gives back."""
    return [(i.pool.mapped_count, i.layout.weight_pages, i.engine.kv.num_blocks) for i in insts]


def assert_pool_back(insts: list[PooledInstance], before: list[tuple[int, int, int]]) -> None:
    """Every member whole again with its shards back, every page where it was (`before`: pool_state)."""
    for i, state in zip(insts, before, strict=True):
        assert i.layout.kept_shards == range(4) and pool_state([i])[0] == state
        i.layout.check_invariants()


def test_a_padded_pool_gives_the_mlp_shards_a_member_no_longer_keeps_to_its_kv_and_takes_them_back():
    """Gyges §4.2 in the pool: the MLP stored in page-aligned shards; at the scale-up each member releases the shards it
    no longer computes on, in place, to its KV, so the merged instance holds more KV than its members did whole
    together (a request longer than that is served), and the scale-down takes the pages back and refills them from
    the host copy. No page is mapped beyond the pool's; every request's tokens are the reference's."""
    torch.set_num_threads(1)
    src = load_model_source(None)
    cfg, weights = src.config, src.load_weights()
    degree = 2
    insts = padded_instances(degree)
    try:
        engines = [i.engine for i in insts]
        requests, tokens = start_decoding(engines)
        before = pool_state(insts)
        mapped, weight_pages, blocks = (list(x) for x in zip(*before, strict=True))
        # longer than both whole instances' KV together: only the released MLP pages make room for it
        long_prompt = list(range(5, 5 + degree * blocks[0] * BLOCK + 40))
        long_req = EngineRequest("long", long_prompt, SamplingParams(max_tokens=4, ignore_eos=True))
        with pytest.raises(InvalidRequest):
            engines[0].validate(long_req)
        port = free_port()
        groups = on_ranks(degree, lambda r: TPGroup(r, degree, "127.0.0.1", port, timeout_s=60, rendezvous_timeout_s=60))
        up: list[TransformReport] = on_ranks(  # type: ignore[assignment]
            degree, lambda r: scale_up(engines[r], groups[r], shard_config(cfg, degree), insts[r]))
        for r, i in enumerate(insts):
            assert i.layout.kept_shards == shards_of(r, degree)
            assert i.pool.mapped_count == mapped[r]  # the released pages went to the KV, none came from elsewhere
            assert i.layout.weight_pages < weight_pages[r]
            i.layout.check_invariants()
        assert all(r.blocks_after > degree * blocks[0] for r in up)
        leader = decode_merged(groups, engines, tokens, tokens.at_least(6, requests))
        engines[0].validate(long_req)
        engines[0].add_request(long_req)
        decode_merged(groups, engines, tokens, lambda: "long" in tokens.finished, leader)
        assert not tokens.finished & set(requests)
        down: list[TransformReport] = on_ranks(  # type: ignore[assignment]
            degree, lambda r: scale_down(engines[r], groups[r], cfg, insts[r]))
        for g in groups:
            g.close()  # type: ignore[attr-defined]
        assert sum(r.requests for r in down) == 2 * degree
        assert_pool_back(insts, before)
        for e in engines:
            step_until(e, tokens, lambda: False)
        assert tokens.finished == set(requests) | {"long"}
        for rid, prompt in [*requests.items(), ("long", long_prompt)]:
            ref, margins = reference_greedy(cfg, weights, prompt, 4 if rid == "long" else MAX_TOKENS)
            compare_greedy(tokens.by_request[rid], ref, margins)
    finally:
        for i in insts:
            i.close()


def test_a_padded_member_failing_mid_split_heals_every_member_with_its_shards_back():
    """A fault in rank 1's exchange during the split of a padded instance: both heal to whole instances, each taking
    its released MLP shards back (the failed move's KV views do not pin the pages the heal remaps), and every request
    ends with the reference's tokens on rank 0, re-prefilled."""
    torch.set_num_threads(1)
    cfg, weights = model("tiny")
    degree = 2
    insts = padded_instances(degree)
    try:
        engines = [i.engine for i in insts]
        requests, tokens = start_decoding(engines)
        before = pool_state(insts)
        port = free_port()
        groups: list[TPGroup] = on_ranks(degree, lambda r: TPGroup(r, degree, "127.0.0.1", port, timeout_s=3, rendezvous_timeout_s=60))  # type: ignore[assignment]
        on_ranks(degree, lambda r: scale_up(engines[r], groups[r], shard_config(cfg, degree), insts[r]))
        assert all(i.layout.kept_shards != range(4) for i in insts)
        decode_merged(groups, engines, tokens, tokens.at_least(6, requests))

        def broken_exchange(*args, **kwargs):
            raise InstanceBroken("injected: rank 1 stopped taking part")

        groups[1].exchange = broken_exchange  # type: ignore[method-assign]
        outcomes = on_ranks(degree, lambda r: _outcome(lambda q: scale_down(engines[q], groups[q], cfg, insts[q]), r))
        assert all(isinstance(o, InstanceBroken) and "healed" in str(o) for o in outcomes), outcomes
        for g in groups:
            g.close()
        assert_pool_back(insts, before)
        assert len(engines[0].seqs) == len(requests) and not engines[1].seqs
        step_until(engines[0], tokens, lambda: False)
        assert tokens.finished == set(requests)
        assert_reference_tokens(cfg, weights, requests, tokens)
    finally:
        for i in insts:
            i.close()


@pytest.mark.parametrize("where", ["release", "move"])
def test_a_padded_member_failing_mid_scale_up_heals_every_member_with_its_shards_back(where, monkeypatch):
    """MLP-first: every member releases its MLP shards before any KV moves. Rank 1 fails either its release (rank 0's
    went through: the KV is where it was, so both whole again keep their requests' KV) or its part of the moves after
    its exchange went through (the vote makes both heal at once; the requests re-prefill). Either way each member
    takes its released shards back and ends with every page where it was, and every request the reference's tokens."""
    torch.set_num_threads(1)
    cfg, weights = model("tiny")
    degree = 2
    insts = padded_instances(degree)
    try:
        engines = [i.engine for i in insts]
        requests, tokens = start_decoding(engines)
        before = pool_state(insts)
        port = free_port()
        groups: list[TPGroup] = on_ranks(degree, lambda r: TPGroup(r, degree, "127.0.0.1", port, timeout_s=30,
                                                                   rendezvous_timeout_s=60))  # type: ignore[assignment]
        exchange = None
        if where == "release":
            def no_release(keep):
                raise RuntimeError("injected: the release failed")
            monkeypatch.setattr(insts[1].layout, "release_shards", no_release)
        else:
            def exchange(sends, recvs, tag):  # rank 1's part of the last layer's exchange goes through, then fails
                groups[1].exchange(sends, recvs, tag)
                if tag == cfg.num_layers - 1:  # one phase per layer: few blocks are in use
                    raise RuntimeError("injected: rank 1 failed after its exchange")
        outcomes = on_ranks(degree, lambda r: _outcome(lambda q: scale_up(
            engines[q], groups[q], shard_config(cfg, degree), insts[q], exchange=exchange if q == 1 else None), r))
        for g in groups:
            g.close()
        assert all(isinstance(o, TPHealed) for o in outcomes), outcomes
        assert all(("keep their KV" if where == "release" else "re-prefill") in str(o) for o in outcomes), outcomes
        if where == "move":  # rank 1 voted no: rank 0 learnt it from the vote, not from a timed-out collective
            assert "another member failed its moves" in str(outcomes[0]), outcomes
        assert_pool_back(insts, before)
        preempted = [s.num_preemptions for e in engines for s in e.snapshot()]
        assert all(n == (0 if where == "release" else 1) for n in preempted), preempted
        for e in engines:
            assert len(e.seqs) == 2 and e.runner.reduce is None
            step_until(e, tokens, lambda: False)
        assert tokens.finished == set(requests)
        assert_reference_tokens(cfg, weights, requests, tokens)
    finally:
        for i in insts:
            i.close()


def test_a_padded_member_that_cannot_take_its_shards_back_says_its_state_is_not_known(monkeypatch):
    """Rank 1 fails its moves and then cannot refill its released MLP shards: HealFailed (a worker exits and starts
    again), never a refusal or a heal that leaves an engine with no weights serving; rank 0 heals."""
    torch.set_num_threads(1)
    cfg, _ = model("tiny")
    degree = 2
    insts = padded_instances(degree)
    try:
        engines = [i.engine for i in insts]
        start_decoding(engines)
        port = free_port()
        groups: list[TPGroup] = on_ranks(degree, lambda r: TPGroup(r, degree, "127.0.0.1", port, timeout_s=30,
                                                                   rendezvous_timeout_s=60))  # type: ignore[assignment]

        def exchange(sends, recvs, tag):
            groups[1].exchange(sends, recvs, tag)
            if tag == cfg.num_layers - 1:
                raise RuntimeError("injected: rank 1 failed after its exchange")

        def no_weights(used):
            raise OSError("injected: the checkpoint cannot be read")

        monkeypatch.setattr(insts[1], "whole", no_weights)
        def up(r: int) -> object:
            try:
                return scale_up(engines[r], groups[r], shard_config(cfg, degree), insts[r],
                                exchange=exchange if r == 1 else None)
            except (InstanceBroken, HealFailed) as exc:
                return exc

        outcomes = on_ranks(degree, up)
        for g in groups:
            g.close()
        assert isinstance(outcomes[0], TPHealed), outcomes
        assert isinstance(outcomes[1], HealFailed) and "checkpoint cannot be read" in str(outcomes[1]), outcomes
    finally:
        for i in insts:
            i.close()


@pytest.mark.parametrize("op", ["scale-up", "scale-down"])
def test_a_member_failing_mid_move_heals_every_member_to_whole_with_its_requests_recomputed(op):
    """A fault injected into rank 1's exchange (it stops taking part): rank 0's collective times out; both heal to
    whole instances, and every request still ends with the reference's tokens (re-prefilled, never re-emitted)."""
    torch.set_num_threads(1)
    cfg, weights = model("tiny")
    degree = 2
    engines, requests, tokens = decoding_engines(cfg, weights, degree)
    port = free_port()
    groups: list[TPGroup] = on_ranks(degree, lambda r: TPGroup(r, degree, "127.0.0.1", port, timeout_s=3, rendezvous_timeout_s=60))  # type: ignore[assignment]

    def broken_exchange(*args, **kwargs):
        raise InstanceBroken("injected: rank 1 stopped taking part")

    if op == "scale-down":
        on_ranks(degree, lambda r: scale_up(engines[r], groups[r], shard_config(cfg, degree), shard_weights(weights, r, degree)))
        decode_merged(groups, engines, tokens, tokens.at_least(6, requests))
        transform = lambda r: scale_down(engines[r], groups[r], cfg, weights)  # noqa: E731
    else:
        transform = lambda r: scale_up(engines[r], groups[r], shard_config(cfg, degree), shard_weights(weights, r, degree))  # noqa: E731
    groups[1].exchange = broken_exchange  # type: ignore[method-assign]
    outcomes = on_ranks(degree, lambda r: _outcome(transform, r))
    assert all(isinstance(o, InstanceBroken) and "healed" in str(o) for o in outcomes), outcomes
    for g in groups:
        g.close()
    assert sum(len(e.seqs) for e in engines) == len(requests)  # no request lost
    for e in engines:
        assert e.kv.kv_heads_per_block == cfg.num_kv_heads and e.kv.num_blocks == BLOCKS and e.runner.reduce is None
        assert all(s.num_computed == 0 for s in e.seqs.values())  # their KV is not trusted: they re-prefill
        step_until(e, tokens, lambda: False)
    assert tokens.finished == set(requests)
    assert_reference_tokens(cfg, weights, requests, tokens)


def _outcome(fn: Callable[[int], object], rank: int) -> object:
    try:
        return fn(rank)
    except InstanceBroken as exc:
        return exc


def test_a_member_that_cannot_build_its_shard_makes_every_member_heal_and_none_own_a_request_twice():
    """The vote before the commit: rank 1 fails after the exchange (its shard's runner cannot be built); rank 0,
    whose part succeeded, must not adopt rank 1's requests."""
    torch.set_num_threads(1)
    cfg, weights = model("tiny")
    degree = 2
    engines, requests, tokens = decoding_engines(cfg, weights, degree)

    def no_memory(*args, **kwargs):
        raise MemoryError("injected: no memory for the shard")

    engines[1].shard_runner = no_memory  # type: ignore[method-assign]
    port = free_port()
    groups: list[TPGroup] = on_ranks(degree, lambda r: TPGroup(r, degree, "127.0.0.1", port, timeout_s=30, rendezvous_timeout_s=60))  # type: ignore[assignment]
    shard_cfg = shard_config(cfg, degree)

    def up(r: int) -> TransformReport:
        return scale_up(engines[r], groups[r], shard_cfg, shard_weights(weights, r, degree))

    outcomes = on_ranks(degree, lambda r: _outcome(up, r))
    assert all(isinstance(o, InstanceBroken) and "healed" in str(o) for o in outcomes), outcomes
    for g in groups:
        g.close()
    assert sorted(engines[0].seqs) == ["m0-r0", "m0-r1"] and sorted(engines[1].seqs) == ["m1-r0", "m1-r1"]
    for e in engines:
        assert e.kv.kv_heads_per_block == cfg.num_kv_heads and e.cfg is cfg
        step_until(e, tokens, lambda: False)
    assert tokens.finished == set(requests)
    assert_reference_tokens(cfg, weights, requests, tokens)


def test_a_check_failing_on_one_member_refuses_on_every_member_and_changes_nothing():
    """Rank 1 preempts by swapping (its swap copies would hold one member's heads): every member refuses at once,
    none waits in a collective the other never joins, and both go on decoding as whole engines."""
    torch.set_num_threads(1)
    cfg, weights = model("tiny")
    swap = SchedulerConfig(max_num_batched_tokens=64, preemption="swap")
    engines = [Engine(cfg, weights, num_kv_blocks=BLOCKS, block_size=BLOCK, scheduler_config=c) for c in (SCHED, swap)]
    tokens = TokenLog()
    for m, e in enumerate(engines):
        e.add_request(EngineRequest(f"m{m}", prompts(m)[0], SamplingParams(max_tokens=8, ignore_eos=True)))
        step_until(e, tokens, tokens.at_least(2, e.seqs))
    port = free_port()
    groups: list[TPGroup] = on_ranks(2, lambda r: TPGroup(r, 2, "127.0.0.1", port, timeout_s=30, rendezvous_timeout_s=60))  # type: ignore[assignment]
    shard_cfg = shard_config(cfg, 2)
    outcomes = on_ranks(2, lambda r: _refusal(lambda: scale_up(engines[r], groups[r], shard_cfg, shard_weights(weights, r, 2))))
    assert all(isinstance(o, ValueError) and "rank 1: it preempts by swapping" in str(o) for o in outcomes), outcomes
    for g in groups:
        g.close()
    for e in engines:
        assert e.kv.kv_heads_per_block == cfg.num_kv_heads and all(s.num_computed > 0 for s in e.seqs.values())
        step_until(e, tokens, lambda: False)
    for m in range(2):
        ref, margins = reference_greedy(cfg, weights, prompts(m)[0], 8)
        compare_greedy(tokens.by_request[f"m{m}"], ref, margins)


def _refusal(fn: Callable[[], object]) -> object:
    try:
        return fn()
    except ValueError as exc:
        return exc
