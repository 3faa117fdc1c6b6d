"""`kunserve export-model DIR`: the embedded tiny model as a Hugging Face directory, so other tools
(`transformers`, vLLM, `vllm bench serve --tokenizer DIR`) can load *the same* model KunServe serves and be
compared with it side by side.

The directory holds config.json, model.safetensors (the seeded random weights), generation_config.json, a
`tokenizer.json` that encodes and decodes exactly as the embedded byte tokenizer (ids 0..255 are bytes, 256
`<s>`, 257 `</s>`, ids >= 258 one printable ASCII character each) and a tokenizer_config.json with a chat
template. How the byte tokenizer is expressed: a byte-level BPE without merges whose 256 single-character
tokens are the bytes in order; each id >= 258 is its character's byte-level form followed by a run of a
marker character that no byte maps to (unique strings for a vocabulary), which a `Replace` decoder strips
again. `split_special_tokens` keeps `<s>` in a prompt's text as bytes, as the byte tokenizer does.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Any

from kunserve.shared.model.architecture import TINY_CONFIG, ModelConfig
from kunserve.shared.model.tokenizer import (
    BYTE_BOS,
    BYTE_EOS,
    BYTE_SPECIALS,
    EMBEDDED_CHAT_TEMPLATE,
    PRINTABLE_COUNT,
    PRINTABLE_FIRST,
)

MARKER = "\u2063"  # INVISIBLE SEPARATOR: outside the byte-level alphabet (which stops at U+0143)
BOS_TOKEN, EOS_TOKEN = "<s>", "</s>"
def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2's bytes_to_unicode: the character each byte is written as in a byte-level vocabulary."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def byte_tokenizer_json(vocab_size: int) -> str:
    """tokenizer.json of the embedded byte tokenizer (see the module docstring)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = _byte_level_alphabet()
    vocab = {alphabet[b]: b for b in range(256)}
    vocab[BOS_TOKEN], vocab[EOS_TOKEN] = BYTE_BOS, BYTE_EOS
    for i in range(BYTE_SPECIALS, vocab_size):
        k = i - BYTE_SPECIALS
        vocab[alphabet[PRINTABLE_FIRST + k % PRINTABLE_COUNT] + MARKER * (1 + k // PRINTABLE_COUNT)] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.Sequence([decoders.Replace(MARKER, ""), decoders.ByteLevel()])
    tok.add_special_tokens([AddedToken(BOS_TOKEN, special=True), AddedToken(EOS_TOKEN, special=True)])
    return tok.to_str(pretty=True)


def tokenizer_config(cfg: ModelConfig) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "add_bos_token": False,
        "add_eos_token": False,
        "split_special_tokens": True,
        "clean_up_tokenization_spaces": False,
        "model_max_length": cfg.max_position_embeddings,
        "chat_template": EMBEDDED_CHAT_TEMPLATE,
    }


def export_model(directory: str | pathlib.Path, *, seed: int = 0, force: bool = False, log=print) -> pathlib.Path:
    """Write the embedded model (TINY_CONFIG, random_weights(seed)) as an HF directory; refuses a non-empty
    directory unless `force`."""
    from kunserve.shared.model.weights import random_weights, save_checkpoint

    d = pathlib.Path(directory)
    if d.exists() and not d.is_dir():
        raise FileExistsError(f"{d} exists and is not a directory")
    if d.is_dir() and any(d.iterdir()) and not force:
        raise FileExistsError(f"{d} is not empty; pass --force to write into it anyway")
    cfg = TINY_CONFIG
    log(f"exporting {cfg.name} ({cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, "
        f"weight seed {seed}) to {d}")
    save_checkpoint(d, cfg, random_weights(cfg, seed))
    log("  wrote config.json, model.safetensors")
    (d / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "do_sample": False}, indent=2) + "\n")
    (d / "tokenizer.json").write_text(byte_tokenizer_json(cfg.vocab_size))
    (d / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(cfg), indent=2) + "\n")
    log("  wrote generation_config.json, tokenizer.json, tokenizer_config.json (with a chat template)")
    log(f"done: load it with `kunserve up --model {d}` or transformers' from_pretrained({str(d)!r})")
    return d


def cmd_export_model(args: argparse.Namespace) -> None:
    from kunserve.shared.config import ConfigError, load_config

    try:
        seed = args.seed if args.seed is not None else load_config(args.config).model.seed
        export_model(args.directory, seed=seed, force=args.force)
    except (ConfigError, OSError) as exc:
        print(f"kunserve export-model: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def register(sub) -> None:
    p = sub.add_parser("export-model", help="write the embedded tiny model as a Hugging Face model directory")
    p.add_argument("directory", help="where to write it (must be empty or missing unless --force)")
    p.add_argument("--seed", type=int, help="weight seed (default: model.seed from the config, 0)")
    p.add_argument("--force", action="store_true", help="write into a non-empty directory")
    p.set_defaults(func=cmd_export_model)
