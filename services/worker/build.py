"""Build a worker's model instance from the cluster config: the layer range in the unified memory
pool (weights + KV cache share its pages), the engine on top, the device, the thread count and the
token budget (SLO-aware from a matching cost-model profile, else the fixed one) and how the engine cuts its
queue into microbatches when it heads a pipeline group (lookahead under the same profile, else token chunking)."""

from __future__ import annotations

from kunserve.services.worker.servicer import WorkerIdentity
from kunserve.shared.config import ClusterConfig
from kunserve.shared.engine.loop import EngineLoop
from kunserve.shared.engine.pooled import PooledInstance
from kunserve.shared.log import get_logger
from kunserve.shared.memory.errors import MemoryPoolError
from kunserve.shared.model.weights import load_model_source
from kunserve.shared.policy.batch_scheduler import FixedTokenBudget, SchedulerConfig, TokenBudget
from kunserve.shared.policy.microbatch import MicrobatchFormer
from kunserve.shared.policy.overload_policies import overload_handling
from kunserve.shared.policy.token_budget import SLOTokenBudget
from kunserve.shared.process import DeviceError, pick_device, thread_share
from kunserve.shared.profile_files import ProfileError, device_signature, find_profile

MIB = 1024 * 1024


class WorkerBuildError(RuntimeError):
    """The worker cannot start with this config/model; the message says what to change."""


def memory_backend(setting: str, device: str) -> str:
    if setting != "auto":
        return setting
    return "cuda" if device == "cuda" else "host"


def make_token_budget(cfg: ClusterConfig, *, model: str, dtype: str, layers: tuple[int, int], device: str,
                      threads: int) -> tuple[TokenBudget, str]:
    """The iteration token budget for this worker and a one-line reason (logged at start).

    engine.profile names a file written by `kunserve profile`; with engine.budget = "auto" and an entry
    for exactly this model, dtype, layer range and device (CPU: model name and thread count), the
    worker runs ConServe's SLO-aware budget: every iteration's predicted latency stays under
    budget_headroom * slo.tbt_ms. Anything else falls back to the fixed max_num_batched_tokens;
    a configured profile that cannot be used is reported as a warning reason ("fallback: ...")."""
    e = cfg.engine
    fixed = FixedTokenBudget(e.max_num_batched_tokens)
    if e.budget == "fixed" or not e.profile:
        return fixed, f"fixed: {e.max_num_batched_tokens} tokens per iteration"
    sig = device_signature(device, threads)
    try:
        prof = find_profile(e.profile, model=model, dtype=dtype, layers=layers, device_sig=sig)
    except ProfileError as exc:
        return fixed, f"fallback: {exc}; using the fixed {e.max_num_batched_tokens} tokens per iteration"
    budget = SLOTokenBudget(prof.conserve, tbt_s=cfg.slo.tbt_ms / 1e3, headroom=e.budget_headroom)
    return budget, (f"slo: profile {prof.key} from {e.profile}, target {budget.target_s * 1e3:.1f} ms "
                    f"({e.budget_headroom:g} x tbt {cfg.slo.tbt_ms:g} ms)")


def make_microbatch_former(cfg: ClusterConfig, *, model: str, dtype: str, layers: tuple[int, int], device: str,
                           threads: int) -> tuple[MicrobatchFormer, str]:
    """How this worker cuts its queue into microbatches when it heads a pipeline group, and a one-line reason
    (logged at start). With engine.lookahead and a profile for exactly this model, dtype, layer range and device
    (the one the SLO budget would use), the lookahead formulation balances microbatches under the profile's
    KunServe cost model; it is fitted on the whole layer range, but a head balances its own stage with it: Eq. 1
    scales with the number of layers, so the cheapest balance point stays where it is. Anything else: token
    chunking."""
    e = cfg.engine
    if not e.lookahead:
        return MicrobatchFormer(None, lookahead=False), "token chunking (engine.lookahead = false)"
    if not e.profile:
        return MicrobatchFormer(None), "token chunking: no cost-model profile (engine.profile) for lookahead"
    try:
        prof = find_profile(e.profile, model=model, dtype=dtype, layers=layers, device_sig=device_signature(device, threads))
    except ProfileError as exc:
        return MicrobatchFormer(None), f"fallback: {exc}; token chunking instead of lookahead"
    return MicrobatchFormer(prof.kunserve), f"lookahead: cost model of profile {prof.key} from {e.profile}"


def build_worker(cfg: ClusterConfig, worker_id: str) -> tuple[EngineLoop, PooledInstance, WorkerIdentity]:
    wsec = cfg.worker(worker_id)
    try:
        device = pick_device(cfg.model.device)
    except DeviceError as exc:
        raise WorkerBuildError(str(exc)) from exc
    try:
        source = load_model_source(cfg.model.path or None, seed=cfg.model.seed, dtype=cfg.model.dtype)
    except (OSError, ValueError) as exc:
        raise WorkerBuildError(f"cannot load model {cfg.model.path or '<embedded>'}: {exc}") from None
    mcfg = source.config
    start = wsec.layer_start
    end = mcfg.num_layers if wsec.layer_end < 0 else wsec.layer_end
    if not (0 <= start < end <= mcfg.num_layers):
        raise WorkerBuildError(f"workers[{worker_id}]: layer range [{start}, {end}) is not within the model's "
                               f"{mcfg.num_layers} layers")
    e = cfg.engine
    threads = thread_share(cfg)
    budget, why = make_token_budget(cfg, model=source.name, dtype=mcfg.dtype, layers=(start, end), device=device,
                                    threads=threads)
    try:
        instance = PooledInstance(
            source, layer_range=(start, end), pool_bytes=e.pool_mib * MIB, page_size=e.page_kib * 1024,
            block_size=e.block_size, backend=memory_backend(e.memory_backend, device), device=device,
            scheduler_config=SchedulerConfig(max_num_batched_tokens=e.max_num_batched_tokens,
                                             max_num_seqs=e.max_num_seqs,
                                             preemption=overload_handling(cfg.policy.overload).preemption),
            budget=budget, keep_host_copy=e.host_copy)
    except MemoryPoolError as exc:
        raise WorkerBuildError(f"memory pool: {exc} (engine.pool_mib = {e.pool_mib}, page_kib = {e.page_kib})") from None
    except (OSError, ValueError) as exc:
        raise WorkerBuildError(f"cannot load model weights: {exc}") from None
    log = get_logger()
    (log.warning if why.startswith("fallback") else log.info)("token_budget", budget=why)
    instance.engine.former, why = make_microbatch_former(cfg, model=source.name, dtype=mcfg.dtype, layers=(start, end),
                                                         device=device, threads=threads)
    (log.warning if why.startswith("fallback") else log.info)("pipeline_microbatches", microbatches=why)
    loop = EngineLoop(instance.engine, num_threads=threads)
    identity = WorkerIdentity(
        worker_id=worker_id, address=wsec.address, model_name=source.name, num_layers_model=mcfg.num_layers,
        vocab_size=mcfg.vocab_size, max_model_len=mcfg.max_position_embeddings, device=device, dtype=mcfg.dtype,
    )
    return loop, instance, identity
