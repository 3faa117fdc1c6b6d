"""Runs any contiguous layer range [start, end) of a Llama/Qwen2 decoder over the paged KV cache.

The first stage embeds token ids; a later stage takes hidden states; the last stage applies the
final norm and lm_head to only the rows that need sampling. q/k/v and gate/up are fused into single
matmuls at load time (fewer, larger ops matter on a 2-core CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kunserve.shared.engine.attention import Attention, AttentionMetadata, make_attention
from kunserve.shared.engine.kv_storage import KVStorage
from kunserve.shared.engine.safepoint import Safepoint
from kunserve.shared.model import rope
from kunserve.shared.model.architecture import ModelConfig
from kunserve.shared.model.weights import Weights

# oneDNN with pre-packed weights beats MKL's sgemm for small row counts on CPU: sgemm re-packs the
# weight matrix on every call, which dominates a decode step (weights do not fit in cache). Measured
# on the 2-core VM, float32, the tiny model's matrices: rows 2..128 -20..-45% time; 1 row (GEMV) and
# >= 192 rows (prefill) are faster unpacked. So both forms are kept (CPU float32 only).
PACKED_ROWS = (2, 128)


def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class _Linear:
    """y = x W^T + b, through a oneDNN pre-packed weight when that is faster for this many rows."""

    __slots__ = ("w", "b", "packed")

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None, pack: bool) -> None:
        self.w = w.contiguous()
        self.b = b
        self.packed = None
        if pack:
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(self.w, 16)
            except RuntimeError:  # CPU without the needed ISA: plain sgemm
                self.packed = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and PACKED_ROWS[0] <= x.shape[0] <= PACKED_ROWS[1]:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.b, "none", [], "")
        return F.linear(x, self.w, self.b)


@dataclass(slots=True)
class _Layer:
    """One decoder layer's weights, with q/k/v and gate/up fused into single matrices."""

    qkv: _Linear
    o: _Linear
    gate_up: _Linear
    down: _Linear
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
                 pack_weights: bool | None = None) -> None:
        self.cfg = cfg
        self.start, self.end = layer_range or (0, cfg.num_layers)
        if not (0 <= self.start < self.end <= cfg.num_layers):
            raise ValueError(f"layer range [{self.start}, {self.end}) outside the model's {cfg.num_layers} layers")
        self.device = torch.device(device)
        self.dtype = cfg.torch_dtype
        self.is_first = self.start == 0
        self.is_last = self.end == cfg.num_layers
        if pack_weights is None:  # default: CPU float32 with oneDNN (doubles the weights' memory)
            pack_weights = self.device.type == "cpu" and self.dtype == torch.float32 and _onednn_available()
        self.pack_weights = pack_weights
        self.attention = attention or make_attention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, self.device)
        self.load(weights)
        self._rope_cache(cfg.max_position_embeddings)

    def load(self, weights: Weights) -> None:
        """(Re)bind weights; called again after a restore hands back new tensors."""
        dev, dt = self.device, self.dtype
        pack = self.pack_weights

        def w(name: str) -> torch.Tensor:
            return weights[name].to(device=dev, dtype=dt)

        self.layers: dict[int, _Layer] = {}
        for i in range(self.start, self.end):
            p = f"model.layers.{i}."
            if p + "self_attn.qkv_proj.weight" in weights:
                # Already fused (the memory pool stores weights the way they are consumed): views, no copy.
                qkv_w = w(p + "self_attn.qkv_proj.weight")
                qkv_b = w(p + "self_attn.qkv_proj.bias") if self.cfg.qkv_bias else None
                gate_up_w = w(p + "mlp.gate_up_proj.weight")
            else:
                qkv_b = (torch.cat([w(p + "self_attn.q_proj.bias"), w(p + "self_attn.k_proj.bias"),
                                    w(p + "self_attn.v_proj.bias")]) if self.cfg.qkv_bias else None)
                qkv_w = torch.cat([w(p + "self_attn.q_proj.weight"), w(p + "self_attn.k_proj.weight"),
                                   w(p + "self_attn.v_proj.weight")], 0)
                gate_up_w = torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")], 0)
            self.layers[i] = _Layer(
                qkv=_Linear(qkv_w, qkv_b, pack),
                o=_Linear(w(p + "self_attn.o_proj.weight"), w(p + "self_attn.o_proj.bias") if self.cfg.o_bias else None,
                          pack),
                gate_up=_Linear(gate_up_w, None, pack), down=_Linear(w(p + "mlp.down_proj.weight"), None, pack),
                ln1=w(p + "input_layernorm.weight"), ln2=w(p + "post_attention_layernorm.weight"))
        self.embed: torch.Tensor | None = w("model.embed_tokens.weight") if self.is_first else None
        self.norm: torch.Tensor | None = None
        self.lm_head: _Linear | None = None
        if self.is_last:
            self.norm = w("model.norm.weight")
            head = w("model.embed_tokens.weight") if self.cfg.tie_word_embeddings else w("lm_head.weight")
            self.lm_head = _Linear(head, None, pack)

    def release(self) -> None:
        """Drop every reference to the weights, so the memory pool may unmap their pages (a view
        that outlived its mapping would crash the process). The runner is unusable until load()."""
        self.layers = {}
        self.embed = self.norm = self.lm_head = None

    def _rope_cache(self, max_pos: int) -> None:
        """cos/sin for every position the context can hold, as transformers computes them (shared/model/rope.py)."""
        cos, sin = rope.cos_sin(self.cfg.rope, self.cfg.head_dim, self.cfg.max_position_embeddings,
                                torch.arange(max_pos))
        self.cos = cos.to(self.device, self.dtype)
        self.sin = sin.to(self.device, self.dtype)

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), w, self.cfg.rms_norm_eps)  # one fused op on CPU
        xf = x.float()  # half precision: normalize in float32 like HF does
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)).to(x.dtype) * w

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return rope.rotate(x, cos, sin)

    @torch.inference_mode()
    def forward(self, inputs: torch.Tensor, positions: torch.Tensor, kv: KVStorage, meta: AttentionMetadata,
                logits_rows: torch.Tensor | None = None, safepoint: Safepoint | None = None) -> torch.Tensor:
        """inputs: token ids [T] on the first stage, else hidden states [T, hidden].
        Returns logits [len(logits_rows), vocab] on the last stage, else hidden states [T, hidden]. With a
        `safepoint` that fires (layer-wise preemption), the rest of the pass runs the safepoint's rows only and
        the result is theirs: logits of safepoint.logits_rows, or hidden states [T', hidden]."""
        cfg = self.cfg
        T = positions.shape[0]
        if self.is_first:
            assert self.embed is not None, "weights released"
            x = F.embedding(inputs, self.embed)
        else:
            x = inputs.to(self.dtype)
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        nh, nkvh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        nq, nkv = nh * hd, nkvh * hd
        for i in range(self.start, self.end):
            if safepoint is not None and safepoint.due(i, self.start):
                x, positions, meta, logits_rows = (x[safepoint.keep], safepoint.positions, safepoint.meta,
                                                   safepoint.logits_rows)
                T = positions.shape[0]
                if T == 0:
                    return x.new_empty((0, cfg.vocab_size if self.is_last else x.shape[-1]),
                                       dtype=torch.float32 if self.is_last else x.dtype)
                cos = self.cos[positions].unsqueeze(1)
                sin = self.sin[positions].unsqueeze(1)
            L = self.layers[i]
            h = self._rms(x, L.ln1)
            qkv = L.qkv(h)
            # rotate q and k heads in one go: [T, H + KVH, d]
            qk = self._rotate(qkv[:, : nq + nkv].view(T, nh + nkvh, hd), cos, sin)
            q, k = qk[:, :nh], qk[:, nh:]
            v = qkv[:, nq + nkv:].view(T, nkvh, hd)
            o = self.attention.forward(q, k, v, kv.layer_cache(i), meta)
            x = x + L.o(o.reshape(T, nq))
            h = self._rms(x, L.ln2)
            gu = L.gate_up(h)
            inter = gu.shape[-1] // 2
            x = x + L.down(F.silu(gu[:, :inter]) * gu[:, inter:])
        if not self.is_last:
            return x
        if logits_rows is not None:
            x = x[logits_rows]
        assert self.lm_head is not None and self.norm is not None, "weights released"
        return self.lm_head(self._rms(x, self.norm)).float()
