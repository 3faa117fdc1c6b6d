"""Worker liveness policy (kunserve.shared.policy.liveness): silence and lack of progress, each reported once,
and how a worker comes back."""

from __future__ import annotations

from kunserve.shared.policy.liveness import Liveness


def test_unknown_worker_is_never_stalled():
    assert Liveness(1.0).stalled("w", 100.0) is None


def test_silence_beyond_the_timeout_is_reported_once_and_the_first_answer_clears_it():
    lv = Liveness(1.0)
    lv.answered("w", 0.0, work=2, progress=(10, 5), transitioning=False)
    assert lv.stalled("w", 0.9) is None
    why = lv.stalled("w", 1.5)
    assert why is not None and "not answered for 1.5 s" in why
    assert lv.stalled("w", 5.0) is None  # reported already
    assert not lv.stuck("w")
    # SIGCONT: it answers still holding its abandoned requests (same counters): judged afresh from now
    lv.answered("w", 6.0, work=2, progress=(10, 5), transitioning=False)
    assert lv.stalled("w", 6.5) is None and not lv.stuck("w")
    lv.answered("w", 6.6, work=0, progress=(10, 5), transitioning=False)  # it freed them
    assert lv.stalled("w", 20.0) is not None  # silent again: a new episode


def test_busy_engine_without_progress_is_stuck_until_its_counters_move():
    lv = Liveness(1.0)
    lv.answered("w", 0.0, work=3, progress=(10, 5), transitioning=False)
    for t in (0.3, 0.6, 0.9):
        lv.answered("w", t, work=3, progress=(10, 5), transitioning=False)
    assert lv.stalled("w", 0.95) is None
    lv.answered("w", 1.2, work=3, progress=(10, 5), transitioning=False)
    why = lv.stalled("w", 1.2)
    assert why is not None and "no progress for 1.2 s with 3 requests" in why
    assert lv.stuck("w") and lv.stalled("w", 3.0) is None
    lv.answered("w", 3.1, work=3, progress=(10, 5), transitioning=False)
    assert lv.stuck("w")  # answering is not enough
    lv.answered("w", 3.2, work=3, progress=(10, 6), transitioning=False)
    assert not lv.stuck("w") and lv.stalled("w", 3.3) is None


def test_idle_or_transitioning_workers_are_not_judged_by_progress():
    lv = Liveness(1.0)
    for t in range(10):
        lv.answered("idle", float(t), work=0, progress=(1, 1), transitioning=False)
        lv.answered("moving", float(t), work=4, progress=(1, 1), transitioning=True)
    assert lv.stalled("idle", 9.5) is None and lv.stalled("moving", 9.5) is None
    # a transition that ends restarts the clock: no stall right after it
    lv.answered("moving", 10.0, work=4, progress=(1, 1), transitioning=False)
    assert lv.stalled("moving", 10.5) is None
    assert lv.stalled("moving", 11.2) is not None


def test_a_stuck_worker_with_nothing_left_to_do_rejoins():
    lv = Liveness(0.5)
    lv.answered("w", 0.0, work=1, progress=(0, 0), transitioning=False)
    lv.answered("w", 0.6, work=1, progress=(0, 0), transitioning=False)
    assert lv.stalled("w", 0.6) is not None and lv.stuck("w")
    lv.answered("w", 0.7, work=0, progress=(0, 0), transitioning=False)  # its abandoned requests were freed
    assert not lv.stuck("w")
