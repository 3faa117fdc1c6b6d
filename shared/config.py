"""The one cluster config file that drives the local launcher, every service and compose.yaml.

Precedence (lowest to highest): built-in defaults < the TOML file < environment variables
(`KUNSERVE__<SECTION>__<KEY>=value`, e.g. `KUNSERVE__DISPATCHER__PORT=6000`) < command-line flags.
Every error names the file, the field and what was expected, so a user never sees a traceback for a
typo in the config.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kunserve.shared.policy.batch_scheduler import COSERVING_MODES
from kunserve.shared.policy.elastic_tp import DEGREES as TP_DEGREES
from kunserve.shared.policy.overload_policies import OVERLOAD_POLICIES

ENV_PREFIX = "KUNSERVE__"
CONFIG_ENV = "KUNSERVE_CONFIG"  # path of the config file when --config is not given
EMBEDDED_SERVED_NAME = "kunserve-tiny"  # the embedded model's id on the HTTP front


class ConfigError(ValueError):
    """A config value is missing, unknown or of the wrong type/range; the message names it."""


@dataclass
class ModelSection:
    path: str = ""  # local HF-format directory; empty = the embedded tiny model
    dtype: str = "float32"
    device: str = "auto"  # auto | cpu | cuda
    seed: int = 0  # seed of the embedded model's random weights
    served_name: str = ""  # the model id of the HTTP front (/v1/models); empty = the directory's name, or kunserve-tiny
    chat_template: str = ""  # a jinja chat template file used instead of the model's own; empty = the model's

    @property
    def served_model(self) -> str:
        return self.served_name or (pathlib.Path(self.path).name if self.path else EMBEDDED_SERVED_NAME)


@dataclass
class ServiceSection:
    host: str = "127.0.0.1"  # the address peers use to reach it
    port: int = 0
    bind: str = ""  # address to listen on; empty = host (containers set 0.0.0.0)
    metrics_port: int = 0  # Prometheus `GET /metrics` (plain HTTP) on the bind host; 0 = none

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def bind_address(self) -> str:
        return f"{self.bind or self.host}:{self.port}"

    @property
    def metrics_bind(self) -> tuple[str, int]:
        return self.bind or self.host, self.metrics_port


@dataclass
class WorkerSection(ServiceSection):
    id: str = ""
    layer_start: int = 0
    layer_end: int = -1  # -1 = all layers of the model
    transfer_port: int = 0  # UCX listener (KV exchange, activations); 0 = any free port, reported via GetInfo


@dataclass
class TensorParallelSection:
    """A static tensor-parallel instance (README "Elastic tensor parallelism (Gyges)"): these workers, in rank order,
    each hold a shard of every layer; rank 0 owns the requests. The ranks meet on `port` of rank 0's host."""

    members: list[str] = field(default_factory=list)
    port: int = 0  # the rendezvous port on rank 0's host; 0 = the local launcher picks a free one
    # A collective that waits longer means a member hangs: the instance breaks and its workers exit (rank 0 sends a
    # heartbeat every timeout_s / 4 while idle, so an idle instance never times out).
    timeout_s: float = 30.0
    rendezvous_timeout_s: float = 300.0  # how long the members wait for each other at start-up

    @property
    def degree(self) -> int:
        return len(self.members)



@dataclass
class DispatcherSection(ServiceSection):
    port: int = 50051
    metrics_port: int = 9400
    # How long a request may wait for a routable worker (all busy forming a group, or restarting)
    # before the client gets UNAVAILABLE.
    route_timeout_s: float = 30.0
    # Transformation-aware routing (README "Elastic tensor parallelism (Gyges)"): a request longer than every routable
    # instance's KV asks the memory manager, which may scale co-located whole instances up into a TP2 / TP4 instance
    # for it (within route_timeout_s). Off: such a request is refused by the worker it is routed to.
    elastic_tp: bool = False
    # Admission control: beyond these bounds a request is refused at once with RESOURCE_EXHAUSTED and a
    # retry hint (the message and the grpc-retry-pushback-ms trailer), so an accepted one is never starved.
    max_inflight_per_worker: int = 0  # requests in flight per routable worker; 0 = engine.max_num_seqs
    max_queued_prompt_tokens: int = 0  # prompt tokens of accepted requests without a first token yet;
    #                                    0 = the routable workers' KV capacity in tokens
    queue_timeout_s: float = 30.0  # an accepted request with no first token by then: RESOURCE_EXHAUSTED
    # Prompt limits, checked before a prompt is tokenized or forwarded (and the gRPC message size limit).
    max_prompt_tokens: int = 0  # 0 = the model's context (config.json max_position_embeddings)
    max_prompt_bytes: int = 0  # text prompts; 0 = 32 bytes per token of max_prompt_tokens
    # Liveness: a worker whose stats stop answering, or whose engine has running requests but makes no
    # progress, for this long is taken out of routing and its requests resume elsewhere.
    stall_timeout_s: float = 3.0
    # The OpenAI-compatible HTTP front (/v1/completions, /v1/chat/completions, ...) on the same host / bind as
    # the gRPC API; 0 = none.
    http_port: int = 8000
    # Offline batches (the Batches gRPC service, `kunserve batch`, /v1/files + /v1/batches): the durable job store,
    # one SQLite file created on the first submit (a relative path is relative to the dispatcher's working dir).
    batch_db: str = "kunserve-batches.sqlite3"
    batch_max_bytes: int = 100 * 1024 * 1024  # a batch's input file
    batch_max_requests: int = 50_000  # requests (lines) in one batch, OpenAI's limit
    batch_concurrency: int = 8  # batch requests in flight at once (offline class, within the admission bounds)

    @property
    def http_address(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def http_bind(self) -> tuple[str, int]:
        return self.bind or self.host, self.http_port


@dataclass
class MemoryManagerSection(ServiceSection):
    port: int = 50052
    metrics_port: int = 9401
    transition_timeout_s: float = 60.0  # one worker's prepare / execute of a drop or restore
    preconnect: bool = True  # link every worker pair over UCX ahead of the first drop (saves 0.1-0.3 s of it)
    # A worker paused for a transition aborts it on its own after this long without a step or a renewal
    # (the memory manager renews every lease / 3): a dead memory manager never leaves workers paused.
    transition_lease_s: float = 5.0
    # KunServe §4.2: a transition's members resume as soon as the layout has changed (the freed pages hold KV,
    # queued requests run) while the running requests' KV streams in the background; only those requests wait
    # until theirs has landed. false: every member pauses from Prepare until the whole exchange has landed
    # (the "kunserve-no-coord" ablation).
    coordinated_exchange: bool = True
    # Runtime membership (README "Discovery and autoscaling"): a worker the config does not list joins by registering;
    # every worker registers again every member_timeout_s / 4, and a joined worker silent for member_timeout_s has
    # left (its requests resume elsewhere, as for any dead worker).
    member_timeout_s: float = 10.0
    # With dispatcher.elastic_tp: a tensor-parallel instance that held no request for this long is split back into
    # whole instances (README "Elastic tensor parallelism (Gyges)"); 0 = never (kunctl tp-split only).
    tp_idle_split_s: float = 30.0
    # How a tensor-parallel change happens when kunctl tp / tp-split or transformation-aware routing does not say:
    # "cold" re-executes the members (running requests re-prefill) and "in-place" changes the running processes (the
    # requests keep their KV; the pool keeps the whole model). README "Elastic tensor parallelism (Gyges)".
    tp_mode: str = "cold"


@dataclass
class EngineSection:
    block_size: int = 16  # tokens per KV block
    pool_mib: int = 256  # memory per worker for weights + KV cache (the unified memory pool)
    page_kib: int = 2048  # pool page size (2 MiB = the CUDA VMM granularity)
    memory_backend: str = "auto"  # auto | host | cuda
    host_copy: bool = True  # keep a DRAM copy of the weights for fast restores
    # keep the host buffer a drop copies its outgoing KV into faulted in ahead of the KV in use (up to the peak
    # KV in use, in host memory), so a drop's decision waits for no page faults; false: allocate it at each drop
    warm_staging: bool = True
    max_num_batched_tokens: int = 256  # per-iteration token budget
    max_num_seqs: int = 64
    # ConServe: a new offline request is admitted only while this share of the KV blocks stays free (room for
    # online arrivals without preempting offline work)
    offline_free_watermark: float = 0.1
    # ConServe's layer-wise preemption: a whole instance's forward pass checks for an online arrival that would
    # miss slo.ttft_ms every this many layers and then finishes the iteration without its offline rows; 0 = off
    safepoint_layers: int = 1
    # How offline requests share an instance with online ones: "conserve" (Algorithm 1, the SLO budget and
    # layer-wise preemption), or a baseline of ConServe §6 (`kunserve bench coserve`): "preemptive" (vLLM-style
    # priority: offline admitted greedily, preempted by recompute, fixed budget, no safepoints) or "non-preemptive"
    # (class-blind FCFS, fixed budget, no safepoints). Both baselines override budget and safepoint_layers.
    coserving: str = "conserve"
    # ConServe's incremental KV checkpoints (§4.4): host memory (MiB per worker, allocated as used) into which the
    # offline requests' completed KV blocks are copied in the background, so preempting one frees its KV at once and
    # recomputes nothing; when full, the oldest offline requests fall back to recompute. 0 = off. Under
    # engine.coserving = "conserve" only (the baselines preempt by recompute).
    checkpoint_mib: int = 256
    threads: int = 0  # torch threads per worker; 0 = share of the cores
    # SLO-aware token budget (ConServe), on by default: with budget = "auto" a worker keeps every iteration's
    # predicted latency under budget_headroom * slo.tbt_ms (and its tokens under max_num_batched_tokens), under
    # the cost-model profile for its model / dtype / layer range / device / threads from `profile` (a file
    # written by `kunserve profile`), else from `profile_cache`, else measured at start-up (seconds) and added
    # to profile_cache. profile_cache = "" turns self-profiling off. "fixed" = max_num_batched_tokens always.
    profile: str = ""
    profile_cache: str = "~/.cache/kunserve/profiles.json"
    budget: str = "auto"  # auto | fixed
    budget_headroom: float = 0.9
    # Microbatches of a pipeline group's head (KunServe §4.3): with a long queue, the lookahead formulation
    # (cost-balanced microbatches under the profile's fitted cost model, token chunking without a matching
    # profile); false = token chunking always (the "kunserve-no-lookahead" ablation).
    lookahead: bool = True


@dataclass
class MonitorSection(ServiceSection):
    port: int = 50053
    metrics_port: int = 9402
    stats_interval_s: float = 0.2
    stale_after_s: float = 3.0  # a worker silent for longer is reported unhealthy
    # Parameter-centric overload handling (KunServe §4): drop on overload, restore on underload.
    auto_drop: bool = True
    policy_interval_s: float = 0.2
    overload_hold_s: float = 0.0  # overload must last this long before a drop (0 = at once)
    restore_threshold: float = 0.5  # restore a group once usage < this fraction of its undropped capacity...
    restore_hold_s: float = 10.0  # ...for this long
    restore_cooldown_s: float = 30.0  # no restore this soon after a drop


@dataclass
class PolicySection:
    # How the cluster handles KV-memory overload: one of OVERLOAD_POLICIES, each described (and decoded for
    # every component) in kunserve.shared.policy.overload_policies.
    overload: str = "kunserve"


@dataclass
class SLOSection:
    ttft_ms: float = 5000.0
    tbt_ms: float = 200.0


@dataclass
class SecuritySection:
    # Credentials (README "Security"). Each *_file is a path to a file holding one token; empty = the
    # environment variable, else the default file under $KUNSERVE_HOME (~/.kunserve) that `kunserve up` writes.
    cluster_secret_file: str = ""  # every internal RPC and the UCX handshake ($KUNSERVE_CLUSTER_SECRET)
    admin_token_file: str = ""  # kunctl on the admin port ($KUNSERVE_ADMIN_TOKEN)
    api_key_file: str = ""  # clients' Generate / Cancel ($KUNSERVE_API_KEY); none = the client API is open
    # Optional TLS: PEM files. tls_cert_file + tls_key_file turn it on for every service (the certificate
    # names every service host); tls_ca_file verifies it; a client certificate as well = mutual TLS.
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_ca_file: str = ""
    tls_client_cert_file: str = ""
    tls_client_key_file: str = ""


@dataclass
class AutoscaleSection:
    # README "Discovery and autoscaling": the memory manager asks a scaler for more instances when no drop plan meets
    # the requirement ("autoscale needed") or a drop has held for hold_s, and gives an added one back once the
    # cluster has been calm (no group, no need, KV usage low) for scale_down_hold_s.
    scaler: str = "none"  # none | local (standby workers of `kunserve up --standby N`) | kubernetes (StatefulSet replicas)
    hold_s: float = 30.0  # a drop that has held this long asks for an instance too
    scale_down_hold_s: float = 60.0  # calm this long before an added worker is drained and given back
    scale_down_usage: float = 0.5  # ...and only while the KV usage without it stays below this fraction
    cooldown_s: float = 5.0  # at least this long between two scale actions
    scale_up_timeout_s: float = 120.0  # an asked-for instance not serving by then: logged, the cluster goes on
    drain_timeout_s: float = 30.0  # a draining worker's running requests finish for this long, then resume elsewhere
    max_workers: int = 0  # members at most, seeds included; 0 = no cap but the scaler's
    # kubernetes: the worker StatefulSet whose spec.replicas the memory manager patches (RBAC in deploy/k8s/base)
    statefulset: str = "kunserve-worker"
    namespace: str = ""  # empty = the memory manager pod's own namespace
    api_url: str = ""  # empty = in cluster: https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT
    max_replicas: int = 0  # 0 = no cap
    api_timeout_s: float = 10.0


@dataclass
class LoggingSection:
    format: str = "auto"  # auto (pretty on a terminal, JSON otherwise) | json | console
    level: str = "info"


@dataclass
class ClusterConfig:
    model: ModelSection = field(default_factory=ModelSection)
    dispatcher: DispatcherSection = field(default_factory=DispatcherSection)
    memory_manager: MemoryManagerSection = field(default_factory=MemoryManagerSection)
    monitor: MonitorSection = field(default_factory=MonitorSection)
    workers: list[WorkerSection] = field(default_factory=list)
    tensor_parallel: list[TensorParallelSection] = field(default_factory=list)
    engine: EngineSection = field(default_factory=EngineSection)
    policy: PolicySection = field(default_factory=PolicySection)
    slo: SLOSection = field(default_factory=SLOSection)
    autoscale: AutoscaleSection = field(default_factory=AutoscaleSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    security: SecuritySection = field(default_factory=SecuritySection)
    source: str = "<defaults>"  # where it was loaded from, for messages

    def worker(self, worker_id: str) -> WorkerSection:
        for w in self.workers:
            if w.id == worker_id:
                return w
        known = ", ".join(w.id for w in self.workers) or "none"
        raise ConfigError(f"{self.source}: no worker with id {worker_id!r} (configured: {known})")

    def tensor_parallel_of(self, worker_id: str) -> tuple[int, TensorParallelSection] | None:
        """The [[tensor_parallel]] entry (its index and itself) that `worker_id` is a member of; None: none."""
        for i, tp in enumerate(self.tensor_parallel):
            if worker_id in tp.members:
                return i, tp
        return None

    def to_toml(self) -> str:
        """Serialize back to TOML (the launcher hands children one effective file)."""
        lines: list[str] = []
        for f in dataclasses.fields(self):
            if f.name in ("workers", "tensor_parallel", "source"):
                continue
            lines.append(f"[{f.name}]")
            lines.extend(_toml_items(getattr(self, f.name)))
            lines.append("")
        for w in self.workers:
            lines.append("[[workers]]")
            lines.extend(_toml_items(w))
            lines.append("")
        for tp in self.tensor_parallel:
            lines.append("[[tensor_parallel]]")
            lines.append("members = [" + ", ".join(_toml_str(m) for m in tp.members) + "]")
            lines.extend(item for item in _toml_items(tp) if not item.startswith("members ="))
            lines.append("")
        return "\n".join(lines)


def _toml_items(section: Any) -> list[str]:
    out = []
    for f in dataclasses.fields(section):
        v = getattr(section, f.name)
        if isinstance(v, list):
            continue  # list-valued keys are written by their section's owner (to_toml)
        if isinstance(v, bool):
            out.append(f"{f.name} = {'true' if v else 'false'}")
        elif isinstance(v, (int, float)):
            out.append(f"{f.name} = {v!r}")
        else:
            out.append(f"{f.name} = {_toml_str(str(v))}")
    return out


def _toml_str(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _coerce(where: str, value: Any, target: Any) -> Any:
    """Convert value to the type of the default `target`, or raise ConfigError naming `where`."""
    kind = type(target)
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return value.lower() in ("1", "true", "yes", "on")
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if kind is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        try:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected an integer, got {value!r}") from None
    if kind is float:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected a number, got {value!r}") from None
    if kind is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return str(value)
    raise ConfigError(f"{where}: unsupported value {value!r}")


def _apply(where: str, section: Any, values: Mapping[str, Any]) -> None:
    if not isinstance(values, Mapping):
        raise ConfigError(f"{where}: expected a table, got {values!r}")
    names = {f.name for f in dataclasses.fields(section)}
    for key, value in values.items():
        if key not in names:
            raise ConfigError(f"{where}.{key}: unknown key (known: {', '.join(sorted(names))})")
        setattr(section, key, _coerce(f"{where}.{key}", value, getattr(section, key)))


def default_workers(n: int, base_port: int = 50061, base_metrics_port: int = 9410) -> list[WorkerSection]:
    return [WorkerSection(id=f"worker-{i}", port=base_port + i, metrics_port=base_metrics_port + i) for i in range(n)]


def config_from_dict(data: Mapping[str, Any], source: str = "<dict>") -> ClusterConfig:
    cfg = ClusterConfig(source=source)
    section_names = {f.name for f in dataclasses.fields(cfg)} - {"source"}
    for key, value in data.items():
        if key not in section_names:
            raise ConfigError(f"{source}: unknown section [{key}] (known: {', '.join(sorted(section_names))})")
        if key == "workers":
            if not isinstance(value, list):
                raise ConfigError(f"{source}: workers must be an array of tables ([[workers]])")
            cfg.workers = []
            for i, w in enumerate(value):
                ws = WorkerSection()
                _apply(f"{source}: workers[{i}]", ws, w)
                cfg.workers.append(ws)
        elif key == "tensor_parallel":
            cfg.tensor_parallel = _tensor_parallel_from(source, value)
        else:
            _apply(f"{source}: {key}", getattr(cfg, key), value)
    if not data.get("workers"):
        cfg.workers = default_workers(2)
    return cfg


def _tensor_parallel_from(source: str, value: Any) -> list[TensorParallelSection]:
    if not isinstance(value, list):
        raise ConfigError(f"{source}: tensor_parallel must be an array of tables ([[tensor_parallel]])")
    out = []
    for i, table in enumerate(value):
        where = f"{source}: tensor_parallel[{i}]"
        if not isinstance(table, Mapping):
            raise ConfigError(f"{where}: expected a table, got {table!r}")
        members = table.get("members")
        if not isinstance(members, list) or not all(isinstance(m, str) and m for m in members):
            raise ConfigError(f"{where}.members: expected a list of worker ids in rank order, got {members!r}")
        tp = TensorParallelSection(members=list(members))
        _apply(where, tp, {k: v for k, v in table.items() if k != "members"})
        out.append(tp)
    return out


def apply_env_overrides(cfg: ClusterConfig, environ: Mapping[str, str] | None = None) -> None:
    """`KUNSERVE__SECTION__KEY=value`; workers by index: `KUNSERVE__WORKERS__0__HOST=worker-0`."""
    environ = os.environ if environ is None else environ
    for name, value in sorted(environ.items()):
        if not name.startswith(ENV_PREFIX):
            continue
        parts = name[len(ENV_PREFIX):].lower().split("__")
        where = f"environment {name}"
        if parts[0] == "workers":
            if len(parts) != 3 or not parts[1].isdigit():
                raise ConfigError(f"{where}: expected KUNSERVE__WORKERS__<index>__<key>")
            idx = int(parts[1])
            if idx >= len(cfg.workers):
                raise ConfigError(f"{where}: worker index {idx} out of range ({len(cfg.workers)} workers)")
            _apply(where, cfg.workers[idx], {parts[2]: value})
        elif len(parts) == 2 and hasattr(cfg, parts[0]) and parts[0] not in ("source", "tensor_parallel"):
            _apply(where, getattr(cfg, parts[0]), {parts[1]: value})
        else:
            raise ConfigError(f"{where}: expected KUNSERVE__<section>__<key>")


def validate(cfg: ClusterConfig) -> None:
    src = cfg.source
    if not cfg.workers:
        raise ConfigError(f"{src}: at least one [[workers]] entry is required")
    seen: set[str] = set()
    for i, w in enumerate(cfg.workers):
        if not w.id:
            w.id = f"worker-{i}"
        if w.id in seen:
            raise ConfigError(f"{src}: workers[{i}].id {w.id!r} is used twice")
        seen.add(w.id)
    for name, svc in [("dispatcher", cfg.dispatcher), ("memory_manager", cfg.memory_manager),
                      ("monitor", cfg.monitor)] + [(f"workers[{i}]", w) for i, w in enumerate(cfg.workers)]:
        if not (0 <= svc.port < 65536):
            raise ConfigError(f"{src}: {name}.port must be in [0, 65535], got {svc.port}")
        http_port = getattr(svc, "http_port", 0)
        if not (0 <= http_port < 65536):
            raise ConfigError(f"{src}: {name}.http_port must be in [0, 65535] (0 = no HTTP front), got {http_port}")
        transfer_port = getattr(svc, "transfer_port", 0)
        if not (0 <= transfer_port < 65536):
            raise ConfigError(f"{src}: {name}.transfer_port must be in [0, 65535], got {transfer_port}")
        if not (0 <= svc.metrics_port < 65536):
            raise ConfigError(f"{src}: {name}.metrics_port must be in [0, 65535] (0 = no /metrics), got {svc.metrics_port}")
    _validate_tensor_parallel(cfg, seen)
    e = cfg.engine
    for key in ("block_size", "pool_mib", "page_kib", "max_num_batched_tokens", "max_num_seqs"):
        if getattr(e, key) <= 0:
            raise ConfigError(f"{src}: engine.{key} must be > 0, got {getattr(e, key)}")
    if e.page_kib % 4 != 0:
        raise ConfigError(f"{src}: engine.page_kib must be a multiple of 4 (KiB), got {e.page_kib}")
    if e.memory_backend not in ("auto", "host", "cuda"):
        raise ConfigError(f"{src}: engine.memory_backend must be auto, host or cuda, got {e.memory_backend!r}")
    if e.threads < 0:
        raise ConfigError(f"{src}: engine.threads must be >= 0, got {e.threads}")
    if e.budget not in ("auto", "fixed"):
        raise ConfigError(f"{src}: engine.budget must be auto or fixed, got {e.budget!r}")
    if not 0 < e.budget_headroom <= 1:
        raise ConfigError(f"{src}: engine.budget_headroom must be in (0, 1], got {e.budget_headroom}")
    if e.coserving not in COSERVING_MODES:
        raise ConfigError(f"{src}: engine.coserving must be one of {', '.join(COSERVING_MODES)}, got {e.coserving!r}")
    if e.safepoint_layers < 0:
        raise ConfigError(f"{src}: engine.safepoint_layers must be >= 0 (0 = off), got {e.safepoint_layers}")
    if e.checkpoint_mib < 0:
        raise ConfigError(f"{src}: engine.checkpoint_mib must be >= 0 (0 = off), got {e.checkpoint_mib}")
    if not 0 <= e.offline_free_watermark < 1:
        raise ConfigError(f"{src}: engine.offline_free_watermark must be in [0, 1), got {e.offline_free_watermark}")
    if not (cfg.slo.tbt_ms > 0 and cfg.slo.ttft_ms > 0):
        raise ConfigError(f"{src}: slo.ttft_ms and slo.tbt_ms must be > 0")
    if cfg.model.dtype not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"{src}: model.dtype must be float32, bfloat16 or float16, got {cfg.model.dtype!r}")
    if cfg.model.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"{src}: model.device must be auto, cpu or cuda, got {cfg.model.device!r}")
    if cfg.policy.overload not in OVERLOAD_POLICIES:
        raise ConfigError(f"{src}: policy.overload must be one of {', '.join(OVERLOAD_POLICIES)}, "
                          f"got {cfg.policy.overload!r}")
    m = cfg.monitor
    if m.stats_interval_s <= 0 or m.policy_interval_s <= 0:
        raise ConfigError(f"{src}: monitor.stats_interval_s and monitor.policy_interval_s must be > 0")
    if not 0 < m.restore_threshold < 1:
        raise ConfigError(f"{src}: monitor.restore_threshold must be in (0, 1), got {m.restore_threshold}")
    if min(m.overload_hold_s, m.restore_hold_s, m.restore_cooldown_s) < 0:
        raise ConfigError(f"{src}: monitor hold and cool-down times must be >= 0")
    if cfg.dispatcher.route_timeout_s < 0 or cfg.memory_manager.transition_timeout_s <= 0:
        raise ConfigError(f"{src}: dispatcher.route_timeout_s must be >= 0 and "
                          "memory_manager.transition_timeout_s > 0")
    d = cfg.dispatcher
    for key in ("max_inflight_per_worker", "max_queued_prompt_tokens", "max_prompt_tokens", "max_prompt_bytes"):
        if getattr(d, key) < 0:
            raise ConfigError(f"{src}: dispatcher.{key} must be >= 0 (0 = automatic), got {getattr(d, key)}")
    if not (d.queue_timeout_s > 0 and d.stall_timeout_s > 0):
        raise ConfigError(f"{src}: dispatcher.queue_timeout_s and dispatcher.stall_timeout_s must be > 0")
    for key in ("batch_max_bytes", "batch_max_requests", "batch_concurrency"):
        if getattr(d, key) <= 0:
            raise ConfigError(f"{src}: dispatcher.{key} must be > 0, got {getattr(d, key)}")
    if not d.batch_db:
        raise ConfigError(f"{src}: dispatcher.batch_db must name the batch store's file")
    _validate_security(cfg.security, src)
    if not 0.1 <= cfg.memory_manager.transition_lease_s <= 3600:
        raise ConfigError(f"{src}: memory_manager.transition_lease_s must be in [0.1, 3600], "
                          f"got {cfg.memory_manager.transition_lease_s}")
    _validate_autoscale(cfg, src)
    if cfg.logging.format not in ("auto", "json", "console"):
        raise ConfigError(f"{src}: logging.format must be auto, json or console, got {cfg.logging.format!r}")


AUTOSCALERS = ("none", "local", "kubernetes")


def _validate_autoscale(cfg: ClusterConfig, src: str) -> None:
    a = cfg.autoscale
    if a.scaler not in AUTOSCALERS:
        raise ConfigError(f"{src}: autoscale.scaler must be one of {', '.join(AUTOSCALERS)}, got {a.scaler!r}")
    for key in ("hold_s", "scale_down_hold_s", "cooldown_s", "drain_timeout_s"):
        if getattr(a, key) < 0:
            raise ConfigError(f"{src}: autoscale.{key} must be >= 0, got {getattr(a, key)}")
    for key in ("scale_up_timeout_s", "api_timeout_s"):
        if getattr(a, key) <= 0:
            raise ConfigError(f"{src}: autoscale.{key} must be > 0, got {getattr(a, key)}")
    if not 0 < a.scale_down_usage <= 1:
        raise ConfigError(f"{src}: autoscale.scale_down_usage must be in (0, 1], got {a.scale_down_usage}")
    if a.max_workers < 0 or a.max_replicas < 0:
        raise ConfigError(f"{src}: autoscale.max_workers and autoscale.max_replicas must be >= 0 (0 = no cap)")
    if a.scaler == "kubernetes" and not a.statefulset:
        raise ConfigError(f"{src}: autoscale.statefulset must name the worker StatefulSet (autoscale.scaler = kubernetes)")
    if cfg.memory_manager.member_timeout_s <= 0:
        raise ConfigError(f"{src}: memory_manager.member_timeout_s must be > 0, got {cfg.memory_manager.member_timeout_s}")


TP_MODES = ("cold", "in-place")


def _validate_tensor_parallel(cfg: ClusterConfig, worker_ids: set[str]) -> None:
    """Members are configured workers holding every layer, each in one instance of 1, 2 or 4; nothing that would move
    one member's KV without the others' (swap preemption) or pair members into pipeline groups (static-pp). Whether
    the degree divides the model's heads is checked where the model is known (the worker's start)."""
    src = cfg.source
    owner: dict[str, int] = {}
    for i, tp in enumerate(cfg.tensor_parallel):
        where = f"{src}: tensor_parallel[{i}]"
        if tp.degree not in TP_DEGREES:
            raise ConfigError(f"{where}.members: a tensor-parallel instance spans "
                              f"{', '.join(map(str, TP_DEGREES))} workers, got {tp.degree} ({tp.members})")
        for m in tp.members:
            if m not in worker_ids:
                raise ConfigError(f"{where}.members: no worker {m!r} (configured: {', '.join(sorted(worker_ids))})")
            if m in owner:
                other = owner[m]
                raise ConfigError(f"{where}.members: worker {m!r} is "
                                  + ("named twice" if other == i else f"already in tensor_parallel[{other}]"))
            owner[m] = i
            w = cfg.worker(m)
            if w.layer_start != 0 or w.layer_end != -1:
                raise ConfigError(f"{where}.members: worker {m!r} holds layers [{w.layer_start}, {w.layer_end}); "
                                  "a tensor-parallel member holds a shard of every layer (layer_start = 0, "
                                  "layer_end = -1)")
        if not 0 <= tp.port < 65536:
            raise ConfigError(f"{where}.port must be in [0, 65535] (0 = the local launcher picks one), got {tp.port}")
        if not (tp.timeout_s > 0 and tp.rendezvous_timeout_s > 0):
            raise ConfigError(f"{where}: timeout_s and rendezvous_timeout_s must be > 0")
    if cfg.memory_manager.tp_mode not in TP_MODES:
        raise ConfigError(f"{src}: memory_manager.tp_mode must be one of {', '.join(TP_MODES)}, got {cfg.memory_manager.tp_mode!r}")
    if any(tp.degree > 1 for tp in cfg.tensor_parallel):
        if cfg.policy.overload == "swap":
            raise ConfigError(f"{src}: policy.overload = swap is not supported with tensor-parallel instances (a swap "
                              "would move rank 0's KV shard and not the others')")
        if cfg.policy.overload == "static-pp":
            raise ConfigError(f"{src}: policy.overload = static-pp pairs every worker into a pipeline group; "
                              "tensor-parallel members cannot join one")


def _validate_security(sec: SecuritySection, src: str) -> None:
    """TLS files come in pairs, and a client certificate (mutual TLS) needs server TLS to go with it."""
    for a, b in (("tls_cert_file", "tls_key_file"), ("tls_client_cert_file", "tls_client_key_file")):
        if bool(getattr(sec, a)) != bool(getattr(sec, b)):
            raise ConfigError(f"{src}: security.{a} and security.{b} must be set together")
    if sec.tls_client_cert_file and not sec.tls_cert_file:
        raise ConfigError(f"{src}: security.tls_client_cert_file (mutual TLS) needs security.tls_cert_file too")


def load_config(path: str | os.PathLike[str] | None = None, *, environ: Mapping[str, str] | None = None) -> ClusterConfig:
    """Load the cluster config: `path`, else $KUNSERVE_CONFIG, else built-in defaults; then env overrides."""
    environ = os.environ if environ is None else environ
    path = path or environ.get(CONFIG_ENV) or None
    if path is None:
        cfg = config_from_dict({}, source="<defaults>")
    else:
        p = pathlib.Path(path)
        try:
            raw = p.read_bytes()
        except FileNotFoundError:
            raise ConfigError(f"config file {p} does not exist") from None
        except OSError as exc:
            raise ConfigError(f"config file {p}: {exc.strerror}") from None
        try:
            data = tomllib.loads(raw.decode("utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"config file {p}: not valid TOML: {exc}") from None
        cfg = config_from_dict(data, source=str(p))
    apply_env_overrides(cfg, environ)
    validate(cfg)
    return cfg
