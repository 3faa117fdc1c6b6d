"""What a pipeline group's head ships next, and the other scheduling glue an engine runs around the pure policies.

The engine (`Engine`, over tensors) and the simulator's worker (`kunserve/sim/worker.py`, over lengths) both run a
group head's microbatch loop and an instance's SLO budget; this module is the one copy of that glue, so the two
cannot drift apart:

* `LookaheadPlan`: the head's next microbatch (KunServe §4.3): its decodes are, while the decode split says so,
  this microbatch's share of the decoding requests, else all of them; its prompt chunks are the next lookahead
  microbatch while a plan lasts (a new plan over the whole queue when none is left and the former finds the queue
  long), else the scheduler's token chunking. A microbatch that does not come out as planned (memory ran short, a
  request left or was preempted) drops the rest of the plan; what was scheduled is valid either way.
* `online_queued_tokens`: online prompt tokens still to prefill after a batch (an online arrival queues behind
  them: layer-wise preemption's wait estimate).
* `role_budget`: the token budget of a role, under a fresh measured latency when it is ConServe's SLO budget.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable

from kunserve.shared.policy.batch_scheduler import ScheduledChunk, Scheduler, TokenBudget
from kunserve.shared.policy.measured_latency import MeasuredLatencyModel
from kunserve.shared.policy.microbatch import Microbatch, MicrobatchFormer, MicroChunk
from kunserve.shared.policy.token_budget import SLOTokenBudget


class LookaheadPlan:
    """A group head's lookahead microbatches still to ship, the former that plans them (None: token chunking) and
    how many microbatches went out as planned."""

    def __init__(self, former: MicrobatchFormer | None = None) -> None:
        self.former = former
        self.pending: collections.deque[Microbatch] = collections.deque()
        self.planned = 0

    def clear(self) -> None:
        self.pending.clear()

    def peek(self, scheduler: Scheduler, decodes: int) -> Microbatch | None:
        """The next lookahead microbatch; a new plan over the whole queue when none is left and the former finds
        the queue long. None: token chunking. A per-chunk cap (max_prefill_chunk) rules lookahead out."""
        former = self.former
        if not self.pending and former is not None and not scheduler.config.max_prefill_chunk:
            budget = max(1, scheduler.budget.max_tokens_for(0) - decodes)
            items = scheduler.prompt_work()
            if former.uses_lookahead(items, budget):
                self.pending.extend(former.form(items, budget))
        return self.pending[0] if self.pending else None

    def next_microbatch(self, scheduler: Scheduler, inflight: int, split_decodes: bool) -> list[ScheduledChunk]:
        """Schedule the head's next microbatch with `inflight` microbatches in flight (see the module doc)."""
        share = scheduler.decode_share(inflight) if split_decodes else None
        planned = self.peek(scheduler, share if share is not None else scheduler.num_decoding())
        if planned is None:
            return scheduler.schedule(max_decodes=share)
        chunks = scheduler.schedule(max_decodes=share, prompt_tokens=sum(c.num_tokens for c in planned))
        ids = {c.request_id for c in planned}
        got = [MicroChunk(c.seq.request_id, c.start, c.num_tokens) for c in chunks if c.seq.request_id in ids]
        if got == planned:
            self.pending.popleft()
            self.planned += 1
        else:
            self.pending.clear()
        return chunks


def online_queued_tokens(scheduler: Scheduler, chunks: Iterable[ScheduledChunk]) -> int:
    """Prompt tokens of online requests still to prefill after this batch: an online arrival queues behind them."""
    batch = {id(c.seq): c.num_tokens for c in chunks}
    left = (s.remaining - batch.get(id(s), 0) for s in (*scheduler.running, *scheduler.waiting) if not s.request.offline)
    return sum(n for n in left if n > 1)


def role_budget(configured: TokenBudget, assumed_scale: float) -> tuple[TokenBudget, MeasuredLatencyModel | None]:
    """The budget of a role and the measured latency it runs under: the configured budget as is when it has no
    latency model, else ConServe's SLO budget under a fresh `MeasuredLatencyModel` that assumes `assumed_scale` x
    the profile's prediction until it has measured (a group head's microbatch round trip waits behind every other
    microbatch in flight)."""
    if not isinstance(configured, SLOTokenBudget):
        return configured, None
    latency = MeasuredLatencyModel(configured.model, assumed_scale=float(assumed_scale))
    return dataclasses.replace(configured, model=latency), latency


__all__ = ["LookaheadPlan", "online_queued_tokens", "role_budget"]
