"""When an online arrival preempts the offline rows of the iteration in flight (ConServe Algorithm 2): a pure
policy over what the engine published about its iteration and what the latency model predicts.

The arrival waits for whatever is left of the iteration in flight, then for its own prefill. If that would
miss the TTFT SLO and the iteration carries offline rows, the worker raises the engine's preemption flag; the
next safepoint of the forward pass drops the offline rows (``shared/engine/safepoint.py``) and the iteration
ends sooner. An iteration with no offline rows is never cut (online work is what the SLO protects), so online-
only serving pays nothing. Without a latency model (``predicted_s`` = 0) the remaining time is unknown and any
iteration carrying offline rows is cut: online requests first, as Algorithm 1 orders them.
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


def should_preempt(now_s: float, it: IterationInFlight | None, online_prefill_s: float, ttft_s: float) -> bool:
    """Raise the preemption flag for an online request arriving at `now_s` whose own prefill (with the online
    requests already waiting) is predicted to take `online_prefill_s`?"""
    if it is None or it.offline_rows == 0:
        return False
    if it.predicted_s <= 0:
        return True
    remaining = max(0.0, it.predicted_s - (now_s - it.started_s))
    return remaining + online_prefill_s > ttft_s
