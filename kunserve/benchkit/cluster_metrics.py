"""What `bench compare` reads from a local cluster's Prometheus endpoints before it stops the cluster: how long
requests queued in the workers (``kunserve:request_queue_time_seconds``, every worker's histogram merged), and for
the ``kunserve+autoscale`` row what the autoscaler did and how long it took from "autoscale needed" to the new
instance serving (``kunserve:autoscale_*``, README "Discovery and autoscaling")."""

from __future__ import annotations

import math
import urllib.error
import urllib.request
from collections.abc import Iterable

from prometheus_client.parser import text_string_to_metric_families

SCRAPE_TIMEOUT_S = 5.0


def scrape(address: str, timeout_s: float = SCRAPE_TIMEOUT_S) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of `http://address/metrics`, keyed by (name, sorted labels); empty when it does not answer."""
    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout_s) as resp:
            text = resp.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, TimeoutError):
        return {}
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def queue_time(worker_addresses: Iterable[str]) -> dict | None:
    """Online requests' queue time in the workers, every worker's histogram merged: mean, p99 (the upper bound of
    the bucket it falls in; inf beyond the last) and how many requests. None when no worker answered."""
    buckets: dict[float, float] = {}
    total = count = 0.0
    answered = False
    for address in worker_addresses:
        samples = scrape(address)
        answered = answered or bool(samples)
        for (name, labels), value in samples.items():
            if name == "kunserve:request_queue_time_seconds_bucket":
                le = float(dict(labels)["le"])
                buckets[le] = buckets.get(le, 0.0) + value
            elif name == "kunserve:request_queue_time_seconds_sum":
                total += value
            elif name == "kunserve:request_queue_time_seconds_count":
                count += value
    if not answered:
        return None
    p99 = None
    if count:
        p99 = next((le for le, n in sorted(buckets.items()) if n >= 0.99 * count), math.inf)
    return {"mean_s": total / count if count else None, "p99_s": p99, "requests": int(count)}


def autoscale(memory_manager_address: str) -> dict | None:
    """What the autoscaler did: instances asked for, served, failed or timed out, given back, and the mean time from
    the need to the instance serving. None when the memory manager's endpoint does not answer."""
    samples = scrape(memory_manager_address)
    if not samples:
        return None
    served = _value(samples, "kunserve:autoscale_time_to_serving_seconds_count")
    ups = {o: int(_value(samples, "kunserve:autoscale_scale_ups_total", outcome=o)) for o in ("requested", "served", "failed", "timed_out")}
    return {
        "scale_ups": ups,
        "scale_downs": int(_value(samples, "kunserve:autoscale_scale_downs_total", outcome="completed")),
        "autoscale_signals": int(_value(samples, "kunserve:autoscale_signals_total")),
        "time_to_serving_s": (_value(samples, "kunserve:autoscale_time_to_serving_seconds_sum") / served if served else None),
    }


def drop_to_new_instance(samples: list[dict]) -> float | None:
    """Seconds from the first sampled drop (a pipeline group in the layout) to the first sample with more workers than
    the run started with (an instance the autoscaler added serving): what the drop's seconds had to hide. None when
    either never happened."""
    if not samples:
        return None
    start = samples[0]["workers"]
    dropped = next((x["t_s"] for x in samples if x["pipelined_units"]), None)
    grown = next((x["t_s"] for x in samples if x["workers"] > start), None)
    if dropped is None or grown is None:
        return None
    return max(0.0, grown - dropped)
