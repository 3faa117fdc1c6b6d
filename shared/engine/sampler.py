"""Token sampling. Greedy rows are one batched argmax; sampled rows use each request's own seeded
generator, so a seed gives the same tokens whatever else shares the batch.

Numerically safe by construction: a row is shifted by its maximum *before* it is divided by the
temperature, so every scaled logit is <= 0 and the maximum is exactly 0. Whatever the (finite)
temperature — 1e-40 included, where a plain ``logits / T`` overflows to inf and softmax to NaN — the
probabilities are finite, non-negative and sum to 1 (the arg-max's weight is exp(0) = 1, so the
normaliser is never 0). The arithmetic is float64, where every finite temperature a request can carry
is non-zero. A row whose *logits* are not finite (a numerical fault in the model for that
request) cannot be sampled; ``sample_rows`` reports it as ``None`` so the engine fails that request
alone instead of the whole batch (or the engine thread).

Log-probabilities (``token_logprobs``) are computed after the tokens are chosen, from the same logits and
without touching the generators, so asking for them never changes a token.
"""

from __future__ import annotations

import torch

from kunserve.shared.engine.api import SamplingParams, TokenLogprob

ChosenLogprobs = tuple[float, tuple[TokenLogprob, ...]]  # the chosen token's logprob, the top-N (descending)


class SamplingFailed(ValueError):
    """A row's logits were not finite; ``row`` says which."""

    def __init__(self, row: int) -> None:
        super().__init__(f"row {row}: cannot be sampled (non-finite logits)")
        self.row = row


def probabilities(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution one sampled (temperature > 0) row draws from: temperature, then top-k, then top-p.
    `logits` is one finite row [vocab]; the result is finite, >= 0 and sums to 1."""
    row = logits.double()  # a float32 scalar would round a subnormal temperature (5e-324) to 0
    if p.top_k > 0 and p.top_k < row.shape[-1]:
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    scaled = (row - row.max()) / p.temperature  # <= 0 everywhere, exactly 0 at the arg-max: no overflow
    probs = torch.softmax(scaled, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, idx = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_probs, 0)
        drop = cum - sorted_probs > p.top_p  # keep the smallest prefix whose mass reaches top_p (never empty)
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, idx, sorted_probs)
        probs = probs / probs.sum()
    return probs


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
                banned: dict[int, list[int]] | None = None) -> list[int | None]:
    """logits [B, vocab] -> one token id per row, or None for a row whose logits are not finite. `banned`: row ->
    token ids that row may not produce now (a request short of its min_tokens cannot end yet)."""
    # one pass for the arg-max and the row maxima, one for the minima: a row is finite when both are (NaN
    # propagates through both); cheaper than materializing isfinite over the whole [B, vocab]
    best, top = logits.max(dim=-1)
    finite = (torch.isfinite(best) & torch.isfinite(logits.amin(dim=-1))).tolist()
    if banned:
        logits = logits.clone()
        for i, ids in banned.items():
            logits[i, ids] = float("-inf")
        top = logits.argmax(dim=-1)
    out: list[int | None] = top.tolist()
    for i, p in enumerate(params):
        if not finite[i]:
            out[i] = None
        elif not p.greedy:
            try:
                out[i] = int(torch.multinomial(probabilities(logits[i], p), 1, generator=generators[i]).item())
            except RuntimeError:  # not expected (see the module docstring); if it happens it is this row's alone
                out[i] = None
    return out


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """Like sample_rows, for callers with no per-request failure path (the in-process pipeline of the tests and
    benchmarks): SamplingFailed names the first bad row."""
    out = sample_rows(logits, params, generators)
    for i, tok in enumerate(out):
        if tok is None:
            raise SamplingFailed(i)
    return out  # type: ignore[return-value]


def token_logprobs(logits: torch.Tensor, params: list[SamplingParams], tokens: list[int | None]) -> list[ChosenLogprobs | None]:
    """For each row whose request asked for logprobs (and that produced a token): log_softmax of its raw logits
    (float32, before temperature / top-k / top-p: vLLM's default) at the chosen token, and its
    `logprobs` most likely tokens. One batched log_softmax over those rows only: rows that did not ask cost
    nothing, and a batch where none asked costs one pass over `params`."""
    out: list[ChosenLogprobs | None] = [None] * len(params)
    want = [i for i, p in enumerate(params) if p.logprobs is not None and tokens[i] is not None]
    if not want:
        return out
    lp = torch.log_softmax(logits[torch.tensor(want, dtype=torch.long, device=logits.device)].float(), dim=-1)
    chosen_ids = torch.tensor([tokens[i] for i in want], dtype=torch.long, device=lp.device)
    chosen = lp.gather(1, chosen_ids.unsqueeze(1)).squeeze(1).tolist()
    k = min(max(params[i].logprobs or 0 for i in want), lp.shape[-1])
    top_v: list[list[float]] = [[] for _ in want]
    top_i: list[list[int]] = [[] for _ in want]
    if k > 0:
        top = torch.topk(lp, k, dim=-1)  # sorted, descending
        top_v, top_i = top.values.tolist(), top.indices.tolist()
    for j, i in enumerate(want):
        n = params[i].logprobs or 0
        out[i] = (chosen[j], tuple(TokenLogprob(t, v) for t, v in zip(top_i[j][:n], top_v[j][:n])))
    return out
