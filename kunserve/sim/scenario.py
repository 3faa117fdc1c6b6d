"""Scenario files (configs/scenarios/*.toml) and the simulated cluster they describe.

A scenario names the cluster (how many instances of which model on which accelerator, with how much memory and
which network between them), the trace (the bench's trace flags: generator or file, bursts, upscaling), the
overload policies to compare, overrides of the cluster config (the same sections and keys as configs/cluster.toml),
an optional offline backlog and a load sweep (ConServe §6.2), and the paper's numbers to print beside the
simulated ones::

    [scenario]
    name = "fig13-sharegpt"
    figure = "KunServe Fig. 13, ShareGPT on Qwen-2.5-14B"
    policies = ["recompute", "swap", "migrate", "kunserve"]

    [cluster]
    instances = 8
    model = "qwen2.5-14b"       # a shipped shape, a model directory, or a config.json
    accelerator = "A800"        # or profile = "FILE" (a `kunserve profile` file)
    tp = 1                      # GPUs per instance
    elastic_tp = false          # merge whole instances into TP2/TP4 for long requests (dispatcher.elastic_tp)
    tp_reform_s = 15.0          # a cold re-form's restart, before the member's weight shard loads
    gpus_per_host = 8           # co-location domain: a TP instance's members share a host
    memory_utilization = 0.9    # of each GPU's memory the pool takes
    network_gbps = 200          # between instances

    [trace]                     # the bench's trace flags, by their option names with '_' for '-'
    profile = "sharegpt"
    burst = ["60:40:4"]

    [config.engine]             # any key of configs/cluster.toml
    max_num_batched_tokens = 2048

    [paper]                     # free-form: shown beside the simulated results
    "ttft_p99 recompute / kunserve" = "12.7-72.2x"

Every key is checked: an unknown one, or a value of the wrong type, is a one-line ScenarioError.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kunserve.shared.config import ClusterConfig
from kunserve.sim.cluster import ClusterSetup
from kunserve.sim.elastic import GPUS_PER_HOST, TP_REFORM_S
from kunserve.sim.hardware import Accelerator, accelerator
from kunserve.sim.shapes import Memory, ModelShape, ShapeError, load_model_config
from kunserve.sim.timing import Links, TimeModel, profile_from_file, roofline_links, roofline_profile

GIB = 1024**3
DEFAULT_MEMORY_UTILIZATION = 0.9  # vLLM's gpu_memory_utilization: the rest is activations and the CUDA context
DEFAULT_NETWORK_GBPS = 200.0  # KunServe's cluster A: 200 Gbps RDMA between single-GPU servers
# The local machine when the time model is a CPU profile: UCX over loopback between worker processes, memcpy.
LOCAL_LINKS = Links(network=5e9, host=10e9, device=20e9, latency_s=100e-6)


class ScenarioError(ValueError):
    """A scenario (file or flags) that cannot be simulated; the message is one line."""


CLUSTER_KEYS = {
    "instances": int,
    "model": str,
    "accelerator": str,
    "profile": str,
    "profile_device": str,
    "tp": int,
    "memory_utilization": float,
    "gpu_memory_gib": float,
    "network_gbps": float,
    "iteration_overhead_ms": float,
    "request_latency_ms": float,
    "sequence_overhead_ms": float,
    "forward_scale": float,
    "elastic_tp": bool,
    "tp_reform_s": float,
    "gpus_per_host": int,
}
TRACE_KEYS = {
    "trace": str,
    "trace_format": str,
    "limit": int,
    "rate": float,
    "cv": float,
    "duration": float,
    "burst": list,
    "bursts": int,
    "burst_gap": float,
    "profile": str,
    "length_scale": float,
    "max_prompt": int,
    "max_output": int,
    "upscale": float,
    "seed": int,
    "calibrate": str,
    "overload": float,
    "request_timeout": float,
}
OFFLINE_KEYS = {"inflight": int, "prompt_mean": int, "output_mean": int, "count": int}
SWEEP_KEYS = {"rates": list, "slo_scale": float, "prompt_tokens": int, "output_tokens": int}


@dataclass(frozen=True)
class Scenario:
    name: str
    figure: str = ""
    policies: tuple[str, ...] = ()
    cluster: Mapping[str, Any] = field(default_factory=dict)
    trace: Mapping[str, Any] = field(default_factory=dict)
    config: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    offline: Mapping[str, Any] | None = None
    sweep: Mapping[str, Any] | None = None
    paper: Mapping[str, Any] = field(default_factory=dict)
    leaves_out: tuple[str, ...] = ()
    path: str = ""


def _typed(section: str, values: Mapping[str, Any], keys: Mapping[str, type], where: str) -> dict[str, Any]:
    out = {}
    for key, value in values.items():
        want = keys.get(key)
        if want is None:
            raise ScenarioError(f"{where}: [{section}] has no key {key!r} (known: {', '.join(sorted(keys))})")
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, want) or isinstance(value, bool) and want is not bool:
            raise ScenarioError(f"{where}: [{section}] {key} must be {want.__name__}, got {value!r}")
        out[key] = value
    return out


def load_scenario(path: str | pathlib.Path) -> Scenario:
    where = str(path)
    try:
        raw = tomllib.loads(pathlib.Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ScenarioError(f"{where}: file not found") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ScenarioError(f"{where}: {exc}") from None
    known = {"scenario", "cluster", "trace", "config", "offline", "sweep", "paper"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ScenarioError(f"{where}: unknown section(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    head = raw.get("scenario", {})
    if not isinstance(head, dict) or not isinstance(head.get("name", ""), str):
        raise ScenarioError(f"{where}: [scenario] needs a name")
    extra = sorted(set(head) - {"name", "figure", "policies", "leaves_out"})
    if extra:
        raise ScenarioError(f"{where}: [scenario] has no key {extra[0]!r}")
    policies = head.get("policies", [])
    if not isinstance(policies, list) or not all(isinstance(p, str) for p in policies):
        raise ScenarioError(f"{where}: [scenario] policies must be a list of names")
    config = raw.get("config", {})
    if not isinstance(config, dict) or not all(isinstance(v, dict) for v in config.values()):
        raise ScenarioError(f"{where}: [config] holds sections of the cluster config, e.g. [config.engine]")
    return Scenario(
        name=head.get("name") or pathlib.Path(path).stem,
        figure=str(head.get("figure", "")),
        policies=tuple(policies),
        cluster=_typed("cluster", raw.get("cluster", {}), CLUSTER_KEYS, where),
        trace=_typed("trace", raw.get("trace", {}), TRACE_KEYS, where),
        config=config,
        offline=_typed("offline", raw["offline"], OFFLINE_KEYS, where) if "offline" in raw else None,
        sweep=_typed("sweep", raw["sweep"], SWEEP_KEYS, where) if "sweep" in raw else None,
        paper=dict(raw.get("paper", {})),
        leaves_out=tuple(str(x) for x in head.get("leaves_out", [])),
        path=where,
    )


def apply_config(cfg: ClusterConfig, overrides: Mapping[str, Mapping[str, Any]], where: str = "config") -> None:
    """Set [config.SECTION] KEY = VALUE on the cluster config, each key and type checked."""
    for section, values in overrides.items():
        target = getattr(cfg, section, None)
        if target is None or not dataclasses.is_dataclass(target) or isinstance(target, list):
            raise ScenarioError(f"{where}: the cluster config has no section [{section}]")
        names = {f.name: f for f in dataclasses.fields(target)}
        for key, value in values.items():
            if key not in names:
                raise ScenarioError(f"{where}: [{section}] has no key {key!r}")
            current = getattr(target, key)
            if isinstance(current, float) and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if type(value) is not type(current):
                raise ScenarioError(f"{where}: [{section}] {key} must be {type(current).__name__}, got {value!r}")
            setattr(target, key, value)


@dataclass
class ClusterSpec:
    """The simulated hardware and model, from a scenario's [cluster] and the command line."""

    instances: int
    model: str
    accelerator: str | None = None
    profile: str | None = None
    profile_device: str | None = None
    tp: int = 1
    memory_utilization: float = DEFAULT_MEMORY_UTILIZATION
    gpu_memory_gib: float | None = None
    network_gbps: float | None = None
    iteration_overhead_ms: float = 0.0
    request_latency_ms: float = 0.0
    sequence_overhead_ms: float = 0.0
    forward_scale: float = 1.0
    elastic_tp: bool | None = None  # given: sets dispatcher.elastic_tp (cmd_simulate)
    tp_reform_s: float = TP_REFORM_S
    gpus_per_host: int = GPUS_PER_HOST

    def check(self) -> None:
        if self.instances < 1:
            raise ScenarioError(f"instances must be >= 1, got {self.instances}")
        if self.tp < 1:
            raise ScenarioError(f"tp must be >= 1, got {self.tp}")
        if not 0 < self.memory_utilization <= 1:
            raise ScenarioError(f"memory_utilization must be in (0, 1], got {self.memory_utilization}")
        if self.accelerator and self.profile:
            raise ScenarioError("give an accelerator (analytic roofline) or a profile file, not both")
        if self.network_gbps is not None and not (math.isfinite(self.network_gbps) and self.network_gbps > 0):
            raise ScenarioError(f"network_gbps must be > 0, got {self.network_gbps}")
        for name in ("iteration_overhead_ms", "request_latency_ms", "sequence_overhead_ms"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ScenarioError(f"{name} must be >= 0, got {value}")
        if not (math.isfinite(self.forward_scale) and self.forward_scale > 0):
            raise ScenarioError(f"forward_scale must be > 0, got {self.forward_scale}")
        if not (math.isfinite(self.tp_reform_s) and self.tp_reform_s >= 0):
            raise ScenarioError(f"tp_reform_s must be >= 0, got {self.tp_reform_s}")
        if self.gpus_per_host < 1:
            raise ScenarioError(f"gpus_per_host must be >= 1, got {self.gpus_per_host}")


def _pool_bytes(spec: ClusterSpec, acc: Accelerator | None, cfg: ClusterConfig) -> int:
    """Each instance's pool: its GPUs' memory times the utilization, or the config's engine.pool_mib (a CPU)."""
    if acc is None and spec.gpu_memory_gib is None:
        return cfg.engine.pool_mib * 1024 * 1024
    per_gpu = acc.memory_bytes / GIB if acc is not None else None
    gib = spec.gpu_memory_gib if spec.gpu_memory_gib is not None else per_gpu
    assert gib is not None
    if per_gpu is not None and gib > per_gpu:
        raise ScenarioError(f"{gib:g} GiB per GPU asked for, but an {acc.name if acc else ''} has {per_gpu:g} GiB")
    if not gib > 0:
        raise ScenarioError(f"gpu_memory_gib must be > 0, got {gib}")
    return int(gib * GIB * spec.memory_utilization) * spec.tp


def build_setup(
    cfg: ClusterConfig, spec: ClusterSpec, *, label: str, local_profile: str | None = None, local_device: str | None = None
) -> ClusterSetup:
    """The ClusterSetup of `spec` under `cfg`. The time model: the roofline of spec.accelerator, else the profile
    file spec.profile, else `local_profile` (the file this machine's workers use) for `local_device`."""
    spec.check()
    if cfg.dispatcher.elastic_tp and spec.tp != 1:
        raise ScenarioError(f"elastic tensor parallelism merges whole single-GPU instances: tp must be 1, got {spec.tp}")
    try:
        shape = ModelShape(load_model_config(spec.model, None), block_size=cfg.engine.block_size, tp=spec.tp)
    except ShapeError as exc:
        raise ScenarioError(str(exc)) from None
    acc = accelerator(spec.accelerator) if spec.accelerator else None
    try:
        memory = Memory(shape, _pool_bytes(spec, acc, cfg), cfg.engine.page_kib * 1024)
    except ShapeError as exc:
        raise ScenarioError(str(exc)) from None
    by_degree: dict[int, TimeModel] = {}
    overheads = {
        "iteration_overhead_s": spec.iteration_overhead_ms / 1e3,
        "request_latency_s": spec.request_latency_ms / 1e3,
        "sequence_overhead_s": spec.sequence_overhead_ms / 1e3,
        "forward_scale": spec.forward_scale,
    }
    if acc is not None:
        links = roofline_links(acc, spec.network_gbps if spec.network_gbps is not None else DEFAULT_NETWORK_GBPS)
        time = TimeModel(roofline_profile(shape, acc), links, f"roofline {acc.name} x{spec.tp}", **overheads)
        if cfg.dispatcher.elastic_tp:  # a merged instance of d GPUs steps at the roofline of d GPUs
            for d in (2, 4):
                tp_shape = dataclasses.replace(shape, tp=d)
                by_degree[d] = TimeModel(roofline_profile(tp_shape, acc), links, f"roofline {acc.name} x{d}", **overheads)
    else:
        path = spec.profile or local_profile
        if not path:
            raise ScenarioError("no time model: give an accelerator (roofline) or a profile file (`kunserve profile`)")
        device = spec.profile_device if spec.profile else (spec.profile_device or local_device)
        profile = profile_from_file(path, shape, device)
        links = LOCAL_LINKS if spec.network_gbps is None else dataclasses.replace(LOCAL_LINKS, network=spec.network_gbps * 1e9 / 8)
        time = TimeModel(profile, links, f"profile {path}: {profile.key}", **overheads)
    return ClusterSetup(
        cfg,
        shape,
        memory,
        time,
        spec.instances,
        label,
        tp_reform_s=spec.tp_reform_s,
        gpus_per_host=spec.gpus_per_host,
        time_by_degree=by_degree,
    )


def machine_profile(cfg: ClusterConfig) -> tuple[str | None, str]:
    """The profile file this machine's workers read (engine.profile, else the cache) and their device signature."""
    from kunserve.services.worker.own_profile import cache_path
    from kunserve.shared.process import pick_device, thread_share
    from kunserve.shared.profile_files import device_signature

    path = cfg.engine.profile or (str(cache_path(cfg.engine.profile_cache)) if cfg.engine.profile_cache else None)
    return path, device_signature(pick_device(cfg.model.device), thread_share(cfg))


def offline_backlog(
    n: int, *, seed: int, context: int, prompt_mean: int | None = None, output_mean: int | None = None
) -> list[tuple[int, int]]:
    """`n` (prompt, output) lengths of ConServe's offline work at full size: each request from one of its offline
    sets (Table 1: DuReader, MultiNews, VCSUM) at random, lognormal around the set's means (or the given means), the
    bench's spread, each fitting the model's `context`."""
    import numpy as np

    from kunserve.benchkit.coserve import OFFLINE_DATASETS, OFFLINE_SIGMA

    rng = np.random.default_rng([seed, 0x0FF])
    sets = list(OFFLINE_DATASETS.values())
    out = []
    for k in rng.integers(0, len(sets), n):
        mean_in, mean_out = sets[int(k)]
        mean_in, mean_out = prompt_mean or mean_in, output_mean or mean_out
        p = int(rng.lognormal(math.log(mean_in) - OFFLINE_SIGMA**2 / 2, OFFLINE_SIGMA))
        o = int(rng.lognormal(math.log(mean_out) - OFFLINE_SIGMA**2 / 2, OFFLINE_SIGMA))
        o = max(1, min(o, context // 4))
        out.append((max(1, min(p, context - o)), o))
    return out


__all__ = ["ClusterSpec", "machine_profile", "offline_backlog", "Scenario", "ScenarioError", "apply_config", "build_setup", "load_scenario"]
