"""The KV tokens a whole-model worker reports for each TP degree (services/worker/servicer.py `_kv_tokens_by_degree`)
by the cluster's TP mode: cold, a member's pool holds its weight shard, so each degree's figure is the pool layout's
own rule on the sharded config (`tp_capacity.kv_tokens_by_degree`); in place the pool keeps the whole weights and d
members hold d times the KV heads, so each degree's figure is d times the TP1 one. A worker holding part of the model
reports nothing; with the padded MLP in its pool (`tp_capacity.in_place_kv_tokens_by_degree`) a member's released shards
add to that. The pool is a fake of the given size; the engine loop is never started."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from worker_servicer_fakes import Instance

from kunserve.services.worker.servicer import WorkerIdentity, WorkerServicer
from kunserve.shared.engine.engine import Engine
from kunserve.shared.engine.loop import EngineLoop
from kunserve.shared.model.architecture import TINY_CONFIG
from kunserve.shared.model.tp_capacity import in_place_kv_tokens_by_degree, kv_tokens_by_degree
from kunserve.shared.model.weights import random_weights

ENGINE_CFG = TINY_CONFIG.replace(num_layers=1, name="one")
CFG = TINY_CONFIG.replace(num_kv_heads=4, name="kv4")  # shards at 1, 2 and 4
NUM_PAGES, PAGE_SIZE, BLOCK_SIZE = 1024, 64 * 1024, 8


class PooledInstance(Instance):
    """Instance with the pool, config and block size `_kv_tokens_by_degree` reads."""

    cfg = CFG
    pool = SimpleNamespace(num_pages=NUM_PAGES, page_size=PAGE_SIZE, device=SimpleNamespace(type="cpu"))
    layout = SimpleNamespace(block_size=BLOCK_SIZE)
    padded_mlp = False


def servicer(tp_mode: str, padded: bool = False) -> WorkerServicer:
    loop = EngineLoop(Engine(ENGINE_CFG, random_weights(ENGINE_CFG, 0), num_kv_blocks=64, block_size=BLOCK_SIZE))
    ident = WorkerIdentity("w0", "127.0.0.1:1", "kv4", CFG.num_layers, CFG.vocab_size, 2048, "cpu", "float32")
    instance = PooledInstance((0, CFG.num_layers))
    instance.padded_mlp = padded
    return WorkerServicer(ident, loop, instance, tp_mode=tp_mode)


@pytest.fixture(scope="module")
def cold_rule() -> dict[int, int]:
    """The pool layout's rule on the sharded config, as the servicer computes it; the modes differ on it."""
    rule = kv_tokens_by_degree(CFG, num_pages=NUM_PAGES, page_size=PAGE_SIZE, block_size=BLOCK_SIZE, device_type="cpu")
    assert sorted(rule) == [1, 2, 4] and rule[1] > 0
    assert all(rule[d] != d * rule[1] for d in (2, 4))
    return rule


def test_in_place_every_degree_is_d_times_the_tp1_figure(cold_rule):
    got = servicer("in-place")._kv_tokens_by_degree(0, CFG.num_layers)
    assert got == {1: cold_rule[1], 2: 2 * cold_rule[1], 4: 4 * cold_rule[1]}


def test_in_place_with_the_padded_mlp_adds_the_released_shards(cold_rule):
    got = servicer("in-place", padded=True)._kv_tokens_by_degree(0, CFG.num_layers)
    want = in_place_kv_tokens_by_degree(CFG, num_pages=NUM_PAGES, page_size=PAGE_SIZE, block_size=BLOCK_SIZE,
                                        device_type="cpu", padded_mlp=True)
    assert got == want and all(got[d] > d * got[1] for d in (2, 4))


def test_cold_is_the_pool_layouts_rule_on_the_sharded_config(cold_rule):
    got = servicer("cold")._kv_tokens_by_degree(0, CFG.num_layers)
    assert got == cold_rule


@pytest.mark.parametrize("tp_mode", ["cold", "in-place"])
def test_a_worker_holding_part_of_the_model_reports_no_degree(tp_mode):
    assert servicer(tp_mode)._kv_tokens_by_degree(0, CFG.num_layers - 1) == {}
