"""Rotary position embeddings as Hugging Face `transformers` computes them, in pure torch.

One place for the math the engine's model runner and the dense reference both use, so a checkpoint's
`rope_parameters` (transformers >= 5) or top-level `rope_theta` / `rope_scaling` (<= 4.x) mean the same
thing everywhere. The formulas follow `transformers/modeling_rope_utils.py` (5.23) operation for
operation, in float32 like it does, so the cos/sin tables are bit-identical to its rotary embedding's.

Variants: `default`, `linear`, `dynamic`, `llama3`, `yarn`. Any other `rope_type` is refused by
`RopeParameters.from_hf` with the key and the file named.

`dynamic` (NTK) in `transformers` rescales theta from the length of the sequence the forward pass sees,
and with a KV cache each token keeps the rotation of the step that computed it: a prompt of length L
is rotated with the frequencies for max(L, max_position_embeddings), the decode token at position p
with those for max(p + 1, max_position_embeddings). A paged cache needs a rotation that depends on
the position alone, so the table here uses max(p + 1, max_position_embeddings) for every token: it
equals `generate` exactly whenever the prompt fits in `max_position_embeddings` (then every prompt
token has the unscaled frequencies), whatever the number of generated tokens. The engine's context is
`max_position_embeddings`, so a prompt beyond it is refused before it reaches this code.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the tables are torch; RopeParameters is config, read by services that never compute
    import torch

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
_KNOWN_KEYS = {
    "default": {"rope_type", "type", "rope_theta"},
    "linear": {"rope_type", "type", "rope_theta", "factor"},
    "dynamic": {"rope_type", "type", "rope_theta", "factor"},
    "llama3": {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "low_freq_factor",
               "high_freq_factor"},
    "yarn": {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "attention_factor",
             "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"},
}


@dataclass(frozen=True)
class RopeParameters:
    """The RoPE variant and its parameters (frozen: part of the hashable ModelConfig)."""

    rope_type: str = "default"
    rope_theta: float = 10000.0
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    attention_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type {self.rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")

    @classmethod
    def from_hf(cls, d: Mapping[str, Any], *, source: str = "config.json") -> RopeParameters:
        """Read either config generation: `rope_parameters` (a dict, transformers >= 5) or top-level
        `rope_theta` + `rope_scaling` (<= 4.x, where the type may be under `type`). Missing theta is
        10000 as in transformers; everything that would change the math and is not implemented is refused."""
        params = d.get("rope_parameters")
        key = "rope_parameters"
        if params is None:
            params = d.get("rope_scaling")
            key = "rope_scaling"
        if params is None:
            params = {}
        if not isinstance(params, Mapping):
            raise ValueError(f"{source}: {key} must be an object, got {params!r}")
        if any(isinstance(v, Mapping) for v in params.values()):
            raise ValueError(f"{source}: {key} holds per-layer-type parameters ({', '.join(params)}), "
                             "which Llama / Qwen2 do not use; not supported")
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"{source}: {key}.rope_type {rope_type!r} is not supported; "
                             f"supported: {', '.join(ROPE_TYPES)}")
        prf = params.get("partial_rotary_factor", d.get("partial_rotary_factor"))
        if prf is not None and float(prf) != 1.0:
            raise ValueError(f"{source}: partial_rotary_factor {prf} is not supported (only 1.0)")
        unknown = set(params) - _KNOWN_KEYS[rope_type] - {"partial_rotary_factor"}
        if unknown:
            raise ValueError(f"{source}: {key} keys {sorted(unknown)} are not supported for rope_type {rope_type!r}")
        theta = params.get("rope_theta")
        if theta is None:
            theta = d.get("rope_theta", 10000.0)

        def num(name: str, required: bool) -> float | None:
            v = params.get(name)
            if v is None:
                if required:
                    raise ValueError(f"{source}: {key}.{name} is required for rope_type {rope_type!r}")
                return None
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"{source}: {key}.{name} must be a number, got {v!r}")
            return float(v)

        orig: int | None = None
        if rope_type in ("llama3", "yarn"):
            # transformers: a top-level original_max_position_embeddings wins, else max_position_embeddings
            raw = d.get("original_max_position_embeddings", params.get("original_max_position_embeddings",
                                                                       d.get("max_position_embeddings")))
            if raw is None:
                raise ValueError(f"{source}: {key}.original_max_position_embeddings is required for "
                                 f"rope_type {rope_type!r}")
            orig = int(raw)
        truncate = params.get("truncate", True)
        if not isinstance(truncate, bool):
            raise ValueError(f"{source}: {key}.truncate must be true or false, got {truncate!r}")
        return cls(
            rope_type=rope_type, rope_theta=float(theta),
            factor=num("factor", rope_type in ("linear", "dynamic", "llama3")) if rope_type != "default" else None,
            original_max_position_embeddings=orig,
            low_freq_factor=num("low_freq_factor", rope_type == "llama3") if rope_type == "llama3" else None,
            high_freq_factor=num("high_freq_factor", rope_type == "llama3") if rope_type == "llama3" else None,
            attention_factor=num("attention_factor", False) if rope_type == "yarn" else None,
            beta_fast=num("beta_fast", False) if rope_type == "yarn" else None,
            beta_slow=num("beta_slow", False) if rope_type == "yarn" else None,
            mscale=num("mscale", False) if rope_type == "yarn" else None,
            mscale_all_dim=num("mscale_all_dim", False) if rope_type == "yarn" else None,
            truncate=truncate,
        )

    def to_hf(self) -> dict[str, Any]:
        """The `rope_parameters` dict transformers 5.x writes (only the keys that are set)."""
        out: dict[str, Any] = {"rope_type": self.rope_type, "rope_theta": self.rope_theta}
        for name in ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor",
                     "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
            v = getattr(self, name)
            if v is not None:
                out[name] = v
        if self.rope_type == "yarn" and not self.truncate:
            out["truncate"] = False
        return out


def _base_inv_freq(base: float | torch.Tensor, dim: int) -> torch.Tensor:
    import torch

    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))


def inv_freq(rope: RopeParameters, head_dim: int, max_position_embeddings: int,
             seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim / 2] float32, attention scaling) as transformers' rope init
    functions return them; `seq_len` matters only for `dynamic` (None = max_position_embeddings)."""
    import torch

    dim, base = head_dim, rope.rope_theta
    t = rope.rope_type
    if t == "default":
        return _base_inv_freq(base, dim), 1.0
    if t == "linear":
        assert rope.factor is not None
        inv = _base_inv_freq(base, dim)
        inv /= rope.factor
        return inv, 1.0
    if t == "dynamic":
        assert rope.factor is not None
        factor = rope.factor
        if seq_len is None:  # at init transformers computes the base in Python floats
            scaled: float | torch.Tensor = base * ((factor * max_position_embeddings / max_position_embeddings)
                                                   - (factor - 1)) ** (dim / (dim - 2))
        else:  # during generate seq_len is a tensor: the base is computed in float32
            s = torch.maximum(torch.tensor(seq_len), torch.tensor(max_position_embeddings))
            scaled = base * ((factor * s / max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
        return _base_inv_freq(scaled, dim), 1.0
    if t == "llama3":
        assert rope.factor is not None and rope.low_freq_factor is not None and rope.high_freq_factor is not None
        assert rope.original_max_position_embeddings is not None
        inv = _base_inv_freq(base, dim)
        factor, low, high = rope.factor, rope.low_freq_factor, rope.high_freq_factor
        old = rope.original_max_position_embeddings
        low_wavelen, high_wavelen = old / low, old / high
        wavelen = 2 * math.pi / inv
        inv_l = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, inv_l), 1.0
    assert t == "yarn" and rope.original_max_position_embeddings is not None
    orig = rope.original_max_position_embeddings
    factor = rope.factor if rope.factor is not None else max_position_embeddings / orig

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = rope.attention_factor
    if attn is None:
        if rope.mscale and rope.mscale_all_dim:
            attn = float(get_mscale(factor, rope.mscale) / get_mscale(factor, rope.mscale_all_dim))
        else:
            attn = get_mscale(factor)
    beta_fast = rope.beta_fast or 32
    beta_slow = rope.beta_slow or 1

    def correction_dim(rot: float) -> float:
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    extra_factor = 1 - ramp
    return interpolation * (1 - extra_factor) + extrapolation * extra_factor, attn


def cos_sin(rope: RopeParameters, head_dim: int, max_position_embeddings: int,
            positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [len(positions), head_dim] float32 for these positions, the attention scaling folded in
    (transformers multiplies both by it). Position-only: see the module docstring for `dynamic`."""
    import torch

    pos = positions.to(torch.int64)
    if rope.rope_type != "dynamic":
        inv, scale = inv_freq(rope, head_dim, max_position_embeddings)
        freqs = pos[:, None].float() * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * scale, emb.sin() * scale
    base_inv, _ = inv_freq(rope, head_dim, max_position_embeddings)
    freqs = pos[:, None].float() * base_inv[None, :]
    for i in torch.nonzero(pos + 1 > max_position_embeddings).flatten().tolist():
        p = int(pos[i])
        freqs[i] = torch.tensor(float(p)) * inv_freq(rope, head_dim, max_position_embeddings, p + 1)[0]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin (transformers' apply_rotary_pos_emb for one tensor)."""
    import torch

    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin
