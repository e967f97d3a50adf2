"""Partial rollouts with over-sampling (`rollout/partial.py`, `train/sources.py`).

Exactness: with weights that do not change between steps, a carried response is prefilled
again with its prefix and goes on with its key and step, so it is token for token the response
an uninterrupted rollout gives (float32; log-probs to the 2e-5 of another program's rounding,
as in test_paged_attention.py). A trainer run with `rollout.partial` logs the per-age split."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from dvp_jax.metrics import read_metrics
from dvp_jax.model import TRAIN_POLICY, ModelConfig, Transformer
from dvp_jax.plan.replay import simulate
from dvp_jax.rollout.engine import EngineConfig, RolloutEngine
from dvp_jax.rollout.offline import generate_rollouts
from dvp_jax.rollout.partial import PartialRollout
from dvp_jax.rollout.scheduler import Limits, Scheduler
from tests.shared_runs import run_trainer

CFG = ModelConfig.preset("tiny", init_std=0.5)
G, P = 2, 2


@pytest.fixture(scope="module")
def engine():
    master = Transformer(CFG, TRAIN_POLICY, rngs=nnx.Rngs(0))
    config = EngineConfig(
        dtype="float32",
        max_concurrent_decodes=4,
        max_prefill_length=16,
        prefill_buckets=(8,),
        max_decode_length=20,
        page_size=4,
        stop_tokens=(2, 7, 11),  # responses of many lengths
    )
    return RolloutEngine(CFG, config, params=nnx.state(master))


PROMPTS = [list(np.random.default_rng(0).integers(12, 60, size=n)) for n in (3, 9, 5, 2, 7, 4, 6)]
PROMPTS += [list(np.random.default_rng(1).integers(12, 60, size=n)) for n in (8, 3, 5)]
KEY = jax.random.key(5)


def _draw(order):
    """Prompts in order, each with its key fold_in(KEY, index) as generate_rollouts keys it."""

    def draw(n):
        out = []
        while order and len(out) < n:
            i = order.pop(0)
            key = np.asarray(jax.device_get(jax.random.key_data(jax.random.fold_in(KEY, i))))
            out.append((PROMPTS[i], i, key))
        return out

    return draw


def test_carried_responses_are_the_uninterrupted_ones(engine):
    """Five steps of P = 2 groups with 2x over-sampling: every trained response equals the
    same prompt and key's uninterrupted response, and some were carried across steps (tokens
    of two weight versions in one response)."""
    reference = generate_rollouts(engine, PROMPTS, G, KEY)
    lengths = reference.response_lengths
    assert lengths.min() < 20 and len(set(lengths.tolist())) > 3  # mixed lengths
    partial = PartialRollout(engine, G, P, 2.0, max_staleness=10)
    draw, carried = _draw(list(range(len(PROMPTS)))), 0
    for step in range(5):
        batch, payloads, stats = partial.generate(engine.params, step, draw)
        assert stats.groups_in_flight <= 4 and batch.num_rows == P * G
        for row in range(batch.num_rows):
            i = payloads[row // G] * G + row % G
            np.testing.assert_array_equal(batch.response(row), reference.response(i))
            cols = batch.response_mask[row]
            ref_cols = reference.response_mask[i]
            np.testing.assert_allclose(
                batch.behaviour_logp[row, cols], reference.behaviour_logp[i, ref_cols], atol=2e-5
            )
            versions = batch.behaviour_version[row, cols]
            assert versions.max() <= step
            carried += len(set(versions.tolist())) > 1
    assert carried > 0


def test_a_response_past_max_staleness_is_decoded_again(engine):
    """max_staleness 0: a response carried over is restarted from its prompt (same key, so
    the same tokens) and counted; every trained token is of the step's version."""
    reference = generate_rollouts(engine, PROMPTS, G, KEY)
    partial = PartialRollout(engine, G, P, 2.0, max_staleness=0)
    draw, restarts = _draw(list(range(len(PROMPTS)))), 0
    for step in range(4):
        batch, payloads, stats = partial.generate(engine.params, step, draw)
        restarts += stats.stale_restarts
        assert np.all(batch.behaviour_version[batch.response_mask] == step)
        for row in range(batch.num_rows):
            i = payloads[row // G] * G + row % G
            np.testing.assert_array_equal(batch.response(row), reference.response(i))
    assert restarts > 0


def test_rejected_groups_are_replaced_by_later_ones(engine):
    """An `accept` that drops every other complete group still yields P groups a step."""
    partial = PartialRollout(engine, G, P, 1.5, max_staleness=10)
    seen = []

    def accept(group):
        seen.append(group.payload)
        return len(seen) % 2 == 0

    batch, payloads, _ = partial.generate(
        engine.params, 0, _draw(list(range(len(PROMPTS)))), accept=accept
    )
    assert len(payloads) == P and len(seen) >= 2 * P
    assert all(seen.index(p) % 2 == 1 for p in payloads)


def test_the_scheduler_ends_a_partial_round_at_its_target_groups():
    """Replayed (the cost model's view): 3 groups of 2, the second group's responses short;
    a round targeting 1 group ends when that group completes, carrying the others."""
    config = EngineConfig(max_concurrent_decodes=6, max_prefill_length=8, max_decode_length=16)
    sched = Scheduler(
        Limits.of(config, "kernel"),
        [4] * 6,
        resume=True,
        groups=[0, 0, 1, 1, 2, 2],
        target_groups=1,
    )
    stats = simulate(sched, [16, 16, 3, 5, 16, 9])
    assert sched.complete == [1] and stats.steps == 5
    carried = dict(sched.unfinished())
    assert carried == {0: 5, 1: 5, 4: 5, 5: 5}


def test_a_partial_trainer_run_logs_the_staleness_split(tmp_path):
    """Three RL steps of the test-size tiny config with partial rollouts and
    mask_stale_tokens: the per-age token shares sum to 1, the split mismatch and the partial
    counts are logged, and step 1 has nothing carried into it."""
    run_trainer(
        tmp_path,
        **{
            "train.steps": 3,
            "rollout.partial": True,
            "rollout.oversample": 2.0,
            "loss.mask_stale_tokens": True,
            "eval.every": 0,
        },
    )
    rows = [r for r in read_metrics(tmp_path) if "age_share_0" in r]
    assert len(rows) == 3
    for r in rows:
        total = r["age_share_0"] + r["age_share_1"] + r["age_share_2plus"]
        assert total == pytest.approx(1.0, abs=1e-6)
        assert r["partial_groups_in_flight"] >= 1 and "mismatch_abs_age0" in r
    assert rows[0]["age_share_0"] == pytest.approx(1.0)  # nothing carried into step 1


def test_partial_config_fields_are_checked_in_one_line():
    from dvp_jax.train.sections import RolloutConfig

    with pytest.raises(ValueError, match="rollout.oversample"):
        RolloutConfig(oversample=0.5)
    with pytest.raises(ValueError, match="rollout.max_staleness"):
        RolloutConfig(max_staleness=-1)
    assert dataclasses.replace(RolloutConfig(), partial=True).partial


def test_every_prompt_drawn_has_its_own_key_and_the_sync_rollout_s():
    """Over-sampling draws several data batches in one step: the b-th batch is keyed as the
    synchronous rollout keys step b's batch (fold_in(key(b), index)), so no two prompts share
    a key, and the batch count goes on from a checkpoint."""
    import types

    from dvp_jax.train.sources import PartialSource

    def batches():
        for b in range(100):
            yield types.SimpleNamespace(
                lengths=[2, 2], tokens=np.full((2, 4), b), answers=[f"{b}a", f"{b}b"]
            )

    cfg = types.SimpleNamespace(train=types.SimpleNamespace(prompts_per_step=2))
    base = jax.random.key(9)
    key = lambda b: jax.random.fold_in(base, b)
    source = PartialSource(cfg, types.SimpleNamespace(engine=None), batches(), key, None, None)
    drawn = source._draw(6)  # three batches within one step
    keys = [tuple(k.tolist()) for _, _, k in drawn]
    assert len(set(keys)) == 6 and source.batches == 3
    want = np.asarray(jax.random.key_data(jax.random.fold_in(key(2), 1)))
    np.testing.assert_array_equal(drawn[3][2], want)  # batch 2, its second prompt
    source.resumed({"partial_batches": 7, "partial_in_flight": 5})
    assert source.batches == 7 and source.dropped == 5
