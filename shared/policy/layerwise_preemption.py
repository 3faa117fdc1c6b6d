"""When an online arrival preempts the offline rows of the iteration in flight (ConServe Algorithm 2): a pure
policy over what the engine published about its iteration and what the latency model predicts.

The arrival waits for whatever is left of the iteration in flight, then for the prefill of the online prompts
queued ahead of it and its own (Algorithm 2's Q_on). If that would miss the TTFT SLO and the iteration carries
offline rows, the worker raises the engine's preemption flag; the
next safepoint of the forward pass drops the offline rows (``shared/engine/safepoint.py``) and the iteration
ends sooner. An iteration with no offline rows is never cut (online work is what the SLO protects), so online-
only serving pays nothing. Without a latency model (``predicted_s`` = 0) the remaining time is unknown and any
iteration carrying offline rows is cut: online requests first, as Algorithm 1 orders them.

An arrival with nothing in flight is taken by the next schedule, online first, and waits for no offline work.
One that comes after that schedule but before its pass is published (its add missed the schedule) is checked by
the engine as the pass starts (``Engine.online_arrived``), so no arrival goes unchecked.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class IterationInFlight:
    """What the engine publishes as a forward pass begins (read from other threads: immutable)."""

    started_s: float      # time.monotonic() when the pass began
    predicted_s: float    # the latency model's prediction for the whole batch; 0 = no model
    offline_rows: int     # tokens of offline requests in the batch
    online_rows: int
    online_queued_tokens: int = 0  # prompt tokens of online requests left to prefill after this batch


def should_preempt(now_s: float, it: IterationInFlight | None, online_prefill_s: float, ttft_s: float) -> bool:
    """Raise the preemption flag for an online request arriving at `now_s`? `online_prefill_s`: the predicted
    prefill of the online prompts it waits behind once the pass in flight ends (those queued, those that arrived
    during the pass) and its own; the caller predicts it (``Engine.online_arrived``)."""
    if it is None or it.offline_rows == 0:
        return False
    if it.predicted_s <= 0:
        return True
    remaining = max(0.0, it.predicted_s - (now_s - it.started_s))
    return remaining + online_prefill_s > ttft_s
