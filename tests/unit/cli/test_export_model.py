"""`kunserve export-model`: the embedded model as an HF directory that transformers loads as is and that
generates, greedily, exactly what KunServe's engine generates; and that KunServe itself serves."""

from __future__ import annotations

import pytest

from kunserve.cli.export_model import export_model
from kunserve.cli.main import main
from kunserve.shared.engine.api import EngineRequest, SamplingParams
from kunserve.shared.engine.engine import Engine
from kunserve.shared.model.architecture import TINY_CONFIG
from kunserve.shared.model.chat_template import chat_template_for
from kunserve.shared.model.tokenizer import ByteTokenizer, HFTokenizer
from kunserve.shared.model.weights import load_model_source

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return export_model(tmp_path_factory.mktemp("tiny"), seed=0, log=lambda _msg: None)


def _engine_greedy(prompt: list[int], n: int) -> list[int]:
    src = load_model_source(None, seed=0)
    eng = Engine(src.config, src.load_weights(), num_kv_blocks=64, block_size=16)
    eng.add_request(EngineRequest("r", prompt, SamplingParams(max_tokens=n, ignore_eos=True)))
    got: list[int] = []
    while eng.has_work():
        got += [ev.token_id for ev in eng.step() if ev.token_id >= 0]
    return got


def test_transformers_loads_it_and_generates_what_the_engine_generates(exported):
    tok = transformers.AutoTokenizer.from_pretrained(str(exported))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(exported), dtype=torch.float32)
    byte = ByteTokenizer()
    text = "The quick brown fox, é 世界 <s>"
    prompt = tok(text)["input_ids"]
    assert prompt == byte.encode(text)  # the exported tokenizer encodes as the byte tokenizer (no BOS)
    ids = list(range(0, TINY_CONFIG.vocab_size, 13)) + [256, 257]
    assert tok.decode(ids, skip_special_tokens=True) == byte.decode(ids)
    n = 12
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    assert out[0, len(prompt):].tolist() == _engine_greedy(prompt, n)


def test_kunserve_serves_it_with_its_chat_template(exported):
    src = load_model_source(str(exported))
    assert src.config.vocab_size == TINY_CONFIG.vocab_size and src.config.num_layers == TINY_CONFIG.num_layers
    assert isinstance(src.tokenizer, HFTokenizer)
    embedded = load_model_source(None, seed=0).load_weights()
    for name, t in src.load_weights().items():
        assert torch.equal(t, embedded[name]), name
    msgs = [{"role": "user", "content": "hi"}]
    hf = transformers.AutoTokenizer.from_pretrained(str(exported))
    rendered = chat_template_for(src.tokenizer).render(msgs)
    assert rendered == hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)


def test_cli_refuses_a_non_empty_directory_unless_forced(tmp_path, capsys):
    (tmp_path / "x").write_text("keep")
    with pytest.raises(SystemExit) as exc:
        main(["export-model", str(tmp_path)])
    assert exc.value.code == 2
    assert "not empty" in capsys.readouterr().err and not (tmp_path / "config.json").exists()
    main(["export-model", str(tmp_path), "--force", "--seed", "3"])
    out = capsys.readouterr().out
    assert "weight seed 3" in out and "done" in out
    assert (tmp_path / "config.json").is_file() and (tmp_path / "tokenizer_config.json").is_file()
