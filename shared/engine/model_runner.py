"""Runs any contiguous layer range [start, end) of a Llama/Qwen2 decoder over the paged KV cache.

The first stage embeds token ids; a later stage takes hidden states; the last stage applies the
final norm and lm_head to only the rows that need sampling. q/k/v and gate/up are fused into single
matmuls at load time (fewer, larger ops matter on a 2-core CPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kunserve.shared.engine.attention import AttentionMetadata, TorchPagedAttention, make_attention
from kunserve.shared.engine.kv_cache import KVStorage
from kunserve.shared.model.config import ModelConfig
from kunserve.shared.model.weights import Weights


class _Layer:
    __slots__ = ("qkv_w", "qkv_b", "o_w", "gate_up_w", "down_w", "ln1", "ln2")


class ModelRunner:
    def __init__(self, cfg: ModelConfig, weights: Weights, layer_range: tuple[int, int] | None = None,
                 device: str | torch.device = "cpu", attention: TorchPagedAttention | None = None) -> None:
        self.cfg = cfg
        self.start, self.end = layer_range or (0, cfg.num_layers)
        if not (0 <= self.start < self.end <= cfg.num_layers):
            raise ValueError(f"layer range [{self.start}, {self.end}) outside the model's {cfg.num_layers} layers")
        self.device = torch.device(device)
        self.dtype = cfg.torch_dtype
        self.is_first = self.start == 0
        self.is_last = self.end == cfg.num_layers
        self.attention = attention or make_attention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, self.device)
        self.load(weights)
        self._rope_cache(cfg.max_position_embeddings)

    def load(self, weights: Weights) -> None:
        """(Re)bind weights; called again after a restore hands back new tensors."""
        dev, dt = self.device, self.dtype

        def w(name: str) -> torch.Tensor:
            return weights[name].to(device=dev, dtype=dt)

        self.layers: dict[int, _Layer] = {}
        for i in range(self.start, self.end):
            p = f"model.layers.{i}."
            L = _Layer()
            L.qkv_w = torch.cat([w(p + "self_attn.q_proj.weight"), w(p + "self_attn.k_proj.weight"),
                                 w(p + "self_attn.v_proj.weight")], 0).contiguous()
            L.qkv_b = (torch.cat([w(p + "self_attn.q_proj.bias"), w(p + "self_attn.k_proj.bias"),
                                  w(p + "self_attn.v_proj.bias")]) if self.cfg.qkv_bias else None)
            L.o_w = w(p + "self_attn.o_proj.weight")
            L.gate_up_w = torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")], 0).contiguous()
            L.down_w = w(p + "mlp.down_proj.weight")
            L.ln1 = w(p + "input_layernorm.weight")
            L.ln2 = w(p + "post_attention_layernorm.weight")
            self.layers[i] = L
        self.embed = w("model.embed_tokens.weight") if self.is_first else None
        if self.is_last:
            self.norm = w("model.norm.weight")
            self.lm_head = w("model.embed_tokens.weight") if self.cfg.tie_word_embeddings else w("lm_head.weight")

    def _rope_cache(self, max_pos: int) -> None:
        d = self.cfg.head_dim
        inv = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        freqs = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(self.device, self.dtype)
        self.sin = emb.sin().to(self.device, self.dtype)

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)).to(x.dtype) * w

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rot * sin

    @torch.inference_mode()
    def forward(self, inputs: torch.Tensor, positions: torch.Tensor, kv: KVStorage, meta: AttentionMetadata,
                logits_rows: torch.Tensor | None = None) -> torch.Tensor:
        """inputs: token ids [T] on the first stage, else hidden states [T, hidden].
        Returns logits [len(logits_rows), vocab] on the last stage, else hidden states [T, hidden]."""
        cfg = self.cfg
        T = positions.shape[0]
        x = F.embedding(inputs, self.embed) if self.is_first else inputs.to(self.dtype)
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        nq, nkv, hd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.head_dim
        for i in range(self.start, self.end):
            L = self.layers[i]
            h = self._rms(x, L.ln1)
            qkv = F.linear(h, L.qkv_w, L.qkv_b)
            q = self._rotate(qkv[:, :nq].view(T, cfg.num_heads, hd), cos, sin)
            k = self._rotate(qkv[:, nq:nq + nkv].view(T, cfg.num_kv_heads, hd), cos, sin)
            v = qkv[:, nq + nkv:].view(T, cfg.num_kv_heads, hd)
            o = self.attention.forward(q, k, v, kv.layer_cache(i), meta)
            x = x + F.linear(o.reshape(T, nq), L.o_w)
            h = self._rms(x, L.ln2)
            gu = F.linear(h, L.gate_up_w)
            inter = gu.shape[-1] // 2
            x = x + F.linear(F.silu(gu[:, :inter]) * gu[:, inter:], L.down_w)
        if not self.is_last:
            return x
        if logits_rows is not None:
            x = x[logits_rows]
        return F.linear(self._rms(x, self.norm), self.lm_head).float()
