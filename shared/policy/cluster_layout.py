"""The cluster's parameter layout as the memory manager knows it: pure state, no I/O.

Which worker holds which contiguous layer range, which group each belongs to, and a monotonically
increasing epoch bumped on every change. Rebuilt from the workers' own reports after a restart.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kunserve.v1 import memory_manager_pb2


@dataclass
class WorkerPlacement:
    worker_id: str
    address: str
    layer_start: int
    layer_end: int
    group_id: str
    reachable: bool = True
    transfer_address: str = ""
    serving: bool = True
    group_members: tuple[str, ...] = ()
    epoch: int = 0  # the worker's own layout epoch (its latest transition)


@dataclass
class LayoutState:
    num_layers_model: int = 0
    epoch: int = 0
    workers: dict[str, WorkerPlacement] = field(default_factory=dict)

    def observe(self, worker_id: str, address: str, layer_start: int, layer_end: int, num_layers_model: int, *,
                group_id: str = "", transfer_address: str = "", serving: bool = True,
                group_members: tuple[str, ...] = (), epoch: int = 0) -> bool:
        """Record what a worker reports it holds; bump the epoch when anything changed. The epoch never falls
        behind a worker's own, so after a memory-manager restart it resumes at the newest transition's epoch
        (bumps the old memory manager made for reachability changes are not remembered) and the next
        transition is newer than every earlier one."""
        if num_layers_model and self.num_layers_model and num_layers_model != self.num_layers_model:
            raise ValueError(f"worker {worker_id} serves a {num_layers_model}-layer model, the cluster has "
                             f"{self.num_layers_model} layers")
        self.num_layers_model = num_layers_model or self.num_layers_model
        prev = self.workers.get(worker_id)
        # A worker holding every layer is an instance of its own; groups come with drop plans.
        group = group_id or worker_id
        new = WorkerPlacement(worker_id, address, layer_start, layer_end, group, True, transfer_address, serving,
                              tuple(group_members) or (worker_id,), epoch)
        self.epoch = max(self.epoch, epoch)
        if prev != new:
            self.workers[worker_id] = new
            self.epoch += 1
            return True
        return False

    def mark_unreachable(self, worker_id: str) -> None:
        w = self.workers.get(worker_id)
        if w is not None and w.reachable:
            w.reachable = False
            self.epoch += 1

    def to_pb(self) -> memory_manager_pb2.ClusterLayout:
        return memory_manager_pb2.ClusterLayout(
            epoch=self.epoch, num_layers_model=self.num_layers_model,
            workers=[memory_manager_pb2.WorkerLayout(
                worker_id=w.worker_id, address=w.address, layer_start=w.layer_start, layer_end=w.layer_end,
                group_id=w.group_id, reachable=w.reachable, transfer_address=w.transfer_address,
                serving=w.serving) for _, w in sorted(self.workers.items())],
        )
