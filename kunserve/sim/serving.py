"""What the live serving path adds to a request beyond the engine's own iterations, measured on a real cluster.

A profile (`kunserve profile`) times forward passes and the engine loop in one process on an idle core. A request
on the live cluster also crosses three processes (client -> dispatcher -> worker, and each token back the same
way), and on a machine with fewer cores than processes the token streams, the gRPC servers and the other workers
take CPU from the forward passes. `--validate` measures what that adds on the real cluster it starts, before and
after it replays the trace, with a probe trace:

* lone requests of several prompt lengths, one per worker at once (both workers compute, as under load): their first
  token prices the prefill (a slowdown of the forward pass) and the request latency (the request's way in and its
  first token's way out), their decode gaps a one-sequence iteration;
* bursts of simultaneous short requests, which the router spreads over the workers: the decode gaps at larger
  batches separate a per-sequence cost (each sampled token's event, hop and stream write) from the per-iteration
  constant.

`fit_serving` fits the forward-pass scale, the per-iteration and per-sequence costs and the request latency together
(non-negative least squares on relative residuals) against the time model's forward passes, and `with_serving`
puts them in its place: the live measurement includes the engine loop a profile measures, so the profile's loop
overhead is left out.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from kunserve.benchkit.stats import RequestResult
from kunserve.benchkit.trace import TraceRequest
from kunserve.shared.policy.costmodel import BatchShape, LoopOverhead, nnls
from kunserve.sim.timing import TimeModel

PROBE_PROMPTS = (16, 64, 256, 512, 768, 1024)  # first-token probes: one request per worker at once, each length twice
PROBE_REPEATS = 2
PROBE_OUTPUT = 16
PAIR_GAP_S = 0.6
BURST_PROMPT = 16
BURST_OUTPUT = 24
PROBE_BURSTS = (4, 8, 16)  # simultaneous requests per worker in a burst
BURST_GAP_S = 2.0


@dataclass(frozen=True)
class ServingOverhead:
    """What the serving path adds: the forward pass's slowdown on the live machine (`forward_scale`, 1 = the
    profile's speed), seconds per iteration, per sequence in an iteration, and per request."""

    forward_scale: float
    iteration_s: float
    per_sequence_s: float
    request_latency_s: float
    decode_points: int
    first_token_points: int
    mean_rel_err: float  # of the fit over the probe's conditions (each its measurements' median)

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


def probe_trace(workers: int) -> list[TraceRequest]:
    """The probe: for each of PROBE_PROMPTS (PROBE_REPEATS times), `workers` requests at once (one per worker: the
    router spreads simultaneous arrivals), PAIR_GAP_S apart; then bursts of PROBE_BURSTS x `workers` short
    requests."""
    workers = max(1, workers)
    out: list[TraceRequest] = []
    t = 0.0
    for _ in range(PROBE_REPEATS):
        for prompt in PROBE_PROMPTS:
            out += [TraceRequest(t, prompt, PROBE_OUTPUT) for _ in range(workers)]
            t += PAIR_GAP_S
    t += 1.0
    for size in PROBE_BURSTS:
        out += [TraceRequest(t, BURST_PROMPT, BURST_OUTPUT) for _ in range(size * workers)]
        t += BURST_GAP_S
    return out


def _decode_shape(batch: int, prompt: int, output: int) -> BatchShape:
    """A decode batch of `batch` probe requests halfway through their outputs."""
    return BatchShape.of([(1, prompt + output // 2)] * batch)


def fit_serving(
    trace: Sequence[TraceRequest], runs: Sequence[Sequence[RequestResult]], time: TimeModel, num_layers: int
) -> ServingOverhead:
    """The serving overhead the probe's real `runs` (each the results of one replay of `trace`: `--validate` probes
    before and after the trace, so a machine whose load changes is seen at both ends) show beyond `time`'s forward
    passes.

    Every finished probe request gives a decode measurement, its mean time per output token = scale x the predicted
    decode step of its batch + iteration + batch x per-sequence (its batch: the requests of its group, same arrival
    time, that ran on its worker); a request alone on its worker gives a first-token measurement too, its TTFT =
    scale x the predicted prefill step + iteration + per-sequence + request latency. The measurements of one
    condition (batch size and lengths; prompt length) are reduced to their median, since a stall on a shared machine
    delays one request's tokens and then delivers them in a burst (a TTFT several times too long and a time per
    token near zero), and the medians are fitted by non-negative least squares on relative residuals, as the cost
    models are. ValueError when no probe request finished."""
    groups: dict[tuple[int, float], list[RequestResult]] = {}
    for k, results in enumerate(runs):
        for r in results:
            if r.ok and r.tpot_s is not None and r.tpot_s > 0:
                groups.setdefault((k, trace[r.index].arrival_s), []).append(r)
    if not groups:
        raise ValueError("no probe request finished: cannot measure the serving overhead")
    conditions: dict[tuple[str, int, int, int], tuple[list[float], list[float]]] = {}
    decodes = firsts = 0
    for members in groups.values():
        per_worker = Counter(r.worker_id for r in members)
        for r in members:
            n = per_worker[r.worker_id]
            req = trace[r.index]
            assert r.tpot_s is not None
            step = time.forward_s(_decode_shape(n, req.prompt_tokens, req.output_tokens), num_layers, num_layers)
            conditions.setdefault(("decode", n, req.prompt_tokens, req.output_tokens), ([step, 1.0, float(n), 0.0], []))[1].append(r.tpot_s)
            decodes += 1
            if n == 1 and r.ttft_s is not None and r.ttft_s > 0:
                prefill = time.forward_s(BatchShape.of([(req.prompt_tokens, 0)]), num_layers, num_layers)
                conditions.setdefault(("first", 1, req.prompt_tokens, 0), ([prefill, 1.0, 1.0, 1.0], []))[1].append(r.ttft_s)
                firsts += 1
    rows = [row for row, _ in conditions.values()]
    measured = [statistics.median(values) for _, values in conditions.values()]
    scale, iteration, per_sequence, latency = nnls([[v / m for v in row] for row, m in zip(rows, measured, strict=True)], [1.0] * len(rows))
    predicted = [scale * a + iteration * b + per_sequence * c + latency * d for a, b, c, d in rows]
    err = statistics.fmean(abs(p - m) / m for p, m in zip(predicted, measured, strict=True))
    return ServingOverhead(scale, iteration, per_sequence, latency, decodes, firsts, err)


def with_serving(time: TimeModel, overhead: ServingOverhead) -> TimeModel:
    """`time` under the measured serving overhead: its forward passes scaled, and the live per-iteration, per-sequence
    and per-request costs in place of its own (the live measurement includes the engine loop the profile measured,
    so the profile's loop overhead is left out)."""
    import dataclasses

    return dataclasses.replace(
        time,
        profile=dataclasses.replace(time.profile, loop=LoopOverhead()),
        forward_scale=time.forward_scale * overhead.forward_scale,
        iteration_overhead_s=overhead.iteration_s,
        sequence_overhead_s=overhead.per_sequence_s,
        request_latency_s=overhead.request_latency_s,
        source=f"{time.source} + serving overhead measured on the live cluster",
    )


__all__ = ["ServingOverhead", "fit_serving", "probe_trace", "with_serving"]
