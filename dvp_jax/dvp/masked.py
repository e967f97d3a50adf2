"""Masked reductions of per-token arrays, shared by the diagnostics and the batch statistics:
values outside the mask (padding, -inf, NaN) are replaced before any arithmetic."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def f32(x):
    return jnp.asarray(x).astype(jnp.float32)


def masked_mean(x: jax.Array, mask: jax.Array, axis=None) -> jax.Array:
    """Mean of x `[...]` over a same-shape `mask` (0 when empty); used for E5-E9 fractions.

    Values outside the mask (including inf/NaN) are replaced before the sum.
    """
    mask = mask.astype(bool)
    total = jnp.sum(jnp.where(mask, f32(x), 0.0), axis=axis)
    count = jnp.sum(mask, axis=axis)
    return total / jnp.maximum(count, 1)


def masked_max(x: jax.Array, mask: jax.Array) -> jax.Array:
    mask = mask.astype(bool)
    return jnp.where(jnp.any(mask), jnp.max(jnp.where(mask, f32(x), -jnp.inf)), 0.0)
