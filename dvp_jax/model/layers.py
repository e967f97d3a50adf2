"""Basic layers: RMSNorm, rotary position embedding, SwiGLU MLP, parameter helpers.

Einsum letters (docs/design.md section 5): b batch, t time, d model, n heads, k kv heads,
h head dim, f ffw, v vocab.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dvp_jax.model.config import DTypePolicy
from dvp_jax.sharding import Sharder


def param(rngs: nnx.Rngs, shape, axes, std: float, dtype) -> nnx.Param:
    """A normal(0, std) parameter tagged with its logical axis names."""
    value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
    return nnx.Param(value.astype(dtype), logical_axes=tuple(axes))


class RMSNorm(nnx.Module):
    """y = w * x / sqrt(mean(x^2) + eps) over the last axis (Qwen3RMSNorm)."""

    def __init__(self, dim: int, eps: float, policy: DTypePolicy, axis_name: str = "norm"):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), policy.param_dtype), logical_axes=(axis_name,))

    def __call__(self, x: jax.Array) -> jax.Array:
        # Statistics in float32 whatever the activation dtype; cast back before the scale, as
        # Hugging Face does, so bf16 rounding matches the reference implementation.
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...].astype(x.dtype) * y.astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding in the "rotate half" layout used by Qwen3.

    Args:
      x: [b, t, n, h] queries or keys.
      positions: [b, t] integer positions.
      theta: RoPE base.
    Returns:
      [b, t, n, h] in x's dtype; the rotation itself runs in float32.
    """
    h = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))  # [h/2]
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [b, t, h/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., : h // 2], x32[..., h // 2 :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class MLP(nnx.Module):
    """SwiGLU: down(silu(x @ gate) * (x @ up))."""

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        std: float,
        policy: DTypePolicy,
        sharder: Sharder,
        *,
        rngs: nnx.Rngs,
    ):
        dt = policy.param_dtype
        self.gate = param(rngs, (d_model, d_ff), ("embed", "mlp"), std, dt)
        self.up = param(rngs, (d_model, d_ff), ("embed", "mlp"), std, dt)
        self.down = param(rngs, (d_ff, d_model), ("mlp", "embed"), std, dt)
        self.compute_dtype = policy.compute_dtype
        self.sharder = sharder

    def __call__(self, x: jax.Array) -> jax.Array:
        cd = self.compute_dtype
        # [b, t, d] x [d, f] -> [b, t, f]
        gate = jnp.einsum("btd,df->btf", x, self.gate[...].astype(cd))
        up = jnp.einsum("btd,df->btf", x, self.up[...].astype(cd))
        hidden = self.sharder.constrain(jax.nn.silu(gate) * up, ("act_batch", "act_seq", "act_mlp"))
        # [b, t, f] x [f, d] -> [b, t, d]
        return jnp.einsum("btf,fd->btd", hidden, self.down[...].astype(cd))
