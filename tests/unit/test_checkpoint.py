"""HF-format checkpoints (config.json + safetensors) load whole or by layer range and match the reference."""

from __future__ import annotations

import json

import pytest
import torch

from kunserve.shared.engine.api import EngineRequest, SamplingParams
from kunserve.shared.engine.engine import Engine
from kunserve.shared.model.config import TINY_CONFIG, ModelConfig
from kunserve.shared.model.loader import load_model_source
from kunserve.shared.model.reference import reference_greedy
from kunserve.shared.model.weights import load_checkpoint, random_weights, save_checkpoint, tensor_shapes
from oracle import compare_greedy

CFG = TINY_CONFIG.replace(num_layers=3, name="ckpt")


@pytest.mark.parametrize("cfg", [CFG, CFG.replace(qkv_bias=True, model_type="qwen2"),
                                 CFG.replace(tie_word_embeddings=True)], ids=["llama", "qwen2", "tied"])
def test_round_trip_matches_reference(tmp_path, cfg):
    w = random_weights(cfg, seed=3)
    save_checkpoint(tmp_path, cfg, w, shard_size=7)
    loaded_cfg, loaded = load_checkpoint(tmp_path)
    assert loaded_cfg.qkv_bias == cfg.qkv_bias and loaded_cfg.tie_word_embeddings == cfg.tie_word_embeddings
    assert loaded.keys() == w.keys() and all(torch.equal(loaded[k], w[k]) for k in w)
    src = load_model_source(str(tmp_path))
    eng = Engine(src.config, src.load_weights(), num_kv_blocks=32, block_size=8)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    got = eng.generate([EngineRequest("r", prompt, SamplingParams(max_tokens=8, ignore_eos=True))])["r"]
    ref, margins = reference_greedy(cfg, w, prompt, 8)
    compare_greedy(got, ref, margins)


def test_layer_range_loads_only_what_the_stage_needs(tmp_path):
    w = random_weights(CFG, seed=1)
    save_checkpoint(tmp_path, CFG, w)
    _, first = load_checkpoint(tmp_path, (0, 1))
    _, last = load_checkpoint(tmp_path, (1, 3))
    assert "model.embed_tokens.weight" in first and "lm_head.weight" not in first
    assert "lm_head.weight" in last and "model.embed_tokens.weight" not in last
    assert not any(k.startswith("model.layers.0.") for k in last)
    assert set(first) | set(last) == set(tensor_shapes(CFG))


def test_random_weights_are_the_same_for_any_layer_range():
    from kunserve.shared.model.weights import select

    full = random_weights(CFG, seed=5)
    assert torch.equal(select(full, CFG, (1, 2))["model.layers.1.mlp.up_proj.weight"],
                       random_weights(CFG, seed=5)["model.layers.1.mlp.up_proj.weight"])


def test_config_from_hf_dict():
    d = CFG.replace(model_type="qwen2").to_hf_dict()
    d["eos_token_id"] = [7, 8]
    cfg = ModelConfig.from_hf_dict(d)
    assert cfg.qkv_bias and cfg.eos_token_id == 7 and cfg.head_dim == 64


def test_checkpoint_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(CFG.to_hf_dict()))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_checkpoint(tmp_path)
    w = random_weights(CFG, seed=1)
    del w["model.layers.2.mlp.up_proj.weight"]
    save_checkpoint(tmp_path, CFG, w)
    with pytest.raises(ValueError, match="missing tensors .*layers.2.mlp.up_proj"):
        load_checkpoint(tmp_path)
    bad = CFG.to_hf_dict()
    bad["model_type"] = "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="not supported"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{broken")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_checkpoint(tmp_path)
