"""Byte and Hugging Face tokenizers: prompts encoded exactly as transformers' AutoTokenizer encodes them
(BOS from the post-processor, neither missing nor doubled), streaming decode whose pieces add up to the
decoded text, generation_config.json defaults, and the dispatcher's stop-string split."""

from __future__ import annotations

import json

import pytest

from kunserve.services.dispatcher.servicer import _stop_split
from kunserve.shared.model.generation_config import load_generation_defaults
from kunserve.shared.model.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

TEXTS = ["hello world", "hello 世界 🙂 world", " leading space", "<s> already has a bos", "", "a\nb\t c"]


def stream(tok, ids):
    s = tok.decode_stream()
    return [s.step(i) for i in ids]


def test_byte_tokenizer_round_trip_and_specials():
    tok = ByteTokenizer()
    text = "héllo, 世界 🙂"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode([256, 104, 257]) == "h"  # BOS / EOS render as nothing
    assert tok.decode([258, 259, 258 + 94, 258 + 95]) == " !~ "  # printable ASCII for random-model ids


def test_streaming_holds_back_partial_utf8():
    tok = ByteTokenizer()
    text = "a世🙂b"
    pieces = stream(tok, tok.encode(text))
    assert "".join(pieces) == text
    assert pieces == ["a", "", "", "世", "", "", "", "🙂", "b"]
    long = "x" * 20 + "é" * 5
    assert "".join(stream(tok, tok.encode(long))) == long


def _bpe(d, *, bos_post_processor: bool, config: dict):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = list(dict.fromkeys(config[k] for k in ("bos_token", "eos_token", "pad_token") if config.get(k)))
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world, 世界 says hello", "streaming tokens 🙂 are fun"] * 20, trainer)
    if bos_post_processor:  # Llama-3 style: TemplateProcessing adds the BOS
        bos = config["bos_token"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, tok.token_to_id(bos))])
    else:  # Qwen2 style: byte-level post-processor, no BOS
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


LLAMA = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
         "eos_token": "<|end_of_text|>", "clean_up_tokenization_spaces": True}
QWEN = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "add_bos_token": False}


@pytest.mark.parametrize("style, bos_pp, config", [
    ("llama3", True, LLAMA),
    ("qwen2", False, {**QWEN, "eos_token": "<|im_end|>", "bos_token": "<|endoftext|>"}),
    ("llama-add-bos-flag", False, {**LLAMA, "add_bos_token": True}),  # transformers 5 drops the flag
    ("split-specials", True, {**LLAMA, "split_special_tokens": True}),
])
def test_encode_equals_transformers_autotokenizer(tmp_path, style, bos_pp, config):
    transformers = pytest.importorskip("transformers")
    d = _bpe(tmp_path / style, bos_post_processor=bos_pp, config=config)
    ours = load_tokenizer(str(d))
    theirs = transformers.AutoTokenizer.from_pretrained(str(d))
    assert isinstance(ours, HFTokenizer)
    for text in TEXTS + [f"{config['bos_token']}hello", "<|im_end|>x"]:
        ids = ours.encode(text)
        assert ids == theirs(text)["input_ids"], (style, text)
        assert ours.encode_chat(text) == theirs(text, add_special_tokens=False)["input_ids"]
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    bos = ours._tok.token_to_id(config["bos_token"])
    assert ours.encode("hello").count(bos) == (1 if bos_pp else 0)  # never doubled, present iff the file adds it


def test_decode_stream_pieces_add_up_to_decode(tmp_path):
    d = _bpe(tmp_path, bos_post_processor=False, config=QWEN | {"bos_token": "<|endoftext|>"})
    tok = load_tokenizer(str(d))
    assert isinstance(tok, HFTokenizer)
    for text in ["hello 世界 🙂 world", "🙂🙂世", "é" * 7 + " streaming"]:
        ids = tok.encode(text)
        pieces = stream(tok, ids)
        assert "".join(pieces) == tok.decode(ids) == text
        assert all("\ufffd" not in p for p in pieces)
    # a special token in the middle is skipped in the stream as in decode
    ids = tok.encode("hello") + [tok._tok.token_to_id("<|im_end|>")] + tok.encode(" world")
    assert "".join(stream(tok, ids)) == tok.decode(ids)


def test_load_tokenizer_rules(tmp_path):
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(str(tmp_path / "missing"))
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 4096}))
    assert load_tokenizer(str(tmp_path)) is None  # no tokenizer.json: token-id prompts only
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_tokenizer(str(tmp_path))
    _bpe(tmp_path, bos_post_processor=False, config=QWEN)
    (tmp_path / "tokenizer_config.json").write_text("[1]")
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        load_tokenizer(str(tmp_path))


def test_generation_config_defaults(tmp_path):
    assert load_generation_defaults(None, embedded_eos=257).eos_token_ids == (257,)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert load_generation_defaults(tmp_path).eos_token_ids == (2,)  # no generation_config.json: config.json's
    (tmp_path / "generation_config.json").write_text(json.dumps({
        "eos_token_id": [128001, 128008, 128009], "do_sample": True, "temperature": 0.6, "top_p": 0.9,
        "max_new_tokens": 64, "repetition_penalty": 1.05}))
    g = load_generation_defaults(tmp_path)
    assert g.eos_token_ids == (128001, 128008, 128009)
    assert (g.temperature, g.top_p, g.top_k, g.max_new_tokens) == (0.6, 0.9, None, 64)
    assert g.unsupported == {"repetition_penalty": 1.05}
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.6}))
    assert load_generation_defaults(tmp_path).temperature == 0.0  # greedy, as transformers reads it
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(ValueError, match="generation_config.json: eos_token_id"):
        load_generation_defaults(tmp_path)


@pytest.mark.parametrize("held, stops, expected", [
    ("hello wor", ("world",), ("hello ", "wor", False)),  # a possible start of a stop string is held
    ("hello world!", ("world",), ("hello ", "", True)),  # trimmed at the stop string
    ("abc", ("x", "bc", "c"), ("a", "", True)),  # the earliest stop wins
    ("plain", ("zz",), ("plain", "", False)),
    ("", ("a",), ("", "", False)),
])
def test_stop_split(held, stops, expected):
    assert _stop_split(held, stops) == expected
