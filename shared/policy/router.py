"""Request routing by Llumnix-style freeness: pure policy, no I/O.

The dispatcher polls every worker; a worker is routable when it is a whole instance or the head of a
complete pipeline group, and then its report carries the load of the unit it heads.

freeness(worker) = free KV blocks - blocks demanded by its queued requests - blocks of requests
this dispatcher routed there that the worker's last report does not yet include.
The most-free healthy, *serving* worker gets an online request.

An offline request (ConServe's batch class) runs on what online work leaves, so it goes where that is
largest (`choose_offline`): first a worker where its prompt fits in the freeness now (it starts at once
instead of queueing behind offline work already there), then the one with the fewest online requests
(the most of its token budget and memory stays with offline work, and the fewest online arrivals preempt
it), then the most free. A worker with idle capacity (room and no online request) is thus never passed
over for a busier one.

Two notions are kept apart:

* healthy: the worker answers (its stats poll succeeds). An unhealthy worker is presumed dead.
* serving: the worker is routable (``WorkerReport.routable``). A healthy worker that is not serving (it
  dropped layers, is forming a group, or just answered a request with FAILED_PRECONDITION) is alive and may
  become routable again: a request that finds no routable worker can wait for it (`may_become_routable`),
  while one whose every candidate is dead fails at once.

One exception to "dead": a worker that said it is re-forming its tensor-parallel instance (`reforming`) answers
nothing while it re-executes, then serves again under its id. It counts as coming back until a report says it
serves, it is forgotten, or the deadline the dispatcher gave passes (a re-form that never comes back is not waited
for forever). A worker that merely refused a request or timed out a poll, then went silent, is not waited for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class RoutingLoad:
    """A worker's load as the dispatcher's last poll saw it: that of the unit it heads when it is routable."""

    worker_id: str
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    queued_demand_blocks: int = 0
    block_size: int = 16
    healthy: bool = False
    report_time: float = 0.0  # dispatcher clock when the report was taken (the poll was sent)
    serving: bool = True  # routable: a whole instance or the head of a complete pipeline group
    online_requests: int = 0  # online requests it runs or queues


@dataclass
class _Pending:
    blocks: int
    routed_at: float
    offline: bool = False


@dataclass
class FreenessRouter:
    workers: dict[str, RoutingLoad] = field(default_factory=dict)
    _pending: dict[str, dict[str, _Pending]] = field(default_factory=dict)
    # worker -> dispatcher clock at which it refused a request (FAILED_PRECONDITION): it stays
    # not serving until a report taken after that moment says otherwise.
    _refused_at: dict[str, float] = field(default_factory=dict)
    # worker -> dispatcher clock until which it is coming back from a re-form (see `reforming`)
    _back_by: dict[str, float] = field(default_factory=dict)

    def update(self, load: RoutingLoad) -> None:
        refused = self._refused_at.get(load.worker_id)
        if refused is not None:
            if load.report_time <= refused:
                # A report taken before the refusal (an older poll answering late) cannot undo it.
                load.serving = False
            elif load.serving:
                del self._refused_at[load.worker_id]
        if load.serving:
            self._back_by.pop(load.worker_id, None)
        self.workers[load.worker_id] = load
        # Requests routed before this report was taken are now part of its numbers.
        pend = self._pending.get(load.worker_id, {})
        for rid in [r for r, p in pend.items() if p.routed_at < load.report_time]:
            del pend[rid]

    def set_healthy(self, worker_id: str, healthy: bool) -> None:
        if worker_id in self.workers:
            self.workers[worker_id].healthy = healthy

    def refused(self, worker_id: str, now: float) -> None:
        """The worker answered a request with "not serving" (FAILED_PRECONDITION) at `now`: it is
        alive but not routable until a stats report taken after `now` says it serves again."""
        self._refused_at[worker_id] = max(now, self._refused_at.get(worker_id, -math.inf))
        if worker_id in self.workers:
            self.workers[worker_id].serving = False

    def reforming(self, worker_id: str, now: float, until: float) -> None:
        """The worker said at `now` that it is re-forming (its stats, or its refusal of a request): not routable,
        and worth waiting for until `until` or until a report taken after `now` says it serves."""
        self.refused(worker_id, now)
        self._back_by[worker_id] = max(until, self._back_by.get(worker_id, -math.inf))

    def forget(self, worker_id: str) -> None:
        """The worker left the cluster: nothing about it is kept."""
        self.workers.pop(worker_id, None)
        self._pending.pop(worker_id, None)
        self._refused_at.pop(worker_id, None)
        self._back_by.pop(worker_id, None)

    def freeness(self, worker_id: str) -> float:
        load = self.workers[worker_id]
        pending = sum(p.blocks for p in self._pending.get(worker_id, {}).values())
        return load.kv_blocks_total - load.kv_blocks_used - load.queued_demand_blocks - pending

    def routable(self, worker_id: str) -> bool:
        load = self.workers.get(worker_id)
        return load is not None and load.healthy and load.serving

    def online_requests(self, worker_id: str) -> int:
        """Online requests it has: those its last report counts and those routed there since."""
        pending = sum(not p.offline for p in self._pending.get(worker_id, {}).values())
        return self.workers[worker_id].online_requests + pending

    def choose(self, exclude: set[str] | frozenset[str] = frozenset()) -> str | None:
        best, best_free = None, -math.inf
        for wid in sorted(self.workers):
            if wid in exclude or not self.routable(wid):
                continue
            f = self.freeness(wid)
            if f > best_free:
                best, best_free = wid, f
        return best

    def choose_offline(self, num_tokens: int, exclude: set[str] | frozenset[str] = frozenset()) -> str | None:
        """Where an offline request of `num_tokens` tokens (prompt + the next one) has the most slack: see the
        module's docstring. Ties go to the lowest id."""
        best, best_key = None, None
        for wid in sorted(self.workers):
            if wid in exclude or not self.routable(wid):
                continue
            free = self.freeness(wid)
            key = (free >= _blocks(num_tokens, self.workers[wid].block_size), -self.online_requests(wid), free)
            if best_key is None or key > best_key:
                best, best_key = wid, key
        return best

    def may_become_routable(self, exclude: set[str] | frozenset[str] = frozenset(), now: float | None = None) -> bool:
        """Some worker outside `exclude` is alive (healthy), so waiting for a routable one makes sense
        (it is forming a group, dropped layers, or refused a request moments ago), or is re-forming with its
        deadline after `now` (None: any re-forming worker counts). False when every candidate is dead or
        excluded: waiting would only delay the error."""
        if any(load.healthy for wid, load in self.workers.items() if wid not in exclude):
            return True
        return any(wid in self.workers and wid not in exclude and (now is None or now < until) for wid, until in self._back_by.items())

    def routed(self, worker_id: str, request_id: str, num_tokens: int, now: float, *, offline: bool = False) -> None:
        """Count a request routed to `worker_id` at `now` (the dispatcher clock at routing, which is
        what later reports are compared with) until a report taken after `now` includes it."""
        bs = self.workers[worker_id].block_size if worker_id in self.workers else 16
        self._pending.setdefault(worker_id, {})[request_id] = _Pending(_blocks(num_tokens, bs), now, offline)

    def done(self, worker_id: str, request_id: str) -> None:
        self._pending.get(worker_id, {}).pop(request_id, None)


def _blocks(num_tokens: int, block_size: int) -> int:
    bs = max(1, block_size)
    return -(-num_tokens // bs)
