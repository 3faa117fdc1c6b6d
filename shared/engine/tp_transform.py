"""In-place tensor-parallel transformation of running instances (Gyges §4.1, §4.3): `degree` whole (TP1) engines
become one TP`degree` instance and back, and the requests they run keep their KV: nothing is re-prefilled.

Every member calls the same function at once, each on its own thread or process, over the TPGroup of the instance
being formed (or split), between two iterations of its engine (nothing in flight, nothing else using the group).

**Scale-up** (`scale_up`):

1. each member snapshots its requests and the members exchange them (one all-gather): every member learns every
   member's used blocks, and rank 0 gets the requests it will own;
2. MLP first (Gyges §4.3): each member releases what its shard will not compute on (`MemberWeights.release_shard`:
   a padded pool's other MLP shards go to its KV tails, in place; nothing for weights held apart) and the members
   gather their new block counts: a member that failed, or unequal counts, make every member whole again with its
   requests keeping their KV (no byte moved yet);
3. every member computes the same `plan_head_split` and reads its KV at H/degree heads per block
   (`split_kv_heads`: the header-centric block makes a rank's heads one byte range, so no byte moves);
4. the exchange's phases run layer by layer over the group (`run_moves`): per layer and phase each member reads
   the sub-blocks it sends into one buffer per peer, sends them and receives the peers', then writes what it
   received; the staging is one phase of one layer;
5. every member builds its shard's runner and the members vote (one all-gather): only when all are ready does any
   commit, so no request ends up owned twice; then every member computes as its shard (`Engine.change_shard`:
   without layer-wise preemption safepoints or KV checkpoints, which would act on its own heads alone, until it
   is whole again); rank 0 takes every member's requests, their block tables mapped into the merged block space
   (member m's block b is merged block `b*degree + m`), the others hold none and follow rank 0's steps
   (tensor_parallel.py).

**Scale-down** (`scale_down`, the inverse):

1. rank 0 snapshots the instance's requests and hands them to every member (one all-gather);
2. every member computes the same assignment of requests to members (`assign_requests` over each request's blocks
   at its whole life, prompt + max_tokens: each to the member with the most free whole blocks; refused, with nothing
   changed, when they do not fit) and the same `plan_head_gather`
   (each used merged block gets a whole block on its request's member; a block that member's own heads already
   occupy in place is kept there);
3. the moves run layer by layer (`run_moves`): every source of a layer is read before any destination is written,
   since a destination may be another move's source; the staging is one layer's moved sub-blocks;
4. after the same vote, every member reads its KV at all heads again (`merge_kv_heads`) and becomes a whole
   instance (with the safepoints and checkpoints it had before the scale-up) holding its
   requests, block tables mapped to its whole blocks.

**Failures.** A check that fails on any member (a transition's KV still landing, swap preemption, a pipeline role,
different block counts, requests that do not fit the whole instances) raises ValueError on every member before
anything changed: the members gather their checks first (`agree_checks`). A member that dies or hangs mid-move (the
group's collective fails or times out) or cannot build its runner before the vote leaves the KV untrusted: every
member heals (`TPHealed` says so; a member whose moves or runner failed votes no, so the others need not wait for
the group's timeout unless it stopped mid-exchange), reading its blocks at all heads again and becoming a whole
instance whose requests re-prefill (a recompute preemption: the same greedy tokens) — after a failed scale-up each
member keeps its own requests, after a failed scale-down rank 0 keeps all of them (where their streams are; each fits
a whole instance, or the assignment would have refused); a member that died takes its own with it (in a cluster their
streams end and the dispatcher resumes them elsewhere).

**Weights** (`MemberWeights`). Given as plain tensors (`FixedWeights`: the shard each member keeps for a scale-up,
`tp_shard.shard_weights`, the whole model's for a scale-down) they live apart from the KV and nothing is released.
A pooled instance whose pool holds the MLP in page-aligned shards (`pooled.PooledInstance(padded_mlp=True)`, Gyges
§4.2) is its own `MemberWeights`: its member computes on views of the shards it keeps, and the scale-up's first step
releases the other shards' pages to the KV in place (no weight copy; the merged instance holds more KV than its
members did whole; a heal takes them back); a scale-down sizes the whole instances at the capacity they will have with their
shards back, gathers the KV below it, and takes the pages back from the KV tails and refills those shards before the
vote. **What differs from Gyges.** The KV moves need no free page (they stay inside the blocks already mapped), so
the pages released first are not used until the merged instance computes; a scale-down refills a member's shards from its own
host copy (or the checkpoint), not from its peers. Both transformations here run between two iterations of the
instance (every request changes parallelism at once, between two of its tokens), so the order of the layers does not
matter and is the natural one; a worker splits layer by layer instead, last layer first, computing between the
layers' moves (tp_stagger.py), and `scale_down` remains the split of every layer at once. The
KV moves over the instance's process group (gloo: point-to-point sends) unless the caller gives another `Exchange`: a
worker sends it over the transfer service's KV-exchange class, as KunServe's drops do.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kunserve.shared.engine.api import SeqSnapshot
from kunserve.shared.engine.engine import Engine, HealFailed, InstanceBroken, TPHealed
from kunserve.shared.engine.kv_blocks import life_blocks
from kunserve.shared.engine.model_runner import ModelRunner
from kunserve.shared.engine.tensor_parallel import TPGroup
from kunserve.shared.memory import kv_head_split, kv_layout
from kunserve.shared.memory.kv_head_split import SubBlockMove
from kunserve.shared.model.architecture import ModelConfig
from kunserve.shared.model.weights import Weights
from kunserve.shared.wire.transitions import snapshots_from_bytes, snapshots_to_bytes

DEFAULT_PHASE_SUBBLOCKS = 256  # sub-blocks one member receives per phase of a scale-up's exchange (its staging)


@dataclass(frozen=True)
class TransformReport:
    """What one member's part of a TP change did (for logs and reports)."""

    op: str  # "scale-up" | "scale-down"
    rank: int
    degree: int
    requests: int  # requests this member holds afterwards
    moved_requests: int  # of the instance's requests, those whose owner changed
    sent_subblocks: int  # per layer
    received_subblocks: int  # per layer
    staging_bytes: int  # the most this member held staged at once
    blocks_before: int
    blocks_after: int
    seconds: float
    moved: dict[str, int] = field(default_factory=dict)  # request id -> its new owner's rank, for those whose owner changed


class MemberWeights(Protocol):
    """What one member computes on around a TP change and the memory behind it (module docstring, "Weights")."""

    def shard(self, rank: int, degree: int) -> Weights:
        """The weights rank `rank` of a TP`degree` instance computes on (built before the vote; nothing changes)."""
        ...

    def release_shard(self, rank: int, degree: int) -> bool:
        """A scale-up's first step (MLP-first): release what rank `rank`'s shard will not compute on, before any KV
        moves (nothing computes during the change). True when it released anything: the engine's whole weights are
        then gone too, and a heal takes them back through `whole`."""
        ...

    def whole_blocks(self, blocks: int, degree: int) -> int:
        """Whole KV blocks this member will hold after a scale-down, its storage now holding `blocks` sub-blocks."""
        ...

    def whole(self, used: Collection[int]) -> Weights:
        """The whole model's weights, anything released taken back first (idempotent). `used`: the sub-blocks whose
        KV must stay (each below `whole_blocks * degree`)."""
        ...


@dataclass(frozen=True)
class FixedWeights:
    """Weights held apart from the KV: nothing is released or taken back."""

    shard_weights: Weights | None = None
    whole_weights: Weights | None = None

    def shard(self, rank: int, degree: int) -> Weights:
        assert self.shard_weights is not None, "no shard weights given"
        return self.shard_weights

    def release_shard(self, rank: int, degree: int) -> bool:
        return False

    def whole_blocks(self, blocks: int, degree: int) -> int:
        return blocks // degree  # a tail too short for a whole block is dropped by the merge

    def whole(self, used: Collection[int]) -> Weights:
        assert self.whole_weights is not None, "no whole weights given"
        return self.whole_weights


# One phase's point-to-point exchange: send sends[r] to rank r, fill recvs[r] from rank r; `tag` is unique within the
# change (layer x phase). TPGroup.exchange (gloo) by default; a worker passes the transfer service's KV-exchange class
# (services/worker/tp_kv_transfer.py). Raises InstanceBroken when a peer does not take part.
Exchange = Callable[[dict[int, torch.Tensor], dict[int, torch.Tensor], int], None]


def run_moves(group: TPGroup, engine: Engine, phases: Sequence[Sequence[SubBlockMove]],
              exchange: Exchange | None = None, layers: range | None = None, first_tag: int = 0
              ) -> tuple[int, int, int]:
    """Run sub-block moves on `layers` (default: every layer this engine holds), layer by layer and phase by phase:
    per phase, read every source this member has (for its peers and for itself), exchange with the peers, then write
    every destination. Slots count sub-blocks of the storage as it is read now; the exchanges' tags count up from
    `first_tag` (a change that calls this more than once keeps them unique and rising). Returns (sent, received, peak
    staging bytes) per layer."""
    sent = received = peak = 0
    layers = range(engine.runner.start, engine.runner.end) if layers is None else layers
    for i, layer in enumerate(layers):
        phys = kv_layout.physical_view(engine.kv.layer_cache(layer))
        # the storage's cached views may have been made by a forward pass: inference tensors
        with torch.inference_mode():
            for p, phase in enumerate(phases):
                n_out, n_in, n_self = _move_phase(group.rank, exchange or group.exchange, phys, phase,
                                                  first_tag + i * len(phases) + p)
                if layer == layers.start:
                    sent += n_out
                    received += n_in - n_self
                peak = max(peak, (n_out + n_in) * phys[0].numel() * phys.element_size())
    return sent, received, peak


def _move_phase(me: int, exchange: Exchange, phys: torch.Tensor, phase: Sequence[SubBlockMove],
                tag: int) -> tuple[int, int, int]:
    """One phase of one layer: read this member's sources, exchange with the peers, write its destinations. Returns
    the sub-blocks sent to peers, received in all, and moved within this member."""
    out_slots: dict[int, list[int]] = {}
    in_slots: dict[int, list[int]] = {}
    for mv in phase:
        if mv.src == me:
            out_slots.setdefault(mv.dst, []).append(mv.src_slot)
        if mv.dst == me:
            in_slots.setdefault(mv.src, []).append(mv.dst_slot)
    # called even with nothing to move: an exchange may keep the members in lockstep (tp_kv_transfer.py)
    staged = {p: phys.index_select(0, _ids(s, phys.device)).cpu().contiguous() for p, s in out_slots.items()}
    local = staged.pop(me, None)
    recvs = {p: torch.empty((len(s), *phys.shape[1:]), dtype=phys.dtype) for p, s in in_slots.items() if p != me}
    exchange(staged, recvs, tag)
    for p, t in recvs.items():
        phys.index_copy_(0, _ids(in_slots[p], phys.device), t.to(phys.device))
    if local is not None:
        phys.index_copy_(0, _ids(in_slots[me], phys.device), local.to(phys.device))
    return (sum(len(s) for p, s in out_slots.items() if p != me), sum(len(s) for s in in_slots.values()),
            len(in_slots.get(me, ())))


def _ids(slots: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(slots, dtype=torch.long, device=device)


def split_assignment(snaps: Sequence[SeqSnapshot], degree: int, whole_blocks: int, block_size: int) -> dict[str, int]:
    """Request id -> the member that keeps it after a split into `degree` whole instances of `whole_blocks` blocks,
    each request sized at its whole life (Algorithm 2 splits once the requests fit the smaller instances: one that
    would outgrow its whole instance must not be split onto one). ValueError when they do not fit."""
    try:
        # each request sized at its whole life, never below the blocks it holds
        sizes = {s.request.request_id: max(len(s.blocks), life_blocks(s.request, block_size)) for s in snaps}
        return kv_head_split.assign_requests(sizes, degree, whole_blocks)
    except ValueError as exc:
        raise ValueError(f"the TP{degree} instance's requests do not fit {degree} whole instances of {whole_blocks} "
                         f"blocks at their whole life: {exc}") from None


def check_split(engine: Engine, degree: int, weights: MemberWeights | None = None) -> None:
    """ValueError when this TP instance's requests (rank 0's engine) would not fit `degree` whole instances: what
    `scale_down` would refuse, asked before the followers are told to split (engine thread)."""
    whole_blocks = (weights or FixedWeights()).whole_blocks(engine.kv.num_blocks, degree)
    split_assignment(engine.snapshot(), degree, whole_blocks, engine.block_size)


def recomputed(s: SeqSnapshot) -> SeqSnapshot:
    """The request without its KV: it re-prefills its prompt and generated tokens (greedy tokens stay the same)."""
    return SeqSnapshot(s.request, list(s.generated), 0, [], s.generator_state, s.num_preemptions + 1)


def healed(op: str, rank: int, degree: int, requests: int, exc: Exception, *, keep: bool = False) -> TPHealed:
    what = "keep their KV" if keep else "re-prefill"
    return TPHealed(f"in-place TP{degree} {op} failed on rank {rank} ({exc}); healed: this member is a whole "
                    f"instance again and its {requests} request(s) {what}")


def local_error(engine: Engine) -> str:
    """Why this member's engine cannot change its parallelism now ("" when it can)."""
    if engine.kv_landing:
        return "a transition's KV is still landing on it"
    if engine.link is not None or engine.kv_limit is not None:
        return "it is a pipeline group's member"
    if engine.scheduler.config.preemption == "swap":
        return "it preempts by swapping, which would copy one member's heads only"
    return ""


def split_error(engine: Engine, degree: int, whole_cfg: ModelConfig, whole_blocks: int) -> str:
    """Why this member's engine cannot split into TP1 engines of `whole_blocks` blocks now ("" when it can)."""
    error = local_error(engine)
    if not error and engine.kv.kv_heads_per_block * degree != whole_cfg.num_kv_heads:
        error = (f"its blocks hold {engine.kv.kv_heads_per_block} KV heads; TP{degree} of a model of "
                 f"{whole_cfg.num_kv_heads} needs {whole_cfg.num_kv_heads // degree}")
    if not error and whole_blocks < 1:
        error = f"{engine.kv.num_blocks} sub-blocks make no whole block of TP{degree}"
    return error


def agree_checks(group: TPGroup, op: str, error: str) -> None:
    """Every member's checks, gathered: ValueError on every member, naming the ranks, when any failed (so none goes on
    to a collective the others will never join)."""
    errors = [e.decode() for e in group.all_gather_bytes(error.encode())]
    bad = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
    if bad:
        raise ValueError(f"cannot {op} in place: " + "; ".join(bad))


def _move_then_vote(group: TPGroup, engine: Engine, phases: Sequence[Sequence[SubBlockMove]], cfg: ModelConfig,
                    weights: Callable[[], Weights], exchange: Exchange | None) -> tuple[int, int, int, ModelRunner]:
    """The moves, then this member's runner for what it becomes, then the vote: every member ready, or every member
    raises (a member that cannot answer raises InstanceBroken), so none commits alone. A member whose moves or runner
    failed still votes (no), so the others need not wait for the group's timeout to learn it."""
    sent = received = peak = 0
    runner: ModelRunner | None = None
    why: Exception | None = None
    try:
        sent, received, peak = run_moves(group, engine, phases, exchange)
        runner = engine.shard_runner(cfg, weights())
    except Exception as exc:  # noqa: BLE001 - reported through the vote
        why = exc
    try:
        ready = all(group.all_gather_int(int(runner is not None)))
    except InstanceBroken:
        if why is not None:
            raise why from None
        raise
    if not ready:
        raise why or RuntimeError("another member failed its moves or could not build its runner")
    assert runner is not None
    return sent, received, peak, runner


def as_member(weights: Weights | MemberWeights, *, as_shard: bool) -> MemberWeights:
    if isinstance(weights, Mapping):
        return FixedWeights(weights, None) if as_shard else FixedWeights(None, weights)
    return weights


def scale_up(engine: Engine, group: TPGroup, shard_cfg: ModelConfig, shard: Weights | MemberWeights, *,
             max_phase_subblocks: int = DEFAULT_PHASE_SUBBLOCKS, exchange: Exchange | None = None) -> TransformReport:
    """This member's part of merging `group.degree` whole engines into one TP instance (module docstring). Every
    member's engine must be whole, idle between iterations, with the same block count; `shard_cfg` is this rank's
    shard of the model and `shard` its weights (or what gives them: "Weights" in the module docstring)."""
    t0 = time.monotonic()
    degree, me = group.degree, group.rank
    member = as_member(shard, as_shard=True)
    whole_heads = engine.kv.kv_heads_per_block
    error = local_error(engine)
    if not error and shard_cfg.num_kv_heads * degree != whole_heads:
        error = (f"the shard holds {shard_cfg.num_kv_heads} KV heads; TP{degree} of blocks of {whole_heads} heads "
                 f"needs {whole_heads // degree}")
    agree_checks(group, f"merge into TP{degree}", error)
    blocks_before = engine.kv.num_blocks
    counts = group.all_gather_int(blocks_before)
    if len(set(counts)) != 1:
        raise ValueError(f"members have different KV block counts {counts} (by rank): a head split needs equal ones")
    now = time.monotonic()  # after a collective: every member's clock reads (nearly) the same instant
    mine = engine.snapshot()
    everyone = [snapshots_from_bytes(b, now) for b in group.all_gather_bytes(snapshots_to_bytes(mine, now))]
    used = [{b for s in snaps for b in s.blocks} for snaps in everyone]
    # planned before anything changes: a plan that cannot be made is refused alike on every member
    plan = kv_head_split.plan_head_split(used, blocks_before, whole_heads, max_phase_subblocks)
    whole_cfg = engine.cfg
    released = False
    why: Exception | None = None
    try:  # MLP first (Gyges §4.3): the shards this member will not compute on go to its KV tails; no KV byte moves
        released = member.release_shard(me, degree)
        blocks = engine.kv.num_blocks
    except Exception as exc:  # noqa: BLE001 - reported through the gather below
        why, blocks = exc, -1
    try:
        counts = group.all_gather_int(blocks)
    except InstanceBroken as exc:
        why, counts = why or exc, [-1]
    if -1 in counts or len(set(counts)) != 1:  # the KV is where it was: every member whole again, keeping it
        _whole_again(engine, member, whole_cfg, released, mine, recompute=False, degree=degree, split=False)
        raise healed("scale-up", me, degree, len(mine), why or RuntimeError(
            f"the members released their MLP shards to unequal KV blocks {counts} (by rank)"), keep=True)
    split = False
    try:
        engine.kv.split_kv_heads(degree)
        split = True
        sub_counts = group.all_gather_int(engine.kv.num_blocks)
        if len(set(sub_counts)) != 1:  # a pool layout's tail can hold a few more sub-blocks on one member
            raise ValueError(f"members have different sub-block counts {sub_counts} (by rank) after the head split")
    except Exception as exc:  # noqa: BLE001 - no byte moved yet: every member whole again, keeping the KV
        _whole_again(engine, member, whole_cfg, released, mine, recompute=False, degree=degree, split=split)
        raise healed("scale-up", me, degree, len(mine), exc, keep=True) from exc
    try:
        sent, received, peak, runner = _move_then_vote(group, engine, plan.phases, shard_cfg,
                                                       lambda: member.shard(me, degree), exchange)
    except Exception as exc:  # a member died, hung or failed before the commit: this member's KV is not trusted
        traceback.clear_frames(exc.__traceback__)  # the failed frames' KV views must not pin pages a heal remaps
        _whole_again(engine, member, whole_cfg, released, mine, recompute=True, degree=degree, split=True)
        raise healed("scale-up", me, degree, len(mine), exc) from exc
    owned: list[SeqSnapshot] = []
    if me == 0:
        for m, snaps in enumerate(everyone):
            source = mine if m == 0 else snaps  # rank 0's own requests keep their exact arrival times
            for s in source:
                owned.append(SeqSnapshot(s.request, list(s.generated), s.num_computed,
                                         [plan.block_maps[m][b] for b in s.blocks], s.generator_state,
                                         s.num_preemptions))
        owned.sort(key=lambda s: s.request.arrival_time)
    engine.change_shard(runner, owned, tensor_parallel=True)
    moved = {s.request.request_id: 0 for m, snaps in enumerate(everyone) if m != 0 for s in snaps}
    return TransformReport("scale-up", me, degree, len(owned), len(moved), sent, received, peak, blocks_before,
                           engine.kv.num_blocks, time.monotonic() - t0, moved)


def _whole_again(engine: Engine, member: MemberWeights, whole_cfg: ModelConfig, released: bool,
                 mine: Sequence[SeqSnapshot], *, recompute: bool, degree: int, split: bool) -> None:
    """A failed scale-up's heal on this member: its blocks read whole again (`split`: the heads were split), its
    released MLP shards taken back (`released`: then its whole runner is rebuilt over them), and its own requests
    back, re-prefilling when their KV is not trusted (`recompute`). HealFailed when it cannot be had."""
    try:
        if split:
            engine.kv.merge_kv_heads(degree)
        if not released:
            engine.become_whole(mine, recompute=recompute)
            return
        kept = [recomputed(s) for s in mine] if recompute else list(mine)
        weights = member.whole([b for s in kept for b in s.blocks])
        engine.change_shard(engine.shard_runner(whole_cfg, weights), kept, tensor_parallel=False)
    except Exception as exc:
        raise HealFailed(f"a failed in-place scale-up could not heal: {type(exc).__name__}: {exc}") from exc


def scale_down(engine: Engine, group: TPGroup, whole_cfg: ModelConfig, whole: Weights | MemberWeights, *,
               exchange: Exchange | None = None) -> TransformReport:
    """This member's part of splitting its TP instance into `group.degree` whole engines (module docstring).
    ValueError, with nothing changed on any member, when the instance's requests cannot fit the whole instances."""
    t0 = time.monotonic()
    degree, me = group.degree, group.rank
    member = as_member(whole, as_shard=False)
    blocks_before = engine.kv.num_blocks
    whole_blocks = member.whole_blocks(blocks_before, degree)
    agree_checks(group, f"split TP{degree}", split_error(engine, degree, whole_cfg, whole_blocks))
    now = time.monotonic()  # after a collective: every member's clock reads (nearly) the same instant
    payload = snapshots_to_bytes(engine.snapshot(), now) if me == 0 else b""
    snaps = snapshots_from_bytes(group.all_gather_bytes(payload)[0], now)
    assignment = split_assignment(snaps, degree, whole_blocks, engine.block_size)
    owners = {b: assignment[s.request.request_id] for s in snaps for b in s.blocks}
    plan = kv_head_split.plan_head_gather(owners, whole_blocks, whole_cfg.num_kv_heads, degree, blocks_before)
    mine = [s for s in snaps if assignment[s.request.request_id] == me]
    kept_subblocks = [w * degree + j for w in plan.block_maps[me].values() for j in range(degree)]
    try:
        sent, received, peak, runner = _move_then_vote(group, engine, [plan.moves], whole_cfg,
                                                       lambda: member.whole(kept_subblocks), exchange)
    except Exception as exc:  # a member died, hung or failed mid-move: whole again, rank 0 with every request recomputed
        traceback.clear_frames(exc.__traceback__)  # the failed frames' KV views must not pin pages a heal remaps
        kept = [recomputed(s) for s in snaps] if me == 0 else []  # where their streams are: nothing moved yet
        try:
            engine.kv.merge_kv_heads(degree)  # no local holds the weights: the raised error must not pin their views
            engine.change_shard(engine.shard_runner(whole_cfg, member.whole(())), kept, tensor_parallel=False)
        except Exception as failed:
            raise HealFailed(f"a failed in-place split could not heal: {type(failed).__name__}: {failed}") from failed
        raise healed("scale-down", me, degree, len(kept), exc) from exc
    engine.kv.merge_kv_heads(degree)
    owned = [SeqSnapshot(s.request, list(s.generated), s.num_computed, [plan.block_maps[me][b] for b in s.blocks],
                         s.generator_state, s.num_preemptions) for s in mine]
    engine.change_shard(runner, owned, tensor_parallel=False)
    moved = {s.request.request_id: assignment[s.request.request_id] for s in snaps
             if assignment[s.request.request_id] != 0}
    return TransformReport("scale-down", me, degree, len(owned), len(moved), sent, received, peak, blocks_before,
                           engine.kv.num_blocks, time.monotonic() - t0, moved)
