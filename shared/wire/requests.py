"""Conversions between protobuf messages and the engine's plain data types (one place, both ways)."""

from __future__ import annotations

from kunserve.shared.engine.api import FinishReason, SamplingParams, TokenEvent
from kunserve.v1 import common_pb2, generation_pb2, worker_pb2

DEFAULT_MAX_TOKENS = 16

_FINISH_TO_PB: dict[FinishReason, common_pb2.FinishReason] = {
    FinishReason.NONE: common_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.EOS: common_pb2.FINISH_REASON_EOS,
    FinishReason.ABORTED: common_pb2.FINISH_REASON_ABORTED,
}
FINISH_NAMES = {v: k.value for k, v in _FINISH_TO_PB.items()}


def finish_to_pb(reason: FinishReason) -> common_pb2.FinishReason:
    # LOST never reaches a client: the worker ends such a stream with UNAVAILABLE (the dispatcher resumes it)
    return _FINISH_TO_PB.get(reason, common_pb2.FINISH_REASON_ABORTED)


REQUEST_CLASSES = {common_pb2.REQUEST_CLASS_ONLINE: "online", common_pb2.REQUEST_CLASS_OFFLINE: "offline"}


def request_class_to_pb(offline: bool) -> common_pb2.RequestClass:
    return common_pb2.REQUEST_CLASS_OFFLINE if offline else common_pb2.REQUEST_CLASS_ONLINE


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
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        min_tokens=msg.min_tokens,
    )


def sampling_to_pb(p: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        max_tokens=p.max_tokens, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
        stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos, min_tokens=p.min_tokens,
    )
    if p.seed is not None:
        msg.seed = p.seed
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    return msg


def logprobs_to_pb(ev: TokenEvent, msg: worker_pb2.WorkerTokenEvent | generation_pb2.GenerateEvent) -> None:
    """Fill msg's logprob / top_logprobs from a token event that carries them (both messages name them alike);
    an event without them leaves logprob unset, so a receiver can tell "not asked" from a logprob of 0."""
    if ev.logprob is None:
        return
    msg.logprob = ev.logprob
    msg.top_logprobs.extend(common_pb2.TokenLogprob(token_id=t.token_id, logprob=t.logprob) for t in ev.top_logprobs)
