"""Property-based: random allocate / free / drop / restore / compact sequences keep every invariant.

A tiny block allocator (lowest ids first, like the engine's) lives in the test. After every step:
no physical page is mapped twice and none is lost (the pool's own bookkeeping, and the contents:
two blocks sharing a page would overwrite each other); every block table entry is a live block
below `num_blocks`; every live block of every held layer holds exactly what was written into it;
every held weight tensor holds its pattern; KV base addresses of layers held throughout never move.
"""

from __future__ import annotations

import gc

import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kunserve.shared.memory import KVCapacityError, LayerRangeError, OutOfPagesError, arena_pages
from kunserve.shared.memory.testing import block_pattern, make_layout, pattern_source, tiny_llama_specs

P = 16 * 1024


class LayoutMachine(RuleBasedStateMachine):
    @initialize(
        num_layers=st.integers(2, 6),
        head_dim=st.sampled_from([16, 12]),  # 12: blocks straddle page boundaries
        block_size=st.sampled_from([2, 4, 8]),
        extra_pages=st.integers(0, 24),
        data=st.data(),
    )
    def setup(self, num_layers: int, head_dim: int, block_size: int, extra_pages: int, data: st.DataObject) -> None:
        start = data.draw(st.integers(0, num_layers - 1), label="start")
        end = data.draw(st.integers(start + 1, num_layers), label="end")
        layer_specs, groups = tiny_llama_specs()
        full_weights = num_layers * arena_pages(layer_specs(0), P) + sum(arena_pages(g.tensors, P) for g in groups)
        # Enough for the whole model with one KV page per layer, plus some.
        num_pages = full_weights + num_layers + extra_pages
        self.layout = make_layout(num_layers=num_layers, layer_start=start, layer_end=end, num_pages=num_pages,
                                  head_dim=head_dim, block_size=block_size)
        self.seqs: dict[int, list[int]] = {}
        self.tag: dict[int, int] = {}  # live block id -> tag of the pattern written into it
        self.next_seq = 0
        self.next_tag = 0
        self.bases = {x: self.layout.kv_data_ptr(x) for x in self.layout.layers}

    # ------------------------------------------------------------------ helpers
    def used(self) -> set[int]:
        return set(self.tag)

    def write_blocks(self, blocks: list[int], layers=None) -> None:
        lay = self.layout
        for x in lay.layers if layers is None else layers:
            kv = lay.layer_cache(x)
            for b in blocks:
                kv[b] = block_pattern(lay, x, self.tag[b])
            del kv

    # ------------------------------------------------------------------ block allocator
    @rule(n=st.integers(1, 32), high=st.booleans())
    def allocate(self, n: int, high: bool) -> None:
        """Lowest free ids first, like the engine; `high` takes the highest (a fragmented cache)."""
        free = sorted(set(range(self.layout.num_blocks)) - self.used())
        if len(free) < n:
            return
        blocks = free[-n:] if high else free[:n]
        for b in blocks:
            self.tag[b] = self.next_tag
            self.next_tag += 1
        self.seqs[self.next_seq] = blocks
        self.next_seq += 1
        self.write_blocks(blocks)

    @precondition(lambda self: bool(self.seqs))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(self.seqs)), label="seq")
        for b in self.seqs.pop(sid):
            del self.tag[b]

    # ------------------------------------------------------------------ drop
    @precondition(lambda self: self.layout.layer_end - self.layout.layer_start >= 2)
    @rule(data=st.data())
    def drop(self, data: st.DataObject) -> None:
        lay = self.layout
        held = list(lay.layers)
        k = data.draw(st.integers(1, len(held) - 1), label="k")
        side = data.draw(st.sampled_from(["prefix", "suffix"]), label="side")
        layers = held[:k] if side == "prefix" else held[-k:]
        old_blocks, old_k, spare = lay.num_blocks, lay.kv_pages_per_layer, lay.spare_pages
        plan = lay.plan_drop(layers)
        freed = lay.weight_pages - plan.weight_pages + k * old_k
        r = lay.drop_layers(layers)
        event("drop done")
        n = len(held) - k
        # The capacity rule: each remaining layer gains (freed + spare) // n pages; the rest stays spare.
        assert r.pages_unmapped == freed
        assert lay.kv_pages_per_layer == plan.kv_pages_per_layer == old_k + (freed + spare) // n
        assert lay.spare_pages == plan.spare_pages == (freed + spare) % n
        assert r.new_num_blocks == lay.num_blocks == lay.kv_pages_per_layer * P // lay.block_bytes >= old_blocks
        for x in layers:
            self.bases.pop(x)

    @rule(layers=st.lists(st.integers(-1, 7), max_size=4))
    def drop_arbitrary(self, layers: list[int]) -> None:
        """Any layer set: either a valid drop, or a LayerRangeError that changes nothing."""
        lay = self.layout
        before = (lay.layer_start, lay.layer_end, lay.num_blocks, lay.generation)
        try:
            lay.plan_drop(layers)
        except LayerRangeError:
            try:
                lay.drop_layers(layers)
            except LayerRangeError:
                assert (lay.layer_start, lay.layer_end, lay.num_blocks, lay.generation) == before
                return
            raise AssertionError(f"drop {layers} succeeded though plan_drop refused it") from None
        lay.drop_layers(layers)
        for x in layers:
            self.bases.pop(x)

    # ------------------------------------------------------------------ restore
    @precondition(lambda self: self.layout.layer_end - self.layout.layer_start < self.layout.num_layers_model)
    @rule(data=st.data(), compact_first=st.booleans())
    def restore(self, data: st.DataObject, compact_first: bool) -> None:
        lay = self.layout
        room_before, room_after = lay.layer_start, lay.num_layers_model - lay.layer_end
        sides = [s for s, room in (("before", room_before), ("after", room_after)) if room]
        side = data.draw(st.sampled_from(sides), label="side")
        if side == "before":
            before_n = data.draw(st.integers(1, room_before), label="before")
            after_n = data.draw(st.integers(0, room_after), label="after")
        else:
            after_n = data.draw(st.integers(1, room_after), label="after")
            before_n = data.draw(st.integers(0, room_before), label="before")
        layers = list(range(lay.layer_start - before_n, lay.layer_start)) + list(
            range(lay.layer_end, lay.layer_end + after_n))
        try:
            plan = lay.plan_restore(layers)
        except OutOfPagesError:
            return
        used = self.used()
        if compact_first and len(used) <= plan.num_blocks:
            self.compact_to(plan.num_blocks)
            used = self.used()
        state = (lay.layer_start, lay.layer_end, lay.num_blocks, lay.generation)
        try:
            lay.restore_layers(layers, pattern_source, used_block_ids=used)
        except KVCapacityError as e:
            event(f"restore refused (needs_compaction={e.needs_compaction})")
            assert (lay.layer_start, lay.layer_end, lay.num_blocks, lay.generation) == state
            assert e.new_num_blocks == plan.num_blocks
            if len(used) > plan.num_blocks:
                assert not e.needs_compaction
            else:
                assert e.needs_compaction and max(used) >= plan.num_blocks
            return
        event("restore done")
        assert lay.num_blocks == plan.num_blocks
        assert all(b < plan.num_blocks for b in used)
        # The restored layers' KV comes back (in the system: exchanged back from the peer stage).
        self.write_blocks(sorted(self.tag), layers)
        for x in layers:
            self.bases[x] = lay.kv_data_ptr(x)

    # ------------------------------------------------------------------ compaction
    def compact_to(self, new_num_blocks: int) -> None:
        mapping = self.layout.plan_compaction(self.used(), new_num_blocks)
        self.layout.apply_compaction(mapping)
        self.tag = {mapping.get(b, b): t for b, t in self.tag.items()}
        self.seqs = {s: [mapping.get(b, b) for b in bl] for s, bl in self.seqs.items()}

    @rule(data=st.data())
    def compact(self, data: st.DataObject) -> None:
        nb = self.layout.num_blocks
        target = data.draw(st.integers(0, nb), label="target")
        if len(self.used()) > target:
            try:
                self.layout.plan_compaction(self.used(), target)
            except KVCapacityError:
                return
            raise AssertionError("plan_compaction accepted more used blocks than the target holds")
        self.compact_to(target)
        event("compaction")
        assert all(b < target for b in self.used())

    # ------------------------------------------------------------------ invariants
    @invariant()
    def pages_and_ranges(self) -> None:
        self.layout.check_invariants()  # no page mapped twice, none lost, k KV pages per layer
        pool = self.layout.pool
        assert pool.mapped_count + pool.free_count == pool.num_pages

    @invariant()
    def block_tables_point_at_live_blocks(self) -> None:
        nb = self.layout.num_blocks
        all_blocks = [b for bl in self.seqs.values() for b in bl]
        assert len(all_blocks) == len(set(all_blocks)) == len(self.tag)
        assert set(all_blocks) == set(self.tag)
        assert all(0 <= b < nb for b in all_blocks)

    @invariant()
    def live_block_contents_preserved(self) -> None:
        lay = self.layout
        if not self.tag:
            return
        ids = sorted(self.tag)
        for x in lay.layers:
            kv = lay.layer_cache(x)
            got = kv[torch.tensor(ids)]
            del kv
            want = torch.stack([block_pattern(lay, x, self.tag[b]) for b in ids])
            assert torch.equal(got, want), f"layer {x}: live KV blocks changed"

    @invariant()
    def weights_and_bases(self) -> None:
        lay = self.layout
        for name, t in lay.weights().items():
            assert torch.equal(t, pattern_source(name)), name
        assert set(self.bases) == set(lay.layers)
        for x in lay.layers:
            assert lay.kv_data_ptr(x) == self.bases[x]

    def teardown(self) -> None:
        lay = getattr(self, "layout", None)
        if lay is not None:
            gc.collect()
            lay.close()
            lay.pool.close()


LayoutMachine.TestCase.settings = settings(
    max_examples=15, stateful_step_count=25, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestLayoutMachine = LayoutMachine.TestCase
