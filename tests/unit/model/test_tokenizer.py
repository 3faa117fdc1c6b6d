"""Byte and Hugging Face tokenizers, and streaming decode that never splits a UTF-8 character."""

from __future__ import annotations

import json

import pytest

from kunserve.shared.model.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer


def stream(tok, ids):
    return [tok.decode_token(ids[:i], ids[i]) for i in range(len(ids))]


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
    ids = tok.encode(text)
    pieces = stream(tok, ids)
    assert "".join(pieces) == text
    assert pieces == ["a", "", "", "世", "", "", "", "🙂", "b"]
    long = "x" * 20 + "é" * 5
    assert "".join(stream(tok, tok.encode(long))) == long


def _train_bpe(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world, 世界 says hello", "streaming tokens 🙂 are fun"] * 20, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    return tmp_path


def test_hf_tokenizer_round_trip_and_streaming(tmp_path):
    d = _train_bpe(tmp_path)
    tok = load_tokenizer(str(d))
    assert isinstance(tok, HFTokenizer)
    text = "hello 世界 🙂 world"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert "".join(stream(tok, ids)) == text
    assert all("\ufffd" not in p for p in stream(tok, ids))


def test_load_tokenizer_rules(tmp_path):
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(str(tmp_path / "missing"))
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 4096}))
    assert load_tokenizer(str(tmp_path)) is None  # no tokenizer.json: token-id prompts only
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_tokenizer(str(tmp_path))
