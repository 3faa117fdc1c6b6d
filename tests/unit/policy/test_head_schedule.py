"""The scheduling glue the engine and the simulator's worker share (shared/policy/head_schedule.py)."""

from __future__ import annotations

from kunserve.shared.policy.batch_scheduler import FixedTokenBudget
from kunserve.shared.policy.costmodel import BatchShape, ConServeLatencyModel
from kunserve.shared.policy.head_schedule import role_budget
from kunserve.shared.policy.measured_latency import MeasuredLatencyModel
from kunserve.shared.policy.token_budget import SLOTokenBudget

CON = ConServeLatencyModel(k1=3e-4, k2=5e-8, k4=2e-6, k5=1e-2)


def test_a_fixed_budget_runs_as_configured_without_a_measured_latency():
    fixed = FixedTokenBudget(256)
    assert role_budget(fixed, 4.0) == (fixed, None)


def test_an_slo_budget_runs_under_a_fresh_measured_latency_of_the_roles_scale():
    slo = SLOTokenBudget(CON, tbt_s=0.2)
    head, latency = role_budget(slo, 4.0)
    assert isinstance(latency, MeasuredLatencyModel) and head.model is latency and head.tbt_s == slo.tbt_s
    shape = BatchShape.of([(64, 0)])
    assert latency.shape_cost(shape) == 4.0 * CON.shape_cost(shape)  # assumed until measured
    again, other = role_budget(slo, 1.0)
    assert other is not latency and other.shape_cost(shape) == CON.shape_cost(shape)
