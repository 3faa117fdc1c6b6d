"""Request routing by Llumnix-style freeness: pure policy, no I/O.

freeness(instance) = free KV blocks - blocks demanded by its queued requests - blocks of requests
this dispatcher routed there that the instance's last stats report does not yet include.
The most-free healthy instance gets the request.
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
    report_time: float = 0.0  # dispatcher clock when the report was taken
    serving: bool = True  # holds the whole model (a worker that dropped layers serves only in its group)


@dataclass
class _Pending:
    blocks: int
    routed_at: float


@dataclass
class FreenessRouter:
    instances: dict[str, InstanceLoad] = field(default_factory=dict)
    _pending: dict[str, dict[str, _Pending]] = field(default_factory=dict)

    def update(self, load: InstanceLoad) -> None:
        self.instances[load.instance_id] = load
        # Requests routed before this report was taken are now part of its numbers.
        pend = self._pending.get(load.instance_id, {})
        for rid in [r for r, p in pend.items() if p.routed_at < load.report_time]:
            del pend[rid]

    def set_healthy(self, instance_id: str, healthy: bool) -> None:
        if instance_id in self.instances:
            self.instances[instance_id].healthy = healthy

    def freeness(self, instance_id: str) -> float:
        inst = self.instances[instance_id]
        pending = sum(p.blocks for p in self._pending.get(instance_id, {}).values())
        return inst.kv_blocks_total - inst.kv_blocks_used - inst.queued_demand_blocks - pending

    def choose(self, exclude: set[str] = frozenset()) -> str | None:
        best, best_free = None, -math.inf
        for iid in sorted(self.instances):
            inst = self.instances[iid]
            if not inst.healthy or not inst.serving or iid in exclude:
                continue
            f = self.freeness(iid)
            if f > best_free:
                best, best_free = iid, f
        return best

    def routed(self, instance_id: str, request_id: str, num_tokens: int, now: float) -> None:
        bs = max(1, self.instances[instance_id].block_size) if instance_id in self.instances else 16
        self._pending.setdefault(instance_id, {})[request_id] = _Pending(-(-num_tokens // bs), now)

    def done(self, instance_id: str, request_id: str) -> None:
        self._pending.get(instance_id, {}).pop(request_id, None)
