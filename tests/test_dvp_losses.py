"""The DVP-RLOO loss (E5-E9), its config and presets.

Tolerances: loss values and importance-weight statistics 1e-5 relative (fp32 vs the float64 loop
reference; 1e-6 absolute near 0); gradients in logp 1e-5 relative against the reference's central
finite differences (the loss is linear in logp with stop-gradient weights, so differences are
exact up to rounding), 1e-4 for the PPO surrogate and for the end-to-end chunked path (composed).

The reference cases run in two regimes: "near" (log-ratio noise 0.3, weights close to 1) and
"cap" (noise 1.0), where tokens and whole responses have exp l > C = 2 and others below, so every
truncation (TIS) and every mask (MIS) of E7 is exercised; the test asserts that the data does.
"""

import dataclasses
import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dvp_jax.dvp import advantages, diagnostics, losses, pruning
from dvp_jax.dvp.chunked import chunked_pruned_logprobs
from dvp_jax.dvp.losses import LossConfig, dvp_loss
from tests import reference as ref

B, T = 6, 5


NOISE = {"near": 0.3, "cap": 1.0}  # std of the log-ratio l_t in the reference batches
LOG_CAP = math.log(2.0)


def _batch(seed=0, b=B, t=T, noise=0.3, outside_rate=0.1):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, t + 1, size=b)
    mask = np.arange(t)[None, :] < lengths[:, None]
    behaviour_logp = -rng.exponential(1.0, size=(b, t))
    logp = behaviour_logp + rng.normal(0.0, noise, size=(b, t))
    in_safe = rng.random((b, t)) > outside_rate
    logp = np.where(in_safe, logp, pruning.LOGP_FLOOR)  # as the trainer produces
    adv = rng.normal(size=b)
    f = lambda x: x.astype(np.float32)
    return f(logp), f(behaviour_logp), f(adv), mask, in_safe


def _value_and_grad(cfg, lp, lr, adv, mask, in_safe, old_logp=None, old_in_safe=None):
    fn = lambda lp: dvp_loss(lp, lr, adv, mask, in_safe, cfg, old_logp, old_in_safe)
    (loss, metrics), grad = jax.value_and_grad(fn, has_aux=True)(lp)
    return loss, metrics, grad


_loss_and_grad = jax.jit(_value_and_grad, static_argnames="cfg")


@functools.partial(jax.jit, static_argnames="cfgs")
def _many_losses_and_grads(cfgs, cases):
    """(loss, metrics, grad) of `_value_and_grad(cfg, *case)` for each pair, in one program: a
    grid of configs compiles as one program in a fraction of the time of one per config (the
    grid's tests read their case from a module fixture)."""
    return [_value_and_grad(cfg, *case) for cfg, case in zip(cfgs, cases, strict=True)]


def _grid(cases: dict) -> dict:
    """{key: (loss, metrics, grad)} for `cases` {key: (cfg, args)}, all in one program."""
    keys = list(cases)
    out = _many_losses_and_grads(tuple(cases[k][0] for k in keys), [cases[k][1] for k in keys])
    return dict(zip(keys, out, strict=True))


def _assert_cap_reached(weight_logp, lr, mask, included):
    """The batch's E6 log-ratios on included responses cross log C both ways, per token and
    per response (so truncation and masking change the result)."""
    l_tok = np.where(mask & included[:, None], weight_logp - lr, np.nan)
    l_seq = np.nansum(l_tok, axis=1)[included]
    assert np.sum(l_tok > LOG_CAP) >= 2 and np.sum(l_tok <= LOG_CAP) >= 2
    assert np.sum(l_seq > LOG_CAP) >= 2 and np.sum(l_seq <= LOG_CAP) >= 2


def _assert_weight_stats(metrics, weights):
    """is_weight_* against the reference's applied weights (float64)."""
    w = np.asarray(weights, np.float64)
    assert len(w) > 0
    ess = w.sum() ** 2 / (len(w) * np.sum(w * w))
    got = [metrics[k] for k in ("is_weight_mean", "is_weight_max", "is_weight_ess")]
    np.testing.assert_allclose(got, [w.mean(), w.max(), ess], rtol=1e-5)


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "field, value",
    [
        ("prune", "yes"),
        ("log_rho", 1.0),
        ("log_rho", math.nan),
        ("correction", "token_is"),
        ("cap", 0.5),
        ("cap", math.inf),
        ("normalisation", "seq_mean"),
        ("ppo_clip_eps", 0.0),
        ("ppo_clip_eps", 1.5),
        ("temperature", 0.0),
        ("icepop_lo", 0.0),
        ("icepop_hi", 0.9),
        ("geo_lo", 1.5),
        ("geo_hi", math.inf),
        ("k3_max", 0.0),
        ("rejection", "seq_max_k3=-1"),
        ("batch_normalise_weights", "yes"),
    ],
)
def test_config_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        LossConfig(**{field: value})


def test_presets():
    expect = {
        "rloo": (False, "none"),
        "tis": (False, "token_tis"),
        "mis": (False, "seq_mis"),
        "dvp": (True, "none"),
        "mis_dvp": (True, "seq_mis"),
        "icepop": (False, "token_icepop"),
        "geo_rs": (False, "seq_geo_rs"),
        "k3_rs": (False, "seq_k3_rs"),
        "skyrl_geo_tis": (False, "token_tis", "seq_mean_k1=0.99:1.01"),
        "verl_seq_is_rs": (False, "seq_tis", "seq_sum_k1=0.5:2"),
        "opsm": (False, "none", "opsm=0.0001"),
    }
    assert set(expect) == set(losses.PRESETS)
    for name, (prune, correction, *rejection) in expect.items():
        cfg = LossConfig.preset(name)
        assert (cfg.prune, cfg.correction, cfg.cap) == (prune, correction, 2.0)
        assert cfg.rejection == (rejection[0] if rejection else "")
        assert cfg.pruning == prune
        assert cfg.effective_log_rho == (-13.0 if prune else -math.inf)
    assert LossConfig.preset("dvp", log_rho=-10.0).effective_log_rho == -10.0
    assert not LossConfig.preset("dvp", log_rho=-math.inf).pruning
    with pytest.raises(ValueError, match="mis_dvp"):
        LossConfig.preset("dvp_mis")
    with pytest.raises(dataclasses.FrozenInstanceError):
        LossConfig().cap = 3.0


# ----------------------------------------------------------------------------- reference


REFERENCE_B = 10
# The rejection baselines' bands (E7b) per regime of the reference grids, so that the batches'
# log-ratios (std 0.3 / 1.0) fall on both sides of each (the defaults reject nearly every
# response of these batches).
BANDS = {
    "near": dict(icepop_lo=0.7, icepop_hi=1.5, geo_lo=0.85, geo_hi=1.15, k3_max=0.05),
    "cap": dict(icepop_lo=0.5, icepop_hi=2.5, geo_lo=0.7, geo_hi=1.4, k3_max=0.6),
}


def _reference_batch(prune, regime):
    lp, lr, adv, mask, in_safe = _batch(seed=1, b=REFERENCE_B, t=6, noise=NOISE[regime])
    if not prune:  # the unpruned trainer has no floors
        lp = np.where(in_safe, lp, lr - 0.1).astype(np.float32)
    return lp, lr, adv, mask, in_safe


@pytest.fixture(scope="module")
def reference_grid():
    """Every (correction, normalisation, prune, regime) case of `test_matches_reference`."""
    return _grid(
        {
            (c, n, p, r): (
                LossConfig(prune=p, correction=c, normalisation=n, **BANDS[r]),
                _reference_batch(p, r),
            )
            for c in losses.CORRECTIONS
            for n in losses.NORMALISATIONS
            for p in (True, False)
            for r in NOISE
        }
    )


@pytest.mark.parametrize("regime", ["near", "cap"])
@pytest.mark.parametrize("correction", losses.CORRECTIONS)
@pytest.mark.parametrize("normalisation", losses.NORMALISATIONS)
@pytest.mark.parametrize("prune", [True, False])
def test_matches_reference(reference_grid, correction, normalisation, prune, regime):
    b = REFERENCE_B
    lp, lr, adv, mask, in_safe = _reference_batch(prune, regime)
    if regime == "cap":
        included = ~np.any(mask & ~in_safe, axis=1) if prune else np.ones(b, bool)
        _assert_cap_reached(lp, lr, mask, included)
    loss, metrics, grad = reference_grid[correction, normalisation, prune, regime]
    kw = dict(
        prune=prune, correction=correction, normalisation=normalisation, cap=2.0, **BANDS[regime]
    )
    expect = ref.dvp_loss(lp, lr, adv, mask, in_safe, **kw)
    if correction == "token_icepop":  # the band is crossed: tokens kept and masked
        assert expect["masked_tokens"] > 0 and expect["kept_tokens"] > 0
    if correction in ("seq_geo_rs", "seq_k3_rs"):  # responses kept and rejected
        assert expect["masked_seqs"] > 0 and expect["kept_responses"] > 0
    np.testing.assert_allclose(loss, expect["loss"], rtol=1e-5, atol=1e-6)
    expect_grad = ref.loss_grad(lp, lr, adv, mask, in_safe, **kw)
    np.testing.assert_allclose(grad, expect_grad, rtol=1e-5, atol=1e-7)
    assert metrics["kept_tokens"] == expect["kept_tokens"]
    assert metrics["kept_responses"] == expect["kept_responses"]
    assert metrics["frac_responses_excluded"] * b == pytest.approx(expect["excluded"])
    assert metrics["frac_responses_masked"] * b == pytest.approx(expect["masked_seqs"])
    assert metrics["frac_tokens_masked"] * mask.sum() == pytest.approx(expect["masked_tokens"])
    _assert_weight_stats(metrics, expect["weights"])
    if regime == "cap":  # the data reaches C: what each correction must do there
        if correction in ("token_tis", "seq_tis"):
            assert metrics["is_weight_max"] == pytest.approx(2.0, rel=1e-6)
        if correction == "token_mis":
            assert expect["masked_tokens"] > 0
        if correction == "seq_mis":
            assert expect["masked_seqs"] > 0
        assert "frac_tokens_outside_train_safe" not in metrics  # diagnostics' job, not the loss's


PPO_B = 12


def _ppo_batch():
    """Cap regime for the behaviour weights pi_old / mu; old and current safe sets differ on some
    tokens (both ways), and a response is excluded when a token is outside either one."""
    lp, lr, adv, mask, in_safe = _batch(seed=6, b=PPO_B, t=6, noise=NOISE["cap"])
    rng = np.random.default_rng(7)
    old_in_safe = in_safe.copy()
    i = np.flatnonzero(~np.any(mask & ~in_safe, axis=1))[0]
    old_in_safe[i, 0] = False  # response i is excluded by the old safe set only
    old_in_safe[tuple(np.argwhere(mask & ~in_safe)[0])] = True  # outside the current one only
    finite = np.where(in_safe, lp, lr)  # a finite trainer value where the current one is a floor
    old_logp = np.where(old_in_safe, finite + rng.normal(0, 0.4, lp.shape), pruning.LOGP_FLOOR)
    return lp, lr, adv, mask, in_safe, old_logp.astype(np.float32), old_in_safe


@pytest.fixture(scope="module")
def ppo_grid():
    """Per correction: the PPO loss on `_ppo_batch`, E9's without PPO, and PPO with pi_old = pi
    (`test_ppo_gradient_matches_decoupled_clip_surrogate`)."""
    lp, lr, adv, mask, in_safe, old_logp, old_in_safe = _ppo_batch()
    cases = {}
    for correction in losses.CORRECTIONS:
        cfg, cfg0 = (
            LossConfig(correction=correction, ppo_clip_eps=0.1, **BANDS["cap"]),
            LossConfig(correction=correction, **BANDS["cap"]),
        )
        cases[correction, "ppo"] = (cfg, (lp, lr, adv, mask, in_safe, old_logp, old_in_safe))
        cases[correction, "e9"] = (cfg0, (lp, lr, adv, mask, in_safe))
        cases[correction, "first"] = (cfg, (lp, lr, adv, mask, in_safe, lp, in_safe))
    return _grid(cases)


@pytest.mark.parametrize("correction", losses.CORRECTIONS)
def test_ppo_gradient_matches_decoupled_clip_surrogate(ppo_grid, correction):
    b = PPO_B
    lp, lr, adv, mask, in_safe, old_logp, old_in_safe = _ppo_batch()
    included = ~np.any(mask & ~(in_safe & old_in_safe), axis=1)
    _assert_cap_reached(old_logp, lr, mask, included)
    _, metrics, grad = ppo_grid[correction, "ppo"]
    kw = dict(prune=True, correction=correction, ppo_eps=0.1, **BANDS["cap"])
    kw |= dict(old_logp=old_logp, old_in_safe=old_in_safe)
    expect = ref.dvp_loss(lp, lr, adv, mask, in_safe, **kw)
    # Only the gradient is the surrogate's (the value is E9's with stop-gradient factors r_t).
    expect_grad = ref.loss_grad(lp, lr, adv, mask, in_safe, **kw)
    np.testing.assert_allclose(grad, expect_grad, rtol=1e-4, atol=1e-7)
    assert metrics["kept_tokens"] == expect["kept_tokens"]
    assert metrics["frac_responses_excluded"] * b == pytest.approx(expect["excluded"])
    assert expect["excluded"] == np.sum(~included)
    _assert_weight_stats(metrics, expect["weights"])
    assert 0 < metrics["ppo_clip_frac"] < 1
    # First optimizer step (pi_old = pi): the value and gradient are E9's.
    loss0, _, grad0 = ppo_grid[correction, "e9"]
    loss1, _, grad1 = ppo_grid[correction, "first"]
    np.testing.assert_allclose(loss1, loss0, rtol=1e-6)
    np.testing.assert_allclose(grad1, grad0, rtol=1e-6)


def test_old_logp_and_old_in_safe_must_come_together():
    lp, lr, adv, mask, in_safe = _batch(seed=2)
    ppo = LossConfig(ppo_clip_eps=0.1)
    with pytest.raises(ValueError, match="old_logp"):
        dvp_loss(lp, lr, adv, mask, in_safe, ppo)
    with pytest.raises(ValueError, match="old_logp"):
        dvp_loss(lp, lr, adv, mask, in_safe, LossConfig(), lp)
    with pytest.raises(ValueError, match="old_in_safe"):  # pruning on: old floors need a mask
        dvp_loss(lp, lr, adv, mask, in_safe, ppo, lp)
    with pytest.raises(ValueError, match="old_in_safe"):
        dvp_loss(lp, lr, adv, mask, in_safe, LossConfig(), None, in_safe)
    # Pruning off: no floors on either side, old_in_safe is not needed.
    unpruned = LossConfig(prune=False, ppo_clip_eps=0.1)
    lp_full = np.where(in_safe, lp, lr).astype(np.float32)
    # (jitted: one program instead of an eager compile per operation)
    loss, _ = jax.jit(dvp_loss, static_argnums=5)(
        lp_full, lr, adv, mask, in_safe, unpruned, lp_full
    )
    assert np.isfinite(loss)


def test_token_outside_the_old_safe_set_excludes_the_response_by_hand():
    """Regression: a sampled token inside the current safe set but outside the old policy's.

    Response 0 (3 tokens): log pi_S = (-0.5, -1.0, -0.25), all inside the
    current V_S; the old policy had token 2 outside its V_S, so log pi_S_old(y_2) is the floor
    -1e9 and pi_old / mu = 0 there; A_0 = -1. Before the fix the response was kept, the PPO
    log-ratio clamped at +20 and d loss / d log pi_S(y_2) = exp(20) / 3 = 1.6e8. Now it is
    excluded (E5 on the old safe set): zero gradient, out of Z.
    Response 1: 2 tokens inside both sets, log mu_S = log pi_S_old = log pi_S - 0.05 (so l_t =
    0 with correction none, r_t = exp(0.05) = 1.0512711 < 1 + eps = 1.2: not clipped); A_1 = 1.5.
    Z = 2 kept tokens; d loss / d log pi_S = -(1/2) * 1.5 * 1.0512711 = -0.7884533 on each;
    loss = -(1/2) * 1.5 * 1.0512711 * (-0.3 - 0.7) = 0.7884533.
    """
    lp = jnp.array([[-0.5, -1.0, -0.25], [-0.3, -0.7, 0.0]])
    old_logp = jnp.array([[-0.5, -1.0, pruning.LOGP_FLOOR], [-0.35, -0.75, 0.0]])
    lr = jnp.array([[-0.5, -1.0, -0.25], [-0.35, -0.75, 0.0]])
    mask = jnp.array([[True, True, True], [True, True, False]])
    in_safe = jnp.ones((2, 3), bool)
    old_in_safe = jnp.array([[True, True, False], [True, True, True]])
    adv = jnp.array([-1.0, 1.5])
    cfg = LossConfig.preset("dvp", ppo_clip_eps=0.2)
    loss, metrics, grad = _loss_and_grad(cfg, lp, lr, adv, mask, in_safe, old_logp, old_in_safe)
    r = math.exp(0.05)
    np.testing.assert_allclose(grad, [[0.0] * 3, [-0.75 * r, -0.75 * r, 0.0]], rtol=1e-6)
    np.testing.assert_allclose(loss, 0.75 * r, rtol=1e-6)
    assert metrics["frac_responses_excluded"] == 0.5
    assert metrics["kept_tokens"] == 2
    # Response 0 alone: the response is excluded, nothing is left (loss 0, gradient 0).
    loss, metrics, grad = _loss_and_grad(
        cfg, lp[:1], lr[:1], adv[:1], mask[:1], in_safe[:1], old_logp[:1], old_in_safe[:1]
    )
    np.testing.assert_array_equal(grad, 0.0)
    assert loss == 0.0 and metrics["kept_tokens"] == 0


# ----------------------------------------------------------------------------- by hand


def test_response_with_a_token_outside_the_safe_set_is_excluded_by_hand():
    # Response 0: 3 tokens, all inside V_S, log pi_S = (-0.5, -1.0, -0.25), A_0 = 2.
    # Response 1: 2 tokens, the second outside the trainer's V_S (log pi_S = -inf), A_1 = -1.
    # E5 drops response 1 from numerator and normaliser: Z = 3 tokens and
    # loss = -(1/3) * 2 * (-0.5 - 1.0 - 0.25) = 3.5 / 3 = 1.1666667;
    # d loss / d log pi_S = -2/3 on response 0's tokens, 0 elsewhere (also on the -inf token).
    lp = jnp.array([[-0.5, -1.0, -0.25], [-0.2, -jnp.inf, 0.0]])
    lr = jnp.array([[-0.5, -1.0, -0.25], [-0.2, -3.0, 0.0]])
    mask = jnp.array([[True, True, True], [True, True, False]])
    in_safe = jnp.array([[True, True, True], [True, False, True]])
    adv = jnp.array([2.0, -1.0])
    cfg = LossConfig.preset("dvp")
    loss, metrics, grad = _loss_and_grad(cfg, lp, lr, adv, mask, in_safe)
    np.testing.assert_allclose(loss, 3.5 / 3, rtol=1e-6)
    np.testing.assert_allclose(grad, [[-2 / 3] * 3, [0.0] * 3], rtol=1e-6)
    assert metrics["frac_responses_excluded"] == 0.5
    assert metrics["kept_tokens"] == 3
    # The count of outside tokens is a diagnostic, computed once in `diagnostics`.
    assert "frac_tokens_outside_train_safe" not in metrics
    diag = jax.jit(diagnostics.mismatch_diagnostics)(  # one program, not many eager ops
        logp=lp, behaviour_logp=lr, response_mask=mask, in_safe=in_safe
    )
    np.testing.assert_allclose(diag["frac_tokens_outside_train_safe"], 1 / 5)
    # The same batch with pruning off (rloo) ignores in_safe: response 1 counts (with a finite
    # log-prob in place of the -inf a pruned trainer would not produce).
    lp_full = lp.at[1, 1].set(-3.0)
    loss, metrics, _ = _loss_and_grad(LossConfig.preset("rloo"), lp_full, lr, adv, mask, in_safe)
    np.testing.assert_allclose(loss, -(2 * -1.75 + -1 * -3.2) / 5, rtol=1e-6)


def test_seq_mis_masks_exactly_responses_with_exp_l_above_cap_by_hand():
    # C = 2 (log C = 0.6931). Rollout log-probs all -1; token log-ratios l:
    #   response 0: (0.3, 0.3)  L = 0.6,  exp L = 1.8221188 <= 2 -> kept, w = 1.8221188
    #   response 1: (0.5, 0.3)  L = 0.8,  exp L = 2.2255409 >  2 -> masked
    #   response 2: (-1.0, 0.2) L = -0.8, exp L = 0.4493290 <= 2 -> kept, w = 0.4493290
    # A = (1, 1, -1); Z = 4 kept tokens;
    # numerator = 1.8221188 * 1 * (-0.7 - 0.7) + 0.4493290 * (-1) * (-2.0 - 0.8)
    #           = -2.5509663 + 1.2581211 = -1.2928452; loss = 1.2928452 / 4 = 0.3232113.
    lr = -jnp.ones((3, 2))
    ratio = jnp.array([[0.3, 0.3], [0.5, 0.3], [-1.0, 0.2]])
    mask = jnp.ones((3, 2), bool)
    adv = jnp.array([1.0, 1.0, -1.0])
    cfg = LossConfig.preset("mis_dvp")
    loss, metrics, grad = _loss_and_grad(cfg, lr + ratio, lr, adv, mask, mask)
    np.testing.assert_allclose(loss, 0.3232113, rtol=1e-6)
    np.testing.assert_allclose(metrics["frac_responses_masked"], 1 / 3)
    np.testing.assert_allclose(grad[1], [0.0, 0.0])
    np.testing.assert_allclose(grad[0], [-1.8221188 / 4] * 2, rtol=1e-6)
    np.testing.assert_allclose(metrics["is_weight_max"], 1.8221188, rtol=1e-6)


def test_icepop_masks_tokens_outside_the_band_both_ways_by_hand():
    # Band [0.5, 5]. Rollout log-probs all -1; token log-ratios l (ratio exp l):
    #   response 0: (0.3, -1.0): 1.3498588 kept (w = 1.3498588); 0.3678794 < 0.5 masked
    #   response 1: (2.0, 0.0):  7.3890561 > 5 masked;           1.0 kept (w = 1)
    # A = (1, -1); Z = 2 kept tokens;
    # numerator = 1.3498588 * 1 * (-0.7) + 1 * (-1) * (-1.0) = -0.9449012 + 1 = 0.0550988;
    # loss = -0.0550988 / 2 = -0.0275494; d loss / d logp = -w A / Z on kept tokens.
    lr = -jnp.ones((2, 2))
    ratio = jnp.array([[0.3, -1.0], [2.0, 0.0]])
    mask = jnp.ones((2, 2), bool)
    cfg = LossConfig.preset("icepop")
    assert (cfg.icepop_lo, cfg.icepop_hi) == (0.5, 5.0)
    loss, metrics, grad = _loss_and_grad(cfg, lr + ratio, lr, jnp.array([1.0, -1.0]), mask, mask)
    np.testing.assert_allclose(loss, -0.0275494, rtol=1e-5)
    np.testing.assert_allclose(grad, [[-0.6749294, 0.0], [0.0, 0.5]], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(metrics["frac_tokens_masked"], 0.5)
    np.testing.assert_allclose(metrics["frac_responses_masked"], 0.0)


def test_geometric_mean_rejection_reads_the_mean_log_ratio_by_hand():
    # Band [0.9, 1.1] (log: [-0.1053605, 0.0953102]). Rollout log-probs all -1; l per token:
    #   response 0: (0.3, -0.3)  mean 0     -> geometric mean 1.0000000 kept (a token at 1.35)
    #   response 1: (0.3, 0.0)   mean 0.15  -> 1.1618342 > 1.1 rejected
    #   response 2: (-0.1, 0.0)  mean -0.05 -> 0.9512294 kept
    # A = (1, 1, -1); w = 1; Z = 4 kept tokens;
    # numerator = (-0.7 - 1.3) + (-1) (-1.1 - 1.0) = -2.0 + 2.1 = 0.1; loss = -0.1 / 4 = -0.025.
    lr = -jnp.ones((3, 2))
    ratio = jnp.array([[0.3, -0.3], [0.3, 0.0], [-0.1, 0.0]])
    mask = jnp.ones((3, 2), bool)
    cfg = LossConfig.preset("geo_rs", geo_lo=0.9, geo_hi=1.1)
    adv = jnp.array([1.0, 1.0, -1.0])
    loss, metrics, grad = _loss_and_grad(cfg, lr + ratio, lr, adv, mask, mask)
    np.testing.assert_allclose(loss, -0.025, rtol=1e-5)
    np.testing.assert_allclose(grad, [[-0.25, -0.25], [0.0, 0.0], [0.25, 0.25]], rtol=1e-6)
    np.testing.assert_allclose(metrics["frac_responses_masked"], 1 / 3)
    np.testing.assert_allclose(metrics["is_weight_max"], 1.0)


def test_k3_rejection_catches_a_symmetric_deviation_by_hand():
    # k3(l) = exp(l) - 1 - l; bound 0.01. Rollout log-probs all -1; l per token:
    #   response 0: (0.1, -0.1): k3 0.0051709, 0.0048374, mean 0.0050042 <= 0.01 kept
    #   response 1: (0.3, 0.0):  k3 0.0498588, 0,         mean 0.0249294 >  0.01 rejected
    #   response 2: (0.2, -0.2): k3 0.0214028, 0.0187308, mean 0.0200668 >  0.01 rejected,
    #     though its geometric-mean ratio is exactly 1 (seq_geo_rs would keep it)
    # A = (1, -1, 1); Z = 2 kept tokens; numerator = -0.9 - 1.1 = -2.0; loss = 2.0 / 2 = 1.0.
    lr = -jnp.ones((3, 2))
    ratio = jnp.array([[0.1, -0.1], [0.3, 0.0], [0.2, -0.2]])
    mask = jnp.ones((3, 2), bool)
    adv = jnp.array([1.0, -1.0, 1.0])
    loss, metrics, grad = _loss_and_grad(
        LossConfig.preset("k3_rs", k3_max=0.01), lr + ratio, lr, adv, mask, mask
    )
    np.testing.assert_allclose(loss, 1.0, rtol=1e-5)
    np.testing.assert_allclose(grad, [[-0.5, -0.5], [0.0, 0.0], [0.0, 0.0]], rtol=1e-6)
    np.testing.assert_allclose(metrics["frac_responses_masked"], 2 / 3)
    geo = LossConfig.preset("geo_rs", geo_lo=0.9, geo_hi=1.1)
    _, m_geo, _ = _loss_and_grad(geo, lr + ratio, lr, adv, mask, mask)
    np.testing.assert_allclose(m_geo["frac_responses_masked"], 1 / 3)  # response 1 only


# ----------------------------------------------------------------------------- identities


def test_identical_logprobs_give_unit_weights_and_equal_presets():
    lp, _, adv, mask, _ = _batch(seed=4)
    lp = np.where(mask, lp, -1.0).astype(np.float32)  # no floors: everything inside
    inside = np.ones_like(mask)
    args = (lp, lp, adv, mask, inside)
    results = _grid(
        {name: (LossConfig.preset(name), args) for name in losses.PRESETS}
        | {
            correction: (LossConfig(correction=correction), args)
            for correction in losses.CORRECTIONS
        }
    )
    base_loss, _, base_grad = results["rloo"]
    for name in losses.PRESETS:
        loss, metrics, grad = results[name]
        np.testing.assert_allclose(loss, base_loss, rtol=1e-6)
        np.testing.assert_allclose(grad, base_grad, rtol=1e-6)
        assert metrics["is_weight_mean"] == 1.0 and metrics["is_weight_max"] == 1.0
        assert metrics["is_weight_ess"] == pytest.approx(1.0)
    for correction in losses.CORRECTIONS:
        _, metrics, _ = results[correction]
        assert metrics["is_weight_mean"] == 1.0 and metrics["is_weight_max"] == 1.0


def test_no_pruning_and_no_correction_is_plain_rloo_reinforce():
    rng = np.random.default_rng(5)
    p, g = 3, 4
    rewards = rng.integers(0, 2, size=p * g).astype(np.float32)
    adv = advantages.rloo(rewards, group_size=g)
    lp, lr, _, mask, _ = _batch(seed=5, b=p * g, outside_rate=0.0)
    loss, _, grad = _loss_and_grad(LossConfig.preset("rloo"), lp, lr, adv, mask, None)
    # REINFORCE with the leave-one-out baseline, averaged over all response tokens.
    a = ref.rloo(rewards.reshape(p, g)).reshape(-1)
    expect = -np.sum(a[:, None] * np.where(mask, lp, 0.0)) / mask.sum()
    np.testing.assert_allclose(loss, expect, rtol=1e-5)
    np.testing.assert_allclose(grad, -a[:, None] * mask / mask.sum(), rtol=1e-5, atol=1e-8)


PADDING_GARBAGE = [np.nan, -np.inf, np.inf, 1e30]


@pytest.fixture(scope="module")
def padding_grid():
    """Per (correction, normalisation): the PPO loss on a batch and on that batch padded with
    each garbage value (`test_padding_never_changes_loss_or_gradients`)."""
    lp, lr, adv, mask, in_safe = _batch(seed=6)
    old = (lp + 0.05).astype(np.float32)

    def pad(x, value):  # 3 more positions per response and one all-padding response
        x = np.concatenate([x, np.full((B, 3), value, x.dtype)], axis=1)
        return np.concatenate([x, np.full((1, T + 3), value, x.dtype)], axis=0)

    cases = {}
    for correction in losses.CORRECTIONS:
        for normalisation in losses.NORMALISATIONS:
            cfg = LossConfig(correction=correction, normalisation=normalisation, ppo_clip_eps=0.2)
            cases[correction, normalisation, None] = (
                cfg,
                (lp, lr, adv, mask, in_safe, old, in_safe),
            )
            for i, value in enumerate(PADDING_GARBAGE):
                other = PADDING_GARBAGE[(i + 1) % len(PADDING_GARBAGE)]
                padded = (
                    pad(lp, value),
                    pad(lr, other),
                    np.concatenate([adv, [np.float32(5.0)]]),
                    pad(mask, False),
                    pad(in_safe, i % 2 == 0),
                    pad(old, other),
                    pad(in_safe, i % 2 == 1),
                )
                cases[correction, normalisation, i] = (cfg, padded)
    return _grid(cases)


@pytest.mark.parametrize("correction", losses.CORRECTIONS)
@pytest.mark.parametrize("normalisation", losses.NORMALISATIONS)
def test_padding_never_changes_loss_or_gradients(padding_grid, correction, normalisation):
    loss, metrics, grad = padding_grid[correction, normalisation, None]
    for i in range(len(PADDING_GARBAGE)):
        got_loss, got_metrics, got_grad = padding_grid[correction, normalisation, i]
        # The padded batch is another program (other shapes, other reduction lengths): equal
        # to float32 rounding, 1e-6 relative; padding itself contributes exact zeros.
        np.testing.assert_allclose(got_loss, loss, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(got_grad[:B, :T], grad, rtol=1e-6, atol=1e-8)
        np.testing.assert_array_equal(got_grad[B:], 0.0)
        np.testing.assert_array_equal(got_grad[:, T:], 0.0)
        for k in ("kept_tokens", "kept_responses"):  # counts: exact
            np.testing.assert_array_equal(got_metrics[k], metrics[k])
        for k in ("is_weight_mean", "is_weight_max"):
            np.testing.assert_allclose(got_metrics[k], metrics[k], rtol=1e-6)


def test_no_retrace_on_second_call():
    cfg = LossConfig.preset("mis_dvp")

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(lp, lr, adv, mask, in_safe):
        fn = lambda lp: dvp_loss(lp, lr, adv, mask, in_safe, cfg)
        return jax.value_and_grad(fn, has_aux=True)(lp)

    step(*_batch(seed=7))
    step(*_batch(seed=8))


def test_end_to_end_chunked_logprobs_into_loss_matches_unchunked():
    """Loss gradients w.r.t. hidden states and unembedding: chunked path == logits path."""
    rng = np.random.default_rng(9)
    d, v = 8, 40
    h = rng.normal(size=(B, T, d)).astype(np.float32)
    w = (1.5 * rng.normal(size=(d, v))).astype(np.float32)
    # Mostly the argmax (inside any safe set), sometimes a random token (often outside).
    y = np.where(rng.random((B, T)) < 0.9, np.argmax(h @ w, axis=-1), rng.integers(0, v, (B, T)))
    y = y.astype(np.int32)
    _, lr, adv, mask, _ = _batch(seed=9)
    cfg = LossConfig.preset("mis_dvp", log_rho=-2.5)

    def loss_fn(h, w, chunked):
        if chunked:
            tl = chunked_pruned_logprobs(h, w, y, log_rho=cfg.effective_log_rho, chunk_size=16)
        else:
            logits = jnp.einsum("btd,dv->btv", h, w)
            tl = pruning.pruned_token_logprobs(logits, y, cfg.effective_log_rho)
        return dvp_loss(tl.logp, lr, adv, mask, tl.in_safe, cfg)

    def vg(chunked):
        fn = functools.partial(loss_fn, chunked=chunked)
        return jax.jit(jax.value_and_grad(fn, argnums=(0, 1), has_aux=True))(h, w)

    (loss_c, m_c), grads_c = vg(True)
    (loss_u, m_u), grads_u = vg(False)
    assert 0 < m_c["frac_responses_excluded"] < 1  # the case exercises E5
    np.testing.assert_allclose(loss_c, loss_u, rtol=1e-5)
    for a, b in zip(grads_c, grads_u, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * np.abs(b).max())
