"""The measured latency model: the profile's prediction scaled by the measured iterations (or a group's
microbatch round trips), the assumed scale until measured; the SLO budget over it admits fewer tokens when the
iterations are slower than the profile says."""

from __future__ import annotations

import pytest

from kunserve.shared.policy.costmodel import BatchShape, ConServeLatencyModel
from kunserve.shared.policy.measured_latency import MeasuredLatencyModel
from kunserve.shared.policy.token_budget import SLOTokenBudget

BASE = ConServeLatencyModel(k1=1e-4, k2=0.0, k3=0.0, k4=0.0, k5=2e-3)


def test_unmeasured_it_uses_the_assumed_scale():
    shape = BatchShape.of([(100, 0)])
    assert MeasuredLatencyModel(BASE).shape_cost(shape) == pytest.approx(BASE.shape_cost(shape))
    assert MeasuredLatencyModel(BASE, assumed_scale=2).shape_cost(shape) == pytest.approx(2 * BASE.shape_cost(shape))


def test_the_scale_follows_the_measurements():
    m = MeasuredLatencyModel(BASE, assumed_scale=2, weight=0.5)
    shape = BatchShape.of([(1, 50)] * 8)
    p = BASE.shape_cost(shape)
    m.observe(shape, 1.5 * p)
    assert m.scale == pytest.approx(1.5), "the first measurement replaces the assumption"
    m.observe(shape, 1.1 * p)
    assert m.scale == pytest.approx(1.3)
    m.observe(BatchShape(), 5.0)  # nothing predicted: says nothing
    m.observe(shape, 0.0)
    assert m.scale == pytest.approx(1.3) and m.observations == 2


def test_slower_iterations_get_a_smaller_budget():
    fast = SLOTokenBudget(MeasuredLatencyModel(BASE, scale=1.0), tbt_s=0.05)
    slow = SLOTokenBudget(MeasuredLatencyModel(BASE, scale=2.0), tbt_s=0.05)
    assert slow.max_tokens_for(4) < fast.max_tokens_for(4)


@pytest.mark.parametrize("kwargs", [{"assumed_scale": 0}, {"weight": 0.0}, {"weight": 1.5}])
def test_bad_parameters_are_refused(kwargs):
    with pytest.raises(ValueError):
        MeasuredLatencyModel(BASE, **kwargs)
