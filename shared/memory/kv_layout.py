"""The header-centric physical order of a paged KV block (Gyges §4.1) and the view the kernels are handed.

A block of one layer holds `block_size` tokens of `num_kv_heads` heads, K and V. In memory it is laid out
**head-major**, `[num_kv_heads, 2, block_size, head_dim]`: one head's K and V are adjacent, so the heads
[a, b) of a block are one contiguous byte range. That is what lets a tensor-parallel scale-up keep a rank's
heads where they lie and reinterpret each block as `degree` smaller blocks (`kv_head_split.py`) instead of
trimming two strided ranges (K and V) per block, as a K/V-major block `[2, num_kv_heads, ...]` would need.

The engine and its kernels keep seeing the order they were written for, `[num_blocks, 2, num_kv_heads,
block_size, head_dim]` (FlashInfer's HND with K/V as the second axis), as a *permuted view* of the physical
tensor (`kv_stride_order`, after the paper's `kv_stride_order()`): only strides differ, the innermost
`[block_size, head_dim]` stays contiguous, and anything that indexes, gathers or copies through the view
(index_select, index_copy_, index_put) reads and writes the same logical elements whatever the physical order.
Kernels that compute addresses themselves take the view's strides (`cpu_kernels.py`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from .kv_head_split import HeadSplitPlan, SubBlockMove

KV_STRIDE_ORDER = (0, 2, 1, 3, 4)
"""Axes of the physical tensor `[blocks, heads, K/V, tokens, dim]` in the logical order `[blocks, K/V, heads, tokens,
dim]` (the permutation is its own inverse)."""


def physical_block_shape(num_kv_heads: int, block_size: int, head_dim: int) -> tuple[int, int, int, int]:
    """One block as it lies in memory: `[num_kv_heads, 2, block_size, head_dim]`."""
    return (num_kv_heads, 2, block_size, head_dim)


def logical_view(physical: torch.Tensor) -> torch.Tensor:
    """The kernels' view `[blocks, 2, heads, block_size, head_dim]` of a physical `[blocks, heads, 2, ...]` tensor."""
    if physical.dim() != 5 or physical.shape[2] != 2:
        raise ValueError(f"a physical KV tensor is [blocks, heads, 2, block_size, head_dim], got {tuple(physical.shape)}")
    return physical.permute(*KV_STRIDE_ORDER)


def physical_view(cache: torch.Tensor) -> torch.Tensor:
    """The physical `[blocks, heads, 2, block_size, head_dim]` tensor under a logical cache view (contiguous)."""
    if cache.dim() != 5 or cache.shape[1] != 2:
        raise ValueError(f"a KV cache view is [blocks, 2, heads, block_size, head_dim], got {tuple(cache.shape)}")
    phys = cache.permute(*KV_STRIDE_ORDER)
    if not phys.is_contiguous():
        raise ValueError(f"the KV cache view (strides {cache.stride()}) is not a header-centric physical tensor")
    return phys


def regroup(cache: torch.Tensor, num_blocks: int, heads: int) -> torch.Tensor:
    """The same bytes read as `num_blocks` blocks of `heads` heads (header-centric: a block is its heads one after
    another), from the start of `cache`; no byte moves. A head split reads `b * degree + r` as heads r of block b; a
    merge reads sub-blocks `b * degree .. b * degree + degree - 1` as block b."""
    phys = physical_view(cache)
    per_head = phys.flatten(0, 1)
    if num_blocks * heads > per_head.shape[0]:
        raise ValueError(f"{num_blocks} blocks of {heads} heads need {num_blocks * heads} heads' bytes, the cache "
                         f"holds {per_head.shape[0]}")
    return logical_view(per_head[: num_blocks * heads].view(num_blocks, heads, *phys.shape[2:]))


def move_blocks(caches: Iterable[torch.Tensor], src: Sequence[int], dst: Sequence[int]) -> None:
    """Copy block src[i] to dst[i] in every cache view (whole physical blocks: contiguous copies), reading every
    source of a cache before writing any destination, so chains are safe. The caller picks the grad mode: views a
    forward pass made are inference tensors."""
    ids = None
    for cache in caches:
        phys = physical_view(cache)
        if ids is None:
            ids = (torch.tensor(list(src), dtype=torch.long, device=phys.device),
                   torch.tensor(list(dst), dtype=torch.long, device=phys.device))
        phys.index_copy_(0, ids[1], phys.index_select(0, ids[0]))


def allocate(
    num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype, device: str | torch.device = "cpu"
) -> torch.Tensor:
    """A zeroed KV tensor laid out header-centric, returned as the kernels' logical view."""
    return logical_view(torch.zeros(num_blocks, *physical_block_shape(num_kv_heads, block_size, head_dim), dtype=dtype, device=device))


def apply_sub_block_moves(moves: Sequence[SubBlockMove], caches: Sequence[torch.Tensor]) -> int:
    """Run `moves` over one layer of every member, in one process: `caches[m]` is member m's split cache view
    (`[num_sub_blocks, 2, H/degree, block_size, head_dim]`). Every source is copied into staging before any
    destination is written, so a slot that is both a source and a destination (a swap, a chain, a cycle) gives
    its old bytes. Returns the most staging bytes one member received (what a transport between processes would
    buffer at the receiver)."""
    phys = [physical_view(c) for c in caches]
    seen: set[tuple[int, int]] = set()
    pairs: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
    for mv in moves:
        for member, slot in ((mv.src, mv.src_slot), (mv.dst, mv.dst_slot)):
            if not 0 <= member < len(phys):
                raise ValueError(f"{mv} names member {member}, but there are {len(phys)} caches")
            if not 0 <= slot < phys[member].shape[0]:
                raise ValueError(f"{mv}: member {member}'s cache has {phys[member].shape[0]} sub-blocks")
        if (mv.dst, mv.dst_slot) in seen:
            raise ValueError(f"two moves write sub-block {mv.dst_slot} of member {mv.dst}")
        seen.add((mv.dst, mv.dst_slot))
        src, dst = pairs.setdefault((mv.src, mv.dst), ([], []))
        src.append(mv.src_slot)
        dst.append(mv.dst_slot)
    received = [0] * len(phys)
    with torch.no_grad():
        staged = []
        for (s, d), (src, dst) in pairs.items():
            ids = torch.tensor(src, dtype=torch.long, device=phys[s].device)
            staged.append((d, dst, phys[s].index_select(0, ids).to(phys[d].device)))
            received[d] += staged[-1][2].numel() * staged[-1][2].element_size()
        for d, dst, t in staged:
            phys[d].index_copy_(0, torch.tensor(dst, dtype=torch.long, device=phys[d].device), t)
    return max(received, default=0)


def exchange_sub_blocks(plan: HeadSplitPlan, caches: Sequence[torch.Tensor]) -> int:
    """Run `plan`'s phased exchange over one layer of every member, in one process: `caches[m]` is member m's
    cache view after the head split (`LayerMemoryLayout.split_kv_heads`: `[num_blocks * degree, 2, H/degree, ...]`).
    Each phase copies every source sub-block into staging, then writes every destination, so a swap's two halves
    are both read before either is written. Returns the most staging bytes one member held in one phase (what a
    transport between processes would buffer at the receiver)."""
    if len(caches) != plan.degree:
        raise ValueError(f"the plan merges {plan.degree} members, got {len(caches)} caches")
    phys = [physical_view(c) for c in caches]
    for m, p in enumerate(phys):
        if p.shape[0] < plan.merged_num_blocks or p.shape[1] != plan.heads_per_rank:
            raise ValueError(
                f"member {m}'s cache is {tuple(p.shape[:2])} sub-blocks x heads; the plan needs at least "
                f"{plan.merged_num_blocks} sub-blocks of {plan.heads_per_rank} heads (split it first)"
            )
    return max((apply_sub_block_moves(phase, caches) for phase in plan.phases), default=0)


__all__ = [
    "KV_STRIDE_ORDER",
    "allocate",
    "apply_sub_block_moves",
    "exchange_sub_blocks",
    "logical_view",
    "physical_block_shape",
    "physical_view",
]
