"""Qwen3-style decoder in Flax NNX."""

from dvp_jax.model.attention import KVCache
from dvp_jax.model.config import (
    PRESETS,
    ROLLOUT_POLICY,
    TRAIN_POLICY,
    DTypePolicy,
    ModelConfig,
)
from dvp_jax.model.transformer import Transformer

__all__ = [
    "PRESETS",
    "ROLLOUT_POLICY",
    "TRAIN_POLICY",
    "DTypePolicy",
    "KVCache",
    "ModelConfig",
    "Transformer",
]
