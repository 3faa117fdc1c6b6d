"""Megatron-style tensor-parallel shards (shared/model/tp_shard.py), in one process: each rank's ModelRunner on its
own thread, the all-reduce a sum over threads in rank order. Logits equal the whole model's (float tolerance) at
TP2 and TP4, biases included; the shard's memory-pool layout holds only its weights and a KV cache of its heads;
degrees that do not fit are refused with a message naming the count."""

from __future__ import annotations

import threading

import pytest
import torch
from engine_testing import TP4_CONFIG

from kunserve.shared.engine.attention import build_metadata
from kunserve.shared.engine.kv_storage import TorchKVStorage
from kunserve.shared.engine.model_runner import ModelRunner
from kunserve.shared.memory import create_pool
from kunserve.shared.model.architecture import TINY_CONFIG, ModelConfig
from kunserve.shared.model.pool_placement import build_model_layout
from kunserve.shared.model.tp_degree import check_degree, degree_error, shard_config
from kunserve.shared.model.tp_shard import shard_weights, sharded_source
from kunserve.shared.model.weights import ModelSource, random_weights

BS = 4


class ThreadSum:
    """An all-reduce between `n` threads: every rank gets the sum of all ranks' tensors, added in rank order."""

    def __init__(self, n: int) -> None:
        self.parts: list[torch.Tensor | None] = [None] * n
        self.barrier = threading.Barrier(n, timeout=60)

    def reducer(self, rank: int):
        def reduce(t: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = t.clone()
            self.barrier.wait()
            total = self.parts[0].clone()
            for p in self.parts[1:]:
                total += p
            self.barrier.wait()
            t.copy_(total)
            return t

        return reduce


def run_forwards(cfg: ModelConfig, weights, degree: int, steps) -> list[list[torch.Tensor]]:
    """Each rank's logits for every step of `steps` ((token ids, positions, metadata, logits rows) in order, over one
    KV cache per rank), the ranks on their own threads."""
    scfg = shard_config(cfg, degree)
    reduce = ThreadSum(degree)
    out: list[list[torch.Tensor]] = [[] for _ in range(degree)]
    errors: list[BaseException] = []

    def rank_main(r: int) -> None:
        try:
            runner = ModelRunner(
                scfg, shard_weights(weights, r, degree), pack_weights=False, reduce=reduce.reducer(r) if degree > 1 else None
            )
            kv = TorchKVStorage(range(cfg.num_layers), 16, scfg.num_kv_heads, BS, scfg.head_dim)
            for ids, pos, meta, rows in steps:
                out[r].append(runner.forward(ids, pos, kv, meta, rows))
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)
            reduce.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(degree)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return out


def prefill_then_decode(prompt: list[int], next_token: int):
    """A prefill of `prompt` (blocks 0..) then one decode step of `next_token`."""
    n = len(prompt)
    blocks = list(range(-(-(n + 1) // BS)))
    pre = build_metadata([blocks[i // BS] for i in range(n)], [i % BS for i in range(n)], [], [(0, n, n, blocks)], BS)
    dec = build_metadata([blocks[n // BS]], [n % BS], [(0, n + 1, blocks)], [], BS)
    return [(torch.tensor(prompt), torch.arange(n), pre, torch.tensor([n - 1])), (torch.tensor([next_token]), torch.tensor([n]), dec, None)]


@pytest.mark.parametrize("cfg,degree", [(TINY_CONFIG, 2), (TP4_CONFIG, 2), (TP4_CONFIG, 4)])
def test_sharded_forward_equals_the_whole_model(cfg, degree):
    torch.set_num_threads(1)
    w = random_weights(cfg, seed=3)
    steps = prefill_then_decode([5, 77, 300, 41, 9, 123, 250], next_token=17)
    (whole,) = run_forwards(cfg, w, 1, steps)
    ranks = run_forwards(cfg, w, degree, steps)
    for r in range(degree):
        for got, ref in zip(ranks[r], whole):
            assert got.shape == ref.shape
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
        assert [int(x.argmax(-1)[-1]) for x in ranks[r]] == [int(x.argmax(-1)[-1]) for x in whole]


def test_shard_shapes_and_replication():
    w = random_weights(TP4_CONFIG, seed=0)
    s1 = shard_weights(w, 1, 4)
    p = "model.layers.0."
    assert s1[p + "self_attn.q_proj.weight"].shape == (2 * 16, 128)  # 2 of 8 query heads
    assert s1[p + "self_attn.k_proj.weight"].shape == (1 * 16, 128)  # 1 of 4 KV heads
    assert s1[p + "self_attn.o_proj.weight"].shape == (128, 2 * 16)  # its heads' input columns
    assert s1[p + "mlp.gate_proj.weight"].shape == (64, 128)
    assert s1[p + "mlp.down_proj.weight"].shape == (128, 64)
    torch.testing.assert_close(s1[p + "self_attn.q_proj.weight"], w[p + "self_attn.q_proj.weight"][32:64])
    torch.testing.assert_close(s1[p + "mlp.down_proj.weight"], w[p + "mlp.down_proj.weight"][:, 64:128])
    torch.testing.assert_close(s1[p + "self_attn.v_proj.bias"], w[p + "self_attn.v_proj.bias"][16:32])
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", p + "input_layernorm.weight"):
        assert s1[name] is w[name]
    # o_proj's bias is added once: rank 0 holds it, the others zeros
    assert shard_weights(w, 0, 4)[p + "self_attn.o_proj.bias"] is w[p + "self_attn.o_proj.bias"]
    assert not s1[p + "self_attn.o_proj.bias"].any()


def test_degrees_that_do_not_fit_are_refused_with_the_count():
    assert degree_error(TINY_CONFIG, 1) is None and degree_error(TINY_CONFIG, 2) is None
    assert "2 KV heads" in degree_error(TINY_CONFIG, 4)  # 4 heads but only 2 KV heads
    assert "must be one of 1, 2, 4" in degree_error(TINY_CONFIG, 3)
    odd = TINY_CONFIG.replace(intermediate_size=703)
    assert "703 intermediate size" in degree_error(odd, 2)
    with pytest.raises(ValueError, match="does not divide"):
        check_degree(TINY_CONFIG, 4)
    with pytest.raises(ValueError, match="rank 2 outside"):
        sharded_source(ModelSource("m", TINY_CONFIG, None), 2, 2)


def test_the_shard_layout_releases_weights_and_divides_kv_per_token():
    """Gyges' point (§2): each TP member holds 1/degree of the sharded weights and of the KV per token, so the
    same pool holds more tokens. The pool's own accounting shows it."""
    src = ModelSource("m", TINY_CONFIG, None)
    maps = {}
    for degree in (1, 2):
        s = sharded_source(src, 0, degree) if degree > 1 else src
        pool = create_pool("host", pool_bytes=24 << 20, page_size=64 << 10)
        try:
            layout = build_model_layout(pool, s.config, (0, 4), 16, s.load_weights())
            maps[degree] = layout.memory_map(per_page=False)
            layout.close()
        finally:
            pool.close()
    one, two = maps[1], maps[2]
    per_layer = [x["weight_bytes"] for x in one["layers"]]
    assert [x["weight_bytes"] for x in two["layers"]] == [b - (b - 2 * 256 * 4) // 2 for b in per_layer]
    assert two["kv"]["block_bytes"] * 2 == one["kv"]["block_bytes"]
    assert two["kv"]["num_blocks"] > 2 * one["kv"]["num_blocks"]  # the freed weight pages hold KV too
    assert two["groups"] == one["groups"]  # embeddings, final norm and lm_head are replicated


@pytest.mark.parametrize("degree", [2, 4])
def test_attention_cut_from_a_padded_pools_stored_weights_is_the_ranks_shard(degree):
    """What an in-place member computes its heads with (PooledInstance.shard): cut from the pool's fused, panel-laid
    weights, the q|k|v rows, o_proj's columns and both biases equal shard_weights' of the HF tensors."""
    from kunserve.shared.model.pool_placement import FFN_SHARDS, QKV
    from kunserve.shared.model.tp_shard import shard_stored_attention

    weights = random_weights(TP4_CONFIG, seed=5)
    pool = create_pool("host", pool_bytes=16 << 20, page_size=64 << 10)
    layout = build_model_layout(pool, TP4_CONFIG, (0, TP4_CONFIG.num_layers), BS, weights, padded_mlp=True)
    try:
        stored = layout.weights()
        assert any(k.endswith(".panels") for k in stored) and any(k.endswith(FFN_SHARDS) for k in stored)
        for rank in range(degree):
            cut = shard_stored_attention(stored, TP4_CONFIG, rank, degree)
            want = shard_weights(weights, rank, degree)
            for layer in range(TP4_CONFIG.num_layers):
                p = f"model.layers.{layer}."
                for part in ("weight", "bias"):
                    torch.testing.assert_close(cut[f"{p}{QKV}.{part}"], torch.cat(
                        [want[f"{p}self_attn.{x}_proj.{part}"] for x in "qkv"]), rtol=0, atol=0)
                    torch.testing.assert_close(cut[f"{p}self_attn.o_proj.{part}"], want[f"{p}self_attn.o_proj.{part}"],
                                               rtol=0, atol=0)
        del stored, cut
    finally:
        layout.close()
        pool.close()
