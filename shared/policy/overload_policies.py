"""What each ``policy.overload`` label means for every component, decoded in one place.

The label picks how the cluster handles KV-memory overload (the headline comparison of ``kunserve bench
compare``). Each service reads only the trait it acts on: the config validates the label, a worker's
scheduler takes its preemption mode, the monitor its automatic action, the memory manager whether it forms
static pipeline pairs at start.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OverloadHandling:
    label: str
    preemption: str               # a worker's scheduler: "recompute", "swap" or "none" (batch_scheduler)
    monitor_action: str | None    # what the monitor (monitor.auto_drop) does on overload: "drop", "migrate" or nothing
    static_pairs: bool = False    # the memory manager pairs the workers into pipeline groups at start


_HANDLINGS = (
    # parameter-centric: drop replicated layers into pipeline groups, restore after (KunServe)
    OverloadHandling("kunserve", preemption="recompute", monitor_action="drop"),
    # vLLM's default: preempt the newest request, free its KV, re-prefill it later
    OverloadHandling("recompute", preemption="recompute", monitor_action=None),
    # InferCept-like: preempted requests' KV goes to host memory and comes back
    OverloadHandling("swap", preemption="swap", monitor_action=None),
    # Llumnix-like: move running requests' KV from an overloaded instance to the freest one
    OverloadHandling("migrate", preemption="recompute", monitor_action="migrate"),
    # every instance holds half the layers from the start, pipelined in pairs
    OverloadHandling("static-pp", preemption="recompute", monitor_action=None, static_pairs=True),
    # no preemption: a request starts only when its whole KV (prompt + max_tokens) fits
    OverloadHandling("queue", preemption="none", monitor_action=None),
)
OVERLOAD_HANDLINGS: dict[str, OverloadHandling] = {h.label: h for h in _HANDLINGS}
OVERLOAD_POLICIES: tuple[str, ...] = tuple(OVERLOAD_HANDLINGS)


def overload_handling(label: str) -> OverloadHandling:
    """The traits of a ``policy.overload`` label; ValueError names the known ones."""
    try:
        return OVERLOAD_HANDLINGS[label]
    except KeyError:
        raise ValueError(f"policy.overload must be one of {', '.join(OVERLOAD_POLICIES)}, got {label!r}") from None
