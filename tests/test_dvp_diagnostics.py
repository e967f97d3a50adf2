"""Mismatch diagnostics and the E10 bound. Tolerance 1e-5 relative vs the float64 reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dvp_jax import metrics
from dvp_jax.dvp import batch_stats, bound, diagnostics, pruning
from dvp_jax.dvp.segments import Segments
from tests import reference as ref

B, T, V = 6, 7, 40


def _logprobs(seed=0):
    rng = np.random.default_rng(seed)
    mask = np.arange(T)[None, :] < rng.integers(1, T + 1, size=B)[:, None]
    mask[-1] = False  # one all-padding response
    lr = -rng.exponential(1.0, size=(B, T))
    lt = lr + rng.normal(0, 0.3, size=(B, T))
    f = lambda x: x.astype(np.float32)
    return f(lt), f(lr), mask


def test_mismatch_metrics_match_reference():
    lt, lr, mask = _logprobs()
    got = jax.jit(diagnostics.mismatch_metrics)(lt, lr, mask)
    expect = ref.mismatch_metrics(lt, lr, mask)
    assert set(got) == set(expect)
    for k, v in expect.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-5, atol=1e-6, err_msg=k)


def test_peer_metrics_match_reference():
    lt, lr, mask = _logprobs()
    got = jax.jit(diagnostics.peer_metrics)(lt, lr, mask)
    expect = ref.peer_metrics(lt, lr, mask)
    assert set(got) == set(expect)
    for k, v in expect.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-5, atol=1e-6, err_msg=k)
        metrics.declared(k)


def test_peer_metrics_by_hand():
    # Two responses; r = log pi - log mu per token:
    #   response 0: log pi = (-1.0, -2.0), log mu = (-1.5, -2.0): r = (0.5, 0.0)
    #   response 1: log pi = (-0.5,),      log mu = (-0.25,):     r = (-0.25,)
    # verl: mismatch_kl = mean_t (-r) = (-0.5 + 0 + 0.25) / 3 = -0.0833333;
    #   mismatch_k3_kl = (e^0.5 - 1.5 + 0 + e^-0.25 - 0.75) / 3 = (0.1487213 + 0.0288008) / 3
    #   = 0.0591740; per response mt = (-1.5, -0.5), mr = (-1.75, -0.25), d = mr - mt =
    #   (-0.25, 0.25): mismatch_log_ppl_diff = 0, _abs_diff = 0.25, _max 0.25, _min -0.25,
    #   mismatch_ppl_ratio = (e^-0.25 + e^0.25) / 2 = 1.0314131,
    #   mismatch_training_ppl = (e^1.5 + e^0.5) / 2 = 3.0652052, _log_ppl = 1.0;
    # NeMo-RL: token_mult_prob_error = (e^0.5 + e^0 + e^0.25) / 3 = (1.6487213 + 1 + 1.2840254)
    #   / 3 = 1.3109156;
    # slime: train_rollout_logprob_abs_diff = ((0.5 + 0) / 2 + 0.25) / 2 = 0.25.
    lt = jnp.array([[-1.0, -2.0], [-0.5, 0.0]])
    lr = jnp.array([[-1.5, -2.0], [-0.25, 0.0]])
    mask = jnp.array([[True, True], [True, False]])
    got = diagnostics.peer_metrics(lt, lr, mask)
    expect = {
        "mismatch_kl": -0.0833333,
        "mismatch_k3_kl": 0.0591740,
        "mismatch_log_ppl_diff": 0.0,
        "mismatch_log_ppl_abs_diff": 0.25,
        "mismatch_log_ppl_diff_max": 0.25,
        "mismatch_log_ppl_diff_min": -0.25,
        "mismatch_ppl_ratio": 1.0314131,
        "mismatch_training_ppl": 3.0652052,
        "mismatch_training_log_ppl": 1.0,
        "token_mult_prob_error": 1.3109156,
        "train_rollout_logprob_abs_diff": 0.25,
    }
    for k, v in expect.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-6, atol=1e-7, err_msg=k)


def test_peer_metrics_packed_equal_padded_and_come_with_the_diagnostics():
    """Two responses per packed row give the padded rows' values; `mismatch_diagnostics`
    reports them on the unpruned log-probs over all response tokens."""
    lt, lr, mask = _logprobs(seed=3)
    ids = np.where(mask, 1 + (np.arange(B) % 2)[:, None], 0).reshape(B // 2, 2 * T)
    pack = lambda x: np.asarray(x).reshape(B // 2, 2 * T)
    segments = Segments(jnp.asarray(ids, jnp.int32), 2)
    padded = diagnostics.peer_metrics(lt, lr, mask)
    packed = diagnostics.peer_metrics(pack(lt), pack(lr), pack(mask), segments)
    for k in padded:
        np.testing.assert_allclose(packed[k], padded[k], rtol=1e-5, atol=1e-6, err_msg=k)
    floor = np.full_like(lt, pruning.LOGP_FLOOR)  # pruned values are not what the peers compare
    out = diagnostics.mismatch_diagnostics(
        logp=floor, behaviour_logp=floor, response_mask=mask, logp_full=lt,
        behaviour_logp_full=lr,
    )  # fmt: skip
    for k in padded:
        np.testing.assert_allclose(out[k], padded[k], rtol=1e-6, err_msg=k)
    np.testing.assert_allclose(out["mismatch_kl"], out["full_kl_k1"], rtol=1e-6)
    np.testing.assert_allclose(out["mismatch_k3_kl"], out["full_kl_k3"], rtol=1e-5)


def test_identical_logprobs_give_zero_mismatch():
    lt, _, mask = _logprobs(seed=1)
    got = jax.jit(diagnostics.mismatch_metrics)(lt, lt, mask)
    for k in ("ppl_gap", "log_ppl_diff", "kl_k1", "kl_k3", "chi2_token", "chi2_seq"):
        assert got[k] == 0.0, k
    assert got["rollout_ppl"] == got["training_ppl"] > 1.0


def test_lt_bins_match_reference():
    rng = np.random.default_rng(2)
    lt, lr, mask = _logprobs(seed=2)
    p = rng.random((B, T)).astype(np.float32)
    p[0, 0], p[0, 1] = 1.0, 0.0  # the edges: 1 - p = 0 -> bin 0, 1 - p = 1 -> last bin
    got = jax.jit(diagnostics.lt_by_p_bins, static_argnames="num_bins")(
        lt - lr, p, mask, num_bins=5
    )
    expect = ref.lt_by_p_bins(lt - lr, p, mask, num_bins=5)
    assert set(got) == set(expect)
    for k, v in expect.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-5, atol=1e-6, err_msg=k)


def test_is_weight_stats_and_exclusion_by_hand():
    # w = (1, 2) kept, 7 masked out: mean 1.5, max 2, ESS = (1 + 2)^2 / (2 * (1 + 4)) = 0.9.
    got = jax.jit(batch_stats.is_weight_stats)(jnp.array([1.0, 2.0, 7.0]), jnp.array([1, 1, 0]))
    np.testing.assert_allclose([got[k] for k in ("is_weight_mean", "is_weight_max")], [1.5, 2.0])
    np.testing.assert_allclose(got["is_weight_ess"], 0.9, rtol=1e-6)
    # 3 responses with tokens (the 4th is padding): 1 excluded, 1 masked; 1 of 5 tokens masked.
    mask = jnp.array([[1, 1], [1, 0], [1, 1], [0, 0]], bool)
    got = jax.jit(batch_stats.exclusion_metrics)(
        mask,
        excluded=jnp.array([True, False, False, True]),
        seq_masked=jnp.array([False, True, False, False]),
        token_masked=jnp.array([[0, 0], [0, 0], [0, 1], [1, 1]], bool),
    )
    np.testing.assert_allclose(
        [got["frac_responses_excluded"], got["frac_responses_masked"], got["frac_tokens_masked"]],
        [1 / 3, 1 / 3, 1 / 5],
        rtol=1e-6,
    )


def test_mismatch_diagnostics_from_logits_end_to_end():
    """Rollout (bf16-rounded logits) vs trainer (fp32) through the pruning functions."""
    rng = np.random.default_rng(3)
    logits = (2.0 * rng.normal(size=(B, T, V))).astype(np.float32)
    logits_r = np.asarray(jnp.asarray(logits, jnp.bfloat16).astype(jnp.float32))
    y = rng.integers(0, V, size=(B, T))
    _, _, mask = _logprobs(seed=3)
    train = pruning.pruned_token_logprobs(logits, y, -3.0)
    roll = pruning.pruned_token_logprobs(logits_r, y, -3.0)
    diagnose = jax.jit(
        lambda: diagnostics.mismatch_diagnostics(
            logp=train.logp,
            behaviour_logp=roll.logp,
            response_mask=mask,
            in_safe=train.in_safe,
            logp_full=train.logp_full,
            behaviour_logp_full=roll.logp_full,
            pruned_mass=train.pruned_mass,
            safe_size=train.safe_size,
            behaviour_pruned_mass=roll.pruned_mass,
            behaviour_safe_size=roll.safe_size,
            num_bins=4,
        )
    )
    got = diagnose()
    assert all(np.isfinite(v) for v in got.values())
    for side in ("train", "rollout"):
        for stat in ("pruned_mass", "safe_size"):
            assert f"{stat}_{side}_mean" in got and f"{stat}_{side}_max" in got
    outside = (~np.asarray(train.in_safe) & mask).sum() / mask.sum()
    assert outside > 0  # the case exercises E5
    np.testing.assert_allclose(got["frac_tokens_outside_train_safe"], outside, rtol=1e-6)
    # Each side's E3 / |V_S| statistics come from its own arrays (train <- plain names,
    # rollout <- behaviour_*).
    for side, tl in (("train", train), ("rollout", roll)):
        m = np.asarray(mask)
        for stat in ("pruned_mass", "safe_size"):
            x = np.asarray(getattr(tl, stat))[m]
            np.testing.assert_allclose(got[f"{stat}_{side}_mean"], x.mean(), rtol=1e-5)
            np.testing.assert_allclose(got[f"{stat}_{side}_max"], x.max(), rtol=1e-6)
    kept = mask & ~np.any(mask & ~np.asarray(train.in_safe), axis=1, keepdims=True)
    expect = ref.mismatch_metrics(train.logp, roll.logp, kept)
    for k, v in expect.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-5, atol=1e-6, err_msg=k)
    expect = ref.mismatch_metrics(train.logp_full, roll.logp_full, mask)
    for k, v in expect.items():
        np.testing.assert_allclose(got["full_" + k], v, rtol=1e-5, atol=1e-6, err_msg=k)
    assert sum(got[f"lt_bin{k}_count"] for k in range(4)) == mask.sum()


def test_frac_tokens_outside_train_safe_is_always_reported():
    # 2 responses, 5 response tokens, 1 outside the trainer safe set (the padding one is ignored).
    mask = jnp.array([[True, True, True], [True, True, False]])
    in_safe = jnp.array([[True, True, True], [True, False, False]])
    got = batch_stats.pruning_metrics(mask, in_safe=in_safe)
    assert got == {"frac_tokens_outside_train_safe": pytest.approx(1 / 5)}
    # Pruning off (no in_safe: the safe set is the whole vocabulary): present and 0, so every
    # method's run logs it.
    assert batch_stats.pruning_metrics(mask) == {"frac_tokens_outside_train_safe": 0.0}
    lp = jnp.full((2, 3), -1.0)
    diag = jax.jit(diagnostics.mismatch_diagnostics)(logp=lp, behaviour_logp=lp, response_mask=mask)
    assert diag["frac_tokens_outside_train_safe"] == 0.0


@pytest.mark.parametrize("eps", [1e-4, 1e-2, 0.3, 2.0])
def test_bound_holds_for_random_perturbations(eps):
    rng = np.random.default_rng(int(eps * 1e4))
    z = (3.0 * rng.normal(size=(64, V))).astype(np.float32)
    z[:8, 0] += 25.0  # some positions with p close to 1 (1 - p ~ 1e-10): the hard end of E10
    d = rng.uniform(-eps, eps, size=z.shape).astype(np.float32)
    report = jax.jit(bound.mismatch_bound)(z + d, z)
    assert report.frac_within == 1.0
    np.testing.assert_allclose(report.eps, np.abs((z + d) - z).max(-1), rtol=1e-6)
    diff = np.abs(ref.log_softmax(z + d) - ref.log_softmax(z))
    np.testing.assert_allclose(report.abs_logp_diff, diff, rtol=1e-3, atol=1e-6 * eps)
    # Gathered at sampled tokens: the same numbers (another program: float32 rounding of
    # values of size eps, 1e-6 relative).
    y = rng.integers(0, V, size=64)
    at_y = jax.jit(bound.mismatch_bound)(z + d, z, y)
    np.testing.assert_allclose(
        at_y.abs_logp_diff, report.abs_logp_diff[np.arange(64), y], rtol=1e-6, atol=1e-7 * eps
    )
    assert at_y.frac_within == 1.0


def test_bound_from_bf16_forward():
    rng = np.random.default_rng(5)
    h = rng.normal(size=(32, 16)).astype(np.float32)
    w = rng.normal(size=(16, V)).astype(np.float32)
    z = h @ w
    z_bf16 = jnp.einsum("nd,dv->nv", jnp.asarray(h, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16))
    report = jax.jit(bound.mismatch_bound)(z_bf16.astype(jnp.float32), z, temperature=0.7)
    assert report.frac_within == 1.0 and float(report.eps.max()) > 0


def test_a_wrong_one_x_bound_is_caught():
    # d = -eps on every logit except +eps on token a: d log q_a / ds = 2 eps (1 - q_a(s)), so
    # |log p'_a - log p_a| is close to 2 eps (1 - p_a) and exceeds eps (1 - min(p_a, p'_a)).
    rng = np.random.default_rng(6)
    z = rng.normal(size=(16, V)).astype(np.float32)
    eps = 0.05
    d = np.full(z.shape, -eps, np.float32)
    d[:, 3] = eps
    check = jax.jit(bound.mismatch_bound)
    assert check(z + d, z).frac_within == 1.0
    wrong = check(z + d, z, factor=1.0)
    assert not np.asarray(wrong.within)[:, 3].any()
    assert wrong.frac_within < 1.0


def _tail_reference(z, z_r, y, mask, log_rho, tail_p):
    """float64 loops over responses and tokens, from the definitions (`tail_metrics`)."""

    def log_softmax(row):
        row = row - row.max()
        return row - np.log(np.exp(row).sum())

    def pruned(row, a):  # log pi_S(a) or None outside V_S (E1, E2)
        safe = row >= row.max() + log_rho
        if not safe[a]:
            return None
        return row[a] - row.max() - np.log(np.exp(row[safe] - row.max()).sum())

    entropy, tail, n_tok = 0.0, 0, 0
    seq, seq_out, seq_in, seq_pruned = [], [], [], []
    for i in range(z.shape[0]):
        if not mask[i].any():
            continue
        total = out = 0.0
        pruned_sum, kept = 0.0, True
        for t in np.flatnonzero(mask[i]):
            lp, lm = log_softmax(z[i, t]), log_softmax(z_r[i, t])
            a = y[i, t]
            l_t = lp[a] - lm[a]
            inside = z[i, t, a] >= z[i, t].max() + log_rho
            total += l_t
            out += 0.0 if inside else l_t
            n_tok += 1
            entropy += -np.sum(np.exp(lp) * lp)
            tail += (not inside) and np.exp(lp[a]) < tail_p
            p_s, m_s = pruned(z[i, t], a), pruned(z_r[i, t], a)
            if p_s is None:
                kept = False
            else:
                pruned_sum += p_s - m_s
        seq.append(total)
        seq_out.append(out)
        seq_in.append(total - out)
        if kept:
            seq_pruned.append(pruned_sum)
    e_out, e_in = np.mean(seq_out), np.mean(seq_in)
    lt = np.asarray(log_softmax_rows(z, y), float) - np.asarray(log_softmax_rows(z_r, y), float)
    outside = mask & (np.take_along_axis(z, y[..., None], -1)[..., 0] < z.max(-1) + log_rho)
    return {
        "frac_tokens_outside_safe": outside.sum() / mask.sum(),
        "full_kl_k1_inside": -lt[mask & ~outside].sum() / mask.sum(),
        "full_kl_k1_outside": -lt[outside].sum() / mask.sum(),
        "abs_log_ratio_outside_share": np.abs(lt[outside]).sum() / np.abs(lt[mask]).sum(),
        "entropy": entropy / n_tok,
        "frac_tokens_tail": tail / n_tok,
        "seq_log_ratio": np.mean(seq),
        "seq_log_ratio_pruned": np.mean(seq_pruned) if seq_pruned else 0.0,
        "seq_log_ratio_outside": e_out,
        "seq_log_ratio_outside_share": abs(e_out) / (abs(e_in) + abs(e_out)),
    }


def log_softmax_rows(z, y):
    """[B, T] float64 log softmax(z)[y]."""
    z = np.asarray(z, np.float64)
    top = z.max(-1, keepdims=True)
    lse = top[..., 0] + np.log(np.exp(z - top).sum(-1))
    return np.take_along_axis(z, y[..., None], -1)[..., 0] - lse


def test_tail_metrics_match_dense_reference():
    """Tolerance 1e-5 relative, 1e-6 absolute (fp32 log-softmax and sums over <= 42 tokens vs
    float64 loops)."""
    rng = np.random.default_rng(5)
    b, t, v, log_rho, tail_p = 8, 6, 60, -1.0, 0.05
    z = (3.0 * rng.normal(size=(b, t, v))).astype(np.float32)  # spread: a real tail
    z_r = (z + rng.normal(0.0, 1.0, size=z.shape)).astype(np.float32)  # the rollout's logits
    # Sample from the rollout's pruned distribution mu_S (E4): inside the rollout's V_S, but
    # sometimes outside the trainer's and in its tail.
    top = z_r.max(-1, keepdims=True)
    p_r = np.exp(z_r - top) * (z_r >= top + log_rho)
    y = np.array([[rng.choice(v, p=row / row.sum()) for row in r] for r in p_r])
    mask = np.arange(t)[None, :] < rng.integers(1, t + 1, size=b)[:, None]
    mask[-1] = False  # one all-padding response
    train = pruning.pruned_token_logprobs(z, y, log_rho)
    roll = pruning.pruned_token_logprobs(z_r, y, log_rho)
    log_p = jax.nn.log_softmax(z)
    entropy = -jnp.sum(jnp.exp(log_p) * log_p, axis=-1)
    got = jax.jit(
        lambda: diagnostics.tail_metrics(
            logp=train.logp,
            behaviour_logp=roll.logp,
            logp_full=train.logp_full,
            behaviour_logp_full=roll.logp_full,
            response_mask=mask,
            safe=train.in_safe,
            in_safe=train.in_safe,
            entropy=entropy,
            tail_p=tail_p,
        )
    )()
    expect = _tail_reference(z, z_r, y, mask, log_rho, tail_p)
    assert set(got) == set(expect)
    # The case exercises every part: tail tokens, excluded and kept responses, both parts of L.
    outside = mask & ~np.asarray(train.in_safe)
    assert 0 < expect["frac_tokens_tail"] < outside.sum() / mask.sum()
    assert 0 < np.any(outside, axis=1).sum() < mask.any(axis=1).sum()
    assert 0.05 < expect["seq_log_ratio_outside_share"] < 0.95
    for k, value in expect.items():
        np.testing.assert_allclose(got[k], value, rtol=1e-5, atol=1e-6, err_msg=k)
    # Pruning off (in_safe None): every response is kept and the pruned L is the full one when
    # the log-probs are unpruned.
    off = diagnostics.tail_metrics(
        logp=train.logp_full,
        behaviour_logp=roll.logp_full,
        logp_full=train.logp_full,
        behaviour_logp_full=roll.logp_full,
        response_mask=mask,
        safe=train.in_safe,
    )
    assert "entropy" not in off
    np.testing.assert_allclose(off["seq_log_ratio_pruned"], expect["seq_log_ratio"], rtol=1e-5)


def test_tail_share_is_bounded_and_zero_without_mismatch():
    # Inside part +2, outside part -1 (they cancel in E[L] = 1): the share is 1 / 3, not -1.
    mask = jnp.array([[True, True, True]])
    safe = jnp.array([[True, True, False]])
    lp = jnp.array([[-1.0, -1.0, -3.0]])
    lm = jnp.array([[-2.0, -2.0, -2.0]])

    @jax.jit
    def tail(behaviour):  # pruned and unpruned log-probs alike on both sides
        return diagnostics.tail_metrics(
            logp=lp,
            behaviour_logp=behaviour,
            logp_full=lp,
            behaviour_logp_full=behaviour,
            response_mask=mask,
            safe=safe,
        )

    got = tail(lm)
    assert got["seq_log_ratio"] == pytest.approx(1.0)
    assert got["seq_log_ratio_outside"] == pytest.approx(-1.0)
    assert got["seq_log_ratio_outside_share"] == pytest.approx(1 / 3)
    same = tail(lp)
    assert same["seq_log_ratio_outside_share"] == 0.0 and same["seq_log_ratio"] == 0.0
