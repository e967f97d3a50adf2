"""RLOO (E8) and GRPO advantages. Tolerance 1e-5 relative (fp32 vs float64 reference)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dvp_jax.dvp import advantages
from tests import reference as ref


def test_rloo_g2_by_hand():
    # G = 2: A_i = R_i - R_other. Group (1, 0) -> (1, -1); group (0.5, 0.5) -> (0, 0).
    a = advantages.rloo(jnp.array([1.0, 0.0, 0.5, 0.5]), group_size=2)
    np.testing.assert_allclose(a, [1.0, -1.0, 0.0, 0.0])


def test_rloo_g4_by_hand():
    # G = 4, R = (1, 0, 0, 1): each baseline is the mean of the three others.
    # A_0 = 1 - (0 + 0 + 1) / 3 = 2/3; A_1 = 0 - (1 + 0 + 1) / 3 = -2/3; same for 3 and 2.
    a = advantages.rloo(jnp.array([[1.0, 0.0, 0.0, 1.0]]), group_size=4)
    np.testing.assert_allclose(a, [[2 / 3, -2 / 3, -2 / 3, 2 / 3]], rtol=1e-6)


@pytest.mark.parametrize("group_size", [2, 3, 16])
def test_rloo_and_grpo_match_reference(group_size):
    rng = np.random.default_rng(group_size)
    rewards = rng.normal(size=(5, group_size)).astype(np.float32)
    rloo = jax.jit(functools.partial(advantages.rloo, group_size=group_size))
    np.testing.assert_allclose(rloo(rewards), ref.rloo(rewards), rtol=1e-5, atol=1e-6)
    flat = rloo(rewards.reshape(-1))
    np.testing.assert_allclose(flat, ref.rloo(rewards).reshape(-1), rtol=1e-5, atol=1e-6)
    got = advantages.grpo(rewards, group_size)
    np.testing.assert_allclose(got, ref.grpo(rewards), rtol=1e-5, atol=1e-6)
    # RLOO is the mean-centred reward scaled by G / (G - 1); advantages sum to zero per group.
    np.testing.assert_allclose(np.sum(rloo(rewards), axis=1), 0.0, atol=1e-5)


def test_grpo_equal_rewards_give_zero_and_unscaled_option():
    np.testing.assert_array_equal(advantages.grpo(jnp.ones((2, 4)), 4), np.zeros((2, 4)))
    a = advantages.grpo(jnp.array([1.0, 0.0, 0.0, 1.0]), 4, scale_by_std=False)
    np.testing.assert_allclose(a, [0.5, -0.5, -0.5, 0.5])


@pytest.mark.parametrize("group_size", [1, 0, 2.0])
def test_group_size_below_two_is_an_error(group_size):
    with pytest.raises(ValueError, match="group_size"):
        advantages.rloo(jnp.ones(4), group_size=group_size)
    with pytest.raises(ValueError, match="group_size"):
        advantages.grpo(jnp.ones(4), group_size=group_size)


def test_shape_errors_name_the_problem():
    with pytest.raises(ValueError, match="whole number of groups"):
        advantages.rloo(jnp.ones(5), group_size=2)
    with pytest.raises(ValueError, match="group_size = 3"):
        advantages.rloo(jnp.ones((2, 4)), group_size=3)
