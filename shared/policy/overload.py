"""When to drop and when to restore: the monitor's overload policy. Pure: time comes in as an argument.

Units are what the dispatcher routes to: an undropped instance or a pipeline group. Per unit, in KV blocks
of the whole model, counting **online** work only (ConServe request classes): offline requests run on what
online ones leave and are preempted first, so their KV counts as free and their queue as no demand, and an
offline backlog never asks for a drop (an online request takes an offline one's blocks before a drop could
help it). ``used`` and ``queued`` below are the online requests'; with no offline work they are everything:

- **overloaded** (Llumnix-style): ``used + head-of-line queued demand > capacity``: the request at the head
  of its queue cannot be admitted; or its clients wait too long: the oldest request that has not started has
  queued longer than ``max_head_wait_s`` (the TTFT SLO), so the policy sees what clients see even when the
  queue is held back by something other than KV memory. After ``overload_hold_s`` (0 = at once) the policy
  asks for a drop.
  The requirement R is the deficit of the overloaded units counting *all* their queued demand,
  ``sum(used + queued − capacity)``, plus ``margin_frac`` of their capacity for the KV growth of running
  decodes (KunServe §4.1 computes R from the queued requests' demand; ``requirement="queued"`` uses all
  queued demand as the paper states).
- **underloaded**: a dropped group whose ``used + queued`` stays below ``restore_threshold`` (50%) of its
  undropped capacity (the capacity its members have as full instances) for ``restore_hold_s`` → restore
  it (KunServe §4.4). Offline KV is harvested here too, but a restore must place every request's KV in the
  instances it splits into, so a group whose KV of every class (``used_blocks``) exceeds its undropped capacity
  is not restored yet: the transition would be refused.

Hysteresis so it never flaps: one action at a time (after a decision the policy waits for ``complete()``,
or ``action_timeout_s``); no restore within ``restore_cooldown_s`` of a drop; no drop within
``drop_cooldown_s`` of a restore (0 by default: overload is urgent, and the 50% restore threshold already
leaves half the memory free); the hold timers restart whenever the condition breaks, the overload one
after every completed action and the restore ones after a drop; a unit that is overloaded is never restored.

Drops stack (§5.6): overload that persists after a drop — held again for ``overload_hold_s`` in the new
layout — asks for another drop, which the planner serves by merging groups (pairs into a quad). A restore
undoes one merge of a group at a time (a quad into pairs, then pairs into whole instances), each step after
its own ``restore_hold_s`` below the threshold.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class UnitLoad:
    unit_id: str
    used_blocks: int                   # every class
    total_blocks: int                  # capacity now (after drops)
    queued_demand_blocks: int = 0      # all waiting requests' prompts, every class
    head_demand_blocks: int | None = None  # the online head-of-line request's demand; None: unknown, use online queued
    undropped_total_blocks: int | None = None  # capacity of its members as full instances; None = total
    members: int = 1                   # instances in the unit (> 1: a dropped pipeline group)
    head_wait_s: float = 0.0           # how long its oldest not-yet-started online request has waited (queue time)
    offline_used_blocks: int = 0       # of used_blocks, those offline requests hold
    offline_queued_demand_blocks: int = 0  # of queued_demand_blocks, the waiting offline requests'

    @property
    def online_used(self) -> int:
        return self.used_blocks - self.offline_used_blocks

    @property
    def online_queued(self) -> int:
        return self.queued_demand_blocks - self.offline_queued_demand_blocks

    @property
    def head_demand(self) -> int:
        return self.online_queued if self.head_demand_blocks is None else self.head_demand_blocks

    @property
    def undropped_total(self) -> int:
        return self.total_blocks if self.undropped_total_blocks is None else self.undropped_total_blocks

    @property
    def overloaded(self) -> bool:
        """KV-blocked: the online head-of-line request's demand does not fit even in the blocks offline requests
        would give up (the queue-time half is the policy's)."""
        return self.online_used + self.head_demand > self.total_blocks

    @property
    def usage(self) -> int:
        """Online load: what online requests hold and wait for (offline KV counts as free)."""
        return self.online_used + self.online_queued

    @property
    def restorable_kv(self) -> bool:
        """Every request's KV, offline included, fits the undropped capacity a restore splits the unit into."""
        return self.used_blocks <= self.undropped_total


@dataclass(frozen=True)
class OverloadConfig:
    overload_hold_s: float = 0.0
    restore_threshold: float = 0.5
    restore_hold_s: float = 10.0
    restore_cooldown_s: float = 30.0   # after a drop completes
    drop_cooldown_s: float = 0.0       # after a restore completes
    action_timeout_s: float = 60.0     # a decision never confirmed by complete() expires
    margin_frac: float = 0.05
    requirement: str = "deficit"       # or "queued" (paper: the demand of all queued requests)
    max_head_wait_s: float = math.inf  # a head-of-line wait beyond this is overload (the TTFT SLO); inf = off

    def __post_init__(self) -> None:
        if not 0 < self.restore_threshold < 1:
            raise ValueError("restore_threshold must be in (0, 1)")
        if self.requirement not in ("deficit", "queued"):
            raise ValueError(f"unknown requirement mode {self.requirement!r}")
        if min(self.overload_hold_s, self.restore_hold_s, self.restore_cooldown_s, self.drop_cooldown_s,
               self.margin_frac) < 0 or self.action_timeout_s <= 0 or not self.max_head_wait_s > 0:
            raise ValueError("times and margins must be >= 0")


@dataclass(frozen=True)
class Decision:
    action: str                                 # "none", "drop", "restore"
    required_blocks: int = 0                    # for "drop": R
    units: tuple[str, ...] = ()                 # overloaded units (drop) or groups to restore
    reason: str = ""


NONE = "none"
DROP = "drop"
RESTORE = "restore"


@dataclass
class OverloadPolicy:
    config: OverloadConfig = field(default_factory=OverloadConfig)
    _overloaded_since: float | None = None
    _below_since: dict[str, float] = field(default_factory=dict)
    _pending: tuple[str, float] | None = None   # (action, decided at)
    _last_drop: float = -math.inf
    _last_restore: float = -math.inf

    def overloaded(self, u: UnitLoad) -> bool:
        """KV-blocked, or its oldest waiting request has queued longer than ``max_head_wait_s``."""
        return u.overloaded or u.head_wait_s > self.config.max_head_wait_s

    def requirement(self, loads: Iterable[UnitLoad]) -> int:
        over = [u for u in loads if self.overloaded(u)]
        if self.config.requirement == "queued":
            base = sum(u.online_queued for u in over)
        else:
            # A unit overloaded by queue time alone needs room for what waits there (its queued demand).
            base = sum(max(0, u.usage - u.total_blocks) if u.overloaded else u.online_queued for u in over)
            base = max(base, sum(u.online_used + u.head_demand - u.total_blocks for u in over if u.overloaded))
        margin = math.ceil(self.config.margin_frac * sum(u.total_blocks for u in over))
        return base + margin if over else 0

    def observe(self, now: float, loads: Iterable[UnitLoad]) -> Decision:
        """Feed one snapshot of every unit's load; returns what to do now."""
        loads = list(loads)
        cfg = self.config
        over = tuple(sorted(u.unit_id for u in loads if self.overloaded(u)))
        overloaded_since = self._overloaded_since if self._overloaded_since is not None else now
        self._overloaded_since = overloaded_since if over else None
        present = {u.unit_id for u in loads}
        for uid in list(self._below_since):
            if uid not in present:
                del self._below_since[uid]
        for u in loads:
            low = (u.members > 1 and not self.overloaded(u) and u.usage < cfg.restore_threshold * u.undropped_total
                   and u.restorable_kv)
            if low:
                self._below_since.setdefault(u.unit_id, now)
            else:
                self._below_since.pop(u.unit_id, None)

        if self._pending is not None:
            action, at = self._pending
            if now - at < cfg.action_timeout_s:
                return Decision(NONE, reason=f"{action} in progress")
            self._pending = None  # never confirmed: allow a new decision

        if over:
            if now - overloaded_since < cfg.overload_hold_s:
                return Decision(NONE, units=over, reason="overload not held long enough")
            if now - self._last_restore < cfg.drop_cooldown_s:
                return Decision(NONE, units=over, reason="drop cool-down after a restore")
            r = self.requirement(loads)
            self._pending = (DROP, now)
            waits = [f"{u.unit_id} ({u.head_wait_s:.1f} s)" for u in loads
                     if u.unit_id in over and not u.overloaded]
            reason = f"head-of-line blocked on {', '.join(over)}"
            if waits:
                reason += f"; queue time over {cfg.max_head_wait_s:g} s on {', '.join(waits)}"
            return Decision(DROP, r, over, reason=reason)

        if now - self._last_drop < cfg.restore_cooldown_s:
            return Decision(NONE, reason="restore cool-down after a drop")
        ready = tuple(sorted(uid for uid, since in self._below_since.items() if now - since >= cfg.restore_hold_s))
        if ready:
            self._pending = (RESTORE, now)
            for uid in ready:
                del self._below_since[uid]
            return Decision(RESTORE, 0, ready,
                            reason=f"usage below {cfg.restore_threshold:.0%} of undropped capacity for "
                                   f"{cfg.restore_hold_s:g} s")
        return Decision(NONE)

    def complete(self, now: float, ok: bool = True) -> None:
        """The decided action finished (or failed: ``ok`` False starts no cool-down)."""
        if self._pending is None:
            return
        action, _ = self._pending
        self._pending = None
        if ok and action == DROP:
            self._last_drop = now
            self._below_since.clear()  # hold timers restart after the layout changed
            self._overloaded_since = None
        elif ok and action == RESTORE:
            self._last_restore = now
            self._overloaded_since = None

    @property
    def pending(self) -> str | None:
        return None if self._pending is None else self._pending[0]
