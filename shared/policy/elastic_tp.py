"""Transformation-aware scheduling for elastic tensor parallelism (Gyges §5, Algorithms 1 and 2): pure, no I/O.

Co-located TP1 instances serve short requests at the best throughput; a request longer than one TP1
instance's KV capacity needs several of them merged into one TP2 or TP4 instance, whose members each hold
a shard of every layer's sharded weights (so they free the rest) and the heads of every token they own.
This module decides, from plain snapshots of the instances, where a request goes and when instances
merge or split; the memory manager carries the transitions out and the dispatcher routes.

Request routing (``ElasticTPScheduler.route``, Algorithm 1):

* A request fits an instance when its whole-life tokens fit the instance's free KV at its degree.
* A short request (it fits one TP1 instance's capacity) skips instances reserved for a scale-up and
  prefers instances at TP1: instances at TP>1 that no longer hold a request needing their degree are
  *throttled* (Algorithm 2's reduced rate), used only when nothing else fits. Among the rest the least
  loaded wins. A short request that fits nowhere waits: overload is the parameter drop's job, not a reason
  to merge.
* A long request prefers the instance at the highest degree that fits it (consecutive long requests then
  reuse one merged instance instead of transforming another host), then the least loaded.
* When no instance fits a long request, the scheduler plans a scale-up: the smallest degree whose capacity
  holds it, formed on one host from unreserved, serving instances whose degrees add up to it, preferring
  sets that already contain a merged instance (fewer moves) and then the least KV in use. The chosen
  instances' requests move with their KV, so they must fit the merged capacity beside the new request.
* If a layout could hold the request but its instances are busy or reserved, it waits; if no layout of
  the cluster could ever hold it, it is refused with the cluster's maximum.

Parallelism scale-down (``ElasticTPScheduler.rebalance``, Algorithm 2): an instance at TP>1 whose requests
would all fit at a lower degree is throttled, and once its requests pack (first-fit decreasing, with
``scale_down_headroom`` of the smaller instances' capacity) into the instances it would split into, a
scale-down to that degree is decided. The paper splits on a load threshold; packing the requests that are
actually there is the same test made exact, since a request's KV cannot be divided between instances.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

DEGREES = (1, 2, 4)


@dataclass(frozen=True)
class TPMemory:
    """One worker's memory for one model copy, which gives an instance's KV capacity at each TP degree.

    ``sharded_bytes`` are the weights split across the members under TP (each member keeps 1/degree, padded
    to whole pages at load time so a scale-up releases whole pages); ``replicated_bytes`` are the weights every
    member keeps whole. ``kv_bytes_per_token`` is one token's K and V in every layer and every KV head; each
    member stores ``1/degree`` of the heads, so an instance of ``degree`` members holds ``degree`` times the
    tokens one member's KV bytes would hold at TP1, plus what the released weights add."""

    pool_bytes: int
    sharded_bytes: int
    replicated_bytes: int
    kv_bytes_per_token: int
    num_kv_heads: int
    block_size: int = 16

    def __post_init__(self) -> None:
        if self.kv_bytes_per_token <= 0 or self.num_kv_heads <= 0 or self.block_size <= 0:
            raise ValueError("kv_bytes_per_token, num_kv_heads and block_size must be > 0")
        if min(self.pool_bytes, self.sharded_bytes, self.replicated_bytes) < 0:
            raise ValueError("memory sizes must be >= 0")

    def valid_degree(self, degree: int) -> bool:
        return degree in DEGREES and self.num_kv_heads % degree == 0

    def check_degree(self, degree: int) -> None:
        if degree not in DEGREES:
            raise ValueError(f"TP degree {degree}: must be one of {', '.join(map(str, DEGREES))}")
        if self.num_kv_heads % degree:
            raise ValueError(f"TP degree {degree} does not divide the model's {self.num_kv_heads} KV heads")

    def kv_bytes_per_member(self, degree: int) -> int:
        return max(0, self.pool_bytes - self.replicated_bytes - -(-self.sharded_bytes // degree))

    def capacity_tokens(self, degree: int) -> int:
        """KV tokens an instance of ``degree`` members holds, in whole blocks."""
        self.check_degree(degree)
        tokens = self.kv_bytes_per_member(degree) * degree // self.kv_bytes_per_token
        return tokens // self.block_size * self.block_size

    def degree_for(self, tokens: int, max_degree: int = DEGREES[-1]) -> int | None:
        """The smallest valid degree whose capacity holds ``tokens``, or None."""
        for d in DEGREES:
            if d <= max_degree and self.valid_degree(d) and self.capacity_tokens(d) >= tokens:
                return d
        return None


@dataclass(frozen=True)
class TPInstance:
    """An instance as the scheduler sees it. ``members`` in rank order (rank 0 owns the requests and is the
    instance's id); ``host`` is the co-location domain members of one instance must share; ``requests`` are
    the whole-life tokens (prompt plus the tokens it may still generate) of every request it holds, running
    or queued; ``used_tokens`` is their sum unless given."""

    members: tuple[str, ...]
    host: str
    requests: tuple[int, ...] = ()
    serving: bool = True
    reserved: bool = False
    used_tokens: int = -1

    def __post_init__(self) -> None:
        if not self.members:
            raise ValueError("an instance has at least one member")
        if len(set(self.members)) != len(self.members):
            raise ValueError(f"instance {self.members[0]}: a worker is listed twice")
        if self.used_tokens < 0:
            object.__setattr__(self, "used_tokens", sum(self.requests))

    @property
    def instance_id(self) -> str:
        return self.members[0]

    @property
    def degree(self) -> int:
        return len(self.members)


@dataclass(frozen=True)
class Route:
    instance_id: str


@dataclass(frozen=True)
class ScaleUp:
    """Merge ``instances`` (ids, the one whose rank 0 heads the result first) into one of ``degree``."""

    host: str
    instances: tuple[str, ...]
    members: tuple[str, ...]
    degree: int


@dataclass(frozen=True)
class Wait:
    reason: str


@dataclass(frozen=True)
class Refuse:
    reason: str
    max_tokens: int


@dataclass(frozen=True)
class ScaleDown:
    instance_id: str
    to_degree: int


Decision = Route | ScaleUp | Wait | Refuse


@dataclass
class ElasticTPScheduler:
    memory: TPMemory
    max_degree: int = DEGREES[-1]
    scale_down_headroom: float = 0.9
    _capacity: dict[int, int] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self.memory.check_degree(self.max_degree)
        if not 0.0 < self.scale_down_headroom <= 1.0:
            raise ValueError("scale_down_headroom must be in (0, 1]")

    def capacity(self, degree: int) -> int:
        if degree not in self._capacity:
            self._capacity[degree] = self.memory.capacity_tokens(degree)
        return self._capacity[degree]

    def needed_degree(self, tokens: int) -> int | None:
        return self.memory.degree_for(tokens, self.max_degree)

    def free_tokens(self, inst: TPInstance) -> int:
        return self.capacity(inst.degree) - inst.used_tokens

    def throttled(self, inst: TPInstance) -> bool:
        """A merged instance none of whose requests needs its degree any more: routing avoids it so it
        drains towards a scale-down (Algorithm 2)."""
        if inst.degree == 1:
            return False
        return all((self.needed_degree(t) or inst.degree) < inst.degree for t in inst.requests)

    def max_tokens(self, instances: Iterable[TPInstance]) -> int:
        """The longest request any layout of these instances could ever hold."""
        per_host: dict[str, int] = {}
        for inst in instances:
            per_host[inst.host] = per_host.get(inst.host, 0) + inst.degree
        best = 0
        for workers in per_host.values():
            for d in DEGREES:
                if d <= min(workers, self.max_degree) and self.memory.valid_degree(d):
                    best = max(best, self.capacity(d))
        return best

    # Algorithm 1 -----------------------------------------------------------------------------------------
    def route(self, tokens: int, instances: Sequence[TPInstance]) -> Decision:
        if tokens <= 0:
            raise ValueError("a request holds at least one token")
        serving = [i for i in instances if i.serving]
        long = tokens > self.capacity(1)
        fits = [i for i in serving if self.free_tokens(i) >= tokens and (long or not i.reserved)]
        if fits:
            if long:
                best = min(fits, key=lambda i: (-i.degree, self._load(i), i.instance_id))
            else:
                best = min(fits, key=lambda i: (self.throttled(i), i.degree > 1, self._load(i), i.instance_id))
            return Route(best.instance_id)
        limit = self.max_tokens(instances)
        if tokens > limit:
            return Refuse(
                f"the request needs {tokens} tokens of KV; the most any layout of this cluster holds is "
                f"{limit} (TP{self._largest_degree(instances)})",
                limit,
            )
        if not long:
            return Wait("every instance's KV is in use")
        plan = self._scale_up(tokens, serving)
        if plan is not None:
            return plan
        return Wait(
            f"a TP{self.needed_degree(tokens)} instance would hold the request, but no host has enough idle, unreserved instances now"
        )

    def _scale_up(self, tokens: int, serving: Sequence[TPInstance]) -> ScaleUp | None:
        by_host: dict[str, list[TPInstance]] = {}
        for inst in serving:
            if not inst.reserved:
                by_host.setdefault(inst.host, []).append(inst)
        for d in DEGREES:
            if d == 1 or d > self.max_degree or not self.memory.valid_degree(d) or self.capacity(d) < tokens:
                continue
            best: tuple[tuple[int, int, str, tuple[str, ...]], tuple[TPInstance, ...]] | None = None
            for host in sorted(by_host):
                pool = by_host[host]
                for n in range(2, min(d, len(pool)) + 1):
                    for combo in itertools.combinations(pool, n):
                        if sum(i.degree for i in combo) != d:
                            continue
                        used = sum(i.used_tokens for i in combo)
                        if used + tokens > self.capacity(d):
                            continue
                        key = (-max(i.degree for i in combo), used, host, tuple(sorted(i.instance_id for i in combo)))
                        if best is None or key < best[0]:
                            best = (key, combo)
            if best is not None:
                chosen = sorted(best[1], key=lambda i: (-i.degree, i.instance_id))
                return ScaleUp(
                    host=chosen[0].host,
                    instances=tuple(i.instance_id for i in chosen),
                    members=tuple(m for i in chosen for m in i.members),
                    degree=d,
                )
        return None

    # Algorithm 2 -----------------------------------------------------------------------------------------
    def rebalance(self, instances: Iterable[TPInstance]) -> list[ScaleDown]:
        """Scale-downs to start now: merged, serving, unreserved instances whose requests fit a lower degree."""
        out: list[ScaleDown] = []
        for inst in instances:
            if inst.degree == 1 or not inst.serving or inst.reserved or not self.throttled(inst):
                continue
            for d in DEGREES:
                if d >= inst.degree or not self.memory.valid_degree(d):
                    continue
                if _packs(inst.requests, inst.degree // d, int(self.capacity(d) * self.scale_down_headroom)):
                    out.append(ScaleDown(inst.instance_id, d))
                    break
        return out

    def _load(self, inst: TPInstance) -> float:
        cap = self.capacity(inst.degree)
        return inst.used_tokens / cap if cap else 1.0

    def _largest_degree(self, instances: Iterable[TPInstance]) -> int:
        per_host: dict[str, int] = {}
        for inst in instances:
            per_host[inst.host] = per_host.get(inst.host, 0) + inst.degree
        most = max(per_host.values(), default=1)
        return max(d for d in DEGREES if d <= min(most, self.max_degree) and self.memory.valid_degree(d))


def _packs(requests: Sequence[int], bins: int, capacity: int) -> bool:
    """First-fit decreasing of request sizes into ``bins`` bins of ``capacity``."""
    free = [capacity] * bins
    for size in sorted(requests, reverse=True):
        for i, room in enumerate(free):
            if size <= room:
                free[i] -= size
                break
        else:
            return False
    return True


@dataclass
class IdleSplitPolicy:
    """When a merged instance goes back to whole ones, as the cluster's cold re-form allows (README "Elastic tensor
    parallelism (Gyges)"): an instance at TP>1 that has held no request, and was given none by placement, for
    ``idle_s`` is split. Algorithm 2 splits an instance once its requests would fit the smaller ones, throttling
    routing to it meanwhile; a cold split hands every running request over to be re-prefilled, so splitting only an
    idle instance is what keeps the split from costing the requests anything. The throttling is the dispatcher's
    (``long_requests.choose_unthrottled``): short requests avoid a merged instance holding no long request while
    another instance has room, so under steady short traffic it does go idle. ``idle_s`` <= 0: never split."""

    idle_s: float
    _idle_since: dict[str, float] = field(default_factory=dict)
    _placed_at: dict[str, float] = field(default_factory=dict)

    def placed(self, instance_id: str, now: float) -> None:
        """Placement sent (or is about to send) a request to this instance: it is not idle, whatever its stats say."""
        self._placed_at[instance_id] = now
        self._idle_since.pop(instance_id, None)

    def observe(self, now: float, instances: Iterable[tuple[str, int, bool]]) -> list[str]:
        """``instances``: (rank 0, degree, holds no request now) of every instance seen. Returns the instances to split
        now (each is forgotten, so one decision per idle spell)."""
        if self.idle_s <= 0:
            return []
        seen, due = set(), []
        for inst, degree, idle in instances:
            seen.add(inst)
            if degree < 2 or not idle or now - self._placed_at.get(inst, -float("inf")) < self.idle_s:
                self._idle_since.pop(inst, None)
                continue
            since = self._idle_since.setdefault(inst, now)
            if now - since >= self.idle_s:
                due.append(inst)
        for inst in due:
            del self._idle_since[inst]
        for inst in set(self._idle_since) - seen:
            del self._idle_since[inst]
        return sorted(due)
