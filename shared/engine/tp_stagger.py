"""Layer-staggered in-place scale-down (Gyges §4.3, "layer-staggered" and "reversed" transformation): a TP`degree`
instance splits into `degree` whole (TP1) engines one layer at a time, from the last layer to the first, while it
goes on computing; every request changes parallelism once, at a boundary that moves down the model.

`tp_transform.scale_down` splits every layer between two iterations: the instance pauses for the whole move. Here the
instance keeps stepping between the layers' moves. With `boundary` = b, layers [0, b) are still the TP instance's
(each member computes its heads and MLP shard of every request, all-reduced, over the merged block space) and layers
[b, L) are already split: each request's KV of those layers lies whole (all heads) on the member that will own it,
in that member's whole blocks, and that member computes those layers for its requests alone with the whole
weights. A step (`StaggeredSplit._forward`, every member, through `Engine.stagger`):

1. every member embeds the step's tokens and runs layers [0, b) as its shard (the hidden states are the same on
   every member after each all-reduce);
2. each member runs layers [b, L) for the rows of its own requests (their whole block tables, `plan_whole_tables`);
3. the members' rows are summed into one `[T, hidden]` tensor (one all-reduce; each row is one member's alone, the
   others add zeros, so the sum is exact) and rank 0 samples from it as before.

Between steps `split_layer` moves layer b-1's KV (`kv_head_split.plan_layer_gather`, the same moves as
`scale_down`'s for that layer alone, over the same `Exchange`) and lowers the boundary; `finish`, once no layer is
left, makes every member a whole engine holding its requests, with the block tables its layers already use.

**Before the first layer moves** (`begin`, every member at once): the members agree as `scale_down` does (the same
checks, the same assignment of requests to members at their whole life), then the whole weights come back first:
with the padded MLP (`pooled.PooledInstance`) the released shards' pages are taken back from the KV tails, so the
used merged blocks are first compacted below the whole instances' capacity on every member (a local copy, the same
ids everywhere); then each member builds its whole runner, and the members vote. Each running request gets its whole
block table for its whole life on its member, so the tokens computed while the layers split have their slots
already. No waiting request is admitted until `finish` (the split layers would have no place for its KV); requests
that finish or are preempted meanwhile simply leave their reserved blocks unused.

**Failures.** A refusal (ValueError) comes before anything changed, on every member. After that, `begin` and every
`split_layer` end with a vote (one all-gather): when any member failed its part (a collective or an exchange
raised, its weights or runner could not be had) or cannot answer, every member heals as `scale_down` does: a whole
engine again (its whole weights back), rank 0 with every request, re-prefilling; the others with none (TPHealed). A
member that cannot even heal raises HealFailed: its state is not known. A member that dies between two layers
breaks the instance's next step, as any TP member's death does (tensor_parallel.py).

**What differs from Gyges.** The layers move between iterations, one per call, not on a separate stream inside an
iteration; the MLP weights come back all at once at the start, from the member's own host copy (the pool maps the
pages back from the KV tails: no memory is allocated, so nothing spikes), not layer by layer from the peers.
"""

from __future__ import annotations

import json
import time
import traceback
from dataclasses import dataclass, field
from typing import NoReturn

import torch

from kunserve.shared.engine.api import SeqSnapshot
from kunserve.shared.engine.engine import Engine, HealFailed
from kunserve.shared.engine.kv_blocks import life_blocks
from kunserve.shared.engine.model_runner import ModelRunner
from kunserve.shared.engine.stage_wire import StageBatch
from kunserve.shared.engine.tensor_parallel import TPGroup
from kunserve.shared.engine.tp_transform import (
    Exchange,
    MemberWeights,
    TransformReport,
    agree_checks,
    as_member,
    healed,
    recomputed,
    run_moves,
    split_assignment,
    split_error,
)
from kunserve.shared.memory import kv_head_split, kv_layout
from kunserve.shared.memory.layer_memory import plan_compaction
from kunserve.shared.model.architecture import ModelConfig
from kunserve.shared.model.weights import Weights
from kunserve.shared.wire.transitions import snapshots_from_bytes, snapshots_to_bytes


def _move_blocks(engine: Engine, mapping: dict[int, int]) -> None:
    """Copy every layer's block `old` to `new` (mapping: old -> new ids, as the storage reads blocks now). No view
    outlives the call: a pool may unmap the tail next."""
    with torch.inference_mode():
        kv_layout.move_blocks((engine.kv.layer_cache(x) for x in range(engine.runner.start, engine.runner.end)),
                              list(mapping), list(mapping.values()))


class _WholeBlocks:
    """The split layers' KV read at whole blocks (all heads) of the member's storage, which the engine still reads as
    sub-blocks for the layers not split yet: the same bytes (`kv_layout.regroup`), fetched fresh every step."""

    def __init__(self, engine: Engine, num_blocks: int, heads: int) -> None:
        self.engine, self.num_blocks, self.heads = engine, num_blocks, heads

    def layer_cache(self, layer: int) -> torch.Tensor:
        return kv_layout.regroup(self.engine.kv.layer_cache(layer), self.num_blocks, self.heads)


@dataclass
class StaggerStats:
    """What one member's staggered split did so far (for logs, reports and the benchmark)."""

    layer_seconds: list[float] = field(default_factory=list)  # each split_layer's pause, last layer first
    steps_between: list[int] = field(default_factory=list)  # steps this member computed before each split_layer
    sent_subblocks: int = 0  # the most in one layer
    received_subblocks: int = 0
    staging_bytes: int = 0
    compacted_blocks: int = 0
    begin_seconds: float = 0.0  # begin's pause: the checks, the whole weights back, the runner, the vote


class StaggeredSplit:
    """One member's part of a layer-staggered scale-down (module docstring): `begin` (every member at once), then
    `split_layer` between steps until `done`, then `finish`. All three are collectives over `group`, called on the
    engine's thread with nothing in flight."""

    def __init__(self, engine: Engine, group: TPGroup, whole_cfg: ModelConfig, member: MemberWeights,
                 exchange: Exchange | None) -> None:
        self.engine, self.group, self.whole_cfg, self.member = engine, group, whole_cfg, member
        self.exchange = exchange
        self.degree, self.rank = group.degree, group.rank
        self.start, self.end = engine.runner.start, engine.runner.end
        self.boundary = self.end  # layers [boundary, end) are split
        self.shard: ModelRunner = engine.runner
        self.whole: ModelRunner | None = None
        self.owner: dict[str, int] = {}  # request id -> the member that keeps it
        self.tables: dict[str, list[int]] = {}  # request id -> its whole blocks on that member, for its whole life
        self._first: dict[int, str] = {}  # the merged block a running request starts with -> its id
        self._compacted: dict[int, int] = {}  # merged block -> where `begin` moved it (padded pools)
        self._whole_kv: _WholeBlocks | None = None
        self._steps = 0
        self.stats = StaggerStats()
        self.blocks_before = engine.kv.num_blocks
        self.t0 = time.monotonic()

    @property
    def done(self) -> bool:
        """Every layer is split: `finish` next."""
        return self.boundary == self.start

    # -- begin ----------------------------------------------------------------------------------------------------
    @classmethod
    def begin(cls, engine: Engine, group: TPGroup, whole_cfg: ModelConfig, whole: Weights | MemberWeights, *,
              exchange: Exchange | None = None) -> StaggeredSplit:
        """Every member at once (module docstring). ValueError, with nothing changed on any member, when the split
        is refused; TPHealed when a member failed after the checks (every member healed, whole again)."""
        self = cls(engine, group, whole_cfg, as_member(whole, as_shard=False), exchange)
        degree = self.degree
        whole_blocks = self.member.whole_blocks(self.blocks_before, degree)
        error = split_error(engine, degree, whole_cfg, whole_blocks)
        if not error and not (engine.runner.is_first and engine.runner.is_last):
            error = f"it holds layers [{self.start}, {self.end}) only"
        agree_checks(group, f"split TP{degree} layer by layer", error)
        now = time.monotonic()
        payload = snapshots_to_bytes(engine.snapshot(), now) if self.rank == 0 else b""
        snaps = snapshots_from_bytes(group.all_gather_bytes(payload)[0], now)
        self.owner = split_assignment(snaps, degree, whole_blocks, engine.block_size)  # the same on every member
        why: Exception | None = None
        tables: dict[str, list[int]] = {}
        try:
            self._take_whole_weights(snaps, whole_blocks)
            tables = {s.request.request_id: [self._compacted.get(b, b) for b in s.blocks] for s in snaps if s.blocks}
            life = {s.request.request_id: max(len(s.blocks), life_blocks(s.request, engine.block_size)) for s in snaps}
            self.tables = kv_head_split.plan_whole_tables(tables, life, self.owner, whole_blocks,
                                                          whole_cfg.num_kv_heads, degree, engine.kv.num_blocks)
        except Exception as exc:  # noqa: BLE001 - reported through the vote
            why = exc
        self._vote(why)
        self._first = {t[0]: rid for rid, t in tables.items()}
        self._whole_kv = _WholeBlocks(engine, whole_blocks, whole_cfg.num_kv_heads)
        engine.stagger(self._forward, whole_blocks)
        self.stats.begin_seconds = time.monotonic() - self.t0
        return self

    def _take_whole_weights(self, snaps: list[SeqSnapshot], whole_blocks: int) -> None:
        """The used merged blocks compacted below the whole capacity (padded pools take their MLP pages back from
        the KV tails), the whole weights back and this member's whole runner built."""
        engine = self.engine
        used = sorted({b for s in snaps for b in s.blocks})
        self._compacted = plan_compaction(used, whole_blocks * self.degree)
        if self._compacted:
            _move_blocks(engine, self._compacted)
            if self.rank == 0:  # the block tables are rank 0's
                engine.apply_compaction(self._compacted)
            self.stats.compacted_blocks = len(self._compacted)
        weights = self.member.whole([self._compacted.get(b, b) for b in used])
        engine.sync_kv_capacity()
        self.whole = engine.shard_runner(self.whole_cfg, weights)

    def _vote(self, why: Exception | None) -> None:
        """Every member's outcome of a part of the change, gathered: when any member failed (or cannot answer) every
        member heals, so none goes on alone (TPHealed)."""
        try:
            ok = all(self.group.all_gather_int(int(why is None)))
        except Exception as exc:  # noqa: BLE001 - a member is gone: heal
            why, ok = why or exc, False
        if not ok:
            self._heal(why or RuntimeError("another member failed its part"))

    # -- a step ---------------------------------------------------------------------------------------------------
    def _own(self, batch: StageBatch) -> tuple[list[int], StageBatch]:
        """This member's rows of the step and their plan over its whole blocks (decodes first, as the engine builds
        them)."""
        bs = self.engine.block_size
        rows: list[int] = []
        positions: list[int] = []
        slot_b: list[int] = []
        slot_o: list[int] = []
        decodes: list[tuple[int, int, list[int]]] = []
        prefills: list[tuple[int, int, int, list[int]]] = []

        def mine(table: list[int]) -> list[int] | None:
            rid = self._first.get(table[0])
            if rid is None:
                raise RuntimeError(f"a step computes merged block {table[0]}, which starts no request this staggered "
                                   "split planned for")
            return self.tables[rid] if self.owner[rid] == self.rank else None

        def take(first_row: int, n: int, whole: list[int]) -> None:
            for r in range(first_row, first_row + n):
                p = batch.positions[r]
                rows.append(r)
                positions.append(p)
                slot_b.append(whole[p // bs])
                slot_o.append(p % bs)

        for row, ctx, table in batch.decodes:
            whole = mine(table)
            if whole is not None:
                decodes.append((len(rows), ctx, whole[: -(-ctx // bs)]))
                take(row, 1, whole)
        for row, n, ctx, table in batch.prefills:
            whole = mine(table)
            if whole is not None:
                prefills.append((len(rows), n, ctx, whole[: -(-ctx // bs)]))
                take(row, n, whole)
        return rows, StageBatch(batch.mb_id, positions, slot_b, slot_o, decodes, prefills, None)

    def _forward(self, batch: StageBatch, ids: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """One step of the staggered instance (module docstring): logits of `rows` on rank 0, nothing elsewhere."""
        engine, dev = self.engine, self.engine.device
        assert self.whole is not None and self._whole_kv is not None
        self._steps += 1
        with torch.inference_mode():
            x = self.shard.embed_tokens(ids)
            if self.boundary > self.start:
                x = self.shard.run_layers(x, batch.positions_tensor(dev), engine.kv,
                                          batch.metadata(engine.block_size, dev), range(self.start, self.boundary))
            own, plan = self._own(batch)
            out = torch.zeros_like(x)
            if own:
                idx = torch.tensor(own, dtype=torch.long, device=dev)
                out[idx] = self.whole.run_layers(x[idx], plan.positions_tensor(dev), self._whole_kv,
                                                 plan.metadata(engine.block_size, dev), range(self.boundary, self.end))
            x = self.group.reduce(out)
            if rows is not None and rows.numel() == 0:
                return x.new_empty((0, self.whole_cfg.vocab_size), dtype=torch.float32)
            return self.shard.logits(x, rows)

    # -- between steps --------------------------------------------------------------------------------------------
    def split_layer(self) -> int:
        """Move the KV of the last layer not split yet to its requests' members and lower the boundary (every member
        at once, between steps). Returns that layer. TPHealed (every member healed) when a member fails."""
        if self.done:
            raise ValueError("every layer is split already: finish")
        t0 = time.monotonic()
        layer = self.boundary - 1
        payload = json.dumps(self.engine.block_tables()).encode() if self.rank == 0 else b""
        why: Exception | None = None
        sent = received = peak = 0
        try:
            tables: dict[str, list[int]] = json.loads(self.group.all_gather_bytes(payload)[0] or b"{}")
            targets = {x: (self.owner[rid], self.tables[rid][j]) for rid, t in tables.items() for j, x in enumerate(t)}
            moves = kv_head_split.plan_layer_gather(targets, self.degree)
            sent, received, peak = run_moves(self.group, self.engine, [moves], self.exchange,
                                             range(layer, layer + 1), first_tag=self.end - 1 - layer)
        except Exception as exc:  # noqa: BLE001 - reported through the vote: the KV is not trusted any more
            why = exc
        self._vote(why)  # a member whose part failed after the others' went through must not leave them going on
        self.boundary = layer
        s = self.stats
        s.sent_subblocks, s.received_subblocks = max(s.sent_subblocks, sent), max(s.received_subblocks, received)
        s.staging_bytes = max(s.staging_bytes, peak)
        s.steps_between.append(self._steps)
        self._steps = 0
        s.layer_seconds.append(time.monotonic() - t0)
        return layer

    def finish(self) -> TransformReport:
        """Every member a whole engine holding the requests it was given (every member at once, once `done`)."""
        if not self.done:
            raise ValueError(f"layers [{self.start}, {self.boundary}) are not split yet")
        now = time.monotonic()
        payload = snapshots_to_bytes(self.engine.snapshot(), now) if self.rank == 0 else b""
        try:
            snaps = snapshots_from_bytes(self.group.all_gather_bytes(payload)[0], now)
        except Exception as exc:  # noqa: BLE001
            self._heal(exc)
        owned = [SeqSnapshot(s.request, list(s.generated), s.num_computed,
                             self.tables[s.request.request_id][: len(s.blocks)] if s.blocks else [],
                             s.generator_state, s.num_preemptions)
                 for s in snaps if self.owner.get(s.request.request_id, 0) == self.rank]
        engine = self.engine
        engine.kv.merge_kv_heads(self.degree)
        assert self.whole is not None
        engine.change_shard(self.whole, owned, tensor_parallel=False)
        moved = {s.request.request_id: self.owner.get(s.request.request_id, 0) for s in snaps
                 if self.owner.get(s.request.request_id, 0) != 0}
        s = self.stats
        return TransformReport("scale-down", self.rank, self.degree, len(owned), len(moved), s.sent_subblocks,
                               s.received_subblocks, s.staging_bytes, self.blocks_before, engine.kv.num_blocks,
                               time.monotonic() - self.t0, moved)

    def _heal(self, exc: Exception) -> NoReturn:
        """Every member whole again, rank 0 with every request re-prefilling; raises TPHealed saying so (HealFailed
        when this member cannot be whole again)."""
        traceback.clear_frames(exc.__traceback__)  # the failed frames' KV views must not pin pages a heal remaps
        engine = self.engine
        try:
            kept = [recomputed(s) for s in engine.snapshot()] if self.rank == 0 else []
            engine.kv.merge_kv_heads(self.degree)
            runner = self.whole or engine.shard_runner(self.whole_cfg, self.member.whole(()))
            engine.change_shard(runner, kept, tensor_parallel=False)
        except Exception as failed:  # not a refusal (ValueError): this member's state is not known
            raise HealFailed(f"in-place TP{self.degree} staggered scale-down failed on rank {self.rank} ({exc}) and "
                             f"could not heal: {type(failed).__name__}: {failed}") from failed
        raise healed("staggered scale-down", self.rank, self.degree, len(kept), exc) from exc
