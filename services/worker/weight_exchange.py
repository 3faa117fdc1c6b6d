"""The weights a transition gives a worker, pulled from the peers that hold them (KunServe §4.4).

A worker that gains layers (a restore: a pair member becoming a whole instance, a quad member growing to its
pair's half) does not need a DRAM copy of the model: a member of its old unit holds every layer it gains
(``shared/policy/transition_plan.weight_pieces`` says which), and sends it on the transfer service's weights
class, below activations and the KV exchange. One message per weight arena (a layer, or a weight group such as
the embeddings): the arena's packed bytes, which both sides lay out identically, read from the sender's live
pages and received straight into the pages the restore took back from the KV tail (the receiver's allocator
hands the transfer service the arena's bytes; a message that arrives before the receiver has remapped lands in
a buffer and is copied in). What no peer delivers (the sender died, or its link did) comes from the host copy
when the worker keeps one (``engine.host_copy``), else the checkpoint.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from kunserve.shared.engine.pooled import PooledInstance
from kunserve.shared.log import get_logger
from kunserve.shared.policy.cluster import Unit
from kunserve.shared.policy.transition_plan import WeightPiece, unit_of
from kunserve.shared.transfer.framing import CONTROL, WEIGHTS
from kunserve.shared.transfer.service import TransferError, TransferService
from kunserve.v1 import transfer_pb2

from .membership import PING

PREFIX = "weights:"
_BEAT = torch.zeros(1, dtype=torch.uint8)
POLL_S = 0.2  # how often a receiver waiting for weights checks that their senders are still linked


def _ranges(units: list[Unit], worker_id: str) -> tuple[int, int]:
    m = unit_of(units, worker_id).member(worker_id)
    assert m is not None
    return m.range


def piece_keys(instance: PooledInstance, piece: WeightPiece, old_units: list[Unit], new_units: list[Unit]) -> list[str]:
    """The arenas that travel with `piece` (the same list on the sender and the receiver)."""
    return instance.layout.restore_arenas(_ranges(old_units, piece.dst), _ranges(new_units, piece.dst),
                                          (piece.layer_start, piece.layer_end))


def export_weights(instance: PooledInstance, me: str, pieces: list[WeightPiece], old_units: list[Unit],
                   new_units: list[Unit]) -> list[tuple[str, str, torch.Tensor]]:
    """(destination, arena key, bytes) for every arena this worker sends (engine thread, before the remap).
    Arenas it keeps are sent from their live pages; one it gives up in the same transition is copied first,
    since its pages are about to become KV."""
    start, end = _ranges(new_units, me)
    out = []
    for piece in pieces:
        if piece.src != me:
            continue
        for key in piece_keys(instance, piece, old_units, new_units):
            data = instance.layout.arena_bytes(key)
            if key.startswith("group:"):
                kept = instance.layout.groups[key.removeprefix("group:")].held_for(start, end, instance.cfg.num_layers)
            else:
                kept = start <= int(key) < end
            out.append((piece.dst, key, data if kept else data.clone()))
    return out


def send_weights(svc: TransferService, messages: list[tuple[str, str, torch.Tensor]], epoch: int) -> int:
    """Submit every arena on the weights class; returns the bytes submitted. Nobody waits for these sends: the
    receiver does. A link that is gone is logged and skipped: its receiver falls back to its host copy or the
    checkpoint."""
    sent = 0
    for dst, key, data in messages:
        try:
            svc.submit(dst, WEIGHTS, data, epoch=epoch, name=PREFIX + key)
        except TransferError as exc:
            get_logger().warning("weights_not_sent", peer=dst, arena=key, error=str(exc))
            continue
        sent += data.numel()
    return sent


@dataclass
class _Expected:
    piece: WeightPiece
    keys: list[str]


@dataclass
class WeightReceiver:
    """What this worker waits for in one transition, and where each arena came from in the end."""

    svc: TransferService
    instance: PooledInstance
    epoch: int
    pieces: list[_Expected]
    source_of: dict[str, str] = field(init=False)  # arena key -> the worker expected to send it
    arrived: dict[str, torch.Tensor | None] = field(default_factory=dict)  # None: received in place
    bytes_by_source: dict[str, int] = field(default_factory=dict)  # "peer" / "host" / "checkpoint" -> bytes
    _installed: bool = False
    _placed: set[str] = field(default_factory=set)  # arenas the allocator handed out its own pages for

    def __post_init__(self) -> None:
        self.source_of = {k: e.piece.src for e in self.pieces for k in e.keys}

    @classmethod
    def expecting(cls, svc: TransferService, instance: PooledInstance, me: str, epoch: int,
                  pieces: list[WeightPiece], old_units: list[Unit], new_units: list[Unit]) -> WeightReceiver:
        return cls(svc, instance, epoch, [_Expected(p, piece_keys(instance, p, old_units, new_units))
                                          for p in pieces if p.dst == me])

    @property
    def missing(self) -> list[str]:
        return [k for k in self.source_of if k not in self.arrived]

    # -- receiving (event loop) ---------------------------------------------------------------------------
    def install(self) -> None:
        """Receive the expected arenas straight into their pages from now on (after the remap made them)."""
        if self.source_of:
            self.svc.set_allocator(WEIGHTS, self._allocate)
            self._installed = True

    def uninstall(self) -> None:
        if self._installed:
            self.svc.set_allocator(WEIGHTS, None)
            self._installed = False

    def _allocate(self, peer: str, h: transfer_pb2.TransferHeader) -> torch.Tensor | None:
        key = h.name.removeprefix(PREFIX)
        if h.epoch != self.epoch or self.source_of.get(key) != peer or key in self.arrived:
            return None  # stale or unexpected: a buffer of its own, dropped on arrival
        try:
            view = self.instance.layout.arena_bytes(key)
        except KeyError:
            return None
        if view.numel() != h.total_bytes:
            return None
        self._placed.add(key)
        return view

    async def receive(self, timeout_s: float) -> None:
        """Wait until every expected arena has arrived, its sender's link is gone, or `timeout_s` passes;
        what is still missing then is filled from the fallback (``finish``)."""
        log = get_logger()
        deadline = time.monotonic() + timeout_s
        while self.missing:
            waiting_on = {self.source_of[k] for k in self.missing}
            gone = sorted(w for w in waiting_on if w not in self.svc.peers)
            if len(gone) == len(waiting_on):
                log.warning("weights_sender_lost", peers=gone, arenas=len(self.missing))
                return
            self._probe(waiting_on)
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning("weights_not_received", peers=sorted(waiting_on), arenas=len(self.missing), timeout_s=timeout_s)
                return
            try:
                msg = await self.svc.recv(WEIGHTS, timeout=min(left, POLL_S))
            except TimeoutError:
                continue
            key = msg.header.name.removeprefix(PREFIX)
            if msg.header.epoch != self.epoch or self.source_of.get(key) != msg.peer or key in self.arrived:
                log.warning("stale_weights_dropped", peer=msg.peer, epoch=msg.header.epoch, arena=key)
                continue
            self.arrived[key] = None if key in self._placed else msg.data
            del msg

    def _probe(self, peers: set[str]) -> None:
        """A receive alone may wait forever on a crashed sender: a ping is a send, which notices (the link is
        then dropped and the sender no longer among the service's peers)."""
        for peer in sorted(peers):
            try:
                self.svc.submit(peer, CONTROL, _BEAT, name=PING, epoch=self.epoch)
            except (TransferError, RuntimeError):
                continue

    # -- filling (engine thread) ----------------------------------------------------------------------------
    def finish(self) -> None:
        """Copy in what arrived in a buffer, fill what never arrived from the host copy or the checkpoint, and
        log where each piece came from. Leaves no arena unfilled, whatever happened before."""
        if not self.pieces:
            return
        log = get_logger()
        layout = self.instance.layout
        for e in self.pieces:
            got = [k for k in e.keys if k in self.arrived]
            for k in got:
                data = self.arrived[k]
                if data is not None:
                    layout.fill_arena(k, data)
                    self.arrived[k] = None
            lacking = [k for k in e.keys if k not in self.arrived]
            layers = list(range(e.piece.layer_start, e.piece.layer_end))
            if got:
                n = sum(layout.arena_nbytes(k) for k in got)
                self.bytes_by_source["peer"] = self.bytes_by_source.get("peer", 0) + n
                log.info("weights_restored", layers=layers, source=f"peer:{e.piece.src}", arenas=len(got), bytes=n,
                         in_place=sum(1 for k in got if k in self._placed))
            if lacking:
                source = self.instance.fallback_source(layers)
                n = self.instance.fill_weights(lacking, source, layers)
                for k in lacking:
                    self.arrived[k] = None
                self.bytes_by_source[source] = self.bytes_by_source.get(source, 0) + n
                log.warning("weights_restored", layers=layers, source=source, arenas=len(lacking), bytes=n,
                            reason=f"peer {e.piece.src} did not send them")
        self.instance.rebind_weights()


