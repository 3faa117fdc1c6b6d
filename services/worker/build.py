"""Build a worker's model instance from the cluster config: the layer range in the unified memory
pool (weights + KV cache share its pages), the engine on top, the device, the thread count and the
token budget (SLO-aware under its cost-model profile: the configured one, the cached one or one it measures at
start-up; else the fixed one) and how the engine cuts its queue into microbatches when it heads a pipeline group
(lookahead under the same profile, else token chunking)."""

from __future__ import annotations

import gc

import torch

from kunserve.services.worker.own_profile import ProfileKey, cache_path, find_own_profile
from kunserve.services.worker.servicer import WorkerIdentity
from kunserve.services.worker.tp_member import TPArgs, TPMembership, membership_of, runtime_membership
from kunserve.shared.config import ClusterConfig
from kunserve.shared.engine.loop import EngineLoop
from kunserve.shared.engine.pooled import PooledInstance
from kunserve.shared.engine.profiler import profile_layers
from kunserve.shared.log import get_logger
from kunserve.shared.memory.errors import MemoryPoolError
from kunserve.shared.model.architecture import ModelConfig
from kunserve.shared.model.pool_placement import padded_mlp_weights
from kunserve.shared.model.tp_capacity import in_place_kv_tokens
from kunserve.shared.model.tp_padding import SHARDS
from kunserve.shared.model.weights import ModelSource, load_model_source
from kunserve.shared.policy.batch_scheduler import FixedTokenBudget, SchedulerConfig, TokenBudget
from kunserve.shared.policy.microbatch import MicrobatchFormer
from kunserve.shared.policy.overload_policies import overload_handling
from kunserve.shared.policy.token_budget import SLOTokenBudget
from kunserve.shared.process import DeviceError, pick_device, thread_share
from kunserve.shared.profile_files import Profile, device_signature

MIB = 1024 * 1024


class WorkerBuildError(RuntimeError):
    """The worker cannot start with this config/model; the message says what to change."""


def memory_backend(setting: str, device: str) -> str:
    if setting != "auto":
        return setting
    return "cuda" if device == "cuda" else "host"


def make_token_budget(cfg: ClusterConfig, prof: Profile | None, found: str) -> tuple[TokenBudget, str]:
    """The iteration token budget for this worker and a one-line reason (logged at start).

    With engine.budget = "auto" and a profile (own_profile: the configured file's, the cache's, or measured at
    start-up; `found` says which, or why there is none) the worker runs ConServe's SLO-aware budget: every
    iteration's predicted latency stays under budget_headroom * slo.tbt_ms, and max_num_batched_tokens stays
    the hard cap (vLLM's meaning of it: the activations one step may hold). "fixed", a co-serving baseline
    (engine.coserving other than conserve: vLLM's budget), or no profile: the fixed max_num_batched_tokens (a
    fallback is reported as a warning reason, "fallback: ...")."""
    e = cfg.engine
    fixed = FixedTokenBudget(e.max_num_batched_tokens)
    if e.budget == "fixed":
        return fixed, f"fixed: {e.max_num_batched_tokens} tokens per iteration (engine.budget = fixed)"
    if e.coserving != "conserve":
        return fixed, f"fixed: {e.max_num_batched_tokens} tokens per iteration (engine.coserving = {e.coserving})"
    if prof is None:
        return fixed, f"{found}; using the fixed {e.max_num_batched_tokens} tokens per iteration"
    budget = SLOTokenBudget(prof.conserve, tbt_s=cfg.slo.tbt_ms / 1e3, headroom=e.budget_headroom,
                            max_tokens=e.max_num_batched_tokens)
    return budget, (f"slo: {found}, target {budget.target_s * 1e3:.1f} ms ({e.budget_headroom:g} x tbt "
                    f"{cfg.slo.tbt_ms:g} ms), at most {e.max_num_batched_tokens} tokens")


def layerwise_every(cfg: ClusterConfig, tp: TPMembership | None = None) -> int:
    """Layers between safepoints of layer-wise preemption: engine.safepoint_layers under ConServe; 0 (off) for the
    baselines, which preempt at iteration boundaries only, and for a tensor-parallel member (a cut would drop rows
    from rank 0's shard alone)."""
    return cfg.engine.safepoint_layers if cfg.engine.coserving == "conserve" and tp is None else 0


def checkpoint_bytes(cfg: ClusterConfig, tp: TPMembership | None = None) -> int:
    """Host memory for the incremental KV checkpoints of offline requests: engine.checkpoint_mib under ConServe; 0
    (off) for the baselines, whose preemption is recompute, and for a tensor-parallel member (a checkpoint would hold
    rank 0's shard of the KV alone)."""
    return cfg.engine.checkpoint_mib * MIB if cfg.engine.coserving == "conserve" and tp is None else 0


def padded_mlp(cfg: ClusterConfig, model: ModelConfig, tp: TPMembership | None, device: str) -> bool:
    """A whole instance of a cluster that changes TP in place lays its MLP out in page-aligned shards, so that a scale-up
    releases the shards a member no longer keeps (tp_padding.py). It cannot when the MLP does not split into them, or
    when the gaps would leave the pool no KV block (large pages, a small model): it then keeps the whole weights and
    its in-place members compute on a copy of their shard (logged)."""
    if cfg.memory_manager.tp_mode != "in-place" or tp is not None:
        return False
    e = cfg.engine
    why = ""
    if model.intermediate_size % SHARDS:
        why = f"intermediate size {model.intermediate_size} does not split into {SHARDS} shards"
    elif in_place_kv_tokens(model, 1, num_pages=e.pool_mib * MIB // (e.page_kib * 1024), page_size=e.page_kib * 1024,
                            block_size=e.block_size, device_type=torch.device(device).type, padded_mlp=True) <= 0:
        why = (f"its page gaps leave the pool no KV block (engine.pool_mib = {e.pool_mib}, page_kib = {e.page_kib}); "
               "a smaller page or a larger pool would")
    if why:
        get_logger().warning("padded_mlp_unavailable", reason=why)
    return not why


def make_microbatch_former(cfg: ClusterConfig, prof: Profile | None, found: str) -> tuple[MicrobatchFormer, str]:
    """How this worker cuts its queue into microbatches when it heads a pipeline group, and a one-line reason
    (logged at start). With engine.lookahead and a profile (the one the SLO budget uses), the lookahead
    formulation balances microbatches under the profile's KunServe cost model; it is fitted on the whole layer
    range, but a head balances its own stage with it: Eq. 1 scales with the number of layers, so the cheapest
    balance point stays where it is. Anything else: token chunking."""
    if not cfg.engine.lookahead:
        return MicrobatchFormer(None, lookahead=False), "token chunking (engine.lookahead = false)"
    if prof is None:
        return MicrobatchFormer(None), f"{found}; token chunking instead of lookahead"
    return MicrobatchFormer(prof.kunserve), f"lookahead: cost model of {found}"


def worker_profile(cfg: ClusterConfig, source: ModelSource, layers: tuple[int, int], device: str,
                   threads: int, padded: bool = False) -> tuple[Profile | None, str]:
    """The profile this worker's budget and microbatches use, and where it came from (own_profile.py): none is
    looked for (nor measured) when neither needs one. A pool with the padded MLP (`padded`) computes its MLP another
    way (per shard, no CPU panel kernel): its profile is its own, under the model's name + "+padded-mlp"."""
    e = cfg.engine
    if e.budget == "fixed" and not e.lookahead:
        return None, "no profile needed"
    name = f"{source.name}+padded-mlp" if padded else source.name
    key = ProfileKey(name, source.config.dtype, layers, device_signature(device, threads))

    def measure() -> Profile:
        torch.set_num_threads(threads)
        weights = source.load_weights(layers)
        try:
            return profile_layers(source.config, padded_mlp_weights(weights) if padded else weights, model=name,
                                  layers=layers, device=device, device_sig=key.device_sig,
                                  block_size=e.block_size).profile
        finally:
            if device.startswith("cuda"):  # the profiling forwards' memory stays in PyTorch's cache, not the pool's
                gc.collect()
                torch.cuda.empty_cache()

    return find_own_profile(key, configured=e.profile, cache=cache_path(e.profile_cache), measure=measure)


def build_worker(cfg: ClusterConfig, worker_id: str, runtime_tp: TPArgs | None = None
                 ) -> tuple[EngineLoop, PooledInstance, WorkerIdentity, TPMembership | None]:
    """The worker's engine loop, instance and identity, and its tensor-parallel membership (None: a whole instance of
    its own): `runtime_tp` (the --tp-* flags of a cold re-form) when given, else the config's; a member has met the
    other members of its instance when this returns."""
    wsec = cfg.worker(worker_id)
    try:
        tp = runtime_membership(cfg, worker_id, runtime_tp) if runtime_tp is not None else membership_of(cfg, worker_id)
    except ValueError as exc:
        raise WorkerBuildError(str(exc)) from None
    try:
        device = pick_device(cfg.model.device)
    except DeviceError as exc:
        raise WorkerBuildError(str(exc)) from exc
    try:
        source = load_model_source(cfg.model.path or None, seed=cfg.model.seed, dtype=cfg.model.dtype)
    except (OSError, ValueError) as exc:
        raise WorkerBuildError(f"cannot load model {cfg.model.path or '<embedded>'}: {exc}") from None
    mcfg = source.config
    served = source
    if tp is not None:
        try:
            source = tp.shard(source)  # the pool holds this rank's shard only
        except ValueError as exc:
            raise WorkerBuildError(str(exc)) from None
    start = wsec.layer_start
    end = mcfg.num_layers if wsec.layer_end < 0 else wsec.layer_end
    if not (0 <= start < end <= mcfg.num_layers):
        raise WorkerBuildError(f"workers[{worker_id}]: layer range [{start}, {end}) is not within the model's "
                               f"{mcfg.num_layers} layers")
    e = cfg.engine
    threads = thread_share(cfg)
    padded = padded_mlp(cfg, mcfg, tp, device)
    if tp is not None and not tp.is_leader:
        prof, found = None, "a tensor-parallel follower runs rank 0's steps"
    else:  # rank 0 starts from its shard's profile; the measured step time (all-reduces included) takes over
        prof, found = worker_profile(cfg, source, (start, end), device, threads, padded)
    budget, why = make_token_budget(cfg, prof, found)
    try:
        instance = PooledInstance(
            source, layer_range=(start, end), pool_bytes=e.pool_mib * MIB, page_size=e.page_kib * 1024,
            block_size=e.block_size, backend=memory_backend(e.memory_backend, device), device=device,
            scheduler_config=SchedulerConfig(max_num_batched_tokens=e.max_num_batched_tokens,
                                             max_num_seqs=e.max_num_seqs,
                                             offline_free_watermark=e.offline_free_watermark,
                                             coserving=e.coserving,
                                             preemption=overload_handling(cfg.policy.overload).preemption),
            budget=budget, keep_host_copy=e.host_copy, padded_mlp=padded)
    except MemoryPoolError as exc:
        raise WorkerBuildError(f"memory pool: {exc} (engine.pool_mib = {e.pool_mib}, page_kib = {e.page_kib})") from None
    except (OSError, ValueError) as exc:
        raise WorkerBuildError(f"cannot load model weights: {exc}") from None
    log = get_logger()
    (log.warning if why.startswith("fallback") else log.info)("token_budget", budget=why)
    instance.engine.former, why = make_microbatch_former(cfg, prof, found)
    instance.engine.enable_layerwise_preemption(layerwise_every(cfg, tp), cfg.slo.ttft_ms / 1e3)
    instance.engine.enable_kv_checkpoint(checkpoint_bytes(cfg, tp))
    (log.warning if why.startswith("fallback") else log.info)("pipeline_microbatches", microbatches=why)
    if tp is not None:
        log.info("tensor_parallel_joining", role=tp.describe(), rendezvous=f"{tp.host}:{tp.port}")
        try:
            tp.join(instance, device, threads)
        except (ValueError, RuntimeError) as exc:  # a rendezvous that timed out, unequal capacities
            instance.close()
            raise WorkerBuildError(f"{tp.where}: cannot form the instance as {tp.describe()}: {exc}") from None
        log.info("tensor_parallel_joined", role=tp.describe(), kv_blocks=instance.engine.allocator.num_blocks)
    loop = EngineLoop(instance.engine, num_threads=threads)
    identity = WorkerIdentity(
        worker_id=worker_id, address=wsec.address, model_name=served.name, num_layers_model=mcfg.num_layers,
        vocab_size=mcfg.vocab_size, max_model_len=mcfg.max_position_embeddings, device=device, dtype=mcfg.dtype,
    )
    return loop, instance, identity, tp
