"""Page-aligned MLP shards for elastic tensor parallelism (Gyges §4.2, Eq. 1–2).

A TP change must release a member's share of the MLP weights in whole pages, in place, with no weight copy.
That needs every TP shard boundary (for TP1/2/4 the quarters of the intermediate dimension) to start on a
page boundary. The MLP's three matrices are stored with the intermediate dimension outermost: gate and up as
``[intermediate, hidden]`` (Hugging Face's layout) and down *transposed*, also ``[intermediate, hidden]``, so
shard ``s`` of each is the contiguous rows ``[s*R, (s+1)*R)``. The memory pool (pool_placement.py, a layout
with ``padded_mlp``) stores the three shards ``s`` side by side, one ``[3, R, hidden]`` unit per shard
(`pack_shards`: ``[SHARDS, 3, R, hidden]``), each unit starting on a page boundary and followed by a gap up to the
next one (``TensorSpec.page_shards``); a member of a TP``d`` instance keeps the units `shards_of` its rank and
the pool releases the others' pages (``LayerMemoryLayout.release_shards``). ``FFNShardLayout`` is the same
arithmetic for one matrix of ``rows x cols`` per shard (a unit is one of ``R x 3*hidden``).

**What differs from the paper.** Eq. 2 pads with zero columns of U and zero rows of D and multiplies the
padded matrices whole. Here the padding is a byte gap that never enters the arithmetic: the FFN runs over a
strided ``[shards, R, hidden]`` view, one matmul per shard, and sums the shards' partial outputs — Eq. 2's
equality read the other way (the padded products are zero). A whole-row pad would have to round each shard
to the row count whose bytes are a page multiple: up to 1,024 rows of Qwen2.5-32B (3.7% of its MLP) where
the gap costs under one page per shard (0.7%), the figure the paper reports.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SHARDS = 4  # the finest split: TP1/2/4 boundaries are all quarter boundaries


def shards_of(rank: int, degree: int, shards: int = SHARDS) -> range:
    """The finest shards member ``rank`` of a TP``degree`` instance keeps."""
    if degree <= 0 or shards % degree:
        raise ValueError(f"TP degree {degree} does not divide {shards} shards")
    if not 0 <= rank < degree:
        raise ValueError(f"rank {rank} is outside TP{degree}")
    per = shards // degree
    return range(rank * per, (rank + 1) * per)


@dataclass(frozen=True)
class FFNShardLayout:
    """Where each shard of one MLP matrix lives in its page-aligned buffer. Sizes in bytes."""

    intermediate: int
    hidden: int
    itemsize: int
    page_bytes: int
    shards: int = SHARDS

    def __post_init__(self) -> None:
        if min(self.intermediate, self.hidden, self.itemsize, self.page_bytes, self.shards) <= 0:
            raise ValueError("intermediate, hidden, itemsize, page_bytes and shards must be > 0")
        if self.intermediate % self.shards:
            raise ValueError(f"intermediate size {self.intermediate} does not split into {self.shards} shards")
        if self.page_bytes % self.itemsize:
            raise ValueError(f"page of {self.page_bytes} bytes is not a whole number of {self.itemsize}-byte elements")

    @property
    def shard_rows(self) -> int:
        return self.intermediate // self.shards

    @property
    def shard_bytes(self) -> int:
        return self.shard_rows * self.hidden * self.itemsize

    @property
    def stride_bytes(self) -> int:
        """Distance between two shards' starts: the shard rounded up to whole pages."""
        return -(-self.shard_bytes // self.page_bytes) * self.page_bytes

    @property
    def total_bytes(self) -> int:
        return self.stride_bytes * self.shards

    @property
    def padding_bytes(self) -> int:
        return self.total_bytes - self.shard_bytes * self.shards

    @property
    def pages(self) -> int:
        return self.total_bytes // self.page_bytes

    def shards_of(self, rank: int, degree: int) -> range:
        """The finest shards member ``rank`` of a TP``degree`` instance keeps."""
        return shards_of(rank, degree, self.shards)

    def pages_of(self, rank: int, degree: int) -> range:
        """The buffer's pages member ``rank`` keeps at TP``degree``; every other page is released."""
        s = self.shards_of(rank, degree)
        per_shard = self.stride_bytes // self.page_bytes
        return range(s.start * per_shard, s.stop * per_shard)

    def view(self, buffer: torch.Tensor, shards: range | None = None) -> torch.Tensor:
        """A ``[len(shards), shard_rows, hidden]`` view over a flat buffer of this layout's element type that
        holds ``shards`` (all of them by default) at their strides, starting with the first one."""
        shards = shards if shards is not None else range(self.shards)
        stride = self.stride_bytes // self.itemsize
        need = (len(shards) - 1) * stride + self.shard_rows * self.hidden
        if buffer.dim() != 1 or buffer.numel() < need:
            raise ValueError(f"buffer of {buffer.numel()} elements cannot hold {len(shards)} shards ({need} needed)")
        return buffer.as_strided((len(shards), self.shard_rows, self.hidden), (stride, self.hidden, 1))

    def pack(self, matrix: torch.Tensor, out: torch.Tensor) -> None:
        """Write an ``[intermediate, hidden]`` matrix into ``out`` (a flat buffer of ``total_bytes``), shard by
        shard; the gaps are zeroed so the buffer's bytes do not depend on what the pages held before."""
        if tuple(matrix.shape) != (self.intermediate, self.hidden):
            raise ValueError(f"matrix of shape {tuple(matrix.shape)}, expected ({self.intermediate}, {self.hidden})")
        out.zero_()
        self.view(out).copy_(matrix.reshape(self.shards, self.shard_rows, self.hidden))


def sharded_swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down_t: torch.Tensor) -> torch.Tensor:
    """``silu(x @ G^T) * (x @ U^T) @ D`` over shard views ``[n, R, hidden]`` (down stored transposed): each shard
    computes its partial output and the partials are summed, exactly what the members of a TP instance compute
    before their all-reduce. With every shard present it is the whole MLP."""
    g = torch.matmul(x.unsqueeze(0), gate.transpose(1, 2))
    u = torch.matmul(x.unsqueeze(0), up.transpose(1, 2))
    partial = torch.matmul(torch.nn.functional.silu(g) * u, down_t)
    if partial.dtype in (torch.float16, torch.bfloat16):  # half precision: the shards' sum accumulated in float32
        return partial.float().sum(dim=0).to(partial.dtype)
    return partial.sum(dim=0)


def shards_shape(intermediate: int, hidden: int) -> tuple[int, int, int, int]:
    """The pool's padded MLP tensor: ``[SHARDS, 3, R, hidden]`` (gate, up and down^T rows of each shard)."""
    if intermediate % SHARDS:
        raise ValueError(f"intermediate size {intermediate} does not split into {SHARDS} shards")
    return (SHARDS, 3, intermediate // SHARDS, hidden)


def pack_shards(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """Hugging Face's gate / up ``[I, hidden]`` and down ``[hidden, I]`` as ``shards_shape`` (a new tensor)."""
    inter, hidden = gate.shape
    shape = shards_shape(inter, hidden)
    if tuple(up.shape) != (inter, hidden) or tuple(down.shape) != (hidden, inter):
        raise ValueError(f"gate {tuple(gate.shape)}, up {tuple(up.shape)}, down {tuple(down.shape)}: expected "
                         f"({inter}, {hidden}) twice and ({hidden}, {inter})")
    return torch.stack([gate, up, down.t()], 0).reshape(3, SHARDS, shape[2], hidden).transpose(0, 1).contiguous()


def swiglu_shards(x: torch.Tensor, units: torch.Tensor) -> torch.Tensor:
    """`sharded_swiglu` over units ``[n, 3, R, hidden]`` (the pool's view of the shards a member keeps)."""
    return sharded_swiglu(x, units[:, 0], units[:, 1], units[:, 2])
