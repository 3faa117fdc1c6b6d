"""The cluster's parameter layout as the memory manager knows it: pure state, no I/O.

Which worker holds which contiguous layer range, which unit each belongs to, and a monotonically
increasing epoch bumped on every change. Rebuilt from the workers' own reports after a restart.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from kunserve.shared.policy.cluster import Member


@dataclass(frozen=True)
class LayoutEntry:
    """One worker's place in the layout, as it last reported it."""

    member: Member                        # the worker, its layer range and its transfer address
    address: str                          # host:port of its gRPC server
    unit_id: str                          # the unit it belongs to (its own id when whole)
    unit_members: tuple[str, ...]         # pipeline order; [0] is the head
    serving: bool = True                  # routable: a whole instance or the head of a complete group
    reachable: bool = True
    epoch: int = 0                        # the worker's own layout epoch (its latest transition)

    def __post_init__(self) -> None:
        object.__setattr__(self, "unit_members", tuple(self.unit_members))

    @property
    def worker_id(self) -> str:
        return self.member.worker_id


@dataclass
class LayoutState:
    num_layers_model: int = 0
    epoch: int = 0
    workers: dict[str, LayoutEntry] = field(default_factory=dict)

    def observe(self, entry: LayoutEntry, num_layers_model: int) -> bool:
        """Record what a worker reports it holds (of a ``num_layers_model``-layer model); bump the epoch when
        anything changed. The epoch never falls behind a worker's own, so after a memory-manager restart it
        resumes at the newest transition's epoch (bumps the old memory manager made for reachability changes
        are not remembered) and the next transition is newer than every earlier one."""
        if num_layers_model and self.num_layers_model and num_layers_model != self.num_layers_model:
            raise ValueError(f"worker {entry.worker_id} serves a {num_layers_model}-layer model, the cluster has "
                             f"{self.num_layers_model} layers")
        self.num_layers_model = num_layers_model or self.num_layers_model
        entry = dataclasses.replace(entry, reachable=True)
        self.epoch = max(self.epoch, entry.epoch)
        if self.workers.get(entry.worker_id) != entry:
            self.workers[entry.worker_id] = entry
            self.epoch += 1
            return True
        return False

    def committed(self, epoch: int) -> int:
        """A transition at ``epoch`` committed: the layout is at least that new (its workers' reports follow)."""
        self.epoch = max(self.epoch, epoch)
        return self.epoch

    def mark_unreachable(self, worker_id: str) -> None:
        w = self.workers.get(worker_id)
        if w is not None and w.reachable:
            self.workers[worker_id] = dataclasses.replace(w, reachable=False)
            self.epoch += 1
