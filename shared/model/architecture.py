"""Model architecture description (Llama / Qwen2 family) and the embedded tiny default."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama / Qwen2 decoder: everything the engine, the reference, the checkpoint loader
    and the memory planner need, and nothing framework-specific. Frozen (hashable) so it can key
    caches and travel between processes as its HF dict."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    head_dim: int = 0  # 0 = hidden_size // num_heads
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    qkv_bias: bool = False  # Qwen2 has biases on q/k/v projections
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    dtype: str = "float32"
    model_type: str = "llama"
    name: str = "custom"

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads "
                             f"({self.num_kv_heads})")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any], *, name: str = "custom", dtype: str | None = None) -> ModelConfig:
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_ARCHITECTURES:
            archs = d.get("architectures")
            raise ValueError(f"config.json: model_type {model_type!r} (architectures {archs}) is not supported; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")

        def need(key: str) -> Any:
            if key not in d:
                raise ValueError(f"config.json: missing key {key!r}")
            return d[key]

        heads = int(need("num_attention_heads"))
        eos = d.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        torch_dtype = dtype or {"bfloat16": "bfloat16", "float16": "float16"}.get(str(d.get("torch_dtype")), "float32")
        return cls(
            vocab_size=int(need("vocab_size")),
            hidden_size=int(need("hidden_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            intermediate_size=int(need("intermediate_size")),
            head_dim=int(d.get("head_dim") or 0),
            rope_theta=float(d.get("rope_theta", 10000.0)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            qkv_bias=True if model_type == "qwen2" else bool(d.get("attention_bias", False)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos,
            dtype=torch_dtype,
            model_type=model_type,
            name=name,
        )

    def to_hf_dict(self) -> dict[str, Any]:
        d = {
            "architectures": [SUPPORTED_ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": self.dtype,
            "hidden_act": "silu",
        }
        if self.model_type == "llama":
            d["attention_bias"] = self.qkv_bias
        return d


# The embedded default: Llama architecture, the shape of the vLLM-CPU reference benchmark.
TINY_CONFIG = ModelConfig(
    vocab_size=4096, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=704,
    head_dim=64, max_position_embeddings=2048, bos_token_id=256, eos_token_id=257, name="kunserve-tiny",
)
