"""Routing units from the workers' latest reports: what the overload policy reasons about. Pure, no I/O.

A *unit* is what the dispatcher routes to (KunServe §4): an undropped instance (one worker holding every
layer), or a pipeline group (workers reporting one ``unit_id``, listed in ``unit_members`` in pipeline order,
``[0]`` being the head that owns the requests).

Load of a unit, in KV blocks (one block = ``block_size`` tokens of one request, over every layer the unit
runs):

- **whole instance**: its own ``kv_blocks_used / kv_blocks_total / queued_demand_blocks`` and the offline
  share of the first and the last (the policy counts online demand only).
- **pipeline group**: every request's KV spans all members (each member keeps that request's KV for its own
  layers), and the head schedules with one block-id space that is valid on every member. So the group's
  capacity is *not* the sum of its members' blocks: it is the head's ``kv_blocks_total``, and the head's
  report carries the group's used / total / queued numbers. The other members' ``kv_blocks_*`` describe the
  same blocks again and are not added.
- **undropped capacity** (the restore threshold's base, §4.4: "below 50 % of the GPU memory without
  drop"): the sum of the members' ``kv_blocks_undropped``, the blocks each had while holding every layer.
  When a member does not report it (0), it is unknown and left ``None`` (the policy then uses the current
  capacity).

Units are left out of the policy's view (and listed in ``Units.skipped`` with the reason) when a member is
missing, unhealthy or stale (the caller passes only fresh reports), when any member is transitioning (a drop
or restore in progress: its numbers are about to change), when members disagree about the group (a report
snapshot straddling a layout change), or when the unit is not routable (a worker holding part of the model
outside a complete group takes no requests of its own).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kunserve.shared.policy.cluster import Unit, WorkerReport
from kunserve.shared.policy.overload import UnitLoad


@dataclass(frozen=True)
class UnitView:
    """A settled, routable unit as the monitor sees it: its structure, its load and its layout epoch."""

    unit: Unit
    load: UnitLoad
    epoch: int = 0                     # the layout epoch its members report

    @property
    def unit_id(self) -> str:
        return self.unit.unit_id


@dataclass(frozen=True)
class Units:
    units: tuple[UnitView, ...] = ()
    skipped: dict[str, str] = field(default_factory=dict)  # unit id -> why it is not in `units`

    @property
    def loads(self) -> list[UnitLoad]:
        return [u.load for u in self.units]

    @property
    def transitioning(self) -> bool:
        return any(r == TRANSITIONING for r in self.skipped.values())


TRANSITIONING = "transitioning"


def build_units(reports: Iterable[WorkerReport]) -> Units:
    """Group the latest reports of the *healthy* workers (the caller drops stale ones) into units.

    Units come out sorted by id, members in pipeline order.
    """
    by_worker: dict[str, WorkerReport] = {}
    for r in reports:
        by_worker[r.worker_id] = r
    claims: dict[str, list[WorkerReport]] = {}
    for r in by_worker.values():
        claims.setdefault(r.unit_id, []).append(r)

    units: list[UnitView] = []
    skipped: dict[str, str] = {}
    for uid in sorted(claims):
        view, why = _build_one(uid, claims[uid], by_worker)
        if view is None:
            skipped[uid] = why
        else:
            units.append(view)
    return Units(tuple(units), skipped)


def _build_one(uid: str, claimants: list[WorkerReport],
               by_worker: dict[str, WorkerReport]) -> tuple[UnitView | None, str]:
    # The member list: every claimant's view must agree (members' reports straddling a layout change do not).
    orders = {r.unit_members for r in claimants}
    if len(orders) != 1:
        return None, "members disagree about the group"
    members = orders.pop()
    if not members or len(set(members)) != len(members) or not all(members):
        return None, "malformed member list"
    missing = [m for m in members if m not in by_worker]
    if missing:
        return None, f"member(s) missing or stale: {', '.join(missing)}"
    stray = sorted(r.worker_id for r in claimants if r.worker_id not in members)
    if stray:
        return None, f"worker(s) claim the group but are not members: {', '.join(stray)}"
    reports = [by_worker[m] for m in members]
    if any(r.unit_id != uid for r in reports):
        return None, "members disagree about the group"
    if any(r.transitioning for r in reports):
        return None, TRANSITIONING
    epochs = {r.epoch for r in reports}
    if len(epochs) != 1:
        return None, "members report different layout epochs"
    head = reports[0]
    if head.is_tp_follower:
        return None, f"tensor-parallel member of {head.tp_members[0]}: rank 0 reports the instance"
    if not head.routable:
        return None, "not serving"
    if len(members) == 1:
        undropped = head.kv_blocks_undropped or None
    else:
        undropped = (sum(r.kv_blocks_undropped for r in reports)
                     if all(r.kv_blocks_undropped > 0 for r in reports) else None)
    load = UnitLoad(
        unit_id=uid,
        used_blocks=head.kv_blocks_used,
        total_blocks=head.kv_blocks_total,        # the group's capacity: the head's block-id space
        queued_demand_blocks=head.queued_demand_blocks,
        head_demand_blocks=None,                  # reports carry all queued demand, not the head-of-line's
        undropped_total_blocks=undropped,
        members=len(members),
        head_wait_s=head.online_waiting_age_s,    # the head owns the unit's queue
        offline_used_blocks=head.offline_kv_blocks_used,
        offline_queued_demand_blocks=head.offline_queued_demand_blocks,
    )
    return UnitView(Unit(uid, tuple(r.member for r in reports)), load, epochs.pop()), ""


def unit_loads(reports: Iterable[WorkerReport]) -> list[UnitLoad]:
    """The policy's input: one UnitLoad per routable, settled unit."""
    return build_units(reports).loads
