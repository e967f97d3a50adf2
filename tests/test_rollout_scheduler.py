"""The one rollout scheduler (`rollout/scheduler.py`): progress on every pool, the engine and the
cost model running the same decisions, and sized dispatches.

Host-only tests replay the device loop (`plan.replay.simulate`); engine tests decode a tiny model
in float32 (tokens of a run on a short pool equal a full pool's: the same keys sample the same
tokens; log-probs to the 2e-5 of test_paged_attention.py, since another span is another
program)."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from dvp_jax.model import TRAIN_POLICY, ModelConfig, Transformer
from dvp_jax.plan import rollout_cost as cost
from dvp_jax.plan.replay import simulate
from dvp_jax.rollout import scheduler
from dvp_jax.rollout.engine import EngineConfig, RolloutEngine
from dvp_jax.rollout.offline import generate_rollouts
from dvp_jax.rollout.scheduler import Limits, Scheduler, Span

CFG = ModelConfig.preset("tiny", init_std=0.5)


def _guarded(sched: Scheduler, responses, budget: int):
    """`simulate` with every plan checked: the dispatch's pages fit the pool, the oldest
    active response is never evicted, and the run ends within `budget` dispatches."""
    plan, plans = sched.plan, []

    def checked():
        active = np.flatnonzero(sched.occupied)
        oldest = int(sched.owner[active[np.argmin(sched.age[active])]]) if active.size else -1
        owner = sched.owner.copy()
        dispatch = plan()
        evicted = {int(owner[s]) for s in dispatch.evict}
        assert oldest not in evicted
        if sched.limits.paged:
            assert dispatch.live_pages <= sched.limits.num_pages
        plans.append(dispatch)
        assert len(plans) <= budget, "no progress"
        return dispatch

    sched.plan = checked
    return simulate(sched, responses), plans


@pytest.mark.parametrize("seed", range(40))
def test_every_pool_finishes_every_response_with_bounded_evictions(seed):
    """Random pools from the least allowed (one slot at full length) to full, group sizes,
    page sizes, lengths and stop patterns (G samples of a prompt crossing a page in the same
    step included), fixed or sized dispatches."""
    rng = np.random.default_rng(seed)
    slots, ps = int(rng.integers(1, 7)), int(rng.choice([1, 2, 4, 8]))
    prompt_cap, m = int(rng.integers(2, 17)), int(rng.integers(1, 33))
    config = EngineConfig(
        max_concurrent_decodes=slots,
        max_prefill_length=prompt_cap,
        max_decode_length=m,
        page_size=ps,
    )
    least, full = config.pages_per_slot, slots * config.pages_per_slot
    config = dataclasses.replace(config, kv_pages=int(rng.integers(least, full + 1)))
    k = None if rng.random() < 0.5 else int(rng.integers(1, 9))
    lim = Limits.of(config, rng.choice(["kernel", "xla"]), k)
    g, n_prompts = int(rng.integers(1, 5)), int(rng.integers(1, 5))
    prompts = np.repeat(rng.integers(1, prompt_cap + 1, size=n_prompts), g)
    if rng.random() < 0.5:  # a group's samples all run to the cap together
        responses = np.full(prompts.shape, m)
    else:
        responses = rng.integers(1, m + 1, size=prompts.shape)
    n = len(prompts)
    stats, plans = _guarded(Scheduler(lim, prompts), responses, budget=n * (m + 1) + 1)
    assert stats.admissions == n + stats.evictions  # every eviction was admitted again
    assert stats.evictions <= len(plans) * (slots - 1)
    if lim.num_pages == full:
        assert stats.evictions == 0


def test_the_livelock_of_a_group_crossing_a_page_together_is_gone():
    """The case that livelocked: G = slots samples of one prompt reach a page boundary in the
    same step with the pool empty. Before, all were preempted, readmitted together and
    replayed the same tokens; now the youngest yield and the oldest go on."""
    for slots, pages in [(2, None), (3, 12)]:
        config = EngineConfig(
            max_concurrent_decodes=slots, max_prefill_length=16, max_decode_length=16, page_size=4
        )
        config = dataclasses.replace(config, kv_pages=pages or config.pages_per_slot)
        lim = Limits.of(config, "xla")
        prompts, responses = np.full(2 * slots, 4), np.full(2 * slots, 16)
        stats, _ = _guarded(Scheduler(lim, prompts), responses, budget=500)
        assert stats.evictions > 0 and stats.admissions == len(prompts) + stats.evictions


def test_sized_dispatches_keep_their_span_and_pool():
    """Sized: as many steps as keep the first steps' span (here the ragged path's page bucket)
    and pages; fixed: k each."""
    config = EngineConfig(
        max_concurrent_decodes=4, max_prefill_length=16, max_decode_length=64, page_size=16
    )
    assert config.page_buckets == (8, 16, 20)
    prompts, responses = np.full(4, 3), np.array([64, 64, 10, 40])
    sized = Scheduler(Limits.of(config, "xla"), prompts)
    first = sized.plan()
    # 8 steps take each slot to position 11, 1 page each: bucket 8, which holds 2 pages a
    # slot, so up to position 32: 29 steps.
    assert first.span == Span("pages", 8) and first.num_steps == 29
    fixed = Scheduler(Limits.of(config, "xla", steps_per_sync=8), prompts)
    assert fixed.plan().num_steps == 8
    s_sized = simulate(Scheduler(Limits.of(config, "xla"), prompts), responses)
    s_fixed = simulate(Scheduler(Limits.of(config, "xla", steps_per_sync=8), prompts), responses)
    assert s_sized.steps == s_fixed.steps == 64
    assert s_sized.dispatches < s_fixed.dispatches


# ----------------------------------------------------------------------------------------------
# The engine.
# ----------------------------------------------------------------------------------------------
PROMPTS = [[1, 4, 14, 5], [1, 6, 16, 7, 18, 9, 9, 9, 9, 9, 9], [1, 3, 3, 3], [1, 8, 8, 2]]


@pytest.fixture(scope="module")
def master():
    return Transformer(CFG, TRAIN_POLICY, rngs=nnx.Rngs(0))


def _run(master, g=3, stop_tokens=None, **kw):
    base = dict(
        dtype="float32",
        max_concurrent_decodes=3,
        max_prefill_length=16,
        prefill_buckets=(8,),
        max_decode_length=20,
        page_size=4,
        stop_tokens=stop_tokens,
    )
    config = EngineConfig(**{**base, **kw})
    engine = RolloutEngine(CFG, config, params=nnx.state(master))
    stats = []
    batch = generate_rollouts(engine, PROMPTS, g, jax.random.key(3), stats=stats)
    return engine, batch, stats[0]


@pytest.fixture(scope="module")
def full(master):
    return _run(master)


@pytest.mark.parametrize(
    "kw",
    [
        dict(kv_pages=9),  # the least: one slot at full length, ceil(36 / 4)
        dict(kv_pages=12),  # the 3 slots and 12 pages
        dict(kv_pages=17),
        dict(kv_pages=9, steps_per_sync=3),
    ],
    ids=["least", "12", "17", "least_k3"],
)
def test_short_pools_give_the_full_pool_tokens_and_the_cost_model_counts_their_steps(
    master, full, kw
):
    """Every pool finishes; tokens equal the full pool's; the cost model, replaying the same
    scheduler over the lengths the engine produced, counts the engine's decode steps."""
    k = kw.pop("steps_per_sync", None)
    engine = RolloutEngine(CFG, dataclasses.replace(full[0].config, **kw), params=nnx.state(master))
    stats = []
    batch = generate_rollouts(engine, PROMPTS, 3, jax.random.key(3), steps_per_sync=k, stats=stats)
    ref = full[1]
    assert len(set(ref.response_lengths.tolist())) > 2  # stops at different steps
    np.testing.assert_array_equal(batch.tokens, ref.tokens)
    np.testing.assert_array_equal(batch.response_lengths, ref.response_lengths)
    np.testing.assert_allclose(batch.behaviour_logp, ref.behaviour_logp, atol=2e-5)
    assert stats[0].evictions > 0 and stats[0].device_preemptions == 0
    lim = Limits.from_engine(engine, k)
    replay = cost.schedule(batch.prompt_lengths, batch.response_lengths, lim)
    assert replay.steps == stats[0].steps and replay.evictions == stats[0].evictions
    assert simulate(Scheduler(lim, batch.prompt_lengths), batch.response_lengths) == stats[0]


def test_the_full_pool_never_evicts_and_the_cost_model_counts_its_steps(full):
    engine, batch, stats = full
    assert stats.evictions == 0 and stats.steps > 0
    lim = Limits.from_engine(engine)
    assert cost.schedule(batch.prompt_lengths, batch.response_lengths, lim).steps == stats.steps


def test_sized_dispatches_sync_less_often_with_the_same_tokens(master, full):
    engine = full[0]
    per = []
    fixed = generate_rollouts(engine, PROMPTS, 3, jax.random.key(3), steps_per_sync=2, stats=per)
    np.testing.assert_array_equal(fixed.tokens, full[1].tokens)
    assert full[2].dispatches < per[0].dispatches and full[2].steps == per[0].steps


def test_limits_refuse_a_bad_dispatch_size():
    with pytest.raises(ValueError, match="steps_per_sync must be None or >= 1"):
        Limits(slots=1, max_decode_length=4, cache_length=8, steps_per_sync=0)
    with pytest.raises(ValueError, match="Span.kind must be one of"):
        Span("bytes", 3)
    assert scheduler.MIN_STEPS <= scheduler.MAX_STEPS


def test_page_settings_that_cannot_work_are_refused_in_one_line():
    """A pool larger than the device's memory (e.g. a page size far above the cache) is refused
    before anything is allocated, naming the field and the bytes."""
    huge = EngineConfig(max_prefill_length=16, max_decode_length=6, page_size=1_000_000)
    with pytest.raises(ValueError, match=r"^cfg.kv_pages: the KV cache needs [\d,.]+ GiB"):
        huge.check_pool_fits(CFG, 1, 2**20, "cfg")
    config = EngineConfig(max_prefill_length=16, max_decode_length=6, page_size=4, kv_pages=10**9)
    # 10^9 pages x 4 positions x 2 (k, v) x 2 layers x kv heads x head dim x 2 bytes (bf16).
    assert (
        config.pool_bytes(CFG) == 10**9 * 4 * 2 * CFG.n_layers * CFG.n_kv_heads * CFG.head_dim * 2
    )
    with pytest.raises(ValueError, match=r"^cfg.kv_pages: the KV cache needs [\d,.]+ GiB per chip"):
        config.check_pool_fits(CFG, 1, 2**30, "cfg")
    config.check_pool_fits(CFG, 1, config.pool_bytes(CFG), "cfg")  # exactly fits
    with pytest.raises(ValueError, match="KV cache needs"):
        RolloutEngine(CFG, config)


@pytest.mark.parametrize("seed", range(20))
def test_resumed_responses_keep_their_tokens_and_every_one_finishes(seed):
    """The server's mode: an evicted response keeps what it generated (prefilled again when
    readmitted) and its own slot; requests arrive while others run. Every response ends with
    exactly its length, the oldest is never evicted, and a response never generates twice."""
    rng = np.random.default_rng(100 + seed)
    slots, ps, m = int(rng.integers(2, 6)), int(rng.choice([2, 4])), int(rng.integers(4, 25))
    config = EngineConfig(
        max_concurrent_decodes=slots, max_prefill_length=8, max_decode_length=m, page_size=ps
    )
    config = dataclasses.replace(config, kv_pages=config.pages_per_slot + int(rng.integers(0, 3)))
    sched = Scheduler(Limits.of(config, "kernel", steps_per_sync=1), resume=True)
    responses, generated = [], []
    for slot in range(slots):
        sched.add(int(rng.integers(1, 9)), home=slot)
        responses.append(int(rng.integers(1, m + 1)))
    step = np.zeros((slots,), np.int64)
    done = np.ones((slots,), bool)
    total = 0
    for _ in range(10_000):
        if sched.done():
            break
        dispatch = sched.plan()
        for s in dispatch.evict:
            done[s] = True
        for s, r in dispatch.admit:
            assert s == sched.home[r]
            step[s], done[s] = sched.generated[r], False
        active = ~done
        step[active] += 1
        total += int(active.sum())
        for s in np.flatnonzero(active):
            done[s] |= step[s] >= responses[sched.owner[s]]
        for s, r in sched.observe(step, done):
            generated.append((r, int(step[s])))
            if len(responses) < 3 * slots:  # a new request takes the freed slot
                sched.add(int(rng.integers(1, 9)), home=s)
                responses.append(int(rng.integers(1, m + 1)))
    assert sched.done()
    assert sorted(generated) == [(r, n) for r, n in enumerate(responses)]
    assert total == sum(responses)  # no token generated twice
