"""In-place tensor-parallel transformation, measured (bench/tp.py --transform; shared/engine/tp_transform.py).

Gyges' question: how long does turning `degree` running whole instances into one TP instance (and back) take, as a
share of the time of a step, and how much extra memory does the move need. Everything runs in this process: each
member is a PooledInstance (the memory pool's "host" backend, so its pages are the pool's real accounting) on its
own thread, over a real gloo TPGroup on 127.0.0.1, one torch thread each, as tests/unit/engine/test_tp_transform.py
drives them.

Per row (a model shape, a degree, a pool layout, a target share of each member's KV blocks): every member is filled with running
requests until about that share of its blocks is used (prompts sized to the blocks, stepped until every request has
its first token); one member then times `steps` decode steps as a whole instance (after one untimed step); all
members scale up at once (the time of the slowest member); the merged instance times `steps` decode steps (rank 0
steps, the others follow on their threads); all members scale down at once; the whole instances finish every
request. Reported: the requests, the KV blocks in use, the sub-blocks every member sends per layer (summed over the
members), the most one member held staged at once beside the KV bytes the instance has in use per layer, the pool
pages mapped before the merge, after it and after the split (the move maps and releases none), both transformation
times and each as a multiple of the merged instance's step and of a whole instance's. Two pool layouts: the whole
weights (a member computes on a copy of its shard, given) and the padded MLP (`padded_mlp`: each member computes on
its pool's pages and releases the MLP shards it no longer keeps to its KV first (MLP-first), and takes them back from its
host copy at the split): per row also the weight pages rank 0 released and its KV (sub-)blocks whole and merged.
One untimed merge and split of the empty engines comes first, so the first row does not pay the group's first use.
Afterwards every request's greedy tokens, across the merge and the split, are checked against the dense reference
(teacher-forced; a divergence after a top-2 margin below 1e-3 counts as a near-tie, the project's oracle).

The transformation runs between two iterations (tp_transform.py's "What differs from Gyges"), so its time here is
the whole pause the requests see. The members are threads of one process on a 2-core CPU, sharing its cores and
Python's lock, and every layer's all-reduces go through gloo over loopback: the merged instance's step is many times
a whole one's, which is why the transformation is given as a multiple of both; the figures move with the load.
"""

from __future__ import annotations

import functools
import random
import time
from dataclasses import dataclass
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from kunserve.benchkit.tp_members import TokenLog, free_port, on_ranks, staggered_split
from kunserve.shared.engine.api import EngineRequest, SamplingParams
from kunserve.shared.engine.engine import Engine, SchedulerConfig
from kunserve.shared.engine.pooled import PooledInstance
from kunserve.shared.engine.tensor_parallel import TPFollower, TPGroup, TPLeader
from kunserve.shared.engine.tp_transform import TransformReport, scale_down, scale_up
from kunserve.shared.model.architecture import ModelConfig
from kunserve.shared.model.reference import reference_scores
from kunserve.shared.model.tp_degree import shard_config
from kunserve.shared.model.tp_shard import shard_weights
from kunserve.shared.model.weights import ModelSource, Weights, load_model_source

MIB = 1 << 20
NEAR_TIE = 1e-3  # tests/oracle.py: a divergence after a top-2 margin below this is a near-tie, not an error
BLOCK = 16
PAGE = 256 << 10
REQUESTS_PER_MEMBER = 4
SCHED = SchedulerConfig(max_num_batched_tokens=512)
THREAD_TIMEOUT_S = 300.0

# Larger than the embedded model, 8 KV heads so TP2 and TP4 both split them.
LARGER = ModelConfig(
    vocab_size=4096,
    hidden_size=512,
    num_layers=8,
    num_heads=8,
    num_kv_heads=8,
    intermediate_size=1536,
    head_dim=64,
    qkv_bias=True,
    bos_token_id=1,
    eos_token_id=2,
    name="random-h512-l8",
)


@dataclass(frozen=True)
class Case:
    """One model shape: the degrees it is merged at, each member's pool (weights + KV) and the KV fills."""

    source: ModelSource
    degrees: tuple[int, ...]
    pool_bytes: int
    fills: tuple[float, ...]


def cases(quick: bool) -> list[Case]:
    tiny = load_model_source(None)
    if quick:
        return [Case(tiny, (2,), 28 * MIB, (0.5,))]
    larger = ModelSource(LARGER.name, LARGER, None, 0)
    return [
        Case(tiny, (2,), 32 * MIB, (0.25, 0.75)),
        Case(larger, (2, 4), 160 * MIB, (0.25, 0.75)),
    ]


def _prompts(cfg: ModelConfig, blocks: int, share: float, member: int, seed: int) -> list[list[int]]:
    """REQUESTS_PER_MEMBER prompts that together fill about `share` of `blocks` once prefilled: each ends half a
    block into its last block, so a few decode steps allocate no new block."""
    target = max(REQUESTS_PER_MEMBER, round(share * blocks))
    per = [target // REQUESTS_PER_MEMBER + (i < target % REQUESTS_PER_MEMBER) for i in range(REQUESTS_PER_MEMBER)]
    rng = random.Random(seed * 1009 + member)
    return [[rng.randrange(3, min(cfg.vocab_size, 256)) for _ in range(b * BLOCK - BLOCK // 2)] for b in per]


def _mean_step_ms(engine: Engine, tokens: TokenLog, steps: int) -> float:
    """The mean of `steps` steps after one untimed step (the first after a change allocates its buffers)."""
    tokens.add(engine.step())
    t0 = time.perf_counter()
    for _ in range(steps):
        tokens.add(engine.step())
    return 1e3 * (time.perf_counter() - t0) / steps


def _check_tokens(cfg: ModelConfig, weights: Weights, prompts: dict[str, list[int]], tokens: TokenLog) -> dict[str, int]:
    """Each request's tokens against the dense reference, teacher-forced (tests/oracle.py's rule)."""
    out = {"equal": 0, "near-tie": 0, "differs": 0}
    for rid, prompt in prompts.items():
        got = tokens.by_request[rid]
        ref, margins = reference_scores(cfg, weights, prompt, got)
        first = next((i for i, (g, r) in enumerate(zip(got, ref, strict=True)) if g != r), None)
        out["equal" if first is None else "near-tie" if margins[first] < NEAR_TIE else "differs"] += 1
    return out


def _kv_block_bytes_per_layer(cfg: ModelConfig) -> int:
    return 2 * cfg.num_kv_heads * cfg.head_dim * BLOCK * torch.tensor([], dtype=cfg.torch_dtype).element_size()


def _row(
    case: Case,
    degree: int,
    share: float,
    insts: list[PooledInstance],
    groups: list[TPGroup],
    weights: Weights,
    shards: list[Weights | PooledInstance],
    steps: int,
    seed: int,
) -> dict[str, Any]:
    cfg = case.source.config
    engines = [i.engine for i in insts]
    num_blocks = engines[0].kv.num_blocks
    # the first token, 1 + `steps` whole, 1 + `steps` merged, one per layer of the staggered split, a few after
    max_tokens = 2 * (steps + 1) + cfg.num_layers + 6
    tokens = TokenLog()
    prompts: dict[str, list[int]] = {}
    for m, e in enumerate(engines):
        for i, p in enumerate(_prompts(cfg, num_blocks, share, m, seed)):
            rid = f"m{m}-r{i}"
            prompts[rid] = p
            e.add_request(EngineRequest(rid, p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
        while not all(tokens.by_request.get(rid) for rid in e.seqs):
            tokens.add(e.step())
    whole_step_ms = _mean_step_ms(engines[0], tokens, steps)
    used = [e.allocator.num_used for e in engines]
    mapped_before = sum(i.pool.mapped_count for i in insts)
    weight_pages = insts[0].layout.weight_pages
    shard_cfg = shard_config(cfg, degree)
    up: list[TransformReport] = on_ranks(degree, lambda r: scale_up(engines[r], groups[r], shard_cfg, shards[r]), THREAD_TIMEOUT_S)
    mapped_merged = sum(i.pool.mapped_count for i in insts)
    released = weight_pages - insts[0].layout.weight_pages
    merged_blocks = engines[0].kv.num_blocks
    leader = TPLeader(groups[0])
    leader.attach(engines[0])
    followers = [TPFollower(groups[r], engines[r]) for r in range(1, degree)]
    for f in followers:
        f.start()
    try:
        tp_step_ms = _mean_step_ms(engines[0], tokens, steps)
    finally:
        leader.stop()
        for f in followers:
            f.join(THREAD_TIMEOUT_S)
    broken = [f.broken for f in followers if f.broken]
    if broken:
        raise RuntimeError(f"a follower broke: {broken[0]}")
    down: list[TransformReport] = on_ranks(
        degree, lambda r: scale_down(engines[r], groups[r], cfg, insts[r]), THREAD_TIMEOUT_S
    )
    mapped_after = sum(i.pool.mapped_count for i in insts)
    # the same requests merged again, then split layer by layer, one step between the layers' moves
    on_ranks(degree, lambda r: scale_up(engines[r], groups[r], shard_cfg, shards[r]), THREAD_TIMEOUT_S)
    leader = TPLeader(groups[0])
    leader.attach(engines[0])
    staggered, splits = staggered_split(groups, leader, engines, tokens, cfg, lambda r: insts[r], steps_per_layer=1,
                                        timeout_s=THREAD_TIMEOUT_S)
    if not all(isinstance(x, TransformReport) for x in staggered):
        raise RuntimeError(f"the staggered split failed: {staggered}")
    stats = [x.stats for x in splits if x is not None]
    mapped_staggered = sum(i.pool.mapped_count for i in insts)
    for e in engines:
        while e.has_work():
            tokens.add(e.step())
    if tokens.finished != set(prompts):
        raise RuntimeError(f"requests unfinished after the split: {sorted(set(prompts) - tokens.finished)}")
    scale_up_ms = 1e3 * max(r.seconds for r in up)
    scale_down_ms = 1e3 * max(r.seconds for r in down)
    kv_layer_bytes = sum(used) * _kv_block_bytes_per_layer(cfg)
    return {
        "shape": cfg.name,
        "layers": cfg.num_layers,
        "kv_heads": cfg.num_kv_heads,
        "degree": degree,
        "padded_mlp": insts[0].padded_mlp,
        "weight_pages_released": released,
        "kv_subblocks_merged": merged_blocks,
        "kv_target_share": share,
        "kv_blocks_per_member": num_blocks,
        "kv_used_blocks": sum(used),
        "kv_used_share": sum(used) / (num_blocks * degree),
        "requests": len(prompts),
        "moved_requests_up": up[0].moved_requests,
        "moved_requests_down": down[0].moved_requests,
        "up_sent_subblocks_per_layer": sum(r.sent_subblocks for r in up),
        "down_sent_subblocks_per_layer": sum(r.sent_subblocks for r in down),
        "up_staging_bytes": max(r.staging_bytes for r in up),
        "down_staging_bytes": max(r.staging_bytes for r in down),
        "kv_bytes_in_use_per_layer": kv_layer_bytes,
        "pages_mapped_before": mapped_before,
        "pages_mapped_merged": mapped_merged,
        "pages_mapped_after": mapped_after,
        "pages_unchanged": mapped_before == mapped_merged == mapped_after == mapped_staggered,
        "scale_up_ms": scale_up_ms,
        "scale_down_ms": scale_down_ms,
        "tp_step_ms": tp_step_ms,
        "whole_step_ms": whole_step_ms,
        "stagger_begin_ms": 1e3 * max(x.begin_seconds for x in stats),
        "stagger_layer_ms_max": 1e3 * max(max(x.layer_seconds) for x in stats),
        "stagger_layer_ms_total": 1e3 * max(sum(x.layer_seconds) for x in stats),
        "stagger_layer_ms": [round(1e3 * t, 2) for t in stats[0].layer_seconds],  # rank 0's, last layer first
        "stagger_steps_between": sum(stats[0].steps_between),
        "stagger_compacted_blocks": stats[0].compacted_blocks,
        "scale_up_steps": scale_up_ms / tp_step_ms,
        "scale_down_steps": scale_down_ms / tp_step_ms,
        "scale_up_whole_steps": scale_up_ms / whole_step_ms,
        "scale_down_whole_steps": scale_down_ms / whole_step_ms,
        "staging_share_of_layer_kv": max(r.staging_bytes for r in (*up, *down)) / kv_layer_bytes,
        "tokens": _check_tokens(cfg, weights, prompts, tokens),
    }


def _join_group(degree: int, port: int, rank: int) -> TPGroup:
    return TPGroup(rank, degree, "127.0.0.1", port, timeout_s=120, rendezvous_timeout_s=60)


def _warm_up(case: Case, degree: int, insts: list[PooledInstance], groups: list[TPGroup],
             shards: list[Weights | PooledInstance]) -> None:
    """One untimed merge and split of the empty engines, so the first row does not pay the group's first use."""
    cfg = case.source.config
    shard_cfg = shard_config(cfg, degree)
    on_ranks(degree, lambda r: scale_up(insts[r].engine, groups[r], shard_cfg, shards[r]), THREAD_TIMEOUT_S)
    on_ranks(degree, lambda r: scale_down(insts[r].engine, groups[r], cfg, insts[r]), THREAD_TIMEOUT_S)


def run_transform(quick: bool = False, steps: int | None = None, seed: int = 0) -> dict[str, Any]:
    """Every case's rows (module docstring); `steps` decode steps are timed per instance (3; --quick 2)."""
    steps = steps if steps is not None else 2 if quick else 3
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows: list[dict[str, Any]] = []
    try:
        for case, degree, padded in ((c, d, p) for c in cases(quick) for d in c.degrees
                                     for p in ((True,) if quick else (False, True))):
            weights = case.source.load_weights()
            insts: list[PooledInstance] = []
            groups: list[TPGroup] = []
            try:
                for _ in range(degree):
                    insts.append(
                        PooledInstance(
                            case.source,
                            layer_range=(0, case.source.config.num_layers),
                            pool_bytes=case.pool_bytes,
                            page_size=PAGE,
                            block_size=BLOCK,
                            backend="host",
                            scheduler_config=SCHED,
                            keep_host_copy=padded,  # a padded member refills its released shards from it
                            padded_mlp=padded,
                        )
                    )
                # a padded member computes on its pool's pages; otherwise on a copy of its shard
                shards: list[Weights | PooledInstance] = (
                    list(insts) if padded else [shard_weights(weights, r, degree) for r in range(degree)])
                port = free_port()
                groups = on_ranks(degree, functools.partial(_join_group, degree, port), THREAD_TIMEOUT_S)
                _warm_up(case, degree, insts, groups, shards)
                for share in case.fills:
                    rows.append(_row(case, degree, share, insts, groups, weights, shards, steps, seed))
            finally:
                for g in groups:
                    g.close()
                for i in insts:
                    i.close()
    finally:
        torch.set_num_threads(threads)
    return {"block_size": BLOCK, "page_bytes": PAGE, "steps_timed": steps, "torch_threads": 1, "rows": rows}


def print_transform(result: dict[str, Any]) -> None:
    t = Table(
        title=f"In-place TP transformation (members on threads over gloo, 1 torch thread, {result['block_size']}-token "
        f"blocks, {result['page_bytes'] >> 10} KiB pages; step = mean of {result['steps_timed']} decode steps)"
    )
    for col in (
        "shape",
        "TP",
        "MLP",
        "pages released",
        "KV blocks whole/merged",
        "KV used",
        "reqs",
        "sub-blocks up/down",
        "staging KiB up/down",
        "KV in use KiB/layer",
        "pages before/merged/after",
        "scale-up ms",
        "scale-down ms",
        "staggered: begin / layer max / layers ms",
        "TP step ms",
        "whole step ms",
        "up/down ÷ TP step",
        "÷ whole step",
        "tokens",
    ):
        t.add_column(col, justify="left" if col in ("shape", "tokens") else "right")
    for r in result["rows"]:
        tok = r["tokens"]
        t.add_row(
            r["shape"],
            str(r["degree"]),
            "padded" if r["padded_mlp"] else "whole",
            str(r["weight_pages_released"]),
            f"{r['kv_blocks_per_member']}/{r['kv_subblocks_merged']}",
            f"{100 * r['kv_used_share']:.0f}%",
            str(r["requests"]),
            f"{r['up_sent_subblocks_per_layer']}/{r['down_sent_subblocks_per_layer']}",
            f"{r['up_staging_bytes'] / 1024:,.0f}/{r['down_staging_bytes'] / 1024:,.0f}",
            f"{r['kv_bytes_in_use_per_layer'] / 1024:,.0f}",
            f"{r['pages_mapped_before']}/{r['pages_mapped_merged']}/{r['pages_mapped_after']}",
            f"{r['scale_up_ms']:.1f}",
            f"{r['scale_down_ms']:.1f}",
            f"{r['stagger_begin_ms']:.1f} / {r['stagger_layer_ms_max']:.1f} / {r['stagger_layer_ms_total']:.1f}",
            f"{r['tp_step_ms']:.1f}",
            f"{r['whole_step_ms']:.1f}",
            f"{r['scale_up_steps']:.1f}x / {r['scale_down_steps']:.1f}x",
            f"{r['scale_up_whole_steps']:.0f}x / {r['scale_down_whole_steps']:.0f}x",
            f"{tok['equal']}+{tok['near-tie']} tie" + (f", {tok['differs']} DIFFER" if tok["differs"] else ""),
        )
    t.caption = (
        "MLP: whole weights (a member computes on a copy of its shard) or padded (it releases the MLP shards it no "
        "longer keeps to its KV: pages released, rank 0); KV blocks: rank 0's whole blocks, then its sub-blocks while "
        "merged (1/TP of the heads each); sub-blocks: sent per layer, all members; staging: the most one member held "
        "at once; scale-down: the split of every layer between two steps; staggered: the same requests merged again "
        "and split layer by layer, last layer first, one step between the layers' moves (tp_stagger.py): the pause "
        "before the first layer (checks, the whole weights back, the runner), the longest layer's and all layers' "
        "together; tokens: greedy tokens equal to the dense reference's (+ near-ties)"
    )
    Console(width=220).print(t)
