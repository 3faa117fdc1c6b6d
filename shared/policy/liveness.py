"""Liveness of workers as the dispatcher sees it, beyond "the process answers": pure policy, no I/O.

A worker is *stalled* when, for longer than ``stall_timeout_s``:

* its stats polls stop answering (a frozen process -- SIGSTOP, a wedged event loop -- times out instead of
  failing, so "it answers" alone would keep it healthy forever); or
* it answers, but its engine has requests and its token counters do not move while it is not in a layout
  transition (a hung engine thread behind a live gRPC server).

The dispatcher takes a stalled worker out of routing and resumes its requests elsewhere, exactly as for a dead
one. Each stall is reported once. Coming back: a silent worker rejoins with its first answer (its progress
clock restarts then, so the requests it still holds for a moment do not count against it); a worker whose
engine did not progress stays out (``stuck``) until its counters move or it has nothing left to do.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Track:
    last_answer: float                   # when a poll last answered
    progress: tuple[float, ...] = ()     # the progress counters last seen (tokens, busy seconds)
    progress_at: float = 0.0             # when they last moved (or the worker had nothing to do)
    busy: bool = False                   # it had requests (and was not transitioning) in the last answer
    work: int = 0                        # how many (for the message)
    reported: bool = False               # the current stall was reported (once per episode)
    stuck: bool = False                  # reported for lack of progress: out of routing until it progresses


@dataclass
class Liveness:
    stall_timeout_s: float = 3.0
    _tracks: dict[str, _Track] = field(default_factory=dict)

    def answered(self, worker_id: str, now: float, *, work: int, progress: tuple[float, ...],
                 transitioning: bool) -> None:
        """A stats poll answered at `now`: `work` requests running or waiting, `progress` its cumulative token
        counters (tokens, busy seconds). A transitioning worker is paused on purpose: its progress clock does not run."""
        t = self._tracks.get(worker_id)
        if t is None:
            t = self._tracks[worker_id] = _Track(last_answer=now, progress=progress, progress_at=now)
        if t.reported and not t.stuck:  # back from silence: judged afresh from now
            t.reported = False
            t.progress_at = now
        was_busy = t.busy
        t.last_answer = now
        t.busy = work > 0 and not transitioning
        t.work = work
        if progress != t.progress or not (t.busy and was_busy):  # the clock runs from when it got busy
            t.progress, t.progress_at = progress, now
            t.stuck = t.reported = False

    def stalled(self, worker_id: str, now: float) -> str | None:
        """Why the worker just became stalled at `now`; None when it is alive, unknown (never answered), or
        its stall was already reported."""
        t = self._tracks.get(worker_id)
        if t is None or t.reported:
            return None
        silent = now - t.last_answer
        if silent > self.stall_timeout_s:
            t.reported = True
            return f"its stats polls have not answered for {silent:.1f} s"
        idle = now - t.progress_at
        if t.busy and idle > self.stall_timeout_s:
            t.reported = t.stuck = True
            return f"its engine made no progress for {idle:.1f} s with {t.work} requests"
        return None

    def stuck(self, worker_id: str) -> bool:
        """Its engine stalled and has not progressed since: answering polls does not make it routable."""
        t = self._tracks.get(worker_id)
        return t is not None and t.stuck
