"""Min-p sampler (E1, E3, E4) against float64 NumPy references, `pruning` and a chi-square test.

Tolerances: float32 statistics of logits of size |z| <= ~20 against float64 are a few float32
ulps (observed max 1.7e-7 absolute, 3.3e-7 relative for the pruned mass); bounds are set a
little above that. Where two quantities come from the same float32 expression the test is exact.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from dvp_jax.dvp import pruning
from dvp_jax.rollout import sampling


def _np_reference(logits, tokens, temperature, log_rho):
    """Float64 E1-E4 for the given tokens: (logp_S, logp_full, pruned_mass, safe_size, safe)."""
    z = np.asarray(logits, np.float64) / temperature
    safe = z >= z.max(-1, keepdims=True) + log_rho
    log_z = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
    zs = np.where(safe, z, -np.inf)
    log_zs = np.log(np.exp(zs - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
    z_y = np.take_along_axis(z, tokens[:, None], -1)[:, 0]
    return z_y - log_zs, z_y - log_z, 1 - np.exp(log_zs - log_z), safe.sum(-1), safe


# One jitted sampler for all tests (eager op-by-op dispatch is slower than compiling).
_sample = jax.jit(sampling.sample)


def _keys(seed, n):
    return jax.random.split(jax.random.key(seed), n)


def test_stats_match_float64_reference_and_tokens_are_in_safe_set():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(4.0 * rng.standard_normal((64, 32)), jnp.float32)
    params = sampling.SamplingParams.create(temperature=0.7, log_rho=-2.0)
    tokens, st = _sample(_keys(0, 64), logits, params)
    tokens = np.asarray(tokens)
    logp, logp_full, mass, size, safe = _np_reference(logits, tokens, 0.7, -2.0)
    # Every sampled token lies in the safe set (E1), so its pruned log-prob is finite.
    assert safe[np.arange(64), tokens].all()
    assert np.asarray(st.in_safe).all()
    # float32 vs float64 on |z| <= ~20 (ulp(16) = 1.9e-6): observed 1.3e-7 (logp), 1.7e-7
    # (logp_full), 3.3e-7 relative (mass, from the pruned terms, so relative even when tiny).
    np.testing.assert_allclose(st.logp, logp, rtol=0, atol=1e-6)
    np.testing.assert_allclose(st.logp_full, logp_full, rtol=0, atol=1e-6)
    np.testing.assert_allclose(st.pruned_mass, mass, rtol=2e-6, atol=1e-12)
    np.testing.assert_array_equal(st.safe_size, size)
    assert (size < 32).all() and (mass > 0).any()


def test_no_pruning_when_log_rho_is_minus_inf():
    logits = jnp.asarray(np.random.default_rng(1).standard_normal((8, 16)) * 10, jnp.float32)
    params = sampling.SamplingParams.create(log_rho=-math.inf)
    _, st = _sample(_keys(1, 8), logits, params)
    np.testing.assert_array_equal(st.safe_size, 16)
    np.testing.assert_array_equal(st.pruned_mass, 0.0)
    # Exact: with nothing outside V_S both are (z_y - max z) - log(sum_safe + 0).
    np.testing.assert_array_equal(st.logp, st.logp_full)


def test_temperature_is_applied_before_pruning():
    logits = jnp.asarray([[0.0, -3.0]], jnp.float32)
    # tau = 1: z_1 = -3 < 0 - 2 is pruned; tau = 2: z_1 = -1.5 >= -2 is kept.
    for tau, expected in ((1.0, 1), (2.0, 2)):
        params = sampling.SamplingParams.create(temperature=tau, log_rho=-2.0)
        _, st = _sample(_keys(2, 1), logits, params)
        assert int(st.safe_size[0]) == expected


def test_greedy_takes_argmax_for_every_key():
    logits = jnp.asarray(np.random.default_rng(3).standard_normal((16, 24)), jnp.float32)
    params = sampling.SamplingParams.create(greedy=True, temperature=0.3, log_rho=-1.0)
    for seed in range(3):
        tokens, st = _sample(_keys(seed, 16), logits, params)
        np.testing.assert_array_equal(tokens, np.argmax(np.asarray(logits), -1))
    # Recorded log-probs are still those of mu_S at tau = 1 (greedy ignores temperature).
    # float32 vs float64 (observed 9.7e-8).
    ref = _np_reference(logits, np.asarray(tokens), 1.0, -1.0)
    np.testing.assert_allclose(st.logp, ref[0], rtol=0, atol=1e-6)


def test_noise_changes_the_behaviour_distribution_consistently():
    logits = jnp.asarray(np.random.default_rng(4).standard_normal((256, 16)) * 3, jnp.float32)
    keys = _keys(4, 256)
    context = jnp.arange(256, dtype=jnp.uint32)
    noise = sampling.SamplingParams.create(log_rho=-3.0, noise_std=1.0)
    clean, _ = _sample(keys, logits, sampling.SamplingParams.create(log_rho=-3.0), context)
    noisy, st = _sample(keys, logits, noise, context)
    assert (np.asarray(clean) != np.asarray(noisy)).any()
    # Without a context there is no noise, whatever noise_std says.
    np.testing.assert_array_equal(_sample(keys, logits, noise)[0], clean)
    # Pruned log-probs renormalise over V_S: log mu_S >= log mu, equal iff nothing is pruned.
    # Exact in float32: both are (z_y - max z) - log(s) with s = sum_safe <= sum_safe + sum_out,
    # and rounding is monotone.
    assert (np.asarray(st.logp) >= np.asarray(st.logp_full)).all()
    assert np.isfinite(np.asarray(st.logp)).all()


def test_noise_is_a_fixed_function_of_the_context():
    """Rows with the same context and logits see the same noisy distribution whatever their key
    (so every recorded log mu of that context agrees); other contexts see other noise."""
    logits = jnp.tile(jnp.asarray(np.linspace(-2.0, 2.0, 32), jnp.float32), (512, 1))
    params = sampling.SamplingParams.create(noise_std=2.0)
    same = jnp.full((512,), 12345, jnp.uint32)
    tokens, st = _sample(_keys(7, 512), logits, params, same)
    tokens, logp = np.asarray(tokens), np.asarray(st.logp_full)
    for y in np.unique(tokens):
        assert np.ptp(logp[tokens == y]) == 0.0  # one distribution, every key
    _, other = _sample(_keys(7, 512), logits, params, jnp.arange(512, dtype=jnp.uint32))
    assert np.unique(np.asarray(other.logp_full)).size > 100
    # The hash: extending context by context equals hashing the whole sequence.
    ids = jnp.asarray([[5, 9, 2, 7, 0, 0]], jnp.int32)
    whole = sampling.context_hash(ids, jnp.asarray([4]))
    step = sampling.context_hash(ids, jnp.asarray([3]))
    assert int(sampling.extend_context(step, ids[:, 3])[0]) == int(whole[0])
    assert int(whole[0]) != int(sampling.context_hash(ids[:, ::-1], jnp.asarray([4]))[0])


@pytest.mark.parametrize("log_rho, tau, n_safe", [(-4.0, 1.0, 5), (-math.inf, 1.5, 8)])
def test_chi_square_samples_follow_the_pruned_distribution(log_rho, tau, n_safe):
    """20,000 draws from one state vs mu_S; significance level alpha = 0.001 (fixed seed).

    (-4, 1): the safe set is z >= 2 - 4, the first five tokens; (-inf, 1.5): no pruning, with
    temperature, down to a tail token of probability 5e-4 (expected count 9)."""
    logits = np.asarray([2.0, 1.5, 1.0, 0.0, -0.5, -3.0, -5.0, -8.0], np.float32)
    n = 20_000
    params = sampling.SamplingParams.create(temperature=tau, log_rho=log_rho)
    batch = jnp.broadcast_to(jnp.asarray(logits), (n, logits.size))
    tokens, st = _sample(_keys(5, n), batch, params)
    counts = np.bincount(np.asarray(tokens), minlength=logits.size)
    z = logits.astype(np.float64) / tau
    safe = z >= z.max() + log_rho
    assert safe.sum() == n_safe and counts[~safe].sum() == 0  # pruned tokens are never drawn
    p = np.exp(z[safe])
    p /= p.sum()
    result = stats.chisquare(counts[safe], n * p)
    assert result.pvalue > 1e-3, (counts, n * p, result)
    np.testing.assert_array_equal(np.asarray(st.safe_size), n_safe)


@pytest.mark.parametrize(
    "temperature, log_rho, greedy",
    [(0.7, -2.0, False), (1.0, -13.0, False), (1.3, -math.inf, False), (0.3, -1.0, True)],
)
def test_sampler_stats_are_pruning_token_logprobs(temperature, log_rho, greedy):
    """One implementation of E1-E3: the sampler's record of its tokens equals
    `pruning.pruned_token_logprobs` (the trainer's reference path) on the same logits.

    Exact: both run `pruning.safe_set_sums` / `pruning.token_logprobs` on the same float32
    z = logits / tau (greedy: tau = 1), so any second implementation would show up as rounding
    differences. Observed: bit-identical."""
    logits = jnp.asarray(5.0 * np.random.default_rng(6).standard_normal((32, 40)), jnp.float32)
    params = sampling.SamplingParams.create(temperature, log_rho, greedy=greedy)
    tokens, st = _sample(_keys(6, 32), logits, params)
    assert isinstance(st, pruning.TokenLogprobs)
    tau = 1.0 if greedy else temperature
    expect = jax.jit(pruning.pruned_token_logprobs, static_argnums=(2, 3))(
        logits, tokens, log_rho, tau
    )
    for field in pruning.TokenLogprobs._fields:
        np.testing.assert_array_equal(getattr(st, field), getattr(expect, field), err_msg=field)
    if log_rho > -math.inf:
        assert (np.asarray(st.safe_size) < 40).all()  # the case prunes


def test_sampler_calls_the_pruning_core(monkeypatch):
    """The sampler's E1-E3 numbers come from `pruning`: a change there reaches the sampler."""
    core = pruning.safe_set_sums

    def doubled_outside(z, log_rho):
        sums = core(z, log_rho)
        return sums._replace(sum_out=2.0 * sums.sum_out)

    logits = jnp.asarray(3.0 * np.random.default_rng(7).standard_normal((8, 16)), jnp.float32)
    params = sampling.SamplingParams.create(log_rho=-2.0)
    keys = _keys(7, 8)
    # A fresh jit per call (distinct lambdas), so the second one traces the patched core.
    _, base = jax.jit(lambda *a: sampling.sample(*a))(keys, logits, params)
    monkeypatch.setattr(pruning, "safe_set_sums", doubled_outside)
    _, changed = jax.jit(lambda *a: sampling.sample(*a))(keys, logits, params)
    mass = np.asarray(base.pruned_mass)
    assert (mass > 0).all()
    # delta' = 2 O / (S + 2 O) = 2 delta / (1 + delta); float32 rounding of a ratio of sums.
    np.testing.assert_allclose(changed.pruned_mass, 2 * mass / (1 + mass), rtol=1e-6)


@pytest.mark.parametrize("kwargs", [dict(temperature=0.0), dict(log_rho=0.5), dict(noise_std=-1.0)])
def test_sampling_params_reject_bad_values(kwargs):
    with pytest.raises(ValueError, match="SamplingParams"):
        sampling.SamplingParams.create(**kwargs)
