"""A model's fingerprint: what a worker that joins at run time is compared on (README "Discovery and autoscaling").

The shape (architecture, layers, hidden size, heads, vocabulary, context, dtype) comes from the model's config; the
checkpoint digest covers what would make two same-shaped checkpoints serve different tokens, read cheaply: the
config.json bytes and, of every ``*.safetensors`` file, its name, size and JSON header (tensor names, dtypes, shapes
and offsets), never the tensor bytes themselves. Two directories with identical headers but other weight values
(a fine-tune written with the same layout) therefore compare equal: a limit the README names. The embedded model's
digest is its seed (its weights are generated from it).
"""

from __future__ import annotations

import hashlib
import pathlib
import struct

from kunserve.shared.model.architecture import ModelConfig
from kunserve.shared.policy.membership import Fingerprint

MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own bound on its header


def checkpoint_digest(path: str | pathlib.Path | None, seed: int = 0) -> str:
    """``embedded seed N`` for the embedded model, else ``sha256:<hex>`` over config.json and the safetensors headers."""
    if not path:
        return f"embedded seed {seed}"
    d = pathlib.Path(path)
    h = hashlib.sha256()
    config = d / "config.json"
    if config.is_file():
        h.update(b"config.json\0" + config.read_bytes())
    for f in sorted(d.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}\0{size}\0".encode())
        with f.open("rb") as fh:
            raw = fh.read(8)
            if len(raw) == 8:
                (n,) = struct.unpack("<Q", raw)
                h.update(fh.read(min(n, MAX_HEADER_BYTES)))
    return "sha256:" + h.hexdigest()


def model_fingerprint(cfg: ModelConfig, name: str, path: str | pathlib.Path | None, seed: int = 0) -> Fingerprint:
    return Fingerprint(
        model_name=name,
        architecture=cfg.model_type,
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        intermediate_size=cfg.intermediate_size,
        vocab_size=cfg.vocab_size,
        max_model_len=cfg.max_position_embeddings,
        dtype=cfg.dtype,
        checkpoint=checkpoint_digest(path, seed),
    )
