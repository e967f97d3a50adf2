"""Dynamic vocabulary pruning: safe set (E1), pruned log-probabilities (E2), pruned mass (E3).

The one implementation of E1-E3 (docs/design.md section 2) from logits `[..., V]` in memory:
`safe_set_sums` is the core (row max, safe mask, exp(z - max) and its sums inside and outside
V_S) and `token_logprobs` turns it into the `TokenLogprobs` record of given tokens;
`pruned_token_logprobs` (the small-shape reference path) and the rollout sampler
(`rollout/sampling.py`) are built on them. The trainer's form, from hidden states and the
unembedding in vocabulary chunks, is `dvp_jax/dvp/chunked.py`; it is not re-exported here.

`log_rho` <= 0, `None` or -inf meaning no pruning, is a Python number or a (traced) array here.
Numerics: float32 statistics; exponentials only of z - max <= 0; E2's -inf outside V_S is the
finite `LOGP_FLOOR`, chosen by `jnp.where`; the pruned mass is summed from the pruned terms.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp

# Stands in for E2's -inf outside the safe set. Finite so that it survives arithmetic (exp gives
# exactly 0 in float32), large enough that nobody mistakes it for a log-probability.
LOGP_FLOOR = -1e9


class TokenLogprobs(NamedTuple):
    """Log-probabilities of given tokens y under one distribution, pruned and full (E1-E3).

    The one record for "log-probs of given tokens": the trainer's (`chunked_pruned_logprobs`),
    the reference path's (`pruned_token_logprobs`) and the rollout sampler's (sampled tokens, E4).
    Stored on the rollout side, its fields take the `behaviour_` prefix (`behaviour_logp`, ...).

    Attributes:
      logp: `[N]` float32, log pi_S(y) (E2); `LOGP_FLOOR` where y is outside V_S.
      in_safe: `[N]` bool, whether y is in V_S (E1).
      pruned_mass: `[N]` float32, delta_S (E3).
      safe_size: `[N]` int32, |V_S| (E1).
      logp_full: `[N]` float32, unpruned log pi(y) = z_y - logsumexp_b z_b.
    """

    logp: jax.Array
    in_safe: jax.Array
    pruned_mass: jax.Array
    safe_size: jax.Array
    logp_full: jax.Array


# The paper's min-p threshold, rho = e^-13: the one default every config and the sampler take.
DEFAULT_LOG_RHO = -13.0
# The sampling temperature every config, the sampler and the loss default to.
DEFAULT_TEMPERATURE = 1.0


def check_log_rho(log_rho, name: str = "log_rho") -> float:
    """The one rule for a log min-p threshold: a number <= 0, or -inf (no pruning).

    Returns it as a float; raises ValueError naming `name` (the caller's field) otherwise.
    `None` is not accepted here: callers that allow it map it to -inf first.
    """
    if isinstance(log_rho, bool) or not isinstance(log_rho, int | float):
        raise ValueError(f"{name} must be a number <= 0 or -inf (no pruning), got {log_rho!r}.")
    log_rho = float(log_rho)
    if math.isnan(log_rho) or log_rho > 0:
        raise ValueError(f"{name} must be a number <= 0 or -inf (no pruning), got {log_rho}.")
    return log_rho


def check_temperature(temperature, name: str = "temperature") -> float:
    """The one rule for a sampling temperature tau (E1, E2): a finite number > 0.

    Returns it as a float; raises ValueError naming `name` (the caller's field) otherwise.
    """
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise ValueError(f"{name} must be a finite number > 0, got {temperature!r}.")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {temperature}.")
    return float(temperature)


def pruning_enabled(log_rho: float | None) -> bool:
    """Whether `log_rho` (a Python number or None) prunes anything (E1)."""
    return log_rho is not None and log_rho != -math.inf


def _check_static_args(log_rho, temperature) -> float:
    """Validates a static `log_rho` / `temperature` pair and returns log_rho as a float."""
    log_rho = check_log_rho(-math.inf if log_rho is None else log_rho)
    check_temperature(temperature)
    return log_rho


def _scaled_logits(logits: jax.Array, temperature) -> jax.Array:
    # Upcast before the temperature so every softmax statistic below is float32.
    return logits.astype(jnp.float32) / temperature


def _as_log_rho(log_rho) -> jax.Array:
    return jnp.asarray(-jnp.inf if log_rho is None else log_rho, jnp.float32)


class SafeSetSums(NamedTuple):
    """The E1-E3 building blocks of one distribution, from float32 scaled logits z `[..., V]`.

    Attributes:
      z_max: `[..., 1]` max_b z_b, under stop-gradient (the E1-E3 values built from these
        are invariant to the shift, so it needs no gradient).
      shifted: `[..., V]` z - z_max (<= 0).
      safe: `[..., V]` bool, V_S = {a : z_a >= z_max + log_rho} (E1); the argmax is inside.
      exp_shifted: `[..., V]` exp(z - z_max) in [0, 1], exactly 1 at the argmax.
      sum_safe: `[..., 1]` sum of `exp_shifted` over V_S (>= 1, the argmax is safe).
      sum_out: `[..., 1]` sum of `exp_shifted` outside V_S.
    """

    z_max: jax.Array
    shifted: jax.Array
    safe: jax.Array
    exp_shifted: jax.Array
    sum_safe: jax.Array
    sum_out: jax.Array

    @property
    def pruned_mass(self) -> jax.Array:
        """`[...]` delta_S = sum_out / (sum_safe + sum_out) (E3), from the pruned terms
        themselves: 1 - sum_safe / sum_full would lose masses of order 1e-7 (the typical size
        for rho = e^-13) to cancellation."""
        return (self.sum_out / (self.sum_safe + self.sum_out))[..., 0]

    @property
    def safe_size(self) -> jax.Array:
        """`[...]` int32 |V_S| (E1)."""
        return jnp.sum(self.safe, axis=-1, dtype=jnp.int32)


def safe_set_sums(
    z: jax.Array, log_rho: float | jax.Array | None, kept: jax.Array | None = None
) -> SafeSetSums:
    """The core of E1-E3 on already-scaled float32 logits z `[..., V]` (z = logits / tau).

    With a truncation set K (`kept`, E13) the support is V_T = {a in K : z_a >= max_{b in K} z_b
    + log_rho}: E1 applied to z restricted to K, and `safe` / `sum_safe` / `pruned_mass` /
    `safe_size` describe V_T (the shift stays the global max, so every exponential is <= 1).

    Args:
      z: `[..., V]` float32 scaled logits.
      log_rho: log min-p threshold (<= 0), a Python number or a (traced) float array broadcasting
        against `z[..., :1]`; None or -inf keeps the full vocabulary.
      kept: `[..., V]` bool truncation set K (`kept_mask`); None: K is the whole vocabulary.

    Returns:
      `SafeSetSums`.
    """
    z_max = jax.lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))
    shifted = z - z_max
    if kept is None:
        safe = z >= z_max + _as_log_rho(log_rho)  # E1
    else:  # E13: E1 relative to the kept set's max
        kept_max = jax.lax.stop_gradient(
            jnp.max(jnp.where(kept, z, -jnp.inf), axis=-1, keepdims=True)
        )
        safe = kept & (z >= kept_max + _as_log_rho(log_rho))
    e = jnp.exp(shifted)  # <= 1, never overflows
    return SafeSetSums(
        z_max=z_max,
        shifted=shifted,
        safe=safe,
        exp_shifted=e,
        sum_safe=jnp.sum(jnp.where(safe, e, 0.0), axis=-1, keepdims=True),
        sum_out=jnp.sum(jnp.where(safe, 0.0, e), axis=-1, keepdims=True),
    )


def token_logprobs(sums: SafeSetSums, y: jax.Array) -> TokenLogprobs:
    """E2-E3 of tokens y under the distribution summarised by `sums` (from `safe_set_sums`).

    log pi_S(y) = (z_y - z_max) - log sum_safe for y in V_S, else `LOGP_FLOOR` (E2);
    log pi(y) = (z_y - z_max) - log(sum_safe + sum_out); delta_S and |V_S| as in `SafeSetSums`.

    Args:
      sums: the core of one distribution per row, leading shape `[...]`.
      y: `[...]` int token ids in [0, V).

    Returns:
      `TokenLogprobs` with fields of shape `[...]`.
    """
    take = lambda a: jnp.take_along_axis(a, y[..., None].astype(jnp.int32), axis=-1)[..., 0]
    shifted_y = take(sums.shifted)
    in_safe = take(sums.safe)
    return TokenLogprobs(
        logp=jnp.where(in_safe, shifted_y - jnp.log(sums.sum_safe[..., 0]), LOGP_FLOOR),
        in_safe=in_safe,
        pruned_mass=sums.pruned_mass,
        safe_size=sums.safe_size,
        logp_full=shifted_y - jnp.log((sums.sum_safe + sums.sum_out)[..., 0]),
    )


def pruned_token_logprobs(
    logits: jax.Array,
    y: jax.Array,
    log_rho: float | jax.Array | None,
    temperature=1.0,
    kept_ids: jax.Array | None = None,
) -> TokenLogprobs:
    """Log pi_S(y) (E2) and friends from full logits, by gather (the unchunked path).

    Args:
      logits: `[..., V]` logits.
      y: `[...]` int token ids in [0, V).
      log_rho: log min-p threshold; None or -inf means no pruning.
      temperature: tau > 0.
      kept_ids: `[..., W]` the rollout's kept set K of each position (E13, `kept_mask`); None
        or W = 0: no truncation.

    Returns:
      `TokenLogprobs` with fields of shape `[...]`.
    """
    z = _scaled_logits(logits, temperature)
    kept = None
    if kept_ids is not None and kept_ids.shape[-1] > 0:
        kept = kept_mask(kept_ids, z.shape[-1])
    return token_logprobs(safe_set_sums(z, log_rho, kept), y)


def kept_mask(kept_ids: jax.Array, vocab: int) -> jax.Array:
    """`[..., V]` bool truncation set K (E13) from the rollout's kept ids `[..., W]`.

    `kept_ids` lists K's token ids, padded with -1; a row of -1 only (a position sampled
    without truncation, or no position at all) means K = the whole vocabulary.
    """
    lead, width = kept_ids.shape[:-1], kept_ids.shape[-1]
    ids = kept_ids.reshape(-1, width)
    rows = jnp.arange(ids.shape[0])[:, None]
    # -1 goes to a dump column V, cut off after the scatter.
    cols = jnp.where(ids >= 0, ids, vocab)
    mask = jnp.zeros((ids.shape[0], vocab + 1), bool).at[rows, cols].set(True)[:, :vocab]
    untruncated = jnp.all(ids < 0, axis=-1, keepdims=True)
    return (mask | untruncated).reshape(*lead, vocab)


__all__ = [
    "DEFAULT_LOG_RHO",
    "DEFAULT_TEMPERATURE",
    "LOGP_FLOOR",
    "SafeSetSums",
    "TokenLogprobs",
    "check_log_rho",
    "check_temperature",
    "kept_mask",
    "pruned_token_logprobs",
    "pruning_enabled",
    "safe_set_sums",
    "token_logprobs",
]
