"""The tiny Llama of the unit tests: ``tiny_model_config(**overrides)``."""

from __future__ import annotations

# 2 layers, GQA (4 query heads over 2 kv heads), runs a forward in milliseconds on one CPU core.
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=32)


def tiny_model_config(**overrides):
    """A :class:`aligner.config.ModelConfig` of TINY with `overrides` (any ModelConfig field) applied.

    Raises TypeError for a field ModelConfig does not have.
    """
    from aligner.config import ModelConfig

    return ModelConfig(**{**TINY, **overrides})
