"""Admission control policy (kunserve.shared.policy.admission): the bounds, the retry hint, the bookkeeping."""

from __future__ import annotations

import pytest

from kunserve.shared.policy.admission import MAX_RETRY_S, MIN_RETRY_S, UNKNOWN_RATE_RETRY_S, Admission


def test_inflight_bound_refuses_with_the_key_and_a_retry_hint():
    a = Admission()
    for i in range(3):
        assert a.admit(f"r{i}", 10, 0.0, max_inflight=3, max_queued_tokens=1000) is None
    r = a.admit("r3", 10, 0.0, max_inflight=3, max_queued_tokens=1000)
    assert r is not None and r.bound == "dispatcher.max_inflight_per_worker"
    assert "3 requests in flight" in r.message and "retry in" in r.message
    assert r.retry_after_s == UNKNOWN_RATE_RETRY_S and r.retry_after_ms == 1000
    assert a.refused_total == 1 and a.inflight == 3
    a.release("r0", 1.0)
    assert a.admit("r3", 10, 1.0, max_inflight=3, max_queued_tokens=1000) is None


def test_queued_prompt_tokens_bound_counts_only_requests_without_a_first_token():
    a = Admission()
    assert a.admit("a", 600, 0.0, max_inflight=10, max_queued_tokens=1000) is None
    r = a.admit("b", 500, 0.0, max_inflight=10, max_queued_tokens=1000)
    assert r is not None and r.bound == "dispatcher.max_queued_prompt_tokens"
    assert "600 prompt tokens are queued" in r.message and "500" in r.message
    a.started("a", 0.5)  # first token: its prompt left the queue, the request is still in flight
    assert a.queued_tokens == 0 and a.inflight == 1
    assert a.admit("b", 500, 0.5, max_inflight=10, max_queued_tokens=1000) is None
    assert a.queued_tokens == 500 and a.queued_requests == 1


def test_a_prompt_larger_than_the_token_bound_gets_in_when_nothing_is_queued():
    a = Admission()
    assert a.admit("long", 5000, 0.0, max_inflight=10, max_queued_tokens=1000) is None
    assert a.admit("next", 1, 0.0, max_inflight=10, max_queued_tokens=1000) is not None


def test_retry_hint_follows_the_recent_completion_rate_and_is_clamped():
    a = Admission()
    for i in range(2):
        a.admit(f"x{i}", 1, 0.0, max_inflight=2, max_queued_tokens=100)
    a.release("x0", 1.0)
    a.release("x1", 1.5)  # two completions over 0.5 s -> 4 per second (measured up to "now")
    a.admit("y0", 1, 1.5, max_inflight=2, max_queued_tokens=100)
    a.admit("y1", 1, 1.5, max_inflight=2, max_queued_tokens=100)
    r = a.admit("z", 1, 1.5, max_inflight=2, max_queued_tokens=100)
    assert r is not None and r.retry_after_s == pytest.approx(0.25)
    # the window forgets old completions: with no recent rate the hint falls back to the default
    assert a.admit("z", 1, 100.0, max_inflight=2, max_queued_tokens=100).retry_after_s == UNKNOWN_RATE_RETRY_S
    assert MIN_RETRY_S <= a.retry_after_s(1.5) <= MAX_RETRY_S


def test_release_is_idempotent_and_forgets_unknown_requests():
    a = Admission()
    a.admit("a", 5, 0.0, max_inflight=1, max_queued_tokens=10)
    a.release("a", 1.0)
    a.release("a", 1.0)
    a.release("never", 1.0)
    a.started("never", 1.0)
    assert a.inflight == 0 and a.queued_tokens == 0
