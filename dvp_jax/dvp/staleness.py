"""The rollout/trainer mismatch split by staleness (partial rollouts, `rollout/partial.py`).

A token sampled under the current weights (age 0) differs from the trainer's log-prob by the
precision mismatch alone; one sampled under older weights (age a >= 1: the policy moved a
updates since) by precision plus policy lag. With r_t = log pi(y_t) - log mu(y_t) on the
unpruned log-probs (E6's l_t), over response tokens:

  age_share_0, age_share_1, age_share_2plus = the share of tokens of each age;
  mismatch_abs_age0 = mean_{age 0} |r_t|,   mismatch_abs_stale = mean_{age >= 1} |r_t|;
  kl_k1_age0 = mean_{age 0} (-r_t),         kl_k1_stale = mean_{age >= 1} (-r_t)

(0 where a group has no token). Pure functions of arrays; the step calls it when the batch
carries ages (`RLBatch.behaviour_age`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def staleness_metrics(
    logp_full: jax.Array, behaviour_logp_full: jax.Array, response_mask: jax.Array, age: jax.Array
) -> dict[str, jax.Array]:
    """The module docstring's metrics.

    Args:
      logp_full, behaviour_logp_full: `[B, T]` unpruned log pi(y_t), log mu(y_t) (float32).
      response_mask: `[B, T]` response tokens.
      age: `[B, T]` int32 weight versions between each token's sampling and this update.
    """
    mask = response_mask.astype(bool)
    r = (logp_full - behaviour_logp_full).astype(jnp.float32)
    total = jnp.maximum(jnp.sum(mask), 1)

    def mean(x, where):
        return jnp.sum(jnp.where(where, x, 0.0)) / jnp.maximum(jnp.sum(where), 1)

    fresh, stale = mask & (age == 0), mask & (age >= 1)
    return {
        "age_share_0": jnp.sum(fresh) / total,
        "age_share_1": jnp.sum(mask & (age == 1)) / total,
        "age_share_2plus": jnp.sum(mask & (age >= 2)) / total,
        "mismatch_abs_age0": mean(jnp.abs(r), fresh),
        "mismatch_abs_stale": mean(jnp.abs(r), stale),
        "kl_k1_age0": mean(-r, fresh),
        "kl_k1_stale": mean(-r, stale),
    }
