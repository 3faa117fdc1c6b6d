"""One entry point for "the model a worker serves": the embedded default or a local HF directory."""

from __future__ import annotations

from dataclasses import dataclass

from kunserve.shared.model.config import TINY_CONFIG, ModelConfig
from kunserve.shared.model.tokenizer import Tokenizer, load_tokenizer
from kunserve.shared.model.weights import Weights, load_checkpoint, random_weights, read_config, select


@dataclass
class ModelSource:
    name: str
    config: ModelConfig
    path: str | None  # None = embedded
    seed: int = 0

    def load_weights(self, layer_range: tuple[int, int] | None = None) -> Weights:
        if self.path is None:
            return select(random_weights(self.config, self.seed), self.config, layer_range)
        return load_checkpoint(self.path, layer_range, dtype=self.config.dtype)[1]

    def tokenizer(self) -> Tokenizer | None:
        return load_tokenizer(self.path)


def load_model_source(path: str | None, *, seed: int = 0, dtype: str = "float32") -> ModelSource:
    if not path:
        cfg = TINY_CONFIG.replace(dtype=dtype)
        return ModelSource(cfg.name, cfg, None, seed)
    cfg = read_config(path, dtype)
    return ModelSource(cfg.name, cfg, path, seed)
