"""The cluster's vocabulary: one name per concept, plain frozen dataclasses every policy speaks.

- A **member** is one worker's place in a unit: the contiguous layer range ``[layer_start, layer_end)`` it
  holds, and the address its transfer service listens on (empty where nobody needs it).
- A **unit** is what the dispatcher routes to (KunServe §4): a whole instance (one member holding every
  layer) or a pipeline group (members in pipeline order, ``members[0]`` the head that owns the requests).
  Its id is the group id (a whole instance's id is its worker's id). ``kv_blocks`` is the block-id space
  its members share, where a transition needs it (0 = not given).

- A **worker report** is one worker's latest stats as the policies read them: the member it is (its layer
  range), the unit it says it belongs to, whether it is routable, and its KV load and counters.

Drop and restore plans (`planner`), transition plans (`transition_plan`), the live routing units
(`units`), the memory manager's layout (`cluster_layout`) and the workers' group roles all speak of these.
Loads, reports and layout entries carry a unit or a member rather than redefining them.
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


@dataclass(frozen=True)
class WorkerReport:
    """One worker's stats report (every field of the wire's WorkerStats, so the monitor relays it whole)."""

    member: Member                        # the worker and the layer range it holds
    num_layers_model: int = 0
    unit_id: str = ""                     # the unit it belongs to (its own id when whole)
    unit_members: tuple[str, ...] = ()    # pipeline order; [0] is the head
    serving: bool = False                 # a whole instance, or the head of a complete pipeline group
    transitioning: bool = False           # a drop / restore is in progress: requests wait
    epoch: int = 0                        # the layout epoch of its latest transition
    address: str = ""                     # host:port of its gRPC server
    timestamp_unix_s: float = 0.0         # the worker's wall clock when it took the report
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_blocks_undropped: int = 0          # KV blocks it had holding every layer (0: not reported)
    queued_demand_blocks: int = 0         # KV blocks the waiting requests' prompts will need
    block_size: int = 0                   # tokens per KV block
    num_running: int = 0
    num_waiting: int = 0
    num_preemptions: int = 0
    prompt_tokens_total: int = 0          # cumulative counters: rates are the receiver's
    generated_tokens_total: int = 0
    oldest_waiting_age_s: float = 0.0     # queue time of its oldest request that has not started
    busy_seconds_total: float = 0.0
    idle_seconds_total: float = 0.0
    bubble_seconds_total: float = 0.0
    bubble_ratio: float = 0.0
    # The offline share (ConServe request classes), each part of the total above: the policies count online demand
    # only, since offline work runs on what online work leaves and is the first victim before any drop.
    num_offline_running: int = 0
    num_offline_waiting: int = 0
    offline_kv_blocks_used: int = 0       # of kv_blocks_used
    offline_queued_demand_blocks: int = 0  # of queued_demand_blocks
    oldest_online_waiting_age_s: float = 0.0  # oldest_waiting_age_s over online requests only
    # Tensor parallelism: the instance's degree (0 or 1: none) and members in rank order ([0] owns the requests)
    tp_degree: int = 0
    tp_members: tuple[str, ...] = ()
    reforming: bool = False  # re-forming its tensor-parallel instance: silent a while, then serving again under its id

    def __post_init__(self) -> None:
        object.__setattr__(self, "unit_members", tuple(self.unit_members))
        object.__setattr__(self, "tp_members", tuple(self.tp_members))

    @property
    def online_kv_blocks_used(self) -> int:
        return self.kv_blocks_used - self.offline_kv_blocks_used

    @property
    def online_queued_demand_blocks(self) -> int:
        return self.queued_demand_blocks - self.offline_queued_demand_blocks

    @property
    def online_waiting_age_s(self) -> float:
        """Queue time of the oldest online request that has not started: with no offline request waiting, every
        waiting request is online (a report that carries no class breakdown says the same)."""
        return self.oldest_online_waiting_age_s if self.num_offline_waiting else self.oldest_waiting_age_s

    @property
    def worker_id(self) -> str:
        return self.member.worker_id

    @property
    def routable(self) -> bool:
        """The dispatcher may route to it: it says it serves (a whole instance or the head of a complete
        group) and is not in the middle of a drop / restore."""
        return self.serving and not self.transitioning

    @property
    def is_non_head_member(self) -> bool:
        """A pipeline group's member other than its head: its KV numbers describe the head's block-id space
        again."""
        return len(self.unit_members) > 1 and self.unit_members[0] != self.worker_id

    @property
    def is_tp_follower(self) -> bool:
        """A tensor-parallel member other than rank 0: it holds a shard of the KV rank 0 reports, and takes no
        requests of its own."""
        return len(self.tp_members) > 1 and self.tp_members[0] != self.worker_id
