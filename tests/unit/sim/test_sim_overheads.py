"""What an iteration and a request cost beyond the forward pass: the engine loop's overhead (fitted by the profiler,
stored in the profile file, old files reading as zero), the serving overhead `--validate` fits from its probe, and
the simulator's time model using both."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kunserve.benchkit.stats import RequestResult
from kunserve.benchkit.trace import TraceRequest
from kunserve.shared.policy.costmodel import BatchShape, ConServeLatencyModel, LoopOverhead, fit_loop_overhead
from kunserve.shared.profile_files import ProfileError, read_profiles, write_profile
from kunserve.sim.cluster import Simulation
from kunserve.sim.scenario import LOCAL_LINKS
from kunserve.sim.serving import PROBE_PROMPTS, PROBE_REPEATS, ServingOverhead, fit_serving, probe_trace, with_serving
from kunserve.sim.timing import Links, TimeModel

CON = ConServeLatencyModel(k1=3e-4, k2=5e-8, k4=2e-6, k5=1e-2)


def _decodes(n: int, ctx: int = 40) -> BatchShape:
    return BatchShape.of([(1, ctx)] * n)


# -- the loop overhead fit ---------------------------------------------------------------------------------------
def test_loop_overhead_fit_recovers_a_constant_and_a_per_sequence_cost():
    steps = [(_decodes(n, ctx), CON.shape_cost(_decodes(n, ctx)) + 2e-3 + 1e-4 * n) for n in (1, 4, 16, 32) for ctx in (20, 90)]
    fit = fit_loop_overhead(steps, CON)
    assert fit.iteration_s == pytest.approx(2e-3, rel=1e-6)
    assert fit.per_sequence_s == pytest.approx(1e-4, rel=1e-6)
    assert fit.points == len(steps) and fit.mean_abs_err_s == pytest.approx(0.0, abs=1e-12)
    assert fit.cost(10) == pytest.approx(3e-3) and fit.cost(0) == 0.0


def test_loop_overhead_is_never_negative():
    """Steps faster than the model predicts (the fit's own error) give no overhead, not a negative one."""
    steps = [(_decodes(n), CON.shape_cost(_decodes(n)) * 0.9) for n in (1, 8, 32)]
    fit = fit_loop_overhead(steps, CON)
    assert fit.iteration_s == 0.0 and fit.per_sequence_s == 0.0
    assert fit_loop_overhead([], CON) == LoopOverhead()


def test_measured_loop_overhead_on_a_real_engine():
    """Against a model that predicts nothing, the whole decode step is overhead: the fit sees every decode iteration
    and charges a positive cost for every batch size."""
    import torch

    from kunserve.shared.engine.profiler import measure_loop_overhead
    from kunserve.shared.model.architecture import TINY_CONFIG
    from kunserve.shared.model.weights import random_weights

    torch.set_num_threads(1)
    cfg = TINY_CONFIG.replace(num_layers=2, name="small")
    fit = measure_loop_overhead(cfg, random_weights(cfg, 0), ConServeLatencyModel(0.0, 0.0), batches=((1, 8, 5), (3, 8, 5)))
    assert fit.points == 8  # 4 decode iterations per batch: tokens 2-5 (the first comes from the prefill)
    assert fit.cost(1) > 0 and fit.cost(3) > 0


# -- profile files -----------------------------------------------------------------------------------------------
@pytest.fixture
def profile(make_setup):
    return make_setup().time.profile


def test_loop_overhead_round_trips_through_a_profile_file(tmp_path, profile):
    path = tmp_path / "p.json"
    prof = dataclasses.replace(profile, loop=LoopOverhead(2e-3, 1e-4, 48, 5e-4))
    write_profile(path, prof)
    (back,) = read_profiles(path).values()
    assert back.loop == prof.loop


def test_a_profile_written_before_loop_overheads_reads_as_zero(tmp_path, profile):
    path = tmp_path / "old.json"
    write_profile(path, profile)
    data = json.loads(path.read_text())
    for entry in data["profiles"].values():
        del entry["loop_overhead"]
    path.write_text(json.dumps(data))
    (back,) = read_profiles(path).values()
    assert back.loop == LoopOverhead() and back.loop.points == 0
    time = TimeModel(back, make_links(), "old")
    assert "not in the profile" in str(time.describe()["loop_overhead"])
    for entry in data["profiles"].values():
        entry["loop_overhead"] = {"iteration_s": -1.0}
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="malformed"):
        read_profiles(path)


def make_links() -> Links:
    return LOCAL_LINKS


# -- the time model ----------------------------------------------------------------------------------------------
def test_an_iteration_costs_forward_plus_loop_plus_serving(profile):
    prof = dataclasses.replace(profile, loop=LoopOverhead(2e-3, 1e-4, 10))
    time = TimeModel(prof, make_links(), "t", iteration_overhead_s=1e-3, sequence_overhead_s=5e-5)
    shape = _decodes(8)
    assert time.step_s(shape, 4, 4) == pytest.approx(prof.conserve.shape_cost(shape) + 2e-3 + 8e-4 + 1e-3 + 4e-4)
    assert time.step_s(BatchShape(), 4, 4) == 0.0
    with pytest.raises(ValueError, match="request_latency_s"):
        TimeModel(prof, make_links(), "t", request_latency_s=-1.0)


def test_request_latency_delays_the_first_token_by_exactly_itself(make_setup):
    """One request on an idle cluster: the latency is the only difference."""
    trace = [TraceRequest(0.5, 64, 8)]
    base = make_setup()
    late = dataclasses.replace(base, time=dataclasses.replace(base.time, request_latency_s=0.03))
    (r0,) = Simulation(base, trace).run().replay.results
    (r1,) = Simulation(late, trace).run().replay.results
    assert r0.ok and r1.ok
    assert r1.ttft_s == pytest.approx(r0.ttft_s + 0.03)
    assert r1.tpot_s == pytest.approx(r0.tpot_s)


# -- the serving overhead fit ------------------------------------------------------------------------------------
def _probe_results(time: TimeModel, num_layers: int, workers: int, truth: ServingOverhead) -> list[RequestResult]:
    """What a live cluster whose serving path costs `truth` would measure for the probe (perfect round-robin)."""
    trace = probe_trace(workers)
    served = with_serving(time, truth)
    groups: dict[float, list[int]] = {}
    for i, r in enumerate(trace):
        groups.setdefault(r.arrival_s, []).append(i)
    out = []
    for members in groups.values():
        for k, i in enumerate(members):
            r = trace[i]
            n = len([j for j in range(len(members)) if j % workers == k % workers])
            tpot = served.step_s(BatchShape.of([(1, r.prompt_tokens + r.output_tokens // 2)] * n), num_layers, num_layers)
            ttft = truth.request_latency_s + served.step_s(BatchShape.of([(r.prompt_tokens, 0)]), num_layers, num_layers)
            times = [ttft + j * tpot for j in range(r.output_tokens)]
            out.append(
                RequestResult(
                    i, r.arrival_s, r.arrival_s, r.prompt_tokens, r.output_tokens, ttft, times, times[-1], True, "", f"w{k % workers}"
                )
            )
    return out


def test_fit_serving_recovers_the_overheads_of_the_live_path(make_setup):
    setup = make_setup()
    layers = setup.shape.num_layers
    truth = ServingOverhead(1.7, 1.5e-3, 2e-4, 0.02, 0, 0, 0.0)
    trace = probe_trace(2)
    fit = fit_serving(trace, [_probe_results(setup.time, layers, 2, truth)] * 2, setup.time, layers)
    assert fit.forward_scale == pytest.approx(truth.forward_scale, rel=1e-6)
    assert fit.iteration_s == pytest.approx(truth.iteration_s, rel=1e-6)
    assert fit.per_sequence_s == pytest.approx(truth.per_sequence_s, rel=1e-6)
    assert fit.request_latency_s == pytest.approx(truth.request_latency_s, rel=1e-6)
    assert fit.first_token_points == 2 * 2 * PROBE_REPEATS * len(PROBE_PROMPTS) and fit.decode_points == 2 * len(trace)
    assert fit.mean_rel_err == pytest.approx(0.0, abs=1e-9)
    served = with_serving(setup.time, fit)
    assert served.profile.loop == LoopOverhead() and served.request_latency_s == pytest.approx(0.02)
    stalled = _probe_results(setup.time, layers, 2, truth)
    first = stalled[0]  # a stall: its first token 5x late, then every token at once
    late = 5 * first.ttft_s
    stalled[0] = dataclasses.replace(first, ttft_s=late, token_times_s=[late + 1e-5 * j for j in range(len(first.token_times_s))])
    robust = fit_serving(trace, [stalled, _probe_results(setup.time, layers, 2, truth)], setup.time, layers)
    assert robust.iteration_s == pytest.approx(truth.iteration_s, rel=1e-6)
    assert robust.request_latency_s == pytest.approx(truth.request_latency_s, rel=1e-6)
    with pytest.raises(ValueError, match="no probe request finished"):
        fit_serving(trace, [[]], setup.time, layers)
