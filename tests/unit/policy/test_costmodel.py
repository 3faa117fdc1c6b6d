"""Cost models (KunServe Eq. 1-3, ConServe's latency model), their non-negative least-squares fit, the
profile file and the profiler harness. No assertion on wall-clock time: the harness is checked for
what it measures (shapes, counts), the fit on synthetic data with known coefficients."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kunserve.shared.policy.costmodel import (
    BatchShape,
    ConServeLatencyModel,
    KunServeCostModel,
    Sample,
    fit_conserve,
    fit_kunserve,
    nnls,
    relative_errors,
    split_holdout,
)
from kunserve.shared.profile_files import Profile, ProfileError, device_signature, find_profile, profile_key, read_profiles, write_profile

KUN = KunServeCostModel(alpha=9e-8, beta=8.5e-5, gamma=3.7e-3, lam=3.5e-3)
CON = ConServeLatencyModel(k1=8.8e-5, k2=6e-8, k3=0.0, k4=9.6e-7, k5=3.2e-3)


def synthetic_batches(rng: random.Random, n: int) -> list[tuple[str, tuple[tuple[int, int], ...]]]:
    out = []
    for _ in range(n):
        kind = rng.choice(["prefill", "chunked_prefill", "decode", "mixed"])
        if kind == "prefill":
            chunks = [(rng.randint(2, 1024), 0) for _ in range(rng.randint(1, 4))]
        elif kind == "chunked_prefill":
            chunks = [(rng.randint(2, 512), rng.randint(1, 1536))]
        elif kind == "decode":
            chunks = [(1, rng.randint(0, 1023))] * rng.randint(1, 64)
        else:
            chunks = [(1, rng.randint(0, 1023)) for _ in range(rng.randint(1, 16))] + [(rng.randint(2, 256),
                                                                                        rng.randint(0, 512))]
        out.append((kind, tuple(chunks)))
    return out


def samples_from(model, noise: float, seed: int, n: int = 160) -> list[Sample]:
    rng = random.Random(seed)
    return [Sample(kind, chunks, model.shape_cost(BatchShape.of(chunks)) * (1 + rng.uniform(-noise, noise)))
            for kind, chunks in synthetic_batches(rng, n)]


# -- the models -------------------------------------------------------------------------------------------
def test_kunserve_equations_by_hand():
    m = KunServeCostModel(alpha=2.0, beta=3.0, gamma=5.0, lam=1.0)
    # Eq. 1: alpha * (p*c + (c^2 + c)/2) + beta*c + gamma
    assert m.chunk_cost(4, 10) == 2.0 * (40 + 10) + 12 + 5
    assert m.chunk_cost(0, 10) == 0.0
    # Eq. 3: sum - (|b| - 1) * lambda
    assert m.batch_cost([(4, 10), (1, 7)]) == m.chunk_cost(4, 10) + m.chunk_cost(1, 7) - 1.0
    assert m.batch_cost([]) == 0.0


def test_conserve_equation_by_hand_and_per_sequence_attention():
    m = ConServeLatencyModel(k1=1.0, k2=0.5, k3=0.25, k4=2.0, k5=7.0)
    P, C = 10, 30
    assert m.latency(P, C) == 1.0 * P + 0.5 * P * (P + C) + 0.25 * P + 2.0 * (P + C) + 7.0
    assert m.batch_latency([(P, C)]) == m.latency(P, C)  # one sequence: exactly the paper's formula
    # two sequences: attention is summed per sequence, everything else over the totals
    two = m.batch_latency([(10, 30), (4, 2)])
    assert two == 1.25 * 14 + 0.5 * (10 * 40 + 4 * 6) + 2.0 * (14 + 32) + 7.0


def test_decode_shape_matches_the_chunk_list():
    ctxs = [5, 17, 300, 1]
    a = BatchShape.of([(1, c - 1) for c in ctxs])
    b = BatchShape.of_decodes(len(ctxs), sum(ctxs))
    assert (a.num_chunks, a.tokens, a.context, a.attn_pairs, a.attn_kun) == \
        (b.num_chunks, b.tokens, b.context, b.attn_pairs, b.attn_kun)
    assert BatchShape.of_decodes(0, 0).num_chunks == 0


coef = st.floats(min_value=0.0, max_value=1e-2, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(a=coef, b=coef, g=coef, lam_frac=st.floats(0, 1), c=st.integers(1, 4096), p=st.integers(0, 8192),
       k=st.lists(coef, min_size=5, max_size=5), others=st.lists(st.tuples(st.integers(1, 512), st.integers(0, 2048)),
                                                                 max_size=6))
def test_predictions_are_monotonic_in_tokens_and_prefix(a, b, g, lam_frac, c, p, k, others):
    kun = KunServeCostModel(a, b, g, g * lam_frac)  # a fit keeps lambda <= gamma (gamma - lambda >= 0)
    con = ConServeLatencyModel(*k)
    for m in (kun, con):
        base = BatchShape.of(others)
        here = m.shape_cost(base.with_chunk(c, p))
        assert m.shape_cost(base.with_chunk(c + 1, p)) >= here
        assert m.shape_cost(base.with_chunk(c, p + 1)) >= here
        assert here >= m.shape_cost(base) - 1e-12  # adding a chunk never makes a batch cheaper
    assert con.latency(c + 1, p) >= con.latency(c, p) and con.latency(c, p + 1) >= con.latency(c, p)


# -- the fit ------------------------------------------------------------------------------------------------
def test_nnls_matches_least_squares_and_clamps_negatives():
    rows = [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]
    assert nnls(rows, [1.0, 2.0, 3.0]) == pytest.approx([1.0, 2.0])
    x = nnls(rows, [1.0, -2.0, -1.0])  # unconstrained optimum has a negative second coefficient
    assert min(x) >= 0.0 and x[1] == 0.0
    with pytest.raises(ValueError):
        nnls([], [])


@pytest.mark.parametrize("noise", [0.0, 0.02])
def test_fit_recovers_known_kunserve_coefficients(noise):
    fitted = fit_kunserve(samples_from(KUN, noise, seed=1))
    tol = 1e-6 if noise == 0 else 0.06
    for name, want in (("alpha", KUN.alpha), ("beta", KUN.beta), ("gamma", KUN.gamma), ("lam", KUN.lam)):
        assert getattr(fitted, name) == pytest.approx(want, rel=tol), name
    held = samples_from(KUN, noise, seed=2, n=60)
    err = relative_errors(fitted, held)
    assert err.max_rel_err <= (1e-6 if noise == 0 else 2.5 * noise)
    assert set(err.per_phase) == {"prefill", "chunked_prefill", "decode", "mixed"}


@pytest.mark.parametrize("noise", [0.0, 0.02])
def test_fit_recovers_known_conserve_coefficients(noise):
    fitted = fit_conserve(samples_from(CON, noise, seed=3))
    tol = 1e-6 if noise == 0 else 0.06
    assert fitted.k3 == 0.0  # not identifiable on one device: folded into k1
    for name in ("k1", "k2", "k4", "k5"):
        assert getattr(fitted, name) == pytest.approx(getattr(CON, name), rel=tol), name
    assert relative_errors(fitted, samples_from(CON, noise, seed=4, n=60)).mean_rel_err <= (1e-6 if noise == 0
                                                                                              else noise)


def test_fit_of_unmodelled_data_stays_non_negative():
    rng = random.Random(5)
    # a convex-ish, unmodelled cost: the fit must still give a usable, monotonic model
    samples = [Sample(kind, ch, 1e-3 + 1e-9 * sum(c * c * c + p for c, p in ch) * (1 + rng.random()))
               for kind, ch in synthetic_batches(rng, 80)]
    for m in (fit_kunserve(samples), fit_conserve(samples)):
        assert all(v >= 0 for v in m.to_dict().values())


def test_holdout_split_is_deterministic_and_covers_every_phase():
    s = samples_from(KUN, 0.0, seed=6, n=80)
    train, held = split_holdout(s)
    assert split_holdout(s) == (train, held)
    assert len(train) + len(held) == len(s) and not set(map(id, train)) & set(map(id, held))
    assert {x.phase for x in held} == {x.phase for x in s}


# -- profile files ------------------------------------------------------------------------------------------
def _profile(layers=(0, 4), device="cpu[test]x1t") -> Profile:
    samples = samples_from(KUN, 0.01, seed=7, n=20)
    return Profile(model="kunserve-tiny", dtype="float32", layers=layers, device=device, kunserve=KUN, conserve=CON,
                   fit={"train_points": 15}, samples=samples, created_unix_s=1.0, torch_version="x")


def test_profile_file_round_trip_and_lookup(tmp_path):
    path = tmp_path / "prof.json"
    write_profile(path, _profile())
    write_profile(path, _profile(layers=(0, 2)))  # a second entry is added, the first kept
    held = read_profiles(path)
    assert len(held) == 2
    p = find_profile(path, model="kunserve-tiny", dtype="float32", layers=(0, 4), device_sig="cpu[test]x1t")
    assert p.kunserve == KUN and p.conserve == CON and p.samples == _profile().samples
    assert p.key == profile_key("kunserve-tiny", "float32", (0, 4), "cpu[test]x1t")
    with pytest.raises(ProfileError, match="layers=1-4"):
        find_profile(path, model="kunserve-tiny", dtype="float32", layers=(1, 4), device_sig="cpu[test]x1t")
    with pytest.raises(ProfileError, match="no profile"):
        find_profile(path, model="kunserve-tiny", dtype="float32", layers=(0, 4), device_sig="cpu[other]x2t")


def test_profile_file_errors(tmp_path):
    with pytest.raises(ProfileError, match="does not exist"):
        read_profiles(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ProfileError, match="cannot read"):
        read_profiles(bad)
    bad.write_text(json.dumps({"format": "other"}))
    with pytest.raises(ProfileError, match="not a kunserve-profile"):
        read_profiles(bad)
    bad.write_text(json.dumps({"format": "kunserve-profile/1", "profiles": {"k": {"model": "m"}}}))
    with pytest.raises(ProfileError, match="malformed"):
        read_profiles(bad)


def test_device_signature_names_the_thread_count():
    assert device_signature("cpu", 2).startswith("cpu[") and device_signature("cpu", 2).endswith("x2t")
    assert device_signature("cpu", 1) != device_signature("cpu", 2)


# -- the profiler harness -----------------------------------------------------------------------------------
def test_profiler_times_every_phase_on_any_layer_range():
    import torch

    from kunserve.shared.engine.profiler import BatchTimer, fit_profile, grid_blocks, measure_grid, profile_grid
    from kunserve.shared.model.architecture import TINY_CONFIG
    from kunserve.shared.model.weights import random_weights

    torch.set_num_threads(1)
    cfg = TINY_CONFIG.replace(num_layers=2, name="small")
    w = random_weights(cfg, 0)
    grid = profile_grid(256, quick=True)
    assert {ph for ph, _ in grid} == {"prefill", "chunked_prefill", "decode", "mixed"}
    assert all(c + p <= 256 for _, chunks in grid for c, p in chunks)
    seen = []
    for layers in ((0, 1), (1, 2)):  # a head stage (embeds token ids) and a last stage (hidden states in)
        timer = BatchTimer(cfg, w, layers, "cpu", max_blocks=grid_blocks(grid, 16))
        samples = measure_grid(timer, grid, repeats=1, progress=lambda i, n, pt: seen.append(i))
        assert len(samples) == len(grid) and all(s.seconds > 0 for s in samples)
        run = fit_profile(samples, model=cfg.name, dtype=cfg.dtype, layers=layers, device_sig="cpu[t]x1t")
        fit = run.profile.fit
        assert fit["train_points"] + fit["heldout_points"] == len(samples)
        for m in ("kunserve", "conserve"):
            assert fit[m]["heldout"]["points"] == len(run.heldout) and fit[m]["heldout"]["mean_rel_err"] >= 0
        assert all(v >= 0 for v in run.profile.kunserve.to_dict().values())
    assert seen[-1] == len(grid)
    with pytest.raises(ValueError, match="KV blocks"):
        BatchTimer(cfg, w, (0, 2), "cpu", max_blocks=2).run(((64, 0),))
