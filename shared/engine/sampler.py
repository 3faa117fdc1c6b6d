"""Token sampling. Greedy rows are one batched argmax; sampled rows use each request's own seeded
generator, so a seed gives the same tokens whatever else shares the batch."""

from __future__ import annotations

import torch

from kunserve.shared.engine.api import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """logits [B, vocab] float32 -> one token id per row."""
    out = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = logits[i].float() / p.temperature
        if p.top_k > 0 and p.top_k < row.shape[-1]:
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, idx = torch.sort(probs, descending=True)
            cum = torch.cumsum(sorted_probs, 0)
            drop = cum - sorted_probs > p.top_p  # keep the smallest prefix whose mass reaches top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, idx, sorted_probs)
        out[i] = int(torch.multinomial(probs, 1, generator=generators[i]).item())
    return out
