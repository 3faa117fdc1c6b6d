"""HF-format checkpoints (config.json + safetensors) load whole or by layer range and match the reference;
model configs parse HF config.json; errors name the missing file, key or tensor."""

from __future__ import annotations

import json

import pytest
import torch
from engine_testing import check_greedy, one_torch_thread  # noqa: F401 - fixture
from safetensors.torch import save_file

from kunserve.shared.engine.api import EngineRequest, SamplingParams
from kunserve.shared.engine.engine import Engine
from kunserve.shared.model.architecture import TINY_CONFIG, ModelConfig
from kunserve.shared.model.tokenizer import ByteTokenizer
from kunserve.shared.model.weights import (
    load_checkpoint,
    load_model_source,
    random_weights,
    save_checkpoint,
    select,
    tensor_shapes,
)

CFG = TINY_CONFIG.replace(num_layers=3, name="ckpt")


@pytest.mark.parametrize("cfg", [CFG, CFG.replace(qkv_bias=True, model_type="qwen2"),
                                 CFG.replace(tie_word_embeddings=True)], ids=["llama", "qwen2", "tied"])
def test_round_trip_matches_reference(tmp_path, cfg):
    w = random_weights(cfg, seed=3)
    save_checkpoint(tmp_path, cfg, w, shard_size=7)
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    loaded_cfg, loaded = load_checkpoint(tmp_path)
    assert loaded_cfg.qkv_bias == cfg.qkv_bias and loaded_cfg.tie_word_embeddings == cfg.tie_word_embeddings
    assert loaded.keys() == w.keys() and all(torch.equal(loaded[k], w[k]) for k in w)
    assert ("lm_head.weight" in loaded) != cfg.tie_word_embeddings
    src_cfg, load_weights, tokenizer = load_model_source(str(tmp_path))
    assert tokenizer is None  # no tokenizer.json: token-id prompts only
    eng = Engine(src_cfg, load_weights(), num_kv_blocks=32, block_size=8)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    got = eng.generate([EngineRequest("r", prompt, SamplingParams(max_tokens=8, ignore_eos=True))])["r"]
    check_greedy(cfg, w, prompt, got)


def test_layer_range_loads_only_what_the_stage_needs(tmp_path):
    w = random_weights(CFG, seed=1)
    save_checkpoint(tmp_path, CFG, w)
    _, first = load_checkpoint(tmp_path, (0, 1))
    _, last = load_checkpoint(tmp_path, (1, 3))
    assert "model.embed_tokens.weight" in first and "lm_head.weight" not in first and "model.norm.weight" not in first
    assert "lm_head.weight" in last and "model.embed_tokens.weight" not in last
    assert not any(k.startswith("model.layers.0.") for k in last)
    assert set(first) | set(last) == set(tensor_shapes(CFG))
    tied = CFG.replace(tie_word_embeddings=True)
    save_checkpoint(tmp_path / "tied", tied, random_weights(tied, seed=1))
    _, last_tied = load_checkpoint(tmp_path / "tied", (2, 3))
    assert "model.embed_tokens.weight" in last_tied and "lm_head.weight" not in last_tied  # the tied head


def test_random_weights_are_deterministic_per_tensor():
    a, b = random_weights(CFG, seed=5), random_weights(CFG, seed=5)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.layers.1.mlp.up_proj.weight"], random_weights(CFG, seed=6)["model.layers.1.mlp.up_proj.weight"])
    assert select(a, CFG, (1, 2)).keys() == tensor_shapes(CFG, (1, 2)).keys()


def test_embedded_default_source():
    src = load_model_source(None)
    cfg, load_weights, tok = src
    assert cfg == TINY_CONFIG and isinstance(tok, ByteTokenizer)
    stage = load_weights((1, 3))
    full = random_weights(TINY_CONFIG, 0)
    assert all(torch.equal(stage[k], full[k]) for k in stage)
    assert "model.embed_tokens.weight" not in stage and "lm_head.weight" not in stage
    assert load_model_source(None, dtype="bfloat16").config.torch_dtype == torch.bfloat16


def test_tiny_config_is_the_benchmark_shape():
    c = TINY_CONFIG
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
            c.vocab_size, c.max_position_embeddings, c.rope_theta, c.tie_word_embeddings, c.dtype) == \
        (256, 4, 4, 2, 64, 704, 4096, 2048, 10000.0, False, "float32")


def test_config_from_hf_dict():
    d = CFG.replace(model_type="qwen2").to_hf_dict()
    d["eos_token_id"] = [7, 8]
    d.pop("head_dim")
    cfg = ModelConfig.from_hf_dict(d)
    assert cfg.qkv_bias and not cfg.o_bias and cfg.eos_token_id == 7 and cfg.head_dim == 64
    assert cfg.eos_token_ids == (7, 8) and ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    llama = CFG.to_hf_dict()
    assert ModelConfig.from_hf_dict(llama) == CFG.replace(name="custom")
    llama["attention_bias"] = True
    assert ModelConfig.from_hf_dict(llama).qkv_bias and ModelConfig.from_hf_dict(llama).o_bias
    del llama["dtype"]
    llama["torch_dtype"] = "bfloat16"  # transformers <= 4.x
    assert ModelConfig.from_hf_dict(llama).dtype == "bfloat16"
    llama["dtype"] = "float16"  # transformers 5.x
    assert ModelConfig.from_hf_dict(llama).dtype == "float16"
    assert ModelConfig.from_hf_dict(llama, dtype="float32").dtype == "float32"


@pytest.mark.parametrize("key", ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                 "intermediate_size"])
def test_config_missing_key_is_named(key):
    d = CFG.to_hf_dict()
    del d[key]
    with pytest.raises(ValueError, match=key):
        ModelConfig.from_hf_dict(d)


def test_config_rejects_other_architectures():
    d = CFG.to_hf_dict()
    d["model_type"] = "gpt2"
    with pytest.raises(ValueError, match="not supported"):
        ModelConfig.from_hf_dict(d)


def test_checkpoint_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(CFG.to_hf_dict()))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model_source(str(tmp_path))
    w = random_weights(CFG, seed=1)
    del w["model.layers.2.mlp.up_proj.weight"]
    save_checkpoint(tmp_path, CFG, w)
    with pytest.raises(ValueError, match="missing tensors .*layers.2.mlp.up_proj"):
        load_checkpoint(tmp_path)
    load_checkpoint(tmp_path, (0, 2))  # a stage that does not hold layer 2 loads fine
    w = random_weights(CFG, seed=1)
    w["model.norm.weight"] = torch.ones(7)
    save_file(w, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.safetensors: tensor model.norm.weight has shape \(7,\)"):
        load_checkpoint(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="model.safetensors"):
        load_checkpoint(tmp_path)
    bad = CFG.to_hf_dict()
    bad["model_type"] = "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="not supported"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{broken")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_checkpoint(tmp_path)
