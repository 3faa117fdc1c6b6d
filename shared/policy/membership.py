"""Which workers make up the cluster right now: the configured ones (seeds) plus the ones that joined at run time.

The config's ``[[workers]]`` are the seeds; they are members for good (a seed that stops answering is unreachable,
not gone: it comes back with the same name). Any other worker joins by registering with the memory manager: it
becomes a whole instance of its own once the model it serves matches the cluster's (compared field by field, so
the refusal names every difference). A joined worker leaves when it deregisters (drained, or shutting down) or
when it has not been heard from for ``member_timeout_s`` (it died). Standby workers (``kunserve up --standby``)
register too, but as offers: they are not members until the local scaler activates one.

Transfer links between workers are authenticated against the member list each worker holds, so a joined
worker becomes *plannable* (a drop may merge it into a pipeline group) only once every live member has applied a
membership version that includes it (a member that joined after it got the list with it in its join reply). The
version starts at a base the memory manager picks per start (its start time in milliseconds), so versions keep
growing across a memory-manager restart: a worker still reporting the version a predecessor gave it never counts
as having applied a list the new one made.

A deregistered process must not rejoin by a heartbeat that was already on its way: each worker process registers
with an incarnation (a random id per start), and the incarnation that left is refused re-entry, while the same
worker restarted (a new incarnation, e.g. a Kubernetes pod restarted under its name) joins again.

Pure: time comes in as arguments, decisions go out as data (tests/unit/policy/test_membership.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

UNAVAILABLE = "UNAVAILABLE"
FAILED_PRECONDITION = "FAILED_PRECONDITION"
INVALID_ARGUMENT = "INVALID_ARGUMENT"


@dataclass(frozen=True)
class Fingerprint:
    """What a worker serves. Empty strings and zeros mean "not known" and are never compared."""

    model_name: str = ""
    architecture: str = ""
    num_layers: int = 0
    hidden_size: int = 0
    num_heads: int = 0
    num_kv_heads: int = 0
    intermediate_size: int = 0
    vocab_size: int = 0
    max_model_len: int = 0
    dtype: str = ""
    checkpoint: str = ""

    def differences(self, cluster: Fingerprint) -> list[str]:
        """Each field both know and disagree on, as "field: this worker's (the cluster's: ...)"."""
        out = []
        for f in dataclasses.fields(self):
            mine, theirs = getattr(self, f.name), getattr(cluster, f.name)
            if mine and theirs and mine != theirs:
                out.append(f"{f.name}: {mine} (the cluster's: {theirs})")
        return out

    def merged(self, other: Fingerprint) -> Fingerprint:
        """This fingerprint with the fields it does not know taken from `other`."""
        return dataclasses.replace(self, **{f.name: getattr(other, f.name) for f in dataclasses.fields(self) if not getattr(self, f.name)})


@dataclass(frozen=True)
class Registration:
    """One RegisterWorker call: a start-up, a heartbeat, or a standby worker's offer."""

    worker_id: str
    address: str
    fingerprint: Fingerprint
    incarnation: str = ""  # a random id per process start
    standby: bool = False
    members_version: int = 0  # the membership version the worker has applied
    kv_blocks: int = 0  # its KV capacity as a whole instance


@dataclass(frozen=True)
class Accepted:
    seed: bool
    version: int
    members: tuple[str, ...]
    removed: bool = False  # this incarnation left (deregistered): it must stop serving, not rejoin
    joined: bool = False  # this call made it a member
    standby: bool = False  # it is (now) in the standby pool


@dataclass(frozen=True)
class Refused:
    code: str  # a gRPC status name
    message: str


@dataclass
class Member:
    worker_id: str
    address: str
    seed: bool
    since: float  # joined (or, for a seed, first heard) at
    heard: float  # last registration or answered refresh
    incarnation: str = ""
    joined_version: int = 0  # the membership version that added it (0 for a seed)
    acked_version: int = 0  # the newest membership version it has applied
    draining: bool = False
    kv_blocks: int = 0


@dataclass
class Membership:
    """The live membership. ``seeds``: worker id -> address from the config."""

    seeds: Mapping[str, str]
    member_timeout_s: float = 10.0
    version: int = 1
    reference: Fingerprint | None = None  # the cluster's model, from the first seed that registered
    members: dict[str, Member] = field(default_factory=dict)
    standby: dict[str, Member] = field(default_factory=dict)
    _gone: dict[str, str] = field(default_factory=dict)  # worker id -> the incarnation that deregistered

    def __post_init__(self) -> None:
        for wid, address in self.seeds.items():
            self.members.setdefault(wid, Member(wid, address, seed=True, since=0.0, heard=0.0))

    # -- reading ---------------------------------------------------------------------------------------------
    @property
    def ids(self) -> list[str]:
        """Every member: seeds in config order, then joined workers in the order they joined."""
        seeds = [w for w in self.seeds]
        joined = sorted((m for m in self.members.values() if not m.seed), key=lambda m: (m.joined_version, m.worker_id))
        return seeds + [m.worker_id for m in joined]

    def address(self, worker_id: str) -> str | None:
        m = self.members.get(worker_id) or self.standby.get(worker_id)
        return m.address if m is not None else None

    def joined(self, worker_id: str) -> bool:
        m = self.members.get(worker_id)
        return m is not None and not m.seed

    def draining(self, worker_id: str) -> bool:
        m = self.members.get(worker_id)
        return m is not None and m.draining

    def live(self, now: float) -> list[str]:
        """Members heard within member_timeout_s (seeds never heard from count as live: they are configured)."""
        return [w for w in self.ids if self.members[w].heard == 0.0 or now - self.members[w].heard <= self.member_timeout_s]

    def plannable(self, worker_id: str, now: float) -> bool:
        """May a transition include this worker? Seeds always; a joined worker once every live member that
        registers (seeds included) has applied a membership version that lists it, so its transfer links will be
        accepted; never a draining one. A member that joined after it is not waited for: its join reply listed it."""
        m = self.members.get(worker_id)
        if m is None or m.draining:
            return False
        if m.seed:
            return True
        return all(
            self.members[w].acked_version >= m.joined_version
            for w in self.live(now)
            if self.members[w].heard > 0.0 and (self.members[w].seed or self.members[w].joined_version < m.joined_version)
        )

    # -- changing --------------------------------------------------------------------------------------------
    def register(self, reg: Registration, now: float) -> Accepted | Refused:
        wid = reg.worker_id
        if not wid or not reg.address:
            return Refused(INVALID_ARGUMENT, "worker_id and address: both must be set")
        seed = wid in self.seeds
        if seed and reg.standby:
            return Refused(
                INVALID_ARGUMENT,
                f"worker {wid} is configured in [[workers]]: a configured worker cannot "
                "be a standby worker; give the standby worker another id",
            )
        reference = self.reference
        if seed and reference is None:
            reference = self.reference = reg.fingerprint
        elif seed and reference is not None and not reg.fingerprint.differences(reference):
            reference = self.reference = reference.merged(reg.fingerprint)  # fields an earlier seed did not know
        if reference is None:
            return Refused(
                UNAVAILABLE,
                "the cluster's model is not known yet (no configured worker has registered with the memory manager); retry shortly",
            )
        diffs = reg.fingerprint.differences(reference)
        if diffs:
            return Refused(FAILED_PRECONDITION, f"worker {wid} serves another model than the cluster: " + "; ".join(diffs))
        if seed:
            m = self.members[wid]
            m.heard, m.acked_version, m.kv_blocks = now, reg.members_version, reg.kv_blocks or m.kv_blocks
            m.since = m.since or now
            return Accepted(True, self.version, tuple(self.ids))
        if reg.standby:
            self._gone.pop(wid, None)  # it left as a member and offers itself again
            if wid in self.members:  # drained back to standby
                self._remove_member(wid)
            s = self.standby.setdefault(wid, Member(wid, reg.address, seed=False, since=now, heard=now))
            s.address, s.heard, s.incarnation, s.kv_blocks = reg.address, now, reg.incarnation, reg.kv_blocks
            return Accepted(False, self.version, tuple(self.ids), standby=True)
        if reg.incarnation and self._gone.get(wid) == reg.incarnation:
            return Accepted(False, self.version, tuple(self.ids), removed=True)
        self.standby.pop(wid, None)
        known = self.members.get(wid)
        if known is None or known.incarnation != reg.incarnation or known.address != reg.address:
            if known is not None:  # the same worker restarted (or moved): it joins again
                self._remove_member(wid)
            self.version += 1
            self.members[wid] = Member(
                wid,
                reg.address,
                seed=False,
                since=now,
                heard=now,
                incarnation=reg.incarnation,
                joined_version=self.version,
                acked_version=reg.members_version,
                kv_blocks=reg.kv_blocks,
            )
            return Accepted(False, self.version, tuple(self.ids), joined=True)
        known.heard, known.acked_version, known.kv_blocks = now, reg.members_version, reg.kv_blocks or known.kv_blocks
        return Accepted(False, self.version, tuple(self.ids))

    def heard(self, worker_id: str, now: float) -> None:
        """The worker answered (a layout refresh): it is alive."""
        m = self.members.get(worker_id)
        if m is not None and (m.heard > 0.0 or not m.seed):
            m.heard = now

    def drain(self, worker_id: str) -> bool:
        """Mark a joined member as leaving: no transition includes it and no new request is routed to it."""
        m = self.members.get(worker_id)
        if m is None or m.seed or m.draining:
            return False
        m.draining = True
        return True

    def undrain(self, worker_id: str) -> None:
        m = self.members.get(worker_id)
        if m is not None:
            m.draining = False

    def deregister(self, worker_id: str, incarnation: str = "") -> bool:
        """A worker leaves on purpose. Seeds stay members (they are configured); a joined worker is removed and
        the incarnation that left may not rejoin; a standby worker leaves the pool. A deregistration naming another
        incarnation than the one registered is stale (a process that restarted since) and changes nothing. True
        when something changed."""
        s = self.standby.get(worker_id)
        if s is not None:
            if incarnation and s.incarnation and incarnation != s.incarnation:
                return False
            del self.standby[worker_id]
            return True
        m = self.members.get(worker_id)
        if m is None or m.seed or (incarnation and m.incarnation and incarnation != m.incarnation):
            return False
        self._gone[worker_id] = incarnation or m.incarnation
        self._remove_member(worker_id)
        return True

    def expire(self, now: float) -> tuple[list[str], list[str]]:
        """Remove joined members and standby workers not heard from for member_timeout_s:
        (members removed, standby workers removed)."""
        gone = [w for w, m in self.members.items() if not m.seed and now - m.heard > self.member_timeout_s]
        for w in gone:
            self._remove_member(w)
        idle = [w for w, m in self.standby.items() if now - m.heard > self.member_timeout_s]
        for w in idle:
            del self.standby[w]
        return gone, idle

    def _remove_member(self, worker_id: str) -> None:
        del self.members[worker_id]
        self.version += 1
