"""The E10 check: the (1 - p) bound on the trainer/rollout log-probability mismatch.

`mismatch_bound(z', z)` measures |log p'_a - log p_a| against 2 eps (1 - min(p_a, p'_a)) per
position and token (docs/design.md E10), computed so that float32 rounding is relative to eps.
A measurement for tests and experiments (`experiments/e001_mismatch_bound.py`); the trainer
logs no field of it.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class BoundReport(NamedTuple):
    """Result of `mismatch_bound` (E10).

    Attributes:
      eps: `[...]` max_b |z'_b - z_b| per position.
      abs_logp_diff: `[..., V]` |log p'_a - log p_a| (or `[...]` for the given tokens).
      bound: same shape, factor * eps * (1 - min(p_a, p'_a)).
      within: same shape, bool, abs_logp_diff <= bound (+ a rounding allowance).
      frac_within: scalar float32, fraction of entries within the bound.
    """

    eps: jax.Array
    abs_logp_diff: jax.Array
    bound: jax.Array
    within: jax.Array
    frac_within: jax.Array


def _one_minus_softmax(z: jax.Array) -> jax.Array:
    """1 - softmax(z) `[..., V]`, accurate also for p close to 1 (no 1 - p cancellation).

    With e_b = exp(z_b - max z) and R = sum of e_b over all b except the argmax:
    1 - p_argmax = R / (1 + R) and 1 - p_a = ((1 - e_a) + R) / (1 + R) otherwise.
    """
    m = jnp.max(z, axis=-1, keepdims=True)
    e = jnp.exp(z - m)
    is_max = jax.nn.one_hot(jnp.argmax(z, axis=-1), z.shape[-1], dtype=bool)
    rest = jnp.sum(jnp.where(is_max, 0.0, e), axis=-1, keepdims=True)
    return jnp.where(is_max, rest, (1.0 - e) + rest) / (1.0 + rest)


def mismatch_bound(
    behaviour_logits: jax.Array,
    logits: jax.Array,
    y: jax.Array | None = None,
    *,
    temperature: float = 1.0,
    factor: float = 2.0,
    rel_tol: float = 1e-5,
) -> BoundReport:
    """Checks E10: |log p'_a - log p_a| <= 2 eps (1 - min(p_a, p'_a)), eps = max_b |z'_b - z_b|.

    Exact, not only first order: along z(s) = z + s (z' - z), d/ds log q_a(s) =
    sum_b q_b (d_a - d_b) with d = z' - z, so its size is at most 2 eps (1 - q_a(s)); and log q_a
    is concave in s (z_a is linear, logsumexp convex), so q_a(s) >= min(p_a, p'_a) on the segment.
    Here p = softmax(z / tau) (trainer), p' = softmax(z' / tau) (rollout), eps on the scaled
    logits. The difference is computed as d_a - log(sum_b p_b exp(d_b)) (log1p/expm1), so its
    float32 rounding is relative to eps, not to the size of the logits; `within` allows
    `rel_tol * eps` for that rounding.

    Args:
      behaviour_logits: `[..., V]` z' (e.g. the bf16 forward, upcast to float32).
      logits: `[..., V]` z (e.g. the fp32 forward).
      y: optional `[...]` token ids; when given, per-token arrays are for those tokens only.
      temperature: tau > 0.
      factor: the bound's constant; 2 is E10 (tests pass 1 to check a wrong bound is caught).
      rel_tol: rounding allowance, as a fraction of eps.

    Returns:
      `BoundReport`.
    """
    z = jnp.asarray(logits).astype(jnp.float32) / temperature
    zr = jnp.asarray(behaviour_logits).astype(jnp.float32) / temperature
    d = zr - z  # [..., V]
    eps = jnp.max(jnp.abs(d), axis=-1)  # [...]
    p = jax.nn.softmax(z, axis=-1)
    # log p'_a - log p_a = d_a - log sum_b p_b exp(d_b)
    shift = jnp.log1p(jnp.sum(p * jnp.expm1(d), axis=-1, keepdims=True))
    diff = jnp.abs(d - shift)
    one_minus_min_p = jnp.maximum(_one_minus_softmax(z), _one_minus_softmax(zr))
    bound = factor * eps[..., None] * one_minus_min_p
    if y is not None:
        take = lambda a: jnp.take_along_axis(a, y[..., None].astype(jnp.int32), axis=-1)[..., 0]
        diff, bound = take(diff), take(bound)
        eps_b = eps
    else:
        eps_b = eps[..., None]
    within = diff <= bound + rel_tol * eps_b
    return BoundReport(
        eps=eps,
        abs_logp_diff=diff,
        bound=bound,
        within=within,
        frac_within=jnp.mean(within.astype(jnp.float32)),
    )
