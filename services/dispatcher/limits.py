"""The dispatcher's request limits, resolved from the config and the model: what it admits, how long a
prompt may be, and how large a message its gRPC server accepts at all.

Why the message size matters: a prompt is checked before it is tokenized or forwarded, but a gRPC server
holds a whole request message in memory before any Python code sees it. So the server's receive limit is
derived from the prompt limit: a 10 MB prompt is refused by gRPC itself (RESOURCE_EXHAUSTED) and never held.
The dispatcher never imports torch, so the model's context is read from its config.json directly.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass

from kunserve.shared.config import ClusterConfig, ConfigError

# The embedded tiny model's context (kunserve.shared.model.architecture.TINY_CONFIG.max_position_embeddings; a
# unit test keeps them equal). HF's default when config.json does not say is the same 2048.
EMBEDDED_CONTEXT_LEN = 2048
HF_DEFAULT_CONTEXT_LEN = 2048
# A cheap upper bound on text per token: a token of a real tokenizer rarely spans more than 32 bytes, so a
# text prompt longer than 32 bytes x the token limit cannot fit and is refused before tokenizing.
MAX_BYTES_PER_TOKEN = 32
MAX_VARINT_BYTES = 10  # a token id on the wire (a negative int32 takes 10 bytes)
MESSAGE_SLACK_BYTES = 64 * 1024  # request id, sampling parameters, stop token ids, framing


@dataclass(frozen=True)
class DispatcherLimits:
    """Resolved limits (no zeros meaning "automatic" left, except max_queued_prompt_tokens: that one follows
    the routable workers' KV capacity, which changes with drops and failures)."""

    context_len: int = EMBEDDED_CONTEXT_LEN        # prompt + max_tokens must fit
    max_prompt_tokens: int = EMBEDDED_CONTEXT_LEN
    max_prompt_bytes: int = EMBEDDED_CONTEXT_LEN * MAX_BYTES_PER_TOKEN
    max_inflight_per_worker: int = 64              # x routable workers
    max_queued_prompt_tokens: int = 0              # 0: the routable workers' KV capacity in tokens
    queue_timeout_s: float = 30.0                  # no first token by then: RESOURCE_EXHAUSTED
    auto_prompt_tokens: bool = True                # max_prompt_tokens is the model context (for messages)

    @property
    def max_message_bytes(self) -> int:
        """The gRPC receive limit: the largest request a valid prompt can make."""
        return max(self.max_prompt_bytes, self.max_prompt_tokens * MAX_VARINT_BYTES) + MESSAGE_SLACK_BYTES

    def server_options(self) -> list[tuple[str, int]]:
        return [("grpc.max_receive_message_length", self.max_message_bytes)]


def model_context_len(model_path: str) -> int:
    """max_position_embeddings of the model's config.json (the embedded model's when `model_path` is empty)."""
    if not model_path:
        return EMBEDDED_CONTEXT_LEN
    path = pathlib.Path(model_path) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"model.path: cannot read the model context from {path}: {exc}") from None
    value = raw.get("max_position_embeddings", HF_DEFAULT_CONTEXT_LEN)
    if not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{path}: max_position_embeddings must be a positive integer, got {value!r}")
    return value


def limits_from_config(cfg: ClusterConfig) -> DispatcherLimits:
    d = cfg.dispatcher
    context = model_context_len(cfg.model.path)
    prompt_tokens = min(d.max_prompt_tokens, context) if d.max_prompt_tokens else context
    return DispatcherLimits(
        context_len=context,
        max_prompt_tokens=prompt_tokens,
        max_prompt_bytes=d.max_prompt_bytes or prompt_tokens * MAX_BYTES_PER_TOKEN,
        # a worker runs at most engine.max_num_seqs requests at once: more would only wait in its queue
        max_inflight_per_worker=d.max_inflight_per_worker or cfg.engine.max_num_seqs,
        max_queued_prompt_tokens=d.max_queued_prompt_tokens,
        queue_timeout_s=d.queue_timeout_s,
        auto_prompt_tokens=not d.max_prompt_tokens or d.max_prompt_tokens >= context,
    )
