"""Algorithm 2: an online arrival cuts the iteration in flight only when it carries offline rows and waiting for
the rest of it would miss the TTFT SLO."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kunserve.shared.policy.layerwise_preemption import IterationInFlight, should_preempt


def test_nothing_in_flight_or_online_only_is_never_cut():
    assert not should_preempt(10.0, None, 5.0, 0.1)
    assert not should_preempt(10.0, IterationInFlight(9.0, 3.0, 0, 64), 5.0, 0.1)


def test_the_rest_of_the_iteration_plus_the_prefill_against_the_slo():
    it = IterationInFlight(started_s=10.0, predicted_s=0.5, offline_rows=256, online_rows=0)
    assert should_preempt(10.1, it, 0.05, 0.3), "0.4 s left + 0.05 s > 0.3 s"
    assert not should_preempt(10.3, it, 0.05, 0.3), "0.2 s left + 0.05 s fits"
    assert not should_preempt(11.0, it, 0.05, 0.3), "overdue: nothing left to wait for"


def test_without_a_latency_model_offline_rows_are_always_cut():
    assert should_preempt(10.0, IterationInFlight(9.9, 0.0, 8, 0), 0.0, 100.0)


@given(st.floats(0, 5), st.floats(0, 5), st.floats(0.001, 5), st.integers(0, 512), st.floats(0, 2), st.floats(0.01, 5))
def test_cut_iff_the_prediction_says_the_slo_would_be_missed(started, elapsed, predicted, offline, prefill, ttft):
    it = IterationInFlight(started, predicted, offline, 1)
    now = started + elapsed
    cut = should_preempt(now, it, prefill, ttft)
    assert cut == (offline > 0 and max(0.0, predicted - (now - started)) + prefill > ttft)
