"""Which running requests a Llumnix-like migration moves: the `migrate` baseline's decision.

Migration frees KV on an overloaded whole instance by moving running requests, KV and all, to another
whole instance. The choice is kept simple: the source's most recently arrived requests go first, until the
asked-for blocks are freed, each one only if it fits beside what the destination already holds (one that
does not fit is skipped, and later ones are still tried). Pure, so that the choice is tested on its own;
the memory manager's orchestrator gathers the requests from the workers and carries the choice out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RunningRequest:
    """A running request as the migration choice sees it."""

    request_id: str
    unit_id: str     # the unit it runs in now
    kv_blocks: int   # KV blocks it holds there
    age_s: float     # time since it arrived


def choose_migrations(requests: Sequence[RunningRequest], src: str, dst: str, dst_capacity: int,
                      blocks: int) -> list[str]:
    """The ids of the requests to move from unit ``src`` to unit ``dst``, in the order chosen.

    Candidates are src's requests that hold KV, youngest first (ties keep the given order). They are taken
    while fewer than ``blocks`` blocks are freed, each only if it fits in dst's free blocks: ``dst_capacity``
    less what dst's own requests hold. Empty when nothing fits (or ``blocks`` <= 0)."""
    dst_free = dst_capacity - sum(r.kv_blocks for r in requests if r.unit_id == dst)
    chosen: list[str] = []
    freed = 0
    for r in sorted((r for r in requests if r.unit_id == src and r.kv_blocks > 0), key=lambda r: r.age_s):
        if freed >= blocks:
            break
        if r.kv_blocks <= dst_free:
            chosen.append(r.request_id)
            dst_free -= r.kv_blocks
            freed += r.kv_blocks
    return chosen
