"""One worker's model instance living in the unified memory pool, with layer drop and restore.

Weights and KV cache share the pool's physical pages (KunServe §4.1): the engine computes on views
of the pages (weights stored fused and, on a CPU in float32, as the GEMM kernel's column panels; no
copies), and the KV cache is the pool layout itself. Dropping layers remaps their pages into the KV tails of the remaining layers;
restoring takes them back (compacting live KV blocks first when they sit in the tail) and refills
the weights: in a cluster transition from the peer that holds them (services/worker/weight_exchange.py
receives straight into the restored arenas), otherwise, or when no peer can send them, from the DRAM
host copy (``engine.host_copy``, optional) or the checkpoint.

With `padded_mlp` the pool holds each layer's MLP in page-aligned shards (tp_padding.py) and the instance is its own
`tp_transform.MemberWeights`: an in-place TP scale-up releases the shards a member no longer computes on to its KV,
a scale-down takes them back and refills them from the host copy.

Every method must run on the engine thread (EngineLoop.call): nothing may compute while pages move.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch

from kunserve.shared.engine.api import SeqSnapshot
from kunserve.shared.engine.engine import Engine, HealFailed
from kunserve.shared.log import get_logger
from kunserve.shared.memory import create_pool
from kunserve.shared.memory.errors import KVCapacityError, MemoryPoolError
from kunserve.shared.memory.layer_memory import RemapResult
from kunserve.shared.model.pool_placement import FFN_SHARDS, PANELS, build_model_layout, fused_source
from kunserve.shared.model.tp_padding import shards_of
from kunserve.shared.model.tp_shard import shard_stored_attention
from kunserve.shared.model.weights import ModelSource, Weights
from kunserve.shared.policy.batch_scheduler import SchedulerConfig, TokenBudget

WEIGHT_SOURCES = ("host", "checkpoint")


class InstanceBusy(MemoryPoolError):
    """Dropping layers would discard the KV of requests in flight (the cluster-level drop exchanges it first)."""

    grpc_code = "FAILED_PRECONDITION"


@dataclass(frozen=True)
class LayerChange:
    """What a drop or restore did, for the RPC answer and the logs."""

    result: RemapResult
    compaction_moves: int = 0
    weight_source: str = ""


class PooledInstance:
    def __init__(self, source: ModelSource, *, layer_range: tuple[int, int], pool_bytes: int, page_size: int,
                 block_size: int, backend: str = "auto", device: str = "cpu",
                 scheduler_config: SchedulerConfig | None = None, budget: TokenBudget | None = None,
                 keep_host_copy: bool = True, padded_mlp: bool = False) -> None:
        self.source = source
        self.cfg = source.config
        self.device = device
        placement: dict[str, Any] = {"device": device} if backend == "cuda" else {}
        self.pool = create_pool(backend, pool_bytes=pool_bytes, page_size=page_size, **placement)
        try:
            self.layout = build_model_layout(self.pool, self.cfg, layer_range, block_size,
                                             source.load_weights(layer_range), padded_mlp=padded_mlp)
        except BaseException:
            self.pool.close()
            raise
        self.padded_mlp = self.layout.shard_count > 0  # fixed at construction: read from any thread
        # The DRAM copy a restore reads from (KunServe §4.4: parameters replicated in host memory).
        self.host_copy: dict[str, torch.Tensor] | None = self.layout.host_copy() if keep_host_copy else None
        self._host_range = layer_range
        self.engine = Engine(self.cfg, self.layout.weights(), block_size=block_size, device=device,
                             layer_range=layer_range, scheduler_config=scheduler_config, budget=budget,
                             kv_storage=self.layout, pack_weights=False)

    # -- state -------------------------------------------------------------------------------------------
    @property
    def layer_range(self) -> tuple[int, int]:
        return self.layout.layer_start, self.layout.layer_end

    @property
    def serving(self) -> bool:
        """A worker serves requests alone only while it holds the whole model."""
        return self.layer_range == (0, self.cfg.num_layers)

    def memory_map(self) -> dict[str, Any]:
        out = self.layout.memory_map(per_page=True)
        out["kv"]["used_blocks"] = self.engine.allocator.num_used
        out["host_copy_bytes"] = sum(t.numel() * t.element_size() for t in (self.host_copy or {}).values())
        return out

    # -- drop --------------------------------------------------------------------------------------------
    def drop(self, layers: list[int]) -> LayerChange:
        if self.engine.has_work():
            raise InstanceBusy(f"{len(self.engine.seqs)} requests are in flight on this worker: dropping layers "
                               f"{layers} would discard their KV; drain them or drop through the memory manager, "
                               "which exchanges KV first")
        self.layout.plan_drop(layers)  # validates (LayerRangeError names the layers) before anything changes
        self.engine.release_weights()
        try:
            result = self.layout.drop_layers(layers)
        finally:
            self.engine.sync_kv_capacity()
            self.rebind_weights()
        return LayerChange(result)

    # -- layout transitions (cluster drop / restore) -------------------------------------------------------
    def capacity_for(self, start: int, end: int) -> int:
        """KV blocks this worker would have holding [start, end) (nothing changes)."""
        return self.layout._plan(start, end).num_blocks

    def to_range(self, start: int, end: int, source: str = "host", *, fill: bool = True) -> list[LayerChange]:
        """Hold exactly [start, end): drop what lies outside, then restore what is missing (from the host
        copy, else the checkpoint; with fill=False the restored arenas are left for the caller to fill:
        ``arena_bytes`` / ``fill_weights``). The engine must hold no KV (a transition cleared it)."""
        if self.engine.allocator.num_used:
            raise InstanceBusy(f"{self.engine.allocator.num_used} KV blocks are in use; a transition clears them first")
        cur_start, cur_end = self.layer_range
        if max(start, cur_start) >= min(end, cur_end):
            raise ValueError(f"range [{start}, {end}) does not overlap the held [{cur_start}, {cur_end})")
        changes = []
        out = [x for x in range(cur_start, cur_end) if not start <= x < end]
        if out:
            changes.append(self.drop(out))
        missing = [x for x in range(start, end) if not cur_start <= x < cur_end]
        if missing:
            if source == "host":
                source = self.fallback_source(missing)
            changes.append(self.restore(missing, source, fill=fill))
        return changes

    def fallback_source(self, layers: list[int]) -> str:
        """Where layers no peer sends come from: the host copy when it holds them all, else the checkpoint."""
        if self.host_copy is not None and self._host_range[0] <= min(layers) and max(layers) < self._host_range[1]:
            return "host"
        return "checkpoint"

    def heal(self, requests: list[SeqSnapshot] | None = None) -> None:
        """Back to a whole instance (the missing layers from the host copy, else the checkpoint) after a group
        broke or a transition failed. The engine keeps its own requests, or exactly `requests` when given, as
        recompute preemptions: their KV cannot be trusted any more."""
        self.engine.leave_group()
        if requests is not None:
            self.engine.become_whole(requests, recompute=True)
        if self.layer_range != (0, self.cfg.num_layers):
            self.to_range(0, self.cfg.num_layers)
        self.engine.sync_kv_capacity()

    # -- restore -----------------------------------------------------------------------------------------
    def weight_source(self, layers: list[int], source: str):
        if source not in WEIGHT_SOURCES:
            raise ValueError(f"source: must be one of {', '.join(WEIGHT_SOURCES)}, got {source!r}")
        if source == "host":
            if self.host_copy is None:
                raise ValueError("source: this worker keeps no host copy (engine.host_copy = false); use 'checkpoint'")
            missing = [x for x in layers if not (self._host_range[0] <= x < self._host_range[1])]
            if missing:
                raise ValueError(f"source: the host copy does not hold layers {missing}; use 'checkpoint'")
            return self.host_copy
        lo, hi = min(layers), max(layers) + 1
        # tensor_shapes((lo, hi)) includes the embeddings / final norm / lm_head when the range touches an end
        return fused_source(self.source.load_weights((lo, hi)))

    def restore(self, layers: list[int], source: str = "host", *, fill: bool = True) -> LayerChange:
        """Take the pages of `layers` back from the KV tails and fill their weights from `source` (fill=False:
        the caller fills every new arena before the engine computes again)."""
        plan = self.layout.plan_restore(layers)  # validates the layer set first
        weights = self.weight_source(layers, source) if fill else None
        used = self.engine.allocator.used_ids()
        if len(used) > plan.num_blocks:
            raise KVCapacityError(
                f"restoring layers {layers} leaves {plan.num_blocks} KV blocks but {len(used)} are in use",
                used_blocks=len(used), new_num_blocks=plan.num_blocks, needs_compaction=False)
        moves: dict[int, int] = {}
        if any(b >= plan.num_blocks for b in used):
            moves = self.layout.plan_compaction(used, plan.num_blocks)
            self.layout.apply_compaction(moves)  # copies the blocks' bytes in every held layer
            self.engine.apply_compaction(moves)  # rewrites the allocator and every block table
        self.engine.release_weights()
        try:
            result = self.layout.restore_layers(layers, weights, used_block_ids=self.engine.allocator.used_ids())
        finally:
            self.engine.sync_kv_capacity()
            self.rebind_weights()
        if fill:
            get_logger().info("weights_restored", layers=list(result.layers), source=source,
                              bytes=self.layers_bytes(result.layers))
        return LayerChange(result, len(moves), source if fill else "")

    def layers_bytes(self, layers: tuple[int, ...] | list[int]) -> int:
        """Weight bytes of `layers` (their tensors, not the page padding)."""
        return sum(s.nbytes for x in layers for s in self.layout._specs(x))

    def fill_weights(self, keys: list[str], source: str, span: list[int]) -> int:
        """Fill the arenas `keys` (as ``LayerMemoryLayout.restore_arenas`` names them for the layers `span`)
        from the host copy or the checkpoint, after a restore with fill=False whose peer did not send them;
        returns the bytes filled."""
        layers = [int(k) for k in keys if not k.startswith("group:")]
        groups = [k.removeprefix("group:") for k in keys if k.startswith("group:")]
        # a piece's groups travel with its end layers, so the span's checkpoint range holds them too
        self.layout.load_weights(self.weight_source(span, source), layers=layers, groups=groups)
        self.rebind_weights()
        return sum(self.layout.arena_nbytes(k) for k in keys)

    def rebind_weights(self) -> None:
        """The engine computes over what the worker now holds (views of the pages; after every remap and
        every fill of restored arenas)."""
        self.engine.use_weights(self.layout.weights(), self.layer_range)

    # -- in-place tensor-parallel changes (tp_transform.MemberWeights) -----------------------------------
    def shard(self, rank: int, degree: int) -> Weights:
        """What rank `rank` of TP`degree` computes on: views of the pool's replicated tensors and of the MLP shards
        it keeps, and copies of its heads' attention weights (cut from the pool's; Gyges keeps attention whole)."""
        keep = self._keep(rank, degree)
        stored = self.layout.weights()
        weights = {k: v for k, v in stored.items() if not k.endswith(FFN_SHARDS)}
        cut = shard_stored_attention(stored, self.cfg, rank, degree)
        for name in cut:
            weights.pop(name + PANELS, None)
        weights.update(cut)
        weights.update(self.layout.shard_views(keep))
        self.layout.release_views()  # the layout's own all-shard views must not pin the pages being released
        return weights

    def release_shard(self, rank: int, degree: int) -> bool:
        """MLP-first (Gyges §4.3): the engine drops its whole weights (nothing computes during the change) and the MLP
        shards rank `rank` will not compute on go to the KV tails, in place. False (nothing released) without the
        padded MLP."""
        if not self.padded_mlp:
            return False
        self.engine.release_weights()
        pages = self.layout.weight_pages
        try:
            result = self.layout.release_shards(self._keep(rank, degree))
        except Exception as exc:
            if self.layout.weight_pages != pages:  # it failed part-way: which pages hold what is not known
                raise HealFailed(f"releasing the MLP shards failed part-way: {type(exc).__name__}: {exc}") from exc
            self.rebind_weights()  # refused with nothing changed: the engine computes on the whole weights again
            raise
        get_logger().info("tp_shards_released", rank=rank, degree=degree, pages=result.pages_unmapped,
                          kv_blocks=result.new_num_blocks)
        return True

    def whole_blocks(self, blocks: int, degree: int) -> int:
        """Whole blocks once the released shards are back (blocks // degree when none is released)."""
        if not self.padded_mlp or self.layout.kept_shards == range(self.layout.shard_count):
            return blocks // degree
        pages = self.layout.plan_shard_reclaim().kv_pages_per_layer
        return pages * self.pool.page_size // (self.layout.block_bytes * degree)

    def whole(self, used: Collection[int]) -> Weights:
        """The whole model's views, the released shards taken back from the KV tails and refilled from the host copy
        (else the checkpoint) first."""
        if self.padded_mlp and self.layout.kept_shards != range(self.layout.shard_count):
            layers = list(self.layout.layers)
            source = self.weight_source(layers, self.fallback_source(layers))
            result = self.layout.reclaim_shards(source, used_block_ids=used)
            get_logger().info("tp_shards_reclaimed", pages=result.pages_mapped, kv_blocks=result.new_num_blocks,
                              fill_s=round(result.fill_seconds, 4))
        return self.layout.weights()

    def _keep(self, rank: int, degree: int) -> range:
        return shards_of(rank, degree, self.layout.shard_count)

    def close(self) -> None:
        self.engine.release_weights()
        self.layout.close()
        self.pool.close()

