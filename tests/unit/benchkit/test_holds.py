"""The holds metric (how long a run serves a burst before requests queue) and the drops / restores read from the
sampler's layout, on synthetic requests and samples."""

import json

import pytest

from kunserve.benchkit.holds import (
    CALIBRATION,
    DROP,
    MEMORY_BOUND_S,
    QUEUE_FACTOR,
    RESTORE,
    SLO_REFERENCE,
    Unloaded,
    burst_holds,
    count,
    layout_events,
    memory_bound_at,
    unloaded_ttft,
)
from kunserve.benchkit.stats import QUEUEING_TTFT_FACTOR


def req(arrival, ttft, *, sent=None, error="", prompt=100):
    return {"arrival_s": arrival, "sent_s": arrival if sent is None else sent, "ttft_s": ttft,
            "ok": ttft is not None, "error": error, "prompt_tokens": prompt}


FLAT = Unloaded(0.1, None, SLO_REFERENCE)  # every request's bound is 5 x 0.1 s


def sample(t, units, workers=4, *, used=0, total=100, queued=0):
    return {"t_s": t, "units": units, "workers": workers, "kv_blocks_used": used, "kv_blocks_total": total,
            "queued_demand_blocks": queued}


def window(start, duration):
    return {"start_s": start, "duration_s": duration, "factor": 5.0}


def test_the_queue_factor_is_the_tables_slo_scale():
    assert QUEUE_FACTOR == QUEUEING_TTFT_FACTOR == 5.0


def test_unloaded_ttft_from_the_calibration_else_the_slo_reference():
    calibrated = {"calibration": {"speeds": {"prefill_tokens_per_s": 1000.0, "tpot_s": 0.01}}}
    u = unloaded_ttft(calibrated, 200.0, 0.7)
    assert u == Unloaded(0.2, 1000.0, CALIBRATION)
    assert u.of(50) == 0.2 and u.of(200) == 0.2 and u.of(800) == pytest.approx(0.8)  # a longer prompt: its prefill
    assert unloaded_ttft({"kind": "gamma"}, 200.0, 0.7) == Unloaded(0.7, None, SLO_REFERENCE)
    assert unloaded_ttft({"calibration": None}, 200.0, 0.7).of(5000) == 0.7
    assert unloaded_ttft({}, None, None) is None and unloaded_ttft({}, 10.0, 0.0) is None


def test_drops_and_restores_from_the_layout():
    # 4 whole instances -> two pairs (one drop) -> a quad (second drop) -> pairs -> whole (two restores);
    # a worker leaving and coming back as a whole instance changes nothing
    units = [(0.0, 4), (0.25, 4), (0.5, 2), (1.0, 2), (1.25, 1), (3.0, 1), (3.25, 2), (4.0, 4)]
    samples = [sample(t, u) for t, u in units] + [sample(4.25, 3, workers=3), sample(4.5, 4)]
    events = layout_events(samples)
    assert [(e["t_s"], e["op"], e["units"]) for e in events] == [
        (0.5, DROP, 2), (1.25, DROP, 1), (3.25, RESTORE, 2), (4.0, RESTORE, 4)]
    assert count(events, DROP) == 2 and count(events, RESTORE) == 2
    assert count(events, DROP, before_s=1.25) == 1 and count(events, RESTORE, before_s=3.25) == 0
    # a pair on 2 workers: whole -> pair -> whole
    assert [e["op"] for e in layout_events([sample(0, 2, 2), sample(1, 1, 2), sample(2, 2, 2)])] == [DROP, RESTORE]
    assert layout_events([]) == [] and layout_events([sample(0, 2, 2)]) == []


def test_holds_per_window_and_for_the_run():
    # reference TTFT 0.1 s: a request queues when its TTFT exceeds 0.5 s, from its send time + 0.5 s
    requests = [
        req(1.0, 2.0),                       # before the first burst: ignored however slow
        req(10.0, 0.1), req(11.0, 0.3),      # window 1 [10, 14): both within 0.5 s
        req(13.0, 0.6),                      # window 1: queued from 13.5 s
        req(12.0, 0.9),                      # window 1: queued from 12.5 s, the first
        req(16.0, 0.2),                      # between the windows
        req(20.0, 0.1), req(21.0, None, error="DEADLINE_EXCEEDED: x"),  # window 2: a failure queued at 21.5 s
        req(24.5, 0.2, error="interrupted"),  # outside every window
    ]
    # drops at 10.3, 12.0 and 12.7 s (pairs, then a quad), a restore at 17 s
    samples = [sample(t, u) for t, u in ((10.0, 4), (10.3, 3), (12.0, 2), (12.7, 1), (17.0, 2))]
    h = burst_holds(requests, [window(20.0, 4.0), window(10.0, 4.0)], FLAT, samples)  # any order: sorted by start
    assert h["k"] == 5.0 and h["unloaded"]["ttft_s"] == 0.1 and h["threshold_s"] == pytest.approx(0.5)
    w1, w2 = h["windows"]
    assert (w1["start_s"], w1["end_s"], w1["requests"], w1["queued"]) == (10.0, 14.0, 4, 2)
    assert w1["onset_s"] == pytest.approx(2.5)
    assert (w2["start_s"], w2["requests"], w2["queued"]) == (20.0, 2, 1) and w2["onset_s"] == pytest.approx(1.5)
    # the run held from 10 s (the first window's start) to 12.5 s; two drops came before that
    assert h["hold_s"] == pytest.approx(2.5) and h["held_through"] is False
    assert h["drops_before_queueing"] == 2 and h["restores_before_queueing"] == 0
    json.dumps(h)


def test_queueing_between_windows_ends_the_hold_and_onset_uses_the_send_time():
    # the backlog shows first in a request that arrived between the windows; a request sent late (the client
    # lagged) starts queueing from when it was sent
    requests = [req(5.0, 0.1), req(7.0, 3.0), req(10.0, 0.8, sent=10.4)]
    h = burst_holds(requests, [window(4.0, 2.0), window(10.0, 2.0)], FLAT)
    assert h["hold_s"] == pytest.approx(7.5 - 4.0)
    assert [w["onset_s"] for w in h["windows"]] == [None, pytest.approx(0.9)]
    assert h["drops_before_queueing"] == 0  # no events


def test_a_run_that_never_queued_held_through_a_lower_bound():
    requests = [req(2.0, 0.1), req(3.0, 0.2), req(30.0, 0.4)]
    h = burst_holds(requests, [window(2.0, 5.0)], FLAT, [sample(2.0, 2, 2), sample(2.5, 1, 2)])
    assert h["held_through"] is True and h["hold_s"] == pytest.approx(30.0 + 0.5 - 2.0)
    assert h["windows"][0]["onset_s"] is None and h["windows"][0]["queued"] == 0
    assert h["drops_before_queueing"] == 1


def test_a_long_prompt_may_take_its_own_prefill_time():
    # unloaded: 0.1 s for a mean prompt of 100 tokens at 1000 tokens/s; a 600-token prompt's is 0.6 s (bound 3 s)
    unloaded = Unloaded(0.1, 1000.0, CALIBRATION)
    requests = [req(1.0, 2.0, prompt=600), req(1.5, 0.6, prompt=20), req(3.0, 3.5, prompt=600)]
    h = burst_holds(requests, [window(1.0, 4.0)], unloaded)
    assert h["windows"][0]["queued"] == 2 and h["hold_s"] == pytest.approx(0.5 + 0.5)  # the short one, at 2 s
    assert h["unloaded"] == {"ttft_s": 0.1, "prefill_tokens_per_s": 1000.0, "source": CALIBRATION}
    late = burst_holds(requests[::2], [window(1.0, 4.0)], unloaded)
    assert late["hold_s"] == pytest.approx(3.0 + 3.0 - 1.0)


def test_the_memory_limit_is_an_overload_that_lasts():
    # capacity 100 blocks, then 250 after a drop at 3 s; over capacity at 2.5-2.75 s (a drop relieves it), then
    # for good from 5 s on
    demand = {0.0: 20, 0.5: 60, 2.5: 120, 2.75: 130, 3.0: 130, 4.0: 200, 5.0: 260, 5.25: 270, 5.5: 300,
              5.75: 320, 6.0: 330, 6.25: 300}
    samples = [sample(t, 2 if t < 3 else 1, 2, used=min(d, 100 if t < 3 else 250),
                      total=100 if t < 3 else 250, queued=max(0, d - (100 if t < 3 else 250)))
               for t, d in demand.items()]
    assert MEMORY_BOUND_S == 1.0
    assert memory_bound_at(samples, 0.0) == 5.0 and memory_bound_at(samples, 4.5) == 5.0
    assert memory_bound_at(samples, 5.5) is None  # 5.5-6.25 s: not a second
    assert memory_bound_at(samples[:-2], 0.0) is None  # 5.0-5.75 s: neither
    h = burst_holds([req(1.0, 0.05), req(2.6, 0.05)], [window(1.0, 2.0)], FLAT, samples)
    assert h["memory_hold_s"] == pytest.approx(4.0) and h["memory_held_through"] is False
    assert h["hold_s"] == pytest.approx(2.1) and h["held_through"] is True  # no request queued
    calm = burst_holds([req(1.0, 0.05)], [window(1.0, 2.0)], FLAT, samples[:4])
    assert calm["memory_held_through"] is True and calm["memory_hold_s"] == pytest.approx(2.75 - 1.0)
    # the memory measure needs no unloaded TTFT, but samples
    assert burst_holds([req(1.0, 0.05)], [window(1.0, 2.0)], None, samples)["memory_hold_s"] == pytest.approx(4.0)
    assert burst_holds([req(1.0, 0.05)], [window(1.0, 2.0)], FLAT)["memory_hold_s"] is None


def test_no_windows_or_no_reference():
    requests = [req(1.0, 0.1)]
    none = burst_holds(requests, [], FLAT)
    assert none["hold_s"] is None and none["held_through"] is None and none["windows"] == []
    h = burst_holds(requests, [window(0.5, 1.0)], None)
    assert h["hold_s"] is None and h["threshold_s"] is None and h["unloaded"] is None
    assert h["windows"] == [{"start_s": 0.5, "end_s": 1.5, "requests": None, "queued": None, "onset_s": None}]
    empty = burst_holds([req(1.0, 0.1)], [window(5.0, 1.0)], FLAT)  # nothing arrived from the window on
    assert empty["hold_s"] is None and empty["windows"][0]["requests"] == 0
