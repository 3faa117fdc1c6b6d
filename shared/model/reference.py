"""An independent dense reference forward: the whole sequence every step, no KV cache, no paging,
no batching, no fused projections. It is the oracle the engine's tokens are compared with, so it
deliberately shares no code with shared/engine. It shares only the cos/sin of shared/model/rope.py,
the one statement of what a checkpoint's rope_parameters mean (that math is checked against
transformers itself in tests/unit/model/test_hf_fidelity.py)."""

from __future__ import annotations

import torch

from kunserve.shared.model import rope
from kunserve.shared.model.architecture import ModelConfig
from kunserve.shared.model.weights import Weights


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    var = x.pow(2).mean(-1, keepdim=True)
    return x * torch.rsqrt(var + eps) * w


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [heads, T, d]; cos/sin: [T, d]
    return x * cos.to(x.dtype) + _rotate_half(x) * sin.to(x.dtype)


@torch.inference_mode()
def reference_logits(cfg: ModelConfig, weights: Weights, token_ids: list[int]) -> torch.Tensor:
    """Logits [T, vocab] in float32 for every position of token_ids."""
    w = {k: v.to(torch.float32) for k, v in weights.items()}
    T = len(token_ids)
    x = w["model.embed_tokens.weight"][torch.tensor(token_ids)]
    pos = torch.arange(T)
    mask = torch.full((T, T), float("-inf")).triu(1)
    hd, nh, nkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    cos, sin = rope.cos_sin(cfg.rope, hd, cfg.max_position_embeddings, pos)
    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}."
        h = _rms_norm(x, w[p + "input_layernorm.weight"], cfg.rms_norm_eps)
        q = h @ w[p + "self_attn.q_proj.weight"].T
        k = h @ w[p + "self_attn.k_proj.weight"].T
        v = h @ w[p + "self_attn.v_proj.weight"].T
        if cfg.qkv_bias:
            q = q + w[p + "self_attn.q_proj.bias"]
            k = k + w[p + "self_attn.k_proj.bias"]
            v = v + w[p + "self_attn.v_proj.bias"]
        q = _rope(q.view(T, nh, hd).transpose(0, 1), cos, sin)
        k = _rope(k.view(T, nkv, hd).transpose(0, 1), cos, sin)
        v = v.view(T, nkv, hd).transpose(0, 1)
        k = k.repeat_interleave(nh // nkv, dim=0)
        v = v.repeat_interleave(nh // nkv, dim=0)
        att = torch.softmax(q @ k.transpose(1, 2) / hd ** 0.5 + mask, dim=-1)
        o = (att @ v).transpose(0, 1).reshape(T, nh * hd)
        x = x + o @ w[p + "self_attn.o_proj.weight"].T
        if cfg.o_bias:
            x = x + w[p + "self_attn.o_proj.bias"]
        h = _rms_norm(x, w[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
        gate = h @ w[p + "mlp.gate_proj.weight"].T
        up = h @ w[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    x = _rms_norm(x, w["model.norm.weight"], cfg.rms_norm_eps)
    head = w["model.embed_tokens.weight"] if cfg.tie_word_embeddings else w["lm_head.weight"]
    return x @ head.T


def reference_scores(cfg: ModelConfig, weights: Weights, prompt: list[int],
                     generated: list[int]) -> tuple[list[int], list[float]]:
    """Teacher-forced check of a generation in ONE dense forward: for each generated position i, the
    reference's argmax and top-1/top-2 margin given prompt + generated[:i].

    Up to the first position where generated differs from the argmax this is exactly the greedy
    reference (same context), so comparing a greedy generation against it is the same oracle as
    reference_greedy, at the cost of one forward instead of len(generated)."""
    if not generated:
        return [], []
    tokens = list(prompt) + list(generated[:-1])
    logits = reference_logits(cfg, weights, tokens)[len(prompt) - 1:]
    top = torch.topk(logits, 2, dim=-1)
    return top.indices[:, 0].tolist(), (top.values[:, 0] - top.values[:, 1]).tolist()


def reference_greedy(cfg: ModelConfig, weights: Weights, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy continuation of prompt (ignoring EOS) and the top-1 minus top-2 logit margin per step."""
    tokens = list(prompt)
    out, margins = [], []
    for _ in range(max_tokens):
        logits = reference_logits(cfg, weights, tokens)[-1]
        top = torch.topk(logits, 2)
        out.append(int(top.indices[0]))
        margins.append(float(top.values[0] - top.values[1]))
        tokens.append(out[-1])
    return out, margins
