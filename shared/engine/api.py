"""Plain data types shared by the engine, the worker service and the tests.

They carry no torch state so the gRPC layer, the scheduler policies and the simulator can use
them without importing the model. Validation lives here too, so every entry point (gRPC, CLI,
direct library use) rejects bad input with the same message naming the field.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import NamedTuple

MAX_LOGPROBS = 20  # most alternatives a request may ask for per token (OpenAI's top_logprobs bound, vLLM's default)


class InvalidRequest(ValueError):
    """A request field is out of range. `field` names it so RPCs can answer INVALID_ARGUMENT precisely."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token. temperature == 0 means greedy (argmax)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0  # 0 = disabled
    top_p: float = 1.0  # 1.0 = disabled
    seed: int | None = None  # per-request generator seed for reproducible sampling
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # benchmarks replay exact output lengths
    logprobs: int | None = None  # None: none; N: the chosen token's logprob and the N most likely tokens'
    min_tokens: int = 0  # EOS and stop token ids cannot be sampled before this many tokens

    def validate(self, vocab_size: int) -> None:
        if self.max_tokens <= 0:
            raise InvalidRequest("max_tokens", f"must be > 0, got {self.max_tokens}")
        if not (0.0 <= self.temperature < math.inf):  # NaN and inf fail too
            raise InvalidRequest("temperature", f"must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InvalidRequest("top_k", f"must be >= 0 (0 disables), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequest("top_p", f"must be in (0, 1], got {self.top_p}")
        for t in self.stop_token_ids:
            if not (0 <= t < vocab_size):
                raise InvalidRequest("stop_token_ids", f"token id {t} outside vocabulary [0, {vocab_size})")
        if not (0 <= self.min_tokens <= self.max_tokens):
            raise InvalidRequest("min_tokens", f"must be in [0, max_tokens = {self.max_tokens}], got {self.min_tokens}")
        if self.logprobs is not None and not (0 <= self.logprobs <= MAX_LOGPROBS):
            raise InvalidRequest("sampling.logprobs", f"must be in [0, {MAX_LOGPROBS}] (the number of most likely tokens "
                                 f"to return besides the chosen one), got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class EngineRequest:
    """One generation request as the engine sees it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float = 0.0  # time.monotonic() when received; used for FCFS order
    offline: bool = False  # ConServe's offline class: runs on the capacity online requests leave

    def validate(self, vocab_size: int, max_model_len: int) -> None:
        if not self.request_id:
            raise InvalidRequest("request_id", "must not be empty")
        if not self.prompt_token_ids:
            raise InvalidRequest("prompt", "must not be empty")
        for t in self.prompt_token_ids:
            if not (0 <= t < vocab_size):
                raise InvalidRequest("prompt_token_ids", f"token id {t} outside vocabulary [0, {vocab_size})")
        self.sampling.validate(vocab_size)
        total = len(self.prompt_token_ids) + self.sampling.max_tokens
        if total > max_model_len:
            raise InvalidRequest(
                "max_tokens",
                f"prompt ({len(self.prompt_token_ids)} tokens) + max_tokens ({self.sampling.max_tokens}) "
                f"= {total} exceeds the model context of {max_model_len}",
            )


class FinishReason(enum.Enum):
    NONE = "none"  # not finished
    LENGTH = "length"  # reached max_tokens
    STOP = "stop"  # a stop token id
    EOS = "eos"  # the model's end-of-sequence token
    ABORTED = "aborted"  # cancelled by the client or the system
    LOST = "lost"  # this worker cannot go on with it (group broke, not serving): resume elsewhere (never on the wire)
    ERROR = "error"  # the engine failed on this request alone (TokenEvent.error says how); never retried elsewhere


class TokenLogprob(NamedTuple):
    """A token and its log-probability: log-softmax of the model's raw logits (before temperature, top-k and
    top-p), what vLLM reports by default, so a client sees the model's distribution whatever it sampled with."""

    token_id: int
    logprob: float


@dataclass(frozen=True)
class TokenEvent:
    """One generated token (or a terminal event with token_id == -1 for aborts)."""

    request_id: str
    token_id: int
    index: int  # 0-based position among generated tokens
    finish_reason: FinishReason = FinishReason.NONE
    error: str = ""  # with FinishReason.ERROR: what failed
    # Only when the request asked for sampling.logprobs: the chosen token's, and the most likely tokens' (logprob
    # descending, as many as it asked for).
    logprob: float | None = None
    top_logprobs: tuple[TokenLogprob, ...] = ()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not FinishReason.NONE


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for the monitor and the router (Llumnix-style freeness needs the queued demand)."""

    kv_blocks_total: int
    kv_blocks_used: int
    block_size: int
    # Requests the scheduler runs and waits to run. Requests whose KV is still landing after a transition are
    # in neither (their blocks count as used): they cannot progress until it has, so a liveness check that saw
    # them as work would call a worker waiting on the network stalled.
    num_running: int
    num_waiting: int
    queued_demand_blocks: int  # blocks the waiting requests' prompts will need
    num_preemptions: int
    prompt_tokens_total: int  # cumulative counters; rates are derived by the receiver
    generated_tokens_total: int
    # Queue time: arrival (the engine's time.monotonic()) of the oldest waiting request that has not started
    # yet; None when none waits. An arrival, not an age, so a cached snapshot still gives the right age later.
    oldest_waiting_arrival: float | None = None
    # The offline share (ConServe request classes), each part of the total above: the monitor counts online demand
    # only (offline work is harvested, the first victim before any parameter drop) and the dispatcher sends
    # offline work where online work leaves room.
    num_offline_running: int = 0
    num_offline_waiting: int = 0
    offline_kv_blocks_used: int = 0
    offline_queued_demand_blocks: int = 0
    oldest_online_waiting_arrival: float | None = None  # oldest_waiting_arrival over online requests only
    # Incremental KV checkpoints of offline requests (ConServe §4.4; zeros while engine.checkpoint_mib = 0): full
    # blocks copied to host memory so far, offline preemptions that went by checkpoint (freeing the blocks at once,
    # recomputing nothing), and the host blocks the checkpoints hold now.
    checkpointed_blocks_total: int = 0
    checkpoint_preemptions: int = 0
    checkpoint_host_blocks: int = 0


@dataclass
class SeqSnapshot:
    """A request's engine state, for moving it to another unit's head (layout transitions)."""

    request: EngineRequest
    generated: list[int]
    num_computed: int
    blocks: list[int]
    generator_state: bytes = b""
    num_preemptions: int = 0
