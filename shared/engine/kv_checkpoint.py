"""Incremental KV checkpointing of offline requests (ConServe §4.4): preempting one frees its device KV at once, with
neither a swap's stall nor recompute's lost work, and resuming it prefetches its KV back.

Why. A preempted request's KV classically has two fates. Recompute drops it (the memory is free at once, but the
request re-prefills its whole prefix later) and swap copies it to host memory at the moment of preemption (nothing
is lost, but the copy grows with the request's length and stalls the online request that needed the memory). KV is
append-only: a block never changes once full while its request holds it. So after every iteration the offline
requests' newly completed blocks are copied to host memory in the background while the requests keep running on
their device copy; at preemption only the last, partial block is left to copy (at most block_size tokens,
synchronously) and the device blocks are freed at once. The request waits like a swapped one (its `Sequence.swapped`
is its `Checkpoint`) and its KV comes back on re-admission: prefetched in the background as soon as the scheduler
would re-admit it (it runs again at once, holding its new blocks and preemptable like any running request, but
computes nothing until its KV is there), else copied at swap-in. Online requests are never checkpointed: offline
requests never preempt them, and their own preemption stays what the config says.

The host region is memory of its own (not the pool's): slots of one block of every layer each, [layers, 2,
kv_heads, block_size, head_dim], pinned when the KV lives on a GPU so the copies are DMA on a side stream, allocated
lazily in chunks and reused. Its size is bounded (engine.checkpoint_mib). When it is full, a request's new blocks
take the slots of older running offline requests' checkpoints (never a preempted one's: its KV is only there):
ConServe's scheduler preempts the newest offline request first, so the newest checkpoints are the ones a preemption
uses. A request left without room falls behind and is preempted by recompute (or swap, per the config) until its
checkpoint catches up; so is one whose partial block finds no slot.

Threads. One background thread runs the copies in FIFO order; the engine thread only enqueues. What must hold:
- a copy reads device blocks its request still holds: a preemption first waits for that request's pending copies
  (its own only), then frees its blocks. A request that finishes or is aborted frees its blocks at once (a copy
  still reading them reads garbage into slots nobody reads again) and its slots go back to the free list only
  once its pending copies are done, so no later copy lands in a reused slot.
- a prefetch writes device blocks its request owns but does not compute on until the copy is done. Preempted again
  or aborted before that, its queued copy is dropped (the checkpoint is still whole on host) or, when it has
  started, waited for, before the blocks are freed.
- nothing reads the KV while the memory pool remaps it: the engine drains the queue (`drain`) before every remap,
  compaction, snapshot or clear.
On a GPU the copies run on a stream of their own, overlapping the model's kernels, each after an event recorded on
the engine's stream when it was enqueued (after the iteration that wrote the blocks).
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import math
import threading
import time
from collections.abc import Iterable
from typing import Any

import torch

from kunserve.shared.engine.kv_storage import KVStorage
from kunserve.shared.log import get_logger
from kunserve.shared.policy.batch_scheduler import Sequence

IDLE_EXIT_S = 2.0  # the copy thread ends after this long with nothing to copy (the next copy starts it again)
CHUNK_BYTES = 16 * 1024 * 1024  # host slots are allocated this many bytes at a time


@dataclasses.dataclass(eq=False)
class Checkpoint:
    """One offline request's KV in host memory: while it runs, `slots` hold its full blocks (the rest is on the
    device); once preempted by checkpoint (`on_host`) the slots plus `tail` are its only KV."""

    request_id: str
    order: tuple[float, int]  # the request's arrival order: the oldest lose their slots first when the region is full
    slots: list[int] = dataclasses.field(default_factory=list)  # host slot of each full block, copied or being copied
    tail: int | None = None  # host slot of the partial last block, while on host
    on_host: bool = False
    pending: int = 0  # copies queued or running for it
    dropped: bool = False  # forgotten while copies were pending: its slots go back once they are done
    failed: bool = False  # a copy raised: its host KV cannot be trusted


@dataclasses.dataclass
class _Job:
    inbound: bool  # host -> device (a prefetch); else device -> host
    items: list[tuple[Checkpoint, int, int]]  # (checkpoint, device block, host slot)
    event: Any = None  # CUDA: recorded on the engine's stream when enqueued


@dataclasses.dataclass(frozen=True)
class CheckpointStats:
    capacity_blocks: int  # host slots the region may hold (engine.checkpoint_mib / bytes of one block of every layer)
    block_bytes: int
    host_blocks_used: int
    host_bytes_allocated: int  # slots allocated so far (lazily, in chunks; reused)
    blocks_checkpointed: int  # full blocks copied to host in the background
    bytes_checkpointed: int  # theirs and the partial blocks'
    tail_blocks: int  # partial blocks copied at preemption
    preemptions: int  # offline preemptions by checkpoint
    fallbacks: int  # offline preemptions the checkpoint did not cover (recompute or swap instead)
    evictions: int  # checkpoints of older running requests dropped to make room
    behind: int  # times a request's new blocks found no room
    prefetches: int  # checkpoints copied back in the background before their request was scheduled again
    restores: int  # checkpoints copied back synchronously at re-admission
    cancelled: int  # prefetches dropped before they started (their request was preempted again or left)
    blocks_restored: int


class KVCheckpointStore:
    """One engine's checkpoints of its offline requests' KV (layers `layers` of `kv`, blocks of `block_shape`) in at
    most capacity_bytes of host memory. Every method runs on the engine thread except `stats` (any thread)."""

    def __init__(self, kv: KVStorage, layers: range, block_shape: tuple[int, ...], dtype: torch.dtype,
                 capacity_bytes: int, device: torch.device) -> None:
        self.kv = kv
        self.layers = layers
        self.device = device
        self.dtype = dtype
        self.slot_shape = (len(layers), *block_shape)
        self.block_bytes = math.prod(self.slot_shape) * torch.empty((), dtype=self.dtype).element_size()
        self.capacity = max(0, capacity_bytes) // self.block_bytes
        self._cuda = device.type == "cuda"
        self._per_chunk = max(1, min(self.capacity, CHUNK_BYTES // self.block_bytes))
        self._chunks: list[torch.Tensor | None] = [None] * -(-self.capacity // self._per_chunk)
        self._alloc = threading.Lock()
        self._free: list[int] = list(range(self.capacity))  # a sorted list is a min-heap: low slots (chunks) first
        self._entries: dict[str, Checkpoint] = {}
        self._releasing: dict[int, Checkpoint] = {}  # dropped with copies pending: their slots come back after them
        self._jobs: collections.deque[_Job] = collections.deque()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stream: Any = None
        self.blocks_checkpointed = self.tail_blocks = self.preemptions = self.fallbacks = 0
        self.evictions = self.behind = self.prefetches = self.restores = self.blocks_restored = self.cancelled = 0

    # -- engine thread ----------------------------------------------------------------------------------------
    def after_iteration(self, seqs: Iterable[Sequence], block_size: int) -> None:
        """Queue the copies of the blocks these running offline requests completed (all full blocks not copied yet:
        a request that fell behind catches up here when there is room). The copies go to the copy thread as one job at
        the end; a checkpoint given slots earlier in this call and then taken for a newer request's blocks has its
        copies withdrawn from that job before they are ever queued (waiting for them would wait forever)."""
        unsent: dict[int, list[tuple[Checkpoint, int, int]]] = {}
        with self._cv:
            for seq in seqs:
                full = seq.num_computed // block_size
                ck = self._entries.get(seq.request_id)
                if ck is None:
                    if full == 0:
                        continue
                    ck = self._entries[seq.request_id] = Checkpoint(seq.request_id, seq.order)
                if ck.failed:  # a copy of it raised: start over once its copies are done
                    if not ck.pending:
                        self._drop(ck)
                    continue
                done = len(ck.slots)
                if full <= done:
                    continue
                slots = self._take(full - done, ck, unsent)
                if slots is None:
                    self.behind += 1
                    continue
                ck.slots.extend(slots)
                ck.pending += len(slots)
                unsent.setdefault(id(ck), []).extend(
                    (ck, block, slot) for block, slot in zip(seq.block_table.ids[done:full], slots))
        items = [item for group in unsent.values() for item in group]
        if items:
            self._submit(_Job(False, items, self._event()))

    def checkpoint_out(self, seq: Sequence, block_size: int) -> Checkpoint | None:
        """Preempting offline `seq`: when its checkpoint holds every full block, wait for its own pending copies, copy
        its partial last block and return the checkpoint (its device blocks may be freed now). None when it does not
        cover them (the preemption falls back; the checkpoint is forgotten)."""
        full, partial = divmod(seq.num_computed, block_size)
        with self._cv:
            ck = self._entries.get(seq.request_id)
            if ck is not None and len(ck.slots) == full:
                while ck.pending:
                    self._cv.wait()
            tail = None
            if ck is not None and not ck.failed and len(ck.slots) == full and partial:
                got = self._take(1, ck)
                tail = got[0] if got else None
            if ck is None or ck.failed or len(ck.slots) != full or (partial and tail is None):
                self.fallbacks += 1
                if ck is not None:
                    self._drop(ck)
                return None
        if tail is not None:
            self._copy_out([(seq.block_table.ids[full], tail)], non_blocking=False)
            self.tail_blocks += 1
        with self._cv:
            ck.tail = tail
            ck.on_host = True
            self.preemptions += 1
        return ck

    def restore(self, ck: Checkpoint, blocks: list[int]) -> None:
        """Copy a preempted checkpoint into `blocks` (its request's new blocks) now, on the engine's stream."""
        self._copy_in(list(zip(blocks, self._host_slots(ck, len(blocks)))), non_blocking=False)
        with self._cv:
            self._back_on_device(ck)
            self.restores += 1
            self.blocks_restored += len(blocks)

    def prefetch(self, ck: Checkpoint, blocks: list[int]) -> None:
        """Copy a preempted checkpoint into `blocks` in the background; `ready` says when it is there."""
        items = [(ck, block, slot) for block, slot in zip(blocks, self._host_slots(ck, len(blocks)))]
        with self._cv:
            ck.pending += len(items)
        self._submit(_Job(True, items, self._event()))

    def cancel_prefetch(self, ck: Checkpoint, *, preempted: bool) -> bool:
        """Its request leaves while its KV comes back (preempted again, or aborted). True: the copy had not started and
        is dropped (the checkpoint is whole on host: the device blocks may be freed at once; with preempted, that is a
        preemption by checkpoint). False: it had, and is waited for (the KV is on the device again: preempt it with
        checkpoint_out)."""
        with self._cv:
            for i, job in enumerate(self._jobs):
                if i and job.inbound and job.items[0][0] is ck:  # the running job is the first one
                    del self._jobs[i]
                    ck.pending -= len(job.items)
                    self.cancelled += 1
                    self.preemptions += preempted
                    self._cv.notify_all()
                    return True
            while ck.pending:
                self._cv.wait()
            return False

    def ready(self, ck: Checkpoint, *, wait: bool) -> bool:
        """Whether no copy of `ck` is pending any more (waiting for that with wait)."""
        with self._cv:
            while wait and ck.pending:
                self._cv.wait()
            return not ck.pending

    def forget(self, request_id: str) -> None:
        """The request finished or left: its slots go back (once its pending copies are done)."""
        with self._cv:
            ck = self._entries.get(request_id)
            if ck is not None:
                self._drop(ck)

    def drain(self) -> None:
        """Wait until every queued copy is done (before the KV memory is remapped, compacted or handed over)."""
        with self._cv:
            while self._jobs:
                self._cv.wait()

    def reset(self) -> None:
        """Forget every checkpoint (the engine forgot its requests); the allocated host memory is kept for reuse."""
        self.drain()
        with self._cv:
            for ck in list(self._entries.values()):
                self._drop(ck)

    def host_copy(self, request_id: str) -> torch.Tensor | None:
        """The checkpointed full blocks of a request, [blocks, layers, 2, kv_heads, block_size, head_dim] (call after
        drain); None when it has none."""
        ck = self._entries.get(request_id)
        if ck is None or not ck.slots:
            return None
        return torch.stack([self._slot(s) for s in ck.slots])

    def stats(self) -> CheckpointStats:
        allocated = sum(c.numel() * c.element_size() for c in self._chunks if c is not None)
        return CheckpointStats(
            capacity_blocks=self.capacity, block_bytes=self.block_bytes, host_blocks_used=self.capacity - len(self._free),
            host_bytes_allocated=allocated, blocks_checkpointed=self.blocks_checkpointed,
            bytes_checkpointed=(self.blocks_checkpointed + self.tail_blocks) * self.block_bytes,
            tail_blocks=self.tail_blocks, preemptions=self.preemptions, fallbacks=self.fallbacks,
            evictions=self.evictions, behind=self.behind, prefetches=self.prefetches, restores=self.restores,
            cancelled=self.cancelled, blocks_restored=self.blocks_restored)

    # -- slots (under self._cv) ----------------------------------------------------------------------------------
    def _take(self, n: int, ck: Checkpoint,
              unsent: dict[int, list[tuple[Checkpoint, int, int]]] | None = None) -> list[int] | None:
        """n free slots for ck; when too few are free, those of older running requests' checkpoints (oldest first) are
        taken too. Slots still being copied count as free-to-be: this waits for their copies, so what fits does not
        depend on how far the copy thread is. None (nothing taken) when even that is not enough. `unsent` holds the
        copies the caller counted as pending but has not queued yet (per checkpoint): a taken checkpoint's are
        withdrawn, as no copy thread would ever finish them."""
        if n > len(self._free):
            room = len(self._free) + sum(len(c.slots) + (c.tail is not None) for c in self._releasing.values())
            use = []
            for c in sorted((c for c in self._entries.values() if c.order < ck.order and c.slots and not c.on_host),
                            key=lambda c: c.order):
                if room >= n:
                    break
                use.append(c)
                room += len(c.slots)
            if room < n:
                return None
            for c in use:
                if unsent is not None:
                    c.pending -= len(unsent.pop(id(c), []))
                self._drop(c)
                self.evictions += 1
            while len(self._free) < n:
                self._cv.wait()
        return [heapq.heappop(self._free) for _ in range(n)]

    def _drop(self, ck: Checkpoint) -> None:
        if self._entries.get(ck.request_id) is ck:
            del self._entries[ck.request_id]
        ck.dropped = True
        if ck.pending:
            self._releasing[id(ck)] = ck
        else:
            self._release(ck)

    def _release(self, ck: Checkpoint) -> None:
        for slot in ck.slots + ([ck.tail] if ck.tail is not None else []):
            heapq.heappush(self._free, slot)
        ck.slots = []
        ck.tail = None

    def _back_on_device(self, ck: Checkpoint) -> None:
        """Its KV is on the device again: the partial block's slot goes back (the block keeps growing there); the full
        blocks' stay, so a later preemption copies only what is new."""
        if ck.tail is not None:
            heapq.heappush(self._free, ck.tail)
            ck.tail = None
        ck.on_host = False

    def _host_slots(self, ck: Checkpoint, n: int) -> list[int]:
        slots = ck.slots + ([ck.tail] if ck.tail is not None else [])
        if len(slots) != n or not ck.on_host:
            raise RuntimeError(f"checkpoint of {ck.request_id!r} holds {len(slots)} blocks (on host: {ck.on_host}), "
                               f"{n} asked for")
        return slots

    def _slot(self, slot: int) -> torch.Tensor:
        c, row = divmod(slot, self._per_chunk)
        chunk = self._chunks[c]
        if chunk is None:
            with self._alloc:
                chunk = self._chunks[c]
                if chunk is None:
                    rows = min(self._per_chunk, self.capacity - c * self._per_chunk)
                    chunk = torch.empty((rows, *self.slot_shape), dtype=self.dtype, pin_memory=self._cuda)
                    self._chunks[c] = chunk
        return chunk[row]

    # -- copies -------------------------------------------------------------------------------------------------
    def _event(self) -> Any:
        if not self._cuda:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    @torch.inference_mode()  # the KV may be inference tensors (written during a forward)
    def _copy_out(self, pairs: list[tuple[int, int]], *, non_blocking: bool) -> None:
        """Device blocks -> host slots: [(block, slot)]; non_blocking: on the copy thread's stream (synchronised
        after), else done when it returns."""
        ids = torch.tensor([b for b, _ in pairs], dtype=torch.long, device=self.device)
        rows = torch.stack([self.kv.layer_cache(layer).index_select(0, ids) for layer in self.layers], dim=1)
        for j, (_, slot) in enumerate(pairs):
            self._slot(slot).copy_(rows[j], non_blocking=non_blocking)

    @torch.inference_mode()
    def _copy_in(self, pairs: list[tuple[int, int]], *, non_blocking: bool) -> None:
        """Host slots -> device blocks: [(block, slot)] (non_blocking as in _copy_out)."""
        ids = torch.tensor([b for b, _ in pairs], dtype=torch.long, device=self.device)
        rows = torch.empty((len(pairs), *self.slot_shape), dtype=self.dtype, device=self.device)
        for j, (_, slot) in enumerate(pairs):
            rows[j].copy_(self._slot(slot), non_blocking=non_blocking)
        for i, layer in enumerate(self.layers):
            self.kv.layer_cache(layer).index_copy_(0, ids, rows[:, i])

    def _submit(self, job: _Job) -> None:
        with self._cv:
            self._jobs.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kv-checkpoint", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def _run(self) -> None:
        """The copy thread: jobs in FIFO order until none came for IDLE_EXIT_S."""
        if self._cuda and self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        while True:
            with self._cv:
                deadline = time.monotonic() + IDLE_EXIT_S
                while not self._jobs:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        self._thread = None
                        return
                    self._cv.wait(left)
                job = self._jobs[0]
            ok = True
            try:
                self._run_job(job)
            except Exception:  # its checkpoints are not trusted: their requests recompute
                get_logger().exception("kv_checkpoint_copy_failed", inbound=job.inbound, blocks=len(job.items))
                ok = False
            with self._cv:
                self._jobs.popleft()
                self._finish(job, ok)
                self._cv.notify_all()

    def _run_job(self, job: _Job) -> None:
        pairs = [(block, slot) for _, block, slot in job.items]
        copy = self._copy_in if job.inbound else self._copy_out
        if not self._cuda:
            copy(pairs, non_blocking=False)
            return
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(job.event)
            copy(pairs, non_blocking=True)
        self._stream.synchronize()

    def _finish(self, job: _Job, ok: bool) -> None:
        """A job is done (under self._cv): pending counts, counters, the slots of checkpoints dropped meanwhile."""
        touched: dict[int, Checkpoint] = {}
        for ck, _, _ in job.items:
            ck.pending -= 1
            ck.failed |= not ok
            touched[id(ck)] = ck
        if job.inbound:
            self.prefetches += len(touched)
            self.blocks_restored += len(job.items)
        else:
            self.blocks_checkpointed += len(job.items)
        for ck in touched.values():
            if ck.pending:
                continue
            if job.inbound and not ck.dropped:
                self._back_on_device(ck)
            if ck.dropped:
                self._releasing.pop(id(ck), None)
                self._release(ck)
