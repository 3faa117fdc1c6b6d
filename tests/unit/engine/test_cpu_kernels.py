"""The CPU panel GEMM (shared/engine/cpu_kernels.py): layout round trip, products equal to torch's linear, and
a row's result independent of the batch it runs in (the greedy oracle's batching invariance)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kunserve.shared.engine import cpu_kernels
from kunserve.shared.engine.cpu_kernels import PANEL, from_panels, linear, linear_torch, panels_shape, to_panels

SHAPES = [(1536, 1024), (100, 70), (64, 1), (130, 300), (8, 513)]


@pytest.mark.parametrize("n,k", SHAPES)
def test_panels_round_trip_and_zero_padding(n, k):
    w = torch.randn(n, k)
    p = to_panels(w)
    assert p.shape == panels_shape(n, k) == (-(-n // PANEL), k, PANEL)
    assert torch.equal(from_panels(p, n), w)
    pad = p.transpose(1, 2).reshape(-1, k)[n:]
    assert pad.numel() == 0 or not pad.any()


@pytest.mark.parametrize("n,k", SHAPES)
def test_linear_equals_torch_linear(n, k):
    g = torch.Generator().manual_seed(n * 1000 + k)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    p = to_panels(w)
    for m in (0, 1, 5, 6, 7, 13, 64):
        x = torch.randn(m, k, generator=g)
        ref = F.linear(x, w, b)
        for fn in (linear, linear_torch):
            y = fn(x, p, n, b)
            assert y.shape == (m, n) and y.dtype == torch.float32
            torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(linear(x, p, n), F.linear(x, w), atol=1e-4, rtol=1e-4)


def test_strided_rows_are_read_in_place():
    w = torch.randn(96, 40)
    x = torch.randn(9, 80)[:, 20:60]  # rows with a stride of 80
    torch.testing.assert_close(linear(x, to_panels(w), 96), F.linear(x, w), atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not cpu_kernels.available(), reason=f"compiled kernel unavailable: {cpu_kernels.unavailable_reason()}")
def test_a_row_does_not_depend_on_its_batch_or_the_thread_count():
    """Bit for bit: each output is summed over K in one fixed order whatever M and the thread count are."""
    w = torch.randn(320, 700)
    p = to_panels(w)
    x = torch.randn(23, 700)
    full = linear(x, p, 320)
    for i in (0, 5, 6, 22):
        assert torch.equal(linear(x[i:i + 1], p, 320), full[i:i + 1])
    assert torch.equal(linear(x[4:17], p, 320), full[4:17])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(linear(x, p, 320), full)
    finally:
        torch.set_num_threads(threads)


def test_bad_panels_are_refused():
    with pytest.raises(ValueError, match="panels"):
        linear(torch.randn(2, 8), torch.randn(1, 7, PANEL), 64)
    with pytest.raises(ValueError, match="panels"):
        linear(torch.randn(2, 8), torch.randn(1, 8, PANEL), 65)


def _reference_decode(q, cache, tables, lens, scale):
    """Dense float64 softmax attention per sequence over its gathered K/V (GQA: query head i reads KV head i // G)."""
    B, H, D = q.shape
    kvh, bs = cache.shape[2], cache.shape[3]
    out = torch.empty(B, H, D, dtype=torch.float64)
    for b in range(B):
        n = int(lens[b])
        blocks = tables[b, : -(-n // bs)]
        k = cache[blocks, 0].permute(1, 0, 2, 3).reshape(kvh, -1, D)[:, :n].double()
        v = cache[blocks, 1].permute(1, 0, 2, 3).reshape(kvh, -1, D)[:, :n].double()
        for i in range(H):
            h = i // (H // kvh)
            p = torch.softmax(k[h] @ q[b, i].double() * scale, dim=0)
            out[b, i] = p @ v[h]
    return out


@pytest.mark.skipif(not cpu_kernels.available(), reason=f"compiled kernel unavailable: {cpu_kernels.unavailable_reason()}")
@pytest.mark.parametrize("heads,kv_heads,dim,block", [(16, 4, 64, 16), (4, 2, 64, 16), (8, 8, 128, 16), (14, 2, 64, 8)])
def test_decode_attention_reads_the_paged_cache_in_place(heads, kv_heads, dim, block):
    g = torch.Generator().manual_seed(heads * 100 + dim)
    cache = torch.randn(120, 2, kv_heads, block, dim, generator=g)
    lens = [1, 5, block, block + 1, 100, 130, 33]
    perm = torch.randperm(120, generator=g).tolist()
    width = max(-(-n // block) for n in lens)
    tables, at = [], 0
    for n in lens:
        nb = -(-n // block)
        tables.append(perm[at:at + nb] + [0] * (width - nb))
        at += nb
    tables_t = torch.tensor(tables, dtype=torch.long)
    lens_t = torch.tensor(lens, dtype=torch.long)
    q = (torch.randn(len(lens), heads + 2 * kv_heads, dim, generator=g) * 3)[:, :heads]  # strided rows, as the model's
    assert cpu_kernels.decode_attention_supported(q, cache)
    scale = dim ** -0.5
    out = cpu_kernels.decode_attention(q, cache, tables_t, lens_t, scale)
    torch.testing.assert_close(out.double(), _reference_decode(q, cache, tables_t, lens_t, scale), atol=2e-5, rtol=1e-5)
    # one sequence alone gets the same bits as in the batch
    assert torch.equal(cpu_kernels.decode_attention(q[4:5], cache, tables_t[4:5], lens_t[4:5], scale), out[4:5])


def test_decode_attention_is_not_claimed_for_other_dtypes_or_head_sizes():
    cache = torch.zeros(4, 2, 2, 16, 64)
    assert not cpu_kernels.decode_attention_supported(torch.zeros(2, 4, 64, dtype=torch.bfloat16), cache)
    assert not cpu_kernels.decode_attention_supported(torch.zeros(2, 4, 40), torch.zeros(4, 2, 2, 16, 40))


def test_paged_attention_decodes_alike_with_and_without_the_kernel(monkeypatch):
    """TorchPagedAttention's batched torch path (other devices and dtypes) and the kernel path agree."""
    from kunserve.shared.engine.attention import TorchPagedAttention, build_metadata

    g = torch.Generator().manual_seed(7)
    heads, kv_heads, dim, block = 8, 2, 64, 16
    cache = torch.randn(64, 2, kv_heads, block, dim, generator=g)
    decodes = [(0, 37, [5, 9, 11]), (1, 16, [2]), (2, 70, [20, 21, 22, 23, 24])]
    meta = build_metadata([0, 0, 0], [0, 0, 0], decodes, [], block)
    q = torch.randn(3, heads, dim, generator=g)
    att = TorchPagedAttention(heads, kv_heads, dim)
    fast = att._decode(q, cache, meta)
    monkeypatch.setattr(cpu_kernels, "decode_attention_supported", lambda q, cache: False)
    torch.testing.assert_close(att._decode(q, cache, meta), fast, atol=1e-5, rtol=1e-5)


needs_kernels = pytest.mark.skipif(not cpu_kernels.available(),
                                   reason=f"compiled kernel unavailable: {cpu_kernels.unavailable_reason()}")


@needs_kernels
def test_silu_mul_equals_torch():
    gu = torch.randn(7, 2 * 45) * 4  # a width that is not a multiple of 16
    ref = F.silu(gu[:, :45]) * gu[:, 45:]
    torch.testing.assert_close(cpu_kernels.silu_mul(gu), ref, atol=1e-6, rtol=1e-5)
    wide = torch.randn(3, 200)[:, :2 * 45]  # strided rows
    torch.testing.assert_close(cpu_kernels.silu_mul(wide), F.silu(wide[:, :45]) * wide[:, 45:], atol=1e-6, rtol=1e-5)


@needs_kernels
def test_rope_store_rotates_in_place_and_fills_the_slots():
    from kunserve.shared.model import rope
    from kunserve.shared.model.rope import RopeParameters

    heads, kv_heads, dim, bs, T = 4, 2, 64, 16, 5
    cos, sin = rope.cos_sin(RopeParameters(), dim, 256, torch.arange(256))
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    qkv = torch.randn(T, (heads + 2 * kv_heads) * dim)
    before = qkv.clone()
    positions = torch.tensor([0, 1, 17, 100, 255])
    blocks, offsets = torch.tensor([3, 3, 0, 7, 1]), torch.tensor([0, 1, 15, 4, 9])
    cache = torch.zeros(8, 2, kv_heads, bs, dim)
    cpu_kernels.rope_store(qkv, heads, kv_heads, dim, cos, sin, positions, cache, blocks, offsets)
    qk = before[:, : (heads + kv_heads) * dim].view(T, heads + kv_heads, dim)
    ref = rope.rotate(qk, cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
    torch.testing.assert_close(qkv[:, : (heads + kv_heads) * dim].view(T, -1, dim), ref, atol=1e-6, rtol=1e-6)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim:], before[:, (heads + kv_heads) * dim:])  # v untouched
    for t in range(T):
        assert torch.equal(cache[blocks[t], 0, :, offsets[t]], ref[t, heads:])
        assert torch.equal(cache[blocks[t], 1, :, offsets[t]], before[t, (heads + kv_heads) * dim:].view(kv_heads, dim))


@needs_kernels
def test_add_rms_norm_equals_torch():
    x, d, w = torch.randn(6, 100), torch.randn(6, 100), torch.randn(100)
    summed = x + d
    h = cpu_kernels.add_rms_norm(x, d, w, 1e-6)
    assert torch.equal(x, summed)  # the residual is added in place
    torch.testing.assert_close(h, F.rms_norm(summed, (100,), w, 1e-6), atol=1e-5, rtol=1e-5)


@needs_kernels
def test_slots_and_blocks_outside_the_cache_are_refused_not_written():
    """The kernels check every index before touching memory (torch's indexing would raise; so do they)."""
    cache = torch.zeros(4, 2, 2, 16, 64)
    qkv = torch.randn(2, 8 * 64)
    cos = sin = torch.ones(32, 64)
    good = torch.tensor([1, 2])
    with pytest.raises(IndexError, match="slot"):
        cpu_kernels.rope_store(qkv, 4, 2, 64, cos, sin, good, cache, torch.tensor([0, 4]), torch.tensor([0, 1]))
    with pytest.raises(IndexError, match="position"):
        cpu_kernels.rope_store(qkv, 4, 2, 64, cos, sin, torch.tensor([0, 32]), cache, good, good)
    assert not cache.any()
    q = torch.randn(1, 4, 64)
    with pytest.raises(IndexError, match="block"):
        cpu_kernels.decode_attention(q, cache, torch.tensor([[0, 9]]), torch.tensor([20]), 0.125)
    with pytest.raises(IndexError, match="context"):
        cpu_kernels.decode_attention(q, cache, torch.tensor([[0, 1]]), torch.tensor([33]), 0.125)
