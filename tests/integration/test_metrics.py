"""Prometheus metrics through real processes: every service's /metrics has the families the README's table gives
it, and a forced `kunctl drop` (then `kunctl restore`) moves the layout epoch, the drop / restore counters, the
groups and their KV capacity the way the transition reports say."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request

import grpc
import pytest
from helpers import generate_many, kunctl_argv, readme_metrics, run
from prometheus_client.parser import text_string_to_metric_families

from kunserve import client

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

Scrape = dict[str, list]  # family name as PromQL selects it (counters with _total) -> its samples


def scrape(port: int) -> Scrape:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {f.name + ("_total" if f.type == "counter" else ""): f.samples for f in text_string_to_metric_families(text)}


def scrape_all(cluster) -> dict[str, Scrape]:
    """Every service's scrape: "dispatcher", "memory manager", "monitor" and each worker by id."""
    cfg = cluster.cfg
    ports = {"dispatcher": cfg.dispatcher.metrics_port, "memory manager": cfg.memory_manager.metrics_port,
             "monitor": cfg.monitor.metrics_port} | {w.id: w.metrics_port for w in cfg.workers}
    return {name: scrape(port) for name, port in ports.items()}


def sample(s: Scrape, name: str, **labels: str) -> float | None:
    """The value of the sample `name` (a histogram's name_count, ...) whose labels include `labels`."""
    for samples in s.values():
        for x in samples:
            if x.name == name and labels.items() <= x.labels.items():
                return x.value
    return None


def kunctl(cluster, *args: str) -> dict:
    out = subprocess.run(kunctl_argv(cluster, *args, "--json"), capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def scrape_until(cluster, ready, what: str, timeout_s: float = 30.0) -> dict[str, Scrape]:
    """Scrape until `ready(scrapes)` holds: the memory manager's layout refresh and the stats streams run every
    second or less, so what a transition changed shows within a few."""
    deadline = time.monotonic() + timeout_s
    while True:
        scrapes = scrape_all(cluster)
        if ready(scrapes):
            return scrapes
        assert time.monotonic() < deadline, f"{what} did not show within {timeout_s:.0f}s"
        time.sleep(0.2)


def test_every_service_exports_its_documented_metrics_and_a_drop_moves_them(cluster):
    workers = [w.id for w in cluster.cfg.workers]
    requests = [client.make_request([5, 6, 7 + i], max_tokens=4, ignore_eos=True) for i in range(4)]
    results = run(generate_many(cluster.cfg.dispatcher.address, requests))
    assert not any(isinstance(r, BaseException) for r in results), results
    refused = run(generate_many(cluster.cfg.dispatcher.address, [client.make_request([5], max_tokens=10**7)]))
    assert isinstance(refused[0], grpc.aio.AioRpcError) and refused[0].code() == grpc.StatusCode.INVALID_ARGUMENT

    before = scrape_until(cluster, lambda s: sample(s["memory manager"], "kunserve:workers_reachable") == 2
                          and sample(s["monitor"], "kunserve:workers_reporting", health="healthy") == 2,
                          "every worker in the layout and the monitor")
    for name, doc in readme_metrics().items():
        for service in doc.services:
            for target in (workers if service == "worker" else [service]):
                assert name in before[target], f"{target} does not export {name}"

    d, mm, mon = before["dispatcher"], before["memory manager"], before["monitor"]
    assert sample(d, "kunserve:time_to_first_token_seconds_count") == 4
    assert sample(d, "kunserve:inter_token_latency_seconds_count") == 4 * 3
    assert sample(d, "kunserve:request_success_total", finished_reason="length") == 4
    assert sample(d, "kunserve:request_generation_tokens_sum") == 4 * 4
    assert sample(d, "kunserve:requests_refused_total", code="INVALID_ARGUMENT") == 1
    assert sum(sample(before[w], "kunserve:request_queue_time_seconds_count", worker=w) for w in workers) == 4
    assert sum(sample(before[w], "kunserve:generation_tokens_total", worker=w) for w in workers) >= 4 * 4
    assert sample(mm, "kunserve:num_groups") == 0 and sample(mon, "kunserve:cluster_kv_blocks_total") > 0
    whole_kv = {w: sample(mm, "kunserve:group_kv_blocks_total", group=w) for w in workers}
    assert all(v and v > 0 for v in whole_kv.values()), whole_kv
    epoch = sample(mm, "kunserve:layout_epoch")
    worker_epochs = {w: sample(before[w], "kunserve:layout_epoch", worker=w) for w in workers}
    monitor_epoch = sample(mon, "kunserve:layout_epoch")
    drops = sample(mm, "kunserve:drops_total", outcome="completed")
    assert kunctl(cluster, "status")["layout"].get("epoch", 0) == epoch  # --json: a 64-bit field as a number

    report = kunctl(cluster, "drop", "--group", ",".join(workers))
    assert report["completed"] and report["epoch"] > epoch
    (group,) = [g["group_id"] for g in report["groups"] if len(g["members"]) == 2]
    # the workers' and the monitor's epoch is the transition's; the memory manager's counts every layout change
    after = scrape_until(cluster, lambda s: sample(s["memory manager"], "kunserve:group_size", group=group) == 2
                         and sample(s["monitor"], "kunserve:layout_epoch") > monitor_epoch
                         and all(sample(s[w], "kunserve:layout_epoch", worker=w) > worker_epochs[w] for w in workers),
                         "the drop")
    mm = after["memory manager"]
    assert sample(mm, "kunserve:layout_epoch") >= report["epoch"]
    assert sample(mm, "kunserve:drops_total", outcome="completed") == drops + 1
    assert sample(mm, "kunserve:drop_duration_seconds_count", outcome="completed") == drops + 1
    assert sample(mm, "kunserve:num_groups") == 1
    assert sample(mm, "kunserve:group_kv_blocks_total", group=group) > max(whole_kv.values())
    assert sample(mm, "kunserve:group_kv_blocks_total", group=workers[0]) is None
    for w in workers:
        assert sample(after[w], "kunserve:layers_held", worker=w) < sample(before[w], "kunserve:layers_held", worker=w)
        assert sample(after[w], "kunserve:kv_blocks_total", worker=w) > sample(before[w], "kunserve:kv_blocks_total",
                                                                               worker=w)

    restored = kunctl(cluster, "restore")
    assert restored["completed"] and restored["epoch"] > report["epoch"]
    final = scrape_until(cluster, lambda s: sample(s["memory manager"], "kunserve:num_groups") == 0
                         and sample(s["memory manager"], "kunserve:group_size", group=workers[0]) == 1, "the restore")
    mm = final["memory manager"]
    assert sample(mm, "kunserve:restores_total", outcome="completed") == 1
    assert sample(mm, "kunserve:layout_epoch") >= restored["epoch"]
    assert sample(mm, "kunserve:drop_state_seconds_total") > 0
    assert {w: sample(mm, "kunserve:group_kv_blocks_total", group=w) for w in workers} == whole_kv
