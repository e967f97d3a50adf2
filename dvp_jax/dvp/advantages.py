"""Group advantages: RLOO (E8, the paper's estimator) and GRPO (for comparison only).

Rewards arrive either flat `[P * G]` (the G responses of a prompt contiguous, prompt-major) or
grouped `[P, G]`; the advantage has the same shape as the rewards. Broadcasting over a response's
tokens is the loss's job (`losses.dvp_loss` takes `[B]` advantages, or the packer's per-token
ones). `zero_advantage` finds the groups whose advantages are all 0 (equal rewards).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _grouped(rewards: jax.Array, group_size: int) -> jax.Array:
    """`[P * G]` or `[P, G]` rewards -> `[P, G]` float32, with errors naming what is wrong."""
    if not isinstance(group_size, int) or group_size < 2:
        raise ValueError(
            f"group_size must be an int >= 2 (RLOO needs another response per prompt as the "
            f"baseline), got {group_size!r}."
        )
    rewards = jnp.asarray(rewards, jnp.float32)
    if rewards.ndim == 1:
        if rewards.shape[0] % group_size:
            raise ValueError(
                f"flat rewards of length {rewards.shape[0]} are not a whole number of groups of "
                f"group_size={group_size}."
            )
        return rewards.reshape(-1, group_size)
    if rewards.ndim == 2 and rewards.shape[1] == group_size:
        return rewards
    raise ValueError(
        f"rewards must be [P * G] or [P, G] with G = group_size = {group_size}; "
        f"got shape {rewards.shape}."
    )


def rloo(rewards: jax.Array, group_size: int) -> jax.Array:
    """RLOO advantage (E8): A_i = R_i - (1 / (G - 1)) sum_{j != i} R_j within each group.

    Equivalently A_i = G / (G - 1) (R_i - mean_g R_g).

    Args:
      rewards: `[P * G]` (groups contiguous) or `[P, G]` scalar rewards per response.
      group_size: G >= 2, responses per prompt (static).

    Returns:
      Advantages, float32, same shape as `rewards`.

    Raises:
      ValueError: group_size < 2 or rewards not a whole number of groups.
    """
    r = _grouped(rewards, group_size)  # [P, G]
    others = (jnp.sum(r, axis=1, keepdims=True) - r) / (group_size - 1)
    return (r - others).reshape(jnp.shape(rewards))


def grpo(
    rewards: jax.Array, group_size: int, *, scale_by_std: bool = True, eps: float = 1e-6
) -> jax.Array:
    """GRPO group-normalised advantage: A_i = (R_i - mean_g R) / (std_g R + eps).

    Not the paper's estimator (the paper uses RLOO, E8); here for comparison runs. The standard
    deviation is the unbiased one (ddof = 1), as in verl's GRPO; `scale_by_std=False` gives the
    Dr. GRPO variant A_i = R_i - mean_g R.

    Args:
      rewards: `[P * G]` (groups contiguous) or `[P, G]`.
      group_size: G >= 2 (static).
      scale_by_std: divide by the group standard deviation.
      eps: added to the standard deviation (groups with equal rewards get A = 0).

    Returns:
      Advantages, float32, same shape as `rewards`.
    """
    r = _grouped(rewards, group_size)  # [P, G]
    a = r - jnp.mean(r, axis=1, keepdims=True)
    if scale_by_std:
        a = a / (jnp.std(r, axis=1, keepdims=True, ddof=1) + eps)
    return a.reshape(jnp.shape(rewards))


def zero_advantage(rewards, group_size: int):
    """`[P * G]` bool: the responses of groups whose G rewards are all equal, so every RLOO
    advantage of the group is 0 (E8) and, with no KL or entropy term, so is its gradient (the
    responses `train.skip_zero_advantage` leaves out of the update, as DAPO's dynamic sampling
    does). Host NumPy; `rewards` flat `[P * G]`, groups contiguous."""
    r = np.asarray(rewards).reshape(-1, group_size)
    return np.repeat(np.all(r == r[:, :1], axis=1), group_size)
