"""Tokenizers: the embedded byte-level one, and Hugging Face `tokenizer.json` via `tokenizers`.

Both expose encode / decode and `decode_token(previous_ids, new_id)`, the text one streamed token adds,
which holds back partial UTF-8 sequences until they complete (so streamed text never shows U+FFFD
halfway through a multi-byte character).
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from typing import Protocol

BYTE_BOS = 256
BYTE_EOS = 257
BYTE_SPECIALS = 258
PRINTABLE_FIRST, PRINTABLE_COUNT = 32, 95
INCREMENTAL_WINDOW = 6  # tokens of context used to compute a new token's text


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def decode_token(self, previous: Sequence[int], new_id: int) -> str: ...


def _incremental(decode, previous: Sequence[int], new_id: int) -> str:
    """Text added by new_id given the previous ids, via the difference of two decodes of a short window."""
    window = list(previous[-INCREMENTAL_WINDOW:])
    before = decode(window)
    after = decode(window + [new_id])
    if after.endswith("\ufffd"):
        return ""  # an incomplete multi-byte character: emitted once it completes
    if before.endswith("\ufffd"):
        # the pending bytes of earlier tokens complete now: emit everything after the last clean prefix
        clean = before.rstrip("\ufffd")
        return after[len(clean):] if after.startswith(clean) else after
    return after[len(before):] if after.startswith(before) else after


class ByteTokenizer:
    """ids 0..255 are bytes, 256 = BOS, 257 = EOS; ids >= 258 render as one printable ASCII character
    (chr(32 + (id - 258) % 95)) so the random-weight embedded model's output is visible text."""

    bos_token_id = BYTE_BOS
    eos_token_id = BYTE_EOS

    def __init__(self, vocab_size: int = 4096) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

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

    def decode_token(self, previous: Sequence[int], new_id: int) -> str:
        return _incremental(self.decode, previous, new_id)


class HFTokenizer:
    """A Hugging Face fast tokenizer loaded from a local tokenizer.json (never from a hub)."""

    def __init__(self, path: str | pathlib.Path) -> None:
        from tokenizers import Tokenizer as _Tok

        self._tok = _Tok.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def decode_token(self, previous: Sequence[int], new_id: int) -> str:
        return _incremental(self.decode, previous, new_id)


def load_tokenizer(model_path: str | None) -> Tokenizer | None:
    """The tokenizer for a model source: embedded (None) -> ByteTokenizer; a directory -> its
    tokenizer.json, else None: the model then takes token-id prompts only. (A byte-level fallback
    would silently feed a real model's vocabulary ids that mean something else.)"""
    if not model_path:
        return ByteTokenizer()
    d = pathlib.Path(model_path)
    if not d.is_dir():
        raise FileNotFoundError(f"model directory {d} does not exist")
    if (d / "tokenizer.json").is_file():
        try:
            return HFTokenizer(d / "tokenizer.json")
        except Exception as exc:  # tokenizers raises a bare Exception for malformed files
            raise ValueError(f"{d / 'tokenizer.json'}: cannot load: {exc}") from None
    return None
