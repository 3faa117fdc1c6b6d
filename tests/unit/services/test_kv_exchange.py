"""The KV exchange's packing: messages copied out into staged memory, sliced for landing between iterations."""

from __future__ import annotations

import pytest
import torch
from engine_testing import one_torch_thread, weights_for  # noqa: F401 - fixture

from kunserve.services.worker.kv_exchange import ExportStaging, StagingReserve, export_flow, import_flow, landing_slices
from kunserve.shared.engine.engine import Engine
from kunserve.shared.model.architecture import TINY_CONFIG
from kunserve.shared.policy.transition_plan import Flow, FlowPart


def _filled_engine() -> Engine:
    engine = Engine(TINY_CONFIG, weights_for(TINY_CONFIG), num_kv_blocks=8, block_size=8)
    for layer in range(engine.runner.start, engine.runner.end):
        cache = engine.kv.layer_cache(layer)
        cache.copy_(torch.randn(cache.shape, dtype=cache.dtype))
    return engine


def _flow() -> Flow:
    return Flow("a", "b", [FlowPart("r1", 0, 2, (3, 1), (5, 6)), FlowPart("r2", 1, 2, (0,), (2,))])


def test_export_into_staging_equals_a_fresh_export_and_falls_back_when_full():
    engine = _filled_engine()
    flow = _flow()
    fresh = export_flow(engine, flow)
    slab, dtype = engine.kv_slab()
    row = torch.empty(slab, dtype=dtype).numel() * torch.empty((), dtype=dtype).element_size()
    staging = ExportStaging(flow.num_block_layers() * row)
    staged = export_flow(engine, flow, staging)
    assert torch.equal(staged, fresh)
    assert staged.untyped_storage().data_ptr() == staging.buf.untyped_storage().data_ptr()  # in the staged pages
    again = export_flow(engine, flow, staging)  # no room left: a fresh allocation, same bytes
    assert torch.equal(again, fresh) and again.untyped_storage().data_ptr() != staging.buf.untyped_storage().data_ptr()


def test_landing_slices_cover_the_message_in_order_and_import_the_same_bytes():
    engine = _filled_engine()
    flow = _flow()
    data = export_flow(engine, flow)
    row = data[0].numel() * data.element_size()
    one_part_each = list(landing_slices(flow, data, max_bytes=1))
    assert [[p.request_id for p, _ in g] for g in one_part_each] == [["r1"], ["r2"]]
    together = list(landing_slices(flow, data, max_bytes=10 * row))
    assert [[p.request_id for p, _ in g] for g in together] == [["r1", "r2"]]
    assert torch.equal(torch.cat([d for g in together for _, d in g]), data)

    other = _filled_engine()
    import_flow(other, flow, data)
    for p in flow.parts:
        assert torch.equal(other.export_blocks(p.new_blocks, p.layer_start, p.layer_end),
                           engine.export_blocks(p.old_blocks, p.layer_start, p.layer_end))
    with pytest.raises(ValueError, match="expected"):
        list(landing_slices(flow, data[:-1], max_bytes=row))


def test_staging_reserve_grows_by_quarters_lends_only_what_fits_and_never_grows_while_lent():
    assert [StagingReserve.target(n, 1000) for n in (0, 1, 250, 251, 999, 1000)] == [0, 250, 250, 500, 1000, 1000]
    assert StagingReserve.target(1200, 1000) == 1200  # more than the bound (requests grew): what is needed
    r = StagingReserve()
    assert r.wants(300, 1000) == 500 and r.lend(10) is None and r.lent
    assert r.wants(300, 1000) == 0, "a transition holds a buffer"
    r.lost()
    r.stock(r.allocate(500))
    assert r.wants(300, 1000) == 0 and r.wants(600, 1000) == 750
    s = r.lend(400)
    assert s is not None and r.idle is None and s.take((100,), torch.uint8) is not None
    r.give_back(s)
    again = r.lend(500)
    assert again is s and again.used == 0, "lent again from the start"
    r.give_back(again)
    assert r.lend(600) is None and r.idle is None, "too small: dropped, the cold allocation replaces it"
