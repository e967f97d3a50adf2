"""The rollout's cost model (`plan/rollout_cost.py`): hand-worked schedules and the bytes they give.
The schedules are the engine's scheduler's (`scheduler.py`); test_rollout_scheduler.py checks
that the engine runs the same number of decode steps."""

import dataclasses

import numpy as np
import pytest

from dvp_jax.plan import rollout_cost as cost
from dvp_jax.rollout.scheduler import Limits
from dvp_jax.rollout.state import EngineConfig


def _limits(kind, slots, k=8, buckets=(4, 8), page_size=2, pages=0):
    return Limits(
        slots=slots,
        max_decode_length=8,
        cache_length=9,
        page_size=0 if kind == "positions" else page_size,
        num_pages=pages or slots * 5,
        buckets=() if kind == "own" else buckets,
        span_kind=kind,
        steps_per_sync=k,
    )


def test_two_slots_one_dispatch_by_hand():
    """Prompts of 1 token, responses of 3 and 1, 2 slots, k = 8, buckets (4, 8), pages of 2.
    Dense: the dispatch attends over bucket 8 (max position 1 + 8 = 9, past the last bucket):
    3 steps x 2 slots x 8 = 48 positions. Kernel: step 1 both slots attend 2 positions (1 page
    each), steps 2 and 3 slot 0 attends 3 and 4 (2 pages each): 4 + 4 + 4 = 12 positions read
    of 2 + 2 + 3 + 4 = 11 attended. Ragged XLA: the two slots hold 2 x ceil(min(1 + 8, 1 +
    3 or 1) / 2) = 2 + 1 = 3 pages by the end, bucket 4: 3 steps x 4 pages x 2 = 24."""
    args = ([1, 1], [3, 1])
    dense = cost.schedule(*args, _limits("positions", 2))
    assert dense == cost.Schedule(steps=3, positions=48, live_positions=11)
    kernel = cost.schedule(*args, _limits("own", 2))
    assert kernel == cost.Schedule(steps=3, positions=12, live_positions=11)
    # The slots may write 8 more positions each: 1 + 8 = 9 -> ceil(9 / 2) = 5 pages, 10 in
    # all, past the last bucket (8): 3 steps x 8 pages x 2 positions.
    xla = cost.schedule(*args, _limits("pages", 2))
    assert xla == cost.Schedule(steps=3, positions=48, live_positions=11)


def test_a_finished_slot_is_refilled_after_the_step_it_finishes_in():
    """One slot, responses of 2 and 1: the first dispatch ends when the first response does
    (a prompt waits), the second serves the other: 3 steps, each over bucket 16 dense."""
    run = cost.schedule([1, 1], [2, 1], _limits("positions", 1, buckets=(16,)))
    assert run == cost.Schedule(steps=3, positions=48, live_positions=7)
    run = cost.schedule([1, 1], [2, 1], _limits("own", 1))
    assert run == cost.Schedule(steps=3, positions=8, live_positions=7)


def test_a_short_pool_admits_what_it_holds_and_evicts_the_younger_response():
    """Two slots, pages of 2, a pool of 5 (one slot at full length, 9 positions); prompts of 1,
    responses of 8, k = 1. Admission looks 8 steps ahead: the first response will hold
    ceil(9 / 2) = 5 pages, so the second waits and runs after it: 8 + 8 = 16 steps, no eviction.
    Looking 1 step ahead (min_steps 1) both start; after 3 steps each holds 2 pages and needs a
    third (6 > 5): the younger is evicted, decoded again from its start, and evicted again
    whenever the older grows, until the older ends; still 16 steps."""
    run = cost.schedule([1, 1], [8, 8], _limits("own", 2, k=1, pages=5))
    assert (run.steps, run.evictions) == (16, 0)
    eager = dataclasses.replace(_limits("own", 2, k=1, pages=5), min_steps=1)
    run = cost.schedule([1, 1], [8, 8], eager)
    assert run.steps == 16 and run.evictions > 0


def test_rollout_costs_take_the_slowest_host_and_add_the_weights():
    """Two hosts; host 1's responses are longer, so it sets the time. Bytes: steps x weights
    plus positions x KV bytes per position, over the bandwidth."""
    prompts, responses = np.ones(4, int), np.array([1, 1, 3, 1])
    config = EngineConfig(
        max_concurrent_decodes=2, max_prefill_length=1, max_decode_length=8, page_size=2
    )
    costs = cost.rollout_costs(
        prompts,
        responses,
        hosts=2,
        config=config,
        weight_bytes=1e9,
        kv_bytes_per_position=1e6,
        hbm_bytes_per_s=1e12,
    )
    dense, kernel, xla = costs
    assert [c.decode for c in costs] == [name for name, _, _ in cost.DECODES]
    assert dense.steps == kernel.steps == xla.steps == 3  # host 1: the hand-worked schedule
    # Sized dispatches: dense reads the cache's one bucket (9 positions: kv_buckets (9,)).
    assert config.kv_buckets == (9,)
    assert dense.seconds == pytest.approx((3 * 1e9 + 3 * 2 * 9 * 1e6) / 1e12)
    assert kernel.seconds == pytest.approx((3 * 1e9 + 12 * 1e6) / 1e12)
    assert kernel.kv_over_live == pytest.approx(12 / 11)
    assert xla.kv_gb >= kernel.kv_gb
    text = cost.table(costs, 1e12)
    assert "bytes/dense" in text and "lower bound" in text
