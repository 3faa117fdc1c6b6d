"""A small gRPC client for the dispatcher: what `kunserve generate`, the benchmarks and tests use.

Credentials: `credentials_from(cfg)` finds the API key (when one is configured) and the admin token the
way every tool does (environment, the config's [security] files, the default files `kunserve up` writes;
see kunserve/shared/credentials.py); `dispatcher_channel` / `admin_channel` present them.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc

from kunserve.shared import credentials
from kunserve.shared.config import ClusterConfig
from kunserve.shared.rpc import TLS, channel
from kunserve.shared.wire.requests import FINISH_NAMES
from kunserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc


@dataclass(frozen=True)
class Credentials:
    """What a client tool presents: the API key to the dispatcher, the admin token to the admin port
    (each None when there is none), and TLS when the cluster serves it."""

    api_key: str | None = None
    admin_token: str | None = None
    tls: TLS | None = None


def credentials_from(cfg: ClusterConfig, environ=None, admin_token_file: str | None = None) -> Credentials:
    """The credentials the lookup finds for `cfg` (raises credentials.CredentialError for an unusable one)."""
    sec = cfg.security
    return Credentials(api_key=credentials.find(credentials.API_KEY, sec, environ),
                       admin_token=credentials.find(credentials.ADMIN_TOKEN, sec, environ, admin_token_file),
                       tls=credentials.load_tls(sec))


def dispatcher_channel(address: str, creds: Credentials | None = None) -> grpc.aio.Channel:
    creds = creds or Credentials()
    return channel(address, token=creds.api_key, tls=creds.tls)


def insecure_channel(address: str) -> grpc.aio.Channel:
    """A plaintext channel with no credential: the client port of a cluster that has no API key and no TLS
    (a local `kunserve up`)."""
    return dispatcher_channel(address)


def admin_channel(address: str, creds: Credentials | None = None) -> grpc.aio.Channel:
    creds = creds or Credentials()
    return channel(address, token=creds.admin_token, tls=creds.tls)


@dataclass
class GenerationResult:
    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    worker_id: str = ""
    num_prompt_tokens: int = 0
    ttft_s: float | None = None  # measured at the client
    token_times_s: list[float] = field(default_factory=list)  # client clock, since the call started

    @property
    def mean_tpot_s(self) -> float | None:
        t = self.token_times_s
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None

    def to_dict(self) -> dict:
        return {"request_id": self.request_id, "token_ids": self.token_ids, "text": self.text,
                "finish_reason": self.finish_reason, "worker_id": self.worker_id,
                "num_prompt_tokens": self.num_prompt_tokens, "ttft_s": self.ttft_s, "mean_tpot_s": self.mean_tpot_s}


def make_request(prompt: str | Sequence[int], *, request_id: str = "", max_tokens: int = 16,
                 temperature: float | None = 0.0, top_k: int | None = 0, top_p: float | None = 1.0,
                 seed: int | None = None, stop_token_ids: Sequence[int] = (), stop: Sequence[str] = (),
                 ignore_eos: bool = False) -> generation_pb2.GenerateRequest:
    """A generation request. temperature / top_k / top_p None leave the field unset: the served model's
    generation_config.json default applies (greedy when it has none); `stop` strings end the text."""
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                         stop_token_ids=list(stop_token_ids), stop=list(stop), ignore_eos=ignore_eos)
    if seed is not None:
        sampling.seed = seed
    req = generation_pb2.GenerateRequest(request_id=request_id, sampling=sampling)
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(int(t) for t in prompt)
    return req


async def stream(channel: grpc.aio.Channel, request: generation_pb2.GenerateRequest,
                 timeout: float | None = None) -> AsyncIterator[generation_pb2.GenerateEvent]:
    async for ev in generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=timeout):
        yield ev


async def generate(channel: grpc.aio.Channel, request: generation_pb2.GenerateRequest, timeout: float | None = None,
                   on_event=None, into: GenerationResult | None = None) -> GenerationResult:
    """Run one request to completion; raises grpc.aio.AioRpcError on failure. `into` is filled as events
    arrive, so a caller keeps what was measured when the call fails or is cancelled (the bench does)."""
    res = into if into is not None else GenerationResult(request_id=request.request_id)
    res.request_id = res.request_id or request.request_id
    start = time.monotonic()
    async for ev in stream(channel, request, timeout):
        now = time.monotonic() - start
        res.request_id = ev.request_id
        res.worker_id = ev.worker_id
        res.num_prompt_tokens = ev.num_prompt_tokens
        if ev.token_id >= 0:
            res.token_ids.append(ev.token_id)
            res.text += ev.text
            res.token_times_s.append(now)
            if res.ttft_s is None:
                res.ttft_s = now
        if ev.finish_reason:
            res.finish_reason = FINISH_NAMES.get(ev.finish_reason, str(ev.finish_reason))
        if on_event is not None:
            on_event(ev)
    return res


async def cancel(channel: grpc.aio.Channel, request_id: str) -> bool:
    resp = await generation_pb2_grpc.GenerationStub(channel).Cancel(common_pb2.CancelRequest(request_id=request_id))
    return resp.cancelled


__all__ = ["Credentials", "GenerationResult", "admin_channel", "cancel", "credentials_from", "dispatcher_channel",
           "generate", "insecure_channel", "make_request", "stream"]
