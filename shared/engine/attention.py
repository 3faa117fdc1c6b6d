"""Attention over the paged, head-major KV cache.

The cache of one layer is `[num_blocks, 2, num_kv_heads, block_size, head_dim]` (FlashInfer's HND
layout, K then V inside each block), a strided view of blocks laid out header-centric in memory
(`[num_kv_heads, 2, block_size, head_dim]`, shared/memory/kv_layout.py): the code here indexes through the
view and never assumes it is contiguous. Every backend implements `Attention.forward(q, k, v, cache,
meta)`: write the new tokens' K/V into their slots, then attend.

`TorchPagedAttention` is the CPU path and a fallback on any device:

- new K/V go into their slots with one vectorized index_put per K and V;
- decoding sequences (one query token each) on a CPU in float32 go through the compiled kernel of
  cpu_kernels.py, which reads each sequence's K/V where they lie in the paged cache (no gathered copy)
  and keeps the softmax in float32;
- elsewhere all decoding sequences are handled in one batched, masked, grouped-query matmul. Their
  blocks are gathered with ONE `index_select` over a *permuted view* of the cache
  (`[2, kv_heads, blocks, block_size, dim]`), whose output is already `[2, kv_heads, B, L, dim]`:
  no second reshape copy, and no repeat_interleave of K/V for GQA (queries are grouped instead);
- prefill chunks run per sequence through SDPA; a chunk without a cached prefix attends to its own
  K/V directly (is_causal, no gather), a chunk with a prefix gathers its blocks and uses a causal
  mask offset by the prefix length.

`FlashInferPagedAttention` is the CUDA path behind the same interface; flashinfer is imported lazily
and only when constructed on CUDA. It cannot be tested on the CPU CI machines; keep it small.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from kunserve.shared.engine import cpu_kernels


@dataclass
class PrefillChunk:
    """One sequence's chunk of query tokens (num_tokens > 1) in the flat token batch."""

    row_start: int  # first row of this chunk in the flat token batch
    num_tokens: int
    context_len: int  # tokens in cache after this chunk (prefix + chunk)
    block_ids: torch.Tensor  # int64 blocks covering context_len
    mask: torch.Tensor | None = None  # [n, ctx] True = attend; None when there is no prefix (pure causal)

    @property
    def prefix_len(self) -> int:
        return self.context_len - self.num_tokens


@dataclass
class AttentionMetadata:
    """Where each new token's K/V goes and what each sequence attends to; built once per step and
    shared by every layer (the per-layer cost is then only tensor work)."""

    slot_blocks: torch.Tensor  # [T] block id of each new token
    slot_offsets: torch.Tensor  # [T] offset inside its block
    block_size: int = 16
    decode_rows: torch.Tensor | None = None  # [B] rows of the decoding sequences (None: no decodes)
    decode_rows_contiguous: bool = False  # decode rows are 0..B-1 (the engine puts decodes first)
    decode_block_tables: torch.Tensor | None = None  # [B, max_blocks] int64, padded with block 0
    decode_context_lens: torch.Tensor | None = None  # [B] int64
    decode_mask: torch.Tensor | None = None  # [1, B, 1, max_blocks*block_size] True = padding (masked)
    prefills: list[PrefillChunk] = field(default_factory=list)

    @property
    def num_decodes(self) -> int:
        return 0 if self.decode_rows is None else int(self.decode_rows.shape[0])


def build_metadata(slot_blocks: Sequence[int], slot_offsets: Sequence[int],
                   decodes: Sequence[tuple[int, int, Sequence[int]]],
                   prefills: Sequence[tuple[int, int, int, Sequence[int]]], block_size: int,
                   device: torch.device | str = "cpu") -> AttentionMetadata:
    """decodes: (row, context_len, block_ids); prefills: (row_start, num_tokens, context_len, block_ids).

    Everything is converted to tensors here with one `torch.tensor` call per field, so the
    per-layer attention code runs no Python loop over tokens or blocks."""
    meta = AttentionMetadata(torch.tensor(slot_blocks, dtype=torch.long, device=device),
                             torch.tensor(slot_offsets, dtype=torch.long, device=device), block_size)
    if decodes:
        nbs = [-(-ctx // block_size) for _, ctx, _ in decodes]
        max_blocks = max(nbs)
        rows = [r for r, _, _ in decodes]
        table = [list(bt[:nb]) + [0] * (max_blocks - nb) for (_, _, bt), nb in zip(decodes, nbs)]
        lens = torch.tensor([ctx for _, ctx, _ in decodes], dtype=torch.long)
        meta.decode_rows = torch.tensor(rows, dtype=torch.long, device=device)
        meta.decode_rows_contiguous = rows == list(range(len(rows)))
        meta.decode_block_tables = torch.tensor(table, dtype=torch.long, device=device)
        meta.decode_context_lens = lens.to(device)
        span = torch.arange(max_blocks * block_size)
        meta.decode_mask = (span[None, :] >= lens[:, None]).view(1, len(decodes), 1, -1).to(device)
    for row, n, ctx, bt in prefills:
        nb = -(-ctx // block_size)
        prefix = ctx - n
        mask = None
        if prefix > 0:
            q_pos = torch.arange(prefix, ctx)[:, None]
            k_pos = torch.arange(ctx)[None, :]
            mask = (k_pos <= q_pos).to(device)
        meta.prefills.append(PrefillChunk(row, n, ctx, torch.tensor(list(bt[:nb]), dtype=torch.long, device=device),
                                          mask))
    return meta


class Attention(Protocol):
    """A paged-attention backend. q [T, H, d], k/v [T, KVH, d] are the new tokens of one step
    (rows as described by meta); cache is one layer's `[num_blocks, 2, KVH, block_size, d]` tensor.
    `kv_written`: the caller has already stored k / v in their slots (the CPU's fused RoPE + store kernel).
    Returns the attention output [T, H, d]."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                meta: AttentionMetadata, kv_written: bool = False) -> torch.Tensor: ...


class TorchPagedAttention:
    """Paged attention in plain torch (CPU, or any device as a fallback)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5

    @property
    def needs_kv_write(self) -> bool:
        """Whether forward must store K/V itself (a backend whose kernels want another layout would say so)."""
        return False

    @staticmethod
    def write_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        """Store the new tokens' K/V at (block, offset): cache[b, 0, :, o, :] = k[t] for every token t.
        Two advanced indices separated by a slice put the token dimension first, matching k [T, KVH, d]."""
        cache[meta.slot_blocks, 0, :, meta.slot_offsets, :] = k
        cache[meta.slot_blocks, 1, :, meta.slot_offsets, :] = v

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                meta: AttentionMetadata, kv_written: bool = False) -> torch.Tensor:
        if not kv_written:
            self.write_kv(cache, k, v, meta)
        if not meta.prefills and meta.decode_rows_contiguous:
            return self._decode(q, cache, meta)  # pure decode step: no scatter of rows
        out = torch.empty_like(q)
        if meta.decode_rows is not None:
            if meta.decode_rows_contiguous:
                out[: meta.num_decodes] = self._decode(q[: meta.num_decodes], cache, meta)
            else:
                out[meta.decode_rows] = self._decode(q[meta.decode_rows], cache, meta)
        for chunk in meta.prefills:
            rows = slice(chunk.row_start, chunk.row_start + chunk.num_tokens)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], cache, chunk)
        return out

    @staticmethod
    def gather(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """K and V of the given blocks as `[2, KVH, *block_ids.shape[:-1], nb*block_size, d]`, in one copy:
        index_select along the block axis of the permuted view [2, KVH, blocks, bs, d] produces the
        head-major, token-contiguous layout the matmuls want directly."""
        two, kvh, bs, d = cache.shape[1], cache.shape[2], cache.shape[3], cache.shape[4]
        x = torch.index_select(cache.permute(1, 2, 0, 3, 4), 2, block_ids.reshape(-1))  # [2, KVH, n, bs, d]
        lead = block_ids.shape[:-1]
        return x.view(two, kvh, *lead, block_ids.shape[-1] * bs, d)

    def _decode(self, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        B = q.shape[0]
        assert meta.decode_block_tables is not None and meta.decode_mask is not None, "a step without decodes"
        assert meta.decode_context_lens is not None
        if cpu_kernels.decode_attention_supported(q, cache):
            return cpu_kernels.decode_attention(q, cache, meta.decode_block_tables, meta.decode_context_lens,
                                                self.scale)
        kv = self.gather(cache, meta.decode_block_tables)  # [2, KVH, B, L, d]
        keys, values = kv[0], kv[1]
        # queries grouped per KV head: [KVH, B, G, d]; GQA without copying K/V per query head
        qg = (q * self.scale).view(B, self.num_kv_heads, self.group, self.head_dim).transpose(0, 1)
        scores = torch.matmul(qg, keys.transpose(-1, -2))  # [KVH, B, G, L]
        if scores.dtype != torch.float32:
            scores = scores.float()  # softmax in float32 (bf16/fp16 caches)
        scores.masked_fill_(meta.decode_mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        out = torch.matmul(probs, values)  # [KVH, B, G, d]
        return out.transpose(0, 1).reshape(B, self.num_heads, self.head_dim)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                 chunk: PrefillChunk) -> torch.Tensor:
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, d]
        if chunk.prefix_len == 0:
            # no cached prefix: the chunk's own K/V are the whole context
            keys, values = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qh, keys, values, is_causal=True, scale=self.scale,
                                               enable_gqa=self.group > 1)
        else:
            kv = self.gather(cache, chunk.block_ids)[:, :, : chunk.context_len]  # [2, KVH, ctx, d]
            o = F.scaled_dot_product_attention(qh, kv[0].unsqueeze(0), kv[1].unsqueeze(0), attn_mask=chunk.mask,
                                               scale=self.scale, enable_gqa=self.group > 1)
        return o.squeeze(0).transpose(0, 1)


FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)


class FlashInferPagedAttention(TorchPagedAttention):  # pragma: no cover - needs a GPU and flashinfer
    """CUDA path (UNTESTED on CPU CI): FlashInfer's paged decode kernel over the same HND cache.

    Only constructed on CUDA; the flashinfer import is lazy so CPU installs never need it. Decode goes
    through BatchDecodeWithPagedKVCacheWrapper (planned once per step, cached across layers via the
    metadata object); prefill chunks keep the torch path (SDPA on CUDA is fast) until the ragged
    prefill wrapper is wired."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim)
        import flashinfer  # noqa: PLC0415 - optional GPU dependency

        self._workspace = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=device)
        self._decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "HND")
        self._planned_for: AttentionMetadata | None = None  # the step's metadata the wrapper is planned for

    def _plan(self, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata) -> None:
        bs = cache.shape[3]
        lens, tables = meta.decode_context_lens, meta.decode_block_tables
        assert lens is not None and tables is not None, "a step without decodes"
        nblocks = (lens + bs - 1) // bs
        indptr = torch.zeros(len(lens) + 1, dtype=torch.int32, device=q.device)
        indptr[1:] = torch.cumsum(nblocks, 0)
        width = tables.shape[1]
        valid = torch.arange(width, device=q.device)[None, :] < nblocks[:, None]
        indices = tables[valid].int()  # row-major: each sequence's blocks in order
        last = (lens - (nblocks - 1) * bs).int()
        self._decode_wrapper.plan(indptr, indices, last, self.num_heads, self.num_kv_heads, self.head_dim, bs,
                                  pos_encoding_mode="NONE", q_data_type=q.dtype, kv_data_type=cache.dtype)
        self._planned_for = meta

    @staticmethod
    def paged_kv(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache as FlashInfer's (K, V) pair of `[blocks, kv_heads, block_size, head_dim]` HND tensors: strided
        views (the header-centric block puts a head's V right after its K), which FlashInfer's paged kernels read
        through their page / head / token strides."""
        return cache[:, 0], cache[:, 1]

    def _decode(self, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if q.dtype not in FLASHINFER_DTYPES:  # FlashInfer's kernels have no float32 instantiation
            return super()._decode(q, cache, meta)
        if self._planned_for is not meta:
            self._plan(q, cache, meta)
        return self._decode_wrapper.run(q.contiguous(), self.paged_kv(cache))


def make_attention(num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device | str) -> Attention:
    """FlashInfer on CUDA when installed, else the torch implementation (which works on CUDA too)."""
    device = torch.device(device)
    if device.type == "cuda":
        try:
            return FlashInferPagedAttention(num_heads, num_kv_heads, head_dim, device)
        except ImportError:
            pass
    return TorchPagedAttention(num_heads, num_kv_heads, head_dim)
