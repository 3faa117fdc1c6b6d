"""Drop and restore plans for parameter-centric memory management (KunServe §4.1, Fig. 6): pure, no I/O.

Drop (``plan_drop``): groups are instances or pipeline groups; each group holds exactly one copy of the
model's layers, split into contiguous ranges among its members in pipeline order. Under a memory
requirement R, the greedy of Fig. 6 pops the two smallest groups from a min-heap (by member count),
merges them, counts the layers both held (``Lg0 ∩ Lg1``: a whole model copy) as freed, pushes the merged
group back, and stops as soon as freed >= R, when one group is left, or when the smallest possible merge
would exceed ``max_group_size`` (or the layer count). O(N log N) in the number of groups. Few merges of
small groups = few pipeline stages per request, which is what costs performance (Fig. 5).

Every group that changed gets a balanced contiguous split of the model's layers among its members
(2 members: [0, L/2), [L/2, L); remainders go to the first stages). Members are put in pipeline order by
the midpoint of the range they hold now, so that each new range lies inside the old one wherever that is
possible: the drop then only unmaps layers and loads nothing (``load`` lists what must be fetched
otherwise). When R cannot be met, the plan says so (``met`` False, ``autoscale_needed``, fallback
``"kv_centric"``) and still carries the best-effort merges; the caller decides whether to apply them.

Existing groups merge like instances (§5.6: a second drop while dropped): two pairs become a quad whose
members each keep half of the range they held, so the second drop also only unmaps layers.

Restore (``plan_split``) is Fig. 6 run backwards one merge at a time (§4.4): a group splits into two
groups of balanced sizes (a quad into pairs, a pair into whole instances), each member taking the new range
that overlaps the one it holds, so it only fetches the layers next to its own.

Groups and instances are `cluster.Unit`s of `cluster.Member`s (a whole instance is a one-member unit).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kunserve.shared.policy.cluster import Member, Range, Unit


@dataclass(frozen=True)
class ModelCost:
    """What the model's layers and KV cost. ``layer_bytes``: weight bytes of one layer (an int when all
    layers are alike, else one int per layer); ``kv_bytes_per_token``: KV bytes of one token in one layer."""

    num_layers: int
    layer_bytes: int | tuple[int, ...]
    kv_bytes_per_token: int = 0
    block_size: int = 16

    def __post_init__(self) -> None:
        if self.num_layers <= 0:
            raise ValueError("num_layers must be > 0")
        if isinstance(self.layer_bytes, Sequence):
            if len(self.layer_bytes) != self.num_layers:
                raise ValueError(f"{len(self.layer_bytes)} layer sizes for {self.num_layers} layers")
            object.__setattr__(self, "layer_bytes", tuple(int(b) for b in self.layer_bytes))
        if self.block_size <= 0:
            raise ValueError("block_size must be > 0")

    def bytes_of(self, start: int, end: int) -> int:
        if end <= start:
            return 0
        if isinstance(self.layer_bytes, tuple):
            return sum(self.layer_bytes[start:end])
        return (end - start) * self.layer_bytes

    @property
    def model_bytes(self) -> int:
        return self.bytes_of(0, self.num_layers)

    @property
    def block_bytes(self) -> int:
        """KV bytes of one block of the whole model (all layers): the unit the cluster's demand is in."""
        if self.kv_bytes_per_token <= 0:
            raise ValueError("kv_bytes_per_token is needed to convert blocks to bytes")
        return self.block_size * self.kv_bytes_per_token * self.num_layers

    def blocks_to_bytes(self, blocks: int) -> int:
        return blocks * self.block_bytes

    def bytes_to_blocks(self, nbytes: int) -> int:
        """Whole-model KV blocks that ``nbytes`` of freed memory holds (rounded down)."""
        return nbytes // self.block_bytes


@dataclass(frozen=True)
class Assignment:
    """One member's new layer range, and what changes on it."""

    worker_id: str
    layer_start: int
    layer_end: int
    old_start: int
    old_end: int
    drop: tuple[Range, ...]        # layers it holds now and gives up
    load: tuple[Range, ...]        # layers it must fetch (empty for a well-aligned drop)
    freed_bytes: int               # weight bytes released on it (negative when it grows)

    @property
    def range(self) -> Range:
        return (self.layer_start, self.layer_end)


@dataclass(frozen=True)
class PlannedUnit:
    unit_id: str
    members: tuple[Assignment, ...]  # pipeline order
    merged_from: tuple[str, ...]     # the previous groups' ids (one id: unchanged / split part)

    @property
    def changed(self) -> bool:
        return any(m.range != (m.old_start, m.old_end) for m in self.members)

    @property
    def size(self) -> int:
        return len(self.members)


@dataclass(frozen=True)
class DropPlan:
    units: tuple[PlannedUnit, ...]
    merges: tuple[tuple[str, str, str], ...]  # (group a, group b, merged group id), in order
    required_bytes: int
    freed_bytes: int                          # sum over merges of the duplicated layers' bytes (Fig. 6)
    met: bool
    load_bytes: int = 0                       # weights some member must fetch (0 for aligned drops)

    @property
    def autoscale_needed(self) -> bool:
        return not self.met

    @property
    def fallback(self) -> str | None:
        """None when the plan frees R; else handle the rest KV-centrically (recompute/swap/migrate)."""
        return None if self.met else "kv_centric"

    @property
    def changed_units(self) -> tuple[PlannedUnit, ...]:
        return tuple(g for g in self.units if len(g.merged_from) > 1)

    @property
    def net_freed_bytes(self) -> int:
        return sum(m.freed_bytes for g in self.units for m in g.members)


# ---------------------------------------------------------------------- helpers


def balanced_split(num_layers: int, parts: int) -> list[Range]:
    """Contiguous ranges covering [0, num_layers), sizes differing by at most one (larger ones first)."""
    if not 0 < parts <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {parts} stages")
    base, extra = divmod(num_layers, parts)
    out, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


def _minus(a: Range, b: Range) -> tuple[Range, ...]:
    """Layers of a not in b (0, 1 or 2 ranges)."""
    out = []
    if a[0] < min(a[1], b[0]):
        out.append((a[0], min(a[1], b[0])))
    if max(a[0], b[1]) < a[1]:
        out.append((max(a[0], b[1]), a[1]))
    return tuple(out)


def _check_unit(g: Unit, num_layers: int) -> None:
    if not g.members:
        raise ValueError(f"group {g.unit_id} has no members")
    ranges = sorted(i.range for i in g.members)
    pos = 0
    for s, e in ranges:
        if s != pos or e <= s:
            raise ValueError(f"group {g.unit_id} does not hold layers [0, {num_layers}) exactly once: "
                             f"{[i.range for i in g.members]}")
        pos = e
    if pos != num_layers:
        raise ValueError(f"group {g.unit_id} holds layers up to {pos}, the model has {num_layers}")


def unit_id_for(worker_ids: Iterable[str]) -> str:
    """A unit's id: its members' ids in pipeline order joined by "+" (a whole instance: its worker's id)."""
    return "+".join(worker_ids)


def pipeline_order(members: Sequence[Member]) -> list[Member]:
    """The order a merged group lays its members out in: by the midpoint of the range each holds now (then
    start, then id), so that each new range lies inside the old one wherever that is possible."""
    return sorted(members, key=lambda i: (i.layer_start + i.layer_end, i.layer_start, i.worker_id))


def merged_members(members: Sequence[Member], num_layers: int) -> tuple[Member, ...]:
    """The members of the group ``members`` merge into, in pipeline order with their new ranges (a balanced
    split; transfer addresses kept)."""
    order = pipeline_order(members)
    return tuple(Member(m.worker_id, s, e, m.transfer_address)
                 for m, (s, e) in zip(order, balanced_split(num_layers, len(order))))


def assign_layers(members: Sequence[Member], model: ModelCost) -> tuple[Assignment, ...]:
    """A balanced contiguous split among ``members``, in ``pipeline_order``."""
    order = pipeline_order(members)
    out = []
    for inst, (s, e) in zip(order, balanced_split(model.num_layers, len(order))):
        old = inst.range
        drop, load = _minus(old, (s, e)), _minus((s, e), old)
        out.append(Assignment(inst.worker_id, s, e, old[0], old[1], drop, load,
                              model.bytes_of(*old) - model.bytes_of(s, e)))
    return tuple(out)


def _unchanged(g: Unit) -> PlannedUnit:
    return PlannedUnit(g.unit_id, tuple(Assignment(i.worker_id, i.layer_start, i.layer_end, i.layer_start,
                                                     i.layer_end, (), (), 0) for i in g.members), (g.unit_id,))


# ---------------------------------------------------------------------- drop


def plan_drop(groups: Sequence[Unit], model: ModelCost, required_bytes: int | None = None, *,
              required_blocks: int | None = None, max_group_size: int | None = None) -> DropPlan:
    """KunServe Fig. 6. R in bytes, or in whole-model KV blocks (converted with ``model.block_bytes``)."""
    if (required_bytes is None) == (required_blocks is None):
        raise ValueError("give exactly one of required_bytes and required_blocks")
    r = required_bytes if required_bytes is not None else model.blocks_to_bytes(required_blocks or 0)
    if r < 0:
        raise ValueError("the requirement must be >= 0")
    ids = [g.unit_id for g in groups]
    if len(set(ids)) != len(ids):
        raise ValueError(f"duplicate group ids in {ids}")
    seen: set[str] = set()
    for g in groups:
        _check_unit(g, model.num_layers)
        for i in g.members:
            if i.worker_id in seen:
                raise ValueError(f"worker {i.worker_id} is in two groups")
            seen.add(i.worker_id)
    limit = model.num_layers if max_group_size is None else min(max_group_size, model.num_layers)

    # heap entries: (size, group id, instances, ids of the original groups merged into it)
    heap: list[tuple[int, str, tuple[Member, ...], tuple[str, ...]]] = [
        (g.size, g.unit_id, g.members, (g.unit_id,)) for g in groups]
    heapq.heapify(heap)
    freed, merges = 0, []
    while len(heap) >= 2 and freed < r:
        if heap[0][0] + min(heap[1:3])[0] > limit:  # the second smallest is a child of the root
            break  # the smallest possible merge is already too deep a pipeline
        s0, id0, inst0, from0 = heapq.heappop(heap)
        s1, id1, inst1, from1 = heapq.heappop(heap)
        held0 = {layer for i in inst0 for layer in range(*i.range)}
        held1 = {layer for i in inst1 for layer in range(*i.range)}
        duplicated = held0 & held1
        freed += sum(model.bytes_of(layer, layer + 1) for layer in duplicated)
        new_id = min(id0, id1)
        merges.append((id0, id1, new_id))
        heapq.heappush(heap, (s0 + s1, new_id, inst0 + inst1, from0 + from1))

    by_id = {g.unit_id: g for g in groups}
    planned = []
    for _size, gid, insts, merged_from in sorted(heap, key=lambda e: e[1]):
        if len(merged_from) == 1:
            planned.append(_unchanged(by_id[gid]))
        else:
            planned.append(PlannedUnit(gid, assign_layers(insts, model), tuple(sorted(merged_from))))
    load = sum(model.bytes_of(*rng) for g in planned for m in g.members for rng in m.load)
    return DropPlan(tuple(planned), tuple(merges), r, freed, freed >= r, load)


# ---------------------------------------------------------------------- restore


def plan_split(group: Unit, num_layers: int, parts: int = 2) -> tuple[Unit, ...]:
    """Undo merges of ``group`` (§4.4): the units it splits into, ``parts`` of them with member counts as even
    as possible (larger first; ``parts`` = its size: whole instances), members in pipeline order.

    Every (new unit, stage) slot gets a balanced range; slots sorted by the midpoint of their range (then unit)
    are matched with the members in pipeline order, so each member's new range holds the layers it holds now
    whenever the group came from merges like the planner's (a quad of pairs: each member of the quad takes the
    half its old pair gave it, and only fetches the other quarter). When a split that keeps every member on a
    layer it holds does not exist, it returns whole instances, which always do."""
    _check_unit(group, num_layers)
    n = group.size
    if not 2 <= parts <= n:
        raise ValueError(f"group {group.unit_id} of {n} members cannot split into {parts} units")
    members = sorted(group.members, key=lambda m: m.layer_start)
    sizes = [e - s for s, e in balanced_split(n, parts)]
    slots = sorted(((unit, stage, rng) for unit, size in enumerate(sizes)
                    for stage, rng in enumerate(balanced_split(num_layers, size))),
                   key=lambda slot: (slot[2][0] + slot[2][1], slot[0], slot[1]))
    placed: list[list[Member]] = [[] for _ in sizes]
    for member, (unit, _stage, (s, e)) in sorted(zip(members, slots), key=lambda pair: pair[1][:2]):
        if max(s, member.layer_start) >= min(e, member.layer_end):
            return tuple(Unit(m.worker_id, (Member(m.worker_id, 0, num_layers, m.transfer_address),)) for m in members)
        placed[unit].append(Member(member.worker_id, s, e, member.transfer_address))
    return tuple(Unit(unit_id_for(m.worker_id for m in ms), tuple(ms)) for ms in placed)
