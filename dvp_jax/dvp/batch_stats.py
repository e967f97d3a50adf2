"""Per-batch statistics of what the loss and the sampler did (docs/design.md section 2,
"Diagnostics"): flat dicts of float32 scalars over `[B, T]` per-token arrays and a response mask.

`pruning_metrics` (delta_S and |V_S| on each side, and the one home of
frac_tokens_outside_train_safe), `truncation_metrics` (the rollout's top-k / top-p, E13),
`exclusion_metrics` and `is_weight_stats` (called by `losses.dvp_loss`). The mismatch between
the trainer and the rollout is `diagnostics.py`'s; nothing here enters a loss.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dvp_jax.dvp.masked import f32, masked_max, masked_mean
from dvp_jax.dvp.segments import Segments


def pruning_metrics(
    response_mask: jax.Array,
    *,
    pruned_mass: jax.Array | None = None,
    safe_size: jax.Array | None = None,
    behaviour_pruned_mass: jax.Array | None = None,
    behaviour_safe_size: jax.Array | None = None,
    in_safe: jax.Array | None = None,
) -> dict[str, jax.Array]:
    """Mean/max pruned mass delta_S (E3) and safe-set size |V_S| (E1) on each side.

    Keys: pruned_mass_train_* / safe_size_train_* from `pruned_mass` / `safe_size` (trainer),
    pruned_mass_rollout_* / safe_size_rollout_* from the `behaviour_*` arrays (rollout); each
    of these is omitted when its argument is None.

    Always frac_tokens_outside_train_safe: the fraction of sampled response tokens outside the
    trainer's safe set (E5); `in_safe` None means all inside (no pruning: V_S is the whole
    vocabulary), so the metric is 0 and present in every run whatever the method.

    Args:
      response_mask: `[B, T]` response tokens.
      pruned_mass, safe_size: `[B, T]` trainer delta_S and |V_S| at the sampled positions.
      behaviour_pruned_mass, behaviour_safe_size: `[B, T]` the same recorded by the rollout.
      in_safe: `[B, T]` bool, sampled token inside the trainer's V_S.

    Returns:
      Dict of float32 scalars.
    """
    mask = response_mask.astype(bool)
    out = {}
    named = {
        "pruned_mass_train": pruned_mass,
        "safe_size_train": safe_size,
        "pruned_mass_rollout": behaviour_pruned_mass,
        "safe_size_rollout": behaviour_safe_size,
    }
    for name, x in named.items():
        if x is not None:
            out[name + "_mean"] = masked_mean(x, mask)
            out[name + "_max"] = masked_max(x, mask)
    outside = jnp.zeros_like(mask) if in_safe is None else ~in_safe.astype(bool)
    out["frac_tokens_outside_train_safe"] = masked_mean(outside, mask)
    return out


def truncation_metrics(
    behaviour_truncated_mass: jax.Array, behaviour_kept_ids: jax.Array, response_mask: jax.Array
) -> dict[str, jax.Array]:
    """What the rollout's top-k / top-p truncation removed (E13), over response tokens.

    Keys: truncated_mass_rollout_mean / _max (mu's mass outside the kept set K),
    frac_positions_truncated (positions where K removed any mass), kept_size_rollout_mean (|K|
    over the truncated positions; 0 if none).

    Args:
      behaviour_truncated_mass: `[B, T]` mass outside K recorded by the rollout.
      behaviour_kept_ids: `[B, T, W]` K's ids (-1 padded; all -1: untruncated).
      response_mask: `[B, T]` response tokens.
    """
    mask = response_mask.astype(bool)
    size = jnp.sum(behaviour_kept_ids >= 0, axis=-1)
    truncated = mask & (size > 0)
    return {
        "truncated_mass_rollout_mean": masked_mean(behaviour_truncated_mass, mask),
        "truncated_mass_rollout_max": masked_max(behaviour_truncated_mass, mask),
        "frac_positions_truncated": masked_mean(behaviour_truncated_mass > 0, mask),
        "kept_size_rollout_mean": masked_mean(size, truncated),
    }


def exclusion_metrics(
    response_mask: jax.Array,
    excluded: jax.Array,
    seq_masked: jax.Array,
    token_masked: jax.Array,
    segments: Segments | None = None,
) -> dict[str, jax.Array]:
    """Fractions of responses excluded (E5) or masked (E7 seq_mis) and of tokens masked (token_mis).

    Args:
      response_mask: `[B, T]` response tokens; responses without tokens are not counted.
      excluded: per response (`segments`' shape, `[B, 1]` one per row; `[B]` also works then),
        bool, response has a sampled token outside the trainer safe set (E5).
      seq_masked: per response, bool, response masked by the correction (seq_mis, exp L > C;
        seq_geo_rs / seq_k3_rs, E7b).
      token_masked: `[B, T]` bool, token masked by the correction (token_mis, exp l_t > C;
        token_icepop, E7b).
      segments: which response each token belongs to (None: one response per row).

    Returns:
      frac_responses_excluded and frac_responses_masked (over responses with tokens),
      frac_tokens_masked (over response tokens).
    """
    mask = response_mask.astype(bool)
    has_tokens = (segments or Segments()).any(mask).reshape(excluded.shape)
    return {
        "frac_responses_excluded": masked_mean(excluded, has_tokens),
        "frac_responses_masked": masked_mean(seq_masked, has_tokens),
        "frac_tokens_masked": masked_mean(token_masked, mask),
    }


def is_weight_stats(weights: jax.Array, mask: jax.Array) -> dict[str, jax.Array]:
    """Importance-weight mean, max and normalised effective sample size (E7 weights).

    ESS = (sum w)^2 / (n sum w^2) in (0, 1] (1 when all weights are equal), n = masked count.

    Args:
      weights: `[...]` applied weights w (per token or per response).
      mask: `[...]` which weights count (kept tokens or kept responses).

    Returns:
      is_weight_mean, is_weight_max, is_weight_ess (float32 scalars; 0 / 0 / 1 when empty).
    """
    mask = mask.astype(bool)
    w = jnp.where(mask, f32(weights), 0.0)
    n = jnp.sum(mask)
    sum_w, sum_w2 = jnp.sum(w), jnp.sum(w * w)
    ess = jnp.where(sum_w2 > 0, sum_w * sum_w / jnp.maximum(n * sum_w2, 1e-30), 1.0)
    return {
        "is_weight_mean": sum_w / jnp.maximum(n, 1),
        "is_weight_max": masked_max(w, mask),
        "is_weight_ess": ess,
    }
