"""A worker's side of an in-place change of tensor parallelism (README "Elastic tensor parallelism (Gyges)"): the
memory manager's `ReformTP{in_place}` makes co-located whole workers one TP instance, and back, without stopping them;
the requests they run keep their KV (shared/engine/tp_transform.py moves it) and their streams follow them.

Scale-up (`merge`, every member at once, each answering its ReformTP at once and going on here):

1. this rank's shard of the model is loaded and the members meet (the rendezvous on rank 0's host) while the engine
   goes on serving the requests it has (new ones are refused with the re-forming trailer: the dispatcher waits);
2. on the engine thread, between two iterations: `scale_up` (the KV moves over the transfer service's KV-exchange
   class when this worker is linked to every member, tp_kv_transfer.py; else over the group's gloo); rank 0 opens
   buffered streams for the requests it adopted (StreamHandover.receive) before the members pass a barrier, and then
   attaches as the leader;
3. back on the event loop a follower ends its requests' streams with `moved_to` rank 0 (the dispatcher re-attaches
   there and relays on from the next token) and starts following rank 0's steps.

Scale-down (`split`), layer by layer (shared/engine/tp_stagger.py): rank 0 sends STAGGER on the engine thread and
begins with the followers (each inside its loop: `follower_stagger`), then, one engine-thread call per layer with the
engine stepping between them, LAYER and the layer's move, then SPLIT (the followers' loops end and each finishes from
its own engine thread: `follower_split`) and finishes; each member opens the streams of the requests it receives before
the barrier, and rank 0 then ends the streams of those that left with `moved_to` their new worker. Every member is a
whole instance again.

Failures: refused (ValueError: a check failed on some member) or healed (TPHealed: a member failed, died or hung
part-way, every member whole again with its own requests, keeping their KV when none had moved yet, else
re-prefilling) leave every stream where it was and the worker whole. A member that cannot heal either (HealFailed)
exits with EXIT_BROKEN.
A failure after the commit breaks the new instance: the membership's watch then ends the worker with EXIT_BROKEN
(a supervisor starts it again as configured) and its streams end, so the dispatcher resumes their requests elsewhere.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable, Mapping

from kunserve.shared.engine.engine import Engine, InstanceBroken, TPHealed
from kunserve.shared.engine.loop import EngineLoop
from kunserve.shared.engine.pooled import PooledInstance
from kunserve.shared.engine.tensor_parallel import TPFollower, TPGroup
from kunserve.shared.engine.tp_stagger import StaggeredSplit
from kunserve.shared.engine.tp_transform import TransformReport, check_split, scale_up
from kunserve.shared.log import get_logger
from kunserve.shared.model.tp_shard import sharded_source
from kunserve.shared.model.weights import Weights

from .handover import StreamHandover
from .peers import PeerLinks, PeerUnreachable
from .tp_kv_transfer import TransferSubBlocks
from .tp_member import TPMembership

RECEIVE_TIMEOUT_S = 30.0  # the engine thread waits this long for the event loop to open the received streams


class SplitBroken(RuntimeError):
    """An in-place split failed where this worker's state is not known: it must exit and be started again."""


class InPlaceTP:
    """The in-place scale-up and scale-down of one worker (module docstring). With the padded MLP in its pool (a
    cluster whose tp_mode is "in-place") a member computes on its pool's pages and releases the MLP shards it no
    longer keeps to its KV, taking them back at the split (`PooledInstance` as tp_transform.MemberWeights); otherwise
    the pool keeps the whole weights and a member computes on a copy of its shard loaded at the scale-up."""

    def __init__(self, engine_loop: EngineLoop, instance: PooledInstance, handover: StreamHandover,
                 owns_stream: Callable[[str], bool],
                 links: Callable[[], PeerLinks | None] = lambda: None) -> None:
        self.engine_loop = engine_loop
        self.instance = instance
        self.handover = handover
        self.owns_stream = owns_stream
        self.links = links  # the worker's transfer links, when it has a transfer service: the KV moves over them
        self.log = get_logger()

    async def _link(self, membership: TPMembership, addresses: Mapping[str, str]) -> None:
        """Open the transfer links to the other members that are not open yet, at once and each within a quarter of
        the group's timeout, before the members meet (best effort: without them the KV moves over the group's
        gloo)."""
        links = self.links()
        if links is None:
            return
        me = membership.members[membership.rank]
        missing = [w for w in membership.members if w != me and addresses.get(w) and w not in links.svc.peers]

        async def one(wid: str) -> None:
            try:
                await links.link(wid, addresses[wid], membership.timeout_s / 4)
            except PeerUnreachable as exc:
                self.log.warning("tp_kv_link_failed", peer=wid, error=str(exc))

        await asyncio.gather(*(one(w) for w in missing))

    def _agreed(self, group: TPGroup, exchange: TransferSubBlocks | None, op: str) -> TransferSubBlocks | None:
        """The transfer exchange when every member has one, else None on every member (gloo): the members must move
        their KV over the same channel (engine thread: a collective of the group). The change's messages carry rank
        0's random nonce, so no message of an earlier change (one healed mid-move, on a port picked again) is taken
        for this one's. A group that fails here changed nothing on this member but cannot go on: RuntimeError (a
        merge is then refused; a split's member exits, SplitBroken)."""
        try:
            every = group.all_gather_int(secrets.randbelow(1 << 62) if exchange is not None else -1)
        except InstanceBroken as exc:
            raise RuntimeError(f"the members could not agree on the KV's channel: {exc}") from None
        agreed = exchange.named(f"{exchange.change}:{every[0]}") if exchange is not None and min(every) >= 0 else None
        self.log.info("tp_in_place_kv", op=op, via="transfer" if agreed is not None else "gloo",
                      **({} if agreed is not None or exchange is None else {"why": "a member has no transfer link"}))
        return agreed

    def _exchange(self, membership: TPMembership, op: str) -> TransferSubBlocks | None:
        """The KV moves of this change over the transfer service (None: over the group's gloo). Every member names
        the change alike: the instance's rendezvous port is its own, and a formation changes up once and down once."""
        links = self.links()
        return TransferSubBlocks.between(links.svc if links is not None else None, asyncio.get_running_loop(),
                                         membership.members, membership.rank, f"tp-kv:{membership.port}:{op}",
                                         membership.timeout_s)

    # -- scale-up -------------------------------------------------------------------------------------------
    async def merge(self, membership: TPMembership, on_follower_end: Callable[[TPFollower], None] | None = None,
                    addresses: Mapping[str, str] | None = None) -> TransformReport:
        """This worker's part of a scale-up into `membership` (its group not formed yet). On success the membership
        has its group and role (not started: the caller starts it; a follower calls `on_follower_end` when its loop
        ends); ValueError / InstanceBroken / RuntimeError leave the worker whole (see the module docstring)."""
        rank, degree = membership.rank, membership.degree
        shard_source = sharded_source(self.instance.source, rank, degree)
        # a pool with the padded MLP gives the member its own pages (released in place first); else a copy
        shard: Weights | PooledInstance = (self.instance if self.instance.padded_mlp
                                           else await asyncio.to_thread(shard_source.load_weights))
        await self._link(membership, addresses or {})  # before the rendezvous, which absorbs the members' skew
        group = await asyncio.to_thread(TPGroup, rank, degree, membership.host, membership.port,
                                        timeout_s=membership.timeout_s,
                                        rendezvous_timeout_s=membership.rendezvous_timeout_s,
                                        device=self.instance.device)
        loop = asyncio.get_running_loop()
        committed: list[TransformReport] = []
        exchange = self._exchange(membership, "up")

        def on_engine(engine: Engine) -> TransformReport:
            report = scale_up(engine, group, shard_source.config, shard, exchange=self._agreed(group, exchange, "up"))
            committed.append(report)
            if rank == 0:  # before anything else can fail: a broken group then stops the engine (InstanceBroken)
                membership.lead(group, engine)
                self._receive_from_engine_thread(report.moved, loop)
            group.barrier()  # rank 0's buffered streams are open before any follower says moved_to
            return report

        try:
            report = await asyncio.wrap_future(self.engine_loop.call(on_engine))
        except BaseException as exc:
            if not committed:
                group.close()
                raise
            # The change committed and something after it failed: the new instance is broken. Its watch ends this
            # worker (EXIT_BROKEN) and its streams end with it, so the dispatcher resumes their requests elsewhere.
            group.broken = group.broken or f"in-place scale-up failed after its commit: {type(exc).__name__}: {exc}"
            self.log.error("tensor_parallel_in_place_broken", error=group.broken)
            report = committed[0]
        if rank > 0:
            if group.broken is None:
                self.handover.hand_over({rid: membership.members[0] for rid in report.moved if self.owns_stream(rid)})
            membership.follow(group, self.engine_loop.engine, self.engine_loop.num_threads, on_follower_end,
                              self.follower_stagger(membership, group))
        return report

    # -- scale-down -----------------------------------------------------------------------------------------
    async def split(self, membership: TPMembership) -> TransformReport:
        """Rank 0's part of splitting its in-place instance back into whole ones, layer by layer (tp_stagger.py):
        STAGGER to the followers and `StaggeredSplit.begin` with them, then one engine-thread call per layer (LAYER,
        `split_layer`), the engine computing between them, then SPLIT and `finish`; the streams of the requests that
        left end with moved_to their new worker.

        Raises ValueError when refused, before STAGGER went out or by every member's checks in `begin` (nothing
        changed: the instance goes on over the same group), InstanceBroken when this worker is a whole instance
        again but the split did not complete (healed, or committed with a hand-over that could not finish: the
        streams of the requests that left then end as lost, so the dispatcher resumes them), SplitBroken when its
        state is not known (the worker must exit and start again). The membership's tasks are cancelled; its group
        is closed unless refused."""
        assert membership.leader is not None and membership.group is not None
        leader, group = membership.leader, membership.group
        membership.cancel_tasks()
        announced: list[bool] = []  # STAGGER went out
        committed: list[TransformReport] = []  # finish returned
        exchange = self._exchange(membership, "down")

        def begin(engine: Engine) -> StaggeredSplit:
            check_split(engine, membership.degree, self.instance)  # refused here: the followers go on following
            announced.append(True)
            leader.stagger()
            return StaggeredSplit.begin(engine, group, self.instance.cfg, self.instance,
                                        exchange=self._agreed(group, exchange, "down"))

        def split_layer(staggered: StaggeredSplit) -> None:
            leader.split_layer()
            staggered.split_layer()

        def finish(staggered: StaggeredSplit) -> TransformReport:
            leader.split()
            report = staggered.finish()
            committed.append(report)
            group.barrier()  # every follower's buffered streams are open before rank 0 says moved_to
            return report

        begun: list[StaggeredSplit] = []
        try:
            staggered: StaggeredSplit = await asyncio.wrap_future(self.engine_loop.call(begin))
            begun.append(staggered)
            while not staggered.done:  # the engine steps between these calls
                await asyncio.wrap_future(self.engine_loop.call(lambda _e: split_layer(staggered)))
            report = await asyncio.wrap_future(self.engine_loop.call(lambda _e: finish(staggered)))
        except Exception as exc:
            if isinstance(exc, ValueError) and not begun:
                raise  # refused (before STAGGER, or by every member's checks in begin): nothing changed
            if not announced:
                raise ValueError(str(exc)) from exc  # nothing sent, nothing changed: as a refusal
            group.close()
            if committed:
                self.handover.lose([rid for rid in committed[0].moved if self.owns_stream(rid)],
                                   f"the in-place split's hand-over failed ({exc})")
                raise InstanceBroken(f"in-place split committed, hand-over failed: {exc}") from exc
            if isinstance(exc, TPHealed):
                raise  # healed: whole, every request where its stream is
            raise SplitBroken(f"in-place split failed mid-way: {type(exc).__name__}: {exc}") from exc
        group.close()
        self._log_stagger(staggered)
        self.handover.hand_over({rid: membership.members[owner] for rid, owner in report.moved.items()
                                 if self.owns_stream(rid)})
        return report

    def follower_stagger(self, membership: TPMembership, group: TPGroup) -> Callable[[], StaggeredSplit]:
        """What a follower does on STAGGER (on its loop's thread): its part of `StaggeredSplit.begin`, the KV over
        the channel the members agree on. Made on the event loop, where the transfer exchange is bound."""
        exchange = self._exchange(membership, "down")
        engine = self.engine_loop.engine

        def begin() -> StaggeredSplit:
            return StaggeredSplit.begin(engine, group, self.instance.cfg, self.instance,
                                        exchange=self._agreed(group, exchange, "down"))
        return begin

    async def follower_split(self, membership: TPMembership) -> TransformReport:
        """A follower's part of the split rank 0 announced (its loop ended on SPLIT, every layer split): `finish` with
        rank 0. Raises InstanceBroken when healed to a whole instance (holding none of the instance's requests),
        SplitBroken when its state is not known (the worker must exit and start again); requests it received before a
        failure are dropped here (rank 0 ends their streams as lost)."""
        assert membership.group is not None and membership.follower is not None
        group, rank = membership.group, membership.rank
        staggered = membership.follower.staggered
        membership.cancel_tasks()
        loop = asyncio.get_running_loop()
        received: list[str] = []

        def on_engine(engine: Engine) -> TransformReport:
            if not isinstance(staggered, StaggeredSplit):
                raise SplitBroken("rank 0 said SPLIT with no layer-staggered split begun")
            report = staggered.finish()
            mine = {rid: o for rid, o in report.moved.items() if o == rank}
            self._receive_from_engine_thread(mine, loop)
            received.extend(mine)
            group.barrier()
            return report

        try:
            report = await asyncio.wrap_future(self.engine_loop.call(on_engine))
        except Exception as exc:
            group.close()
            if received:
                self.handover.drop(received)
            if isinstance(exc, InstanceBroken):
                raise
            raise SplitBroken(f"in-place split failed mid-way: {type(exc).__name__}: {exc}") from exc
        group.close()
        assert isinstance(staggered, StaggeredSplit)
        self._log_stagger(staggered)
        return report

    def _log_stagger(self, staggered: StaggeredSplit) -> None:
        s = staggered.stats
        self.log.info("tp_stagger_done", rank=staggered.rank, layers=len(s.layer_seconds),
                      begin_ms=round(s.begin_seconds * 1e3, 1),
                      layer_ms_max=round(max(s.layer_seconds, default=0.0) * 1e3, 1),
                      layer_ms_total=round(sum(s.layer_seconds) * 1e3, 1), steps_between=sum(s.steps_between),
                      compacted_blocks=s.compacted_blocks)

    # -- streams --------------------------------------------------------------------------------------------
    def _receive_from_engine_thread(self, moved: dict[str, int], loop: asyncio.AbstractEventLoop) -> None:
        """Open buffered streams for the requests that arrive here (on the event loop, waited for from the engine
        thread: the engine must not emit their next token before a stream takes it)."""
        ids = list(moved)
        if not ids:
            return

        async def receive() -> None:
            self.handover.receive(ids)

        asyncio.run_coroutine_threadsafe(receive(), loop).result(RECEIVE_TIMEOUT_S)

