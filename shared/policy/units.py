"""Routing units from the workers' latest stats: what the overload policy reasons about. Pure, no I/O.

A *unit* is what the dispatcher routes to (KunServe §4): an undropped instance (one worker holding every
layer), or a pipeline group (workers sharing a ``group_id``, listed in ``group_members`` in pipeline order,
``[0]`` being the head that owns the requests).

Load of a unit, in KV blocks (one block = ``block_size`` tokens of one request, over every layer the unit
runs):

- **whole instance**: its own ``kv_blocks_used / kv_blocks_total / queued_demand_blocks``.
- **pipeline group**: every request's KV spans all members (each member keeps that request's KV for its own
  layers), and the head schedules with one block-id space that is valid on every member. So the group's
  capacity is *not* the sum of its members' blocks: it is the head's ``kv_blocks_total``, and the head's
  stats carry the group's used / total / queued numbers. The other members' ``kv_blocks_*`` describe the
  same blocks again and are not added.
- **undropped capacity** (the restore threshold's base, §4.4: "below 50 % of the GPU memory without
  drop"): the sum of the members' ``kv_blocks_undropped``, the blocks each had while holding every layer.
  When a member does not report it (0), it is unknown and left ``None`` (the policy then uses the current
  capacity).

Units are left out of the policy's view (and listed in ``Units.skipped`` with the reason) when a member is
missing, unhealthy or stale (the caller passes only fresh stats), when any member is transitioning (a drop
or restore in progress: its numbers are about to change), when members disagree about the group (a stats
snapshot straddling a layout change), or when the unit is not routable (a worker holding part of the model
outside a complete group takes no requests of its own).

Workers that predate the unit fields report an empty ``group_id``: such a worker is a whole unit of its own,
routable when it holds every layer.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kunserve.shared.policy.overload import UnitLoad
from kunserve.v1 import common_pb2


@dataclass(frozen=True)
class Unit:
    unit_id: str                       # the group id (a whole worker's own id)
    members: tuple[str, ...]           # pipeline order; [0] is the head
    load: UnitLoad
    epoch: int = 0                     # the layout epoch its members report

    @property
    def head(self) -> str:
        return self.members[0]

    @property
    def is_group(self) -> bool:
        return len(self.members) > 1


@dataclass(frozen=True)
class Units:
    units: tuple[Unit, ...] = ()
    skipped: dict[str, str] = field(default_factory=dict)  # unit id -> why it is not in `units`

    @property
    def loads(self) -> list[UnitLoad]:
        return [u.load for u in self.units]

    @property
    def transitioning(self) -> bool:
        return any(r == TRANSITIONING for r in self.skipped.values())


TRANSITIONING = "transitioning"


def _holds_every_layer(s: common_pb2.WorkerStats) -> bool:
    return s.num_layers_model > 0 and s.layer_start == 0 and s.layer_end == s.num_layers_model


def group_key(s: common_pb2.WorkerStats) -> str:
    """The unit a worker belongs to: its ``group_id``, or its own id when it reports none."""
    return s.group_id or s.worker_id


def build_units(stats: Iterable[common_pb2.WorkerStats]) -> Units:
    """Group the latest stats of the *healthy* workers (the caller drops stale ones) into units.

    Units come out sorted by id, members in pipeline order.
    """
    by_worker: dict[str, common_pb2.WorkerStats] = {}
    for s in stats:
        by_worker[s.worker_id] = s
    claims: dict[str, list[common_pb2.WorkerStats]] = {}
    for s in by_worker.values():
        claims.setdefault(group_key(s), []).append(s)

    units: list[Unit] = []
    skipped: dict[str, str] = {}
    for gid in sorted(claims):
        claimants = claims[gid]
        unit, why = _build_one(gid, claimants, by_worker)
        if unit is None:
            skipped[gid] = why
        else:
            units.append(unit)
    return Units(tuple(units), skipped)


def _build_one(gid: str, claimants: list[common_pb2.WorkerStats],
               by_worker: dict[str, common_pb2.WorkerStats]) -> tuple[Unit | None, str]:
    # The member list: every claimant's view must agree (members' stats straddling a layout change do not).
    orders = {tuple(s.group_members) or (s.worker_id,) for s in claimants}
    if len(orders) != 1:
        return None, "members disagree about the group"
    members = orders.pop()
    if len(set(members)) != len(members) or not all(members):
        return None, "malformed member list"
    missing = [m for m in members if m not in by_worker]
    if missing:
        return None, f"member(s) missing or stale: {', '.join(missing)}"
    stray = sorted(s.worker_id for s in claimants if s.worker_id not in members)
    if stray:
        return None, f"worker(s) claim the group but are not members: {', '.join(stray)}"
    member_stats = [by_worker[m] for m in members]
    if any(group_key(s) != gid for s in member_stats):
        return None, "members disagree about the group"
    if any(s.transitioning for s in member_stats):
        return None, TRANSITIONING
    epochs = {s.epoch for s in member_stats}
    if len(epochs) != 1:
        return None, "members report different layout epochs"
    head = member_stats[0]
    if len(members) == 1:
        routable = head.serving or (not head.group_id and _holds_every_layer(head))
    else:
        routable = head.serving
    if not routable:
        return None, "not serving"
    if len(members) == 1:
        undropped = head.kv_blocks_undropped or None
    else:
        undropped = (sum(s.kv_blocks_undropped for s in member_stats)
                     if all(s.kv_blocks_undropped > 0 for s in member_stats) else None)
    load = UnitLoad(
        unit_id=gid,
        used_blocks=head.kv_blocks_used,
        total_blocks=head.kv_blocks_total,        # the group's capacity: the head's block-id space
        queued_demand_blocks=head.queued_demand_blocks,
        head_demand_blocks=None,                  # stats carry all queued demand, not the head-of-line's
        undropped_total_blocks=undropped,
        members=len(members),
        head_wait_s=head.oldest_waiting_age_s,    # the head owns the unit's queue
    )
    return Unit(gid, members, load, epochs.pop()), ""


def unit_loads(stats: Iterable[common_pb2.WorkerStats]) -> list[UnitLoad]:
    """The policy's input: one UnitLoad per routable, settled unit."""
    return build_units(stats).loads
