"""A checkpoint's `generation_config.json`: the EOS ids generation stops on, and the sampling defaults a
request that leaves a field unset gets (as vLLM applies them: only the keys the file sets).

Real checkpoints list several EOS ids (Llama-3: `<|end_of_text|>`, `<|eot_id|>`, ...); stopping on only the
first would run a chat answer on past its end. `do_sample: false` in the file means greedy by default (the
file's temperature / top_p / top_k are then not defaults, as in transformers). Keys that change sampling and
that the engine does not implement are listed in `unsupported` for the caller to log.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass, field
from typing import Any

from kunserve.shared.model.tokenizer import read_json_object

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "max_new_tokens")
UNSUPPORTED_KEYS = ("repetition_penalty", "min_p", "presence_penalty", "frequency_penalty", "typical_p", "min_new_tokens",
                    "no_repeat_ngram_size")


@dataclass(frozen=True)
class GenerationDefaults:
    eos_token_ids: tuple[int, ...] = ()
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_new_tokens: int | None = None
    unsupported: dict[str, Any] = field(default_factory=dict)  # set in the file, not applied


def _ids(value: Any, where: str) -> tuple[int, ...]:
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ValueError(f"{where}: eos_token_id must be a token id or a list of them, got {value!r}")
    return tuple(values)


def load_generation_defaults(model_dir: str | pathlib.Path | None, embedded_eos: int | None = None) -> GenerationDefaults:
    """The defaults of a model directory (None: the embedded model, whose only EOS is `embedded_eos`). EOS ids
    are generation_config.json's, else config.json's (each may be one id or a list)."""
    if model_dir is None:
        return GenerationDefaults(eos_token_ids=() if embedded_eos is None else (embedded_eos,))
    d = pathlib.Path(model_dir)
    gen_path, cfg_path = d / "generation_config.json", d / "config.json"
    gen = read_json_object(gen_path) if gen_path.is_file() else {}
    eos = _ids(gen.get("eos_token_id"), str(gen_path))
    if not eos and cfg_path.is_file():
        eos = _ids(read_json_object(cfg_path).get("eos_token_id"), str(cfg_path))
    values: dict[str, Any] = {}
    if gen.get("do_sample") is False:
        values["temperature"] = 0.0
    else:
        for key, kind in (("temperature", float), ("top_p", float), ("top_k", int)):
            if gen.get(key) is not None:
                v = gen[key]
                if not isinstance(v, (int, float)) or isinstance(v, bool):
                    raise ValueError(f"{gen_path}: {key} must be a number, got {v!r}")
                values[key] = kind(v)
    if gen.get("max_new_tokens") is not None:
        v = gen["max_new_tokens"]
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{gen_path}: max_new_tokens must be a positive integer, got {v!r}")
        values["max_new_tokens"] = v
    unsupported = {k: gen[k] for k in UNSUPPORTED_KEYS if gen.get(k) not in (None, 1.0, 0.0, 0)}
    return GenerationDefaults(eos_token_ids=eos, unsupported=unsupported, **values)
