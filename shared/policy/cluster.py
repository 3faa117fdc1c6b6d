"""The cluster's vocabulary: one name per concept, plain frozen dataclasses every policy speaks.

- A **member** is one worker's place in a unit: the contiguous layer range ``[layer_start, layer_end)`` it
  holds, and the address its transfer service listens on (empty where nobody needs it).
- A **unit** is what the dispatcher routes to (KunServe §4): a whole instance (one member holding every
  layer) or a pipeline group (members in pipeline order, ``members[0]`` the head that owns the requests).
  Its id is the group id (a whole instance's id is its worker's id). ``kv_blocks`` is the block-id space
  its members share, where a transition needs it (0 = not given).

Drop and restore plans (`planner`), transition plans (`transition_plan`), the live routing units
(`units`), the memory manager's layout (`cluster_layout`) and the workers' group roles all speak of these
two. Loads, reports and layout entries carry a unit or a member rather than redefining them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

Range = tuple[int, int]  # [start, end) of layers


@dataclass(frozen=True)
class Member:
    worker_id: str
    layer_start: int
    layer_end: int
    transfer_address: str = ""

    @property
    def range(self) -> Range:
        return self.layer_start, self.layer_end


@dataclass(frozen=True)
class Unit:
    unit_id: str
    members: tuple[Member, ...]  # pipeline order; [0] is the head
    kv_blocks: int = 0           # the block-id space the members share (0: not given)

    def __post_init__(self) -> None:
        object.__setattr__(self, "members", tuple(self.members))

    @classmethod
    def single(cls, worker_id: str, num_layers: int, transfer_address: str = "") -> Unit:
        """A whole instance: one worker holding every layer."""
        return cls(worker_id, (Member(worker_id, 0, num_layers, transfer_address),))

    @property
    def head(self) -> str:
        return self.members[0].worker_id

    @property
    def worker_ids(self) -> tuple[str, ...]:
        return tuple(m.worker_id for m in self.members)

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def is_group(self) -> bool:
        return len(self.members) > 1

    def member(self, worker_id: str) -> Member | None:
        for m in self.members:
            if m.worker_id == worker_id:
                return m
        return None

    def tiling_problem(self, num_layers: int) -> str | None:
        """Why the members' ranges do not tile ``[0, num_layers)`` in pipeline order; None when they do."""
        if not self.members:
            return f"unit {self.unit_id}: no members"
        at = 0
        for m in self.members:
            if m.layer_start != at or m.layer_end <= m.layer_start:
                return f"unit {self.unit_id}: ranges {[m.range for m in self.members]} do not tile [0, {num_layers}) in order"
            at = m.layer_end
        if at != num_layers:
            return f"unit {self.unit_id}: ranges {[m.range for m in self.members]} do not cover [0, {num_layers})"
        return None


def units_by_id(units: Sequence[Unit]) -> dict[str, Unit]:
    return {u.unit_id: u for u in units}
