"""Repeated runs of a comparison: the order they run in and the median / range a table shows.

One replay on a small CPU is noisy (the same 7x burst gave one policy a TTFT p99 of 1,592 ms and then 219 ms),
so every row runs several times. The runs are interleaved, round after round, with the row order rotated each
round: a slow spell of the machine (another process, thermal throttling) then lands on different rows instead
of on every run of one, and no row always goes first on a cold page cache. Pure.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import TypedDict


def schedule(rows: Sequence[str], repeats: int) -> list[list[str]]:
    """``repeats`` rounds, each every row once; round r is ``rows`` rotated left by r."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if not rows:
        return [[] for _ in range(repeats)]
    n = len(rows)
    return [[rows[(r + i) % n] for i in range(n)] for r in range(repeats)]


class Spread(TypedDict):
    median: float | None
    min: float | None
    max: float | None
    n: int


def spread(values: Sequence[float | None]) -> Spread:
    """Median and range of the runs that have a value (None: not measured in that run)."""
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


__all__ = ["Spread", "schedule", "spread"]
