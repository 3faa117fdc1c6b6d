"""Attention over the paged, head-major KV cache.

`TorchPagedAttention` is the CPU path (and a fallback anywhere): new K/V are written into their slots
with one vectorized index_put per layer; all decoding sequences (one query token each) are handled in
one batched, masked, grouped-query matmul; prefill chunks (with any prefix already cached) go one
sequence at a time through SDPA with a causal mask offset by the prefix length.
`FlashInferPagedAttention` is the CUDA path behind the same interface (lazy import).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    row_start: int  # first row of this chunk in the flat token batch
    num_tokens: int
    context_len: int  # tokens in cache after this chunk (prefix + chunk)
    block_ids: torch.Tensor  # blocks covering context_len, int64


@dataclass
class AttentionMetadata:
    """Where each token's K/V goes and what each sequence attends to, built once per step."""

    slot_blocks: torch.Tensor  # [T] block id of each token
    slot_offsets: torch.Tensor  # [T] offset inside the block
    decode_rows: torch.Tensor | None = None  # [B] rows of decoding sequences
    decode_block_tables: torch.Tensor | None = None  # [B, max_blocks], padded with 0
    decode_context_lens: torch.Tensor | None = None  # [B]
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, max_blocks*block_size] True = masked
    prefills: list[PrefillChunk] = field(default_factory=list)
    prefill_masks: list[torch.Tensor] = field(default_factory=list)  # per chunk [n, ctx] True = attend


def build_metadata(slot_blocks: list[int], slot_offsets: list[int], decodes: list[tuple[int, int, list[int]]],
                   prefills: list[tuple[int, int, int, list[int]]], block_size: int,
                   device: torch.device | str = "cpu") -> AttentionMetadata:
    """decodes: (row, context_len, block_table); prefills: (row_start, n, context_len, block_table)."""
    meta = AttentionMetadata(torch.tensor(slot_blocks, dtype=torch.long, device=device),
                             torch.tensor(slot_offsets, dtype=torch.long, device=device))
    if decodes:
        max_blocks = max(-(-ctx // block_size) for _, ctx, _ in decodes)
        table = torch.zeros(len(decodes), max_blocks, dtype=torch.long)
        for i, (_, ctx, bt) in enumerate(decodes):
            nb = -(-ctx // block_size)
            table[i, :nb] = torch.tensor(bt[:nb], dtype=torch.long)
        lens = torch.tensor([ctx for _, ctx, _ in decodes], dtype=torch.long)
        meta.decode_rows = torch.tensor([r for r, _, _ in decodes], dtype=torch.long, device=device)
        meta.decode_block_tables = table.to(device)
        meta.decode_context_lens = lens.to(device)
        span = torch.arange(max_blocks * block_size)
        meta.decode_mask = (span[None, :] >= lens[:, None]).view(len(decodes), 1, 1, -1).to(device)
    for row, n, ctx, bt in prefills:
        nb = -(-ctx // block_size)
        meta.prefills.append(PrefillChunk(row, n, ctx, torch.tensor(bt[:nb], dtype=torch.long, device=device)))
        prefix = ctx - n
        q_pos = torch.arange(prefix, ctx)[:, None]
        k_pos = torch.arange(ctx)[None, :]
        meta.prefill_masks.append((k_pos <= q_pos).to(device))
    return meta


class TorchPagedAttention:
    """Reference-quality paged attention in plain torch (CPU, or any device as a fallback)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5

    def write_kv(self, cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        # cache[b, 0, :, o, :] for each token: advanced indices separated by a slice put T first.
        cache[meta.slot_blocks, 0, :, meta.slot_offsets, :] = k
        cache[meta.slot_blocks, 1, :, meta.slot_offsets, :] = v

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q [T, H, d], k/v [T, KVH, d] for the new tokens; returns [T, H, d]."""
        self.write_kv(cache, k, v, meta)
        out = torch.empty_like(q)
        if meta.decode_rows is not None:
            out[meta.decode_rows] = self._decode(q[meta.decode_rows], cache, meta)
        for chunk, mask in zip(meta.prefills, meta.prefill_masks):
            rows = slice(chunk.row_start, chunk.row_start + chunk.num_tokens)
            out[rows] = self._prefill(q[rows], cache, chunk, mask)
        return out

    @staticmethod
    def _gather_kv(cache: torch.Tensor, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the given blocks as [..., KVH, nb*bs, d]: one index_select (a memcpy per block)
        instead of advanced indexing, which is several times slower on CPU."""
        lead = block_ids.shape  # (..., nb)
        x = torch.index_select(cache, 0, block_ids.reshape(-1))  # [n, 2, KVH, bs, d]
        x = x.view(*lead, *x.shape[1:]).movedim(len(lead) - 1, -3)  # [..., 2, KVH, nb, bs, d]
        x = x.reshape(*x.shape[:-3], x.shape[-3] * x.shape[-2], x.shape[-1])  # [..., 2, KVH, nb*bs, d]
        return x.select(-4, 0), x.select(-4, 1)

    def _decode(self, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        B = q.shape[0]
        keys, values = self._gather_kv(cache, meta.decode_block_tables)  # [B, KVH, L, d]
        qg = q.view(B, self.num_kv_heads, self.group, self.head_dim)
        scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * self.scale  # [B, KVH, G, L]
        scores.masked_fill_(meta.decode_mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        return torch.matmul(probs, values).view(B, self.num_heads, self.head_dim)

    def _prefill(self, q: torch.Tensor, cache: torch.Tensor, chunk: PrefillChunk, mask: torch.Tensor) -> torch.Tensor:
        n, ctx = chunk.num_tokens, chunk.context_len
        keys, values = self._gather_kv(cache, chunk.block_ids)  # [KVH, nb*bs, d]
        keys, values = keys[:, :ctx], values[:, :ctx]
        o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
                                           attn_mask=mask, scale=self.scale, enable_gqa=self.group > 1)
        return o.squeeze(0).transpose(0, 1)


class FlashInferPagedAttention(TorchPagedAttention):  # pragma: no cover - needs a GPU and flashinfer
    """CUDA path: FlashInfer's paged kernels over the same HND cache. Only constructed on CUDA; the
    flashinfer import is lazy so CPU installs never need it. Decode goes through
    BatchDecodeWithPagedKVCacheWrapper; prefill chunks keep the torch path until the prefill wrapper is
    wired (correct, slower)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim)
        import flashinfer  # noqa: PLC0415 - optional GPU dependency

        self._fi = flashinfer
        self._workspace = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=device)
        self._decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "HND")

    def _decode(self, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        bs = cache.shape[3]
        lens = meta.decode_context_lens
        nblocks = (lens + bs - 1) // bs
        indptr = torch.zeros(len(lens) + 1, dtype=torch.int32, device=q.device)
        indptr[1:] = torch.cumsum(nblocks, 0)
        indices = torch.cat([meta.decode_block_tables[i, : int(nb)] for i, nb in enumerate(nblocks.tolist())]).int()
        last = (lens - (nblocks - 1) * bs).int()
        self._decode_wrapper.plan(indptr, indices, last, self.num_heads, self.num_kv_heads, self.head_dim, bs,
                                  pos_encoding_mode="NONE", q_data_type=q.dtype, kv_data_type=cache.dtype)
        return self._decode_wrapper.run(q.contiguous(), cache)


def make_attention(num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device | str) -> TorchPagedAttention:
    device = torch.device(device)
    if device.type == "cuda":
        try:
            return FlashInferPagedAttention(num_heads, num_kv_heads, head_dim, device)
        except ImportError:
            pass  # flashinfer not installed: the torch path works on CUDA too
    return TorchPagedAttention(num_heads, num_kv_heads, head_dim)
