"""Request routing by Llumnix-style freeness: pure policy, no I/O.

freeness(instance) = free KV blocks - blocks demanded by its queued requests - blocks of requests
this dispatcher routed there that the instance's last stats report does not yet include.
The most-free healthy, *serving* instance gets the request.

Two notions are kept apart:

* healthy: the instance answers (its stats poll succeeds). An unhealthy instance is presumed dead.
* serving: the instance is routable — a whole instance, or the head of a complete pipeline group.
  A healthy instance that is not serving (it dropped layers, is forming a group, or just answered a
  request with FAILED_PRECONDITION) is alive and may become routable again: a request that finds no
  routable instance can wait for it (`may_become_routable`), while one whose every candidate is dead
  fails at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class InstanceLoad:
    instance_id: str
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    queued_demand_blocks: int = 0
    block_size: int = 16
    healthy: bool = False
    report_time: float = 0.0  # dispatcher clock when the report was taken (the poll was sent)
    serving: bool = True  # routable: a whole instance or the head of a complete pipeline group


@dataclass
class _Pending:
    blocks: int
    routed_at: float


@dataclass
class FreenessRouter:
    instances: dict[str, InstanceLoad] = field(default_factory=dict)
    _pending: dict[str, dict[str, _Pending]] = field(default_factory=dict)
    # instance -> dispatcher clock at which it refused a request (FAILED_PRECONDITION): it stays
    # not serving until a report taken after that moment says otherwise.
    _refused_at: dict[str, float] = field(default_factory=dict)

    def update(self, load: InstanceLoad) -> None:
        refused = self._refused_at.get(load.instance_id)
        if refused is not None:
            if load.report_time <= refused:
                # A report taken before the refusal (an older poll answering late) cannot undo it.
                load.serving = False
            else:
                del self._refused_at[load.instance_id]
        self.instances[load.instance_id] = load
        # Requests routed before this report was taken are now part of its numbers.
        pend = self._pending.get(load.instance_id, {})
        for rid in [r for r, p in pend.items() if p.routed_at < load.report_time]:
            del pend[rid]

    def set_healthy(self, instance_id: str, healthy: bool) -> None:
        if instance_id in self.instances:
            self.instances[instance_id].healthy = healthy

    def refused(self, instance_id: str, now: float) -> None:
        """The instance answered a request with "not serving" (FAILED_PRECONDITION) at `now`: it is
        alive but not routable until a stats report taken after `now` says it serves again."""
        self._refused_at[instance_id] = max(now, self._refused_at.get(instance_id, -math.inf))
        if instance_id in self.instances:
            self.instances[instance_id].serving = False

    def freeness(self, instance_id: str) -> float:
        inst = self.instances[instance_id]
        pending = sum(p.blocks for p in self._pending.get(instance_id, {}).values())
        return inst.kv_blocks_total - inst.kv_blocks_used - inst.queued_demand_blocks - pending

    def routable(self, instance_id: str) -> bool:
        inst = self.instances.get(instance_id)
        return inst is not None and inst.healthy and inst.serving

    def choose(self, exclude: set[str] | frozenset[str] = frozenset()) -> str | None:
        best, best_free = None, -math.inf
        for iid in sorted(self.instances):
            if iid in exclude or not self.routable(iid):
                continue
            f = self.freeness(iid)
            if f > best_free:
                best, best_free = iid, f
        return best

    def may_become_routable(self, exclude: set[str] | frozenset[str] = frozenset()) -> bool:
        """Some instance outside `exclude` is alive (healthy), so waiting for a routable one makes sense
        (it is forming a group, dropped layers, or refused a request moments ago). False when every
        candidate is dead or excluded: waiting would only delay the error."""
        return any(inst.healthy for iid, inst in self.instances.items() if iid not in exclude)

    def routed(self, instance_id: str, request_id: str, num_tokens: int, now: float) -> None:
        """Count a request routed to `instance_id` at `now` (the dispatcher clock at routing, which is
        what later reports are compared with) until a report taken after `now` includes it."""
        bs = max(1, self.instances[instance_id].block_size) if instance_id in self.instances else 16
        self._pending.setdefault(instance_id, {})[request_id] = _Pending(-(-num_tokens // bs), now)

    def done(self, instance_id: str, request_id: str) -> None:
        self._pending.get(instance_id, {}).pop(request_id, None)


def serving_from_stats(serving: bool, group_id: str, transitioning: bool, layer_start: int, layer_end: int,
                       num_layers_model: int) -> bool:
    """Whether a worker's stats report makes it routable.

    The worker says so itself (`serving`: a whole instance or the head of a complete pipeline group);
    a worker in the middle of a drop / restore never is. Compatibility fallback: a worker that predates
    the layout fields leaves both `serving` and `group_id` unset (false / empty); it is routable exactly
    when it holds the whole model. A worker that fills the new fields always sets `group_id` (its own id
    when whole), so the fallback never overrides an explicit "not serving". Harmless to keep.
    """
    if transitioning:
        return False
    if serving:
        return True
    if not group_id:
        return num_layers_model > 0 and layer_start == 0 and layer_end == num_layers_model
    return False
