"""The rollout's cost model (`rollout/cost.py`): hand-worked schedules and the bytes they give."""

import numpy as np
import pytest

from dvp_jax.rollout import cost


def test_two_slots_one_dispatch_by_hand():
    """Prompts of 1 token, responses of 3 and 1, 2 slots, k = 8, buckets (4, 8), pages of 2.
    The dispatch attends over bucket 8 (max position 1 + 8 = 9, past the last bucket): 3 steps
    x 2 slots x 8 = 48 positions dense. Paged: step 1 both slots attend 2 positions (1 page
    each), steps 2 and 3 slot 0 attends 3 and 4 (2 pages each): 4 + 4 + 4 = 12 positions read
    of 2 + 2 + 3 + 4 = 11 attended."""
    run = cost.schedule([1, 1], [3, 1], slots=2, steps_per_sync=8, kv_buckets=(4, 8), page_size=2)
    assert run == cost.Schedule(steps=3, dense_positions=48, paged_positions=12, live_positions=11)


def test_a_finished_slot_is_refilled_after_the_step_it_finishes_in():
    """One slot, responses of 2 and 1: the first dispatch ends when the first response does
    (a prompt waits), the second serves the other: 3 steps, each over bucket 16 dense."""
    run = cost.schedule([1, 1], [2, 1], slots=1, steps_per_sync=8, kv_buckets=(16,), page_size=2)
    assert run == cost.Schedule(steps=3, dense_positions=48, paged_positions=8, live_positions=7)


def test_rollout_costs_take_the_slowest_host_and_add_the_weights():
    """Two hosts; host 1's responses are longer, so it sets the time. Bytes: steps x weights
    plus positions x KV bytes per position, over the bandwidth."""
    prompts, responses = np.ones(4, int), np.array([1, 1, 3, 1])
    costs = cost.rollout_costs(
        prompts,
        responses,
        hosts=2,
        slots=2,
        steps_per_sync=8,
        kv_buckets=(4, 8),
        page_size=2,
        weight_bytes=1e9,
        kv_bytes_per_position=1e6,
        hbm_bytes_per_s=1e12,
    )
    dense, paged = costs
    assert (dense.decode, paged.decode) == ("dense (today)", "paged")
    assert dense.steps == paged.steps == 3  # host 1: the hand-worked schedule above
    assert dense.seconds == pytest.approx((3 * 1e9 + 48 * 1e6) / 1e12)
    assert paged.seconds == pytest.approx((3 * 1e9 + 12 * 1e6) / 1e12)
    assert paged.kv_over_live == pytest.approx(12 / 11)
    text = cost.table(costs, 1e12)
    assert "paged / dense bytes read" in text and "lower bound" in text
