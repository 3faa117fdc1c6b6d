"""This worker's membership of the cluster, kept with the memory manager (README "Discovery and autoscaling").

Every worker registers with the memory manager and registers again every heartbeat: a configured worker (a seed)
to tell it the model it serves, a worker the config does not list to join as a whole instance of its own, and a
standby worker (``kunserve up --standby N``) to offer itself to the local scaler, which activates it with the
``Activate`` RPC. Each reply carries the cluster's member list, which becomes the set of names this worker's
transfer service accepts links from, so a worker that joined can be merged into pipeline groups. A worker that
drains (``Drain``) deregisters and, for the local scaler, goes back to standby.

States: ``standby`` (loaded, takes no requests, sends no stats) -> ``active`` -> ``draining`` (takes no new
requests) -> ``standby`` again, or ``out`` (drained for good, or removed by the memory manager).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Collection

import grpc

from kunserve.shared.log import get_logger
from kunserve.shared.policy.membership import Fingerprint
from kunserve.shared.rpc import channel
from kunserve.shared.wire.membership import fingerprint_to_pb
from kunserve.v1 import memory_manager_pb2, memory_manager_pb2_grpc

STANDBY, ACTIVE, DRAINING, OUT = "standby", "active", "draining", "out"
RETRY_S = 0.5  # between registrations the memory manager could not take (unreachable, model not known yet)
MAX_RETRY_S = 5.0
REGISTER_TIMEOUT_S = 5.0
FATAL = (
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
)


class MembershipRefused(Exception):
    """The memory manager refused this worker for good (another model, a bad registration)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class ClusterMembership:
    """Registration, heartbeats and the state that decides whether this worker takes requests.

    ``on_active`` / ``on_inactive`` run when the worker starts and stops serving (the stats stream to the monitor
    follows them: a standby worker must not count as capacity)."""

    def __init__(
        self,
        memory_manager: str,
        worker_id: str,
        address: str,
        fingerprint: Fingerprint,
        configured: Collection[str],
        kv_blocks: Callable[[], int],
        *,
        standby: bool = False,
        on_members: Callable[[frozenset[str]], None] | None = None,
        on_active: Callable[[], None] | None = None,
        on_inactive: Callable[[], None] | None = None,
    ) -> None:
        self.memory_manager = memory_manager
        self.worker_id = worker_id
        self.address = address
        self.fingerprint = fingerprint
        self.configured = frozenset(configured)
        self.kv_blocks = kv_blocks
        self.state = STANDBY if standby else ACTIVE
        self.incarnation = uuid.uuid4().hex
        self.version = 0
        self.heartbeat_s = 2.5
        self.on_members = on_members
        self.on_active = on_active
        self.on_inactive = on_inactive
        self.log = get_logger()
        self._channel: grpc.aio.Channel | None = None
        self._wake = asyncio.Event()

    # -- state -------------------------------------------------------------------------------------------------
    @property
    def in_service(self) -> bool:
        return self.state == ACTIVE

    def why_not_serving(self) -> str:
        if self.state == STANDBY:
            return f"worker {self.worker_id} is a standby worker: it joins the cluster when the autoscaler activates it"
        if self.state == DRAINING:
            return f"worker {self.worker_id} is draining (leaving the cluster); send requests to another worker"
        return f"worker {self.worker_id} has left the cluster"

    def _set(self, state: str) -> None:
        was_active = self.state in (ACTIVE, DRAINING)
        self.state = state
        active = state in (ACTIVE, DRAINING)
        if active and not was_active and self.on_active is not None:
            self.on_active()
        elif was_active and not active and self.on_inactive is not None:
            self.on_inactive()

    # -- the memory manager ----------------------------------------------------------------------------------------
    def _stub(self) -> memory_manager_pb2_grpc.MemoryManagerStub:
        if self._channel is None:
            self._channel = channel(self.memory_manager)
        return memory_manager_pb2_grpc.MemoryManagerStub(self._channel)

    async def register_once(self) -> memory_manager_pb2.RegisterWorkerReply:
        """One registration in the current state (raises grpc.aio.AioRpcError)."""
        reply = await self._stub().RegisterWorker(
            memory_manager_pb2.RegisterWorkerRequest(
                worker_id=self.worker_id,
                address=self.address,
                model=fingerprint_to_pb(self.fingerprint),
                standby=self.state == STANDBY,
                members_version=self.version,
                kv_blocks_total=self.kv_blocks(),
                incarnation=self.incarnation,
            ),
            timeout=REGISTER_TIMEOUT_S,
        )
        if reply.heartbeat_s > 0:
            self.heartbeat_s = reply.heartbeat_s
        self.version = reply.members_version
        if self.on_members is not None:
            self.on_members(self.configured | frozenset(reply.members))
        if reply.removed and self.state in (ACTIVE, DRAINING):
            self.log.warning("removed_from_cluster", reason="the memory manager no longer lists this worker")
            self._set(OUT)
        return reply

    async def register_until_accepted(self) -> memory_manager_pb2.RegisterWorkerReply:
        """Register, retrying while the memory manager is unreachable or does not know the cluster's model yet;
        raises MembershipRefused when it refuses this worker for good."""
        delay = RETRY_S
        logged = False
        while True:
            try:
                return await self.register_once()
            except grpc.aio.AioRpcError as exc:
                if exc.code() in FATAL:
                    raise MembershipRefused(exc.code(), exc.details() or exc.code().name) from None
                if not logged:
                    logged = True
                    self.log.info("registration_retrying", memory_manager=self.memory_manager, code=exc.code().name, error=exc.details())
            await asyncio.sleep(delay)
            delay = min(MAX_RETRY_S, delay * 2)

    async def heartbeat_forever(self) -> None:
        """Register now, then again every heartbeat while not OUT (a seed's first registration tells the memory
        manager the cluster's model). A refusal is logged: a seed keeps serving (it is configured), and a memory
        manager restarted with another model refuses it until that is resolved."""
        while True:
            if self.state != OUT:
                try:
                    await self.register_once()
                except grpc.aio.AioRpcError as exc:
                    level = self.log.error if exc.code() in FATAL else self.log.debug
                    level("heartbeat_failed", code=exc.code().name, error=exc.details())
            try:
                await asyncio.wait_for(self._wake.wait(), self.heartbeat_s)
            except TimeoutError:
                pass
            self._wake.clear()

    async def deregister(self, reason: str) -> None:
        """Tell the memory manager this worker leaves (best effort: it notices a silent one anyway)."""
        try:
            await self._stub().DeregisterWorker(
                memory_manager_pb2.DeregisterWorkerRequest(worker_id=self.worker_id, reason=reason, incarnation=self.incarnation),
                timeout=REGISTER_TIMEOUT_S,
            )
        except grpc.aio.AioRpcError as exc:
            self.log.warning("deregister_failed", code=exc.code().name, error=exc.details())

    # -- transitions of the state ------------------------------------------------------------------------------------
    async def activate(self) -> None:
        """A standby worker joins: registers as a member (raises MembershipRefused) and starts serving."""
        if self.state != STANDBY:
            raise MembershipRefused(
                grpc.StatusCode.FAILED_PRECONDITION, f"worker {self.worker_id} is not a standby worker (it is {self.state})"
            )
        self.incarnation = uuid.uuid4().hex  # a new membership: the one that drained may not come back
        self._set(ACTIVE)
        try:
            await self.register_until_accepted()
        except BaseException:
            self._set(STANDBY)
            raise
        self.log.info("activated", worker=self.worker_id, members_version=self.version)

    def start_draining(self) -> None:
        if self.state != ACTIVE:
            raise MembershipRefused(grpc.StatusCode.FAILED_PRECONDITION, f"worker {self.worker_id} is not serving (it is {self.state})")
        self._set(DRAINING)

    async def drained(self, to_standby: bool) -> None:
        """Draining is over: deregister, then standby (offered again at the next heartbeat) or out for good."""
        await self.deregister("drained")
        self._set(STANDBY if to_standby else OUT)
        self._wake.set()

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
