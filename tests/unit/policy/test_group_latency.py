"""A group head's latency model: the profile's prediction scaled by the measured round trips of its microbatches,
the number of stages until it has measured; the SLO budget over it admits fewer tokens when the group is slower."""

from __future__ import annotations

import pytest

from kunserve.shared.policy.costmodel import BatchShape, ConServeLatencyModel
from kunserve.shared.policy.group_latency import GroupLatencyModel
from kunserve.shared.policy.token_budget import SLOTokenBudget

BASE = ConServeLatencyModel(k1=1e-4, k2=0.0, k3=0.0, k4=0.0, k5=2e-3)


def test_unmeasured_it_assumes_the_stages_do_not_overlap():
    m = GroupLatencyModel(BASE, stages=2)
    shape = BatchShape.of([(100, 0)])
    assert m.shape_cost(shape) == pytest.approx(2 * BASE.shape_cost(shape))


def test_the_scale_follows_the_measured_round_trips():
    m = GroupLatencyModel(BASE, stages=2, weight=0.5)
    shape = BatchShape.of([(1, 50)] * 8)
    p = BASE.shape_cost(shape)
    m.observe(shape, 1.5 * p)
    assert m.scale == pytest.approx(1.5), "the first measurement replaces the assumption"
    m.observe(shape, 1.1 * p)
    assert m.scale == pytest.approx(1.3)
    m.observe(BatchShape(), 5.0)  # nothing predicted: says nothing
    m.observe(shape, 0.0)
    assert m.scale == pytest.approx(1.3) and m.observations == 2


def test_a_slower_group_gets_a_smaller_budget():
    fast = SLOTokenBudget(GroupLatencyModel(BASE, stages=2, scale=1.0), tbt_s=0.05)
    slow = SLOTokenBudget(GroupLatencyModel(BASE, stages=2, scale=2.0), tbt_s=0.05)
    assert slow.max_tokens_for(4) < fast.max_tokens_for(4)


@pytest.mark.parametrize("kwargs", [{"stages": 0}, {"stages": 2, "weight": 0.0}, {"stages": 2, "weight": 1.5}])
def test_bad_parameters_are_refused(kwargs):
    with pytest.raises(ValueError):
        GroupLatencyModel(BASE, **kwargs)
