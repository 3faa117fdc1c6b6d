"""One microbatch on the wire between pipeline stages in different processes: pure torch, no I/O.

The head builds a microbatch once (token positions, KV slots, per-sequence block tables, the rows that
need logits); every later stage needs exactly that to run its layers over its own KV cache. It travels
as one uint8 tensor: int64 count n, n int64 metadata words, then the hidden states' raw bytes. The
last stage answers with the float32 logits of the rows that complete a sequence. No pickle.

Metadata words: mb_id, T, hidden, n_decodes, n_prefills, n_rows, positions[T], slot_blocks[T],
slot_offsets[T], per decode (row, ctx_len, n_table, table...), per prefill (row, n, ctx_len, n_table,
table...), rows[n_rows] (n_rows == -1: every row, i.e. logits for all tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kunserve.shared.engine.attention import build_metadata

_I64 = torch.int64


@dataclass
class StageBatch:
    """What a stage needs to run one microbatch (built on the head, rebuilt from the wire elsewhere)."""

    mb_id: int
    positions: list[int]
    slot_blocks: list[int]
    slot_offsets: list[int]
    decodes: list[tuple[int, int, list[int]]]          # (row, ctx_len, block table)
    prefills: list[tuple[int, int, int, list[int]]]    # (row, n, ctx_len, block table)
    rows: list[int] | None                             # logits rows; None = all

    def metadata(self, block_size: int, device: torch.device):
        return build_metadata(self.slot_blocks, self.slot_offsets, self.decodes, self.prefills, block_size, device)

    def rows_tensor(self, device: torch.device) -> torch.Tensor | None:
        return None if self.rows is None else torch.tensor(self.rows, dtype=_I64, device=device)

    def positions_tensor(self, device: torch.device) -> torch.Tensor:
        return torch.tensor(self.positions, dtype=_I64, device=device)


def encode(batch: StageBatch, hidden: torch.Tensor) -> torch.Tensor:
    """The microbatch and the hidden states [T, hidden] entering the next stage, as one uint8 tensor."""
    T = len(batch.positions)
    if hidden.dim() != 2 or hidden.shape[0] != T:
        raise ValueError(f"hidden states {tuple(hidden.shape)} do not match {T} tokens")
    words: list[int] = [batch.mb_id, T, hidden.shape[1], len(batch.decodes), len(batch.prefills),
                        -1 if batch.rows is None else len(batch.rows)]
    words += batch.positions + batch.slot_blocks + batch.slot_offsets
    for row, ctx, table in batch.decodes:
        words += [row, ctx, len(table), *table]
    for row, n, ctx, table in batch.prefills:
        words += [row, n, ctx, len(table), *table]
    if batch.rows is not None:
        words += batch.rows
    meta = torch.tensor([len(words), *words], dtype=_I64)
    payload = hidden.detach().contiguous().cpu().view(torch.uint8).reshape(-1)
    return torch.cat([meta.view(torch.uint8), payload])


def decode(data: torch.Tensor, dtype: torch.dtype) -> tuple[StageBatch, torch.Tensor]:
    """Inverse of encode: (batch, hidden states [T, hidden] of `dtype`)."""
    if data.dtype != torch.uint8 or data.dim() != 1 or data.numel() < 8:
        raise ValueError("a stage microbatch is a flat uint8 tensor")
    try:
        return _decode(data, dtype)
    except (RuntimeError, IndexError, ValueError) as exc:
        raise ValueError(f"malformed stage microbatch ({data.numel()} bytes): {exc}") from None


def _decode(data: torch.Tensor, dtype: torch.dtype) -> tuple[StageBatch, torch.Tensor]:
    n = int(data[:8].view(_I64)[0])
    if n < 6 or 8 + 8 * n > data.numel():
        raise ValueError(f"metadata of {n} words does not fit")
    words = data[8:8 + 8 * n].view(_I64).tolist()
    mb_id, T, H, nd, npf, nr = words[:6]
    at = 6
    positions = words[at:at + T]
    slot_b = words[at + T:at + 2 * T]
    slot_o = words[at + 2 * T:at + 3 * T]
    at += 3 * T
    decodes = []
    for _ in range(nd):
        row, ctx, k = words[at:at + 3]
        decodes.append((row, ctx, words[at + 3:at + 3 + k]))
        at += 3 + k
    prefills = []
    for _ in range(npf):
        row, cnt, ctx, k = words[at:at + 4]
        prefills.append((row, cnt, ctx, words[at + 4:at + 4 + k]))
        at += 4 + k
    rows = None if nr < 0 else words[at:at + nr]
    if T < 0 or H < 0 or nd < 0 or npf < 0 or at + max(nr, 0) != n:
        raise ValueError(f"inconsistent metadata (T={T}, hidden={H}, {nd} decodes, {npf} prefills, {nr} rows, "
                         f"{n} words)")
    payload = data[8 + 8 * n:]
    itemsize = torch.empty((), dtype=dtype).element_size()
    if payload.numel() != T * H * itemsize:
        raise ValueError(f"{payload.numel()} payload bytes for {T} x {H} {dtype} hidden states")
    hidden = payload.view(dtype).reshape(T, H)
    return StageBatch(mb_id, positions, slot_b, slot_o, decodes, prefills, rows), hidden
