"""A worker's place in a static tensor-parallel instance ([[tensor_parallel]] in the config; README "Elastic tensor
parallelism (Gyges)"): the shard it loads, the rendezvous with the other members, and its role while it serves.

Rank 0 is the instance: a worker like any other to the dispatcher and the monitor (its reports carry the instance's
KV), whose engine hands every forward's plan to the others (shared/engine/tensor_parallel.py) and keeps an idle
instance's followers alive with heartbeats on its engine thread. A follower runs rank 0's steps on its own thread and
takes no requests: it reports itself not serving, like a later stage of a pipeline group. Neither takes part in a
parameter drop, a restore or a migration, and neither runs layer-wise preemption safepoints or KV checkpoints: each
of those would act on one member's shard alone.

When the instance breaks (a member died or hangs) every member stops serving and exits with EXIT_BROKEN, so a
supervisor starts all of them again and they meet at a fresh rendezvous; rank 0's requests end as lost on the way,
and the dispatcher resumes them elsewhere.

A membership may also come from the command line (`--tp-members w0,w1 --tp-rank R --tp-port P`, `TPArgs`): the
memory manager's cold re-form (`ReformTP`) re-executes a worker with them, overriding [[tensor_parallel]]; one member
makes it a whole instance whatever the config says. A supervisor restarts a worker with its original command line,
so a runtime member that breaks (EXIT_BROKEN) comes back as configured: that is how a broken re-formed instance heals.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NoReturn

from kunserve.shared.config import ClusterConfig, ConfigError, TensorParallelSection
from kunserve.shared.engine.engine import Engine, InstanceBroken
from kunserve.shared.engine.loop import EngineLoop, EngineStopped
from kunserve.shared.engine.pooled import PooledInstance
from kunserve.shared.engine.tensor_parallel import LayerSplitter, TPFollower, TPGroup, TPLeader, check_same_blocks
from kunserve.shared.log import get_logger
from kunserve.shared.model.tp_degree import degree_error
from kunserve.shared.model.tp_shard import sharded_source
from kunserve.shared.model.weights import ModelSource

EXIT_BROKEN = 3  # the worker's exit status after its tensor-parallel instance broke


@dataclass
class TPMembership:
    """This worker's rank in tensor_parallel[index] (a degree of 2 or 4)."""

    index: int
    rank: int
    members: tuple[str, ...]
    host: str  # rank 0's host: the rendezvous store
    port: int
    timeout_s: float
    rendezvous_timeout_s: float
    group: TPGroup | None = None
    whole: ModelSource | None = None  # the unsharded model (its fingerprint is the cluster's)
    leader: TPLeader | None = None
    follower: TPFollower | None = None
    exited_broken: bool = False
    in_place: bool = False  # formed in place: the pool still holds the whole model, so it may split in place
    _tasks: list[asyncio.Task] = field(default_factory=list)

    @property
    def degree(self) -> int:
        return len(self.members)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def where(self) -> str:
        return f"tensor_parallel[{self.index}]" if self.index >= 0 else "--tp-members"

    def describe(self) -> str:
        return f"rank {self.rank} of tensor-parallel instance {self.members[0]} (TP{self.degree}: {', '.join(self.members)})"

    # -- start-up --------------------------------------------------------------------------------------------
    def shard(self, source: ModelSource) -> ModelSource:
        """The model as this rank holds it (ValueError naming the section when the degree does not fit)."""
        self.whole = source
        try:
            return sharded_source(source, self.rank, self.degree)
        except ValueError as exc:
            raise ValueError(f"{self.where}: {exc}") from None

    def join(self, instance: PooledInstance, device: str, threads: int) -> None:
        """Meet the other members (blocks until all arrive, up to rendezvous_timeout_s), check that every member has
        the same KV blocks, and take this rank's role on the instance's engine. Raises ValueError / RuntimeError."""
        if self.port == 0:
            raise ValueError(
                f"{self.where}.port is 0: set the rendezvous port on {self.members[0]}'s host (the local launcher picks a free one)"
            )
        engine = instance.engine
        self.group = TPGroup(
            self.rank,
            self.degree,
            self.host,
            self.port,
            timeout_s=self.timeout_s,
            rendezvous_timeout_s=self.rendezvous_timeout_s,
            device=device,
        )
        try:
            check_same_blocks(self.group, engine.allocator.num_blocks)
        except (ValueError, InstanceBroken):
            self.group.close()
            raise
        if self.is_leader:
            self.lead(self.group, engine)
        else:
            self.follow(self.group, engine, threads)

    def lead(self, group: TPGroup, engine: Engine) -> None:
        """Rank 0's role over `group`: the leader of its engine's steps (engine thread, nothing computing)."""
        self.group = group
        self.leader = TPLeader(group)
        self.leader.attach(engine)

    def follow(self, group: TPGroup, engine: Engine, threads: int,
               on_end: Callable[[TPFollower], None] | None = None,
               begin_stagger: Callable[[], LayerSplitter] | None = None) -> None:
        """A follower's role over `group` (its loop runs once started: `start`); `on_end` is called when it ends;
        `begin_stagger` makes its part of a layer-staggered split (an in-place instance's)."""
        self.group = group
        self.follower = TPFollower(group, engine, threads, on_end=on_end, begin_stagger=begin_stagger)

    # -- serving ---------------------------------------------------------------------------------------------
    def broken(self, engine_loop: EngineLoop) -> str | None:
        """Why this member can no longer serve (None: it can). A follower healing from a failed staggered split, or
        healed (whole again: the servicer leaves the instance), is not broken though its group is."""
        f = self.follower
        if f is not None and (f.changing or f.healed is not None):
            return None
        if self.group is not None and self.group.broken is not None:
            return self.group.broken
        if self.follower is not None and self.follower.error is not None:
            return self.follower.error
        if isinstance(engine_loop.error, InstanceBroken):
            return str(engine_loop.error)
        return None

    def start(self, engine_loop: EngineLoop) -> None:
        """On the worker's event loop once it serves: the follower's thread, rank 0's heartbeats, and the watch that
        ends the process when the instance breaks."""
        if self.follower is not None:
            self.follower.start()
        if self.leader is not None:
            self._tasks.append(asyncio.create_task(self._heartbeats(engine_loop, self.leader)))
        self._tasks.append(asyncio.create_task(self._watch(engine_loop)))

    async def _heartbeats(self, engine_loop: EngineLoop, leader: TPLeader) -> None:
        """Between iterations (the engine thread owns the group), a BEAT whenever nothing went out for a while."""
        while True:
            await asyncio.sleep(leader.beat_every_s / 2)
            try:
                await asyncio.wrap_future(engine_loop.call(lambda _engine: leader.heartbeat()))
            except (InstanceBroken, EngineStopped):
                return  # _watch sees it

    async def _watch(self, engine_loop: EngineLoop, interval_s: float = 0.2) -> None:
        while True:
            await asyncio.sleep(interval_s)
            why = self.broken(engine_loop)
            if why is not None:
                get_logger().error("tensor_parallel_instance_broken", role=self.describe(), error=why, exit_status=EXIT_BROKEN)
                self.exited_broken = True
                os.kill(os.getpid(), signal.SIGTERM)  # the service's graceful stop; main() exits with EXIT_BROKEN
                return

    def cancel_tasks(self) -> None:
        """At shutdown or before an in-place split, on the event loop: no more heartbeats or watching."""
        for t in self._tasks:
            t.cancel()
        self._tasks.clear()

    def close(self, engine_loop: EngineLoop) -> None:
        """At shutdown, after the engine loop stopped (off the event loop: it may wait): rank 0 ends the followers'
        loops (STOP); a follower waits a little for its loop to see it. Then the process groups go."""
        if self.group is None:
            return
        if self.leader is not None and not engine_loop.running:
            self.leader.stop()
        if self.follower is not None and not self.follower.join(2.0):
            return  # still blocked in a receive: the process exits around it
        self.group.close()


def membership_of(cfg: ClusterConfig, worker_id: str) -> TPMembership | None:
    """This worker's tensor-parallel membership; None when it is in no instance of degree > 1."""
    found = cfg.tensor_parallel_of(worker_id)
    if found is None or found[1].degree < 2:
        return None
    index, tp = found
    return TPMembership(
        index,
        tp.members.index(worker_id),
        tuple(tp.members),
        cfg.worker(tp.members[0]).host,
        tp.port,
        tp.timeout_s,
        tp.rendezvous_timeout_s,
    )


@dataclass(frozen=True)
class TPArgs:
    """A runtime tensor-parallel membership from the worker's command line (a cold re-form): it overrides the config's
    [[tensor_parallel]]; a single member is a whole instance."""

    members: tuple[str, ...]
    rank: int = 0
    port: int = 0
    host: str = ""  # rank 0's host; empty: rank 0's configured host
    rendezvous_timeout_s: float = 0.0  # 0: [[tensor_parallel]]'s default

    def check(self, worker_id: str) -> None:
        """ValueError with what is wrong."""
        members = self.members
        if not members or any(not m for m in members):
            raise ValueError("tensor-parallel members: must be non-empty worker ids")
        if len(set(members)) != len(members):
            raise ValueError(f"tensor-parallel members {list(members)}: a worker is named twice")
        if len(members) not in (1, 2, 4):
            raise ValueError(f"tensor-parallel members {list(members)}: an instance spans 1, 2 or 4 workers")
        if worker_id not in members:
            raise ValueError(f"tensor-parallel members {list(members)}: this worker ({worker_id}) is not one of them")
        if members.index(worker_id) != self.rank:
            raise ValueError(f"tensor-parallel rank {self.rank}: {worker_id} is member {members.index(worker_id)} of {list(members)}")
        if len(members) > 1 and self.port <= 0:
            raise ValueError("tensor-parallel port: a rendezvous port > 0 is needed for more than one member")
        if self.rendezvous_timeout_s < 0:
            raise ValueError("tensor-parallel rendezvous timeout: must be >= 0")

    def argv(self) -> list[str]:
        """The worker flags that give this membership."""
        out = ["--tp-members", ",".join(self.members), "--tp-rank", str(self.rank)]
        if len(self.members) > 1:
            out += ["--tp-port", str(self.port)]
            if self.host:
                out += ["--tp-host", self.host]
            if self.rendezvous_timeout_s:
                out += ["--tp-rendezvous-timeout", f"{self.rendezvous_timeout_s:g}"]
        return out


TP_FLAGS = ("--tp-members", "--tp-rank", "--tp-port", "--tp-host", "--tp-rendezvous-timeout")


def runtime_membership(cfg: ClusterConfig, worker_id: str, args: TPArgs) -> TPMembership | None:
    """The membership `args` give (None: a whole instance). ValueError when they are inconsistent, or the model's
    heads / intermediate size do not divide by the degree (checked when the shard is cut)."""
    args.check(worker_id)
    if len(args.members) == 1:
        return None
    host = args.host
    if not host:
        try:
            host = cfg.worker(args.members[0]).host
        except ConfigError:
            raise ValueError(f"--tp-host: rank 0 ({args.members[0]}) is not a configured worker; give its host") from None
    defaults = TensorParallelSection()
    return TPMembership(
        -1, args.rank, args.members, host, args.port, defaults.timeout_s, args.rendezvous_timeout_s or defaults.rendezvous_timeout_s
    )


def reform_argv(argv: Sequence[str], new: TPArgs) -> list[str]:
    """The worker's command line (without the program) with its --tp-* flags replaced by `new`'s, and without
    --standby: only a worker in service re-forms, and one re-executed as a standby would offer itself again instead
    of joining, so the re-form would wait for it in vain."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in TP_FLAGS:
            skip = True
            continue
        if a.split("=", 1)[0] in TP_FLAGS or a == "--standby":
            continue
        out.append(a)
    return out + new.argv()


def pick_free_port(bind: str = "") -> int:
    """A TCP port nothing listens on now (the OS's pick). Another process may take it before the rendezvous store
    binds it; the followers then time out and every member heals back to a whole instance."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((bind, 0))
        return int(s.getsockname()[1])


def close_on_exec(first: int = 3) -> list[int]:
    """Mark every open descriptor from `first` up close-on-exec (Python opens its own so, but sockets and files that
    native libraries opened may not be); returns the ones that were inheritable."""
    fixed: list[int] = []
    try:
        fds = [int(x) for x in os.listdir("/proc/self/fd")]
    except OSError:
        return fixed
    for fd in fds:
        if fd < first:
            continue
        try:
            if os.get_inheritable(fd):
                os.set_inheritable(fd, False)
                fixed.append(fd)
        except OSError:
            pass  # the listing's own descriptor, already closed
    return fixed


def reexec(argv: Sequence[str]) -> NoReturn:
    """Replace this process with a fresh worker run with `argv` (same pid: the launcher keeps tracking it); nothing
    but stdin, stdout and stderr crosses the exec. An exec that fails (the interpreter gone, too many processes) exits
    with EXIT_BROKEN, so that a supervisor starts the worker again as configured."""
    fixed = close_on_exec()
    log = get_logger()
    log.info("worker_reexec", argv=list(argv), made_close_on_exec=fixed)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execv(sys.executable, [sys.executable, "-m", "kunserve.services.worker", *argv])
    except OSError as exc:
        log.error("worker_reexec_failed", error=str(exc), exit_status=EXIT_BROKEN)
        raise SystemExit(EXIT_BROKEN) from None


def check_model_degree(source: ModelSource, degree: int) -> str | None:
    """Why the model cannot run at `degree` (None: it can; 1 always can)."""
    return None if degree == 1 else degree_error(source.config, degree)
