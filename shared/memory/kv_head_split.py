"""In-place head split of paged KV when `degree` TP1 members merge into one TP`degree` instance (Gyges §4.1.2),
and the head gather that undoes it.

Pure plan over plain data (no torch): which merged block id each member's block becomes, and the phased exchange
of sub-blocks that puts every head where the merged instance expects it.

With the header-centric block (`kv_layout.py`: `[heads, K/V, tokens, dim]`) the heads of rank r,
`[r * H/degree, (r+1) * H/degree)`, are one contiguous byte range of every block, so a member's KV range read at
`H/degree` heads per block is `num_blocks * degree` **sub-blocks**: physical block b, heads of rank r, is sub-block
`b * degree + r`, at the same bytes. Merged block ids interleave the members: member m's block b becomes merged
block `b * degree + m`, and rank r of the merged instance holds heads r of every merged block at its own sub-block
of that id. So:

- member m's sub-block `b*degree + m` (its own heads of its own block) is already in place: no byte moves;
- for r != m, member m's sub-block `b*degree + r` (heads r of m's block b) goes to member r's sub-block
  `b*degree + m`, and member r's sub-block `b*degree + m` (heads m of r's block b) goes the other way: the only
  moves are pairwise swaps of same-block-index slots between two members.

The swaps run in **phases** of at most `max_phase_subblocks` sub-blocks received per member; in each phase every
member first sends (reads its sources into the staging of that phase) and then every member writes what it received.
Both halves of a swap are in one phase, so no slot is overwritten before it was read, and the extra memory of the
whole exchange is one phase's staging. A slot whose block is unused on the other side is only read: its bytes become
free in place, and the merged instance allocates them (no page is mapped, unmapped or trimmed).

**The inverse, a head gather** (scale-down, TP`degree` -> `degree` TP1 instances, keeping running requests' KV):
`assign_requests` gives every request to one member (its merged blocks must fit the member's `num_blocks` whole
blocks), so every used merged block x has an owner m that keeps it, as whole block y. `plan_head_gather` picks y:
when x = y*degree + m for a free y (x is "m's" slot of its whole-block group), m's own heads of x already lie in
sub-block y*degree + m, which is where heads m of whole block y belong: nothing moves. Every other (x, rank r)
is a move from rank r's sub-block x to owner m's sub-block y*degree + r. Unlike the split's swaps these moves form
chains and cycles (a destination slot may hold another move's source: heads of a different merged block), so a
layer is executed by reading EVERY source of that layer into staging before writing any destination; then the
members read their ranges at `num_kv_heads` heads per block again (`merge_kv_heads`). The extra memory is one
layer's staging per member, `staging_subblocks` sub-blocks (all it receives in that layer, its own in-process
moves included), i.e. about the member's share of the used KV of one layer; layers run one after another.

`kv_major_split_cost` is the baseline: with a K/V-major block (`[K/V, heads, tokens, dim]`, this project's layout
before the header-centric one) a rank's heads are two separate ranges per block (its K heads, its V heads), so the
received heads cannot land in the slots the sent ones leave: the receiver reserves fresh memory for all of them and
each member then trims (copies) its kept heads into compact blocks (Gyges §4.1.2, "migration and trim").
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SubBlockMove:
    """Sub-block `src_slot` of member `src` goes to sub-block `dst_slot` of member `dst` (slots count sub-blocks)."""

    src: int
    src_slot: int
    dst: int
    dst_slot: int


@dataclass(frozen=True)
class HeadSplitPlan:
    """The merge of `degree` members of `num_blocks` blocks each (see the module docstring).

    `block_maps[m]` maps member m's used block ids to merged block ids; `phases` are the exchange's phases;
    `staging_subblocks` is the most sub-blocks one member receives in one phase (its staging bound);
    `in_place` counts the used sub-blocks that stay where they are."""

    degree: int
    num_blocks: int
    num_kv_heads: int
    block_maps: tuple[dict[int, int], ...]
    phases: tuple[tuple[SubBlockMove, ...], ...]
    staging_subblocks: int
    in_place: int

    @property
    def heads_per_rank(self) -> int:
        return self.num_kv_heads // self.degree

    @property
    def merged_num_blocks(self) -> int:
        return self.num_blocks * self.degree

    @property
    def moves(self) -> list[SubBlockMove]:
        return [mv for phase in self.phases for mv in phase]

    def heads(self, rank: int) -> range:
        """The KV heads rank `rank` holds after the merge."""
        return rank_heads(rank, self.degree, self.num_kv_heads)


@dataclass(frozen=True)
class SplitCost:
    """Memory a merge needs per layer beyond the pages the members already hold (bytes, for one member: the one
    that needs the most): `extra_bytes` at the peak (staging, or reserved pages), `copied_bytes` moved inside the
    member's own KV (trimming); `sent_bytes` is what crosses between members, the same for both layouts."""

    extra_bytes: int
    copied_bytes: int
    sent_bytes: int


def rank_heads(rank: int, degree: int, num_kv_heads: int) -> range:
    """KV heads `[rank * H/degree, (rank+1) * H/degree)`: one contiguous byte range of a header-centric block."""
    _check_degree(degree, num_kv_heads)
    if not 0 <= rank < degree:
        raise ValueError(f"rank {rank} is outside [0, {degree})")
    per = num_kv_heads // degree
    return range(rank * per, (rank + 1) * per)


def merged_block_id(member: int, block: int, degree: int) -> int:
    """The merged instance's id of member `member`'s block `block`."""
    return block * degree + member


def sub_block(block: int, rank: int, degree: int) -> int:
    """The sub-block (at H/degree heads per block) holding heads of `rank` of physical block `block`."""
    return block * degree + rank


def plan_head_split(used_blocks: Sequence[Collection[int]], num_blocks: int, num_kv_heads: int, max_phase_subblocks: int) -> HeadSplitPlan:
    """Plan the merge of `len(used_blocks)` members (rank = position), member m using blocks `used_blocks[m]` of its
    `num_blocks`; each phase delivers at most `max_phase_subblocks` sub-blocks to any one member."""
    degree = len(used_blocks)
    _check_degree(degree, num_kv_heads)
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
    if max_phase_subblocks < 1:
        raise ValueError(f"a phase must move at least one sub-block, got max_phase_subblocks={max_phase_subblocks}")
    used: list[set[int]] = []
    for m, blocks in enumerate(used_blocks):
        ids = {int(b) for b in blocks}
        bad = sorted(b for b in ids if not 0 <= b < num_blocks)
        if bad:
            raise ValueError(f"member {m}: block ids outside [0, {num_blocks}): {bad[:8]}")
        used.append(ids)
    maps = tuple({b: merged_block_id(m, b, degree) for b in sorted(ids)} for m, ids in enumerate(used))

    # One group per (block index, member pair) with something to move: the swap's two halves must share a phase.
    groups: list[tuple[SubBlockMove, ...]] = []
    for b in sorted(set().union(*used)):
        for m in range(degree):
            for r in range(m + 1, degree):
                pair = []
                if b in used[m]:
                    pair.append(SubBlockMove(m, sub_block(b, r, degree), r, sub_block(b, m, degree)))
                if b in used[r]:
                    pair.append(SubBlockMove(r, sub_block(b, m, degree), m, sub_block(b, r, degree)))
                if pair:
                    groups.append(tuple(pair))
    phases: list[tuple[SubBlockMove, ...]] = []
    current: list[SubBlockMove] = []
    received = [0] * degree
    for group in groups:
        need = [0] * degree
        for mv in group:
            need[mv.dst] += 1
        if any(received[i] + need[i] > max_phase_subblocks for i in range(degree)):
            phases.append(tuple(current))
            current, received = [], [0] * degree
        current.extend(group)
        received = [received[i] + need[i] for i in range(degree)]
    if current:
        phases.append(tuple(current))
    staging = max((max(sum(1 for mv in ph if mv.dst == i) for i in range(degree)) for ph in phases), default=0)
    return HeadSplitPlan(degree, num_blocks, num_kv_heads, maps, tuple(phases), staging, sum(len(ids) for ids in used))


@dataclass(frozen=True)
class HeadGatherPlan:
    """The scale-down of one TP`degree` instance into `degree` TP1 members of `num_blocks` whole blocks each.

    `block_maps[m]` maps the merged block ids member m keeps to its whole block ids; `moves` address sub-blocks
    (`num_kv_heads / degree` heads per block) on both sides, before and after; `staging_subblocks` is the most
    sub-blocks one member receives in a layer (its staging per layer, own moves included); `in_place` counts the
    used sub-blocks that stay where they are. Execute a layer's moves by reading every source before writing any
    destination (see the module docstring)."""

    degree: int
    num_blocks: int
    num_kv_heads: int
    block_maps: tuple[dict[int, int], ...]
    moves: tuple[SubBlockMove, ...]
    staging_subblocks: int
    in_place: int

    @property
    def heads_per_rank(self) -> int:
        return self.num_kv_heads // self.degree


def assign_requests(blocks: Mapping[str, int], degree: int, num_blocks: int, prefer: Mapping[str, int] | None = None) -> dict[str, int]:
    """Give each request (id -> merged blocks it holds) to one of `degree` members of `num_blocks` whole blocks.

    Greedy, largest requests first (ties by id): to `prefer[request]` when that member has room, else to the member
    with the most free blocks (ties: lowest rank). ValueError when the blocks cannot fit."""
    if degree < 1:
        raise ValueError(f"degree must be >= 1, got {degree}")
    if num_blocks < 0:
        raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
    bad = sorted(rid for rid, n in blocks.items() if n < 0)
    if bad:
        raise ValueError(f"requests with a negative block count: {bad[:8]}")
    prefer = prefer or {}
    bad = sorted(rid for rid, m in prefer.items() if not 0 <= m < degree)
    if bad:
        raise ValueError(f"preferred members outside [0, {degree}) for requests {bad[:8]}")
    need, capacity = sum(blocks.values()), degree * num_blocks
    if need > capacity:
        raise ValueError(f"the requests hold {need} blocks but {degree} members of {num_blocks} blocks hold {capacity}")
    free = [num_blocks] * degree
    out: dict[str, int] = {}
    for rid, n in sorted(blocks.items(), key=lambda kv: (-kv[1], kv[0])):
        m = prefer.get(rid)
        if m is None or free[m] < n:
            m = max(range(degree), key=lambda i: (free[i], -i))
        if free[m] < n:
            raise ValueError(
                f"request {rid!r} holds {n} blocks but no member has room (free blocks per member: "
                f"{free}); the requests hold {need} of {capacity} blocks but do not pack"
            )
        free[m] -= n
        out[rid] = m
    return out


def plan_head_gather(owners: Mapping[int, int], num_blocks: int, num_kv_heads: int, degree: int,
                     sub_blocks: int | None = None) -> HeadGatherPlan:
    """Plan the gather of every used merged block x (`owners[x]`: the member that keeps it) into whole blocks of
    its owner, `num_blocks` per member (see the module docstring). `sub_blocks`: how many merged ids the split
    storage has (default `num_blocks * degree`; a pool layout's split can hold a few more in its tail, which the
    whole blocks do not cover: those always move)."""
    _check_degree(degree, num_kv_heads)
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
    merged = num_blocks * degree if sub_blocks is None else sub_blocks
    if merged < num_blocks * degree:
        raise ValueError(f"{merged} sub-blocks cannot hold {num_blocks} whole blocks of TP{degree}")
    bad = sorted(x for x in owners if not 0 <= x < merged)
    if bad:
        raise ValueError(f"merged block ids outside [0, {merged}): {bad[:8]}")
    bad = sorted(x for x, m in owners.items() if not 0 <= m < degree)
    if bad:
        raise ValueError(f"merged blocks {bad[:8]} are given to members outside [0, {degree})")
    kept: list[list[int]] = [[] for _ in range(degree)]
    for x in sorted(owners):
        kept[owners[x]].append(x)
    for m, xs in enumerate(kept):
        if len(xs) > num_blocks:
            raise ValueError(f"member {m} is given {len(xs)} blocks but holds {num_blocks}")
    maps: list[dict[int, int]] = []
    for m, xs in enumerate(kept):
        # x = y*degree + m for distinct x gives distinct y: every such block keeps its whole-block id.
        target = {x: x // degree for x in xs if x % degree == m and x // degree < num_blocks}
        taken = set(target.values())
        free = (y for y in range(num_blocks) if y not in taken)
        for x in xs:
            if x not in target:
                target[x] = next(free)
        maps.append(dict(sorted(target.items())))
    moves: list[SubBlockMove] = []
    in_place = 0
    for m, mp in enumerate(maps):
        for x, y in mp.items():
            for r in range(degree):
                dst = sub_block(y, r, degree)
                if r == m and x == dst:
                    in_place += 1
                else:
                    moves.append(SubBlockMove(r, x, m, dst))
    staging = max((sum(1 for mv in moves if mv.dst == m) for m in range(degree)), default=0)
    return HeadGatherPlan(degree, num_blocks, num_kv_heads, tuple(maps), tuple(moves), staging, in_place)


def plan_whole_tables(tables: Mapping[str, Sequence[int]], life_blocks: Mapping[str, int],
                      assignment: Mapping[str, int], num_blocks: int, num_kv_heads: int, degree: int,
                      sub_blocks: int | None = None) -> dict[str, list[int]]:
    """Each request's whole-block table on the member `assignment` gives it, for a layer-staggered scale-down
    (tp_stagger.py): the whole blocks `plan_head_gather` picks for the merged blocks it holds now (`tables`), so a
    block already in place stays, then, to `life_blocks[request]`, free whole blocks of that member (lowest first)
    for the tokens it computes while the layers are split one by one. ValueError when a member runs out."""
    owners = {x: assignment[rid] for rid, table in tables.items() for x in table}
    plan = plan_head_gather(owners, num_blocks, num_kv_heads, degree, sub_blocks)
    free = [sorted(set(range(num_blocks)) - set(plan.block_maps[m].values()), reverse=True) for m in range(degree)]
    out: dict[str, list[int]] = {}
    for rid in sorted(tables):
        m = assignment[rid]
        whole = [plan.block_maps[m][x] for x in tables[rid]]
        extra = max(0, life_blocks.get(rid, 0) - len(whole))
        if extra > len(free[m]):
            raise ValueError(f"request {rid!r} needs {extra} more whole blocks on member {m}, which has "
                             f"{len(free[m])} free")
        whole += [free[m].pop() for _ in range(extra)]
        out[rid] = whole
    return out


def plan_layer_gather(targets: Mapping[int, tuple[int, int]], degree: int) -> tuple[SubBlockMove, ...]:
    """The moves of one layer of a layer-staggered scale-down: merged block x goes to whole block y of member m
    (`targets[x] = (m, y)`). As in `plan_head_gather`, heads r of x move from rank r's sub-block x to m's sub-block
    `y*degree + r`, except m's own heads when x is already that slot. Run them reading every source before writing
    any destination."""
    if degree < 2:
        raise ValueError(f"degree must be >= 2, got {degree}")
    moves: list[SubBlockMove] = []
    whole: set[tuple[int, int]] = set()
    for x, (m, y) in sorted(targets.items()):
        if not 0 <= m < degree:
            raise ValueError(f"merged block {x} is given to member {m}, outside [0, {degree})")
        if (m, y) in whole:
            raise ValueError(f"whole block {y} of member {m} is the target of two merged blocks")
        whole.add((m, y))
        for r in range(degree):
            dst = sub_block(y, r, degree)
            if not (r == m and x == dst):
                moves.append(SubBlockMove(r, x, m, dst))
    return tuple(moves)


def header_centric_split_cost(plan: HeadSplitPlan, block_bytes: int) -> SplitCost:
    """Per layer, the in-place split: one phase's staging, nothing copied inside a member."""
    sub = block_bytes // plan.degree
    sent = max((sum(1 for mv in plan.moves if mv.src == m) for m in range(plan.degree)), default=0)
    return SplitCost(plan.staging_subblocks * sub, 0, sent * sub)


def kv_major_split_cost(used_blocks: Sequence[Collection[int]], num_kv_heads: int, block_bytes: int, page_size: int) -> SplitCost:
    """Per layer, the same merge over K/V-major blocks: a member's kept heads are two ranges per block (K and V), so
    it reserves whole pages for every sub-block it receives before the holes its sends leave can be reused, and
    trims (copies) its kept heads of every used block into compact blocks."""
    degree = len(used_blocks)
    _check_degree(degree, num_kv_heads)
    sub = block_bytes // degree
    counts = [len(set(b)) for b in used_blocks]
    worst_extra = worst_copy = worst_sent = 0
    for r in range(degree):
        incoming = sum(c for m, c in enumerate(counts) if m != r) * sub
        worst_extra = max(worst_extra, -(-incoming // page_size) * page_size)
        worst_copy = max(worst_copy, counts[r] * sub)
        worst_sent = max(worst_sent, counts[r] * (degree - 1) * sub)
    return SplitCost(worst_extra, worst_copy, worst_sent)


def _check_degree(degree: int, num_kv_heads: int) -> None:
    if degree < 2:
        raise ValueError(f"a head split needs at least 2 members, got {degree}")
    if num_kv_heads % degree:
        raise ValueError(f"degree {degree} does not divide the {num_kv_heads} KV heads")


__all__ = [
    "HeadGatherPlan",
    "HeadSplitPlan",
    "SplitCost",
    "SubBlockMove",
    "assign_requests",
    "header_centric_split_cost",
    "kv_major_split_cost",
    "merged_block_id",
    "plan_head_gather",
    "plan_head_split",
    "rank_heads",
    "sub_block",
]
