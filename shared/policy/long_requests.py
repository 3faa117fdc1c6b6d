"""Which routable units could ever hold a request (pure: over the router's view). The dispatcher's transformation-
aware routing (`dispatcher.elastic_tp`, README "Elastic tensor parallelism (Gyges)") sends a request only to a unit
whose KV capacity holds its whole life, and asks the memory manager for a placement when no routable unit does.

A unit holds a request when the KV blocks of prompt + max_tokens - 1 tokens (the last sampled token gets no KV: the
worker's own check) fit its KV blocks in total; what is in use does not matter, since the worker queues a request
that fits its capacity.
"""

from __future__ import annotations

from kunserve.shared.policy.router import FreenessRouter


def kv_blocks_needed(whole_life_tokens: int, block_size: int) -> int:
    return -(-max(1, whole_life_tokens - 1) // max(1, block_size))


def split_by_fit(
    router: FreenessRouter, whole_life_tokens: int, exclude: set[str] | frozenset[str] = frozenset()
) -> tuple[list[str], list[str]]:
    """(routable units that could hold the request, routable units too small for it), `exclude` left out."""
    fits: list[str] = []
    small: list[str] = []
    for wid, load in sorted(router.workers.items()):
        if wid in exclude or not router.routable(wid):
            continue
        held = kv_blocks_needed(whole_life_tokens, load.block_size) <= load.kv_blocks_total
        (fits if held else small).append(wid)
    return fits, small


__all__ = ["kv_blocks_needed", "split_by_fit"]
