"""Attention over the header-centric KV cache, and across an in-place TP1 -> TP2 / TP4 head split.

- The kernels read the cache through its strides: decode attention and the fused RoPE + KV store give bit-identical
  results over a K/V-major contiguous cache and over the header-centric one (the pool's and TorchKVStorage's).
- Kernel-level oracle of "running requests keep their KV (no recompute)": `degree` TP1 members each hold several
  sequences' KV (random, partly filled last blocks); they split in place and run the phased exchange
  (kv_head_split.py, kv_layout.exchange_sub_blocks); then every rank attends with the merged block tables and its
  own heads' queries, and its output equals the TP1 output of those heads bit for bit (float32), on the compiled
  CPU kernel and on the torch path, over TorchKVStorage and over the memory pool.
"""

from __future__ import annotations

import random

import pytest
import torch

from kunserve.shared.engine import cpu_kernels
from kunserve.shared.engine.attention import TorchPagedAttention, build_metadata
from kunserve.shared.engine.kv_storage import TorchKVStorage
from kunserve.shared.memory import kv_layout
from kunserve.shared.memory.kv_head_split import merged_block_id, plan_head_split
from kunserve.shared.memory.testing import make_layout

needs_kernel = pytest.mark.skipif(not cpu_kernels.available(), reason=f"compiled kernel unavailable: {cpu_kernels.unavailable_reason()}")

HEADS, KV_HEADS, DIM, BS = 8, 4, 32, 4


@needs_kernel
def test_decode_kernel_reads_either_physical_order_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    kv_major = torch.randn(9, 2, KV_HEADS, BS, DIM, generator=g)
    header = kv_layout.allocate(9, KV_HEADS, BS, DIM, torch.float32)
    header.copy_(kv_major)
    assert kv_major.is_contiguous() and not header.is_contiguous()
    q = torch.randn(3, HEADS, DIM, generator=g)
    tables = torch.tensor([[4, 1, 7, 0], [2, 0, 0, 0], [8, 3, 5, 6]])
    lens = torch.tensor([11, 3, 16])
    for cache in (kv_major, header):
        assert cpu_kernels.decode_attention_supported(q, cache)
    a = cpu_kernels.decode_attention(q, kv_major, tables, lens, DIM**-0.5)
    b = cpu_kernels.decode_attention(q, header, tables, lens, DIM**-0.5)
    assert torch.equal(a, b)


@needs_kernel
def test_rope_store_writes_either_physical_order_alike():
    g = torch.Generator().manual_seed(1)
    T, max_pos = 5, 64
    qkv = torch.randn(T, (HEADS + 2 * KV_HEADS) * DIM, generator=g)
    cos, sin = torch.randn(max_pos, DIM, generator=g), torch.randn(max_pos, DIM, generator=g)
    positions, blocks, offsets = torch.tensor([0, 7, 9, 30, 63]), torch.tensor([1, 4, 4, 0, 2]), torch.tensor([0, 3, 1, 2, 3])
    kv_major = torch.zeros(5, 2, KV_HEADS, BS, DIM)
    header = kv_layout.allocate(5, KV_HEADS, BS, DIM, torch.float32)
    out = []
    for cache in (kv_major, header):
        x = qkv.clone()
        cpu_kernels.rope_store(x, HEADS, KV_HEADS, DIM, cos, sin, positions, cache, blocks, offsets)
        out.append(x)
    assert torch.equal(out[0], out[1]) and torch.equal(kv_major, header)
    k = out[0][:, HEADS * DIM : (HEADS + KV_HEADS) * DIM].view(T, KV_HEADS, DIM)
    v = out[0][:, (HEADS + KV_HEADS) * DIM :].view(T, KV_HEADS, DIM)
    assert torch.equal(header[blocks, 0, :, offsets], k) and torch.equal(header[blocks, 1, :, offsets], v)


def _torch_path(monkeypatch) -> None:
    monkeypatch.setattr(cpu_kernels, "decode_attention_supported", lambda q, cache: False)


def _members(kind: str, degree: int) -> tuple[list, int]:
    if kind == "torch":
        return [TorchKVStorage([0], 10, KV_HEADS, BS, DIM) for _ in range(degree)], 10
    lays = [make_layout(num_layers=1, num_kv_heads=KV_HEADS, head_dim=DIM, block_size=BS, num_pages=24) for _ in range(degree)]
    return lays, lays[0].num_blocks


def _split(member, degree: int, plan) -> None:
    if isinstance(member, TorchKVStorage):
        member.split_kv_heads(degree)
    else:
        member.split_kv_heads(degree, plan)


@pytest.mark.parametrize("path", ["kernel", "torch"])
@pytest.mark.parametrize("kind", ["torch", "pool"])
@pytest.mark.parametrize("degree", [2, 4])
def test_running_sequences_keep_their_kv_through_a_head_split(monkeypatch, path, kind, degree):
    if path == "kernel" and not cpu_kernels.available():
        pytest.skip(f"compiled kernel unavailable: {cpu_kernels.unavailable_reason()}")
    if path == "torch":
        _torch_path(monkeypatch)
    rng = random.Random(degree * 7 + len(kind) + len(path))
    gen = torch.Generator().manual_seed(rng.randint(0, 1 << 30))
    members, nb = _members(kind, degree)
    seqs = []  # (member, context_len, block table) per sequence
    for m, st in enumerate(members):
        cache = st.layer_cache(0)
        cache.copy_(torch.randn(cache.shape, generator=gen))  # unused slots hold garbage too
        del cache
        free = list(range(nb))
        rng.shuffle(free)
        for _ in range(3):
            ctx = rng.randint(1, 3 * BS)
            n = -(-ctx // BS)
            seqs.append((m, ctx, [free.pop() for _ in range(n)]))
    q = torch.randn(len(seqs), HEADS, DIM, generator=gen)
    tp1 = TorchPagedAttention(HEADS, KV_HEADS, DIM)
    ref = {}
    for m, st in enumerate(members):
        rows = [i for i, s in enumerate(seqs) if s[0] == m]
        meta = build_metadata([], [], [(j, seqs[i][1], seqs[i][2]) for j, i in enumerate(rows)], [], BS)
        out = tp1._decode(q[rows], st.layer_cache(0), meta)
        for j, i in enumerate(rows):
            ref[i] = out[j]

    used = [{b for s in seqs if s[0] == m for b in s[2]} for m in range(degree)]
    plan = plan_head_split(used, nb, KV_HEADS, max_phase_subblocks=2)
    pages = [st.kv_pages_per_layer for st in members] if kind == "pool" else None
    for st in members:
        _split(st, degree, plan)
    caches = [st.layer_cache(0) for st in members]
    staged = kv_layout.exchange_sub_blocks(plan, caches)
    assert staged <= 2 * kv_layout.physical_view(caches[0])[0].numel() * 4
    del caches
    if pages is not None:
        assert [st.kv_pages_per_layer for st in members] == pages

    hq, hkv = HEADS // degree, KV_HEADS // degree
    tp = TorchPagedAttention(hq, hkv, DIM)
    for r, st in enumerate(members):
        qr = q[:, r * hq : (r + 1) * hq]
        for m in range(degree):  # one batch per former member: the same shapes as its TP1 batch
            rows = [i for i, s in enumerate(seqs) if s[0] == m]
            decodes = [(j, seqs[i][1], [plan.block_maps[m][b] for b in seqs[i][2]]) for j, i in enumerate(rows)]
            assert all(t == [merged_block_id(m, b, degree) for b in seqs[i][2]] for (_, _, t), i in zip(decodes, rows))
            out = tp._decode(qr[rows].contiguous(), st.layer_cache(0), build_metadata([], [], decodes, [], BS))
            for j, i in enumerate(rows):
                assert torch.equal(out[j], ref[i][r * hq : (r + 1) * hq]), f"rank {r}, sequence {i} of member {m}"
        if path == "kernel":  # the compiled kernel is batch-invariant: the merged batch of every sequence at once
            decodes = [(i, s[1], [plan.block_maps[s[0]][b] for b in s[2]]) for i, s in enumerate(seqs)]
            out = tp._decode(qr.contiguous(), st.layer_cache(0), build_metadata([], [], decodes, [], BS))
            for i in range(len(seqs)):
                assert torch.equal(out[i], ref[i][r * hq : (r + 1) * hq])


def test_an_engine_refuses_to_follow_a_split_storage_and_the_kernels_refuse_a_head_mismatch():
    """A split storage's block ids name sub-blocks of fewer heads: an engine built for the whole model must not grow its
    allocator over them, and the kernels must not read or write a cache whose head count is not the caller's."""
    from engine_testing import weights_for

    from kunserve.shared.engine.api import EngineRequest, SamplingParams
    from kunserve.shared.engine.engine import Engine
    from kunserve.shared.model.architecture import TINY_CONFIG

    eng = Engine(TINY_CONFIG, weights_for(TINY_CONFIG), num_kv_blocks=16, block_size=8)
    eng.generate([EngineRequest("r", list(range(1, 12)), SamplingParams(max_tokens=2, ignore_eos=True))])
    with pytest.raises(ValueError, match="a head split needs a degree >= 2"):
        eng.kv.split_kv_heads(1)
    eng.kv.split_kv_heads(2)
    with pytest.raises(ValueError, match="KV storage blocks hold 1 KV heads"):
        eng.sync_kv_capacity()
    assert eng.allocator.num_blocks == 16
    if not cpu_kernels.fused_layer_ops_supported(torch.float32, torch.device("cpu"), 64):
        pytest.skip("the compiled CPU kernels are not available here")
    cache = eng.kv.layer_cache(0)  # [32, 2, 1, 8, 64]: one KV head per sub-block
    q = torch.randn(1, TINY_CONFIG.num_heads, 64)
    with pytest.raises(ValueError, match="decode attention"):
        cpu_kernels.decode_attention(q, cache[:, :, :, :, :32], torch.zeros(1, 1, dtype=torch.long),
                                     torch.ones(1, dtype=torch.long), 1.0)
    qkv = torch.randn(1, (TINY_CONFIG.num_heads + 2 * TINY_CONFIG.num_kv_heads) * 64)
    cos = torch.ones(8, 64)
    with pytest.raises(ValueError, match="rope_store"):
        cpu_kernels.rope_store(qkv, TINY_CONFIG.num_heads, TINY_CONFIG.num_kv_heads, 64, cos, cos,
                               torch.zeros(1, dtype=torch.long), cache, torch.zeros(1, dtype=torch.long),
                               torch.zeros(1, dtype=torch.long))
