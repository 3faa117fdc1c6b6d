"""The latency model a pipeline group's head budgets its microbatches with: ConServe's SLO-aware budget after
a drop, on the group's step rather than the whole model's.

A worker's profile predicts one iteration of all its layers on one device. In a group, what a request waits
between two tokens is its microbatch's round trip: the head's stage, the activations' hops, every later stage,
the logits back, and the time the microbatch queues behind the others in flight at each stage. No offline
profile knows the last three, and they depend on the deployment: with a device per stage the stages overlap,
while two workers sharing a 2-core CPU do not (a pair's TPOT measured 2.0x a whole instance's at the same
load). So the head measures its group's step: each microbatch's round trip against the profile's prediction
for the same batch, and scales every prediction by the running ratio (an exponentially weighted mean). Until
it has measured, it assumes the stages do not overlap at all (scale = number of stages), so the SLO holds while
it learns.

Pure policy: no clock, no I/O; the engine reports what it measured.
"""

from __future__ import annotations

from dataclasses import dataclass

from kunserve.shared.policy.costmodel import BatchShape
from kunserve.shared.policy.token_budget import LatencyModel

MIN_PREDICTION_S = 1e-6  # a prediction this small says nothing about the ratio (an empty batch)


@dataclass
class GroupLatencyModel:
    base: LatencyModel  # the profile's model of one iteration over the whole model on one device
    stages: int
    weight: float = 0.2  # of the newest round trip in the running ratio
    scale: float = 0.0  # round trip / prediction; 0 = not measured yet: `stages`
    observations: int = 0

    def __post_init__(self) -> None:
        if self.stages < 1:
            raise ValueError(f"stages must be >= 1, got {self.stages}")
        if not 0 < self.weight <= 1:
            raise ValueError(f"weight must be in (0, 1], got {self.weight}")
        if self.scale <= 0:
            self.scale = float(self.stages)

    def shape_cost(self, s: BatchShape) -> float:
        return self.base.shape_cost(s) * self.scale

    def observe(self, shape: BatchShape, round_trip_s: float) -> None:
        """A microbatch of `shape` came back `round_trip_s` after its head shipped it."""
        predicted = self.base.shape_cost(shape)
        if predicted < MIN_PREDICTION_S or round_trip_s <= 0:
            return
        ratio = round_trip_s / predicted
        self.scale = ratio if self.observations == 0 else (1 - self.weight) * self.scale + self.weight * ratio
        self.observations += 1
