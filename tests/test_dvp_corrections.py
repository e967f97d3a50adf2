"""The correction family beyond E7 (E14-E17): combinable rejection rules, worst-token rejection,
OPSM, batch-normalised weights and the peers' presets, in the loss (`losses.dvp_loss`).

Tolerances as in test_dvp_losses.py: loss values and weight statistics 1e-5 relative against the
float64 loop reference (`tests/reference.py`, 1e-6 absolute near 0); gradients 1e-5 relative
against its central finite differences (1e-4 under PPO, composed); packed == padded 1e-5
relative (segment sums add in another order), 1e-6 absolute.

The reference cases use `test_dvp_losses`' batches; each rule's band per regime (`RULES`) is
set inside the spread of that regime's statistics, so that every rule keeps some tokens and
rejects others (asserted).
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dvp_jax.dvp import corrections, losses
from dvp_jax.dvp.losses import LossConfig, dvp_loss
from dvp_jax.dvp.segments import Segments
from tests import reference as ref
from tests.test_dvp_losses import _batch, _grid, _reference_batch

# One band per rule and regime ("near": log-ratio noise 0.3, "cap": 1.0).
RULES = {
    "near": dict(
        token_k1="0.85:1.2", token_k2="0.02", token_k3="0.02",
        seq_sum_k1="0.8:1.3", seq_sum_k2="0.1", seq_sum_k3="0.1",
        seq_mean_k1="0.95:1.1", seq_mean_k2="0.02", seq_mean_k3="0.03",
        seq_max_k2="0.05", seq_max_k3="0.06", opsm="0.02",
    ),
    "cap": dict(
        token_k1="0.6:2", token_k2="0.2", token_k3="0.2",
        seq_sum_k1="0.5:2", seq_sum_k2="1.0", seq_sum_k3="1.0",
        seq_mean_k1="0.8:1.5", seq_mean_k2="0.25", seq_mean_k3="0.3",
        seq_max_k2="0.5", seq_max_k3="0.6", opsm="0.05",
    ),
}  # fmt: skip
assert all(set(r) == set(corrections.RULE_KINDS) for r in RULES.values())

# Stacks: (correction, rules, batch_normalise_weights, normalisation).
STACKS = {
    **{kind: ("none", (kind,), False, "token_mean") for kind in corrections.RULE_KINDS},
    "skyrl_geo_tis": ("token_tis", ("seq_mean_k1",), False, "token_mean"),
    "verl_seq_is_rs": ("seq_tis", ("seq_sum_k1",), False, "seq_mean_token_sum"),
    "mis_stack": ("token_mis", ("token_k3", "seq_max_k2", "opsm"), False, "token_mean"),
    "icepop_worst": ("token_icepop", ("seq_max_k3", "opsm"), False, "seq_mean_token_sum"),
    "bn_token_tis": ("token_tis", (), True, "token_mean"),
    "bn_seq_tis": ("seq_tis", (), True, "token_mean"),
    "bn_tis_rules": ("token_tis", ("seq_max_k3", "token_k1"), True, "seq_mean_token_sum"),
}


def _spec(rules, regime):
    return ",".join(f"{k}={RULES[regime][k]}" for k in rules)


def _ref_rules(rules, regime):
    out = []
    for kind in rules:
        band = [float(v) for v in RULES[regime][kind].split(":")]
        out.append((kind, band[0], band[1]) if len(band) == 2 else (kind, 0.0, band[0]))
    return tuple(out)


def _cfg(stack, regime, prune, **kw):
    correction, rules, bn, normalisation = STACKS[stack]
    return LossConfig(
        prune=prune,
        correction=correction,
        rejection=_spec(rules, regime),
        batch_normalise_weights=bn,
        normalisation=normalisation,
        **kw,
    )


def _ref_kw(stack, regime, prune):
    correction, rules, bn, normalisation = STACKS[stack]
    return dict(
        prune=prune,
        correction=correction,
        normalisation=normalisation,
        rules=_ref_rules(rules, regime),
        batch_normalise=bn,
    )


# ----------------------------------------------------------------------------- syntax


@pytest.mark.parametrize(
    "spec, why",
    [
        ("seq_max_k3", "missing '=BAND'"),
        ("seq_max_k4=0.1", "unknown rule"),
        ("seq_mean_k1=1.2:2", "0 < LO <= 1 <= HI"),
        ("token_k1=0.5", "0 < LO <= 1 <= HI"),
        ("token_k2=0.1:0.2", "one number"),
        ("seq_max_k2=0", "> 0"),
        ("opsm=-0.1", ">= 0"),
        ("opsm=1e-4,opsm=1e-3", "given twice"),
        ("token_k3=abc", "not a number"),
        ("seq_sum_k2=inf", "finite"),
    ],
)
def test_a_bad_rule_is_one_line_naming_the_field_and_the_entry(spec, why):
    with pytest.raises(ValueError, match="LossConfig.rejection") as e:
        LossConfig(rejection=spec)
    assert why in str(e.value) and "\n" not in str(e.value)


def test_rules_parse_with_spaces_and_rejection_baselines_keep_their_own_rule():
    cfg = LossConfig(rejection=" seq_mean_k1 = 0.99:1.01 , opsm=1e-4,")
    assert cfg.rules == (
        corrections.Rule("seq_mean_k1", 0.99, 1.01),
        corrections.Rule("opsm", 0.0, 1e-4),
    )
    assert LossConfig().rules == ()
    geo = LossConfig(correction="seq_geo_rs", geo_lo=0.9, geo_hi=1.2, rejection="seq_max_k2=1")
    assert [r.kind for r in geo.rules] == ["seq_mean_k1", "seq_max_k2"]
    with pytest.raises(ValueError, match="already applies"):
        LossConfig(correction="seq_k3_rs", rejection="seq_mean_k3=0.1")
    with pytest.raises(ValueError, match="batch_normalise_weights.*kl_coef"):
        LossConfig(batch_normalise_weights=True, kl_coef=0.1)


# ----------------------------------------------------------------------------- reference


@pytest.fixture(scope="module")
def rules_grid():
    return _grid(
        {
            (s, p, r): (_cfg(s, r, p), _reference_batch(p, r))
            for s in STACKS
            for p in (True, False)
            for r in RULES
        }
    )


@pytest.mark.parametrize("regime", list(RULES))
@pytest.mark.parametrize("prune", [True, False])
@pytest.mark.parametrize("stack", list(STACKS))
def test_rules_match_reference(rules_grid, stack, prune, regime):
    lp, lr, adv, mask, in_safe = _reference_batch(prune, regime)
    loss, metrics, grad = rules_grid[stack, prune, regime]
    kw = _ref_kw(stack, regime, prune)
    expect = ref.dvp_loss(lp, lr, adv, mask, in_safe, **kw)
    np.testing.assert_allclose(loss, expect["loss"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        grad, ref.loss_grad(lp, lr, adv, mask, in_safe, **kw), rtol=1e-5, atol=1e-7
    )
    assert metrics["kept_tokens"] == expect["kept_tokens"] > 0
    assert metrics["kept_responses"] == expect["kept_responses"]
    b, n = mask.shape[0], mask.sum()
    assert metrics["frac_responses_masked"] * b == pytest.approx(expect["masked_seqs"])
    assert metrics["frac_tokens_masked"] * n == pytest.approx(expect["masked_tokens"])
    for kind, count in expect["rejected"].items():
        assert 0 < count  # the band is crossed: this rule rejects, and tokens stay (above)
        assert metrics["rejected/" + kind] * n == pytest.approx(count)
    assert {k for k in metrics if k.startswith("rejected/")} == {
        "rejected/" + k for k in expect["rejected"]
    }
    w = np.asarray(expect["weights"])
    ess = w.sum() ** 2 / (len(w) * np.sum(w * w))
    got = [metrics[k] for k in ("is_weight_mean", "is_weight_max", "is_weight_ess")]
    np.testing.assert_allclose(got, [w.mean(), w.max(), ess], rtol=1e-5)
    if STACKS[stack][2]:  # E17: the applied weights average 1 over what they count
        np.testing.assert_allclose(metrics["is_weight_mean"], 1.0, rtol=1e-6)


def test_rules_under_decoupled_ppo_match_reference():
    """With decoupled PPO the rules read pi_old / mu (E6), OPSM the current pi (E16)."""
    from tests.test_dvp_losses import _ppo_batch

    lp, lr, adv, mask, in_safe, old_logp, old_in_safe = _ppo_batch()
    cfg = _cfg("mis_stack", "cap", True, ppo_clip_eps=0.1)
    fn = lambda x: dvp_loss(x, lr, adv, mask, in_safe, cfg, old_logp, old_in_safe)
    (loss, metrics), grad = jax.jit(jax.value_and_grad(fn, has_aux=True))(lp)
    kw = _ref_kw("mis_stack", "cap", True) | dict(
        ppo_eps=0.1, old_logp=old_logp, old_in_safe=old_in_safe
    )
    expect = ref.dvp_loss(lp, lr, adv, mask, in_safe, **kw)
    assert expect["rejected"]["opsm"] > 0 and expect["rejected"]["seq_max_k2"] > 0
    np.testing.assert_allclose(
        grad, ref.loss_grad(lp, lr, adv, mask, in_safe, **kw), rtol=1e-4, atol=1e-7
    )
    assert metrics["kept_tokens"] == expect["kept_tokens"]
    for kind, count in expect["rejected"].items():
        assert metrics["rejected/" + kind] * mask.sum() == pytest.approx(count)


# ----------------------------------------------------------------------------- by hand


def _hand(cfg, ratio, adv, norm=None):
    """loss, metrics, d loss / d logp of responses with rollout log-probs -1 everywhere and
    token log-ratios `ratio` (rows = responses, all tokens response tokens)."""
    ratio = jnp.asarray(ratio, jnp.float32)
    lr = jnp.full(ratio.shape, -1.0)
    mask = jnp.ones(ratio.shape, bool)
    adv = jnp.asarray(adv, jnp.float32)
    fn = lambda x: dvp_loss(x, lr, adv, mask, mask, cfg, is_weight_norm=norm)
    (loss, metrics), grad = jax.value_and_grad(fn, has_aux=True)(lr + ratio)
    return loss, metrics, grad


def test_worst_token_rejection_reads_the_largest_token_by_hand():
    # seq_max_k2 = 0.04 and seq_max_k3 = 0.04 on the same responses, rollout log-probs -1:
    #   response 0: l = (0.25, -0.05): k2 = (0.03125, 0.00125) max 0.03125 <= 0.04 kept;
    #               k3 = (0.0340254, 0.0012294) max 0.0340254 <= 0.04 kept
    #   response 1: l = (0.0, -0.3):  k2 = (0, 0.045) max 0.045 > 0.04 rejected;
    #               k3 = (0, 0.0408182) max 0.0408182 > 0.04 rejected
    #   response 2: l = (0.28, 0.0):  k2 = 0.0392 <= 0.04 kept; k3 = 0.0431298 > 0.04 rejected
    #   (its mean k3 0.0215649 would pass a seq_mean_k3 bound of 0.04: the worst token decides)
    # A = (1, -1, 1), w = 1. seq_max_k2: Z = 4 kept tokens (responses 0, 2),
    #   numerator = (-0.75 - 1.05) + (-0.72 - 1.0) = -3.52, loss = 3.52 / 4 = 0.88.
    # seq_max_k3: Z = 2 (response 0), numerator = -1.8, loss = 0.9; d loss / d logp = -A / Z.
    ratio = [[0.25, -0.05], [0.0, -0.3], [0.28, 0.0]]
    adv = [1.0, -1.0, 1.0]
    loss2, m2, g2 = _hand(LossConfig(rejection="seq_max_k2=0.04"), ratio, adv)
    loss3, m3, g3 = _hand(LossConfig(rejection="seq_max_k3=0.04"), ratio, adv)
    mean3, _, _ = _hand(LossConfig(rejection="seq_mean_k3=0.04"), ratio, adv)
    np.testing.assert_allclose([loss2, loss3], [0.88, 0.9], rtol=1e-5)
    np.testing.assert_allclose(g2, [[-0.25] * 2, [0.0] * 2, [-0.25] * 2], rtol=1e-6)
    np.testing.assert_allclose(g3, [[-0.5] * 2, [0.0] * 2, [0.0] * 2], rtol=1e-6)
    np.testing.assert_allclose(
        [m2["frac_responses_masked"], m3["frac_responses_masked"]], [1 / 3, 2 / 3]
    )
    np.testing.assert_allclose(m3["rejected/seq_max_k3"], 4 / 6)
    # seq_mean_k3 keeps all three (means 0.0176, 0.0204, 0.0216): -(-1.8 + 2.3 - 1.72) / 6
    np.testing.assert_allclose(mean3, 1.22 / 6, rtol=1e-5)


def test_opsm_masks_only_negative_advantages_far_off_policy_by_hand():
    # opsm, delta = 0.1; rollout log-probs -1; mean_t log(mu / pi) = -mean_t l:
    #   response 0: l = (-0.3, -0.1): KL 0.2 > 0.1, A = -1 < 0  -> masked
    #   response 1: l = (-0.3, -0.1): KL 0.2 > 0.1, A = +1      -> kept (only A < 0 is masked)
    #   response 2: l = (0.1, -0.2):  KL 0.05 <= 0.1, A = -1    -> kept
    # w = 1, Z = 4; numerator = 1 (-1.3 - 1.1) + (-1)(-0.9 - 1.2) = -2.4 + 2.1 = -0.3;
    # loss = 0.3 / 4 = 0.075; d loss / d logp = -A / Z on kept tokens.
    ratio = [[-0.3, -0.1], [-0.3, -0.1], [0.1, -0.2]]
    loss, metrics, grad = _hand(LossConfig.preset("opsm", rejection="opsm=0.1"), ratio, [-1, 1, -1])
    np.testing.assert_allclose(loss, 0.075, rtol=1e-5)
    np.testing.assert_allclose(grad, [[0.0] * 2, [-0.25] * 2, [0.25] * 2], rtol=1e-6)
    np.testing.assert_allclose(metrics["frac_responses_masked"], 1 / 3)
    np.testing.assert_allclose(metrics["rejected/opsm"], 2 / 6)
    assert LossConfig.preset("opsm").rules == (corrections.Rule("opsm", 0.0, 1e-4),)


def test_combined_rules_keep_a_token_only_if_every_rule_does_by_hand():
    # token_k1 = 0.8:1.25 (log: -0.2231436, 0.2231436) and seq_sum_k1 = 0.7:1.5 (log:
    # -0.3566749, 0.4054651), rollout log-probs -1:
    #   response 0: l = (0.3, 0.0):   token 0 out of token_k1 (1.35 > 1.25); L = 0.3 kept
    #   response 1: l = (0.2, 0.25):  token 1 out (1.284); L = 0.45 > 0.405 rejected: none left
    #   response 2: l = (-0.1, -0.1): both tokens in; L = -0.2 kept
    # token_tis (cap 2): w = exp(l): response 0 token 1 w = 1, response 2 w = 0.9048374 each.
    # A = (1, 1, -1); Z = 3 kept tokens; numerator = 1 (1)(-1.0) + 2 (0.9048374)(-1)(-1.1)
    #   = -1.0 + 1.9906423 = 0.9906423; loss = -0.9906423 / 3 = -0.3302141.
    ratio = [[0.3, 0.0], [0.2, 0.25], [-0.1, -0.1]]
    cfg = LossConfig(correction="token_tis", rejection="token_k1=0.8:1.25,seq_sum_k1=0.7:1.5")
    loss, metrics, grad = _hand(cfg, ratio, [1, 1, -1])
    np.testing.assert_allclose(loss, -0.3302141, rtol=1e-5)
    w = 0.9048374 / 3
    np.testing.assert_allclose(grad, [[0.0, -1 / 3], [0.0, 0.0], [w, w]], rtol=1e-5)
    np.testing.assert_allclose(metrics["frac_tokens_masked"], 2 / 6)  # the two token_k1 hits
    np.testing.assert_allclose(metrics["frac_responses_masked"], 1 / 3)
    np.testing.assert_allclose(metrics["rejected/token_k1"], 2 / 6)
    np.testing.assert_allclose(metrics["rejected/seq_sum_k1"], 2 / 6)
    assert metrics["kept_tokens"] == 3 and metrics["kept_responses"] == 2


def test_batch_normalised_weights_average_one_by_hand():
    # token_tis, cap 2, rollout log-probs -1; l = (ln 2, 0) and (-ln 2, ln 4):
    #   raw w = (2, 1, 0.5, 2 (capped from 4)); mean 5.5 / 4 = 1.375; normalised w = w / 1.375.
    # A = (1, -1); numerator (raw) = 1 (2 (ln 2 - 1) + 1 (-1))
    #   + (-1)(0.5 (-ln 2 - 1) + 2 (ln 4 - 1))
    #   = (-0.6137056 - 1) - (-0.8465736 + 0.7725887) = -1.6137056 + 0.0739849 = -1.5397207;
    # loss = 1.5397207 / 1.375 / 4 = 0.2799492.
    ratio = [[math.log(2), 0.0], [-math.log(2), math.log(4)]]
    cfg = LossConfig(correction="token_tis", batch_normalise_weights=True)
    loss, metrics, grad = _hand(cfg, ratio, [1, -1])
    np.testing.assert_allclose(loss, 0.2799492, rtol=1e-5)
    s = 1 / (1.375 * 4)
    np.testing.assert_allclose(grad, [[-2 * s, -1 * s], [0.5 * s, 2 * s]], rtol=1e-5)
    np.testing.assert_allclose(metrics["is_weight_mean"], 1.0, rtol=1e-6)
    np.testing.assert_allclose(metrics["is_weight_max"], 2 / 1.375, rtol=1e-6)
    # A caller's batch mean replaces this call's: 1.0 gives the raw weights (a micro-batch,
    # whose sum and count the update adds up, `losses.weight_total`).
    raw, m_raw, _ = _hand(cfg, ratio, [1, -1], norm=1.0)
    np.testing.assert_allclose(raw, 0.2799492 * 1.375, rtol=1e-5)
    np.testing.assert_allclose(losses.weight_total(m_raw, cfg), [5.5, 4.0], rtol=1e-6)


# ----------------------------------------------------------------------------- packed == padded


def _pack_case(lp, lr, adv, mask, in_safe):
    """Rows 2k and 2k+1 side by side in row k `[B/2, 2T]`, segment ids 1 and 2 on their
    response tokens (0 elsewhere), the advantage per token (the packed layout)."""
    b, t = mask.shape
    ids = np.where(mask, 1 + (np.arange(b) % 2)[:, None], 0).reshape(b // 2, 2 * t)
    adv_t = np.broadcast_to(np.asarray(adv)[:, None], (b, t))
    args = [np.asarray(a).reshape(b // 2, 2 * t) for a in (lp, lr, adv_t, mask, in_safe)]
    return args, Segments(jnp.asarray(ids, jnp.int32), 2)


@functools.partial(jax.jit, static_argnames=("cfgs",))
def _packed_and_padded(cfgs, padded_args, packed_args, segments):
    out = []
    for cfg in cfgs:
        f = lambda x, args, seg, cfg=cfg: dvp_loss(x, *args[1:], cfg, segments=seg)
        pad = jax.value_and_grad(f, has_aux=True)(padded_args[0], padded_args, None)
        pack = jax.value_and_grad(f, has_aux=True)(packed_args[0], packed_args, segments)
        out.append((pad, pack))
    return out


@pytest.mark.parametrize("regime", list(RULES))
def test_packed_rows_equal_padded_rows(regime):
    """Every stack's loss, metrics and gradient on two responses per packed row equal the
    padded rows' (E14-E17 reduce per response with segment sums)."""
    prune = True
    lp, lr, adv, mask, in_safe = _reference_batch(prune, regime)
    packed_args, segments = _pack_case(lp, lr, adv, mask, in_safe)
    stacks = list(STACKS)
    cfgs = tuple(_cfg(s, regime, prune) for s in stacks)
    results = _packed_and_padded(cfgs, (lp, lr, adv, mask, in_safe), packed_args, segments)
    b, t = mask.shape
    for stack, (((l0, m0), g0), ((l1, m1), g1)) in zip(stacks, results, strict=True):
        assert set(m0) == set(m1), stack
        np.testing.assert_allclose(l1, l0, rtol=1e-5, atol=1e-6, err_msg=stack)
        for k in m0:
            np.testing.assert_allclose(m1[k], m0[k], rtol=1e-5, atol=1e-6, err_msg=stack + k)
        np.testing.assert_allclose(
            np.asarray(g1).reshape(b, t), g0, rtol=1e-5, atol=1e-7, err_msg=stack
        )


def test_identical_logprobs_reject_nothing():
    lp, _, adv, mask, _ = _batch(seed=4)
    lp = np.where(mask, lp, -1.0).astype(np.float32)
    inside = np.ones_like(mask)
    spec = ",".join(f"{k}={RULES['near'][k]}" for k in corrections.RULE_KINDS)
    loss, metrics = dvp_loss(lp, lp, adv, mask, inside, LossConfig(rejection=spec))
    base, _ = dvp_loss(lp, lp, adv, mask, inside, LossConfig())
    np.testing.assert_allclose(loss, base, rtol=1e-6)
    assert all(float(metrics["rejected/" + k]) == 0 for k in corrections.RULE_KINDS)
