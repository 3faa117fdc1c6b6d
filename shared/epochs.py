"""Layout epochs: the bounds every service checks at its edge.

Epochs travel as uint64 and every transition adds one, so an epoch taken from the wire unchecked (2**64-1
from anyone who can reach a worker) makes the next `+ 1` overflow the field: GetLayout, kunctl status,
Drop and PlanDrop then fail until the worker restarts. A worker accepts only epochs below MAX_EPOCH and at
most MAX_STEP ahead of its own; the memory manager never computes one at or above MAX_EPOCH.
"""

from __future__ import annotations

MAX_EPOCH = 2**62
MAX_STEP = 2**20


def epoch_error(epoch: int, current: int, field: str = "epoch") -> str | None:
    """Why `epoch` may not be acted on by a worker at epoch `current` (None: it may). The message names
    the field. Whether it is newer than `current` is the transition's own (state) check."""
    if epoch <= 0:
        return f"{field}: must be > 0, got {epoch}"
    if epoch >= MAX_EPOCH:
        return f"{field}: must be < 2**62, got {epoch}"
    if epoch > current + MAX_STEP:
        return f"{field}: {epoch} is more than 2**20 ahead of this worker's epoch {current}"
    return None
