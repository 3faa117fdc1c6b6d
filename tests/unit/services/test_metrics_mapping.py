"""The Prometheus metrics of every service (shared/metrics.py, services/*/metrics.py): what each state or event maps
to, that the families exported are exactly the README's "Metrics" table (name, type, labels, service), and the
/metrics endpoint itself. No cluster: hand-built stats, events and transition reports."""

from __future__ import annotations

import asyncio
import socket
import urllib.request
from types import SimpleNamespace

import pytest
from helpers import readme_metrics
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from kunserve.cli.launcher import assign_free_ports, with_workers
from kunserve.services.dispatcher.metrics import DispatcherMetrics, admission_families
from kunserve.services.memory_manager.metrics import AutoscaleMetrics, DropClock, TransitionMetrics, layout_families, outcome
from kunserve.services.memory_manager.orchestrator import OrchestrationError, Orchestrator
from kunserve.services.monitor.metrics import monitor_families
from kunserve.services.monitor.servicer import PolicyCounters
from kunserve.services.worker.metrics import IterationMetrics, worker_families
from kunserve.shared.config import ConfigError, load_config
from kunserve.shared.metrics import Lazy, MetricsServer, new_registry, serve_metrics, token_count_buckets
from kunserve.shared.policy.cluster import Member, WorkerReport
from kunserve.shared.policy.cluster_layout import LayoutState
from kunserve.shared.policy.cluster_load import ClusterStatus, WorkerStatus
from kunserve.v1 import common_pb2, generation_pb2, memory_manager_pb2, worker_pb2

pytestmark = pytest.mark.timeout(60)


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


# --- worker --------------------------------------------------------------------------------------------------------

def worker_registry(stats: common_pb2.WorkerStats) -> tuple[CollectorRegistry, IterationMetrics]:
    registry = new_registry()
    registry.register(Lazy(lambda: worker_families(stats)))
    return registry, IterationMetrics(registry, stats.worker_id)


def test_a_workers_stats_become_its_gauges_and_counters():
    stats = common_pb2.WorkerStats(
        worker_id="w1", kv_blocks_total=400, kv_blocks_used=100, kv_blocks_undropped=250, num_running=3, num_waiting=5,
        num_offline_running=1, num_offline_waiting=2, offline_kv_blocks_used=20, queued_demand_blocks=60,
        num_preemptions=7, prompt_tokens_total=1000, generated_tokens_total=300, busy_seconds_total=8.0,
        idle_seconds_total=2.0, bubble_seconds_total=2.0, bubble_ratio=0.2, serving=True, transitioning=False,
        layer_start=0, layer_end=2, epoch=5, oldest_waiting_age_s=1.5)
    r, _ = worker_registry(stats)
    expected = {
        "kunserve:num_requests_running": 3, "kunserve:num_requests_waiting": 5,
        "kunserve:num_offline_requests_running": 1, "kunserve:num_offline_requests_waiting": 2,
        "kunserve:kv_blocks_used": 100, "kunserve:kv_blocks_total": 400, "kunserve:kv_blocks_undropped": 250,
        "kunserve:kv_cache_usage_perc": 0.25, "kunserve:offline_kv_blocks_used": 20, "kunserve:queued_demand_blocks": 60,
        "kunserve:oldest_waiting_age_seconds": 1.5, "kunserve:num_preemptions_total": 7,
        "kunserve:prompt_tokens_total": 1000, "kunserve:generation_tokens_total": 300, "kunserve:busy_seconds_total": 8,
        "kunserve:idle_seconds_total": 2, "kunserve:bubble_seconds_total": 2, "kunserve:bubble_ratio": 0.2,
        "kunserve:serving": 1, "kunserve:transitioning": 0, "kunserve:layers_held": 2, "kunserve:layout_epoch": 5,
    }
    for name, want in expected.items():
        assert value(r, name, worker="w1") == pytest.approx(want), name


def test_kv_usage_of_a_worker_without_kv_is_zero():
    r, _ = worker_registry(common_pb2.WorkerStats(worker_id="w0"))
    assert value(r, "kunserve:kv_cache_usage_perc", worker="w0") == 0.0


def chunk(num_tokens: int, start: int, arrival: float, *, offline: bool = False, preemptions: int = 0):
    request = SimpleNamespace(arrival_time=arrival, offline=offline)
    return SimpleNamespace(num_tokens=num_tokens, start=start, seq=SimpleNamespace(request=request,
                                                                                    num_preemptions=preemptions))


def test_an_iteration_counts_its_tokens_and_the_queue_time_of_online_requests_starting():
    r, it = worker_registry(common_pb2.WorkerStats(worker_id="w0"))
    # a first prefill chunk (queued 3 s), a later chunk, a decode, an offline start, a recompute after preemption
    it.scheduled([chunk(64, 0, 7.0), chunk(64, 64, 1.0), chunk(1, 30, 1.0), chunk(32, 0, 2.0, offline=True),
                  chunk(16, 0, 5.0, preemptions=1)], now=10.0)
    it.scheduled([chunk(8, 0, 9.5)], now=10.0)
    assert value(r, "kunserve:iteration_tokens_total_count", worker="w0") == 2
    assert value(r, "kunserve:iteration_tokens_total_sum", worker="w0") == 64 + 64 + 1 + 32 + 16 + 8
    assert value(r, "kunserve:iteration_tokens_total_bucket", worker="w0", le="8.0") == 1
    assert value(r, "kunserve:request_queue_time_seconds_count", worker="w0") == 2
    assert value(r, "kunserve:request_queue_time_seconds_sum", worker="w0") == pytest.approx(3.5)


# --- dispatcher ----------------------------------------------------------------------------------------------------

def event(index: int, *, token: int = 5, finish: int = 0, elapsed: float = 0.0, latency: float = 0.0, prompt: int = 12):
    return generation_pb2.GenerateEvent(token_id=token, index=index, finish_reason=finish, elapsed_s=elapsed,
                                        token_latency_s=latency, num_prompt_tokens=prompt)


def test_a_requests_events_give_ttft_inter_token_latency_and_its_totals():
    m = DispatcherMetrics(max_model_len=100)
    r = m.registry
    for ev in (event(0, elapsed=0.3), event(1, elapsed=0.35, latency=0.05),
               event(2, elapsed=0.45, latency=0.1, finish=common_pb2.FINISH_REASON_EOS)):
        m.observe(ev)
    assert value(r, "kunserve:time_to_first_token_seconds_count") == 1
    assert value(r, "kunserve:time_to_first_token_seconds_sum") == pytest.approx(0.3)
    assert value(r, "kunserve:inter_token_latency_seconds_count") == 2
    assert value(r, "kunserve:inter_token_latency_seconds_sum") == pytest.approx(0.15)
    assert value(r, "kunserve:e2e_request_latency_seconds_sum") == pytest.approx(0.45)
    assert value(r, "kunserve:request_prompt_tokens_sum") == 12
    assert value(r, "kunserve:request_generation_tokens_sum") == 3
    assert value(r, "kunserve:request_success_total", finished_reason="stop") == 1  # EOS is vLLM's "stop"


def test_a_cancelled_request_ends_with_a_tokenless_abort_and_other_ends_are_counted_by_status():
    m = DispatcherMetrics(max_model_len=100)
    r = m.registry
    m.observe(event(0, elapsed=0.2))
    m.observe(event(1, token=-1, finish=common_pb2.FINISH_REASON_ABORTED, elapsed=0.4, latency=0.2))
    assert value(r, "kunserve:request_generation_tokens_sum") == 1  # the tokenless last event adds none
    assert value(r, "kunserve:inter_token_latency_seconds_count") == 0
    m.observe(event(0, finish=common_pb2.FINISH_REASON_LENGTH, elapsed=0.1))
    m.abandoned()
    m.refused("RESOURCE_EXHAUSTED")
    m.refused("RESOURCE_EXHAUSTED")
    m.failed("UNAVAILABLE")
    m.resumes.inc()
    m.reattaches.inc()
    assert value(r, "kunserve:request_success_total", finished_reason="abort") == 2
    assert value(r, "kunserve:request_success_total", finished_reason="length") == 1
    assert value(r, "kunserve:requests_refused_total", code="RESOURCE_EXHAUSTED") == 2
    assert value(r, "kunserve:requests_failed_total", code="UNAVAILABLE") == 1
    assert value(r, "kunserve:request_resumes_total") == 1 and value(r, "kunserve:request_reattaches_total") == 1


def test_token_count_buckets_are_vllms_1_2_5_series():
    assert token_count_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert token_count_buckets(4) == [1, 2]


# --- memory manager ------------------------------------------------------------------------------------------------

def report(op: str = "drop", **kw) -> memory_manager_pb2.TransitionReport:
    return memory_manager_pb2.TransitionReport(op=op, **kw)


def test_transition_outcomes():
    assert outcome(report(completed=True)) == "completed"
    assert outcome(report(rolled_back=True, error="w1 died")) == "rolled_back"
    assert outcome(report("restore", completed=True, error="nothing to restore")) == "noop"
    assert outcome(report(autoscale_needed=True, error="no drop plan")) == "no_plan"


def test_transition_reports_become_counts_durations_bytes_and_the_autoscale_signal():
    r = new_registry()
    t = TransitionMetrics(r)
    assert value(r, "kunserve:drops_total", outcome="completed") == 0  # there before the first drop
    t.reported(report(completed=True, total_seconds=0.4, pause_seconds=0.1, kv_bytes_moved=4096, requests_moved=3,
                      autoscale_needed=True))
    t.reported(report(rolled_back=True, total_seconds=2.0))
    t.reported(report("restore", completed=True, total_seconds=1.0, weight_bytes_from_peers=100,
                      weight_bytes_from_host=50))
    t.refused("drop", "ABORTED")
    assert value(r, "kunserve:drops_total", outcome="completed") == 1
    assert value(r, "kunserve:drops_total", outcome="rolled_back") == 1
    assert value(r, "kunserve:drops_total", outcome="refused") == 1
    assert value(r, "kunserve:restores_total", outcome="completed") == 1
    assert value(r, "kunserve:drop_duration_seconds_sum", outcome="completed") == pytest.approx(0.4)
    assert value(r, "kunserve:drop_duration_seconds_sum", outcome="rolled_back") == pytest.approx(2.0)
    assert value(r, "kunserve:transition_pause_seconds_sum", op="drop") == pytest.approx(0.1)
    assert value(r, "kunserve:kv_bytes_moved_total", op="drop") == 4096
    assert value(r, "kunserve:requests_moved_total", op="drop") == 3
    assert value(r, "kunserve:weight_bytes_restored_total", source="peer") == 100
    assert value(r, "kunserve:weight_bytes_restored_total", source="host") == 50
    assert value(r, "kunserve:autoscale_signals_total") == 1
    assert value(r, "kunserve:autoscale_needed") == 0  # the completed restore cleared it
    t.reported(report(autoscale_needed=True, error="no drop plan"))
    assert value(r, "kunserve:autoscale_needed") == 1 and value(r, "kunserve:drops_total", outcome="no_plan") == 1


def info(wid: str, members: tuple[str, ...] = (), kv: int = 100) -> worker_pb2.WorkerInfo:
    members = members or (wid,)
    return worker_pb2.WorkerInfo(worker_id=wid, group_id="+".join(members), group_members=members, kv_blocks_total=kv)


def layout_registry(infos: dict[str, worker_pb2.WorkerInfo], epoch: int = 3) -> CollectorRegistry:
    r = new_registry()
    r.register(Lazy(lambda: layout_families(epoch, infos, 3, 12.5, False)))
    return r


def test_the_layout_gives_each_unit_its_size_and_kv_capacity():
    whole = layout_registry({w: info(w) for w in ("w0", "w1", "w2")})
    assert value(whole, "kunserve:num_groups") == 0 and value(whole, "kunserve:layout_epoch") == 3
    assert value(whole, "kunserve:group_size", group="w1") == 1
    assert value(whole, "kunserve:group_kv_blocks_total", group="w1") == 100
    dropped = layout_registry({"w0": info("w0", ("w0", "w1"), kv=260), "w1": info("w1", ("w0", "w1"), kv=255),
                               "w2": info("w2")}, epoch=4)
    assert value(dropped, "kunserve:num_groups") == 1
    assert value(dropped, "kunserve:group_size", group="w0+w1") == 2
    assert value(dropped, "kunserve:group_kv_blocks_total", group="w0+w1") == 260  # the head's block space
    assert value(dropped, "kunserve:group_size", group="w0") is None
    assert value(dropped, "kunserve:workers_reachable") == 3 and value(dropped, "kunserve:drop_state_seconds_total") == 12.5


def test_the_drop_clock_counts_time_with_a_group():
    now = [0.0]
    clock = DropClock(lambda: now[0])
    clock.observe(False)
    now[0] = 5.0
    clock.observe(True)
    now[0] = 7.0
    assert clock.seconds() == 2.0
    clock.observe(True)
    now[0] = 9.0
    clock.observe(False)
    now[0] = 20.0
    assert clock.seconds() == 4.0


class Recorder:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    def reported(self, report: memory_manager_pb2.TransitionReport) -> None:
        self.seen.append((report.op, outcome(report)))

    def refused(self, op: str, code: str) -> None:
        self.seen.append((op, code))


class OneWorker:
    """ClusterAccess with one whole worker that answers GetInfo (enough for a restore with nothing to restore)."""

    def __init__(self, ids: tuple[str, ...]) -> None:
        self.ids = ids
        self.layout = LayoutState(epoch=1)

    @property
    def worker_ids(self) -> list[str]:
        return list(self.ids)

    def worker_stub(self, worker_id: str):
        async def get_info(request, timeout=None, wait_for_ready=None) -> worker_pb2.WorkerInfo:
            return worker_pb2.WorkerInfo(worker_id=worker_id, num_layers_model=4, layer_start=0, layer_end=4,
                                         group_id=worker_id, group_members=[worker_id], serving=True)
        return SimpleNamespace(GetInfo=get_info)

    async def refresh(self) -> None:
        pass


def test_the_orchestrator_tells_its_observers_every_report_and_refusal():
    recorder = Recorder()
    orch = Orchestrator(OneWorker(("w0",)), timeout_s=5.0)
    orch.observers.append(recorder)
    rep = asyncio.run(orch.restore(memory_manager_pb2.RestoreRequest()))
    assert rep.completed and recorder.seen == [("restore", "noop")]
    empty = Orchestrator(OneWorker(()), timeout_s=5.0)
    empty.observers.append(recorder)
    with pytest.raises(OrchestrationError):
        asyncio.run(empty.restore(memory_manager_pb2.RestoreRequest()))
    assert recorder.seen[-1] == ("restore", "UNAVAILABLE")


# --- monitor -------------------------------------------------------------------------------------------------------

def status(*workers: tuple[str, int, bool]) -> ClusterStatus:
    ws = tuple(WorkerStatus(WorkerReport(Member(wid, 0, 4), epoch=epoch), healthy, 0.0, 0.0, 0.0, 0.0)
               for wid, epoch, healthy in workers)
    return ClusterStatus(0.0, ws, kv_blocks_total=500, kv_blocks_used=120, queued_demand_blocks=30, overloaded=True)


def test_the_monitor_exports_the_cluster_it_hears_and_the_policy_counters():
    r = new_registry()
    r.register(Lazy(lambda: monitor_families(status(("w0", 4, True), ("w1", 3, True), ("w2", 9, False)),
                                             PolicyCounters(drops=2, restores=1, failures=3, autoscale_needed=1))))
    assert value(r, "kunserve:layout_epoch") == 4  # the stale worker's epoch is not taken
    assert value(r, "kunserve:workers_reporting", health="healthy") == 2
    assert value(r, "kunserve:workers_reporting", health="stale") == 1
    assert value(r, "kunserve:cluster_kv_blocks_total") == 500 and value(r, "kunserve:cluster_kv_blocks_used") == 120
    assert value(r, "kunserve:cluster_queued_demand_blocks") == 30 and value(r, "kunserve:cluster_overloaded") == 1
    assert value(r, "kunserve:policy_actions_total", action="drop") == 2
    assert value(r, "kunserve:policy_actions_total", action="restore") == 1
    assert value(r, "kunserve:policy_failures_total") == 3 and value(r, "kunserve:policy_autoscale_needed_total") == 1
    idle = new_registry()
    idle.register(Lazy(lambda: monitor_families(ClusterStatus(0.0), None)))  # no policy loop: zeros
    assert value(idle, "kunserve:policy_actions_total", action="drop") == 0 and value(idle, "kunserve:layout_epoch") == 0


# --- the README's table --------------------------------------------------------------------------------------------

def exported(registry: CollectorRegistry) -> dict[str, tuple[str, frozenset[str]]]:
    """name as PromQL selects it (counters with _total) -> (type, label names) of a registry's exposition."""
    out = {}
    for family in registry.collect():
        name = family.name + ("_total" if family.type == "counter" else "")
        labels = {k for s in family.samples for k in s.labels if k != "le"}
        out[name] = (family.type, frozenset(labels))
    return out


def every_service() -> dict[str, dict[str, tuple[str, frozenset[str]]]]:
    """Each service's registry as its __main__ builds it, every labelled series observed once."""
    worker, iterations = worker_registry(common_pb2.WorkerStats(worker_id="w0"))
    iterations.scheduled([chunk(4, 0, 0.0)], now=1.0)
    d = DispatcherMetrics(new_registry(), max_model_len=64)
    d.registry.register(Lazy(lambda: admission_families(1, 10, 2)))
    d.observe(event(0, finish=common_pb2.FINISH_REASON_STOP))
    d.refused("INVALID_ARGUMENT")
    d.failed("UNAVAILABLE")
    mm = layout_registry({"w0": info("w0")})
    t = TransitionMetrics(mm)
    AutoscaleMetrics(mm)  # every memory manager has them (zeros without a scaler)
    for op in ("drop", "restore", "migrate"):
        t.reported(report(op, completed=True, weight_bytes_from_peers=1))
    monitor = new_registry()
    monitor.register(Lazy(lambda: monitor_families(status(("w0", 1, True)), None)))
    return {"worker": exported(worker), "dispatcher": exported(d.registry), "memory manager": exported(mm),
            "monitor": exported(monitor)}


def test_every_exported_metric_is_in_the_readme_table_and_every_row_is_exported():
    documented = readme_metrics()
    services = every_service()
    for service, families in services.items():
        for name, (kind, labels) in families.items():
            assert name in documented, f"{service} exports {name}, which the README's metrics table lacks"
            doc = documented[name]
            assert service in doc.services, f"{name}: the README does not say {service} exports it"
            assert kind == doc.kind, f"{name} is a {kind}, the README says {doc.kind}"
            assert labels <= doc.labels, f"{name} ({service}): labels {sorted(labels)}, README {sorted(doc.labels)}"
    for name, doc in documented.items():
        for service in doc.services:
            assert name in services[service], f"the README lists {name} for the {service}, which does not export it"
        seen = frozenset().union(*(services[s][name][1] for s in doc.services))
        assert seen == doc.labels, f"{name}: README labels {sorted(doc.labels)}, exported {sorted(seen)}"


# --- the endpoint --------------------------------------------------------------------------------------------------

def test_the_endpoint_serves_the_registry_in_the_text_format_and_port_0_is_off():
    async def scenario() -> tuple[str, str]:
        r, _ = worker_registry(common_pb2.WorkerStats(worker_id="w0", num_running=2))
        assert await serve_metrics(r, ("127.0.0.1", 0), "workers[0].metrics_port") is None
        server = MetricsServer(r)
        await server.start("127.0.0.1", 0)
        try:
            def get() -> tuple[str, str]:
                with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as resp:
                    return resp.headers["Content-Type"], resp.read().decode()
            return await asyncio.to_thread(get)
        finally:
            await server.stop()

    content_type, body = asyncio.run(scenario())
    assert content_type.startswith("text/plain; version=0.0.4")
    families = {f.name: f for f in text_string_to_metric_families(body)}
    assert families["kunserve:num_requests_running"].samples[0].value == 2


def test_a_taken_metrics_port_is_a_start_up_error_naming_the_key():
    async def scenario() -> None:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            await serve_metrics(new_registry(), ("127.0.0.1", taken.getsockname()[1]), "dispatcher.metrics_port")

    with pytest.raises(SystemExit, match=r"dispatcher\.metrics_port"):
        asyncio.run(scenario())


# --- the config's metrics ports ------------------------------------------------------------------------------------

def test_every_service_has_a_metrics_port_and_the_launcher_keeps_them_apart(tmp_path):
    cfg = load_config(None, environ={})
    assert (cfg.dispatcher.metrics_port, cfg.memory_manager.metrics_port, cfg.monitor.metrics_port) == (9400, 9401, 9402)
    with_workers(cfg, 3)
    assert [w.metrics_port for w in cfg.workers] == [9410, 9411, 9412]
    assign_free_ports(cfg)
    ports = [s.metrics_port for s in (cfg.dispatcher, cfg.memory_manager, cfg.monitor, *cfg.workers)]
    assert all(ports) and len(set(ports)) == len(ports) and not set(ports) & {9400, 9401, 9402, 9410, 9411, 9412}
    off = load_config(None, environ={"KUNSERVE__MONITOR__METRICS_PORT": "0", "KUNSERVE__WORKERS__0__METRICS_PORT": "0"})
    with_workers(off, 2)
    assign_free_ports(off)
    assert off.monitor.metrics_port == 0 and [w.metrics_port for w in off.workers] == [0, 0]  # off stays off
    bad = tmp_path / "bad.toml"
    bad.write_text("[dispatcher]\nmetrics_port = 70000\n")
    with pytest.raises(ConfigError, match=r"dispatcher\.metrics_port must be in \[0, 65535\]"):
        load_config(bad, environ={})
