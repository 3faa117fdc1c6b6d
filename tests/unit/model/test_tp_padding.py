"""Page-aligned MLP shards (Gyges §4.2): the padded FFN equals the unpadded one, shards start on pages."""

from __future__ import annotations

import pytest
import torch

from kunserve.shared.model.tp_padding import FFNShardLayout, sharded_swiglu

PAGE = 64 << 10


def reference_mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """Hugging Face's LlamaMLP: down_proj(silu(gate_proj(x)) * up_proj(x)), down as [hidden, intermediate]."""
    return torch.nn.functional.linear(
        torch.nn.functional.silu(torch.nn.functional.linear(x, gate)) * torch.nn.functional.linear(x, up), down
    )


@pytest.mark.parametrize("hidden,inter", [(96, 344), (128, 512), (256, 688)])
def test_padded_ffn_equals_the_unpadded_one_at_every_degree(hidden: int, inter: int) -> None:
    torch.manual_seed(0)
    # float64 so the comparison is about the layout, not about float32 summation order.
    f64 = torch.float64
    lay = FFNShardLayout(intermediate=inter, hidden=hidden, itemsize=8, page_bytes=PAGE)
    gate, up = torch.randn(inter, hidden, dtype=f64), torch.randn(inter, hidden, dtype=f64)
    down = torch.randn(hidden, inter, dtype=f64)
    bufs = []
    for m in (gate, up, down.t().contiguous()):
        b = torch.full((lay.total_bytes // 8,), float("nan"), dtype=f64)  # stale bytes in the gaps must not leak in
        lay.pack(m, b)
        bufs.append(b)
    x = torch.randn(5, hidden, dtype=f64)
    want = reference_mlp(x, gate, up, down)
    whole = sharded_swiglu(x, *(lay.view(b) for b in bufs))
    torch.testing.assert_close(whole, want, rtol=1e-12, atol=1e-9)
    for degree in (1, 2, 4):
        partials = []
        for rank in range(degree):
            shards = lay.shards_of(rank, degree)
            pages = lay.pages_of(rank, degree)
            # A member's shards start on a page boundary and are whole pages of the buffer.
            own = [b[pages.start * PAGE // 8 : pages.stop * PAGE // 8] for b in bufs]
            partials.append(sharded_swiglu(x, *(lay.view(b, shards) for b in own)))
        torch.testing.assert_close(torch.stack(partials).sum(0), want, rtol=1e-12, atol=1e-9)


def test_shard_pages_partition_the_buffer() -> None:
    lay = FFNShardLayout(intermediate=27648, hidden=5120, itemsize=2, page_bytes=2 << 20)
    for degree in (1, 2, 4):
        seen: list[int] = []
        for rank in range(degree):
            seen.extend(lay.pages_of(rank, degree))
        assert seen == list(range(lay.pages))
    # Qwen2.5-32B, bf16, 2 MiB pages: 33.75 pages per quarter; the gaps cost a quarter page each (< 0.7%).
    assert lay.shard_bytes / (2 << 20) == 33.75
    assert lay.padding_bytes == 4 * (2 << 20) // 4
    assert lay.padding_bytes / (lay.shard_bytes * 4) < 0.0075


def test_aligned_shapes_need_no_padding_and_bad_shapes_are_refused() -> None:
    llama70b = FFNShardLayout(intermediate=28672, hidden=8192, itemsize=2, page_bytes=2 << 20)
    assert llama70b.padding_bytes == 0 and llama70b.pages == 224
    with pytest.raises(ValueError, match="does not split into 4 shards"):
        FFNShardLayout(intermediate=30, hidden=8, itemsize=4, page_bytes=PAGE)
    lay = FFNShardLayout(intermediate=32, hidden=8, itemsize=4, page_bytes=PAGE)
    with pytest.raises(ValueError, match="TP degree 3"):
        lay.shards_of(0, 3)
    with pytest.raises(ValueError, match="rank 2 is outside TP2"):
        lay.pages_of(2, 2)
    with pytest.raises(ValueError, match="expected"):
        lay.pack(torch.zeros(8, 32), torch.zeros(lay.total_bytes // 4))
    with pytest.raises(ValueError, match="cannot hold"):
        lay.view(torch.zeros(10))
