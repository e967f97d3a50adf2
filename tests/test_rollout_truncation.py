"""Top-k / top-p truncation kept on the trainer (E13): the sampler against float64 NumPy
(`reference.truncation_set`, `reference.truncated_token_logprob`), the hand-worked case of
docs/design.md, the chunked trainer pass against the in-memory path, and an fp32 engine's
behaviour log-probs against the trainer's on every sampled token.

Tolerances: float32 statistics of |z| <= ~20 against float64 are a few ulps (1e-6 absolute on
log-probs, 2e-6 relative on masses, as tests/test_rollout_sampling.py); the chunked pass against
the in-memory one sums in another order (observed 7e-7 on values, 7e-6 on gradients of O(1));
fp32 decode against the fp32 full forward differs in op order through the whole model (observed
4.3e-6 in tests/test_rollout_engine.py; bound 1e-5).
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dvp_jax.dvp import chunked, pruning
from dvp_jax.model import TRAIN_POLICY, ModelConfig, Transformer
from dvp_jax.rollout import sampling
from dvp_jax.rollout.engine import EngineConfig, RolloutEngine
from dvp_jax.rollout.offline import generate_rollouts
from dvp_jax.train import packing, step
from dvp_jax.train.sections import RolloutConfig
from tests import reference

_sample = jax.jit(sampling.sample, static_argnames="kept_width")


def _keys(seed, n):
    return jax.random.split(jax.random.key(seed), n)


@pytest.mark.parametrize(
    "top_k, top_p, log_rho, tau",
    [(5, 1.0, -math.inf, 1.0), (0, 0.8, -3.0, 0.7), (6, 0.9, -2.0, 1.3), (0, 0.999, -13.0, 1.0)],
)
def test_sampler_records_the_truncated_distribution_it_samples_from(top_k, top_p, log_rho, tau):
    """Kept ids = NumPy's top-k / top-p set; behaviour log-probs, delta, |V_T| and the truncated
    mass = float64 E13 on that set; every sampled token lies in V_T."""
    rng = np.random.default_rng(3)
    n, v, width = 48, 40, 12
    logits = jnp.asarray(3.0 * rng.standard_normal((n, v)), jnp.float32)
    params = sampling.SamplingParams.create(
        temperature=tau, log_rho=log_rho, top_k=top_k, top_p=top_p
    )
    tokens, st, trunc = _sample(_keys(0, n), logits, params, kept_width=width)
    tokens, kept_ids = np.asarray(tokens), np.asarray(trunc.kept_ids)
    for i in range(n):
        kept = reference.truncation_set(np.asarray(logits[i]), top_k, top_p, width, tau)
        assert kept_ids[i][kept_ids[i] >= 0].tolist() == kept
        ref = reference.truncated_token_logprob(
            np.asarray(logits[i]), int(tokens[i]), kept, log_rho, tau
        )
        assert ref["in_safe"] and bool(st.in_safe[i])
        np.testing.assert_allclose(st.logp[i], ref["logp"], rtol=0, atol=1e-6)
        np.testing.assert_allclose(st.pruned_mass[i], ref["pruned_mass"], rtol=2e-6, atol=1e-12)
        np.testing.assert_allclose(
            trunc.truncated_mass[i], ref["truncated_mass"], rtol=2e-6, atol=1e-12
        )
        assert int(st.safe_size[i]) == ref["safe_size"]
    assert (np.asarray(trunc.truncated_mass) > 0).all()


def test_truncation_off_keeps_everything_and_changes_nothing():
    """top_k = 0, top_p = 1 in a truncating engine: kept ids all -1 and the same draw and
    statistics as the sampler compiled without truncation (bit for bit)."""
    logits = jnp.asarray(3.0 * np.random.default_rng(4).standard_normal((16, 30)), jnp.float32)
    params = sampling.SamplingParams.create(log_rho=-2.0)
    keys = _keys(1, 16)
    t0, s0, tr0 = _sample(keys, logits, params, kept_width=0)
    t1, s1, tr1 = _sample(keys, logits, params, kept_width=8)
    assert tr0.kept_ids.shape == (16, 0) and (np.asarray(tr1.kept_ids) == -1).all()
    np.testing.assert_array_equal(t0, t1)
    for a, b in zip(s0, s1, strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(tr1.truncated_mass, 0.0)


def test_chi_square_samples_follow_the_truncated_distribution():
    from scipy import stats

    logits = jnp.log(jnp.asarray([[0.4, 0.25, 0.15, 0.1, 0.06, 0.04]], jnp.float32))
    n = 20000
    params = sampling.SamplingParams.create(top_p=0.75, log_rho=-math.inf)
    tokens, _, trunc = _sample(_keys(2, n), jnp.repeat(logits, n, 0), params, kept_width=4)
    assert np.asarray(trunc.kept_ids[0]).tolist() == [0, 1, 2, -1]
    counts = np.bincount(np.asarray(tokens), minlength=6)
    assert counts[3:].sum() == 0
    expected = n * np.array([0.4, 0.25, 0.15]) / 0.8
    assert stats.chisquare(counts[:3], expected).pvalue > 1e-3


def test_hand_worked_case():
    """docs/design.md E13: rollout (0.5, 0.3, 0.15, 0.05) at p = 0.7 keeps K = {0, 1}, mu_T(1) =
    0.375; trainer (0.3, 0.25, 0.4, 0.05) on the carried K: pi_T(1) = 0.25 / 0.55; with log rho =
    log 0.9 the trainer's V_T = {0} and token 1 is outside."""
    rollout = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]], jnp.float32))
    params = sampling.SamplingParams.create(top_p=0.7, log_rho=-13.0)
    y = jnp.asarray([1])
    kept = sampling.truncation(rollout, params, kept_width=4)
    assert kept.tolist() == [[0, 1, -1, -1]]
    mu = pruning.pruned_token_logprobs(rollout, y, -13.0, kept_ids=kept)
    np.testing.assert_allclose(mu.logp, [math.log(0.375)], rtol=0, atol=1e-6)
    trainer = jnp.log(jnp.asarray([[0.3, 0.25, 0.4, 0.05]], jnp.float32))
    own = sampling.truncation(trainer, params, kept_width=4)
    assert own.tolist() == [[2, 0, -1, -1]]  # a replay on the trainer's logits is another set
    pi = pruning.pruned_token_logprobs(trainer, y, -13.0, kept_ids=kept)
    np.testing.assert_allclose(pi.logp, [math.log(0.25 / 0.55)], rtol=0, atol=1e-6)
    assert int(pi.safe_size[0]) == 2
    tight = pruning.pruned_token_logprobs(trainer, y, math.log(0.9), kept_ids=kept)
    assert not bool(tight.in_safe[0]) and int(tight.safe_size[0]) == 1


@pytest.mark.parametrize("log_rho", [-1.5, None])
def test_chunked_pass_with_kept_sets_equals_float64_and_in_memory_gradients(log_rho):
    """The trainer's chunked E13 (several chunks, a shifted last chunk) against float64 E13, and
    its custom VJP against autodiff of the in-memory path (`pruning.pruned_token_logprobs`)."""
    rng = np.random.default_rng(5)
    n, d, v, width = 7, 8, 50, 5
    h = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((d, v)), jnp.float32)
    kept = np.full((n, width), -1, np.int32)
    for i in range(n - 1):  # the last row is untruncated
        kept[i, : 2 + i % 4] = rng.choice(v, 2 + i % 4, replace=False)
    y = np.where(kept[:, 0] >= 0, kept[:, 0], 3)
    kept, y = jnp.asarray(kept), jnp.asarray(y)

    def chunk(h, w):
        return chunked.chunked_pruned_logprobs(
            h, w, y, log_rho=log_rho, temperature=0.7, chunk_size=16, kept_ids=kept
        )

    def memory(h, w):
        z = jnp.einsum("nd,dv->nv", h, w)
        return pruning.pruned_token_logprobs(z, y, log_rho, 0.7, kept_ids=kept)

    got = chunk(h, w)
    z = np.asarray(jnp.einsum("nd,dv->nv", h, w), np.float64)
    lr = -math.inf if log_rho is None else log_rho
    for i in range(n):
        k = [int(a) for a in np.asarray(kept[i]) if a >= 0] or list(range(v))
        ref = reference.truncated_token_logprob(z[i], int(y[i]), k, lr, 0.7)
        assert bool(got.in_safe[i]) == ref["in_safe"]
        assert int(got.safe_size[i]) == ref["safe_size"]
        if ref["in_safe"]:
            np.testing.assert_allclose(got.logp[i], ref["logp"], rtol=0, atol=1e-5)
        np.testing.assert_allclose(got.pruned_mass[i], ref["pruned_mass"], rtol=1e-5, atol=1e-7)

    def objective(fn):
        def f(h, w):
            out = fn(h, w)
            logp = jnp.where(out.in_safe, out.logp, 0.0)
            return (
                jnp.sum(logp * jnp.arange(n))
                + jnp.sum(out.logp_full)
                + 3 * jnp.sum(out.pruned_mass)
            )

        return f

    g_chunk = jax.grad(objective(chunk), (0, 1))(h, w)
    g_memory = jax.grad(objective(memory), (0, 1))(h, w)
    for a, b in zip(g_chunk, g_memory, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-5)


def test_untruncated_chunked_program_is_unchanged_by_a_zero_width_kept_set():
    """kept_ids of width 0 (no truncation) compile to the same program as no kept_ids at all
    (the lowered text differs by the zero-size operand only)."""
    h = jnp.ones((4, 8), jnp.float32)
    w = jnp.ones((8, 20), jnp.float32)
    y = jnp.zeros((4,), jnp.int32)

    def compiled(kept):
        fn = lambda h, w: (
            chunked.chunked_pruned_logprobs(h, w, y, log_rho=-2.0, chunk_size=8, kept_ids=kept).logp
        )
        text = jax.jit(fn).lower(h, w).compile().as_text()
        # The instructions, without their source-line metadata.
        lines = [re.sub(r", metadata=\{[^}]*\}", "", x) for x in text.splitlines() if " = " in x]
        return [x for x in lines if "file_name_id" not in x]

    assert compiled(None) == compiled(jnp.zeros((4, 0), jnp.int32))


# ----------------------------------------------------------------------------------------------
# The engine: an fp32 rollout with top-p and top-k, and the trainer's log-probs of its tokens.
# ----------------------------------------------------------------------------------------------

CFG = ModelConfig.preset("tiny", init_std=0.5)
PROMPTS = [[1, 4, 14, 5, 18], [1, 6, 16, 7, 18, 9, 9], [1, 3]]


@pytest.fixture(scope="module")
def master():
    return Transformer(CFG, TRAIN_POLICY, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def engine(master):
    config = EngineConfig(
        dtype="float32",
        max_concurrent_decodes=4,
        max_prefill_length=8,
        prefill_buckets=(),
        max_decode_length=8,
        log_rho=-3.0,
        top_p=0.8,
        max_kept=8,
    )
    return RolloutEngine(CFG, config, params=nnx.state(master))


@pytest.mark.parametrize("top_k, top_p", [(0, 0.8), (3, 0.9)])
def test_fp32_trainer_logprobs_equal_the_engine_behaviour_on_every_sampled_token(
    engine, master, top_k, top_p
):
    """fp32 on both sides: the packed update's trainer log pi_T (chunked, on the carried kept
    sets) equals the engine's log mu_T on every response token, every token is inside the
    trainer's V_T, and the kept sets are NumPy's top-k / top-p of the teacher-forced logits.
    Changing top_k / top_p does not recompile the engine's programs."""
    params = engine.config.sampling_params(top_k=top_k, top_p=top_p)
    b = generate_rollouts(engine, PROMPTS, 3, jax.random.key(7), sampling=params)
    assert b.behaviour_kept_ids.shape[-1] == 8
    mask = b.response_mask
    sizes = (b.behaviour_kept_ids >= 0).sum(-1)[mask]
    assert sizes.min() >= 1 and (sizes < CFG.vocab_size).all()
    assert (b.behaviour_truncated_mass[mask] > 0).any()
    layout = packing.make_layout(
        sequences=b.num_rows, longest=16, row_length=32, micro_batches=1, packed=True
    )
    rl = packing.pack(b, np.zeros(b.num_rows, np.float32), layout)
    graphdef, state = nnx.split(master)
    tl = jax.jit(
        lambda p, tok, pos, seg, kept: step.token_logprobs(
            p,
            graphdef,
            tok,
            pos,
            seg,
            log_rho=-3.0,
            temperature=1.0,
            chunk_size=32,
            kept_ids=kept,
        )
    )(state, rl.tokens, rl.positions, rl.segment_ids, rl.behaviour_kept_ids)
    resp = rl.response_mask
    assert np.asarray(tl.in_safe)[resp].all()
    diff = np.abs(np.asarray(tl.logp)[resp] - rl.behaviour_logp[resp])
    assert diff.max() < 1e-5, diff.max()
    np.testing.assert_allclose(
        np.asarray(tl.pruned_mass)[resp], rl.behaviour_pruned_mass[resp], rtol=1e-4, atol=1e-6
    )
    # The recorded kept sets are top-k / top-p of the trainer's own fp32 logits here (the
    # boundary is never within float32 round-off of these logits).
    model = nnx.merge(graphdef, state)
    logits = np.asarray(
        model(jnp.asarray(rl.tokens), jnp.asarray(rl.positions), jnp.asarray(rl.segment_ids))
    )[:, :-1]
    for r, t in zip(*np.nonzero(resp), strict=True):
        kept = rl.behaviour_kept_ids[r, t]
        want = reference.truncation_set(logits[r, t], top_k, top_p, 8)
        assert kept[kept >= 0].tolist() == want


def test_sampling_without_a_truncating_engine_is_refused(master):
    plain = RolloutEngine(
        CFG,
        EngineConfig(
            dtype="float32", max_concurrent_decodes=2, max_prefill_length=8, max_decode_length=2
        ),
        params=nnx.state(master),
    )
    with pytest.raises(ValueError, match="top_k / top_p"):
        plain.init_decode_state(sampling=plain.config.sampling_params(top_p=0.9))


def test_a_top_k_above_the_kept_width_is_refused(engine):
    with pytest.raises(ValueError, match=r"sampling.top_k must be <= EngineConfig.max_kept \(8\)"):
        engine.init_decode_state(sampling=engine.config.sampling_params(top_k=9))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(top_k=-1), "config.rollout.top_k must be an int >= 0"),
        (dict(top_k=1.5), "config.rollout.top_k must be an int >= 0"),
        (dict(top_p=0.0), r"config.rollout.top_p must be a number in \(0, 1\]"),
        (dict(top_p=1.5), r"config.rollout.top_p must be a number in \(0, 1\]"),
        (dict(max_kept=0), "config.rollout.max_kept must be an int >= 1"),
        (dict(top_k=65, max_kept=64), r"config.rollout.top_k must be <= config.rollout.max_kept"),
    ],
)
def test_bad_truncation_settings_name_their_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RolloutConfig(**kwargs)


def test_truncation_width_is_zero_when_off():
    assert EngineConfig().kept_width == 0
    assert EngineConfig(top_p=0.95).kept_width == 64
    assert EngineConfig(top_k=4, max_kept=16).kept_width == 16


def test_the_update_and_the_old_policy_forward_train_on_the_carried_kept_sets(engine):
    """The jitted update (decoupled PPO, so the old-policy forward runs too) on a truncated
    packed batch: the forward's log pi_T_old equals `step.token_logprobs` with the kept sets,
    the first PPO ratio is 1, and the truncation metrics are logged."""
    import optax

    from dvp_jax.dvp.losses import LossConfig
    from dvp_jax.metrics import METRICS
    from dvp_jax.sharding import Sharder
    from dvp_jax.train.batch import with_logprobs
    from dvp_jax.train.state import init_train_state

    b = generate_rollouts(engine, PROMPTS, 2, jax.random.key(9))
    layout = packing.make_layout(
        sequences=b.num_rows, longest=16, row_length=32, micro_batches=2, packed=True
    )
    advantages = np.where(np.arange(b.num_rows) % 2, 1.0, -1.0).astype(np.float32)
    rl = packing.pack(b, advantages, layout)
    assert rl.behaviour_kept_ids.shape == (layout.rows, 31, 8)
    sgd = optax.apply_if_finite(optax.sgd(0.1), 10)  # as the trainer wraps its optimizer
    model = Transformer(CFG, TRAIN_POLICY, rngs=nnx.Rngs(0))
    graphdef, state, _ = init_train_state(model, sgd, 0, Sharder())
    loss_cfg = LossConfig.preset("dvp", log_rho=-3.0, ppo_clip_eps=0.2)
    common = dict(graphdef=graphdef, chunk_size=32, micro_batches=2, sequences_per_row=16)
    old = step.batch_logprobs(
        state.params,
        step.logprob_inputs(rl),
        log_rho=-3.0,
        temperature=1.0,
        **common,
    )
    direct = step.token_logprobs(
        state.params,
        graphdef,
        rl.tokens,
        rl.positions,
        rl.segment_ids,
        log_rho=-3.0,
        temperature=1.0,
        chunk_size=32,
        kept_ids=rl.behaviour_kept_ids,
    )
    resp = rl.response_mask
    # The same math on micro-batches of other shapes: float32 op order (observed 2.6e-6).
    np.testing.assert_allclose(np.asarray(old.logp)[resp], np.asarray(direct.logp)[resp], atol=1e-5)
    np.testing.assert_allclose(np.asarray(old.logp)[resp], rl.behaviour_logp[resp], atol=1e-5)
    rl = with_logprobs(rl, "old", old)
    _, metrics = jax.jit(
        lambda s, batch: step.rl_update(s, batch, optimizer=sgd, loss_cfg=loss_cfg, **common)
    )(state, rl)
    keys = ("truncated_mass_rollout_mean", "frac_positions_truncated", "kept_size_rollout_mean")
    for key in keys:
        assert key in METRICS and np.isfinite(float(metrics[key]))
    assert float(metrics["ppo_clip_frac"]) == 0.0
    assert 0 < float(metrics["truncated_mass_rollout_mean"]) < 0.2 + 1e-6


@pytest.mark.parametrize("shape, kind", [((1, 2, 4), "auto"), ((2, 1, 4), "explicit")])
def test_kept_sets_on_the_vocabulary_parallel_mesh_equal_one_device(shape, kind):
    """E13 on a (data, fsdp, tensor) mesh, W split over tensor on V (each shard marks its own
    columns of K, the max over K is a pmax): values, dh and dW equal one device's (tolerances
    of tests/test_dvp_pruning.py's vocabulary-parallel test: psum order)."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    rng = np.random.default_rng(8)
    n, d, v, width = 32, 8, 200, 6
    h = jnp.asarray(1.5 * rng.standard_normal((n, d)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((d, v)), jnp.float32)
    kept = np.full((n, width), -1, np.int32)
    for i in range(n - 4):  # the last 4 rows untruncated
        kept[i, : 1 + i % width] = rng.choice(v, 1 + i % width, replace=False)
    y = np.where(kept[:, 0] >= 0, kept[:, 0], 5).astype(np.int32)
    axis = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}[kind]
    mesh = jax.make_mesh(shape, ("data", "fsdp", "tensor"), axis_types=(axis,) * 3)

    def value_and_grad(y, kept, mesh=None):
        def fn(h, w):
            out = chunked.chunked_pruned_logprobs(
                h, w, y, log_rho=-2.0, temperature=0.7, chunk_size=16, mesh=mesh, kept_ids=kept
            )
            logp = jnp.where(out.in_safe, out.logp, 0.0)
            return jnp.sum(logp * jnp.linspace(-1, 1, n)) + 2 * jnp.sum(out.pruned_mass), out

        return jax.jit(jax.value_and_grad(fn, argnums=(0, 1), has_aux=True))

    (_, expect), expect_grads = value_and_grad(jnp.asarray(y), jnp.asarray(kept))(h, w)
    rows = P(("data", "fsdp"))
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
    hs, ws = put(h, P(*rows, None)), put(w, P("fsdp", "tensor"))
    ys, ks = put(y, rows), put(kept, P(*rows, None))
    (_, got), grads = value_and_grad(ys, ks, mesh if axis == AxisType.Auto else None)(hs, ws)
    for a, b in zip(got, expect, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, expect_grads, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())
