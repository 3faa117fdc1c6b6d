"""Tokenizers: the embedded byte-level one, and a Hugging Face directory via `tokenizers`.

A text prompt must become the ids `transformers`' `AutoTokenizer` would give the model, or a real checkpoint
sees a different prompt from the one its users tested (a missing or doubled BOS changes every logit). So an
HF directory is read the way transformers 5.x's fast-tokenizer backend reads it: `tokenizer.json`'s pipeline
and post-processor (with `add_special_tokens=True`: a BOS is added exactly when that post-processor adds
one; `add_bos_token` / `add_eos_token` in `tokenizer_config.json` are dropped whenever `tokenizer.json`
exists, as transformers 5.x drops them), the named special tokens of `tokenizer_config.json` /
`special_tokens_map.json` registered as special, and `split_special_tokens` honoured. A rendered chat is
encoded without added specials (its template writes them), as `apply_chat_template` does.

Streaming text goes through `decode_stream()`: one stateful decoder per request (`tokenizers`'
`DecodeStream` for HF tokenizers, an incremental UTF-8 decoder for the byte one) whose pieces, concatenated,
equal `decode` of all the ids, and never end halfway through a multi-byte character.
"""

from __future__ import annotations

import codecs
import json
import pathlib
from collections.abc import Sequence
from typing import Any, Protocol

BYTE_BOS = 256
BYTE_EOS = 257
BYTE_SPECIALS = 258
PRINTABLE_FIRST, PRINTABLE_COUNT = 32, 95
# The embedded model's chat format (role tags, one line each): what the front renders its chats with, and what
# `kunserve export-model` writes into tokenizer_config.json, so a chat served either way is the same prompt.
EMBEDDED_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class TextStream(Protocol):
    def step(self, token_id: int) -> str: ...


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def encode_chat(self, rendered: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def decode_stream(self) -> TextStream: ...


class _ByteStream:
    def __init__(self, tok: ByteTokenizer) -> None:
        self._tok = tok
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def step(self, token_id: int) -> str:
        return self._utf8.decode(self._tok._bytes([token_id]))


class ByteTokenizer:
    """ids 0..255 are bytes, 256 = BOS, 257 = EOS; ids >= 258 render as one printable ASCII character
    (chr(32 + (id - 258) % 95)) so the random-weight embedded model's output is visible text. No BOS is
    added to a prompt (the embedded model was never trained with one)."""

    bos_token_id = BYTE_BOS
    eos_token_id = BYTE_EOS
    chat_template: str | None = EMBEDDED_CHAT_TEMPLATE
    special_tokens: dict[str, str] = {"bos_token": "<s>", "eos_token": "</s>"}
    source = "the embedded byte tokenizer"

    def __init__(self, vocab_size: int = 4096) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_chat(self, rendered: str) -> list[int]:
        return self.encode(rendered)

    def _bytes(self, ids: Sequence[int]) -> bytes:
        out = bytearray()
        for i in ids:
            if 0 <= i < 256:
                out.append(i)
            elif i >= BYTE_SPECIALS:
                out.append(PRINTABLE_FIRST + (i - BYTE_SPECIALS) % PRINTABLE_COUNT)
        return bytes(out)

    def decode(self, ids: Sequence[int]) -> str:
        return self._bytes(ids).decode("utf-8", errors="replace")

    def decode_stream(self) -> TextStream:
        return _ByteStream(self)


class _HFStream:
    def __init__(self, tok: Any) -> None:
        from tokenizers.decoders import DecodeStream

        self._tok = tok
        self._stream = DecodeStream(skip_special_tokens=True)

    def step(self, token_id: int) -> str:
        return self._stream.step(self._tok, token_id) or ""


def _token_content(value: Any, where: str) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict with `content`."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"{where}: expected a string or an object with 'content', got {value!r}")


def read_json_object(path: pathlib.Path) -> dict[str, Any]:
    """A model directory's JSON file that must hold an object; a bad one is a ValueError naming the file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


class HFTokenizer:
    """A Hugging Face fast tokenizer from a local directory (never from a hub): tokenizer.json plus, when
    present, tokenizer_config.json / special_tokens_map.json / chat_template.jinja."""

    def __init__(self, path: str | pathlib.Path, tokenizer_config: dict[str, Any] | None = None) -> None:
        from tokenizers import AddedToken
        from tokenizers import Tokenizer as _Tok

        path = pathlib.Path(path)
        self.source = str(path.parent)
        self._tok = _Tok.from_file(str(path))
        conf = dict(tokenizer_config or {})
        where = f"{path.parent / 'tokenizer_config.json'}"
        self.special_tokens: dict[str, str] = {}
        for key in SPECIAL_TOKEN_KEYS:
            content = _token_content(conf.get(key), f"{where}: {key}")
            if content is not None:
                self.special_tokens[key] = content
        # Named special tokens the backend does not yet treat as added tokens become special ones (transformers
        # does the same), so their text in a prompt maps to their id.
        added = {t.content for t in self._tok.get_added_tokens_decoder().values()}
        missing = [c for c in self.special_tokens.values() if c not in added]
        if missing:
            self._tok.add_special_tokens([AddedToken(c, special=True) for c in dict.fromkeys(missing)])
        self._tok.encode_special_tokens = bool(conf.get("split_special_tokens", False))
        self.bos_token_id = self._id_of("bos_token")
        self.eos_token_id = self._id_of("eos_token")
        template = conf.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            if "default" not in named:
                raise ValueError(f"{where}: chat_template lists {sorted(map(str, named))} but no 'default'")
            template = named["default"]
        if template is not None and not isinstance(template, str):
            raise ValueError(f"{where}: chat_template must be a string, got {type(template).__name__}")
        self.chat_template: str | None = template

    def _id_of(self, key: str) -> int | None:
        content = self.special_tokens.get(key)
        return None if content is None else self._tok.token_to_id(content)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=True).ids

    def encode_chat(self, rendered: str) -> list[int]:
        return self._tok.encode(rendered, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def decode_stream(self) -> TextStream:
        return _HFStream(self._tok)


def _tokenizer_config(d: pathlib.Path) -> dict[str, Any]:
    """tokenizer_config.json, with special_tokens_map.json filling named tokens it lacks and chat_template.jinja
    (the file recent transformers versions write) taking the place of an inline chat_template."""
    conf = read_json_object(d / "tokenizer_config.json") if (d / "tokenizer_config.json").is_file() else {}
    if (d / "special_tokens_map.json").is_file():
        for key, value in read_json_object(d / "special_tokens_map.json").items():
            if key in SPECIAL_TOKEN_KEYS and conf.get(key) is None:
                conf[key] = value
    jinja = d / "chat_template.jinja"
    if jinja.is_file():
        conf["chat_template"] = jinja.read_text(encoding="utf-8")
    return conf


def load_tokenizer(model_path: str | None) -> Tokenizer | None:
    """The tokenizer for a model source: embedded (None) -> ByteTokenizer; a directory -> its
    tokenizer.json (+ tokenizer_config.json), else None: the model then takes token-id prompts only. (A
    byte-level fallback would silently feed a real model's vocabulary ids that mean something else.)"""
    if not model_path:
        return ByteTokenizer()
    d = pathlib.Path(model_path)
    if not d.is_dir():
        raise FileNotFoundError(f"model directory {d} does not exist")
    if not (d / "tokenizer.json").is_file():
        return None
    conf = _tokenizer_config(d)
    try:
        return HFTokenizer(d / "tokenizer.json", conf)
    except ValueError:
        raise
    except Exception as exc:  # tokenizers raises a bare Exception for malformed files
        raise ValueError(f"{d / 'tokenizer.json'}: cannot load: {exc}") from None
