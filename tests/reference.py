"""Float64 NumPy references of docs/design.md E1-E10, written from the equations, not the JAX code.

Deliberately plain: Python loops over rows, responses and tokens, sets instead of masks, -inf
where the equations say -inf. Slow, so only for the small shapes of the tests.
"""

from __future__ import annotations

import math

import numpy as np


def _logsumexp(x):
    x = np.asarray(x, np.float64)
    m = np.max(x)
    return m + math.log(np.sum(np.exp(x - m)))


# ----------------------------------------------------------------------------- E1-E3


def safe_set(z_row, log_rho, tau=1.0) -> set[int]:
    """E1 for one position: {a : z_a / tau >= max_b z_b / tau + log_rho}."""
    z = np.asarray(z_row, np.float64) / tau
    top = max(z)
    return {a for a in range(len(z)) if z[a] >= top + log_rho}


def pruned_token_logprob(z_row, y, log_rho, tau=1.0) -> dict:
    """E1-E3 for one position and target y: logp (-inf outside V_S), in_safe, mass, size, full."""
    z = np.asarray(z_row, np.float64) / tau
    s = safe_set(z_row, log_rho, tau)
    lse_s = _logsumexp([z[b] for b in sorted(s)])
    probs = np.exp(z - _logsumexp(z))
    return {
        "logp": z[y] - lse_s if y in s else -math.inf,
        "in_safe": y in s,
        "pruned_mass": 1.0 - sum(probs[b] for b in s),
        "safe_size": len(s),
        "logp_full": z[y] - _logsumexp(z),
    }


def pruned_token_logprobs(logits, y, log_rho, tau=1.0) -> dict[str, np.ndarray]:
    """E1-E3 for rows of logits `[N, V]` and targets `[N]`; dict of `[N]` arrays."""
    rows = [pruned_token_logprob(logits[n], int(y[n]), log_rho, tau) for n in range(len(y))]
    return {k: np.array([r[k] for r in rows]) for k in rows[0]}


def pruned_entropy(z_row, log_rho, tau=1.0) -> float:
    """E12's H(pi_S) for one position: -sum over V_S of q log q, q = softmax over V_S."""
    z = np.asarray(z_row, np.float64) / tau
    s = sorted(safe_set(z_row, log_rho, tau))
    log_q = np.array([z[b] for b in s]) - _logsumexp([z[b] for b in s])
    return float(-np.sum(np.exp(log_q) * log_q))


def entropy_grad_logits(logits, log_rho, tau, g, step=1e-6) -> np.ndarray:
    """d/d logits of sum_n g_n H(pi_S(. | n)), `[N, V]`, by central finite differences (the
    safe set held fixed: rho's boundary is far from every entry in the tests)."""
    logits = np.asarray(logits, np.float64)
    grad = np.zeros_like(logits)
    for n in range(logits.shape[0]):
        for v in range(logits.shape[1]):
            up, down = logits[n].copy(), logits[n].copy()
            up[v] += step
            down[v] -= step
            diff = pruned_entropy(up, log_rho, tau) - pruned_entropy(down, log_rho, tau)
            grad[n, v] = g[n] * diff / (2 * step)
    return grad


def objective_grad_logits(logits, y, log_rho, tau, g_logp, g_full, g_mass, step=1e-6):
    """d/d logits of sum_n g_logp logp + g_full logp_full + g_mass pruned_mass, `[N, V]`.

    Central finite differences of the float64 reference, one position at a time. logp outside
    the safe set is the constant floor (zero gradient), as in the JAX code.
    """
    logits = np.asarray(logits, np.float64)
    grad = np.zeros_like(logits)

    def objective(row, n):
        r = pruned_token_logprob(row, int(y[n]), log_rho, tau)
        logp = r["logp"] if r["in_safe"] else 0.0
        return g_logp[n] * logp + g_full[n] * r["logp_full"] + g_mass[n] * r["pruned_mass"]

    for n in range(logits.shape[0]):
        for v in range(logits.shape[1]):
            up, down = logits[n].copy(), logits[n].copy()
            up[v] += step
            down[v] -= step
            grad[n, v] = (objective(up, n) - objective(down, n)) / (2 * step)
    return grad


# ----------------------------------------------------------------------------- E8


def rloo(rewards_pg) -> np.ndarray:
    """E8 on `[P, G]` rewards: A_i = R_i - mean of the other G-1 rewards."""
    r = np.asarray(rewards_pg, np.float64)
    p_count, g_count = r.shape
    out = np.zeros_like(r)
    for p in range(p_count):
        for i in range(g_count):
            others = [r[p, j] for j in range(g_count) if j != i]
            out[p, i] = r[p, i] - sum(others) / len(others)
    return out


def grpo(rewards_pg, eps=1e-6) -> np.ndarray:
    """(R_i - mean) / (unbiased std + eps) within each group of `[P, G]` rewards."""
    r = np.asarray(rewards_pg, np.float64)
    out = np.zeros_like(r)
    for p in range(r.shape[0]):
        out[p] = (r[p] - r[p].mean()) / (r[p].std(ddof=1) + eps)
    return out


# ----------------------------------------------------------------------------- E5-E9


def _rule_statistic(kind, r):
    """E14's per-token statistic of the log-ratio r (k2, k3 with r clipped to +-20)."""
    if kind.endswith("_k1"):
        return r
    r = min(max(r, -20.0), 20.0)
    return 0.5 * r * r if kind.endswith("_k2") else math.exp(r) - 1.0 - r


def _rule_rejects(kind, lo, hi, values):
    """E15: whether one rule rejects, given its statistic's values (one token, or a response)."""
    if kind.startswith("token_"):
        agg = values[0]
    elif kind.startswith("seq_sum_"):
        agg = sum(values)
    elif kind.startswith("seq_mean_"):
        agg = sum(values) / len(values)
    else:  # seq_max_
        agg = max(values)
    if kind.endswith("_k1"):
        return not (lo <= math.exp(agg) <= hi)
    return agg > hi


def dvp_loss(
    logp_obj,
    behaviour_logp,
    advantages,
    response_mask,
    in_safe,
    *,
    prune,
    correction,
    cap=2.0,
    normalisation="token_mean",
    logp_weights=None,
    ppo_eps=None,
    old_logp=None,
    old_in_safe=None,
    kl_coef=0.0,
    kl_estimator="k3",
    ref_logp=None,
    ref_in_safe=None,
    entropy_coef=0.0,
    entropy=None,
    icepop_lo=0.5,
    icepop_hi=5.0,
    geo_lo=0.999,
    geo_hi=1.001,
    k3_max=0.005,
    rules=(),
    batch_normalise=False,
) -> dict:
    """E5-E9, E14-E17 by loops. `logp_obj` enters the objective; weights use `logp_weights`
    (default `logp_obj`; the stop-gradient of E6), so finite differences in `logp_obj` give the
    gradient.

    With `ppo_eps`, returns the decoupled PPO-clip surrogate
    -(1/Z) sum w min(r A, clip(r, 1-eps, 1+eps) A), r = exp(logp_obj - old_logp), with weights
    from old_logp (behaviour correction pi_old / mu). With pruning, a response is excluded (E5)
    when a sampled token is outside the trainer safe set (`in_safe`) or, when `old_in_safe` is
    given, outside the old policy's (pi_S_old(y) = 0, so pi_old / mu = 0).

    With `kl_coef` (E11) the loss adds kl_coef/Z times the sum of k1 = log pi - log pi_ref or
    k3 = pi_ref/pi - log(pi_ref/pi) - 1 over the kept tokens (those with y outside the reference's
    safe set skipped when pruning; log-ratio clipped to +-20); with `entropy_coef` (E12) it
    subtracts entropy_coef/Z times the sum of `entropy` over the kept tokens.

    Rejection baselines (E7b): token_icepop keeps a token with weight exp(l_t) only when
    icepop_lo <= exp(l_t) <= icepop_hi; seq_geo_rs keeps a response (weight 1) only when
    geo_lo <= exp(mean_t l_t) <= geo_hi; seq_k3_rs keeps it when mean_t (exp(l_t) - 1 - l_t)
    <= k3_max (l_t clipped to +-20), means over the response's tokens.

    Rules (E14-E16), `rules` a sequence of (kind, lo, hi): a token is kept only if no rule
    rejects it or its response. k1 rules reject outside lo <= exp(aggregate of l_t) <= hi,
    k2 / k3 rules when the aggregate of l_t^2 / 2 or exp(l_t) - 1 - l_t exceeds hi (token itself,
    sum, mean or max over the response's tokens); opsm rejects a response with A < 0 and
    mean_t (log mu - log pi) > hi, pi the current policy (`logp_weights` before the PPO
    override). With `batch_normalise` (E17) every applied weight is divided by the mean of the
    applied weights over the kept tokens (per response for seq_tis / seq_mis).

    Returns the loss, the counts, `kl_ref` (the mean k over the KL's tokens), `weights`: the
    applied E7 weights (after E17), one per kept token (none, token_*) or one per kept response
    (seq_*), and `rejected`: per rule the count of response tokens it alone removes.
    """
    logp_obj = np.asarray(logp_obj, np.float64)
    lp_w = logp_obj if logp_weights is None else np.asarray(logp_weights, np.float64)
    lp_now = lp_w  # OPSM's current policy (E16)
    if ppo_eps is not None:
        lp_w = np.asarray(old_logp, np.float64)
    rules = list(rules)
    if correction == "seq_geo_rs":
        rules.insert(0, ("seq_mean_k1", geo_lo, geo_hi))
    elif correction == "seq_k3_rs":
        rules.insert(0, ("seq_mean_k3", 0.0, k3_max))
    b_count, t_count = logp_obj.shape
    excluded = masked_seqs = masked_tokens = 0
    rejected = {kind: 0 for kind, _, _ in rules}
    kept = []  # (response i, token t, weight) entering E9
    for i in range(b_count):
        tokens = [t for t in range(t_count) if response_mask[i][t]]
        outside = [t for t in tokens if not in_safe[i][t]]
        if old_in_safe is not None:
            outside += [t for t in tokens if not old_in_safe[i][t]]
        if prune and outside:
            excluded += 1  # E5: token ratio 0 -> whole response contributes nothing
            continue
        if not tokens:
            continue
        ratio = {t: lp_w[i, t] - behaviour_logp[i][t] for t in tokens}  # E6
        big_l = sum(ratio.values())
        reject = False  # the response, by a sequence rule
        token_rejected = set()
        for kind, lo, hi in rules:  # E14-E16
            if kind == "opsm":
                kl = sum(behaviour_logp[i][t] - lp_now[i, t] for t in tokens) / len(tokens)
                out = float(advantages[i]) < 0 and kl > hi
            elif kind.startswith("token_"):
                hits = {
                    t
                    for t in tokens
                    if _rule_rejects(kind, lo, hi, [_rule_statistic(kind, ratio[t])])
                }
                token_rejected |= hits
                rejected[kind] += len(hits)
                continue
            else:
                stats = [_rule_statistic(kind, ratio[t]) for t in tokens]
                out = _rule_rejects(kind, lo, hi, stats)
            reject = reject or out
            rejected[kind] += len(tokens) if out else 0
        seq_mis_out = correction == "seq_mis" and math.exp(big_l) > cap
        if reject or seq_mis_out:
            masked_seqs += 1
        token_masked = set(token_rejected)
        weights = {}
        for t in tokens:  # E7
            if correction in ("none", "seq_geo_rs", "seq_k3_rs"):
                w = 1.0
            elif correction == "token_tis":
                w = min(math.exp(ratio[t]), cap)
            elif correction == "token_mis":
                w = math.exp(ratio[t]) if math.exp(ratio[t]) <= cap else None
            elif correction == "seq_tis":
                w = min(math.exp(big_l), cap)
            elif correction == "seq_mis":
                w = None if seq_mis_out else math.exp(big_l)
            elif correction == "token_icepop":
                inside = icepop_lo <= math.exp(ratio[t]) <= icepop_hi
                w = math.exp(ratio[t]) if inside else None
            else:
                raise ValueError(correction)
            if w is None and correction != "seq_mis":
                token_masked.add(t)
            if w is not None and t not in token_rejected and not reject:
                weights[t] = w
        masked_tokens += len(token_masked)
        kept += [(i, t, w) for t, w in weights.items()]

    per_response = correction in ("seq_tis", "seq_mis")
    if batch_normalise and kept:  # E17
        if per_response:
            first = {}
            for i, _, w in kept:
                first.setdefault(i, w)
            w_bar = sum(first.values()) / len(first)
        else:
            w_bar = sum(w for _, _, w in kept) / len(kept)
        kept = [(i, t, w / w_bar) for i, t, w in kept]

    total, kl_values, entropy_total, applied = 0.0, [], 0.0, []
    seen = set()
    for i, t, w in kept:  # E9 numerator
        if not per_response or i not in seen:
            applied.append(w)
        seen.add(i)
        a = float(advantages[i])
        if ppo_eps is None:
            total += w * a * logp_obj[i, t]
        else:
            r = math.exp(logp_obj[i, t] - lp_w[i, t])
            clipped = min(max(r, 1 - ppo_eps), 1 + ppo_eps)
            total += w * min(r * a, clipped * a)
        if kl_coef and (not prune or ref_in_safe[i][t]):  # E11
            d = min(max(float(ref_logp[i][t]) - logp_obj[i, t], -20.0), 20.0)
            kl_values.append(-d if kl_estimator == "k1" else math.exp(d) - d - 1.0)
        if entropy_coef:  # E12
            entropy_total += float(entropy[i][t])
    z_tokens, z_seqs = len(kept), len(seen)
    z = z_tokens if normalisation == "token_mean" else z_seqs
    total -= kl_coef * sum(kl_values) - entropy_coef * entropy_total
    return {
        "kl_ref": float(np.mean(kl_values)) if kl_values else 0.0,
        "loss": -total / z if z else 0.0,
        "kept_tokens": z_tokens,
        "kept_responses": z_seqs,
        "excluded": excluded,
        "masked_seqs": masked_seqs,
        "masked_tokens": masked_tokens,
        "weights": applied,
        "rejected": rejected,
    }


def loss_grad(logp_obj, *args, step=1e-6, **kwargs) -> np.ndarray:
    """Central finite differences of `dvp_loss(...)["loss"]` in `logp_obj` (weights held)."""
    logp_obj = np.asarray(logp_obj, np.float64)
    kwargs.setdefault("logp_weights", logp_obj.copy())
    grad = np.zeros_like(logp_obj)
    for idx in np.ndindex(logp_obj.shape):
        up, down = logp_obj.copy(), logp_obj.copy()
        up[idx] += step
        down[idx] -= step
        grad[idx] = (
            dvp_loss(up, *args, **kwargs)["loss"] - dvp_loss(down, *args, **kwargs)["loss"]
        ) / (2 * step)
    return grad


# ----------------------------------------------------------------------------- diagnostics


def mismatch_metrics(logp, behaviour_logp, mask) -> dict[str, float]:
    """verl-style ppl / kl / chi^2 metrics by loops (see diagnostics.mismatch_metrics)."""
    seqs, tokens = [], []
    for i in range(len(mask)):
        ts = [t for t in range(len(mask[i])) if mask[i][t]]
        if not ts:
            continue
        lt = [float(logp[i][t]) for t in ts]
        lr = [float(behaviour_logp[i][t]) for t in ts]
        diffs = [a - b for a, b in zip(lt, lr, strict=True)]
        seqs.append((np.mean(lt), np.mean(lr), sum(diffs)))
        tokens += diffs
    clip = lambda x: min(max(x, -20.0), 20.0)
    return {
        "training_ppl": np.mean([math.exp(-mt) for mt, _, _ in seqs]),
        "rollout_ppl": np.mean([math.exp(-mr) for _, mr, _ in seqs]),
        "ppl_gap": np.mean([abs(math.exp(-mr) - math.exp(-mt)) for mt, mr, _ in seqs]),
        "log_ppl_diff": np.mean([mr - mt for mt, mr, _ in seqs]),
        "kl_k1": np.mean([-r for r in tokens]),
        "kl_k3": np.mean([math.exp(r) - r - 1 for r in tokens]),
        "chi2_token": np.mean([math.exp(2 * clip(r)) for r in tokens]) - 1,
        "chi2_seq": np.mean([math.exp(2 * clip(s)) for _, _, s in seqs]) - 1,
    }


def peer_metrics(logp, behaviour_logp, mask) -> dict[str, float]:
    """The peers' mismatch metrics by loops, from their definitions (see
    diagnostics.peer_metrics): verl's mismatch_* (token means and means over responses),
    NeMo-RL's token_mult_prob_error = mean_t exp(|log pi - log mu|), slime's
    train_rollout_logprob_abs_diff = mean over responses of mean_t |log pi - log mu|."""
    tokens, mt, mr = [], [], []
    for i in range(len(mask)):
        ts = [t for t in range(len(mask[i])) if mask[i][t]]
        if not ts:
            continue
        pairs = [(float(logp[i][t]), float(behaviour_logp[i][t])) for t in ts]
        tokens += pairs
        mt.append(sum(a for a, _ in pairs) / len(ts))
        mr.append(sum(b for _, b in pairs) / len(ts))
    d = [b - a for a, b in zip(mt, mr, strict=True)]
    per_seq_abs, start = [], 0
    for i in range(len(mask)):
        n = int(np.sum(mask[i]))
        if n:
            per_seq_abs.append(sum(abs(a - b) for a, b in tokens[start : start + n]) / n)
            start += n
    return {
        "mismatch_kl": np.mean([b - a for a, b in tokens]),
        "mismatch_k3_kl": np.mean([math.exp(a - b) - (a - b) - 1 for a, b in tokens]),
        "mismatch_training_ppl": np.mean([math.exp(-m) for m in mt]),
        "mismatch_training_log_ppl": np.mean([-m for m in mt]),
        "mismatch_rollout_ppl": np.mean([math.exp(-m) for m in mr]),
        "mismatch_rollout_log_ppl": np.mean([-m for m in mr]),
        "mismatch_log_ppl_diff": np.mean(d),
        "mismatch_log_ppl_abs_diff": np.mean(np.abs(d)),
        "mismatch_log_ppl_diff_max": max(d),
        "mismatch_log_ppl_diff_min": min(d),
        "mismatch_ppl_ratio": np.mean([math.exp(x) for x in d]),
        "token_mult_prob_error": np.mean([math.exp(abs(a - b)) for a, b in tokens]),
        "train_rollout_logprob_abs_diff": np.mean(per_seq_abs),
    }


def lt_by_p_bins(log_ratio, p, mask, num_bins) -> dict[str, float]:
    """Mean signed / mean |l_t| / count per bin of 1 - p in [k/K, (k+1)/K)."""
    bins = [[] for _ in range(num_bins)]
    for idx in np.ndindex(np.shape(mask)):
        if mask[idx]:
            k = min(int((1.0 - p[idx]) * num_bins), num_bins - 1)
            bins[k].append(float(log_ratio[idx]))
    out = {}
    for k, vals in enumerate(bins):
        out[f"lt_bin{k}_mean_signed"] = np.mean(vals) if vals else 0.0
        out[f"lt_bin{k}_mean_abs"] = np.mean(np.abs(vals)) if vals else 0.0
        out[f"lt_bin{k}_count"] = len(vals)
    return out


def log_softmax(z) -> np.ndarray:
    """Row-wise float64 log-softmax of `[..., V]`."""
    z = np.asarray(z, np.float64)
    m = z.max(axis=-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(axis=-1, keepdims=True))


# ----------------------------------------------------------------------------- E13


def truncation_set(z_row, top_k=0, top_p=1.0, max_kept=None, tau=1.0) -> list[int]:
    """E13's kept set K of one position, in decreasing z (ties to the lower id): the max_kept
    highest, the first top_k of them (0: all), then the ranks whose higher ranks' probability is
    below top_p (renormalised over the top-k set when top_k > 0). Neither on: every id."""
    z = np.asarray(z_row, np.float64) / tau
    if top_k == 0 and top_p >= 1.0:
        return list(range(len(z)))
    order = sorted(range(len(z)), key=lambda a: (-z[a], a))[: max_kept or len(z)]
    if top_k > 0:
        order = order[:top_k]
    probs = np.exp(z - _logsumexp(z if top_k == 0 else [z[a] for a in order]))
    kept, before = [], 0.0
    for a in order:
        if top_p < 1.0 and before >= top_p:
            break
        kept.append(a)
        before += probs[a]
    return kept


def truncated_token_logprob(z_row, y, kept, log_rho, tau=1.0) -> dict:
    """E13 for one position: log pi_T(y) over V_T = {a in K : z_a >= max_K z + log_rho}
    (-inf outside), in V_T, delta_T = 1 - pi(V_T), |V_T|, and pi's mass outside K."""
    z = np.asarray(z_row, np.float64) / tau
    top = max(z[a] for a in kept)
    v_t = sorted(a for a in kept if z[a] >= top + log_rho)
    probs = np.exp(z - _logsumexp(z))
    return {
        "logp": z[y] - _logsumexp([z[a] for a in v_t]) if y in v_t else -math.inf,
        "in_safe": y in v_t,
        "pruned_mass": 1.0 - sum(probs[a] for a in v_t),
        "safe_size": len(v_t),
        "truncated_mass": 1.0 - sum(probs[a] for a in kept),
    }
