"""Which tokens of a `[B, T]` layout belong to which response: per-response sums and spreads.

The loss (E5-E9) and the diagnostics reduce per response (does a response hold a token outside
the safe set; its sequence log-ratio L; its mean log-prob) and spread the result back over its
tokens. Two layouts hold responses:

* one response per row (`Segments()`, `ids` None): the padded batch, row b is response b;
  per-response arrays are `[B, 1]` and every reduction is a plain sum over the row, so this
  layout computes exactly what a `[B]`-per-response implementation would;
* packed rows (`Segments(ids, count)`): `ids[b, t]` = k in 1..count names the k-th sequence of
  row b, 0 marks padding; per-response arrays are `[B, count]` (slot k-1 is sequence k; a slot
  no sequence uses holds zeros), each reduced with a segment sum within its row, so rows stay
  independent (and shard over the batch axes like every other `[B, ...]` array).

`spread` returns an array that broadcasts against `[B, T]`: `[B, 1]` for one response per row,
`[B, T]` for packed rows (padding gets zeros / False).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Segments:
    """The response each token belongs to (module docstring).

    Attributes:
      ids: `[B, T]` int32 sequence of each token within its row (1..count; 0 padding), or None:
        row b is one response.
      count: the most sequences a row holds (static); 1 when `ids` is None.
    """

    ids: jax.Array | None = None
    count: int = dataclasses.field(default=1, metadata=dict(static=True))

    @property
    def packed(self) -> bool:
        return self.ids is not None

    def _segment(self, op, x):
        """`op` (a `jax.ops.segment_*`) of `x` `[B, T]` per sequence of each row: `[B, count]`."""
        per_row = lambda v, s: op(v, s, num_segments=self.count + 1)
        return jax.vmap(per_row)(x, self.ids)[:, 1:]  # slot 0 is padding

    def sum(self, x: jax.Array) -> jax.Array:
        """Per-response sums of `x` `[B, T]`: `[B, 1]` or `[B, count]`."""
        if not self.packed:
            return jnp.sum(x, axis=-1, keepdims=True)
        return self._segment(jax.ops.segment_sum, x)

    def any(self, x: jax.Array) -> jax.Array:
        """Per-response "any token is True" of bool `x` `[B, T]`."""
        if not self.packed:
            return jnp.any(x, axis=-1, keepdims=True)
        return self._segment(jax.ops.segment_sum, x.astype(jnp.int32)) > 0

    def max(self, x: jax.Array) -> jax.Array:
        """Per-response max of `x` `[B, T]` (the dtype's lowest value for a slot no token uses)."""
        if not self.packed:
            return jnp.max(x, axis=-1, keepdims=True)
        return self._segment(jax.ops.segment_max, x)

    def spread(self, y: jax.Array) -> jax.Array:
        """Per-response `y` back on each response's tokens: broadcastable against `[B, T]`."""
        if not self.packed:
            return y
        padded = jnp.concatenate([jnp.zeros_like(y[:, :1]), y], axis=1)  # [B, count + 1]
        return jnp.take_along_axis(padded, self.ids, axis=1)
