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
_sample = jax.jit(lambda *a: sampling.sample(*a)[:2])  # (tokens, TokenLogprobs)


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


def test_first_argmax_is_the_first_index_of_the_row_max():
    """`first_argmax` (max, then the smallest index attaining it) equals NumPy's argmax, ties
    included: rows of small integers have many tied maxima, and the first one wins."""
    rng = np.random.default_rng(11)
    x = rng.integers(0, 4, size=(64, 37)).astype(np.float32)
    x[5] = 2.0  # a row that is all one tie
    got = jax.jit(sampling.first_argmax)(jnp.asarray(x))
    np.testing.assert_array_equal(got, np.argmax(x, -1))
    assert got.dtype == jnp.int32
    given_max = sampling.first_argmax(jnp.asarray(x), jnp.asarray(x.max(-1, keepdims=True)))
    np.testing.assert_array_equal(given_max, np.argmax(x, -1))


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


def test_the_two_level_draw_follows_the_weights_across_vocabulary_chunks():
    """`inverse_cdf_draw` over 3 chunks (V = 2,500 = 2 x 1,024 + a padded third): mass in every
    chunk, zero weights between; 20,000 draws against w / sum(w) (chi-square, alpha = 0.001);
    no zero-weight entry is ever drawn, also with uniforms at the top of [0, 1)."""
    v = 2500
    w = np.zeros(v, np.float32)
    support = [0, 3, 1023, 1024, 1500, 2047, 2048, 2499]
    w[support] = [1.0, 0.5, 0.25, 2.0, 0.1, 0.7, 1.2, 0.05]
    n = 20_000
    u = jax.random.uniform(jax.random.key(3), (n, 2))
    # Rows n, n + 1: uniforms at the top of [0, 1); row n + 2: zeros (one compiled draw).
    top = jnp.full((2, 2), np.nextafter(np.float32(1), np.float32(0)))
    u = jnp.concatenate([u, top, jnp.zeros((1, 2))])
    drawn = np.asarray(jax.jit(sampling.inverse_cdf_draw)(jnp.broadcast_to(w, (n + 3, v)), u))
    tokens, edge, zero = drawn[:n], drawn[n : n + 2], drawn[n + 2 :]
    counts = np.bincount(tokens, minlength=v)
    assert counts[w == 0].sum() == 0
    p = w[support].astype(np.float64) / w[support].astype(np.float64).sum()
    assert stats.chisquare(counts[support], n * p).pvalue > 1e-3
    assert list(edge) == [2499, 2499]  # the last positive entry
    assert int(zero[0]) == 0


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

    def doubled_outside(z, log_rho, kept=None):
        sums = core(z, log_rho, kept)
        return sums._replace(sum_out=2.0 * sums.sum_out)

    logits = jnp.asarray(3.0 * np.random.default_rng(7).standard_normal((8, 16)), jnp.float32)
    params = sampling.SamplingParams.create(log_rho=-2.0)
    keys = _keys(7, 8)
    # A fresh jit per call (distinct lambdas), so the second one traces the patched core.
    _, base = jax.jit(lambda *a: sampling.sample(*a)[:2])(keys, logits, params)
    monkeypatch.setattr(pruning, "safe_set_sums", doubled_outside)
    _, changed = jax.jit(lambda *a: sampling.sample(*a)[:2])(keys, logits, params)
    mass = np.asarray(base.pruned_mass)
    assert (mass > 0).all()
    # delta' = 2 O / (S + 2 O) = 2 delta / (1 + delta); float32 rounding of a ratio of sums.
    np.testing.assert_allclose(changed.pruned_mass, 2 * mass / (1 + mass), rtol=1e-6)


def _tail_case(n_rows=512, tail_gap=13.0, noise_std=3.0, temperature=1.3, log_rho=-13.0):
    """Rows of one logit vector spanning 0 .. -26 over 48 tokens (tempered gaps 0 .. 20), one
    shared context, and the tail-shaped noise's parameters."""
    logits = jnp.tile(jnp.asarray(np.linspace(0.0, -26.0, 48), jnp.float32), (n_rows, 1))
    params = sampling.SamplingParams.create(
        temperature=temperature, log_rho=log_rho, noise_std=noise_std, noise_tail_gap=tail_gap
    )
    context = jnp.full((n_rows,), 4242, jnp.uint32)
    return logits, params, context


def test_tail_noise_off_by_default_is_bit_identical():
    """noise_tail_gap = 0 (the default) is today's uniform noise, bit for bit: the same tokens
    and records as a `SamplingParams` without the field (the code path before it existed),
    which are `pruning.pruned_token_logprobs` of logits + sigma n (to float32 rounding: XLA may
    fuse the add differently in another program; |z| <= ~20 where ulp(16) = 1.9e-6, observed
    1.2e-6, so 5e-6). With the noise off
    too (every default) the records are those of the clean logits, exactly."""
    logits = jnp.asarray(3.0 * np.random.default_rng(8).standard_normal((64, 40)), jnp.float32)
    keys, context = _keys(8, 64), jnp.arange(64, dtype=jnp.uint32)
    default = sampling.SamplingParams.create(temperature=0.8, log_rho=-4.0, noise_std=1.5)
    assert float(default.noise_tail_gap) == 0.0
    legacy = sampling.SamplingParams(
        default.temperature, default.log_rho, default.noise_std, default.greedy
    )
    tokens, st = _sample(keys, logits, default, context)
    old_tokens, old = _sample(keys, logits, legacy, context)
    np.testing.assert_array_equal(tokens, old_tokens)
    noise = jax.vmap(
        lambda c: jax.random.normal(
            jax.random.fold_in(jax.random.key(sampling.NOISE_SEED), c), (40,), jnp.float32
        )
    )(context)
    prune = jax.jit(pruning.pruned_token_logprobs, static_argnums=(2, 3))
    expect = prune(logits + 1.5 * noise, tokens, -4.0, 0.8)
    for field in pruning.TokenLogprobs._fields:
        np.testing.assert_array_equal(getattr(st, field), getattr(old, field), err_msg=field)
        np.testing.assert_allclose(
            getattr(st, field), getattr(expect, field), rtol=0, atol=5e-6, err_msg=field
        )
    quiet = sampling.SamplingParams.create(temperature=0.8, log_rho=-4.0)
    q_tokens, q = _sample(keys, logits, quiet, context)
    q_expect = prune(logits, q_tokens, -4.0, 0.8)
    for field in pruning.TokenLogprobs._fields:
        np.testing.assert_array_equal(getattr(q, field), getattr(q_expect, field), err_msg=field)


def test_tail_noise_leaves_the_head_and_perturbs_the_tail():
    """Tokens within G/2 of the top keep their logits bit for bit; from gap G on each gets the
    full sigma n(c); between, a linear ramp. The argmax token's log mu then moves only through
    the renormalisation over the perturbed tail."""
    base = jax.random.key(sampling.NOISE_SEED)
    scaled = jax.jit(sampling.scaled_logits)
    # tau = 1: the head's z is its logit bit for bit (the added term is exactly 0).
    logits, params, context = _tail_case(n_rows=2, temperature=1.0)
    keys = jax.vmap(lambda c: jax.random.fold_in(base, c))(context)
    z = np.asarray(scaled(logits, params, keys))
    x = np.asarray(logits)
    head = x.max(-1, keepdims=True) - x < 6.5
    assert head[0].sum() >= 10 and not head.all()
    np.testing.assert_array_equal(z[head], x[head])
    assert (z[~head] != x[~head]).all()
    # tau = 1.3: the gap is read on the tempered logits.
    logits, params, context = _tail_case(n_rows=2)
    z = np.asarray(scaled(logits, params, keys))
    clean = np.asarray(logits, np.float64) / 1.3
    n = np.asarray(jax.vmap(lambda k: jax.random.normal(k, (48,), jnp.float32))(keys))
    gap = clean.max(-1, keepdims=True) - clean
    head, tail = gap < 6.5, gap >= 13.0
    assert head[0].sum() >= 10 and tail[0].sum() >= 10
    # The head's z is logits / tau up to the rounding of that division (1e-6 at |z| <= 5).
    np.testing.assert_allclose(z[head], clean[head], rtol=0, atol=1e-6)
    # Full strength beyond G: z = (logits + sigma n) / tau; float32 rounding of that expression
    # (|z| <= ~30, ulp 1.9e-6), so 1e-5.
    full = (np.asarray(logits, np.float64) + 3.0 * n) / 1.3
    np.testing.assert_allclose(z[tail], full[tail], rtol=0, atol=1e-5)
    ramp = np.clip((gap - 6.5) / 6.5, 0, 1)
    mid = ~head & ~tail
    np.testing.assert_allclose(
        z[mid], ((np.asarray(logits, np.float64) + 3.0 * ramp * n) / 1.3)[mid], atol=1e-5
    )
    # The argmax token's log mu moves only by the renormalisation over the perturbed tail.
    # (The default 512 rows: the noisy draw is the program the next test compiles.)
    logits, params, context = _tail_case()
    greedy = params.replace(greedy=jnp.asarray(True))
    _, st = _sample(_keys(9, 512), logits, greedy, context)
    _, st_clean = _sample(_keys(9, 512), logits, greedy.replace(noise_std=jnp.asarray(0.0)))
    assert abs(float(st.logp_full[0] - st_clean.logp_full[0])) < 0.05


def test_tail_noise_is_fixed_per_context_and_recorded_exactly():
    """Every sample of one context draws from one distribution (its tokens' log mu agree for
    every key), and the recorded log mu_S / log mu are those of the perturbed, tempered,
    pruned logits (float64 reference of z = (logits + sigma s n) / tau; tolerance as in the
    reference test above, 1e-5 for |z| <= ~30)."""
    logits, params, context = _tail_case()
    tokens, st = _sample(_keys(10, 512), logits, params, context)
    tokens = np.asarray(tokens)
    for y in np.unique(tokens):
        assert np.ptp(np.asarray(st.logp_full)[tokens == y]) == 0.0
    base = jax.random.key(sampling.NOISE_SEED)
    n = np.asarray(jax.random.normal(jax.random.fold_in(base, 4242), (48,), jnp.float32), float)
    x = np.asarray(logits[0], np.float64)
    ramp = np.clip(((x.max() - x) / 1.3 - 6.5) / 6.5, 0, 1)
    z = np.tile(x + 3.0 * ramp * n, (512, 1))
    logp, logp_full, mass, size, _ = _np_reference(z, tokens, 1.3, -13.0)
    np.testing.assert_allclose(st.logp, logp, rtol=0, atol=1e-5)
    np.testing.assert_allclose(st.logp_full, logp_full, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(st.safe_size, size)
    # Another context is another fixed perturbation of the tail.
    _, other = _sample(_keys(10, 512), logits, params, context + 1)
    assert not np.array_equal(np.asarray(other.safe_size), np.asarray(st.safe_size)) or (
        np.asarray(other.pruned_mass)[0] != np.asarray(st.pruned_mass)[0]
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=0.0),
        dict(log_rho=0.5),
        dict(noise_std=-1.0),
        dict(noise_tail_gap=-1.0),
        dict(noise_tail_gap=math.inf),
    ],
)
def test_sampling_params_reject_bad_values(kwargs):
    with pytest.raises(ValueError, match="SamplingParams"):
        sampling.SamplingParams.create(**kwargs)
