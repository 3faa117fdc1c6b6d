"""Tensor-parallel execution across worker processes (Gyges §2): one instance over 2 or 4 workers.

Every member holds a shard of every layer (shared/model/tp_shard.py) in its own memory pool and runs the whole forward
pass over it; the partial sums of o_proj and down_proj are all-reduced between the members (`TPGroup.reduce`, the
model runner's reduce hook). Rank 0 *is* the instance: it owns the requests, schedules, allocates KV blocks and samples
exactly as a whole instance does. Before each forward it broadcasts the step's plan, in the stage_wire encoding
pipeline stages use (positions, KV slots, block tables, logits rows) with the token ids as its payload
(`TPLeader.send_step`, the engine's step_plan hook); the other ranks run the same forward on their shards at the same
block ids and discard the output (`TPFollower`). Every member's pool has the same shape, so their block counts match
(checked at start-up: `check_same_blocks`).

Collectives go over torch.distributed process groups built directly on a TCP store on rank 0's host (no global
default group: a process may later leave one instance and join another): gloo for the plans (CPU tensors) and the
reductions on CPU; on CUDA the reductions go over NCCL. Every message has rank 0 as its source: a header
int64[2] = (kind, payload bytes), then for a STEP the payload. While rank 0 is idle it sends a BEAT whenever no
message went out for `beat_every_s` (`TPLeader.heartbeat`, driven by the worker), so a follower's wait for the next
message is bounded by the group's timeout without ever hitting it; STOP ends the followers cleanly, and SPLIT ends
their loops with the group kept open for an in-place scale-down (tp_transform.py) that every member then joins.

A collective that fails (a peer's connection closed: it died) or times out (a peer hangs) breaks the instance: rank
0's engine stops with InstanceBroken (every request ends as lost and resumes elsewhere), a follower's loop ends, and
each member says so (`broken`) so that the worker exits and is started again with the others.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from kunserve.shared.engine import stage_wire
from kunserve.shared.engine.engine import Engine, InstanceBroken, TPHealed
from kunserve.shared.engine.stage_wire import StageBatch
from kunserve.shared.log import get_logger

STEP, BEAT, STOP, SPLIT, STAGGER, LAYER = 1, 2, 3, 4, 5, 6
_KINDS = {STEP: "step", BEAT: "beat", STOP: "stop", SPLIT: "split", STAGGER: "stagger", LAYER: "layer"}


class LayerSplitter(Protocol):
    """A member's part of a layer-staggered split (tp_stagger.StaggeredSplit)."""

    def split_layer(self) -> int: ...


class TPGroup:
    """One member's end of a tensor-parallel instance's process groups. Collectives are not thread-safe: on rank 0
    only the engine thread uses the group (the heartbeat runs there through EngineLoop.call), on a follower only its
    loop thread."""

    def __init__(
        self,
        rank: int,
        degree: int,
        host: str,
        port: int,
        *,
        timeout_s: float = 30.0,
        rendezvous_timeout_s: float = 300.0,
        device: str | torch.device = "cpu",
    ) -> None:
        if not 0 <= rank < degree:
            raise ValueError(f"rank {rank} outside a tensor-parallel group of {degree}")
        self.rank = rank
        self.degree = degree
        self.timeout_s = timeout_s
        self.broken: str | None = None  # why the instance can no longer compute (None: it can)
        timeout = datetime.timedelta(seconds=timeout_s)
        # Rank 0 serves the store and waits for every member to connect to it (the start-up rendezvous).
        self._store = dist.TCPStore(
            host, port, degree, is_master=rank == 0, timeout=datetime.timedelta(seconds=rendezvous_timeout_s), wait_for_workers=True
        )
        # torch's stubs type these backends without their collectives: Any
        self._gloo: Any = dist.ProcessGroupGloo(dist.PrefixStore("kunserve/tp/gloo", self._store), rank, degree, timeout)
        self._nccl: Any = None  # a ProcessGroupNCCL: the class exists in CUDA builds of torch only
        if torch.device(device).type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self._nccl = dist.ProcessGroupNCCL(dist.PrefixStore("kunserve/tp/nccl", self._store), rank, degree, opts)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def _fail(self, what: str, exc: Exception) -> InstanceBroken:
        self.broken = f"tensor-parallel {what} failed on rank {self.rank} of {self.degree}: {exc}"
        return InstanceBroken(self.broken)

    def _check(self) -> Any:
        if self.broken is not None:
            raise InstanceBroken(self.broken)
        if self._gloo is None:
            raise InstanceBroken("the tensor-parallel group is closed")
        return self._gloo

    def reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the members, in place (the model runner's reduce hook); InstanceBroken when a member is gone."""
        gloo = self._check()
        pg = self._nccl if t.is_cuda and self._nccl is not None else gloo
        try:
            pg.allreduce([t]).wait()
        except RuntimeError as exc:
            raise self._fail("all-reduce", exc) from None
        return t

    def send(self, kind: int, payload: torch.Tensor | None = None) -> None:
        """Rank 0: broadcast one message (a uint8 payload for STEP)."""
        gloo = self._check()
        n = 0 if payload is None else payload.numel()
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        try:
            gloo.broadcast([torch.tensor([kind, n], dtype=torch.int64)], opts).wait()
            if payload is not None and n:
                gloo.broadcast([payload], opts).wait()
        except RuntimeError as exc:
            raise self._fail(f"{_KINDS.get(kind, kind)} broadcast", exc) from None

    def recv(self) -> tuple[int, torch.Tensor | None]:
        """A follower: the next message from rank 0 (waits at most the group's timeout)."""
        gloo = self._check()
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        header = torch.zeros(2, dtype=torch.int64)
        try:
            gloo.broadcast([header], opts).wait()
            kind, n = int(header[0]), int(header[1])
            payload = None
            if n:
                payload = torch.empty(n, dtype=torch.uint8)
                gloo.broadcast([payload], opts).wait()
        except RuntimeError as exc:
            raise self._fail("receive", exc) from None
        if kind not in _KINDS:
            self.broken = f"tensor-parallel rank {self.rank}: unknown message kind {kind} from rank 0"
            raise InstanceBroken(self.broken)
        return kind, payload

    def all_gather_int(self, value: int) -> list[int]:
        """`value` of every member, in rank order."""
        gloo = self._check()
        out = [torch.zeros(1, dtype=torch.int64) for _ in range(self.degree)]
        try:
            gloo.allgather([out], [torch.tensor([value], dtype=torch.int64)]).wait()
        except RuntimeError as exc:
            raise self._fail("all-gather", exc) from None
        return [int(t) for t in out]

    def all_gather_bytes(self, payload: bytes) -> list[bytes]:
        """`payload` of every member, in rank order (sizes gathered first, then one padded all-gather)."""
        sizes = self.all_gather_int(len(payload))
        gloo = self._check()
        width = max(sizes)
        if width == 0:
            return [b""] * self.degree
        mine = torch.zeros(width, dtype=torch.uint8)
        if payload:
            mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        out = [torch.empty(width, dtype=torch.uint8) for _ in range(self.degree)]
        try:
            gloo.allgather([out], [mine]).wait()
        except RuntimeError as exc:
            raise self._fail("all-gather", exc) from None
        return [bytes(t[:n].numpy().tobytes()) for t, n in zip(out, sizes, strict=True)]

    def exchange(self, sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor], tag: int = 0) -> None:
        """Point to point: send `sends[r]` to rank r and receive `recvs[r]` (filled in place, of the size rank r
        sends) from rank r, all posted at once and then awaited (no pair can wait for another: every member posts
        every one of its sends and receives before waiting). Tensors on the CPU, contiguous."""
        gloo = self._check()
        works = []
        try:
            for r, t in sorted(sends.items()):
                works.append(gloo.send([t], r, tag))
            for r, t in sorted(recvs.items()):
                works.append(gloo.recv([t], r, tag))
            for w in works:
                w.wait()
        except RuntimeError as exc:
            raise self._fail("exchange", exc) from None

    def barrier(self) -> None:
        """Every member has reached this point."""
        self.all_gather_int(0)

    def close(self) -> None:
        """Drop the process groups and the store (rank 0's store stops listening once nothing holds it)."""
        self._gloo = self._nccl = None
        self._store = None  # type: ignore[assignment]


def check_same_blocks(group: TPGroup, num_blocks: int) -> None:
    """Every member must have the same number of KV blocks: the followers write at rank 0's block ids."""
    counts = group.all_gather_int(num_blocks)
    if len(set(counts)) != 1:
        raise ValueError(
            f"tensor-parallel members have different KV capacities {counts} (blocks by rank): give every "
            "member the same engine.pool_mib, page_kib and block_size"
        )


class TPLeader:
    """Rank 0: hands every forward's plan to the followers (Engine.step_plan) and keeps an idle instance's followers
    waiting within the group's timeout (`heartbeat`)."""

    def __init__(self, group: TPGroup, beat_every_s: float | None = None) -> None:
        if not group.is_leader:
            raise ValueError(f"rank {group.rank} is not the leader of its tensor-parallel instance")
        self.group = group
        self.beat_every_s = beat_every_s if beat_every_s is not None else group.timeout_s / 4
        self._last_sent = time.monotonic()
        self.steps = 0
        self.split_sent = False

    def attach(self, engine: Engine) -> None:
        engine.step_plan = self.send_step
        engine.runner.reduce = self.group.reduce

    def send_step(self, batch: StageBatch, inputs: torch.Tensor) -> None:
        """The plan and token ids of the forward rank 0 is about to run (engine thread)."""
        ids = inputs.detach().to("cpu", torch.int64).reshape(-1, 1)
        self.group.send(STEP, stage_wire.encode(batch, ids))
        self._last_sent = time.monotonic()
        self.steps += 1

    def heartbeat(self) -> bool:
        """Send a BEAT if nothing went out for beat_every_s (engine thread: EngineLoop.call). Returns whether it sent
        (never once the followers were told to split: they no longer listen)."""
        if self.split_sent or time.monotonic() - self._last_sent < self.beat_every_s:
            return False
        self.group.send(BEAT)
        self._last_sent = time.monotonic()
        return True

    def stop(self) -> None:
        """End the followers' loops (once the engine thread is done: nothing else may use the group then)."""
        if self.group.broken is None and not self.split_sent:
            try:
                self.group.send(STOP)
            except InstanceBroken:
                pass  # a follower already gone: nothing to stop

    def split_refused(self) -> None:
        """The split that SPLIT announced was refused: the followers follow again, heartbeats resume."""
        self.split_sent = False

    def split(self) -> None:
        """End the followers' loops for an in-place scale-down (engine thread): each then joins `scale_down` (or a
        staggered split's `finish`) over the same group. InstanceBroken when a follower is gone."""
        self.split_sent = True
        self.group.send(SPLIT)

    def stagger(self) -> None:
        """Have the followers begin a layer-staggered split with rank 0 (engine thread, before its own
        `StaggeredSplit.begin`); they go on following rank 0's steps."""
        self.group.send(STAGGER)
        self._last_sent = time.monotonic()

    def split_layer(self) -> None:
        """Have the followers move the next layer of the staggered split with rank 0 (before its own `split_layer`)."""
        self.group.send(LAYER)
        self._last_sent = time.monotonic()


class TPFollower:
    """A rank > 0: runs rank 0's forwards on its shard until STOP or the instance breaks (`run`, or on its own
    thread: `start`)."""

    def __init__(self, group: TPGroup, engine: Engine, num_threads: int = 1, on_end: Callable[[TPFollower], None] | None = None,
                 begin_stagger: Callable[[], LayerSplitter] | None = None) -> None:
        if group.is_leader:
            raise ValueError("rank 0 leads its tensor-parallel instance; it does not follow")
        self.group = group
        self.engine = engine
        self.num_threads = max(1, num_threads)
        self.on_end = on_end
        self.steps = 0
        self.stopped = False  # rank 0 said STOP
        self.split = False  # rank 0 said SPLIT: the members change parallelism in place next
        # A layer-staggered split (STAGGER, then a LAYER per layer): `begin_stagger` makes this member's part of it
        self.begin_stagger = begin_stagger
        self.staggered: LayerSplitter | None = None
        self.healed: str | None = None  # the change failed and this member healed: whole again, its loop ended
        # inside a staggered split's begin or layer: a failing collective then heals this member (see `healed`), so
        # the group's `broken` does not mean the worker is (TPMembership.broken)
        self.changing = False
        self.error: str | None = None
        self._thread: threading.Thread | None = None
        engine.runner.reduce = group.reduce

    @property
    def broken(self) -> str | None:
        return self.error

    def run(self) -> None:
        torch.set_num_threads(self.num_threads)
        try:
            while True:
                kind, payload = self.group.recv()
                if kind == STOP:
                    self.stopped = True
                    return
                if kind == SPLIT:
                    self.split = True
                    return
                if kind == STEP:
                    assert payload is not None
                    self._forward(payload)
                    self.steps += 1
                if kind in (STAGGER, LAYER) and not self._stagger(kind):
                    return
        except Exception as exc:  # the instance cannot compute any more, whatever broke
            self.error = str(exc) if isinstance(exc, InstanceBroken) else f"{type(exc).__name__}: {exc}"
            get_logger().error("tensor_parallel_broken", rank=self.group.rank, error=self.error)
        finally:
            if self.on_end is not None:
                self.on_end(self)

    def _forward(self, payload: torch.Tensor) -> None:
        batch, ids = stage_wire.decode(payload, torch.int64)
        self.engine.follow(batch, ids.reshape(-1))

    def _stagger(self, kind: int) -> bool:
        """This member's part of a staggered split's step; False when it healed (whole again: the loop ends)."""
        self.changing = True
        try:
            if kind == STAGGER:
                if self.begin_stagger is None:
                    raise InstanceBroken(f"tensor-parallel rank {self.group.rank} cannot split layer by layer")
                try:
                    self.staggered = self.begin_stagger()
                except ValueError:  # refused on every member, nothing changed: rank 0 goes on leading
                    pass
            elif self.staggered is None:
                raise InstanceBroken(f"tensor-parallel rank {self.group.rank}: a layer to split but no split begun")
            else:
                self.staggered.split_layer()
        except TPHealed as exc:
            self.healed = str(exc)
            get_logger().warning("tp_stagger_healed", rank=self.group.rank, error=self.healed)
            return False
        finally:
            self.changing = False
        return True

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("TPFollower.start() called twice")
        self._thread = threading.Thread(target=self.run, name="tp-follower", daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = None) -> bool:
        """Whether the loop has ended (within timeout)."""
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()
