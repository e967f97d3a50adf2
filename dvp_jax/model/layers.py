"""Basic layers: RMSNorm, rotary position embedding, SwiGLU MLP, parameter helpers.

Einsum letters (docs/design.md section 5): b batch, t time, d model, n heads, k kv heads,
h head dim, f ffw, v vocab.

Layers built with `layers=L` hold a stack of L layers' parameters: each parameter gets a leading
`[L]` axis with the logical name "layers" (replicated by both rule tables), and the module is
called on one layer's slice inside `nnx.scan` (`dvp_jax/model/transformer.py`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dvp_jax.model.config import DTypePolicy
from dvp_jax.sharding import Sharder


def stacked(shape, axes, layers: int | None) -> tuple[tuple, tuple]:
    """(shape, logical axes) with a leading `[layers]` axis named "layers" (unchanged if None)."""
    if layers is None:
        return tuple(shape), tuple(axes)
    return (layers, *shape), ("layers", *axes)


def param(rngs: nnx.Rngs, shape, axes, std: float, dtype, layers: int | None = None) -> nnx.Param:
    """A normal(0, std) parameter tagged with its logical axis names.

    With `layers=L` the parameter is `[L, *shape]` (one draw for the whole stack) and its axes
    start with "layers".
    """
    shape, axes = stacked(shape, axes, layers)
    value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
    return nnx.Param(value.astype(dtype), logical_axes=axes)


def matmul(spec: str, x: jax.Array, w: jax.Array, policy: DTypePolicy, **kwargs) -> jax.Array:
    """`jnp.einsum(spec, x, w)` at the policy's matmul precision, `w` cast to the compute dtype.

    Every matmul of the model goes through this function or passes `policy.precision` itself
    (the attention's q.k and p.v), so the policy alone decides the precision (docs/design.md
    section 3).
    """
    return jnp.einsum(spec, x, w.astype(policy.compute_dtype), precision=policy.precision, **kwargs)


class RMSNorm(nnx.Module):
    """y = w * x / sqrt(mean(x^2) + eps) over the last axis (Qwen3RMSNorm)."""

    def __init__(
        self,
        dim: int,
        eps: float,
        policy: DTypePolicy,
        axis_name: str = "norm",
        layers: int | None = None,
    ):
        self.eps = eps
        shape, axes = stacked((dim,), (axis_name,), layers)
        self.weight = nnx.Param(jnp.ones(shape, policy.param_dtype), logical_axes=axes)

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
        layers: int | None = None,
    ):
        dt = policy.param_dtype
        self.gate = param(rngs, (d_model, d_ff), ("embed", "mlp"), std, dt, layers)
        self.up = param(rngs, (d_model, d_ff), ("embed", "mlp"), std, dt, layers)
        self.down = param(rngs, (d_ff, d_model), ("mlp", "embed"), std, dt, layers)
        self.policy = policy
        self.sharder = sharder

    def __call__(self, x: jax.Array) -> jax.Array:
        p = self.policy
        # [b, t, d] x [d, f] -> [b, t, f]
        gate = matmul("btd,df->btf", x, self.gate[...], p)
        up = matmul("btd,df->btf", x, self.up[...], p)
        hidden = self.sharder.constrain(jax.nn.silu(gate) * up, ("act_batch", "act_seq", "act_mlp"))
        # [b, t, f] x [f, d] -> [b, t, d]
        return matmul("btf,fd->btd", hidden, self.down[...], p)
