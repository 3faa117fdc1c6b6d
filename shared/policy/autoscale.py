"""When to ask for more instances and when to give one back: autoscaling behind the drop (KunServe §4.4).

A drop buys seconds; they are what hides a new instance's cold start. So the memory manager asks its scaler for an
instance when the drop planner says no plan meets the requirement ("autoscale needed") or when a drop has held for
``hold_s`` (the burst is not passing), and gives an added instance back once the cluster has been calm for
``scale_down_hold_s``: no pipeline group, no need, no overload, and the KV usage of the cluster without that instance
below ``scale_down_usage``. Hysteresis comes from the two different conditions (need to add, calm *and* low usage to
remove), the hold times and a ``cooldown_s`` between any two actions; one request is outstanding at a time (the next
waits until the instances asked for serve, or until ``scale_up_timeout_s`` gives up on them: then the cluster goes
on with what it has, and the need may ask again).

A drop that held long enough asks once per episode: after an instance it asked for serves, the hold restarts, so a
group that persists while the new instance takes load does not add one instance per cooldown.

A scale-down drains the instance back to standby before the scaler takes its capacity back; when the scaler refused
that (a Kubernetes API that said no), the standby instance is left over. While the cluster is calm it is given back
again (``give_back``), at most once per ``max(cooldown_s, scale_down_hold_s)``.

Pure: signals in (plain data, a clock reading), decisions out (tests/unit/policy/test_autoscale.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

SCALE_UP = "scale_up"
SCALE_DOWN = "scale_down"
GIVE_BACK = "give_back"  # a standby instance a scale-down left over: the scaler is asked again to take it back
NOTHING = "nothing"


@dataclass(frozen=True)
class AutoscaleConfig:
    hold_s: float = 30.0
    scale_down_hold_s: float = 60.0
    scale_down_usage: float = 0.5
    cooldown_s: float = 5.0
    scale_up_timeout_s: float = 120.0
    max_workers: int = 0  # members at most, seeds included; 0 = no cap
    step: int = 1  # instances asked for at once


@dataclass(frozen=True)
class Candidate:
    """An added instance that may be given back (a whole instance, not draining), and its KV capacity."""

    worker_id: str
    kv_blocks: int


@dataclass(frozen=True)
class ClusterSignals:
    now: float
    autoscale_needed: bool = False  # the drop planner's latest word: no plan meets the requirement
    needed_since: float | None = None  # when that autoscale-needed episode began (None: when first seen here)
    dropped_since: float | None = None  # since when at least one pipeline group exists (None: none now)
    members: int = 0  # live members, seeds included
    available: int | None = None  # instances the scaler can add now (None: unbounded or unknown)
    kv_used_blocks: int | None = None  # the cluster's KV in use (None: no figure, e.g. the monitor did not answer)
    kv_total_blocks: int = 0
    overloaded: bool = False  # some unit is overloaded now
    removable: tuple[Candidate, ...] = ()  # preferred first
    left_over: tuple[str, ...] = ()  # standby instances a scale-down drained but the scaler kept, preferred first


@dataclass(frozen=True)
class ScaleDecision:
    action: str
    count: int = 0  # scale_up: instances to ask for
    worker_id: str = ""  # scale_down / give_back: the instance to give back
    reason: str = ""
    expired: int = 0  # instances asked for that did not serve within scale_up_timeout_s (given up on by this call)


@dataclass
class _Pending:
    asked_at: float
    need_since: float  # when the need it answers began (for "autoscale needed -> serving")


@dataclass
class AutoscalePolicy:
    config: AutoscaleConfig = field(default_factory=AutoscaleConfig)
    _pending: list[_Pending] = field(default_factory=list)
    _last_action: float = float("-inf")
    _calm_since: float | None = None
    _need_since: float | None = None
    _served_at: float = float("-inf")  # the last time an instance asked for started serving
    _gave_back_at: float = float("-inf")  # the last scale-down or give-back (left-over standby instances wait)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def need_since(self) -> float | None:
        """When the current need began (None: no need now)."""
        return self._need_since

    def decide(self, s: ClusterSignals) -> ScaleDecision:
        c = self.config
        now = s.now
        expired = [p for p in self._pending if now - p.asked_at > c.scale_up_timeout_s]
        self._pending = [p for p in self._pending if p not in expired]
        why = self._need(s)
        if why is not None:
            if self._need_since is None:
                self._need_since = s.needed_since if s.autoscale_needed and s.needed_since is not None else now
            self._calm_since = None
        else:
            self._need_since = None
        calm = why is None and s.dropped_since is None and not s.overloaded
        if not calm:
            self._calm_since = None
        elif self._calm_since is None:
            self._calm_since = now

        def nothing(reason: str) -> ScaleDecision:
            return ScaleDecision(NOTHING, reason=reason, expired=len(expired))

        if why is not None:
            if self._pending:
                return nothing(f"{why}; waiting for the {len(self._pending)} instance(s) asked for")
            if now - self._last_action < c.cooldown_s:
                return nothing(f"{why}; cooling down after the last scale action")
            room = c.step if s.available is None else min(c.step, s.available)
            if c.max_workers:
                room = min(room, c.max_workers - s.members)
            if room <= 0:
                cap = (
                    f"autoscale.max_workers = {c.max_workers} reached"
                    if c.max_workers and s.members >= c.max_workers
                    else "the scaler has no instance left to add"
                )
                return nothing(f"{why}; {cap}")
            assert self._need_since is not None
            self._pending.extend(_Pending(now, self._need_since) for _ in range(room))
            self._last_action = now
            return ScaleDecision(SCALE_UP, count=room, reason=why, expired=len(expired))

        if calm and s.left_over and not self._pending and now - self._gave_back_at >= max(c.cooldown_s, c.scale_down_hold_s):
            self._gave_back_at = now
            return ScaleDecision(
                GIVE_BACK,
                worker_id=s.left_over[0],
                expired=len(expired),
                reason="calm: a standby instance an earlier scale-down left over",
            )
        if not calm or not s.removable:
            return nothing("")
        assert self._calm_since is not None
        calm_for = now - self._calm_since
        if self._pending or calm_for < c.scale_down_hold_s or now - self._last_action < max(c.cooldown_s, c.scale_down_hold_s):
            return nothing("")
        if s.kv_used_blocks is None:
            return nothing("calm, but no KV usage figure to size a scale-down on")
        victim = s.removable[0]
        left = s.kv_total_blocks - victim.kv_blocks
        if left <= 0:
            return nothing(f"{victim.worker_id} holds all the KV capacity")
        usage = s.kv_used_blocks / left
        if usage >= c.scale_down_usage:
            return nothing(f"calm, but the KV usage without {victim.worker_id} would be {usage:.0%}")
        self._last_action = self._gave_back_at = now
        return ScaleDecision(
            SCALE_DOWN,
            worker_id=victim.worker_id,
            expired=len(expired),
            reason=f"calm for {calm_for:.0f} s; KV usage without it {usage:.0%}",
        )

    def _need(self, s: ClusterSignals) -> str | None:
        if s.autoscale_needed:
            return "autoscale needed: no drop plan meets the requirement"
        if s.dropped_since is not None:
            held = s.now - max(s.dropped_since, self._served_at)
            if held >= self.config.hold_s:
                return f"a drop has held for {held:.0f} s"
        return None

    def served(self, now: float) -> float | None:
        """An instance asked for serves: returns when the need it answered began (None: nobody asked for it)."""
        self._served_at = now
        if not self._pending:
            return None
        return self._pending.pop(0).need_since

    def failed(self, count: int) -> None:
        """The scaler could not add `count` of the instances just asked for: they are not waited for (the need may
        ask again after the cooldown)."""
        del self._pending[len(self._pending) - min(count, len(self._pending)) :]
