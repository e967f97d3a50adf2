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


def _batch(rows=8, seed=0):
    return step_lib.synthetic_batch(64, rows, 10, 4, seed)


def _step(micro_batches=1, optimizer=None):
    optimizer = optimizer or make_optimizer(1e-2, 0, 0.0, 1.0)
    graphdef, state, _ = init_train_state(tiny_model(seed=1), optimizer, 0, Sharder())
    fn = jax.jit(
        lambda s, b: step_lib.rl_step(
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
