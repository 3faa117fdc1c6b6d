"""Layer-wise preemption (ConServe §4.3): safepoints between layer groups where a forward pass drops its
offline rows and finishes the iteration for the online rows only.

An iteration full of offline work can take hundreds of milliseconds; an online request that arrives just after
it began would wait for all of it. The worker's arrival check (``shared/policy/layerwise_preemption.py``,
Algorithm 2) raises a flag when waiting would miss the TTFT SLO; the forward pass checks the flag every ``every`` layers
(one ``Event.is_set``: nanoseconds against a layer's milliseconds) and, when it is up, keeps only the online
rows: their hidden states, positions, attention metadata and logit rows, all prepared by the engine before the
pass began, so the cut itself is one index of the hidden states. The offline rows' KV written by the layers
before the cut stays where it is (the next iteration recomputes those tokens and writes the same slots), and
their requests are scheduled again from where they were.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from kunserve.shared.engine.attention import AttentionMetadata


@dataclass
class Safepoint:
    every: int                       # check before every `every`-th layer of the pass (not before its first)
    flag: threading.Event            # raised by the arrival check, cleared by the engine after the iteration
    keep: torch.Tensor               # [T'] rows of the batch that go on: the online tokens, in their batch order
    positions: torch.Tensor          # [T'] their positions
    meta: AttentionMetadata          # the online rows' attention metadata, rows renumbered 0..T'-1
    logits_rows: torch.Tensor | None  # their logit rows among the kept rows (None: all)
    fired_before: int | None = None  # the layer before which the offline rows were dropped (None: they were not)

    def due(self, layer: int, start: int) -> bool:
        """Drop the offline rows before `layer`? Once per pass, at a layer-group boundary, when flagged."""
        if self.fired_before is not None or layer == start or (layer - start) % self.every or not self.flag.is_set():
            return False
        self.fired_before = layer
        return True
