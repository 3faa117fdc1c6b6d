"""Conversions between protobuf messages and the engine's plain data types (one place, both ways)."""

from __future__ import annotations

import time
from typing import Any

from kunserve.shared.engine.api import EngineStats, FinishReason, SamplingParams
from kunserve.v1 import common_pb2

DEFAULT_MAX_TOKENS = 16

_FINISH_TO_PB = {
    FinishReason.NONE: common_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.EOS: common_pb2.FINISH_REASON_EOS,
    FinishReason.ABORTED: common_pb2.FINISH_REASON_ABORTED,
}
FINISH_NAMES = {v: k.value for k, v in _FINISH_TO_PB.items()}


def finish_to_pb(reason: FinishReason) -> int:
    # LOST never reaches a client: the worker ends such a stream with UNAVAILABLE (the dispatcher resumes it)
    return _FINISH_TO_PB.get(reason, common_pb2.FINISH_REASON_ABORTED)


def sampling_from_pb(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Unset max_tokens / top_p take their defaults; every value that is set is taken as sent and
    validated by SamplingParams.validate (so an explicit max_tokens of 0 is rejected, not defaulted)."""
    return SamplingParams(
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else DEFAULT_MAX_TOKENS,
        temperature=msg.temperature,
        top_k=msg.top_k,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        seed=msg.seed if msg.HasField("seed") else None,
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
    )


def sampling_to_pb(p: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        max_tokens=p.max_tokens, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
        stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos,
    )
    if p.seed is not None:
        msg.seed = p.seed
    return msg


def busy_idle_fields(b) -> dict[str, float]:
    """WorkerStats fields from an accounting.BusyIdle snapshot (pass them to stats_to_pb as extras)."""
    return {"busy_seconds_total": b.busy_s, "idle_seconds_total": b.idle_s, "bubble_seconds_total": b.bubble_s,
            "bubble_ratio": b.bubble_ratio}


def stats_to_pb(s: EngineStats, now: float | None = None, **extra: Any) -> common_pb2.WorkerStats:
    """`now`: the engine's clock (time.monotonic()) at which the oldest waiting request's age is taken; the
    default is the current time, so a snapshot the engine cached an iteration ago still reports the age now."""
    if s.oldest_waiting_arrival is None:
        age = 0.0
    else:
        age = max(0.0, (time.monotonic() if now is None else now) - s.oldest_waiting_arrival)
    return common_pb2.WorkerStats(
        kv_blocks_total=s.kv_blocks_total, kv_blocks_used=s.kv_blocks_used, block_size=s.block_size,
        num_running=s.num_running, num_waiting=s.num_waiting, queued_demand_blocks=s.queued_demand_blocks,
        num_preemptions=s.num_preemptions, prompt_tokens_total=s.prompt_tokens_total,
        generated_tokens_total=s.generated_tokens_total, oldest_waiting_age_s=age, **extra,
    )
