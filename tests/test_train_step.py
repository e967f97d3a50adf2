"""The jitted train step: non-finite updates are skipped and counted; accumulation is exact."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dvp_jax.dvp.losses import LossConfig
from dvp_jax.sharding import Sharder
from dvp_jax.train import step as step_lib
from dvp_jax.train.state import init_train_state, make_optimizer
from tests.helpers import tiny_model
from tests.train_utils import synthetic_batch


def _batch(rows=8, seed=0):
    return synthetic_batch(64, rows, 10, 4, seed)


def _step(micro_batches=1, optimizer=None):
    optimizer = optimizer or make_optimizer(1e-2, 0, 0.0, 1.0)
    graphdef, state, _ = init_train_state(tiny_model(seed=1), optimizer, 0, Sharder())
    fn = jax.jit(
        lambda s, b: step_lib.rl_update(
            s,
            b,
            graphdef=graphdef,
            optimizer=optimizer,
            loss_cfg=LossConfig.preset("dvp", log_rho=-3.0),
            chunk_size=16,
            micro_batches=micro_batches,
        )
    )
    return state, fn


def test_non_finite_gradient_skips_the_update_and_counts_it():
    state, fn = _step()
    before = jax.tree.map(np.asarray, state.params)
    bad = _batch()
    bad.advantages[2] = np.nan  # a NaN advantage poisons the gradient
    state, metrics = fn(state, jax.tree.map(jnp.asarray, bad))
    assert float(metrics["skipped_updates"]) == 1.0
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state.params), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    # A finite batch afterwards updates normally and the counter keeps its total.
    state, metrics = fn(state, jax.tree.map(jnp.asarray, _batch(seed=1)))
    assert float(metrics["skipped_updates"]) == 1.0
    assert not np.array_equal(before["embed"], np.asarray(state.params["embed"]))


def test_gradient_accumulation_equals_one_big_batch():
    # Plain SGD with lr 1 so the parameter change is exactly minus the accumulated gradient.
    sgd = optax.apply_if_finite(optax.sgd(1.0), 10)
    batch = jax.tree.map(jnp.asarray, _batch(rows=8, seed=3))
    state1, fn1 = _step(micro_batches=1, optimizer=sgd)
    state4, fn4 = _step(micro_batches=4, optimizer=sgd)
    state1, m1 = fn1(state1, batch)
    state4, m4 = fn4(state4, batch)
    np.testing.assert_allclose(m1["loss"], m4["loss"], rtol=1e-6)
    np.testing.assert_allclose(m1["grad_norm"], m4["grad_norm"], rtol=1e-5)
    assert float(m1["grad_norm"]) > 0
    for a, b in zip(jax.tree.leaves(state1.params), jax.tree.leaves(state4.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_from_rollouts_aligns_behaviour_stats_with_targets():
    from dvp_jax.rollout.offline import RolloutBatch
    from dvp_jax.train.batch import from_rollouts

    # Two rows, T = 6: prompt of 2 and 3 tokens, responses of 3 and 2 tokens.
    tokens = np.array([[1, 5, 6, 7, 8, 0], [1, 4, 4, 9, 2, 0]], np.int32)
    prompt_len, resp_len = np.array([2, 3]), np.array([3, 2])
    pos = np.arange(6)[None, :]
    prompt_mask = pos < prompt_len[:, None]
    response_mask = ~prompt_mask & (pos < (prompt_len + resp_len)[:, None])
    stat = np.where(response_mask, -(pos + 10 * np.arange(2)[:, None]), 0).astype(np.float32)
    rollouts = RolloutBatch(
        tokens=tokens,
        prompt_mask=prompt_mask,
        response_mask=response_mask,
        behaviour_logp=stat,
        behaviour_logp_full=stat - 1,
        behaviour_pruned_mass=-stat / 100,
        behaviour_safe_size=(-stat).astype(np.int32),
        prompt_index=np.array([0, 0], np.int32),
        group_index=np.array([0, 1], np.int32),
        prompt_lengths=prompt_len.astype(np.int32),
        response_lengths=resp_len.astype(np.int32),
        finished=np.array([True, False]),
    )
    b = from_rollouts(rollouts, np.array([0.5, -0.5]))
    # Column t of the batch describes the target tokens[:, t + 1].
    np.testing.assert_array_equal(b.response_mask, response_mask[:, 1:])
    np.testing.assert_array_equal(b.behaviour_logp, stat[:, 1:])
    np.testing.assert_array_equal(b.behaviour_logp_full, stat[:, 1:] - 1)
    np.testing.assert_array_equal(b.behaviour_safe_size, -stat[:, 1:])
    assert b.response_mask[0].tolist() == [False, True, True, True, False]
    np.testing.assert_array_equal(b.valid, prompt_mask | response_mask)
    assert b.old_in_safe.all() and not b.old_logp.any()
