"""The simulator runs the policies the services run: it never carries a copy of one.

Two checks, one static and one at run time:

* **no clone**: every function and class of kunserve/sim is compared with every function and class of the policies
  (shared/policy/*) and of the services' code that drives them (the monitor's overload loop, the memory manager's
  orchestrator, the worker's budget wiring). A shared name is a failure, and so is a function whose syntax tree has
  the same shape as a policy function's once identifiers and constants are blanked out (an exact structural copy,
  renamed), or whose node sequence is 85 % similar or more (a copy with small edits);
* **called live**: the policy entry points are wrapped wherever they are bound (the defining module, every module
  that imported them by name, their classes), simulations of every mechanism are run (drop, restore, migration,
  swap, lookahead microbatches, the SLO budget, co-serving with layer-wise preemption, elastic tensor parallelism's
  placement, scale-up, throttling and idle split), and each entry point must
  have been called by the simulation. A simulator that decided anything with its own copy would not call them.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import pathlib
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kunserve.benchkit.trace import Burst, TraceRequest, generate_trace
from kunserve.services.memory_manager import orchestrator, tp_placement, tp_reform
from kunserve.services.monitor import servicer as monitor
from kunserve.services.worker import build
from kunserve.shared.memory import layer_memory
from kunserve.shared.model import tp_capacity
from kunserve.shared.policy import (
    admission,
    batch_scheduler,
    cluster_load,
    costmodel,
    dispatch_rules,
    elastic_tp,
    head_schedule,
    layerwise_preemption,
    long_requests,
    measured_latency,
    microbatch,
    migration,
    overload,
    planner,
    router,
    token_budget,
    transition_plan,
    units,
)
from kunserve.sim.cluster import OfflineLoad, Simulation
from kunserve.sim.shapes import Memory

ROOT = pathlib.Path(__file__).resolve().parents[3]
SIM = ROOT / "kunserve" / "sim"
POLICY_SOURCES = [
    *sorted((ROOT / "shared" / "policy").glob("*.py")),
    ROOT / "services" / "monitor" / "servicer.py",
    ROOT / "services" / "memory_manager" / "orchestrator.py",
    ROOT / "services" / "memory_manager" / "tp_placement.py",
    ROOT / "services" / "memory_manager" / "tp_reform.py",
    ROOT / "services" / "worker" / "build.py",
]
MIN_NODES = 40  # smaller functions (accessors, one-line sums) are alike by nature
SIMILAR = 0.85


IO_ADAPTERS = {"GrpcMemoryManager", "MonitorServicer"}  # gRPC plumbing beside the policy loop, not a policy


def _defs(path: pathlib.Path) -> Iterator[tuple[str, ast.AST]]:
    tree = ast.parse(path.read_text())
    skip = {id(n) for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and c.name in IO_ADAPTERS for n in ast.walk(c)}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and id(node) not in skip:
            yield node.name, node


def _top_names(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


class _Blank(ast.NodeTransformer):
    """Identifiers, attributes, arguments and constants blanked: what is left is the shape of the code."""

    def visit_Name(self, node: ast.Name) -> ast.AST:
        return ast.copy_location(ast.Name(id="_", ctx=node.ctx), node)

    def visit_Attribute(self, node: ast.Attribute) -> ast.AST:
        self.generic_visit(node)
        node.attr = "_"
        return node

    def visit_arg(self, node: ast.arg) -> ast.AST:
        node.arg, node.annotation = "_", None
        return node

    def visit_Constant(self, node: ast.Constant) -> ast.AST:
        return ast.copy_location(ast.Constant(value=0), node)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.AST:
        self.generic_visit(node)
        node.name, node.returns, node.decorator_list = "_", None, []
        if node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant):
            node.body = node.body[1:] or [ast.Pass()]
        return node


def _shape(node: ast.AST) -> tuple[str, list[str]]:
    import copy

    blank = _Blank().visit(copy.deepcopy(node))
    return ast.dump(blank), [type(n).__name__ for n in ast.walk(blank)]


def _functions(paths: list[pathlib.Path]) -> list[tuple[str, str, list[str]]]:
    out = []
    for path in paths:
        for name, node in _defs(path):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                dump, seq = _shape(node)
                if len(seq) >= MIN_NODES:
                    out.append((f"{path.name}:{name}", dump, seq))
    return out


def test_the_simulator_defines_no_policy_name():
    policy_names = set().union(*(_top_names(p) for p in POLICY_SOURCES))
    for path in sorted(SIM.glob("*.py")):
        clash = _top_names(path) & policy_names
        assert not clash, f"{path.name} defines {sorted(clash)}, which the policies define: call theirs"


def test_no_simulator_function_is_a_copy_of_a_policy_function():
    policies = _functions(POLICY_SOURCES)
    assert len(policies) > 50  # the comparison has something to compare with
    for where, dump, seq in _functions(sorted(SIM.glob("*.py"))):
        for pwhere, pdump, pseq in policies:
            assert dump != pdump, f"{where} has the exact shape of {pwhere}"
            if 2 * min(len(seq), len(pseq)) < SIMILAR * (len(seq) + len(pseq)):
                continue  # the ratio cannot reach SIMILAR
            matcher = difflib.SequenceMatcher(None, seq, pseq, autojunk=False)
            if matcher.quick_ratio() >= SIMILAR:
                assert matcher.ratio() < SIMILAR, f"{where} is {matcher.ratio():.0%} like {pwhere}"


def test_the_clone_check_catches_a_renamed_copy(tmp_path):
    """The check above is not vacuous: a policy function copied with every name changed is flagged."""
    source = ast.get_source_segment(
        (ROOT / "shared/policy/migration.py").read_text(),
        next(n for name, n in _defs(ROOT / "shared/policy/migration.py") if name == "choose_migrations"),
    )
    assert source is not None
    renamed = source.replace("choose_migrations", "pick").replace("requests", "reqs").replace("dst_free", "room")
    copy = tmp_path / "copy.py"
    copy.write_text(renamed)
    ((_, dump, seq),) = _functions([copy])
    ((_, pdump, pseq),) = [f for f in _functions([ROOT / "shared/policy/migration.py"]) if f[0].endswith("choose_migrations")]
    assert dump == pdump


# -- called live --------------------------------------------------------------------------------------------------------
ENTRY_POINTS: list[tuple[Any, str]] = [
    (router.FreenessRouter, "choose"),
    (router.FreenessRouter, "update"),
    (router.FreenessRouter, "routed"),
    (admission.Admission, "admit"),
    (dispatch_rules, "capacity"),
    (dispatch_rules, "admission_bounds"),
    (dispatch_rules, "choose_worker"),
    (batch_scheduler.Scheduler, "schedule"),
    (batch_scheduler.Scheduler, "preempt"),
    (batch_scheduler.Scheduler, "check_fits"),
    (batch_scheduler.Scheduler, "stats"),
    (token_budget.SLOTokenBudget, "max_tokens_for"),
    (token_budget.SLOTokenBudget, "chunk_limit"),
    (measured_latency.MeasuredLatencyModel, "observe"),
    (microbatch.MicrobatchFormer, "form"),
    (microbatch.DecodeSplit, "observe"),
    (head_schedule.LookaheadPlan, "next_microbatch"),
    (head_schedule, "online_queued_tokens"),
    (head_schedule, "role_budget"),
    (costmodel.ConServeLatencyModel, "shape_cost"),
    (costmodel.KunServeCostModel, "chunk_cost"),
    (overload.OverloadPolicy, "observe"),
    (cluster_load.ClusterLoad, "observe"),
    (units, "build_units"),
    (monitor.OverloadController, "tick"),
    (orchestrator.Orchestrator, "drop"),
    (orchestrator.Orchestrator, "restore"),
    (orchestrator.Orchestrator, "migrate"),
    (planner, "plan_drop"),
    (planner, "plan_split"),
    (transition_plan, "assign_tables"),
    (transition_plan, "assign_restore_targets"),
    (transition_plan, "kv_flows"),
    (transition_plan, "weight_pieces"),
    (migration, "choose_migrations"),
    (layerwise_preemption, "should_preempt"),
    (build, "make_token_budget"),
    (build, "make_microbatch_former"),
    (layer_memory, "kv_capacity"),
    (elastic_tp.ElasticTPScheduler, "route"),
    (elastic_tp.IdleSplitPolicy, "observe"),
    (elastic_tp.IdleSplitPolicy, "placed"),
    (long_requests, "split_by_fit"),
    (long_requests, "is_long"),
    (long_requests, "throttled_units"),
    (long_requests.LongHeld, "throttled"),
    (long_requests, "choose_unthrottled"),
    (tp_placement, "placement_worker"),
    (tp_placement, "placement_inputs"),
    (tp_placement, "kv_tokens"),
    (tp_reform, "check_transform"),
    (tp_reform, "check_split"),
    (tp_capacity, "kv_tokens_by_degree"),
    (orchestrator.Orchestrator, "_exclusive"),
]


def _spy(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Wrap every entry point wherever it is bound: its class, its module, and every kunserve module that imported
    it by name."""
    calls: Counter[str] = Counter()

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return fn(*args, **kwargs)

        counted.__wrapped__ = fn  # type: ignore[attr-defined]
        return counted

    for owner, attr in ENTRY_POINTS:
        fn = getattr(owner, attr)
        name = f"{owner.__name__}.{attr}"
        wrapped = wrap(name, fn)
        if isinstance(owner, type):
            monkeypatch.setattr(owner, attr, wrapped)
            continue
        for mod in [m for n, m in sys.modules.items() if n.startswith("kunserve") and m is not None]:
            for key, value in list(vars(mod).items()):
                if value is fn:
                    monkeypatch.setattr(mod, key, wrapped)
    return calls


def test_every_mechanism_calls_the_live_policies(monkeypatch, make_setup, bursty_trace):
    calls = _spy(monkeypatch)
    burst = generate_trace(
        rate=3.0, cv=1.0, duration_s=60.0, seed=3, scale=0.5, burst=[Burst(3.0, 6.0, 5.0)], max_prompt=1024, max_output=256
    )
    kun = Simulation(make_setup("kunserve", instances=4), burst).run()
    ops = Counter(t["op"] for t in kun.transitions if t["completed"])
    assert ops["drop"] and ops["restore"], kun.transitions
    mig = Simulation(make_setup("migrate", instances=4), burst).run()
    assert any(t["op"] == "migrate" and t["completed"] for t in mig.transitions), mig.transitions
    swap = Simulation(make_setup("swap"), bursty_trace).run()
    assert swap.counters["swapped_out_blocks"] > 0
    co = Simulation(
        make_setup("recompute", engine__coserving="conserve", slo__ttft_ms=50.0),
        bursty_trace,
        offline=OfflineLoad(((900, 40), (300, 100)), 6),
    ).run()
    assert co.offline and co.counters["layerwise_preemptions"] > 0
    # elastic TP: small pools (a whole instance holds 1280 KV tokens, TP2 5632), one long request amid short ones
    setup = make_setup("kunserve", instances=3, dispatcher__elastic_tp=True, memory_manager__tp_idle_split_s=5.0, engine__page_kib=256)
    setup = dataclasses.replace(setup, memory=Memory(setup.shape, 26 << 20, 256 * 1024), tp_reform_s=2.0)
    trace = [TraceRequest(0.5 * i, 200, 30) for i in range(50)] + [TraceRequest(1.0, 1500, 100)]
    el = Simulation(setup, trace).run()
    assert {t["op"] for t in el.transitions} >= {"tp", "tp-split"}, el.transitions
    missing = [f"{o.__name__}.{a}" for o, a in ENTRY_POINTS if not calls[f"{o.__name__}.{a}"]]
    assert not missing, f"the simulation never called {missing}"
