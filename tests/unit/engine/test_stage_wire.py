"""One microbatch on the wire between pipeline stages (shared/engine/stage_wire.py): encode/decode is an
exact round trip (every field, the hidden states bit for bit in float32 and bfloat16), a later stage builds
exactly the attention metadata the head built, a group whose stages exchange wire messages computes the
whole instance's tokens, and malformed input is refused."""

from __future__ import annotations

import random

import pytest
import torch
from engine_testing import one_torch_thread, weights_for  # noqa: F401 - fixture

from kunserve.shared.engine import stage_wire
from kunserve.shared.engine.api import EngineRequest, SamplingParams
from kunserve.shared.engine.attention import AttentionMetadata
from kunserve.shared.engine.engine import Engine, SchedulerConfig
from kunserve.shared.engine.local_link import local_group
from kunserve.shared.engine.stage_wire import StageBatch
from kunserve.shared.model.architecture import TINY_CONFIG

SMALL = TINY_CONFIG.replace(num_layers=2, name="small")

MIXED = StageBatch(  # two decodes, then a prefill chunk with a prefix and a fresh one; logits for some rows
    mb_id=7, positions=[20, 3, 16, 17, 18, 0, 1], slot_blocks=[5, 0, 2, 2, 2, 9, 9],
    slot_offsets=[4, 3, 0, 1, 2, 0, 1],
    decodes=[(0, 21, [1, 3, 4, 6, 5]), (1, 4, [0])],
    prefills=[(2, 3, 19, [7, 8, 2]), (5, 2, 2, [9])],
    rows=[0, 1, 6])
ALL_ROWS = StageBatch(mb_id=2**40 + 3, positions=[9, 12], slot_blocks=[2, 3], slot_offsets=[1, 0],
                      decodes=[(0, 10, [1, 2]), (1, 13, [0, 3])], prefills=[], rows=None)
NO_ROWS = StageBatch(mb_id=1, positions=list(range(8, 13)), slot_blocks=[1] * 5, slot_offsets=list(range(0, 5)),
                     decodes=[], prefills=[(0, 5, 13, [0, 1])], rows=[])


def special_hidden(T: int, H: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, H, generator=g).to(dtype)
    flat = h.view(-1)
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-40, 3.0e38]).to(dtype)
    flat[: min(len(specials), flat.numel())] = specials[: flat.numel()]
    return h


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def assert_same_metadata(a: AttentionMetadata, b: AttentionMetadata) -> None:
    def same(x, y):
        if x is None or y is None:
            assert x is None and y is None
        else:
            assert x.dtype == y.dtype and torch.equal(x, y)

    assert a.block_size == b.block_size
    same(a.slot_blocks, b.slot_blocks)
    same(a.slot_offsets, b.slot_offsets)
    same(a.decode_rows, b.decode_rows)
    assert a.decode_rows_contiguous == b.decode_rows_contiguous
    same(a.decode_block_tables, b.decode_block_tables)
    same(a.decode_context_lens, b.decode_context_lens)
    same(a.decode_mask, b.decode_mask)
    assert len(a.prefills) == len(b.prefills)
    for p, q in zip(a.prefills, b.prefills):
        assert (p.row_start, p.num_tokens, p.context_len) == (q.row_start, q.num_tokens, q.context_len)
        same(p.block_ids, q.block_ids)
        same(p.mask, q.mask)


@pytest.mark.parametrize("batch", [MIXED, ALL_ROWS, NO_ROWS], ids=["mixed", "rows-none", "rows-empty"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip(batch, dtype):
    hidden = special_hidden(len(batch.positions), 24, dtype, seed=len(batch.positions))
    data = stage_wire.encode(batch, hidden)
    assert data.dtype == torch.uint8 and data.dim() == 1
    got, h = stage_wire.decode(data, dtype)
    assert got == batch  # every field, rows None vs a list included
    assert (got.rows is None) == (batch.rows is None)
    assert same_bits(h, hidden)
    assert_same_metadata(got.metadata(16, torch.device("cpu")), batch.metadata(16, torch.device("cpu")))
    assert torch.equal(got.positions_tensor(torch.device("cpu")), torch.tensor(batch.positions))
    rt = got.rows_tensor(torch.device("cpu"))
    assert (rt is None) if batch.rows is None else torch.equal(rt, torch.tensor(batch.rows, dtype=torch.int64))


def test_encode_of_a_non_contiguous_view_and_an_empty_hidden_dim():
    hidden = torch.randn(24, 7).t()  # non-contiguous [7, 24]
    assert not hidden.is_contiguous()
    got, h = stage_wire.decode(stage_wire.encode(MIXED, hidden), torch.float32)
    assert got == MIXED and same_bits(h, hidden.contiguous())
    got, h = stage_wire.decode(stage_wire.encode(MIXED, torch.empty(7, 0)), torch.float32)
    assert got == MIXED and h.shape == (7, 0)


HEAD_SCHED = SchedulerConfig(max_num_batched_tokens=24, max_prefill_chunk=11)


def staggered(eng: Engine) -> dict[str, list[int]]:
    """Staggered requests (one added per step), then step to the end: chunked prefill, decodes, preemption."""
    out: dict[str, list[int]] = {}
    rng = random.Random(3)
    for i in range(6):
        eng.add_request(EngineRequest(f"r{i}", [rng.randrange(SMALL.vocab_size) for _ in range(rng.randint(1, 30))],
                                      SamplingParams(max_tokens=rng.randint(1, 12), ignore_eos=True)))
        out[f"r{i}"] = []
        for ev in eng.step():
            out[ev.request_id].append(ev.token_id)
    while eng.has_work():
        for ev in eng.step():
            out[ev.request_id].append(ev.token_id)
    return out


def head_batches() -> list[tuple[StageBatch, int]]:
    """The microbatches a head really builds: staggered requests, chunked prefill, decodes, preemption."""
    cfg = SMALL
    eng = Engine(cfg, weights_for(cfg), num_kv_blocks=24, block_size=4, scheduler_config=HEAD_SCHED)
    out: list[tuple[StageBatch, int]] = []
    orig = eng._build

    def build(chunks):
        batch, ids, sampled = orig(chunks)
        out.append((batch, len(ids)))
        return batch, ids, sampled

    eng._build = build
    staggered(eng)
    return out


def test_metadata_from_the_wire_equals_the_heads():
    batches = head_batches()
    kinds = {("d" if b.decodes else "") + ("p" if b.prefills else "") + ("*" if b.rows is None else "")
             for b, _ in batches}
    assert {"d*", "dp", "p"} <= kinds, kinds  # pure decode (all rows), mixed, prefill only
    for i, (batch, T) in enumerate(batches):
        assert T == len(batch.positions)
        hidden = special_hidden(T, SMALL.hidden_size, torch.float32, seed=i)
        got, h = stage_wire.decode(stage_wire.encode(batch, hidden), torch.float32)
        assert got == batch and same_bits(h, hidden)
        cpu = torch.device("cpu")
        assert_same_metadata(got.metadata(4, cpu), batch.metadata(4, cpu))


def test_a_group_whose_stages_exchange_wire_messages_computes_the_whole_instances_tokens():
    w = weights_for(SMALL)
    want = staggered(Engine(SMALL, w, num_kv_blocks=24, block_size=4, scheduler_config=HEAD_SCHED))
    head, link = local_group(SMALL, w, [(0, 1), (1, 2)], num_kv_blocks=24, block_size=4,
                             scheduler_config=HEAD_SCHED, wire=True)
    with link:
        assert staggered(head) == want
    assert head.scheduler.num_preemptions > 0


# -- malformed input ---------------------------------------------------------------------------------------

def test_encode_refuses_hidden_states_that_do_not_match():
    with pytest.raises(ValueError, match="7 tokens"):
        stage_wire.encode(MIXED, torch.zeros(6, 4))
    with pytest.raises(ValueError):
        stage_wire.encode(MIXED, torch.zeros(7 * 4))
    with pytest.raises(ValueError):
        stage_wire.encode(MIXED, torch.zeros(1, 7, 4))


def test_decode_refuses_what_is_not_a_flat_byte_tensor():
    data = stage_wire.encode(MIXED, torch.zeros(7, 4))
    with pytest.raises(ValueError, match="uint8"):
        stage_wire.decode(data.to(torch.int8), torch.float32)
    with pytest.raises(ValueError, match="uint8"):
        stage_wire.decode(data.float(), torch.float32)
    with pytest.raises(ValueError, match="uint8"):
        stage_wire.decode(data.view(1, -1), torch.float32)
    for n in (0, 1, 7):
        with pytest.raises(ValueError):
            stage_wire.decode(data[:n].clone(), torch.float32)
    with pytest.raises(ValueError):  # just the word count, no metadata words
        stage_wire.decode(data[:8].clone(), torch.float32)


def _set_word(data: torch.Tensor, index: int, value: int) -> torch.Tensor:
    """Overwrite int64 word `index` of the message (0 = the metadata word count)."""
    out = data.clone()
    out[8 * index:8 * index + 8].view(torch.int64)[0] = value
    return out


_DATA = stage_wire.encode(MIXED, torch.zeros(7, 4))
_EXTRA = torch.cat([_DATA, torch.zeros(4, dtype=torch.uint8)])


@pytest.mark.parametrize("data", [_DATA[:-1], _DATA[:-4], _EXTRA, _DATA[:20], _set_word(_DATA, 0, 10**6)],
                         ids=["payload-cut-mid-element", "payload-short", "payload-padded", "header-cut",
                              "word-count-too-large"])
def test_decode_refuses_a_message_of_the_wrong_size(data):
    with pytest.raises(ValueError):
        stage_wire.decode(data, torch.float32)


@pytest.mark.parametrize("data", [_set_word(_DATA, 2, -1), _set_word(_DATA, 6, 100)], ids=["T=-1", "n_rows=100"])
def test_decode_refuses_inconsistent_metadata(data):
    with pytest.raises(ValueError):
        stage_wire.decode(data, torch.float32)

