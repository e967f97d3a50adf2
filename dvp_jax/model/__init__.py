"""Qwen3-style decoder in Flax NNX."""

from dvp_jax.model.config import (
    MIXED_TRAIN_POLICY,
    PRECISIONS,
    PRESETS,
    REMAT_POLICIES,
    ROLLOUT_POLICY,
    TRAIN_POLICY,
    TRAIN_PRECISIONS,
    DTypePolicy,
    ModelConfig,
)
from dvp_jax.model.kv_cache import KVCache
from dvp_jax.model.transformer import Transformer

__all__ = [
    "MIXED_TRAIN_POLICY",
    "PRECISIONS",
    "PRESETS",
    "REMAT_POLICIES",
    "ROLLOUT_POLICY",
    "TRAIN_POLICY",
    "TRAIN_PRECISIONS",
    "DTypePolicy",
    "KVCache",
    "ModelConfig",
    "Transformer",
]
