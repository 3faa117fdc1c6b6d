"""The engine on a CUDA device (skipped without one): same tokens as the CPU reference in float32,
and a bfloat16 run that completes. FlashInfer is used when installed, else the torch paged path."""

from __future__ import annotations

import random

import pytest
import torch
from engine_testing import check_greedy, weights_for

from kunserve.shared.engine.api import EngineRequest, SamplingParams
from kunserve.shared.engine.attention import make_attention
from kunserve.shared.engine.engine import Engine, SchedulerConfig
from kunserve.shared.model.architecture import TINY_CONFIG

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("seed", range(4))
def test_cuda_engine_matches_the_reference(seed):
    cfg = TINY_CONFIG
    w = weights_for(cfg)
    rng = random.Random(seed)
    prompts = [[rng.randrange(cfg.vocab_size) for _ in range(rng.randint(1, 150))] for _ in range(rng.randint(2, 6))]
    eng = Engine(cfg, w, num_kv_blocks=rng.choice([24, 200]), block_size=rng.choice([8, 16]), device="cuda",
                 scheduler_config=SchedulerConfig(max_num_batched_tokens=rng.choice([32, 512])))
    out = eng.generate([EngineRequest(f"r{i}", p, SamplingParams(max_tokens=12, ignore_eos=True))
                        for i, p in enumerate(prompts)])
    ties = sum(check_greedy(cfg, w, p, out[f"r{i}"]) for i, p in enumerate(prompts))
    assert ties <= 1
    assert eng.allocator.num_used == 0


def test_cuda_bfloat16_runs():
    cfg = TINY_CONFIG.replace(dtype="bfloat16")
    eng = Engine(cfg, weights_for(TINY_CONFIG), num_kv_blocks=64, block_size=16, device="cuda")
    out = eng.generate([EngineRequest(f"r{i}", list(range(1, 20 + i)), SamplingParams(max_tokens=8, ignore_eos=True))
                        for i in range(4)])
    assert all(len(v) == 8 for v in out.values())


def test_backend_choice():
    att = make_attention(4, 2, 64, "cuda")
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        assert type(att).__name__ == "TorchPagedAttention"
    else:
        assert type(att).__name__ == "FlashInferPagedAttention"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_flashinfer_decode_matches_the_torch_path(dtype):
    """FlashInfer's paged decode over the engine's HND cache gives the torch path's output (float32 has no FlashInfer
    kernel and takes the torch path), for sequences whose last block is partly filled and of different lengths."""
    pytest.importorskip("flashinfer")
    from kunserve.shared.engine.attention import FlashInferPagedAttention, TorchPagedAttention, build_metadata

    heads, kv_heads, dim, bs = 4, 2, 64, 16
    gen = torch.Generator(device="cuda").manual_seed(0)
    cache = torch.randn(10, 2, kv_heads, bs, dim, device="cuda", generator=gen).to(dtype)
    q = torch.randn(3, heads, dim, device="cuda", generator=gen).to(dtype)
    meta = build_metadata([2, 3, 6], [3, 4, 0], [(0, 20, [1, 2]), (1, 5, [3]), (2, 33, [4, 5, 6])], [], bs, "cuda")
    got = FlashInferPagedAttention(heads, kv_heads, dim, torch.device("cuda"))._decode(q, cache, meta)
    ref = TorchPagedAttention(heads, kv_heads, dim)._decode(q, cache, meta)
    tol = {torch.float32: 0.0, torch.bfloat16: 3e-2, torch.float16: 3e-3}[dtype]
    assert got.shape == ref.shape and float((got.float() - ref.float()).abs().max()) <= tol
