"""The jitted train step: non-finite updates are skipped and counted; accumulation is exact."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dvp_jax.dvp.losses import LossConfig
from dvp_jax.sharding import Sharder
from dvp_jax.train import step as step_lib
from dvp_jax.train.state import init_train_state, make_optimizer, skipped_updates
from tests.helpers import forward, tiny_model
from tests.train_utils import synthetic_batch


def _batch(rows=8, seed=0):
    return synthetic_batch(64, rows, 10, 4, seed)


# Plain SGD with lr 1, so the parameter change is exactly minus the accumulated gradient; wrapped
# like the trainer's optimizer, so a non-finite gradient is skipped and counted.
SGD = optax.apply_if_finite(optax.sgd(1.0), 10)


@functools.cache
def _step(micro_batches: int):
    """(initial state, jitted DVP update) with `micro_batches`: one compile per count, shared."""
    graphdef, state, _ = init_train_state(tiny_model(seed=1), SGD, 0, Sharder())
    fn = jax.jit(
        lambda s, b: step_lib.rl_update(
            s,
            b,
            graphdef=graphdef,
            optimizer=SGD,
            loss_cfg=LossConfig.preset("dvp", log_rho=-3.0),
            chunk_size=16,
            micro_batches=micro_batches,
        )
    )
    return state, fn


def test_non_finite_gradient_skips_the_update_and_counts_it():
    state, fn = _step(1)
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


def test_the_trainer_optimizer_skips_a_non_finite_update_and_counts_it():
    """`make_optimizer` (AdamW) is wrapped the same way: params and moments stay, a count grows."""
    opt = make_optimizer(1e-2, 0, 0.0, 1.0)
    params = {"w": jnp.ones((3,))}
    opt_state = opt.init(params)
    updates, bad_state = opt.update({"w": jnp.array([1.0, jnp.nan, 0.0])}, opt_state, params)
    np.testing.assert_array_equal(optax.apply_updates(params, updates)["w"], params["w"])
    assert int(skipped_updates(bad_state)) == 1
    for before, after in zip(
        jax.tree.leaves(opt_state.inner_state), jax.tree.leaves(bad_state.inner_state), strict=True
    ):
        np.testing.assert_array_equal(before, after)
    updates, good_state = opt.update({"w": jnp.ones((3,))}, bad_state, params)
    assert int(skipped_updates(good_state)) == 1 and np.all(np.asarray(updates["w"]) < 0)


def test_gradient_accumulation_equals_one_big_batch():
    batch = jax.tree.map(jnp.asarray, _batch(rows=8, seed=3))
    state1, fn1 = _step(1)
    state4, fn4 = _step(4)
    state1, m1 = fn1(state1, batch)
    state4, m4 = fn4(state4, batch)
    np.testing.assert_allclose(m1["loss"], m4["loss"], rtol=1e-6)
    np.testing.assert_allclose(m1["grad_norm"], m4["grad_norm"], rtol=1e-5)
    assert float(m1["grad_norm"]) > 0
    for a, b in zip(jax.tree.leaves(state1.params), jax.tree.leaves(state4.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_from_rollouts_aligns_behaviour_stats_with_targets():
    from dvp_jax.rollout.offline import RolloutBatch
    from dvp_jax.train.batch import abstract_batch, from_rollouts

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
    # The abstract batch the trainer jits its update for has these shapes and dtypes, but for
    # the advantages: the packer's are per target token (tests/test_packing.py).
    got = jax.tree.map(lambda x: (x.shape, np.dtype(x.dtype)), abstract_batch(2, 6))
    want = jax.tree.map(lambda x: (x.shape, x.dtype), b)
    assert got.advantages == ((2, 5), np.float32) and want.advantages == ((2,), np.float32)
    assert dataclasses.replace(got, advantages=None) == dataclasses.replace(want, advantages=None)


def _dense_tail_reference(model, batch, log_rho):
    """float64 NumPy tail metrics from the model's dense logits (docs/design.md, Diagnostics)."""
    logits = forward(model, jnp.asarray(batch.tokens), jnp.asarray(batch.positions), batch.valid)
    z = np.asarray(logits, np.float64)[:, :-1]  # predicts tokens[:, 1:]
    y = batch.tokens[:, 1:]
    log_p = z - z.max(-1, keepdims=True)
    log_p -= np.log(np.exp(log_p).sum(-1, keepdims=True))
    take = lambda a: np.take_along_axis(a, y[..., None], -1)[..., 0]
    lp, mask = take(log_p), batch.response_mask
    inside = take(z) >= z.max(-1) + log_rho
    l_t = np.where(mask, lp - batch.behaviour_logp_full, 0.0)
    out = np.where(mask & ~inside, l_t, 0.0).sum(-1)
    kept = ~np.any(mask & ~inside, axis=1)
    # Pruned log pi_S on kept responses: log p minus the log of the safe-set mass.
    safe_mass = np.where(z >= z.max(-1, keepdims=True) + log_rho, np.exp(log_p), 0.0).sum(-1)
    l_pruned = np.where(mask, lp - np.log(safe_mass) - batch.behaviour_logp, 0.0).sum(-1)
    e_out, e_in = out.mean(), (l_t.sum(-1) - out).mean()
    return {
        "entropy": (-np.sum(np.exp(log_p) * log_p, -1))[mask].mean(),
        "frac_tokens_tail": (mask & ~inside & (np.exp(lp) < 1e-3)).sum() / mask.sum(),
        "seq_log_ratio": l_t.sum(-1).mean(),
        "seq_log_ratio_pruned": l_pruned[kept].mean(),
        "seq_log_ratio_outside": e_out,
        "seq_log_ratio_outside_share": abs(e_out) / (abs(e_in) + abs(e_out)),
        # The safe-set split of the per-token mismatch, whatever the method (issue 46).
        "frac_tokens_outside_safe": (mask & ~inside).sum() / mask.sum(),
        "full_kl_k1_inside": -l_t[mask & inside].sum() / mask.sum(),
        "full_kl_k1_outside": -l_t[mask & ~inside].sum() / mask.sum(),
        "abs_log_ratio_outside_share": np.abs(l_t[mask & ~inside]).sum() / np.abs(l_t[mask]).sum(),
    }


def test_step_tail_metrics_match_dense_logits_without_pruning():
    """entropy, frac_tokens_tail and the seq_log_ratio family from the jitted step equal a dense
    float64 computation on the model's logits. The method is rloo (no pruning): the pass runs
    with log_rho = -inf and the safe set at LossConfig.log_rho comes from z_y - max z, the path
    only the step has (with pruning the step passes `in_safe` to `diagnostics.tail_metrics`,
    whose dense test covers it; one method keeps this test to one compile). Tolerance 1e-4
    relative, 1e-5 absolute: composed (model forward, chunked vocabulary sums in fp32) against
    float64."""
    from dvp_jax import metrics as metrics_lib

    # Spread logits (init_std 0.2): of 48 response tokens 8 are outside V_S, 2 of them in the
    # tail, and 4 of 8 responses would be kept by E5.
    log_rho = -4.0
    model = tiny_model(seed=2, init_std=0.2)
    optimizer = make_optimizer(1e-2, 0, 0.0, 1.0)
    graphdef, state, _ = init_train_state(model, optimizer, 0, Sharder())
    batch = _batch(rows=8, seed=4)
    expect = _dense_tail_reference(nnx.merge(graphdef, state.params), batch, log_rho)
    assert 0 < expect["frac_tokens_tail"] and 0.05 < expect["seq_log_ratio_outside_share"] < 1
    fn = jax.jit(
        lambda s, b: step_lib.rl_update(
            s,
            b,
            graphdef=graphdef,
            optimizer=optimizer,
            loss_cfg=LossConfig.preset("rloo", log_rho=log_rho),
            chunk_size=16,
            micro_batches=2,  # the per-position stats come back through the micro-batch scan
        )
    )
    _, got = fn(state, jax.tree.map(jnp.asarray, batch))
    metrics_lib.check(got)
    expect["seq_log_ratio_pruned"] = expect["seq_log_ratio"]  # nothing pruned or excluded
    for key, value in expect.items():
        np.testing.assert_allclose(got[key], value, rtol=1e-4, atol=1e-5, err_msg=key)
    assert float(got["frac_tokens_outside_train_safe"]) == 0.0  # E5's meaning: no pruning
