"""How long a policy holds a burst before requests queue, and the drops / restores it made (KunServe §5.5-5.6).

Fig. 17 of the paper replays a burst again and again and asks how long each system serves it before running
out of memory (KunServe 1.5x longer than vLLM, with two drops); Fig. 16 marks the drop periods of a long run
with two overloads. A run of `bench` measures both from what it already records: each request's arrival, send
time and TTFT, and the sampler's view of the layout. Pure: no clocks, no I/O; inputs are the JSON-able dicts of
a run's record, so a saved result.json can be re-read.

**Queueing.** A request *queues* when it waits longer than ``K x`` its unloaded TTFT for its first token, ``K``
being :data:`QUEUE_FACTOR` (the TTFT SLO scale the table reports, 5; paper §5.6: "no SLO (5x) violations").
Its unloaded TTFT (:class:`Unloaded`) is what calibration measured: the lone prefill of a mean-length prompt
(``mean prompt / prefill_tokens_per_s``, the probe's TTFT), or its own prefill time when its prompt is longer;
without calibration, the comparison's SLO reference (the best row's TTFT p50; a run's own p50 alone), which a
heavy burst inflates. It starts queueing at ``sent_s + K x unloaded``, the moment its wait passes that bound. A
request that got no first token (failed) queued too; one cut short by an interruption without a token was not
observed and is skipped.

**Holds.** For each burst window ``[start, end)`` (trace time): the requests that arrived in it, how many
queued, and ``onset_s``, the time from the window's start to the first moment one of them started queueing
(None: none did, the window was held through). For the run, ``hold_s`` is the time from the first window's
start to the first moment any request that arrived since then started queueing (between the windows
included: a backlog shows there first). When none did, ``hold_s`` is the lower bound ``max(sent_s + K x
unloaded) - start`` over those requests (as far as the run could see) and ``held_through`` is set.

**The memory limit** (the paper's own Fig. 17 measure: "reaches the memory limit in 152 s"), from the
sampler: ``memory_hold_s`` is the time from the first window's start to the first stretch of samples, at
least :data:`MEMORY_BOUND_S` long, in which the KV in use plus the prompts waiting at the workers exceed the
layout's KV capacity (an overload a drop relieves within that second does not count). On a machine short of
compute, requests can queue for the CPU well before memory runs out; this one tells the two apart. When it never
came, it is the lower bound ``last sample - start`` with ``memory_held_through`` set.

**Drops and restores** come from the sampler's layout (:func:`layout_events`): with ``workers`` the members of
all units and ``units`` the units (whole instances and pipeline groups), ``workers - units`` counts the merges
in force; a sample where it grew saw a drop (a pair, or pairs merging into a quad), one where it fell a
restore (a group split, a quad back into pairs). Two transitions within one sampling interval (0.25 s) read as
one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kunserve.benchkit.stats import QUEUEING_TTFT_FACTOR

QUEUE_FACTOR = QUEUEING_TTFT_FACTOR
DROP = "drop"
RESTORE = "restore"
CALIBRATION = "calibration"
SLO_REFERENCE = "slo_reference"
# An overload that a drop relieves sooner than this is not the memory limit (samples come every 0.25 s).
MEMORY_BOUND_S = 1.0


@dataclass(frozen=True)
class Unloaded:
    """A request's TTFT with nothing else on the instance: ``ttft_s`` for a prompt of the trace's mean length,
    and with ``prefill_tokens_per_s`` a longer prompt's own prefill time instead."""

    ttft_s: float
    prefill_tokens_per_s: float | None
    source: str    # CALIBRATION or SLO_REFERENCE

    def of(self, prompt_tokens: int) -> float:
        if self.prefill_tokens_per_s is None:
            return self.ttft_s
        return max(self.ttft_s, prompt_tokens / self.prefill_tokens_per_s)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def unloaded_ttft(source: Mapping[str, Any], mean_prompt: float | None, slo_reference_s: float | None) -> Unloaded | None:
    """The unloaded TTFT of a run whose trace came from ``source`` (its calibration record, when calibrated,
    holds the measured prefill speed), else the SLO reference; None when neither is usable."""
    speeds = (source.get("calibration") or {}).get("speeds") or {}
    rate = speeds.get("prefill_tokens_per_s")
    if rate and mean_prompt:
        return Unloaded(mean_prompt / rate, rate, CALIBRATION)
    if slo_reference_s is not None and slo_reference_s > 0:
        return Unloaded(slo_reference_s, None, SLO_REFERENCE)
    return None


def layout_events(samples: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The drops and restores between consecutive samples, each at the time of the sample that first showed
    it: ``{"t_s", "op", "units", "workers"}`` (the layout after it)."""
    events: list[dict[str, Any]] = []
    for a, b in zip(samples, samples[1:]):
        before, after = a["workers"] - a["units"], b["workers"] - b["units"]
        if after != before:
            events.append({"t_s": b["t_s"], "op": DROP if after > before else RESTORE, "units": b["units"],
                           "workers": b["workers"]})
    return events


def count(events: Sequence[Mapping[str, Any]], op: str, before_s: float | None = None) -> int:
    """Events of kind ``op``, those before ``before_s`` only when given."""
    return sum(1 for e in events if e["op"] == op and (before_s is None or e["t_s"] < before_s))


def _queued_at(r: Mapping[str, Any], unloaded: Unloaded) -> float | None:
    """When the request started queueing (send time + K x its unloaded TTFT), None when it did not (or was not
    seen)."""
    ttft = r.get("ttft_s")
    if ttft is None and r.get("error") == "interrupted":
        return None
    bound = QUEUE_FACTOR * unloaded.of(r["prompt_tokens"])
    if ttft is None or ttft > bound:
        return r["sent_s"] + bound
    return None


def memory_bound_at(samples: Sequence[Mapping[str, Any]], since_s: float) -> float | None:
    """The start of the first stretch of samples from ``since_s`` on, at least :data:`MEMORY_BOUND_S` long, in
    which the KV in use plus the prompts waiting at the workers exceed the layout's KV capacity; None when none
    came."""
    start: float | None = None
    for s in samples:
        if s["t_s"] < since_s:
            continue
        if s["kv_blocks_total"] and s["kv_blocks_used"] + s["queued_demand_blocks"] > s["kv_blocks_total"]:
            start = s["t_s"] if start is None else start
            if s["t_s"] - start >= MEMORY_BOUND_S:
                return start
        else:
            start = None
    return None


def burst_holds(requests: Sequence[Mapping[str, Any]], windows: Sequence[Mapping[str, Any]], unloaded: Unloaded | None,
                samples: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """The holds of one run (see the module docstring). ``requests``: RequestResult dicts (``arrival_s``,
    ``sent_s``, ``prompt_tokens``, ``ttft_s``, ``error``); ``windows``: ``{"start_s", "duration_s"}`` in trace
    time, as the trace source lists its bursts; ``unloaded``: :func:`unloaded_ttft`; ``samples``: the
    sampler's ClusterSample dicts. Keys: ``k``, ``unloaded`` (its dict), ``threshold_s`` (K x the unloaded TTFT
    of a mean-length prompt: the bound of every request no longer than that), ``hold_s``, ``held_through``,
    ``drops_before_queueing``, ``restores_before_queueing``, ``memory_hold_s``, ``memory_held_through`` and
    ``windows`` (per window: ``start_s``, ``end_s``, ``requests``, ``queued``, ``onset_s``). Without windows the
    run-level values are None; without an unloaded TTFT the queueing ones, without samples the memory ones."""
    ordered = sorted(windows, key=lambda w: w["start_s"])
    out: dict[str, Any] = {"k": QUEUE_FACTOR, "unloaded": None, "threshold_s": None, "hold_s": None,
                           "held_through": None, "drops_before_queueing": None, "restores_before_queueing": None,
                           "memory_hold_s": None, "memory_held_through": None, "windows": []}
    if ordered and samples:
        first = ordered[0]["start_s"]
        bound = memory_bound_at(samples, first)
        out["memory_held_through"] = bound is None
        out["memory_hold_s"] = (samples[-1]["t_s"] if bound is None else bound) - first
    if unloaded is None:
        out["windows"] = [{"start_s": w["start_s"], "end_s": w["start_s"] + w["duration_s"], "requests": None,
                           "queued": None, "onset_s": None} for w in ordered]
        return out
    out["unloaded"], out["threshold_s"] = unloaded.to_dict(), QUEUE_FACTOR * unloaded.ttft_s
    for w in ordered:
        start, end = w["start_s"], w["start_s"] + w["duration_s"]
        inside = [r for r in requests if start <= r["arrival_s"] < end]
        moments = [t for t in (_queued_at(r, unloaded) for r in inside) if t is not None]
        out["windows"].append({"start_s": start, "end_s": end, "requests": len(inside), "queued": len(moments),
                               "onset_s": min(moments) - start if moments else None})
    if not ordered:
        return out
    first = ordered[0]["start_s"]
    since = [r for r in requests if r["arrival_s"] >= first]
    moments = [t for t in (_queued_at(r, unloaded) for r in since) if t is not None]
    if moments:
        out["hold_s"], out["held_through"] = min(moments) - first, False
    elif since:
        out["hold_s"] = max(r["sent_s"] + QUEUE_FACTOR * unloaded.of(r["prompt_tokens"]) for r in since) - first
        out["held_through"] = True
    if out["hold_s"] is not None:
        events = layout_events(samples)
        until = first + out["hold_s"]
        out["drops_before_queueing"] = count(events, DROP, until)
        out["restores_before_queueing"] = count(events, RESTORE, until)
    return out


__all__ = ["CALIBRATION", "DROP", "MEMORY_BOUND_S", "QUEUE_FACTOR", "RESTORE", "SLO_REFERENCE", "Unloaded", "burst_holds",
           "count", "layout_events", "memory_bound_at", "unloaded_ttft"]
