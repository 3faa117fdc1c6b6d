"""How long simulated work takes: an iteration from the fitted cost models, a transfer from bytes / bandwidth.

Both sources end in the same object the workers use, a ``profile_files.Profile`` holding the KunServe cost model
(Eq. 1-3: what a group head's lookahead microbatcher balances) and ConServe's latency model (what the SLO-aware
token budget bounds):

* **a profile file** (`kunserve profile` on the real device): the entry for this model over all its layers, the
  way a worker finds its own (same model name, dtype and layer range; a device signature when several match);
* **an analytic roofline** of a named accelerator (`hardware.py`) for the model shape: every sample batch a
  profiler would time is priced as the sum, per operation class, of max(FLOPs / FLOP/s, bytes / HBM bandwidth):
  the linear layers (2 FLOPs per parameter per token against reading every weight once per iteration), the
  attention (4 * heads * head_dim FLOPs per (query, key) pair, causal within a chunk, against reading the cached
  KV), plus the tensor-parallel all-reduces (two per layer over NVLink) and a fixed per-iteration overhead. The
  samples are then fitted by the very code `kunserve profile` fits with (``costmodel.fit_conserve`` /
  ``fit_kunserve``), so a roofline profile is what profiling that GPU would give if it ran at those efficiencies.

An iteration's time is ConServe's prediction for its batch (its memory-access term prices a decode over long
contexts, which Eq. 1 lacks), scaled to the layers a worker holds (a pipeline stage runs its share), plus what an
engine iteration costs beyond its forward pass: the profile's measured loop overhead (a constant and a cost per
sequence: scheduling, sampling, bookkeeping; zero in a profile written before it was measured) and a serving
overhead and a forward-pass slowdown given by the user or measured by `--validate` on the live cluster (what the
worker process, the dispatcher and the token streams add per iteration, and what sharing the cores costs the
forward passes). A request reaches the dispatcher
`request_latency_s` after the client sent it: its path through the processes before its first forward pass and
its first token's way back, which a profile of one process cannot see. The
pipeline's activations and logits, the KV exchange of a transition, weights a restore pulls and swapped KV take
bytes / the bandwidth of the link they cross.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from kunserve.shared.policy.costmodel import (
    BatchShape,
    Sample,
    fit_conserve,
    fit_kunserve,
    relative_errors,
    split_holdout,
)
from kunserve.shared.profile_files import Profile, ProfileError, read_profiles
from kunserve.sim.hardware import Accelerator
from kunserve.sim.shapes import ModelShape

ALLREDUCE_LATENCY_S = 8e-6  # one NCCL all-reduce's fixed cost on NVLink


@dataclass(frozen=True)
class Links:
    """Bandwidths (bytes/s, one direction) of the links simulated transfers cross."""

    network: float  # between instances: pipeline activations, KV exchange, weights a restore pulls
    host: float  # device <-> host memory: swap preemption
    device: float  # within one device: KV renumbered in place
    latency_s: float = 10e-6  # per message on the network

    def __post_init__(self) -> None:
        for name in ("network", "host", "device"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"link bandwidth {name} must be finite and > 0, got {getattr(self, name)}")

    def network_s(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.network if nbytes > 0 else 0.0


@dataclass(frozen=True)
class TimeModel:
    """The profile the simulated workers run under and the links between them."""

    profile: Profile
    links: Links
    source: str  # "profile FILE: KEY" or "roofline ACCELERATOR x tp"
    iteration_overhead_s: float = 0.0  # serving overhead added to every iteration, beyond the profile's loop overhead
    request_latency_s: float = 0.0  # from the client's send to the dispatcher, first token's way back included
    sequence_overhead_s: float = 0.0  # serving overhead per sequence in an iteration (its token's way to the client)
    forward_scale: float = 1.0  # forward passes take this times the profile's prediction (contention on a live machine)

    def __post_init__(self) -> None:
        for name in ("iteration_overhead_s", "request_latency_s", "sequence_overhead_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {value}")
        if not (math.isfinite(self.forward_scale) and self.forward_scale > 0):
            raise ValueError(f"forward_scale must be finite and > 0, got {self.forward_scale}")

    def forward_s(self, shape: BatchShape, layers: int, num_layers: int) -> float:
        """The forward pass of `shape` over `layers` of the model's `num_layers` layers."""
        return self.profile.conserve.shape_cost(shape) * self.forward_scale * layers / num_layers

    def step_s(self, shape: BatchShape, layers: int, num_layers: int) -> float:
        """One iteration of `shape` over `layers` of the model's `num_layers` layers: the forward pass, the engine
        loop's overhead around it and the serving overhead."""
        forward = self.forward_s(shape, layers, num_layers)
        serving = self.iteration_overhead_s + self.sequence_overhead_s * shape.num_chunks if shape.num_chunks else 0.0
        return forward + self.profile.loop.cost(shape.num_chunks) + serving

    def describe(self) -> dict[str, object]:
        return {
            "source": self.source,
            "conserve": self.profile.conserve.to_dict(),
            "kunserve": self.profile.kunserve.to_dict(),
            "fit": self.profile.fit,
            "loop_overhead": self.profile.loop.to_dict()
            if self.profile.loop.points
            else "not in the profile (written before loop overheads were measured): zero",
            "forward_scale": self.forward_scale,
            "iteration_overhead_s": self.iteration_overhead_s,
            "sequence_overhead_s": self.sequence_overhead_s,
            "request_latency_s": self.request_latency_s,
            "links_bytes_per_s": {"network": self.links.network, "host": self.links.host, "device": self.links.device},
        }


# -- profile files ---------------------------------------------------------------------------------------------
def profile_from_file(path: str, shape: ModelShape, device: str | None = None) -> Profile:
    """The whole-model profile of `shape` in `path` (ProfileError, one line, when it holds none: a profile of
    another model, dtype or layer range does not describe this one)."""
    profiles = read_profiles(path)
    want = (shape.name, shape.config.dtype, (0, shape.num_layers))
    matching = [p for _, p in sorted(profiles.items()) if (p.model, p.dtype, p.layers) == want]
    if device is not None:
        matching = [p for p in matching if p.device == device]
    if not matching:
        held = ", ".join(sorted(profiles)) or "nothing"
        dev = f" on {device}" if device else ""
        raise ProfileError(
            f"profile file {path} has no profile of {shape.name} ({shape.config.dtype}, layers 0-{shape.num_layers}){dev}: it holds {held}"
        )
    return matching[0]


# -- the roofline --------------------------------------------------------------------------------------------------
def roofline_seconds(chunks: Iterable[tuple[int, int]], shape: ModelShape, acc: Accelerator) -> float:
    """One iteration of `chunks` ((new tokens, cached prefix) per sequence) on an instance of `shape.tp` GPUs."""
    chunks = [(c, p) for c, p in chunks if c > 0]
    if not chunks:
        return 0.0
    cfg = shape.config
    tp = shape.tp
    flops, bandwidth = acc.flops * tp, acc.bandwidth * tp
    tokens = sum(c for c, _ in chunks)
    rows = len(chunks)  # sampled rows: the lm_head runs on each chunk's last token
    layer_params = sum(shape.layer_bytes) / shape.dtype_bytes
    head_params = cfg.vocab_size * cfg.hidden_size
    linear = max(2 * (layer_params * tokens + head_params * rows) / flops, shape.weight_bytes / bandwidth)
    pairs = sum(c * p + c * (c + 1) / 2 for c, p in chunks)  # (query, key) pairs, causal within a chunk
    attn_flops = 4 * cfg.num_heads * cfg.head_dim * pairs * cfg.num_layers
    kv_bytes = sum(p + c for c, p in chunks) * shape.kv_bytes_per_token * cfg.num_layers
    attention = max(attn_flops / flops, kv_bytes / bandwidth)
    comm = 0.0
    if tp > 1:  # two all-reduces of the hidden states per layer (attention out, MLP out), ring algorithm
        nbytes = tokens * cfg.hidden_size * shape.dtype_bytes
        comm = 2 * cfg.num_layers * (ALLREDUCE_LATENCY_S + 2 * (tp - 1) / tp * nbytes / acc.nvlink_bytes_per_s)
    return linear + attention + comm + acc.iteration_overhead_s


def roofline_samples(shape: ModelShape, acc: Accelerator) -> list[Sample]:
    """The grid a profiler would time (prefills, chunked prefills, decodes, mixed batches), priced by the roofline."""
    context = cfg_context = shape.config.max_position_embeddings
    out: list[Sample] = []

    def add(phase: str, chunks: list[tuple[int, int]]) -> None:
        if all(c + p <= cfg_context for c, p in chunks):
            out.append(Sample(phase, tuple(chunks), roofline_seconds(chunks, shape, acc)))

    for c in (16, 64, 128, 256, 512, 1024, 2048, 4096, 8192):
        add("prefill", [(c, 0)])
    for c in (128, 512, 2048):
        for p in (512, 2048, 8192, 16384):
            add("chunked_prefill", [(c, p)])
    for b in (1, 4, 16, 32, 64, 128, 256):
        for ctx in (128, 1024, 4096, 16384):
            if b * ctx <= 64 * context:
                add("decode", [(1, ctx - 1)] * b)
    for b in (4, 32, 128):
        for c, p in ((256, 0), (1024, 0), (512, 2048)):
            add("mixed", [(1, 1023)] * b + [(c, p)])
    return out


def roofline_profile(shape: ModelShape, acc: Accelerator) -> Profile:
    """A Profile of `shape` on `acc` fitted from roofline samples by `kunserve profile`'s own fitting code."""
    samples = roofline_samples(shape, acc)
    train, held = split_holdout(samples)
    kun, con = fit_kunserve(train), fit_conserve(train)
    fit = {
        "kunserve": relative_errors(kun, held).to_dict(),
        "conserve": relative_errors(con, held).to_dict(),
        "train_points": len(train),
        "heldout_points": len(held),
    }
    return Profile(
        model=shape.name,
        dtype=shape.config.dtype,
        layers=(0, shape.num_layers),
        device=f"roofline[{acc.name}x{shape.tp}]",
        kunserve=fit_kunserve(samples),
        conserve=fit_conserve(samples),
        fit=fit,
        samples=samples,
    )


def roofline_links(acc: Accelerator, network_gbps: float | None) -> Links:
    """Links of a cluster of `acc`: the scale-out network at `network_gbps` (None: NVLink, one NVLink domain)."""
    network = acc.nvlink_bytes_per_s if network_gbps is None else network_gbps * 1e9 / 8
    return Links(network=network, host=acc.pcie_bytes_per_s, device=acc.bandwidth)


__all__ = [
    "Links",
    "ProfileError",
    "TimeModel",
    "profile_from_file",
    "roofline_links",
    "roofline_profile",
    "roofline_samples",
    "roofline_seconds",
]
