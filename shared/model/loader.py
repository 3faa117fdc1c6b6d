"""Compatibility re-export: `load_model_source` and `ModelSource` live in weights.py."""

from kunserve.shared.model.weights import ModelSource, load_model_source

__all__ = ["ModelSource", "load_model_source"]
