"""Mismatch diagnostics (docs/design.md section 2, "Diagnostics"): flat dicts of scalars.

Pure functions of `[B, T]` per-token arrays (B rows, T positions) and a `[B, T]` response mask;
masked positions may hold anything (-inf, NaN) and never reach arithmetic. A row is one response
unless `segments` (`dvp/segments.py`) says which packed sequence each token belongs to; every
per-response quantity is then reduced per sequence, with the same values. Each function
lists its keys: `mismatch_metrics` (verl's perplexity, KL and chi^2 definitions),
`peer_metrics` (the same mismatch under verl's, NeMo-RL's and slime's metric names),
`lt_by_p_bins` (the (1 - p) evidence),
`mismatch_diagnostics` (all config-independent ones) and `tail_metrics` (entropy, tail tokens,
the sequence log-ratio's share from outside the safe set). The E10 bound check is
`dvp_jax/dvp/bound.py` (`mismatch_bound` is re-exported here); the per-batch statistics of
pruning, truncation, exclusion and the importance weights are `batch_stats.py`; nothing here
enters a loss.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from dvp_jax.dvp.batch_stats import pruning_metrics
from dvp_jax.dvp.bound import BoundReport, mismatch_bound  # noqa: F401 (re-exported)
from dvp_jax.dvp.masked import f32, masked_max, masked_mean
from dvp_jax.dvp.segments import Segments

# Clamp on log-ratios before exponentiating for chi^2 (as verl's SAFETY_BOUND): exp(2 * 20) is
# finite in float32.
LOG_RATIO_BOUND = 20.0


# `frac_tokens_tail`: a sampled token is in the tail when its trainer probability is below this.
TAIL_P = 1e-3


def mismatch_metrics(
    logp: jax.Array,
    behaviour_logp: jax.Array,
    mask: jax.Array,
    prefix: str = "",
    segments: Segments | None = None,
) -> dict[str, jax.Array]:
    """Trainer/rollout log-probability mismatch metrics on the E6 log-ratios (verl definitions).

    With per-response mean log-probs mt_i = mean_t log pi(y_it), mr_i = mean_t log mu(y_it) and
    token log-ratio r_t = log pi - log mu:
      training_ppl = mean_i exp(-mt_i); rollout_ppl = mean_i exp(-mr_i);
      ppl_gap = mean_i |exp(-mr_i) - exp(-mt_i)|; log_ppl_diff = mean_i (mr_i - mt_i);
      kl_k1 = mean_t (-r_t) (estimates KL(mu || pi), samples are from mu);
      kl_k3 = mean_t (exp(r_t) - r_t - 1);
      chi2_token = mean_t exp(2 r_t) - 1; chi2_seq = mean_i exp(2 sum_t r_t) - 1
    (r clamped to +-20 before exp). Means over tokens are over all masked-in tokens; means over
    responses are over responses with at least one masked-in token.

    Args:
      logp: `[B, T]` trainer log-probs of the sampled tokens.
      behaviour_logp: `[B, T]` rollout (behaviour) log-probs of the same tokens.
      mask: `[B, T]` tokens to use (must exclude any position whose log-prob is a floor).
      prefix: prepended to every key.
      segments: which response each token belongs to (None: one response per row).

    Returns:
      Dict of float32 scalars.
    """
    seqs = segments or Segments()
    mask = mask.astype(bool)
    lt = jnp.where(mask, f32(logp), 0.0)
    lr = jnp.where(mask, f32(behaviour_logp), 0.0)
    count = seqs.sum(mask.astype(jnp.int32))  # per response
    seq = count > 0
    mt = seqs.sum(lt) / jnp.maximum(count, 1)
    mr = seqs.sum(lr) / jnp.maximum(count, 1)
    ppl_t, ppl_r = jnp.exp(-mt), jnp.exp(-mr)
    r = lt - lr  # 0 off the mask
    # mt - mr as the mean of per-token differences: no cancellation between two large means.
    mean_r = seqs.sum(r) / jnp.maximum(count, 1)
    r_safe = jnp.clip(r, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    r_seq = jnp.clip(seqs.sum(r), -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    out = {
        "training_ppl": masked_mean(ppl_t, seq),
        "rollout_ppl": masked_mean(ppl_r, seq),
        # |exp(-mr) - exp(-mt)| = exp(-mt) |expm1(mt - mr)|
        "ppl_gap": masked_mean(ppl_t * jnp.abs(jnp.expm1(mean_r)), seq),
        "log_ppl_diff": masked_mean(-mean_r, seq),
        "kl_k1": masked_mean(-r, mask),
        # expm1 keeps the small-mismatch regime accurate (exp(r) - 1 cancels).
        "kl_k3": masked_mean(jnp.expm1(r_safe) - r_safe, mask),
        "chi2_token": masked_mean(jnp.expm1(2.0 * r_safe), mask),
        "chi2_seq": masked_mean(jnp.expm1(2.0 * r_seq), seq),
    }
    return {prefix + k: v for k, v in out.items()}


def peer_metrics(
    logp: jax.Array,
    behaviour_logp: jax.Array,
    mask: jax.Array,
    segments: Segments | None = None,
) -> dict[str, jax.Array]:
    """The mismatch under the names verl, NeMo-RL and slime log it, computed as each computes it
    (docs/design.md "Metrics under the peers' names"; no clamp, as theirs have none).

    With r_t = log pi(y_t) - log mu(y_t) on the masked tokens and, per response with tokens,
    mt_i = mean_t log pi, mr_i = mean_t log mu, d_i = mr_i - mt_i:
      verl (`mismatch_helper.compute_mismatch_metrics`): mismatch_kl = mean_t (-r_t);
        mismatch_k3_kl = mean_t (exp r_t - r_t - 1); mismatch_training_ppl = mean_i exp(-mt_i);
        mismatch_training_log_ppl = mean_i (-mt_i); mismatch_rollout_ppl, _log_ppl the same of
        mr_i; mismatch_log_ppl_diff = mean_i d_i; mismatch_log_ppl_abs_diff = mean_i |d_i|;
        mismatch_log_ppl_diff_max / _min = max_i / min_i d_i; mismatch_ppl_ratio = mean_i
        exp(d_i);
      NeMo-RL (ClippedPGLossFn): token_mult_prob_error = mean_t exp(|r_t|);
      slime (policy_loss_function, per-sample reduction): train_rollout_logprob_abs_diff =
        mean_i mean_t |r_t|.
    Token means are over all masked tokens of the batch; response means over responses with
    at least one masked token.

    Args:
      logp, behaviour_logp: `[B, T]` trainer and rollout log-probs of the sampled tokens.
      mask: `[B, T]` tokens to use.
      segments: which response each token belongs to (None: one response per row).

    Returns:
      Dict of float32 scalars.
    """
    seqs = segments or Segments()
    mask = mask.astype(bool)
    lt = jnp.where(mask, f32(logp), 0.0)
    lr = jnp.where(mask, f32(behaviour_logp), 0.0)
    r = lt - lr  # 0 off the mask
    count = seqs.sum(mask.astype(jnp.float32))  # per response
    seq = count > 0
    n = jnp.maximum(count, 1.0)
    mt, mr = seqs.sum(lt) / n, seqs.sum(lr) / n
    d = -seqs.sum(r) / n  # mr - mt as a mean of differences (no cancellation)
    extreme = lambda x, sign: sign * masked_max(sign * x, seq)
    return {
        "mismatch_kl": masked_mean(-r, mask),
        "mismatch_k3_kl": masked_mean(jnp.exp(r) - r - 1.0, mask),
        "mismatch_training_ppl": masked_mean(jnp.exp(-mt), seq),
        "mismatch_training_log_ppl": masked_mean(-mt, seq),
        "mismatch_rollout_ppl": masked_mean(jnp.exp(-mr), seq),
        "mismatch_rollout_log_ppl": masked_mean(-mr, seq),
        "mismatch_log_ppl_diff": masked_mean(d, seq),
        "mismatch_log_ppl_abs_diff": masked_mean(jnp.abs(d), seq),
        "mismatch_log_ppl_diff_max": extreme(d, 1.0),
        "mismatch_log_ppl_diff_min": extreme(d, -1.0),
        "mismatch_ppl_ratio": masked_mean(jnp.exp(d), seq),
        "token_mult_prob_error": masked_mean(jnp.exp(jnp.abs(r)), mask),
        "train_rollout_logprob_abs_diff": masked_mean(seqs.sum(jnp.abs(r)) / n, seq),
    }


def lt_by_p_bins(
    log_ratio: jax.Array, p: jax.Array, mask: jax.Array, num_bins: int = 10
) -> dict[str, jax.Array]:
    """Token log-ratio l_t binned by 1 - p (the (1 - p) evidence behind E10).

    Bin k holds tokens with 1 - p in [k / K, (k + 1) / K) (p = 0 goes to the last bin). Reports
    per bin the mean signed l_t (systematic bias), mean |l_t| and the token count.

    Args:
      log_ratio: `[B, T]` l_t = log pi(y_t) - log mu(y_t).
      p: `[B, T]` trainer probability of the sampled token.
      mask: `[B, T]` tokens to use.
      num_bins: K (static).

    Returns:
      lt_bin{k}_mean_signed, lt_bin{k}_mean_abs, lt_bin{k}_count for k < K.
    """
    mask = mask.astype(bool)
    one_minus_p = jnp.clip(1.0 - jnp.where(mask, f32(p), 1.0), 0.0, 1.0)
    k = jnp.minimum((one_minus_p * num_bins).astype(jnp.int32), num_bins - 1)
    ratio = jnp.where(mask, f32(log_ratio), 0.0)
    # [B, T, K] one-hot bin membership; K is small.
    member = (k[..., None] == jnp.arange(num_bins)) & mask[..., None]
    count = jnp.sum(member, axis=(0, 1))
    per_bin = lambda x: jnp.sum(jnp.where(member, x[..., None], 0.0), axis=(0, 1))  # [K]
    signed = per_bin(ratio) / jnp.maximum(count, 1)
    absolute = per_bin(jnp.abs(ratio)) / jnp.maximum(count, 1)
    out = {}
    for b in range(num_bins):
        out[f"lt_bin{b}_mean_signed"] = signed[b]
        out[f"lt_bin{b}_mean_abs"] = absolute[b]
        out[f"lt_bin{b}_count"] = count[b]
    return out


def mismatch_diagnostics(
    *,
    logp: jax.Array,
    behaviour_logp: jax.Array,
    response_mask: jax.Array,
    in_safe: jax.Array | None = None,
    logp_full: jax.Array | None = None,
    behaviour_logp_full: jax.Array | None = None,
    pruned_mass: jax.Array | None = None,
    safe_size: jax.Array | None = None,
    behaviour_pruned_mass: jax.Array | None = None,
    behaviour_safe_size: jax.Array | None = None,
    num_bins: int = 10,
    segments: Segments | None = None,
) -> dict[str, jax.Array]:
    """All config-independent diagnostics of one batch (docs/design.md section 2).

    * `mismatch_metrics` on the pruned log-probs (E2/E4, what the objective sees), over the
      responses kept by E5 (those with no sampled token outside the trainer safe set);
    * `peer_metrics` (the peers' names) on the unpruned log-probs over all response tokens
      when both full log-probs are given (what a trainer without pruning compares), else on
      the pruned ones over the E5-kept responses;
    * the same with keys prefixed `full_` on the unpruned log-probs, over all response tokens,
      when both `logp_full` and `behaviour_logp_full` are given;
    * `pruning_metrics` (always including frac_tokens_outside_train_safe, 0 when `in_safe` is
      None);
    * `lt_by_p_bins` of l_t = log pi(y) - log mu(y) against p = pi(y), unpruned when the full
      log-probs are given (the setting of E10), else pruned over the E5-kept tokens.

    Args:
      logp: `[B, T]` log pi_S(y_t) (floor outside the trainer safe set).
      behaviour_logp: `[B, T]` log mu_S(y_t) recorded by the rollout (E4).
      response_mask: `[B, T]` response tokens.
      in_safe: `[B, T]` bool, y_t inside the trainer safe set (None: all inside).
      logp_full, behaviour_logp_full: `[B, T]` unpruned log pi(y_t), log mu(y_t).
      pruned_mass, safe_size: `[B, T]` trainer delta_S (E3) and |V_S| (E1).
      behaviour_pruned_mass, behaviour_safe_size: `[B, T]` the rollout's delta_S and |V_S|.
      num_bins: number of (1 - p) bins (static).
      segments: which response each token belongs to (None: one response per row).

    Returns:
      Flat dict of float32 scalars.
    """
    seqs = segments or Segments()
    mask = response_mask.astype(bool)
    inside = jnp.ones_like(mask) if in_safe is None else in_safe.astype(bool)
    kept = mask & ~seqs.spread(seqs.any(mask & ~inside))  # E5-kept responses
    out = mismatch_metrics(logp, behaviour_logp, kept, segments=seqs)
    have_full = logp_full is not None and behaviour_logp_full is not None
    if have_full:
        out |= mismatch_metrics(logp_full, behaviour_logp_full, mask, "full_", seqs)
        out |= peer_metrics(logp_full, behaviour_logp_full, mask, seqs)
    else:
        out |= peer_metrics(logp, behaviour_logp, kept, seqs)
    out |= pruning_metrics(
        mask,
        pruned_mass=pruned_mass,
        safe_size=safe_size,
        behaviour_pruned_mass=behaviour_pruned_mass,
        behaviour_safe_size=behaviour_safe_size,
        in_safe=in_safe,
    )
    if have_full:
        lt, lr, bin_mask = f32(logp_full), f32(behaviour_logp_full), mask
    else:
        lt, lr, bin_mask = f32(logp), f32(behaviour_logp), kept
    lt = jnp.where(bin_mask, lt, 0.0)
    lr = jnp.where(bin_mask, lr, 0.0)
    out |= lt_by_p_bins(lt - lr, jnp.exp(lt), bin_mask, num_bins)
    return out


def tail_metrics(
    *,
    logp: jax.Array,
    behaviour_logp: jax.Array,
    logp_full: jax.Array,
    behaviour_logp_full: jax.Array,
    response_mask: jax.Array,
    safe: jax.Array,
    in_safe: jax.Array | None = None,
    entropy: jax.Array | None = None,
    tail_p: float = TAIL_P,
    segments: Segments | None = None,
) -> dict[str, jax.Array]:
    """Entropy, tail tokens and the sequence log-ratio L (E6) with its share from the tail.

    With unpruned token log-ratios l_t = log pi(y_t) - log mu(y_t) and, per response i,
    L_i = sum_t l_t over its response tokens, split into L_i = L_i^in + L_i^out by whether y_t is
    inside the trainer's safe set V_S (E1, `safe`):

      entropy = mean over response tokens of H(pi(. | s_t)) (full distribution, nats);
      frac_tokens_tail = fraction of response tokens with pi(y_t) < `tail_p` and y_t outside V_S;
      seq_log_ratio = mean_i L_i (E[L], unpruned: what the rollout mismatch adds up to);
      seq_log_ratio_pruned = mean over E5-kept responses of sum_t (log pi_S - log mu_S) (E6's L,
        over the tokens the pruned objective keeps: all of a response or none);
      seq_log_ratio_outside = mean_i L_i^out;
      seq_log_ratio_outside_share = |E[L^out]| / (|E[L^in]| + |E[L^out]|), 0 when both are 0;
      frac_tokens_outside_safe = fraction of response tokens outside V_S (at the configured rho
        whatever the method, unlike frac_tokens_outside_train_safe, 0 when nothing is pruned);
      full_kl_k1_inside / full_kl_k1_outside = sum over response tokens inside / outside V_S of
        -l_t, over the number of response tokens (they add up to full_kl_k1);
      abs_log_ratio_outside_share = sum_outside |l_t| / sum |l_t| over response tokens (0 when
        the sum is 0): the tail's share of the per-token mismatch.

    The share compares the two parts of E[L] after each is summed with its sign (so per-token
    noise cancels within each part, as it does in E[L]). It equals E[L^out] / E[L] when the parts
    have the same sign, and unlike that ratio it stays in [0, 1] and defined when they cancel
    (E[L] ~ 0). Means over responses are over responses with at least one response token.

    Args:
      logp, behaviour_logp: `[B, T]` pruned log pi_S(y_t) (floor outside the trainer's V_S) and
        the rollout's log mu_S(y_t) (E2, E4).
      logp_full, behaviour_logp_full: `[B, T]` unpruned log pi(y_t), log mu(y_t).
      response_mask: `[B, T]` response tokens.
      safe: `[B, T]` bool, y_t inside the trainer's safe set at the configured rho (whether or
        not the objective prunes), the split of L into in / out.
      in_safe: `[B, T]` bool, the objective's E5 membership (None: pruning off, all kept).
      entropy: `[B, T]` H(pi) per position (`chunked.PositionStats.entropy`); None omits it.
      tail_p: the probability below which a token is in the tail.
      segments: which response each token belongs to (None: one response per row).

    Returns:
      Dict of float32 scalars.
    """
    seqs = segments or Segments()
    mask = response_mask.astype(bool)
    outside = mask & ~safe.astype(bool)
    has_tokens = seqs.any(mask)  # per response
    on = lambda x, m: jnp.where(m, f32(x), 0.0)  # masked values never reach arithmetic
    l_full = on(logp_full, mask) - on(behaviour_logp_full, mask)  # [B, T], 0 off the mask
    l_seq = seqs.sum(l_full)  # per response
    l_out = seqs.sum(jnp.where(outside, l_full, 0.0))
    mean_out = masked_mean(l_out, has_tokens)
    mean_in = masked_mean(l_seq - l_out, has_tokens)
    parts = jnp.abs(mean_in) + jnp.abs(mean_out)
    inside = jnp.ones_like(mask) if in_safe is None else in_safe.astype(bool)
    kept = has_tokens & ~seqs.any(mask & ~inside)  # E5-kept responses
    tok = mask & seqs.spread(kept)
    l_pruned = on(logp, tok) - on(behaviour_logp, tok)
    tail = outside & (on(logp_full, mask) < math.log(tail_p))
    n_tok = jnp.maximum(jnp.sum(mask), 1).astype(jnp.float32)
    abs_all = jnp.sum(jnp.abs(l_full))
    abs_out = jnp.sum(jnp.where(outside, jnp.abs(l_full), 0.0))
    out = {
        "frac_tokens_outside_safe": masked_mean(outside, mask),
        "full_kl_k1_inside": -jnp.sum(jnp.where(outside, 0.0, l_full)) / n_tok,
        "full_kl_k1_outside": -jnp.sum(jnp.where(outside, l_full, 0.0)) / n_tok,
        "abs_log_ratio_outside_share": jnp.where(
            abs_all > 0, abs_out / jnp.where(abs_all > 0, abs_all, 1.0), 0.0
        ),
        "frac_tokens_tail": masked_mean(tail, mask),
        "seq_log_ratio": masked_mean(l_seq, has_tokens),
        "seq_log_ratio_pruned": masked_mean(seqs.sum(l_pruned), kept),
        "seq_log_ratio_outside": mean_out,
        "seq_log_ratio_outside_share": jnp.where(
            parts > 0, jnp.abs(mean_out) / jnp.where(parts > 0, parts, 1.0), 0.0
        ),
    }
    if entropy is not None:
        out["entropy"] = masked_mean(entropy, mask)
    return out
