"""Layout transitions between routing units (KunServe §4.1–§4.4): pure, no I/O.

A *unit* is what the dispatcher routes to: a whole instance (one member) or a pipeline group (members in
pipeline order, each holding a contiguous layer range; members[0] is the head, which owns the requests).
A drop merges units into a group (whole instances, or existing groups: two pairs into a quad), a restore
splits a group back (a quad into pairs, a pair into whole instances); both are one *transition* from old
units to new units over the same workers, and nothing here depends on how many members either side has.

Every request keeps its KV: for each layer, its blocks live on the old unit's member holding that layer
(at the old unit's block ids, which are the same on every member of a group: the head schedules one
block-id space) and must end on the new unit's member holding that layer, at new block ids. `kv_flows`
lists, for every (source, destination) pair of workers, which requests' layers move; a pair with
source == destination is a local renumbering. Both sides compute the same flows from the same spec, so a
receiver knows exactly which messages to wait for and how to slice them.

`assign_tables` gives every request its block table in its new unit (compact ids from 0, one block per old
block), refusing a transition whose requests do not fit (nothing has changed then: the caller aborts).
`assign_restore_targets` spreads a group's requests over the instances it splits into. `weight_pieces` says
who sends a worker each layer it holds after a transition but not before (§4.4: a restore pulls the missing
layers from a peer of the old group, not from a DRAM copy of the model).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kunserve.shared.policy.cluster import Unit


class TransitionError(ValueError):
    """The transition cannot be planned (unknown worker, bad ranges, requests that do not fit)."""


@dataclass
class SeqMove:
    """One request's part in a transition (its engine state travels separately, as SeqState)."""

    request_id: str
    old_unit: str
    new_unit: str
    old_blocks: tuple[int, ...]
    new_blocks: tuple[int, ...] = ()


@dataclass(frozen=True)
class FlowPart:
    request_id: str
    layer_start: int
    layer_end: int
    old_blocks: tuple[int, ...]
    new_blocks: tuple[int, ...]

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start


@dataclass
class Flow:
    """Everything one worker sends one other worker (or keeps, when src == dst), in a fixed order."""

    src: str
    dst: str
    parts: list[FlowPart] = field(default_factory=list)

    def num_block_layers(self) -> int:
        """How many (layer, block) KV slabs travel: the message is that many blocks long."""
        return sum(p.num_layers * len(p.old_blocks) for p in self.parts)


@dataclass(frozen=True)
class WeightPiece:
    """Layers [layer_start, layer_end) that `dst` gains in a transition, sent by `src`, which holds them before."""

    src: str
    dst: str
    layer_start: int
    layer_end: int


def check_unit(unit: Unit, num_layers: int) -> None:
    """The unit's members must tile [0, num_layers) in pipeline order."""
    problem = unit.tiling_problem(num_layers)
    if problem is not None:
        raise TransitionError(problem)


def check_units(old: Sequence[Unit], new: Sequence[Unit], num_layers: int) -> None:
    """Same workers on both sides, each in exactly one unit; every unit tiles the model."""
    def workers(units: Sequence[Unit]) -> list[str]:
        return [w for u in units for w in u.worker_ids]

    for units in (old, new):
        ws = workers(units)
        if len(set(ws)) != len(ws):
            raise TransitionError(f"a worker appears twice in units {[u.worker_ids for u in units]}")
        for u in units:
            check_unit(u, num_layers)
    if sorted(workers(old)) != sorted(workers(new)):
        raise TransitionError(f"old units hold {sorted(workers(old))}, new units {sorted(workers(new))}: "
                              "a transition keeps the same workers")
    for w in workers(new):
        o = _find(old, w).member(w)
        n = _find(new, w).member(w)
        assert o is not None and n is not None
        if max(o.layer_start, n.layer_start) >= min(o.layer_end, n.layer_end):
            raise TransitionError(f"worker {w}: new range {n.range} does not overlap its old range {o.range} "
                                  "(it would have to reload every layer)")


def _find(units: Iterable[Unit], worker_id: str) -> Unit:
    for u in units:
        if worker_id in u.worker_ids:
            return u
    raise TransitionError(f"worker {worker_id!r} is in no unit")


def unit_of(units: Iterable[Unit], worker_id: str) -> Unit:
    return _find(units, worker_id)


def assign_tables(moves: Sequence[SeqMove], new_units: Sequence[Unit],
                  old_heads: dict[str, str] | None = None) -> list[SeqMove]:
    """New block tables per new unit. Without `old_heads`: compact ids from 0 in the order given. With it
    (old unit id -> its head worker): a request whose new unit has the same head keeps its ids when they fit
    the unit's kv_blocks (its KV on that head then stays where it is: no copy), and the others get the
    lowest ids left, in the order given. Raises TransitionError when a unit's requests need more blocks than
    its kv_blocks."""
    by_id = {u.unit_id: u for u in new_units}
    taken: dict[str, set[int]] = {u.unit_id: set() for u in new_units}
    kept: dict[str, tuple[int, ...]] = {}
    for m in moves:
        if m.new_unit not in by_id:
            raise TransitionError(f"request {m.request_id}: unknown new unit {m.new_unit!r}")
        u = by_id[m.new_unit]
        if (old_heads is not None and old_heads.get(m.old_unit) == u.head and m.old_blocks
                and max(m.old_blocks) < u.kv_blocks and not taken[u.unit_id] & set(m.old_blocks)):
            kept[m.request_id] = m.old_blocks
            taken[u.unit_id].update(m.old_blocks)
    out = []
    cursor = {uid: 0 for uid in by_id}
    for m in moves:
        if m.request_id in kept:
            out.append(SeqMove(m.request_id, m.old_unit, m.new_unit, m.old_blocks, m.old_blocks))
            continue
        ids: list[int] = []
        t = taken[m.new_unit]
        c = cursor[m.new_unit]
        while len(ids) < len(m.old_blocks):
            if c not in t:
                ids.append(c)
            c += 1
        cursor[m.new_unit] = c
        t.update(ids)
        out.append(SeqMove(m.request_id, m.old_unit, m.new_unit, m.old_blocks, tuple(ids)))
    for uid, t in taken.items():
        need = len(t)
        top = max(t) + 1 if t else 0
        if need > by_id[uid].kv_blocks or top > by_id[uid].kv_blocks:
            raise TransitionError(f"unit {uid}: its requests hold {need} KV blocks but it has {by_id[uid].kv_blocks}")
    return out


def assign_restore_targets(moves: Sequence[SeqMove], capacity: dict[str, int]) -> list[SeqMove]:
    """Send each request (largest first) to the new unit with the most free blocks; ties by id. Raises
    TransitionError when one does not fit anywhere."""
    free = dict(capacity)
    target: dict[str, str] = {}
    for m in sorted(moves, key=lambda m: (-len(m.old_blocks), m.request_id)):
        best = max(sorted(free), key=lambda u: free[u]) if free else None
        if best is None or free[best] < len(m.old_blocks):
            raise TransitionError(f"request {m.request_id} ({len(m.old_blocks)} KV blocks) fits in no instance "
                                  f"after the restore (free: {free})")
        free[best] -= len(m.old_blocks)
        target[m.request_id] = best
    return [SeqMove(m.request_id, m.old_unit, target[m.request_id], m.old_blocks) for m in moves]


def kv_flows(old: Sequence[Unit], new: Sequence[Unit], moves: Sequence[SeqMove]) -> dict[tuple[str, str], Flow]:
    """(src, dst) -> Flow for every pair that moves at least one block, parts ordered by request then layer."""
    old_by = {u.unit_id: u for u in old}
    new_by = {u.unit_id: u for u in new}
    flows: dict[tuple[str, str], Flow] = {}
    for m in sorted(moves, key=lambda m: m.request_id):
        if not m.old_blocks:
            continue
        if len(m.new_blocks) != len(m.old_blocks):
            raise TransitionError(f"request {m.request_id}: {len(m.old_blocks)} old blocks, {len(m.new_blocks)} new")
        if m.old_unit not in old_by or m.new_unit not in new_by:
            raise TransitionError(f"request {m.request_id}: unknown unit {m.old_unit!r} -> {m.new_unit!r}")
        ou, nu = old_by[m.old_unit], new_by[m.new_unit]
        for s in ou.members:
            for d in nu.members:
                lo, hi = max(s.layer_start, d.layer_start), min(s.layer_end, d.layer_end)
                if lo >= hi:
                    continue
                if s.worker_id == d.worker_id and m.old_blocks == m.new_blocks:
                    continue  # stays in place on this worker: nothing to copy
                f = flows.setdefault((s.worker_id, d.worker_id), Flow(s.worker_id, d.worker_id))
                f.parts.append(FlowPart(m.request_id, lo, hi, m.old_blocks, m.new_blocks))
    return flows


def weight_pieces(old: Sequence[Unit], new: Sequence[Unit]) -> list[WeightPiece]:
    """Every layer a worker holds in `new` but not in `old`, with the member of its old unit that holds it
    (a unit tiles the model, so exactly one does, and it is never the worker itself). Consecutive layers from
    one source form one piece; pieces ordered by destination, then layer. Sender and receiver compute the
    same pieces from the same spec, so a receiver knows what to wait for and from whom."""
    pieces: list[WeightPiece] = []
    for unit in sorted(new, key=lambda u: u.unit_id):
        for d in sorted(unit.members, key=lambda m: m.worker_id):
            ou = _find(old, d.worker_id)
            o = ou.member(d.worker_id)
            assert o is not None
            for layer in range(d.layer_start, d.layer_end):
                if o.layer_start <= layer < o.layer_end:
                    continue
                src = next((m.worker_id for m in ou.members if m.layer_start <= layer < m.layer_end), None)
                if src is None:
                    raise TransitionError(f"worker {d.worker_id} gains layer {layer}, which no member of its old "
                                          f"unit {ou.unit_id} holds")
                last = pieces[-1] if pieces else None
                if last is not None and last.dst == d.worker_id and last.src == src and last.layer_end == layer:
                    pieces[-1] = WeightPiece(src, d.worker_id, last.layer_start, layer + 1)
                else:
                    pieces.append(WeightPiece(src, d.worker_id, layer, layer + 1))
    return pieces
