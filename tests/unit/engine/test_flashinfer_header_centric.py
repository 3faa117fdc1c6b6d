"""FlashInfer's paged decode over the header-centric KV cache (CUDA + flashinfer only; skipped elsewhere).

The engine hands FlashInfer the cache as a (K, V) pair of strided `[blocks, kv_heads, block_size, head_dim]` views
(`FlashInferPagedAttention.paged_kv`); FlashInfer reads pages through their strides. Its output must match the same
kernel over a contiguous K/V-major cache holding the same values, and the torch path's; and a rank's output after an
in-place TP2 head split must match the TP1 output of its heads."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

HEADS, KV_HEADS, DIM, BS = 8, 4, 64, 16
TOL = {torch.bfloat16: 3e-2, torch.float16: 3e-3}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flashinfer_reads_the_header_centric_cache(dtype):
    pytest.importorskip("flashinfer")
    from kunserve.shared.engine.attention import FlashInferPagedAttention, TorchPagedAttention, build_metadata
    from kunserve.shared.memory import kv_layout

    gen = torch.Generator(device="cuda").manual_seed(0)
    kv_major = torch.randn(12, 2, KV_HEADS, BS, DIM, device="cuda", generator=gen).to(dtype)
    header = kv_layout.allocate(12, KV_HEADS, BS, DIM, dtype, "cuda")
    header.copy_(kv_major)
    q = torch.randn(3, HEADS, DIM, device="cuda", generator=gen).to(dtype)
    meta = build_metadata([], [], [(0, 20, [1, 2]), (1, 5, [3]), (2, 33, [4, 5, 6])], [], BS, "cuda")
    fi = FlashInferPagedAttention(HEADS, KV_HEADS, DIM, torch.device("cuda"))
    got = fi._decode(q, header, meta)
    same = FlashInferPagedAttention(HEADS, KV_HEADS, DIM, torch.device("cuda"))._decode(q, kv_major, meta)
    ref = TorchPagedAttention(HEADS, KV_HEADS, DIM)._decode(q, header, meta)
    assert torch.equal(got, same), "FlashInfer reads the strided pair as it reads a contiguous cache"
    assert float((got.float() - ref.float()).abs().max()) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flashinfer_after_an_in_place_head_split(dtype):
    pytest.importorskip("flashinfer")
    from kunserve.shared.engine.attention import FlashInferPagedAttention, build_metadata
    from kunserve.shared.engine.kv_storage import TorchKVStorage
    from kunserve.shared.memory import kv_layout
    from kunserve.shared.memory.kv_head_split import plan_head_split

    gen = torch.Generator(device="cuda").manual_seed(1)
    members = [TorchKVStorage([0], 8, KV_HEADS, BS, DIM, dtype, "cuda") for _ in range(2)]
    tables = [[[3, 1], [6]], [[0, 2, 5], [7]]]
    lens = [[20, 9], [40, 1]]
    q = torch.randn(2, 2, HEADS, DIM, device="cuda", generator=gen).to(dtype)
    ref = []
    for m, st in enumerate(members):
        st.layer_cache(0).copy_(torch.randn(st.layer_cache(0).shape, device="cuda", generator=gen).to(dtype))
        meta = build_metadata([], [], [(i, lens[m][i], tables[m][i]) for i in range(2)], [], BS, "cuda")
        ref.append(FlashInferPagedAttention(HEADS, KV_HEADS, DIM, torch.device("cuda"))._decode(q[m], st.layer_cache(0), meta))
    plan = plan_head_split([{b for t in tables[m] for b in t} for m in range(2)], 8, KV_HEADS, 2)
    for st in members:
        st.split_kv_heads(2)
    kv_layout.exchange_sub_blocks(plan, [st.layer_cache(0) for st in members])
    for r, st in enumerate(members):
        fi = FlashInferPagedAttention(HEADS // 2, KV_HEADS // 2, DIM, torch.device("cuda"))
        for m in range(2):
            merged = [(i, lens[m][i], [plan.block_maps[m][b] for b in tables[m][i]]) for i in range(2)]
            out = fi._decode(
                q[m][:, r * HEADS // 2 : (r + 1) * HEADS // 2].contiguous(),
                st.layer_cache(0),
                build_metadata([], [], merged, [], BS, "cuda"),
            )
            expect = ref[m][:, r * HEADS // 2 : (r + 1) * HEADS // 2]
            assert float((out.float() - expect.float()).abs().max()) <= TOL[dtype]
