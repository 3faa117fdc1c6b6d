"""Runs any contiguous layer range [start, end) of a Llama/Qwen2 decoder over the paged KV cache.

The first stage embeds token ids; a later stage takes hidden states; the last stage applies the
final norm and lm_head to only the rows that need sampling. q/k/v and gate/up are fused into single
matmuls (fewer, larger ops matter on a 2-core CPU).

Linear layers on a CPU in float32 run the panel GEMM of cpu_kernels.py over weights stored as column
panels: the memory pool stores them that way (pool_placement.py) and the runner computes on views of
its pages; weights handed over in nn.Linear's [out, in] form are re-laid out once at load
(`pack_weights`, the default on CPU float32), the panels then being the runner's only copy. Other
devices and dtypes use torch's linear (oneDNN for float32 [out, in] weights on a CPU).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kunserve.shared.engine import cpu_kernels
from kunserve.shared.engine.attention import Attention, AttentionMetadata, TorchPagedAttention, make_attention
from kunserve.shared.engine.kv_storage import LayerCaches
from kunserve.shared.engine.safepoint import Safepoint
from kunserve.shared.model import rope, tp_padding
from kunserve.shared.model.architecture import ModelConfig
from kunserve.shared.model.pool_placement import FFN_SHARDS, GATE_UP, PANELS, QKV
from kunserve.shared.model.weights import Weights


def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class _Linear:
    """y = x W^T + b over W as column panels (the CPU kernel), or as [out, in] (torch: oneDNN on a CPU in
    float32, whose unpacked path beats MKL's sgemm on AMD CPUs)."""

    __slots__ = ("w", "b", "n", "panels", "onednn")

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None, n: int) -> None:
        self.panels = w.dim() == 3
        self.w = w if self.panels else w.contiguous()
        self.b = b
        self.n = n
        self.onednn = (not self.panels and w.device.type == "cpu" and w.dtype == torch.float32
                       and _onednn_available())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels:
            return cpu_kernels.linear(x, self.w, self.n, self.b)
        if self.onednn:
            return torch.ops.mkldnn._linear_pointwise(x, self.w, self.b, "none", [], "")
        return F.linear(x, self.w, self.b)


class _MLP:
    """down(silu(gate(x)) * up(x)) with gate and up fused into one matrix; `fused`: SiLU * up in one pass."""

    __slots__ = ("gate_up", "down", "fused")

    def __init__(self, gate_up: _Linear, down: _Linear, fused: bool) -> None:
        self.gate_up, self.down, self.fused = gate_up, down, fused

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up(h)
        if self.fused:
            return self.down(cpu_kernels.silu_mul(gu))
        inter = gu.shape[-1] // 2
        return self.down(F.silu(gu[:, :inter]) * gu[:, inter:])


class _ShardedMLP:
    """The same MLP over the pool's page-aligned shards (`FFN_SHARDS`, tp_padding.py: `[n, 3, R, hidden]`, the
    shards this runner keeps): each shard's partial output, summed."""

    __slots__ = ("units",)

    def __init__(self, units: torch.Tensor) -> None:
        self.units = units

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return tp_padding.swiglu_shards(h, self.units)


@dataclass(slots=True)
class _Layer:
    """One decoder layer's weights, with q/k/v fused into one matrix."""

    qkv: _Linear
    o: _Linear
    mlp: _MLP | _ShardedMLP
    ln1: torch.Tensor
    ln2: torch.Tensor


class ModelRunner:
    """Forward pass of layers [start, end) over the paged KV cache.

    Which end the range touches decides the input and output: the first stage embeds token ids, a
    later stage takes the previous stage's hidden states; the last stage returns float32 logits for
    `logits_rows` only (the last token of each chunk that needs sampling), other stages return the
    hidden states of every token (the activations a pipeline ships to the next stage)."""

    def __init__(self, cfg: ModelConfig, weights: Weights, layer_range: tuple[int, int] | None = None,
                 device: str | torch.device = "cpu", attention: Attention | None = None,
                 pack_weights: bool | None = None, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.cfg = cfg
        # Tensor parallelism (tensor_parallel.py): sums o_proj's and down_proj's partial outputs across the ranks
        self.reduce = reduce
        self.start, self.end = layer_range or (0, cfg.num_layers)
        if not (0 <= self.start < self.end <= cfg.num_layers):
            raise ValueError(f"layer range [{self.start}, {self.end}) outside the model's {cfg.num_layers} layers")
        self.device = torch.device(device)
        self.dtype = cfg.torch_dtype
        self.is_first = self.start == 0
        self.is_last = self.end == cfg.num_layers
        if pack_weights is None:  # default: the CPU kernel's panels on a CPU in float32
            pack_weights = self.device.type == "cpu" and self.dtype == torch.float32
        self.pack_weights = pack_weights
        self.attention = attention or make_attention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, self.device)
        # CPU float32: RoPE + KV store, residual add + RMSNorm and SiLU * up as single passes (cpu_kernels.py)
        self.fused = (isinstance(self.attention, TorchPagedAttention) and not self.attention.needs_kv_write
                      and cpu_kernels.fused_layer_ops_supported(self.dtype, self.device, cfg.head_dim))
        self.load(weights)
        self._rope_cache(cfg.max_position_embeddings)

    def load(self, weights: Weights) -> None:
        """(Re)bind weights; called again after a restore hands back new tensors. Weights already stored as
        panels (the pool's CPU layout) are used as they are; [out, in] ones are re-laid out as panels when
        `pack_weights` (a copy the runner then owns), else used as they are."""
        dev, dt, cfg = self.device, self.dtype, self.cfg

        def w(name: str) -> torch.Tensor:
            return weights[name].to(device=dev, dtype=dt)

        def linear(name: str, n: int, parts: tuple[str, ...] = (), bias: torch.Tensor | None = None) -> _Linear:
            """`name`'s weight ([n, in], or panels), else the concatenation of `parts` (HF's unfused names)."""
            if name + PANELS in weights:
                return _Linear(w(name + PANELS), bias, n)
            mat = w(name) if name in weights else torch.cat([w(part) for part in parts], 0)
            if self.pack_weights:
                mat = cpu_kernels.to_panels(mat)
            return _Linear(mat, bias, n)

        h, hd = cfg.hidden_size, cfg.head_dim
        qkv_rows = (cfg.num_heads + 2 * cfg.num_kv_heads) * hd
        self.layers: dict[int, _Layer] = {}
        for i in range(self.start, self.end):
            p = f"model.layers.{i}."
            qkv_b = None
            if cfg.qkv_bias:
                qkv_b = (w(p + QKV + ".bias") if p + QKV + ".bias" in weights else
                         torch.cat([w(p + "self_attn.q_proj.bias"), w(p + "self_attn.k_proj.bias"),
                                    w(p + "self_attn.v_proj.bias")]))
            mlp: _MLP | _ShardedMLP
            if p + FFN_SHARDS in weights:
                mlp = _ShardedMLP(w(p + FFN_SHARDS))
            else:
                mlp = _MLP(linear(p + GATE_UP + ".weight", 2 * cfg.intermediate_size,
                                  (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")),
                           linear(p + "mlp.down_proj.weight", h), self.fused)
            self.layers[i] = _Layer(
                qkv=linear(p + QKV + ".weight", qkv_rows, tuple(p + f"self_attn.{x}_proj.weight" for x in "qkv"),
                           qkv_b),
                o=linear(p + "self_attn.o_proj.weight", h,
                         bias=w(p + "self_attn.o_proj.bias") if cfg.o_bias else None),
                mlp=mlp, ln1=w(p + "input_layernorm.weight"), ln2=w(p + "post_attention_layernorm.weight"))
        self.embed: torch.Tensor | None = w("model.embed_tokens.weight") if self.is_first else None
        self.norm: torch.Tensor | None = None
        self.lm_head: _Linear | None = None
        if self.is_last:
            self.norm = w("model.norm.weight")
            if cfg.tie_word_embeddings:  # the embedding matrix itself: its rows are looked up too
                self.lm_head = _Linear(w("model.embed_tokens.weight"), None, cfg.vocab_size)
            else:
                self.lm_head = linear("lm_head.weight", cfg.vocab_size)

    def release(self) -> None:
        """Drop every reference to the weights, so the memory pool may unmap their pages (a view
        that outlived its mapping would crash the process). The runner is unusable until load()."""
        self.layers = {}
        self.embed = self.norm = self.lm_head = None

    def _rope_cache(self, max_pos: int) -> None:
        """cos/sin for every position the context can hold, as transformers computes them (shared/model/rope.py)."""
        cos, sin = rope.cos_sin(self.cfg.rope, self.cfg.head_dim, self.cfg.max_position_embeddings,
                                torch.arange(max_pos))
        self.cos = cos.to(self.device, self.dtype).contiguous()
        self.sin = sin.to(self.device, self.dtype).contiguous()

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), w, self.cfg.rms_norm_eps)  # one fused op on CPU
        xf = x.float()  # half precision: normalize in float32 like HF does
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)).to(x.dtype) * w

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return rope.rotate(x, cos, sin)

    def _rope_inputs(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(positions, cos, sin) as the layers take them: the fused kernel indexes the tables itself."""
        if self.fused:
            positions = positions.contiguous()
            return positions, positions, positions
        return positions, self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def _layer(self, i: int, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               kv: LayerCaches, meta: AttentionMetadata) -> torch.Tensor:
        """Decoder layer i over hidden states x [T, hidden] (the fused path adds into x in place)."""
        cfg = self.cfg
        T = positions.shape[0]
        nh, nkvh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        nq, nkv = nh * hd, nkvh * hd
        L = self.layers[i]
        h = self._rms(x, L.ln1)
        qkv = L.qkv(h)
        if self.fused:
            # RoPE in place on the q and k heads, k and v into their cache slots, in one pass (cpu_kernels)
            cache = kv.layer_cache(i)
            cpu_kernels.rope_store(qkv, nh, nkvh, hd, self.cos, self.sin, positions, cache, meta.slot_blocks,
                                   meta.slot_offsets)
            q = qkv[:, :nq].view(T, nh, hd)
            k = qkv[:, nq:nq + nkv].view(T, nkvh, hd)
            v = qkv[:, nq + nkv:].view(T, nkvh, hd)
            o = self.attention.forward(q, k, v, cache, meta, kv_written=True)
            a = L.o(o.reshape(T, nq))
            h = cpu_kernels.add_rms_norm(x, a if self.reduce is None else self.reduce(a), L.ln2,
                                         cfg.rms_norm_eps)  # x += a
            m = L.mlp(h)
            x += m if self.reduce is None else self.reduce(m)
            return x
        # rotate q and k heads in one go: [T, H + KVH, d]
        qk = self._rotate(qkv[:, : nq + nkv].view(T, nh + nkvh, hd), cos, sin)
        q, k = qk[:, :nh], qk[:, nh:]
        v = qkv[:, nq + nkv:].view(T, nkvh, hd)
        o = self.attention.forward(q, k, v, kv.layer_cache(i), meta)
        a = L.o(o.reshape(T, nq))
        x = x + (a if self.reduce is None else self.reduce(a))
        h = self._rms(x, L.ln2)
        m = L.mlp(h)
        return x + (m if self.reduce is None else self.reduce(m))

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """The first layer's input: hidden states [T, hidden] of token ids [T]."""
        assert self.embed is not None, "weights released or not the first stage"
        return F.embedding(ids, self.embed)

    @torch.inference_mode()
    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, kv: LayerCaches, meta: AttentionMetadata,
                   layers: range) -> torch.Tensor:
        """Hidden states [T, hidden] through `layers` (part of this runner's range): no embedding, no head. A
        layer-staggered split computes a step's first layers as one shard and the rest as another (tp_stagger.py)."""
        if not (self.start <= layers.start and layers.stop <= self.end):
            raise ValueError(f"layers {layers} outside this runner's [{self.start}, {self.end})")
        x = x.to(self.dtype, copy=self.fused)  # the fused path adds into x in place
        positions, cos, sin = self._rope_inputs(positions)
        for i in layers:
            x = self._layer(i, x, positions, cos, sin, kv, meta)
        return x

    @torch.inference_mode()
    def logits(self, x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """float32 logits of the final hidden states' `rows` (None: all)."""
        if rows is not None:
            x = x[rows]
        assert self.lm_head is not None and self.norm is not None, "weights released or not the last stage"
        return self.lm_head(self._rms(x, self.norm)).float()

    @torch.inference_mode()
    def forward(self, inputs: torch.Tensor, positions: torch.Tensor, kv: LayerCaches, meta: AttentionMetadata,
                logits_rows: torch.Tensor | None = None, safepoint: Safepoint | None = None) -> torch.Tensor:
        """inputs: token ids [T] on the first stage, else hidden states [T, hidden].
        Returns logits [len(logits_rows), vocab] on the last stage, else hidden states [T, hidden]. With a
        `safepoint` that fires (layer-wise preemption), the rest of the pass runs the safepoint's rows only and
        the result is theirs: logits of safepoint.logits_rows, or hidden states [T', hidden]."""
        cfg = self.cfg
        if self.is_first:
            x = self.embed_tokens(inputs)
        else:
            x = inputs.to(self.dtype, copy=self.fused)  # the fused path adds into x in place
        positions, cos, sin = self._rope_inputs(positions)
        for i in range(self.start, self.end):
            if safepoint is not None and safepoint.due(i, self.start):
                x, positions, meta, logits_rows = (x[safepoint.keep], safepoint.positions, safepoint.meta,
                                                   safepoint.logits_rows)
                if positions.shape[0] == 0:
                    return x.new_empty((0, cfg.vocab_size if self.is_last else x.shape[-1]),
                                       dtype=torch.float32 if self.is_last else x.dtype)
                positions, cos, sin = self._rope_inputs(positions)
            x = self._layer(i, x, positions, cos, sin, kv, meta)
        if not self.is_last:
            return x
        return self.logits(x, logits_rows)
