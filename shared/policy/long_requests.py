"""Which routable units could ever hold a request, and which merged units short requests avoid (pure: over the
router's view). The dispatcher's transformation-aware routing (`dispatcher.elastic_tp`, README "Elastic tensor
parallelism (Gyges)") sends a request only to a unit whose KV capacity holds its whole life, and asks the memory
manager for a placement when no routable unit does.

A unit holds a request when the KV blocks of prompt + max_tokens - 1 tokens (the last sampled token gets no KV: the
worker's own check) fit its KV blocks in total; what is in use does not matter, since the worker queues a request
that fits its capacity.

Throttling (Gyges §5, Algorithm 2: "once long requests are completed and if any instances with TP > 1 remain, the
scheduler reduces the request rate to these instances to facilitate scaling down"). A request is *long* when no
TP1 unit holds its whole life, i.e. it needs a merged (TP > 1) unit. A merged unit holding no long request is
*throttled*: a short request (and an offline one) goes to the others while one of them has room for it now, and to
the throttled ones only when none has, so throttling never makes a request wait for a route or queue behind a full
instance while a merged one has room. A merged unit that gets no short requests drains and goes idle, which is when
the memory manager splits it (`IdleSplitPolicy`). Long requests are not throttled: they go to the units that hold
them, which are merged ones. What differs from the paper: the rate is not reduced by a factor but to "only when the
others are full", and "long" means "needs more than TP1" (not "needs the unit's own degree", as
`ElasticTPScheduler.throttled` has it) because the cluster splits a merged instance back into whole ones only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kunserve.shared.policy import dispatch_rules
from kunserve.shared.policy.router import FreenessRouter, RoutingLoad

# worker id -> the members of its tensor-parallel instance in rank order ([0] owns the requests); a worker not
# listed is a whole (TP1) instance
TPMembers = Mapping[str, Sequence[str]]


def kv_blocks_needed(whole_life_tokens: int, block_size: int) -> int:
    return -(-max(1, whole_life_tokens - 1) // max(1, block_size))


def holds(load: RoutingLoad, whole_life_tokens: int) -> bool:
    """The unit's KV capacity holds a request of `whole_life_tokens` (prompt + max_tokens)."""
    return kv_blocks_needed(whole_life_tokens, load.block_size) <= load.kv_blocks_total


def split_by_fit(
    router: FreenessRouter, whole_life_tokens: int, exclude: set[str] | frozenset[str] = frozenset()
) -> tuple[list[str], list[str]]:
    """(routable units that could hold the request, routable units too small for it), `exclude` left out."""
    fits: list[str] = []
    small: list[str] = []
    for wid, load in sorted(router.workers.items()):
        if wid in exclude or not router.routable(wid):
            continue
        (fits if holds(load, whole_life_tokens) else small).append(wid)
    return fits, small


def tp_degree(tp_members: TPMembers, wid: str) -> int:
    return max(1, len(tp_members.get(wid, ())))


def is_long(router: FreenessRouter, tp_members: TPMembers, whole_life_tokens: int) -> bool:
    """No TP1 unit the router knows holds the request (routable or not: one that is re-forming or refused a request
    a moment ago still tells what a whole instance holds). With no TP1 unit known every request counts as long, so
    nothing is throttled on a guess."""
    return not any(tp_degree(tp_members, wid) == 1 and holds(load, whole_life_tokens) for wid, load in router.workers.items())


def throttled_units(tp_members: TPMembers, long_held: Mapping[str, int]) -> frozenset[str]:
    """The merged units (rank 0 of an instance of degree > 1) that hold no long request; `long_held`: unit -> the
    long requests it holds now."""
    return frozenset(wid for wid, members in tp_members.items() if len(members) > 1 and members[0] == wid and long_held.get(wid, 0) <= 0)


@dataclass
class LongHeld:
    """The long requests each unit holds now (the dispatcher counts one per worker stream of a long request, released
    however the stream ends), and from them the merged units short requests avoid."""

    counts: dict[str, int] = field(default_factory=dict)

    def add(self, unit: str) -> None:
        self.counts[unit] = self.counts.get(unit, 0) + 1

    def release(self, unit: str) -> None:
        left = self.counts.get(unit, 0) - 1
        if left > 0:
            self.counts[unit] = left
        else:
            self.counts.pop(unit, None)

    def throttled(self, router: FreenessRouter, tp_members: TPMembers) -> frozenset[str]:
        """`throttled_units` among the routable units (a departed head's stale members are no unit)."""
        return frozenset(w for w in throttled_units(tp_members, self.counts) if router.routable(w))


def has_room(router: FreenessRouter, wid: str, tokens: int) -> bool:
    """The unit would start a request of `tokens` (its prompt, the tokens it has, the next one) now: nothing waits
    there (a worker also queues at its batch limits with KV free) and its freeness holds the request."""
    load = router.workers[wid]
    return load.queued_demand_blocks == 0 and router.freeness(wid) >= -(-tokens // max(1, load.block_size))


def choose_unthrottled(
    router: FreenessRouter,
    *,
    offline: bool,
    tokens: int,
    throttled: frozenset[str],
    exclude: set[str] | frozenset[str] = frozenset(),
) -> str | None:
    """Where a short (or offline) request goes: `dispatch_rules.choose_worker` over the units that are not
    throttled when its choice has room for the request now; otherwise its choice over every unit (a throttled one
    with room wins, being the freest; with room nowhere the freest unit queues it, as without throttling)."""
    if throttled:
        wid = dispatch_rules.choose_worker(router, offline=offline, tokens=tokens, exclude=set(exclude) | throttled)
        if wid is not None and has_room(router, wid, tokens):
            return wid
    return dispatch_rules.choose_worker(router, offline=offline, tokens=tokens, exclude=exclude)


__all__ = [
    "LongHeld",
    "TPMembers",
    "choose_unthrottled",
    "has_room",
    "holds",
    "is_long",
    "kv_blocks_needed",
    "split_by_fit",
    "throttled_units",
    "tp_degree",
]
