"""Admission control for the dispatcher: bounded requests in flight and bounded queued prompt tokens, with a
retry hint for what is refused. Pure policy over plain data: time comes in as an argument.

Why bounds at the front door: a request the cluster accepts must get its first token (or a status) within the
queue timeout. Accepting without bound only moves the queue into the workers, where every accepted request
waits behind all the others and nobody gets an answer; refusing early with RESOURCE_EXHAUSTED and a hint of
when to come back keeps the accepted ones fast and tells the rest what to do.

Two bounds, both checked on arrival:

* **in flight**: requests accepted and not finished (``max_inflight``);
* **queued prompt tokens**: the prompt tokens of accepted requests that have not produced their first token
  yet (``max_queued_tokens``) -- the prefill work ahead of a new request. A prompt is always admitted when
  nothing is queued, so one request as long as the context still gets in on an idle cluster.

The retry hint is the expected time until the refused bound has room again, from the recent rate at which
requests finish (in flight) or start (queued tokens); 1 s until a rate is known. Clients should add jitter.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

RATE_WINDOW_S = 10.0     # recent events that estimate completion / start rates
MIN_RETRY_S = 0.05
MAX_RETRY_S = 10.0
UNKNOWN_RATE_RETRY_S = 1.0


@dataclass(frozen=True)
class Refusal:
    """Why a request was not admitted: `bound` names the config key, `retry_after_s` is the hint."""

    bound: str
    message: str
    retry_after_s: float

    @property
    def retry_after_ms(self) -> int:
        return max(1, round(self.retry_after_s * 1000))


@dataclass
class _Rate:
    """Events per second (weighted by amount) over the last RATE_WINDOW_S."""

    events: deque[tuple[float, int]] = field(default_factory=deque)

    def add(self, now: float, amount: int = 1) -> None:
        self.events.append((now, amount))
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self.events and now - self.events[0][0] > RATE_WINDOW_S:
            self.events.popleft()

    def per_s(self, now: float) -> float | None:
        """None until two events span a measurable time."""
        self._trim(now)
        if len(self.events) < 2:
            return None
        span = now - self.events[0][0]
        return sum(a for _, a in self.events) / span if span > 0 else None


def _eta(needed: float, rate: float | None) -> float:
    if rate is None or rate <= 0:
        return UNKNOWN_RATE_RETRY_S
    return min(MAX_RETRY_S, max(MIN_RETRY_S, needed / rate))


@dataclass
class Admission:
    """The dispatcher's books: which requests are in, and whose prompt still waits for its first token."""

    _queued: dict[str, int] = field(default_factory=dict)  # request -> prompt tokens, until its first token
    _inflight: set[str] = field(default_factory=set)
    _finished: _Rate = field(default_factory=_Rate)
    _started_tokens: _Rate = field(default_factory=_Rate)
    refused_total: int = 0

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    @property
    def queued_tokens(self) -> int:
        return sum(self._queued.values())

    @property
    def queued_requests(self) -> int:
        return len(self._queued)

    def admit(self, request_id: str, prompt_tokens: int, now: float, *, max_inflight: int,
              max_queued_tokens: int) -> Refusal | None:
        """Take the request in (None) or say which bound refuses it and when to retry."""
        if self.inflight >= max_inflight:
            self.refused_total += 1
            wait = _eta(self.inflight - max_inflight + 1, self._finished.per_s(now))
            return Refusal("dispatcher.max_inflight_per_worker",
                           f"the cluster is at its bound of {max_inflight} requests in flight "
                           f"(dispatcher.max_inflight_per_worker x routable workers); retry in {wait * 1000:.0f} ms",
                           wait)
        queued = self.queued_tokens
        if queued and queued + prompt_tokens > max_queued_tokens:
            self.refused_total += 1
            wait = _eta(queued + prompt_tokens - max_queued_tokens, self._started_tokens.per_s(now))
            return Refusal("dispatcher.max_queued_prompt_tokens",
                           f"{queued} prompt tokens are queued for a first token; this prompt's {prompt_tokens} "
                           f"would exceed the bound of {max_queued_tokens} (dispatcher.max_queued_prompt_tokens); "
                           f"retry in {wait * 1000:.0f} ms", wait)
        self._inflight.add(request_id)
        self._queued[request_id] = prompt_tokens
        return None

    def started(self, request_id: str, now: float) -> None:
        """Its first token arrived: its prompt no longer counts as queued."""
        tokens = self._queued.pop(request_id, None)
        if tokens is not None:
            self._started_tokens.add(now, tokens)

    def release(self, request_id: str, now: float) -> None:
        """It ended (any outcome): its slot is free."""
        if request_id in self._inflight:
            self._inflight.discard(request_id)
            self._queued.pop(request_id, None)
            self._finished.add(now)

    def retry_after_s(self, now: float) -> float:
        """A hint for a request that gave up waiting for its first token (queue timeout)."""
        return _eta(1, self._finished.per_s(now))
