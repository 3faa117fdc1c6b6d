"""Small random Llama / Qwen2 checkpoints written by `transformers` itself, and its greedy `generate`: the
oracle the fidelity tests (unit and integration) compare KunServe with. Import only where transformers is
installed (the tests `importorskip` it first)."""

from __future__ import annotations

import math

import torch
import transformers

VOCAB = 512
PROMPT_LENS = (1, 7, 61, 300, 1000)
MAX_NEW = 8
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1100, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _spread(model: torch.nn.Module, seed: int, tied: bool) -> None:
    """Weights with wide logits (std ~4) so greedy has clear top-1/top-2 margins (transformers' own init,
    std 0.02, makes near-uniform logits where float noise decides the argmax). A tied embedding is scaled
    down (std 1/sqrt(hidden)), else the input token's own embedding decides the argmax whatever the
    attention computed, and a wrong RoPE would go unseen."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 / math.sqrt(p.shape[1]) if tied else 1.0))
            elif name == "lm_head.weight":
                p.copy_(torch.randn(p.shape, generator=g) * 4.0 / math.sqrt(p.shape[1]))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))


def write_checkpoint(path, arch: str, seed: int = 0, **overrides):
    """A transformers-written checkpoint in `path`; returns the transformers model (float32, eval)."""
    cls_cfg, cls_model = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                          "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[arch]
    cfg = cls_cfg(**{**SHAPE, **overrides})
    torch.manual_seed(seed)
    model = cls_model(cfg).eval()
    _spread(model, seed, bool(cfg.tie_word_embeddings))
    if cfg.tie_word_embeddings:
        model.tie_weights()
    model.save_pretrained(str(path))
    return model


def prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]


def hf_greedy(model, prompt: list[int]) -> list[int]:
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=MAX_NEW, do_sample=False, top_k=None, top_p=None, temperature=None)
    return out[0, len(prompt):].tolist()
