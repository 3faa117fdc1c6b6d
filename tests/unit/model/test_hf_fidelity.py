"""The model math of real Hugging Face checkpoints, proven against `transformers` itself.

Tiny random Llama and Qwen2 checkpoints are written by transformers (both config generations: the 5.x
`rope_parameters` it writes, and a hand-written 4.x config.json with top-level `rope_theta` /
`rope_scaling`; every scaled RoPE variant; theta 1e6 so a fallback to 10000 would show), loaded through
`load_model_source`, and the engine's greedy continuation must equal `model.generate(do_sample=False)`
token for token, EOS included, for prompts up to ~1K tokens; the dense reference must agree too.
Every key that changes the math and is not implemented is refused with the key and the file named.
"""

from __future__ import annotations

import json

import pytest
import torch
from engine_testing import one_torch_thread  # noqa: F401 - fixture

from kunserve.shared.engine.api import EngineRequest, SamplingParams
from kunserve.shared.engine.engine import Engine
from kunserve.shared.model import rope
from kunserve.shared.model.reference import reference_scores
from kunserve.shared.model.weights import load_checkpoint, load_model_source

transformers = pytest.importorskip("transformers")
from hf_checkpoints import MAX_NEW, SHAPE, VOCAB, hf_greedy, prompts, write_checkpoint  # noqa: E402


def engine_greedy(path, all_prompts: list[list[int]]) -> tuple[dict[str, list[int]], object, dict]:
    cfg, load_weights, _ = load_model_source(str(path))
    weights = load_weights()
    eng = Engine(cfg, weights, num_kv_blocks=4 * 80, block_size=16)
    reqs = [EngineRequest(f"r{i}", p, SamplingParams(max_tokens=MAX_NEW)) for i, p in enumerate(all_prompts)]
    return eng.generate(reqs), cfg, weights


def check_against_transformers(path, model, seed: int = 0):
    """The engine (all prompts batched, chunked prefill) and the reference equal transformers' generate."""
    ps = prompts(seed)
    got, cfg, weights = engine_greedy(path, ps)
    for i, p in enumerate(ps):
        want = hf_greedy(model, p)
        assert got[f"r{i}"] == want, f"prompt of {len(p)} tokens: engine {got[f'r{i}']}, transformers {want}"
        ref, _ = reference_scores(cfg, weights, p, want)
        assert ref == want, f"prompt of {len(p)} tokens: reference {ref}, transformers {want}"
    return cfg


LLAMA3 = {"rope_type": "llama3", "rope_theta": 1e6, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
YARN = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 256}

CASES = {
    "llama-default-1e6": ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
    "qwen2-default-1e6-tied": ("qwen2", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
                                         "tie_word_embeddings": True}),
    "llama-linear": ("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e6, "factor": 4.0}}),
    "llama-dynamic": ("llama", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e6, "factor": 2.0}}),
    "llama-llama3": ("llama", {"rope_parameters": LLAMA3}),
    "llama-yarn": ("llama", {"rope_parameters": YARN}),
    "qwen2-yarn-attention-factor": ("qwen2", {"rope_parameters": {**YARN, "attention_factor": 1.3,
                                                                  "beta_fast": 16, "beta_slow": 2}}),
    "llama-bias-headdim-eps-eoslist": ("llama", {"attention_bias": True, "head_dim": 24, "rms_norm_eps": 1e-5,
                                                 "eos_token_id": [2, 5, 77],
                                                 "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_equals_transformers(tmp_path, case):
    arch, overrides = CASES[case]
    model = write_checkpoint(tmp_path, arch, seed=len(case), **overrides)
    written = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" in written and "rope_theta" not in written  # the 5.x generation
    cfg = check_against_transformers(tmp_path, model, seed=len(case))
    assert cfg.rope.rope_type == overrides["rope_parameters"]["rope_type"]
    assert cfg.rope_theta == overrides["rope_parameters"]["rope_theta"]
    assert cfg.eos_token_ids == tuple(written["eos_token_id"] if isinstance(written["eos_token_id"], list)
                                      else [written["eos_token_id"]])


@pytest.mark.parametrize("scaling", [None, {"type": "linear", "factor": 2.0},
                                     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                                     {"type": "yarn", "factor": 4.0}],
                         ids=["theta-only", "linear", "llama3", "yarn-implicit-original"])
def test_transformers_4x_config(tmp_path, scaling):
    """A 4.x config.json (top-level rope_theta, rope_scaling, torch_dtype), written by hand: the engine and
    transformers 5.x, both reading that file, generate the same tokens."""
    write_checkpoint(tmp_path, "llama", seed=3)
    d = json.loads((tmp_path / "config.json").read_text())
    del d["rope_parameters"]
    d.pop("dtype", None)
    d.update({"rope_theta": 1e6, "torch_dtype": "float32", "transformers_version": "4.46.0"})
    if scaling is not None:
        d["rope_scaling"] = scaling
    (tmp_path / "config.json").write_text(json.dumps(d))
    model = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path)).eval()
    cfg = check_against_transformers(tmp_path, model, seed=3)
    assert cfg.rope_theta == 1e6
    assert cfg.rope.rope_type == ("default" if scaling is None else scaling.get("rope_type", scaling.get("type")))


def _hf_rotary(arch: str, **overrides):
    cfg = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[arch](**{**SHAPE, **overrides})
    mod = {"llama": transformers.models.llama.modeling_llama.LlamaRotaryEmbedding,
           "qwen2": transformers.models.qwen2.modeling_qwen2.Qwen2RotaryEmbedding}[arch](cfg)
    return cfg, mod


@pytest.mark.parametrize("params", [{"rope_type": "default", "rope_theta": 1e6},
                                    {"rope_type": "linear", "rope_theta": 1e4, "factor": 3.0},
                                    {"rope_type": "dynamic", "rope_theta": 1e6, "factor": 2.0}, LLAMA3, YARN,
                                    {**YARN, "mscale": 0.7, "mscale_all_dim": 1.0, "truncate": False}],
                         ids=["default", "linear", "dynamic", "llama3", "yarn", "yarn-mscale-notruncate"])
def test_cos_sin_bit_identical_to_transformers(params):
    """shared/model/rope.py's tables equal transformers' rotary embedding bit for bit, including what
    `generate` does with a KV cache (prefill, then one position per step), past max_position_embeddings
    for `dynamic`."""
    max_pos = SHAPE["max_position_embeddings"]
    cfg, mod = _hf_rotary("llama", rope_parameters=dict(params))
    ours = rope.RopeParameters.from_hf(cfg.to_dict())
    x = torch.zeros(1, 1, 16)
    prompt_len, total = 900, max_pos + 200  # decode beyond the context: dynamic rescales every step
    hf_cos, hf_sin = mod(x, torch.arange(prompt_len)[None])
    steps = [mod(x, torch.tensor([[p]])) for p in range(prompt_len, total)]
    hf_cos = torch.cat([hf_cos[0]] + [c[0] for c, _ in steps])
    hf_sin = torch.cat([hf_sin[0]] + [s[0] for _, s in steps])
    cos, sin = rope.cos_sin(ours, cfg.head_dim, max_pos, torch.arange(total))
    assert torch.equal(cos, hf_cos) and torch.equal(sin, hf_sin)


def test_stops_on_any_eos_id_like_transformers(tmp_path):
    """eos_token_id as a list: generation ends on any of them, as in transformers (which reads the list
    from generation_config.json, written from config.json)."""
    write_checkpoint(tmp_path, "qwen2", seed=5, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    prompt = prompts(5)[2]
    free = transformers.Qwen2ForCausalLM.from_pretrained(str(tmp_path)).eval()
    free.generation_config.eos_token_id = None
    tokens = hf_greedy(free, prompt)
    stop = next(t for t in tokens[2:] if t not in tokens[:2])  # first ends the sequence at its position
    for name in ("config.json", "generation_config.json"):
        d = json.loads((tmp_path / name).read_text())
        d["eos_token_id"] = [VOCAB - 1, stop]
        (tmp_path / name).write_text(json.dumps(d))
    model = transformers.Qwen2ForCausalLM.from_pretrained(str(tmp_path)).eval()
    want = hf_greedy(model, prompt)
    assert want[-1] == stop and len(want) < MAX_NEW
    got, cfg, _ = engine_greedy(tmp_path, [prompt])
    assert cfg.eos_token_ids == (VOCAB - 1, stop) and got["r0"] == want


def test_dtype_keys_and_override(tmp_path):
    model = write_checkpoint(tmp_path, "qwen2", seed=1).to(torch.bfloat16)
    model.save_pretrained(str(tmp_path))
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    assert load_model_source(str(tmp_path)).config.dtype == "bfloat16"
    src = load_model_source(str(tmp_path), dtype="float32")
    w = src.load_weights()
    assert src.config.dtype == "float32" and w["model.embed_tokens.weight"].dtype == torch.float32
    assert torch.equal(w["model.embed_tokens.weight"], model.model.embed_tokens.weight.float())


def _config(tmp_path, arch="qwen2", **changes):
    write_checkpoint(tmp_path, arch)
    d = json.loads((tmp_path / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    (tmp_path / "config.json").write_text(json.dumps(d))


@pytest.mark.parametrize("arch,changes,named", [
    ("llama", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0],
                                   "long_factor": [1.0], "original_max_position_embeddings": 64}}, "rope_type"),
    ("llama", {"rope_parameters": None, "rope_scaling": {"type": "su", "factor": 2.0}}, "rope_scaling.rope_type"),
    ("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}}, "rope_parameters.factor"),
    ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 2]}},
     "mrope_section"),
    ("llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 64, "layer_types": None, "max_window_layers": 1},
     "sliding_window"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 64,
               "layer_types": ["full_attention", "sliding_attention"]}, "sliding_window"),
    ("llama", {"model_type": "mistral"}, "model_type"),
    ("llama", {"architectures": ["LlamaForSequenceClassification"]}, "architectures"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act"),
    ("llama", {"mlp_bias": True}, "mlp_bias"),
    ("llama", {"dtype": "float64"}, "dtype"),
    ("llama", {"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_refused_by_name(tmp_path, arch, changes, named):
    _config(tmp_path, arch, **changes)
    with pytest.raises(ValueError, match=rf"config\.json: .*{named}"):
        load_model_source(str(tmp_path))


def test_sliding_window_not_in_use_is_accepted(tmp_path):
    # a window as long as the context, or use_sliding_window false (what Qwen2 checkpoints ship), never masks
    _config(tmp_path, "qwen2", use_sliding_window=True, sliding_window=SHAPE["max_position_embeddings"],
            max_window_layers=0, layer_types=None)
    load_model_source(str(tmp_path))
    _config(tmp_path, "qwen2", use_sliding_window=False, sliding_window=64)
    load_model_source(str(tmp_path))


def test_bad_checkpoints_name_file_and_key(tmp_path):
    from safetensors.torch import load_file, save_file

    write_checkpoint(tmp_path, "llama")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    (tmp_path / "model.safetensors").unlink()
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for f, ns in shards.items():
        save_file({n: tensors[n] for n in ns}, str(tmp_path / f))
    index = {"metadata": {}, "weight_map": {n: f for f, ns in shards.items() for n in ns}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    load_checkpoint(tmp_path)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match=rf"model.safetensors.index.json: shard model-00002-of-00002.safetensors "
                                         rf"\(holding {names[half]}\) is missing"):
        load_model_source(str(tmp_path))
    save_file({n: tensors[n] for n in names[half:]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    d = json.loads((tmp_path / "config.json").read_text())
    d["intermediate_size"] = 96
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match=r"model-0000[12]-of-00002.safetensors: tensor model.layers.0.mlp.\w+_proj"
                                         r".weight has shape"):
        load_checkpoint(tmp_path)


def test_a_worker_in_the_memory_pool_serves_every_bias_like_transformers(tmp_path):
    """What a worker runs: the model placed in the unified pool (fused q/k/v, Llama's o_proj bias as well)."""
    from kunserve.shared.engine.pooled import PooledInstance

    case, overrides = CASES["llama-bias-headdim-eps-eoslist"]
    model = write_checkpoint(tmp_path / "m", case, seed=5, **overrides)
    src = load_model_source(str(tmp_path / "m"))
    inst = PooledInstance(src, layer_range=(0, src.config.num_layers), pool_bytes=32 << 20, page_size=256 * 1024,
                          block_size=16, backend="host")
    try:
        ps = [p for p in prompts(5) if len(p) <= 300]
        got = inst.engine.generate([EngineRequest(f"r{i}", p, SamplingParams(max_tokens=MAX_NEW))
                                    for i, p in enumerate(ps)])
        for i, p in enumerate(ps):
            assert got[f"r{i}"] == hf_greedy(model, p), f"prompt of {len(p)} tokens"
    finally:
        inst.close()
