"""Model architecture description (Llama / Qwen2 family) and the embedded tiny default.

`ModelConfig.from_hf_dict` is where a checkpoint's config.json meets the engine: every key that changes
the math is either carried into the config (and honoured by the model runner and the reference) or
refused with a ValueError naming the key and the file. Nothing falls back silently."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kunserve.shared.model.rope import RopeParameters

if TYPE_CHECKING:
    import torch

SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# the dtypes a config may name, by their torch attribute names: torch is imported only where tensors are made, so the
# services that read a config and never compute (dispatcher, memory manager) start without it
DTYPES = ("float32", "bfloat16", "float16")


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
    rope: RopeParameters = RopeParameters()
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    qkv_bias: bool = False  # Qwen2 has biases on q/k/v projections; Llama's attention_bias too
    o_bias: bool = False  # Llama's attention_bias also puts one on o_proj
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None  # the first end-of-sequence id
    extra_eos_token_ids: tuple[int, ...] = ()  # the rest, when config.json gives a list
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
        import torch

        dtype: torch.dtype = getattr(torch, self.dtype)
        return dtype

    @property
    def rope_theta(self) -> float:
        return self.rope.rope_theta

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends a sequence (generation stops on any of them)."""
        return () if self.eos_token_id is None else (self.eos_token_id, *self.extra_eos_token_ids)

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any], *, name: str = "custom", dtype: str | None = None,
                     source: str = "config.json") -> ModelConfig:
        """Parse a Hugging Face config.json (either transformers generation). `dtype` overrides the
        checkpoint's `dtype` / `torch_dtype`; `source` is the file named in errors."""
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_ARCHITECTURES:
            archs = d.get("architectures")
            raise ValueError(f"{source}: model_type {model_type!r} (architectures {archs}) is not supported; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        archs = d.get("architectures")
        if archs is not None and (not isinstance(archs, list) or
                                  any(a != SUPPORTED_ARCHITECTURES[model_type] for a in archs)):
            raise ValueError(f"{source}: architectures {archs!r} is not supported for model_type {model_type!r}; "
                             f"expected [{SUPPORTED_ARCHITECTURES[model_type]!r}]")

        def need(key: str) -> Any:
            if key not in d:
                raise ValueError(f"{source}: missing key {key!r}")
            return d[key]

        def refuse_unless(key: str, ok: bool, value: Any, why: str) -> None:
            if not ok:
                raise ValueError(f"{source}: {key} {value!r} is not supported ({why})")

        act = d.get("hidden_act", "silu")
        refuse_unless("hidden_act", act == "silu", act, "only silu")
        refuse_unless("mlp_bias", not d.get("mlp_bias", False), d.get("mlp_bias"), "MLP biases are not implemented")
        if d.get("quantization_config") is not None:
            raise ValueError(f"{source}: quantization_config is not supported (unquantized checkpoints only)")
        heads = int(need("num_attention_heads"))
        layers = int(need("num_hidden_layers"))
        max_pos = int(d.get("max_position_embeddings", 2048))
        if model_type == "qwen2" and d.get("use_sliding_window", False):
            window = d.get("sliding_window")
            layer_types = d.get("layer_types")
            if layer_types is not None:
                sliding = any(t == "sliding_attention" for t in layer_types)
            else:
                sliding = int(d.get("max_window_layers", 28)) < layers
            if window is not None and int(window) < max_pos and sliding:
                raise ValueError(f"{source}: sliding_window {window} is in use (use_sliding_window is true and "
                                 f"the window is smaller than max_position_embeddings {max_pos}); not supported")
        if model_type == "llama" and d.get("layer_types") is not None:
            refuse_unless("layer_types", all(t == "full_attention" for t in d["layer_types"]), d["layer_types"],
                          "only full_attention")
        eos = d.get("eos_token_id")
        eos_ids: tuple[int, ...] = ()
        if isinstance(eos, list):
            eos_ids = tuple(int(e) for e in eos)
        elif eos is not None:
            eos_ids = (int(eos),)
        ckpt_dtype = d.get("dtype", d.get("torch_dtype"))
        if dtype is None:
            if ckpt_dtype is None:
                dtype = "float32"  # what transformers loads a config without a dtype in
            elif ckpt_dtype not in DTYPES:
                key = "dtype" if "dtype" in d else "torch_dtype"
                raise ValueError(f"{source}: {key} {ckpt_dtype!r} is not supported; supported: {sorted(DTYPES)}")
            else:
                dtype = str(ckpt_dtype)
        attention_bias = bool(d.get("attention_bias", False))
        return cls(
            vocab_size=int(need("vocab_size")),
            hidden_size=int(need("hidden_size")),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            intermediate_size=int(need("intermediate_size")),
            head_dim=int(d.get("head_dim") or 0),
            rope=RopeParameters.from_hf(d, source=source),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_pos,
            qkv_bias=True if model_type == "qwen2" else attention_bias,
            o_bias=model_type == "llama" and attention_bias,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos_ids[0] if eos_ids else None,
            extra_eos_token_ids=eos_ids[1:],
            dtype=dtype,
            model_type=model_type,
            name=name,
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """config.json as transformers 5.x writes it (rope_parameters, dtype), with the 4.x keys
        (top-level rope_theta, rope_scaling, torch_dtype) beside them for older readers."""
        rope = self.rope.to_hf()
        d: dict[str, Any] = {
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
            "rope_parameters": rope,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if self.extra_eos_token_ids else self.eos_token_id,
            "dtype": self.dtype,
            "torch_dtype": self.dtype,
            "hidden_act": "silu",
        }
        if self.rope.rope_type != "default":
            d["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
        if self.model_type == "llama":
            if self.qkv_bias != self.o_bias:
                raise ValueError("a Llama config.json cannot express q/k/v biases without an o_proj bias "
                                 "(attention_bias covers both)")
            d["attention_bias"] = self.qkv_bias
        elif self.o_bias:
            raise ValueError("Qwen2 has no o_proj bias")
        return d


# The embedded default: Llama architecture, the shape of the vLLM-CPU reference benchmark.
TINY_CONFIG = ModelConfig(
    vocab_size=4096, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=704,
    head_dim=64, max_position_embeddings=2048, bos_token_id=256, eos_token_id=257, name="kunserve-tiny",
)
