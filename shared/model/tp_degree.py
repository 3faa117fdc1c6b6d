"""Which tensor-parallel degrees a model's config allows, and the config of one rank's shard (local heads, local
intermediate size; shared/model/tp_shard.py shards the tensors). Config only, no torch: the memory manager checks a
re-form's degree with it and never computes."""

from __future__ import annotations

from kunserve.shared.model.architecture import ModelConfig
from kunserve.shared.policy.elastic_tp import DEGREES as TP_DEGREES


def degree_error(cfg: ModelConfig, degree: int) -> str | None:
    """Why `cfg` cannot run at tensor-parallel `degree` (None: it can)."""
    if degree not in TP_DEGREES:
        return f"tensor-parallel degree must be one of {', '.join(map(str, TP_DEGREES))}, got {degree}"
    for what, n in (("attention heads", cfg.num_heads), ("KV heads", cfg.num_kv_heads), ("intermediate size", cfg.intermediate_size)):
        if n % degree:
            return f"tensor-parallel degree {degree} does not divide the model's {n} {what} (every rank holds an equal share)"
    return None


def check_degree(cfg: ModelConfig, degree: int) -> None:
    why = degree_error(cfg, degree)
    if why is not None:
        raise ValueError(why)


def shard_config(cfg: ModelConfig, degree: int) -> ModelConfig:
    """The config of one rank's shard (the same for every rank): local heads, local intermediate size."""
    check_degree(cfg, degree)
    if degree == 1:
        return cfg
    return cfg.replace(
        num_heads=cfg.num_heads // degree,
        num_kv_heads=cfg.num_kv_heads // degree,
        intermediate_size=cfg.intermediate_size // degree,
        head_dim=cfg.head_dim,
    )


__all__ = ["TP_DEGREES", "check_degree", "degree_error", "shard_config"]
