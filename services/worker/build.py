"""Build a worker's engine from the cluster config: load the model's layer range, size the KV cache
from the memory pool budget, pick the device and the thread count."""

from __future__ import annotations

import os

import torch

from kunserve.services.worker.servicer import WorkerIdentity
from kunserve.shared.config import ClusterConfig
from kunserve.shared.engine.engine import Engine, SchedulerConfig
from kunserve.shared.engine.loop import EngineLoop
from kunserve.shared.model.loader import load_model_source

MIB = 1024 * 1024


class WorkerBuildError(RuntimeError):
    """The worker cannot start with this config/model; the message says what to change."""


def pick_device(setting: str) -> str:
    if setting == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if setting == "cuda" and not torch.cuda.is_available():
        raise WorkerBuildError("model.device = 'cuda' but no CUDA device is available")
    return setting


def thread_share(cfg: ClusterConfig) -> int:
    """Torch threads for this worker: the configured number, else an even share of the cores.

    Oversubscribed OpenMP threads make CPU inference several times slower (MEASURED.md)."""
    if cfg.engine.threads > 0:
        return cfg.engine.threads
    return max(1, (os.cpu_count() or 1) // max(1, len(cfg.workers)))


def kv_blocks_for_budget(pool_bytes: int, weight_bytes: int, block_bytes_all_layers: int) -> int:
    return (pool_bytes - weight_bytes) // block_bytes_all_layers


def build_worker(cfg: ClusterConfig, worker_id: str) -> tuple[EngineLoop, WorkerIdentity]:
    wsec = cfg.worker(worker_id)
    device = pick_device(cfg.model.device)
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
    weights = source.load_weights((start, end))
    weight_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    dtype_size = torch.empty((), dtype=getattr(torch, mcfg.dtype)).element_size()
    block_bytes = 2 * mcfg.num_kv_heads * cfg.engine.block_size * mcfg.head_dim * dtype_size * (end - start)
    num_blocks = kv_blocks_for_budget(cfg.engine.pool_mib * MIB, weight_bytes, block_bytes)
    if num_blocks < 1:
        raise WorkerBuildError(f"engine.pool_mib = {cfg.engine.pool_mib} MiB does not even hold the weights "
                               f"({weight_bytes / MIB:.1f} MiB) plus one KV block; raise it")
    engine = Engine(
        mcfg, weights, num_kv_blocks=num_blocks, block_size=cfg.engine.block_size, device=device,
        layer_range=(start, end),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=cfg.engine.max_num_batched_tokens,
                                         max_num_seqs=cfg.engine.max_num_seqs),
    )
    loop = EngineLoop(engine, num_threads=thread_share(cfg))
    identity = WorkerIdentity(
        worker_id=worker_id, address=wsec.address, model_name=source.name, num_layers_model=mcfg.num_layers,
        layer_start=start, layer_end=end, vocab_size=mcfg.vocab_size, max_model_len=mcfg.max_position_embeddings,
        device=device, dtype=mcfg.dtype,
    )
    return loop, identity
