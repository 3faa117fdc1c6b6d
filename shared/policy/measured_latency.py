"""The latency model an engine budgets its iterations with: the profile's prediction, scaled by how long its
iterations really take. ConServe's SLO-aware budget is only as good as this prediction.

A profile is measured offline, by timing forward passes alone on an idle device. A live iteration also
schedules and samples, shares the CPU with the process's gRPC streams (every token of every request is sent
while the next iteration runs), and on a loaded machine simply runs slower: measured here, mixed online and
offline batches ran 1.3-1.6x their prediction, so a budget that trusted the profile overshot the TBT SLO by
as much. And in a pipeline group, what a request waits between two tokens is its microbatch's round trip: the
head's stage, the activations' hops, every later stage, the logits back, and the time the microbatch queues
behind the others in flight at each stage, none of which a profile of one device knows; they depend on the
deployment (a stage per GPU overlaps; two workers on a 2-core CPU do not: a pair's TPOT measured 2.0x a whole
instance's at the same load).

So the engine reports every iteration (a whole instance: schedule to sampled tokens; a group head: each
microbatch's round trip) against the profile's prediction for the same batch, and every prediction is scaled
by the running ratio (an exponentially weighted mean). Until it has measured, it assumes `assumed_scale`: 1
for a whole instance, the number of stages for a group (no overlap at all), so the SLO holds while it learns.

Pure policy: no clock, no I/O; the engine reports what it measured.
"""

from __future__ import annotations

from dataclasses import dataclass

from kunserve.shared.policy.costmodel import BatchShape
from kunserve.shared.policy.token_budget import LatencyModel

MIN_PREDICTION_S = 1e-6  # a prediction this small says nothing about the ratio (an empty batch)


@dataclass
class MeasuredLatencyModel:
    base: LatencyModel  # the profile's model of one iteration over the whole model on one device
    assumed_scale: float = 1.0  # until measured
    weight: float = 0.2  # of the newest measurement in the running ratio
    scale: float = 0.0  # measured / predicted; 0 = not measured yet: assumed_scale
    observations: int = 0

    def __post_init__(self) -> None:
        if self.assumed_scale <= 0:
            raise ValueError(f"assumed_scale must be > 0, got {self.assumed_scale}")
        if not 0 < self.weight <= 1:
            raise ValueError(f"weight must be in (0, 1], got {self.weight}")
        if self.scale <= 0:
            self.scale = float(self.assumed_scale)

    def shape_cost(self, s: BatchShape) -> float:
        return self.base.shape_cost(s) * self.scale

    def observe(self, shape: BatchShape, seconds: float) -> None:
        """An iteration (or a group's microbatch round trip) of `shape` took `seconds`."""
        predicted = self.base.shape_cost(shape)
        if predicted < MIN_PREDICTION_S or seconds <= 0:
            return
        ratio = seconds / predicted
        self.scale = ratio if self.observations == 0 else (1 - self.weight) * self.scale + self.weight * ratio
        self.observations += 1
