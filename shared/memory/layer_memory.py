"""Weights and paged KV cache of one worker's layer range, in one page pool (KunServe §4.1).

A worker holds the contiguous layer range [start, end) of a model. `LayerMemoryLayout` places in
the pool:

- the weights of each held layer in a **weight arena**: the layer's tensors packed (256-byte
  aligned) into one virtual range padded to whole pages, so dropping a layer frees whole pages
  (Gyges pads to the page size for the same reason);
- the non-layer weights (embeddings, final norm, lm_head) as **weight groups**, each in its own
  arena; a group is held while the range touches the model end it belongs to (`held_with`);
- the KV cache of each held layer as **one virtual range reserved at the size of the whole pool**,
  with pages mapped only at its head. Blocks lie in it header-centric, `[num_kv_heads, 2, block_size, head_dim]`
  (one head's K and V adjacent: kv_layout.py, Gyges §4.1); kernels see one static tensor per layer,
  `[num_blocks, 2, num_kv_heads, block_size, head_dim]` (FlashInfer HND, K then V per block), a permuted view.

Capacity rule. Every held layer gets the same number of KV pages,
``k = (total_pages - weight_pages) // held_layers``, and
``num_blocks = k * page_size // block_bytes``. The remainder,
``(total_pages - weight_pages) % held_layers`` pages, stays free as *spare pages* (their RAM is
released on the host) and is used by the next drop. Blocks may straddle page boundaries: the
mapped head of a KV range is virtually contiguous, so only the bytes past the last whole block
(`k*page_size % block_bytes`) go unused. With a page size that is a multiple of the block size
(2 MiB pages, 64 KiB blocks for Qwen2.5-14B bf16 with 16-token blocks) nothing is wasted.

Drop moves no KV byte: the dropped layers' pages (weights and KV) are unmapped and mapped at the
tails of the remaining layers' KV ranges, whose existing pages and base addresses do not change.
Per remaining layer the KV grows by ``(freed_pages + spare_pages) // remaining_layers`` pages, i.e.
by exactly ``freed_bytes // (block_bytes * remaining_layers)`` blocks when the page size is a
multiple of the block size and the pages divide evenly; otherwise the per-page rounding above
applies and the leftover pages stay spare.

Restore takes pages back from the KV tails. Blocks at or beyond the smaller `num_blocks` must be
free; when some are in use the caller compacts first (`plan_compaction` + `apply_compaction`, then
rewrites its block tables). A block allocator that hands out low block ids first keeps the tail
free and makes compaction rare.

Contract with the engine (views): every tensor handed out (`layer_cache`, `layer_weights`,
`group_weights`) is a view that the pool tracks. After any `drop_layers` / `restore_layers`
(`generation` changes) re-fetch `layer_cache(layer)` and `num_blocks`; before dropping layers,
release every reference to their weights and KV tensors. A remap that would unmap pages under a
live view raises ViewStillAliveError and changes nothing, instead of leaving a view that would
kill the process on touch. The layout is not thread-safe: pause the step loop around remaps.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from . import kv_head_split, kv_layout
from .errors import KVCapacityError, LayerRangeError, OutOfPagesError, WeightSourceError
from .pool import PagePool, VirtualRange

TENSOR_ALIGN = 256  # bytes: what CUDA kernels and vector loads want for every weight tensor

HeldWith = Literal["always", "first", "last", "ends"]
WeightSource = Callable[[str], torch.Tensor] | Mapping[str, torch.Tensor]


# ---------------------------------------------------------------------- specs
@dataclass(frozen=True)
class TensorSpec:
    """One weight tensor: its full name (the key a weight source answers to), shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    # > 0: dim 0 is this many shards, each starting on a page boundary in the arena (Gyges §4.2's padding: a
    # tensor-parallel member keeps some shards and the others' pages are released in place, `release_shards`)
    page_shards: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if self.page_shards < 0 or (self.page_shards and (not self.shape or self.shape[0] != self.page_shards)):
            raise ValueError(f"{self.name}: page_shards {self.page_shards} must be 0 or the size of dim 0 of "
                             f"{self.shape}")

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _itemsize(self.dtype)

    @property
    def shard_bytes(self) -> int:
        """Bytes of one shard (dim 0's index) of a sharded tensor."""
        return self.nbytes // max(self.page_shards, 1)

    def shard_stride(self, page_size: int) -> int:
        """Bytes from one shard's start to the next's: a shard rounded up to whole pages."""
        return -(-self.shard_bytes // page_size) * page_size


@dataclass(frozen=True)
class WeightGroupSpec:
    """Non-layer weights kept together in their own pages.

    `held_with` says when a worker needs them: "first" while it holds layer 0 (embeddings),
    "last" while it holds the last layer (final norm, lm_head), "ends" while it holds either (tied
    embeddings), "always" whatever it holds.
    """

    name: str
    tensors: tuple[TensorSpec, ...]
    held_with: HeldWith = "always"

    def held_for(self, start: int, end: int, num_layers_model: int) -> bool:
        first, last = start == 0, end == num_layers_model
        return {"always": True, "first": first, "last": last, "ends": first or last}[self.held_with]


@dataclass(frozen=True)
class KVCacheSpec:
    """One KV block: the kernels see `[2, num_kv_heads, block_size, head_dim]` of `dtype` (`block_shape`); in memory
    it is `[num_kv_heads, 2, block_size, head_dim]` (`physical_block_shape`, header-centric: kv_layout.py)."""

    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for f in ("num_kv_heads", "head_dim", "block_size"):
            if getattr(self, f) <= 0:
                raise ValueError(f"KVCacheSpec.{f} must be > 0, got {getattr(self, f)}")

    @property
    def block_shape(self) -> tuple[int, int, int, int]:
        return (2, self.num_kv_heads, self.block_size, self.head_dim)

    @property
    def physical_block_shape(self) -> tuple[int, int, int, int]:
        return kv_layout.physical_block_shape(self.num_kv_heads, self.block_size, self.head_dim)

    @property
    def head_bytes(self) -> int:
        """Bytes of one head's K and V in a block: the contiguous unit a head split keeps or moves."""
        return 2 * self.block_size * self.head_dim * _itemsize(self.dtype)

    @property
    def block_bytes(self) -> int:
        return 2 * self.num_kv_heads * self.block_size * self.head_dim * _itemsize(self.dtype)


@dataclass(frozen=True)
class CapacityPlan:
    """What a layer range gets from a pool: see the capacity rule in the module docstring."""

    layer_start: int
    layer_end: int
    weight_pages: int
    kv_pages_per_layer: int
    num_blocks: int
    spare_pages: int

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start


@dataclass(frozen=True)
class RemapResult:
    """What a drop or restore (or a TP member's shard release or reclaim) did; `seconds` is the remap itself,
    `fill_seconds` the weight copy."""

    op: Literal["drop", "restore", "release", "reclaim"]
    layers: tuple[int, ...]
    layer_start: int
    layer_end: int
    old_num_blocks: int
    new_num_blocks: int
    pages_unmapped: int
    pages_mapped: int
    spare_pages: int
    generation: int
    seconds: float
    fill_seconds: float = 0.0


@dataclass(frozen=True)
class HeadSplitResult:
    """What `split_kv_heads` did: the KV ranges read at `1/degree` of the heads per block, no page touched.

    Pages are read from the pool before and after (per layer KV range; pool-wide mapped and unmapped), so a split
    that touched a page would show it; `kv_pages_before == kv_pages_after` and no page mapped or unmapped. With a plan,
    `staging_bytes` is the extra memory the exchange needs per layer (one phase's staging) and `kv_major` what the
    K/V-major layout would need for the same merge (reserved pages for every received sub-block, and a trim copy
    of the kept heads)."""

    degree: int
    old_num_blocks: int
    new_num_blocks: int
    old_block_bytes: int
    new_block_bytes: int
    kv_pages_before: int
    kv_pages_after: int
    pages_mapped: int
    pages_unmapped: int
    generation: int
    staging_bytes: int = 0
    kv_major: kv_head_split.SplitCost | None = None


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def pack_tensors(specs: Sequence[TensorSpec], align: int = TENSOR_ALIGN,
                 page_size: int | None = None) -> tuple[list[int], int]:
    """Byte offsets of `specs` packed in order, each aligned to `align` (a sharded one's shards each to a page
    boundary of `page_size`, one `shard_stride` apart); and the total size."""
    offsets: list[int] = []
    pos = 0
    for s in specs:
        if s.page_shards:
            if not page_size:
                raise ValueError(f"{s.name} is page-sharded: packing it needs the page size")
            pos = -(-pos // page_size) * page_size
            offsets.append(pos)
            pos += s.shard_stride(page_size) * s.page_shards
            continue
        pos = -(-pos // align) * align
        offsets.append(pos)
        pos += s.nbytes
    return offsets, pos


def arena_pages(specs: Sequence[TensorSpec], page_size: int) -> int:
    """Whole pages the packed `specs` occupy (0 for no bytes)."""
    _, total = pack_tensors(specs, page_size=page_size)
    return -(-total // page_size)


def kv_capacity(total_pages: int, weight_pages: int, num_layers: int, page_size: int, block_bytes: int,
                layer_start: int = 0) -> CapacityPlan:
    """The capacity rule as pure arithmetic (used by the layout, the planner and bench/remap.py)."""
    if num_layers <= 0:
        raise ValueError(f"num_layers must be > 0, got {num_layers}")
    left = total_pages - weight_pages
    k = max(left, 0) // num_layers
    return CapacityPlan(layer_start, layer_start + num_layers, weight_pages, k, k * page_size // block_bytes,
                        max(left, 0) - k * num_layers)


def plan_compaction(used_block_ids: Iterable[int], new_num_blocks: int) -> dict[int, int]:
    """Move every used block id >= `new_num_blocks` to the lowest free id below it.

    Returns {old_id: new_id} (empty when nothing needs to move). Raises KVCapacityError when more
    blocks are used than `new_num_blocks` can hold.
    """
    used = sorted(set(int(b) for b in used_block_ids))
    if any(b < 0 for b in used):
        raise ValueError(f"negative block id in {used[:5]}")
    if len(used) > new_num_blocks:
        raise KVCapacityError(
            f"{len(used)} KV blocks are in use but only {new_num_blocks} would remain: free or move KV first",
            used_blocks=len(used), new_num_blocks=new_num_blocks, needs_compaction=False)
    movers = [b for b in used if b >= new_num_blocks]
    if not movers:
        return {}
    used_low = set(b for b in used if b < new_num_blocks)
    targets = (b for b in range(new_num_blocks) if b not in used_low)
    return {old: next(targets) for old in movers}


# ---------------------------------------------------------------------- arenas
@dataclass(eq=False)
class _Arena:
    """The pages of one layer's (or group's) weights: one virtual range, fully mapped."""

    key: str
    specs: tuple[TensorSpec, ...]
    offsets: list[int]
    vr: VirtualRange
    cache: dict[str, torch.Tensor] | None = field(default=None, repr=False)

    @property
    def num_pages(self) -> int:
        return self.vr.num_slots


# ---------------------------------------------------------------------- the layout
class LayerMemoryLayout:
    """Weights and KV cache of the layer range [layer_start, layer_end) of one worker, in `pool`.

    `layer_specs(layer)` lists the weight tensors of a layer (full names, e.g.
    "layers.3.mlp.up_proj.weight"); it is called for held layers and for layers being restored, so
    it must answer for every layer of the model. `groups` are the non-layer weights. The layout
    assumes it is the pool's only user. See the module docstring for the capacity rule and the
    view contract.
    """

    def __init__(self, pool: PagePool, *, num_layers_model: int, layer_start: int, layer_end: int,
                 layer_specs: Callable[[int], Sequence[TensorSpec]], kv: KVCacheSpec,
                 groups: Sequence[WeightGroupSpec] = (), weight_source: WeightSource | None = None,
                 discard_spare: bool = True) -> None:
        if num_layers_model <= 0:
            raise ValueError(f"num_layers_model must be > 0, got {num_layers_model}")
        if not (0 <= layer_start < layer_end <= num_layers_model):
            raise LayerRangeError(f"layer range [{layer_start}, {layer_end}) is empty or outside the model's "
                                  f"[0, {num_layers_model})", range(layer_start, layer_end))
        names = [g.name for g in groups]
        empty = [g.name for g in groups if sum(t.nbytes for t in g.tensors) == 0]
        if empty:
            raise ValueError(f"weight groups without bytes: {empty}")
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate weight group names: {names}")
        self.pool = pool
        self.num_layers_model = num_layers_model
        self.kv_spec = kv
        self.layer_specs = layer_specs
        self.groups = {g.name: g for g in groups}
        self.discard_spare = discard_spare
        self._start, self._end = layer_start, layer_end
        self._weights: dict[int, _Arena] = {}
        self._group_arenas: dict[str, _Arena] = {}
        self._kv: dict[int, VirtualRange] = {}
        self._kv_cache: dict[int, torch.Tensor] = {}
        self._spec_cache: dict[int, tuple[TensorSpec, ...]] = {}
        self._k = 0
        self._released: range | None = None  # the shards kept while the others' pages are released
        counts = {s.page_shards for x in range(num_layers_model) for s in self._specs(x) if s.page_shards}
        if len(counts) > 1:
            raise ValueError(f"page-sharded tensors split into different shard counts {sorted(counts)}")
        self.shard_count = counts.pop() if counts else 0  # shards of the page-sharded tensors (0: none)
        self.generation = 0

        plan = self._plan(layer_start, layer_end)
        self._check_plan(plan, "place the layer range")
        try:
            for name in self._groups_for(layer_start, layer_end):
                self._group_arenas[name] = self._make_arena(f"group:{name}", self.groups[name].tensors)
            for layer in range(layer_start, layer_end):
                self._make_layer(layer, plan.kv_pages_per_layer)
        except BaseException:
            self._teardown()
            raise
        self._k = plan.kv_pages_per_layer
        self._after_remap()
        if weight_source is not None:
            self.load_weights(weight_source)

    # ------------------------------------------------------------------ state
    @property
    def layer_start(self) -> int:
        return self._start

    @property
    def layer_end(self) -> int:
        return self._end

    @property
    def layers(self) -> range:
        return range(self._start, self._end)

    @property
    def num_blocks(self) -> int:
        """KV blocks per layer (the same for every held layer)."""
        return self._k * self.pool.page_size // self.kv_spec.block_bytes

    @property
    def block_size(self) -> int:
        return self.kv_spec.block_size

    @property
    def block_bytes(self) -> int:
        return self.kv_spec.block_bytes

    @property
    def kv_pages_per_layer(self) -> int:
        return self._k

    @property
    def spare_pages(self) -> int:
        return self.pool.free_count

    @property
    def weight_pages(self) -> int:
        """Pages mapped under weights (released shards' pages are not)."""
        return sum(a.vr.mapped_count() for a in self._arenas())

    @property
    def held_groups(self) -> list[str]:
        return list(self._group_arenas)

    def _arenas(self) -> list[_Arena]:
        return list(self._group_arenas.values()) + [self._weights[layer] for layer in sorted(self._weights)]

    def _specs(self, layer: int) -> tuple[TensorSpec, ...]:
        if layer not in self._spec_cache:
            self._spec_cache[layer] = tuple(self.layer_specs(layer))
        return self._spec_cache[layer]

    def _groups_for(self, start: int, end: int) -> list[str]:
        return [n for n, g in self.groups.items() if g.held_for(start, end, self.num_layers_model)]

    def _plan(self, start: int, end: int, released: int = 0) -> CapacityPlan:
        """The capacity rule for [start, end) with `released` of its weight pages unmapped (released shards)."""
        P = self.pool.page_size
        w = sum(arena_pages(self._specs(layer), P) for layer in range(start, end))
        w += sum(arena_pages(self.groups[n].tensors, P) for n in self._groups_for(start, end))
        return kv_capacity(self.pool.num_pages, w - released, end - start, P, self.kv_spec.block_bytes, start)

    def _check_plan(self, plan: CapacityPlan, what: str) -> None:
        if plan.num_blocks < 1:
            raise OutOfPagesError(
                f"cannot {what} [{plan.layer_start}, {plan.layer_end}): the pool has {self.pool.num_pages} pages "
                f"of {self.pool.page_size} bytes, weights need {plan.weight_pages}, which leaves less than one "
                f"{self.kv_spec.block_bytes}-byte KV block per layer")

    # ------------------------------------------------------------------ views
    @property
    def kv_heads_per_block(self) -> int:
        return self.kv_spec.num_kv_heads

    def layer_cache(self, layer: int) -> torch.Tensor:
        """KV tensor of a held layer: `[num_blocks, 2, num_kv_heads, block_size, head_dim]`.

        Zero-copy over the mapped head of the layer's KV range, a permuted view of the header-centric
        blocks (`kv_layout.logical_view`); its `data_ptr()` never changes while the layer is held.
        Re-fetch after every remap (`generation`): a tensor kept from before a restore would block the
        restore (ViewStillAliveError).
        """
        vr = self._kv_range(layer)
        t = self._kv_cache.get(layer)
        if t is None:
            shape = (self.num_blocks, *self.kv_spec.physical_block_shape)
            t = kv_layout.logical_view(self.pool.view(vr, 0, shape, self.kv_spec.dtype))
            self._kv_cache[layer] = t
        return t

    def kv_data_ptr(self, layer: int) -> int:
        """Base address of a layer's KV range (stable while the layer is held)."""
        return self._kv_range(layer).base

    def layer_weights(self, layer: int) -> dict[str, torch.Tensor]:
        """Zero-copy views of a held layer's weights, by full name. Release them before dropping it."""
        if layer not in self._weights:
            if self._start <= layer < self._end:
                return {}  # a layer with no weight tensors
            raise LayerRangeError(f"layer {layer} is not held (held: [{self._start}, {self._end}))", [layer],
                                  "FAILED_PRECONDITION")
        return dict(self._arena_views(self._weights[layer]))

    def group_weights(self, name: str) -> dict[str, torch.Tensor]:
        """Zero-copy views of a held weight group (e.g. "embed", "head"), by full tensor name."""
        if name not in self._group_arenas:
            known = "held" if name in self.groups else "unknown"
            raise KeyError(f"weight group {name!r} is {known} not held on layers [{self._start}, {self._end})")
        return dict(self._arena_views(self._group_arenas[name]))

    def weights(self) -> dict[str, torch.Tensor]:
        """Every held weight tensor by full name (groups and layers)."""
        out: dict[str, torch.Tensor] = {}
        for a in self._arenas():
            out.update(self._arena_views(a))
        return out

    def release_views(self) -> None:
        """Drop the layout's own cached views (it does so itself before every remap)."""
        self._kv_cache.clear()
        for a in self._arenas():
            a.cache = None

    def _arena_views(self, a: _Arena) -> dict[str, torch.Tensor]:
        if a.cache is None:
            a.cache = {s.name: self._spec_view(a, s, off) for s, off in zip(a.specs, a.offsets)}
        return a.cache

    def _spec_view(self, a: _Arena, s: TensorSpec, off: int, shards: range | None = None) -> torch.Tensor:
        """`s`'s tensor; a sharded one's as `[len(shards), *shape[1:]]` over those shards (default: the ones mapped),
        one `shard_stride` apart: the view covers only their pages, so the others can be unmapped under it."""
        if not s.page_shards:
            return self.pool.view(a.vr, off, s.shape, s.dtype)
        shards = self.kept_shards if shards is None else shards
        stride = s.shard_stride(self.pool.page_size) // _itemsize(s.dtype)
        unit = s.shape[1:]
        flat = self.pool.view(a.vr, off + shards.start * stride * _itemsize(s.dtype),
                              ((len(shards) - 1) * stride + math.prod(unit),), s.dtype)
        return flat.as_strided((len(shards), *unit), (stride, *torch.empty(unit, device="meta").stride()))

    def _sharded(self) -> list[tuple[_Arena, TensorSpec, int]]:
        """Every held layer's page-sharded tensors, with their arena and offset."""
        return [(a, s, off) for x in sorted(self._weights) for a in (self._weights[x],)
                for s, off in zip(a.specs, a.offsets) if s.page_shards]

    def _kv_range(self, layer: int) -> VirtualRange:
        vr = self._kv.get(layer)
        if vr is None:
            raise LayerRangeError(f"layer {layer} is not held (held: [{self._start}, {self._end}))", [layer],
                                  "FAILED_PRECONDITION")
        return vr

    # ------------------------------------------------------------------ weights
    def load_weights(self, source: WeightSource, layers: Iterable[int] | None = None,
                     groups: Iterable[str] | None = None) -> float:
        """Copy weights from `source` (name -> tensor) into the arenas; returns seconds spent.

        Defaults to every held layer and group. Shapes must match exactly; dtypes are converted.
        """
        self._check_whole_weights("load weights")
        t0 = time.perf_counter()
        arenas: list[_Arena] = []
        for g in (self._group_arenas if groups is None else groups):
            if g not in self._group_arenas:
                raise KeyError(f"weight group {g!r} is not held")
            arenas.append(self._group_arenas[g])
        for layer in (self.layers if layers is None else layers):
            if not (self._start <= layer < self._end):
                raise LayerRangeError(f"layer {layer} is not held", [layer], "FAILED_PRECONDITION")
            if layer in self._weights:
                arenas.append(self._weights[layer])
        get = source.__getitem__ if isinstance(source, Mapping) else source
        for a in arenas:
            self._fill_arena(a, get)
        return time.perf_counter() - t0

    def _fill_arena(self, a: _Arena, get: Callable[[str], torch.Tensor]) -> None:
        views: dict[str, torch.Tensor] | None = self._arena_views(a)
        try:
            with torch.no_grad():
                for s in a.specs:
                    try:
                        src = get(s.name)
                    except KeyError as e:
                        raise WeightSourceError(s.name, "missing from the weight source") from e
                    if not isinstance(src, torch.Tensor):
                        raise WeightSourceError(s.name, f"weight source returned {type(src).__name__}, not a tensor")
                    if tuple(src.shape) != s.shape:
                        raise WeightSourceError(s.name, f"shape {tuple(src.shape)} != expected {s.shape}")
                    assert views is not None
                    views[s.name].copy_(src)
        finally:
            # A traceback keeps this frame alive; it must not pin views a rollback has to unmap.
            views = None
            a.cache = None

    def arena_bytes(self, key: str) -> torch.Tensor:
        """A held arena's packed bytes as one flat uint8 view (key: a layer number, or "group:<name>").

        Two layouts of the same model pack an arena identically, so these bytes are what a peer restoring the
        arena needs, and what it receives straight into (``restore_layers`` with no weight source). The view
        pins the arena's pages like any other: drop it before the arena's layer is dropped."""
        return self.pool.view(self._arena(key).vr, 0, (self.arena_nbytes(key),), torch.uint8)

    def arena_nbytes(self, key: str) -> int:
        """The packed size of a held arena (what ``arena_bytes`` spans)."""
        _, total = pack_tensors(self._arena(key).specs, page_size=self.pool.page_size)
        return total

    def restore_arenas(self, held: tuple[int, int], target: tuple[int, int], piece: tuple[int, int]) -> list[str]:
        """The arena keys a worker holding `held` and going to `target` gets with the layers `piece` (part of
        what it gains): the piece's layers, plus the weight groups `target` needs and `held` lacks that travel
        with the piece's ends, so that sender and receiver agree on them (first-layer groups with layer 0,
        last-layer ones with the last layer; one needed with either end with layer 0 when it is gained)."""
        last = self.num_layers_model - 1
        lo, hi = piece
        keys: list[str] = []
        for g in self.groups.values():
            if g.held_for(*held, self.num_layers_model) or not g.held_for(*target, self.num_layers_model):
                continue
            with_first = lo == 0 and g.held_for(0, 1, self.num_layers_model)
            with_last = hi == last + 1 and g.held_for(last, last + 1, self.num_layers_model) and not (
                target[0] == 0 and held[0] != 0 and g.held_with == "ends")
            if with_first or with_last:
                keys.append(f"group:{g.name}")
        specs = [x for x in range(lo, hi) if sum(s.nbytes for s in self._specs(x)) > 0]
        return keys + [str(x) for x in specs]

    def fill_arena(self, key: str, data: torch.Tensor) -> None:
        """Copy an arena's packed bytes (``arena_bytes`` of a peer's layout) into this one."""
        view = self.arena_bytes(key)
        try:
            flat = data.reshape(-1).view(torch.uint8)
            if flat.numel() != view.numel():
                raise WeightSourceError(key, f"{flat.numel()} bytes received, the arena packs {view.numel()}")
            with torch.no_grad():
                view.copy_(flat)
        finally:
            del view

    def _arena(self, key: str) -> _Arena:
        if key.startswith("group:"):
            a = self._group_arenas.get(key.removeprefix("group:"))
        else:
            a = self._weights.get(int(key)) if key.lstrip("-").isdigit() else None
        if a is None:
            raise KeyError(f"no weight arena {key!r} is held on layers [{self._start}, {self._end})")
        return a

    def host_copy(self, layers: Iterable[int] | None = None, groups: bool = True) -> dict[str, torch.Tensor]:
        """CPU clones of held weights by name: a weight source for a later `restore_layers`."""
        out: dict[str, torch.Tensor] = {}
        arenas = list(self._group_arenas.values()) if groups else []
        arenas += [self._weights[layer] for layer in (self.layers if layers is None else layers)
                   if layer in self._weights]
        for a in arenas:
            for name, v in self._arena_views(a).items():
                out[name] = v.detach().to("cpu", copy=True)
            a.cache = None
        return out

    # ------------------------------------------------------------------ validation
    def _normalize(self, layers: Iterable[int]) -> list[int]:
        ls = [int(x) for x in layers]
        if not ls:
            raise LayerRangeError("no layers given", [])
        if len(set(ls)) != len(ls):
            dups = sorted({x for x in ls if ls.count(x) > 1})
            raise LayerRangeError("duplicate layers", dups)
        outside = [x for x in ls if not (0 <= x < self.num_layers_model)]
        if outside:
            raise LayerRangeError(f"outside the model's layers [0, {self.num_layers_model})", outside)
        return sorted(ls)

    def _drop_target(self, layers: Iterable[int]) -> tuple[list[int], int, int]:
        self._check_whole_weights("drop layers")
        ls = self._normalize(layers)
        held = set(self.layers)
        missing = [x for x in ls if x not in held]
        if missing:
            raise LayerRangeError(f"not held by this worker (held: [{self._start}, {self._end}))", missing,
                                  "FAILED_PRECONDITION")
        remaining = [x for x in self.layers if x not in set(ls)]
        if not remaining:
            raise LayerRangeError("would drop every held layer; a worker keeps at least one", ls,
                                  "FAILED_PRECONDITION")
        if remaining[-1] - remaining[0] + 1 != len(remaining):
            raise LayerRangeError(f"must be a prefix and/or suffix of the held range [{self._start}, {self._end}): "
                                  f"the remaining layers would not be contiguous", ls, "FAILED_PRECONDITION")
        return ls, remaining[0], remaining[-1] + 1

    def _restore_target(self, layers: Iterable[int]) -> tuple[list[int], int, int]:
        self._check_whole_weights("restore layers")
        ls = self._normalize(layers)
        held = [x for x in ls if self._start <= x < self._end]
        if held:
            raise LayerRangeError(f"already held (held: [{self._start}, {self._end}))", held, "FAILED_PRECONDITION")
        new_start, new_end = min(ls[0], self._start), max(ls[-1] + 1, self._end)
        if new_end - new_start != len(ls) + (self._end - self._start):
            raise LayerRangeError(f"must extend the held range [{self._start}, {self._end}) contiguously "
                                  f"(adjacent prefix and/or suffix)", ls, "FAILED_PRECONDITION")
        return ls, new_start, new_end

    def plan_drop(self, layers: Iterable[int]) -> CapacityPlan:
        """Validate a drop and return the capacity it would give (nothing changes)."""
        _, s, e = self._drop_target(layers)
        return self._plan(s, e)

    def plan_restore(self, layers: Iterable[int]) -> CapacityPlan:
        """Validate a restore and return the capacity left after it (nothing changes)."""
        _, s, e = self._restore_target(layers)
        plan = self._plan(s, e)
        self._check_plan(plan, "restore to")
        return plan

    # ------------------------------------------------------------------ drop
    def drop_layers(self, layers: Iterable[int]) -> RemapResult:
        """Free the weights and KV of `layers` and remap their pages into the remaining KV tails.

        `layers` must leave a contiguous, non-empty range (a prefix and/or suffix of the held
        range). Weight groups no longer needed (e.g. embeddings when layer 0 goes) are freed too.
        The remaining layers' KV pages stay where they are: no KV byte moves, and their KV
        tensors keep their data_ptr. Raises LayerRangeError or ViewStillAliveError with nothing
        changed.
        """
        ls, new_start, new_end = self._drop_target(layers)
        plan = self._plan(new_start, new_end)
        t0 = time.perf_counter()
        old_blocks = self.num_blocks
        gone_groups = [n for n in self._group_arenas if n not in self._groups_for(new_start, new_end)]
        out_ranges: list[VirtualRange] = [self._kv[x] for x in ls]
        out_ranges += [self._weights[x].vr for x in ls if x in self._weights]
        out_ranges += [self._group_arenas[n].vr for n in gone_groups]
        self.release_views()
        self.pool.ensure_no_views((vr, 0, vr.num_slots) for vr in out_ranges)

        unmapped = 0
        for x in ls:
            if x in self._weights:
                unmapped += len(self.pool.free_range(self._weights.pop(x).vr))
            unmapped += len(self.pool.free_range(self._kv.pop(x)))
        for n in gone_groups:
            unmapped += len(self.pool.free_range(self._group_arenas.pop(n).vr))
        self._start, self._end = new_start, new_end
        assert plan.kv_pages_per_layer >= self._k
        mapped = self._resize_kv(plan.kv_pages_per_layer)
        self._after_remap()
        return RemapResult("drop", tuple(ls), new_start, new_end, old_blocks, self.num_blocks, unmapped, mapped,
                           self.pool.free_count, self.generation, time.perf_counter() - t0)

    # ------------------------------------------------------------------ restore
    def restore_layers(self, layers: Iterable[int], weight_source: WeightSource | None, *,
                       used_block_ids: Collection[int]) -> RemapResult:
        """Take pages back from the KV tails, re-create `layers`, fill their weights from `weight_source`.

        `used_block_ids` are the KV blocks the allocator has handed out (required, pass `()` when
        none: forgetting them would unmap live KV, and GPU kernels do not bounds-check block ids);
        every one must be below the new `num_blocks` (see `plan_restore`), else KVCapacityError
        (compact first, or free KV). The restored layers' KV starts empty; their weights (and weight groups that become
        needed) come from `weight_source` (name -> tensor, e.g. `host_copy()` or a checkpoint
        reader). If filling fails, the restore is rolled back and the error re-raised. With no
        `weight_source` the new arenas are left unfilled: the caller fills every one of them
        (`fill_arena` with a peer's bytes, `load_weights`) before anything computes on them.
        """
        ls, new_start, new_end = self._restore_target(layers)
        plan = self._plan(new_start, new_end)
        self._check_plan(plan, "restore to")
        old_blocks = self.num_blocks
        used = set(int(b) for b in used_block_ids)
        bad = sorted(b for b in used if not (0 <= b < old_blocks))
        if bad:
            raise ValueError(f"used block ids outside [0, {old_blocks}): {bad[:8]}")
        if len(used) > plan.num_blocks:
            raise KVCapacityError(
                f"restoring layers {ls} leaves {plan.num_blocks} KV blocks per layer but {len(used)} are in use: "
                f"free or move KV first", used_blocks=len(used), new_num_blocks=plan.num_blocks,
                needs_compaction=False)
        beyond = sorted(b for b in used if b >= plan.num_blocks)
        if beyond:
            raise KVCapacityError(
                f"restoring layers {ls} shrinks the KV cache to {plan.num_blocks} blocks but blocks {beyond[:8]}"
                f"{'...' if len(beyond) > 8 else ''} beyond it are in use: call plan_compaction / apply_compaction "
                f"and rewrite the block tables first", used_blocks=len(used), new_num_blocks=plan.num_blocks,
                needs_compaction=True)

        t0 = time.perf_counter()
        k_new = plan.kv_pages_per_layer
        self.release_views()
        self.pool.ensure_no_views((self._kv[x], k_new, self._k) for x in self.layers)
        unmapped = self._resize_kv(k_new) if k_new < self._k else 0
        new_groups = [n for n in self._groups_for(new_start, new_end) if n not in self._group_arenas]
        mapped = 0
        for n in new_groups:
            self._group_arenas[n] = self._make_arena(f"group:{n}", self.groups[n].tensors)
            mapped += self._group_arenas[n].num_pages
        for x in ls:
            mapped += self._make_layer(x, k_new)
        self._start, self._end = new_start, new_end
        self._after_remap()
        seconds = time.perf_counter() - t0
        if weight_source is None:
            return RemapResult("restore", tuple(ls), new_start, new_end, old_blocks, self.num_blocks, unmapped, mapped,
                               self.pool.free_count, self.generation, seconds)
        try:
            fill = self.load_weights(weight_source, layers=ls, groups=new_groups)
        except BaseException:
            self._rollback_restore(ls, new_groups)
            raise
        return RemapResult("restore", tuple(ls), new_start, new_end, old_blocks, self.num_blocks, unmapped, mapped,
                           self.pool.free_count, self.generation, seconds, fill)

    def _rollback_restore(self, ls: list[int], new_groups: list[str]) -> None:
        remaining = [x for x in self.layers if x not in set(ls)]
        self.release_views()
        for x in ls:
            if x in self._weights:
                self.pool.free_range(self._weights.pop(x).vr)
            self.pool.free_range(self._kv.pop(x))
        for n in new_groups:
            self.pool.free_range(self._group_arenas.pop(n).vr)
        self._start, self._end = remaining[0], remaining[-1] + 1
        self._resize_kv(self._plan(self._start, self._end).kv_pages_per_layer)
        self._after_remap()

    # ------------------------------------------------------------------ compaction
    def plan_compaction(self, used_block_ids: Iterable[int], new_num_blocks: int) -> dict[int, int]:
        """{old_id: new_id} moving used blocks below `new_num_blocks` (see module-level plan_compaction)."""
        used = list(used_block_ids)
        bad = [b for b in used if not (0 <= int(b) < self.num_blocks)]
        if bad:
            raise ValueError(f"used block ids outside [0, {self.num_blocks}): {bad[:8]}")
        return plan_compaction(used, new_num_blocks)

    def apply_compaction(self, mapping: Mapping[int, int]) -> None:
        """Copy KV block `old` to `new` for every pair, in every held layer, all at once.

        All sources are read before any destination is written, so chains are safe. Destinations
        must be distinct and should be free blocks: the layout does not know which blocks are
        live. The caller rewrites its block tables with the same mapping afterwards.
        """
        if not mapping:
            return
        src = [int(k) for k in mapping]
        dst = [int(v) for v in mapping.values()]
        nb = self.num_blocks
        bad = [b for b in src + dst if not (0 <= b < nb)]
        if bad:
            raise ValueError(f"block ids outside [0, {nb}): {bad[:8]}")
        if len(set(dst)) != len(dst):
            raise ValueError("two blocks would be moved to the same destination")
        with torch.no_grad():
            kv_layout.move_blocks((self.layer_cache(x) for x in self.layers), src, dst)

    # ------------------------------------------------------------------ tensor-parallel head split
    def split_kv_heads(self, degree: int, plan: kv_head_split.HeadSplitPlan | None = None) -> HeadSplitResult:
        """Read every held layer's KV range at `num_kv_heads / degree` heads per block, in place (Gyges §4.1.2).

        The header-centric block (`kv_layout.py`) makes the heads of rank r of block b one byte range, which is
        sub-block `b * degree + r` of the range read at the smaller block size: no page is mapped, unmapped or
        copied, the base addresses stay, and `num_blocks` becomes at least `degree` times larger (sub-blocks of
        `1/degree` the bytes; a tail too short for a whole block may now hold sub-blocks). Moving the heads
        between members (`kv_head_split.plan_head_split`) is the caller's; give its `plan` to have its staging and
        the K/V-major baseline reported. Re-fetch `layer_cache` afterwards (`generation` changes)."""
        spec = self.kv_spec
        if degree < 2 or spec.num_kv_heads % degree:
            raise ValueError(f"degree {degree}: a head split needs a degree >= 2 that divides the {spec.num_kv_heads} "
                             "KV heads per block")
        old_blocks = self.num_blocks
        if plan is not None and (plan.degree != degree or plan.num_blocks != old_blocks
                                 or plan.num_kv_heads != spec.num_kv_heads):
            raise ValueError(f"the plan is for degree {plan.degree}, {plan.num_blocks} blocks of {plan.num_kv_heads} "
                             f"heads; this layout has {old_blocks} blocks of {spec.num_kv_heads} heads (degree {degree})")
        pages_before, pool_mapped_before = self._kv_pages_mapped(), self.pool.mapped_count
        self.kv_spec = dataclasses.replace(spec, num_kv_heads=spec.num_kv_heads // degree)
        self._kv_cache.clear()
        self.generation += 1
        staging, baseline = 0, None
        if plan is not None:
            staging = kv_head_split.header_centric_split_cost(plan, spec.block_bytes).extra_bytes
            baseline = kv_head_split.kv_major_split_cost([list(m) for m in plan.block_maps], spec.num_kv_heads,
                                                         spec.block_bytes, self.pool.page_size)
        pool_mapped_after = self.pool.mapped_count
        return HeadSplitResult(degree, old_blocks, self.num_blocks, spec.block_bytes, self.kv_spec.block_bytes,
                               pages_before, self._kv_pages_mapped(), max(0, pool_mapped_after - pool_mapped_before),
                               max(0, pool_mapped_before - pool_mapped_after), self.generation, staging, baseline)

    def merge_kv_heads(self, degree: int) -> int:
        """The inverse of `split_kv_heads` (a TP`degree` -> TP1 scale-down): read every held layer's KV range at
        `num_kv_heads * degree` heads per block, in place; sub-blocks `b * degree + r` become whole block b again.
        Gathering the heads of the kept blocks first is the caller's (`kv_head_split.plan_head_gather`,
        `kv_layout.apply_sub_block_moves`). `num_blocks` follows the block size: sub-blocks at the tail that do not
        fill a whole block are no longer addressable. Returns the new `num_blocks`; re-fetch `layer_cache`
        afterwards (`generation` changes)."""
        if degree < 2:
            raise ValueError(f"degree {degree}: a head merge needs a degree >= 2")
        self.kv_spec = dataclasses.replace(self.kv_spec, num_kv_heads=self.kv_spec.num_kv_heads * degree)
        self._kv_cache.clear()
        self.generation += 1
        return self.num_blocks

    def _kv_pages_mapped(self) -> int:
        """Pages mapped under one held layer's KV range, read from the range itself (every layer has as many)."""
        return max((vr.mapped_count() for vr in self._kv.values()), default=0)

    # ------------------------------------------------------------------ tensor-parallel weight shards
    @property
    def kept_shards(self) -> range:
        """The shards whose pages are mapped: all of them unless `release_shards` gave the others' away."""
        return self._released if self._released is not None else range(self.shard_count)

    def shard_views(self, keep: range) -> dict[str, torch.Tensor]:
        """Every held page-sharded tensor over the shards `keep` only (`[len(keep), ...]`): what a tensor-parallel
        member computes on, taken before `release_shards(keep)` so that the release can unmap the others."""
        self._check_keep(keep)
        return {s.name: self._spec_view(a, s, off, keep) for a, s, off in self._sharded()}

    def _check_keep(self, keep: range) -> None:
        n = self.shard_count
        if n == 0:
            raise ValueError("the layers hold no page-sharded tensor: nothing to keep or release")
        if keep.step != 1 or not 0 <= keep.start < keep.stop <= n:
            raise ValueError(f"shards {keep} are not a contiguous part of [0, {n})")
        if not (keep.start >= self.kept_shards.start and keep.stop <= self.kept_shards.stop):
            raise ValueError(f"shards {keep} are not all mapped (mapped: {self.kept_shards})")

    def _shard_spans(self, shards: Iterable[int]) -> list[tuple[VirtualRange, int, int]]:
        """(range, first slot, slot count) of the pages of `shards` in every held sharded tensor."""
        P = self.pool.page_size
        shards = list(shards)
        out = []
        for a, s, off in self._sharded():
            per = s.shard_stride(P) // P
            out += [(a.vr, off // P + i * per, per) for i in shards]
        return out

    def plan_shard_release(self, keep: range) -> CapacityPlan:
        """The capacity `release_shards(keep)` would give (nothing changes): the capacity rule over the weight pages
        still mapped, so every held layer's KV gets an equal share of the released pages."""
        self._check_keep(keep)
        released = sum(n for _, _, n in self._shard_spans(i for i in self.kept_shards if i not in keep))
        return self._plan(self._start, self._end, released=self._released_pages() + released)

    def _released_pages(self) -> int:
        if self._released is None:
            return 0
        return sum(n for _, _, n in self._shard_spans(i for i in range(self.shard_count) if i not in self._released))

    def release_shards(self, keep: range) -> RemapResult:
        """Unmap the pages of every page-sharded tensor's shards outside `keep` and map them at the held layers' KV
        tails (Gyges §4.2-4.3: a scale-up releases the MLP shards a member no longer computes on, in whole pages,
        with no weight copy). The KV keeps its base addresses and bytes; `num_blocks` grows. Release the views of
        the shards going away first (the engine's runner then computes on `shard_views(keep)`): ViewStillAliveError
        otherwise, with nothing changed. Layer drops and restores are refused until `reclaim_shards`."""
        plan = self.plan_shard_release(keep)
        t0 = time.perf_counter()
        old_blocks = self.num_blocks
        spans = self._shard_spans(i for i in self.kept_shards if i not in keep)
        self.release_views()
        self.pool.ensure_no_views((vr, first, first + n) for vr, first, n in spans)
        unmapped = sum(len(self.pool.unmap(vr, first, n)) for vr, first, n in spans)
        mapped = self._resize_kv(plan.kv_pages_per_layer)
        self._released = keep if keep != range(self.shard_count) else None
        self._after_remap()
        return RemapResult("release", (), self._start, self._end, old_blocks, self.num_blocks, unmapped, mapped,
                           self.pool.free_count, self.generation, time.perf_counter() - t0)

    def plan_shard_reclaim(self) -> CapacityPlan:
        """The capacity once `reclaim_shards` maps every shard again: the plain capacity rule."""
        return self._plan(self._start, self._end)

    def reclaim_shards(self, source: WeightSource, *, used_block_ids: Collection[int]) -> RemapResult:
        """The inverse of `release_shards` (a scale-down back to a whole instance): take the pages back from the KV
        tails, map them under the released shards and fill those shards from `source` (name -> the whole tensor,
        e.g. the host copy). Every used KV block must lie below the plan's `num_blocks` (KVCapacityError: the
        caller gathers its blocks low first)."""
        if self._released is None:
            raise ValueError("no shard is released")
        plan = self.plan_shard_reclaim()
        used = sorted(int(b) for b in used_block_ids)
        beyond = [b for b in used if b >= plan.num_blocks]
        if beyond:
            raise KVCapacityError(f"taking the weight shards back leaves {plan.num_blocks} KV blocks but blocks "
                                  f"{beyond[:8]} beyond it are in use", used_blocks=len(used),
                                  new_num_blocks=plan.num_blocks, needs_compaction=True)
        get = source.__getitem__ if isinstance(source, Mapping) else source
        wholes: list[torch.Tensor] = []  # every shard's source read and checked before any page moves
        for _, s, _ in self._sharded():
            try:
                whole = get(s.name)
            except KeyError as e:
                raise WeightSourceError(s.name, "missing from the weight source") from e
            if tuple(whole.shape) != s.shape:
                raise WeightSourceError(s.name, f"shape {tuple(whole.shape)} != expected {s.shape}")
            wholes.append(whole)
        t0 = time.perf_counter()
        old_blocks = self.num_blocks
        gone = [i for i in range(self.shard_count) if i not in self._released]
        spans = self._shard_spans(gone)
        self.release_views()
        self.pool.ensure_no_views((self._kv[x], plan.kv_pages_per_layer, self._k) for x in self.layers)
        unmapped = self._resize_kv(plan.kv_pages_per_layer)
        for vr, first, n in spans:
            self.pool.map(vr, first, self.pool.take_free(n))
        self._released = None
        self._after_remap()
        fill_t0 = time.perf_counter()
        with torch.no_grad():
            for (a, s, off), whole in zip(self._sharded(), wholes, strict=True):
                for lo, hi in _runs(gone):
                    self._spec_view(a, s, off, range(lo, hi)).copy_(whole[lo:hi])
        return RemapResult("reclaim", (), self._start, self._end, old_blocks, self.num_blocks, unmapped,
                           sum(n for _, _, n in spans), self.pool.free_count, self.generation,
                           fill_t0 - t0, time.perf_counter() - fill_t0)

    def _check_whole_weights(self, what: str) -> None:
        if self._released is not None:
            raise ValueError(f"cannot {what} while weight shards outside {self._released} are released (a "
                             "tensor-parallel member): reclaim them first")

    # ------------------------------------------------------------------ building blocks
    def _resize_kv(self, k: int) -> int:
        """Every held layer's KV range to `k` pages: free pages mapped at the tails, or the tails unmapped (the caller
        checked no view covers them). Bases and the bytes before `k` stay. Returns the pages mapped or unmapped."""
        moved = 0
        for x in self.layers:
            if k > self._k:
                pages = self.pool.take_free(k - self._k)
                self.pool.map(self._kv[x], self._k, pages)
                moved += len(pages)
            elif k < self._k:
                moved += len(self.pool.unmap(self._kv[x], k, self._k - k))
        self._k = k
        return moved

    def _make_arena(self, key: str, specs: Sequence[TensorSpec]) -> _Arena:
        specs = tuple(specs)
        offsets, total = pack_tensors(specs, page_size=self.pool.page_size)
        n = -(-total // self.pool.page_size)
        if n <= 0:
            raise ValueError(f"arena {key} has no bytes")
        vr = self.pool.reserve(n, f"weights:{key}" if not key.startswith("group:") else key)
        try:
            self.pool.map(vr, 0, self.pool.take_free(n))
        except BaseException:
            self.pool.free_range(vr)
            raise
        return _Arena(key, specs, offsets, vr)

    def _make_layer(self, layer: int, kv_pages: int) -> int:
        """Create a layer's weight arena (if it has weights) and KV range; returns pages mapped."""
        mapped = 0
        specs = self._specs(layer)
        if specs and sum(s.nbytes for s in specs) > 0:
            self._weights[layer] = self._make_arena(str(layer), specs)
            mapped += self._weights[layer].num_pages
        # Reserved at the size of the whole pool: the most pages this layer's KV could ever get.
        vr = self.pool.reserve(self.pool.num_pages, f"kv:{layer}")
        self._kv[layer] = vr
        self.pool.map(vr, 0, self.pool.take_free(kv_pages))
        return mapped + kv_pages

    def _after_remap(self) -> None:
        self._kv_cache.clear()
        self.generation += 1
        if self.discard_spare:
            self.pool.discard_free_pages()

    def _teardown(self) -> None:
        self.release_views()
        for vr in [a.vr for a in self._arenas()] + list(self._kv.values()):
            if not vr.released:
                self.pool.free_range(vr)
        self._weights.clear()
        self._group_arenas.clear()
        self._kv.clear()

    def close(self) -> None:
        """Free every range of this layout (the pool itself stays open). Refuses while views are alive."""
        self.release_views()
        self.pool.ensure_no_views((vr, 0, vr.num_slots) for vr in [a.vr for a in self._arenas()] +
                                  list(self._kv.values()))
        self._teardown()

    # ------------------------------------------------------------------ introspection
    def check_invariants(self) -> None:
        """Pool bookkeeping plus: every held layer has its weights and exactly k KV pages at its head."""
        self.pool.check_invariants()
        assert set(self._kv) == set(self.layers), f"KV ranges {sorted(self._kv)} != held {list(self.layers)}"
        for x in self.layers:
            vr = self._kv[x]
            assert vr.mapped_prefix() == self._k == vr.mapped_count(), \
                f"layer {x}: KV head {vr.mapped_prefix()} / mapped {vr.mapped_count()} pages, expected {self._k}"
            specs = self._specs(x)
            assert (x in self._weights) == bool(specs and sum(s.nbytes for s in specs) > 0)
        assert set(self._weights) <= set(self.layers)
        assert sorted(self._group_arenas) == sorted(self._groups_for(self._start, self._end))
        gone = [i for i in range(self.shard_count) if i not in self.kept_shards]
        released = {(vr.rid, first + j) for vr, first, n in self._shard_spans(gone) for j in range(n)}
        for a in self._arenas():
            holes = {i for i, p in enumerate(a.vr.slots) if p is None}
            assert holes == {i for rid, i in released if rid == a.vr.rid}, f"arena {a.key}: unmapped slots {holes}"
        owned = {a.vr.rid for a in self._arenas()} | {vr.rid for vr in self._kv.values()}
        assert owned == {vr.rid for vr in self.pool.ranges}, "pool holds ranges the layout does not know"
        plan = self._plan(self._start, self._end, self._released_pages())
        assert plan.kv_pages_per_layer == self._k, f"KV pages per layer {self._k} != plan {plan.kv_pages_per_layer}"
        assert self.pool.free_count == plan.spare_pages, f"free {self.pool.free_count} != spare {plan.spare_pages}"

    def memory_map(self, per_page: bool = True) -> dict[str, Any]:
        """Plain-data description for the worker's memory RPC and `kunctl memory`.

        Owners are "free", "weights:<layer>", "kv:<layer>" and "group:<name>". `page_runs` lists
        [first_page, count, owner] for runs of physical pages with one owner; `page_owners` (when
        `per_page`) gives the owner of every page.
        """
        P = self.pool.page_size
        owner_of: list[str] = []
        for p in range(self.pool.num_pages):
            slot = self.pool.page_owner(p)
            owner_of.append("free" if slot is None else slot[0].tag)
        runs: list[list[Any]] = []
        for p, o in enumerate(owner_of):
            if runs and runs[-1][2] == o and runs[-1][0] + runs[-1][1] == p:
                runs[-1][1] += 1
            else:
                runs.append([p, 1, o])
        counts: dict[str, int] = {}
        for o in owner_of:
            counts[o] = counts.get(o, 0) + 1
        nb = self.num_blocks
        n = self._end - self._start
        layers = []
        for x in self.layers:
            w = self._weights.get(x)
            layers.append({
                "layer": x,
                "weight_pages": w.vr.mapped_count() if w else 0,
                "weight_bytes": sum(s.nbytes for s in w.specs) if w else 0,
                "kv_pages": self._k,
                "kv_blocks": nb,
                "kv_base": self._kv[x].base,
            })
        out: dict[str, Any] = {
            "backend": self.pool.backend,
            "device": str(self.pool.device),
            "page_size": P,
            "num_pages": self.pool.num_pages,
            "free_pages": self.pool.free_count,
            "generation": self.generation,
            "num_layers_model": self.num_layers_model,
            "layer_start": self._start,
            "layer_end": self._end,
            "weight_pages": self.weight_pages,
            "kept_shards": [self.kept_shards.start, self.kept_shards.stop] if self.shard_count else None,
            "weight_bytes": sum(s.nbytes for a in self._arenas() for s in a.specs),
            "groups": [{"name": a.key.removeprefix("group:"), "pages": a.num_pages,
                        "bytes": sum(s.nbytes for s in a.specs)} for a in self._group_arenas.values()],
            "kv": {
                "block_size": self.kv_spec.block_size,
                "block_bytes": self.kv_spec.block_bytes,
                "block_shape": list(self.kv_spec.block_shape),
                "physical_block_shape": list(self.kv_spec.physical_block_shape),
                "dtype": str(self.kv_spec.dtype).removeprefix("torch."),
                "pages_per_layer": self._k,
                "num_blocks": nb,
                "capacity_blocks": nb,
                "capacity_tokens": nb * self.kv_spec.block_size,
                "capacity_bytes": nb * self.kv_spec.block_bytes * n,
                "mapped_bytes": self._k * P * n,
            },
            "layers": layers,
            "owner_pages": counts,
            "page_runs": runs,
            "stats": dict(self.pool.stats),
        }
        if per_page:
            out["page_owners"] = owner_of
        return out

    def __repr__(self) -> str:
        return (f"LayerMemoryLayout(layers=[{self._start}, {self._end}), num_blocks={self.num_blocks}, "
                f"kv_pages_per_layer={self._k}, weight_pages={self.weight_pages}, spare={self.spare_pages}, "
                f"backend={self.pool.backend})")


def _runs(ids: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted ids as [lo, hi) runs of consecutive ones."""
    runs: list[tuple[int, int]] = []
    for i in sorted(ids):
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def uniform_layer_specs(template: Sequence[tuple[str, Sequence[int], torch.dtype]],
                        prefix: str = "layers.{layer}.") -> Callable[[int], list[TensorSpec]]:
    """`layer_specs` for a model whose layers all have the same tensors: names get `prefix` + name."""
    tmpl = [(n, tuple(s), d) for n, s, d in template]

    def specs(layer: int) -> list[TensorSpec]:
        p = prefix.format(layer=layer)
        return [TensorSpec(p + n, s, d) for n, s, d in tmpl]

    return specs


__all__ = [
    "CapacityPlan", "HeadSplitResult", "HeldWith", "KVCacheSpec", "LayerMemoryLayout", "RemapResult", "TensorSpec", "WeightGroupSpec",
    "WeightSource", "arena_pages", "kv_capacity", "pack_tensors", "plan_compaction", "uniform_layer_specs",
]
