"""Paged decode (`model/paged.py`, `model/decode_kernels.py`) against dense decode.

Rollouts of a tiny model with responses that stop at different steps, so slots finish and are
refilled at different steps; a pool smaller than the responses need, so pages are returned and
taken again and responses are preempted and decoded again. Tolerances: the paged paths sum the
same float32 terms in another order (per page, then across pages), so float32 log-probs agree to
a few ulp of O(10) logits (observed 5e-6; bound 2e-5) and tokens are equal; in bfloat16 the
attention output is rounded to bf16 after that reordering, so log-probs agree to bf16 rounding
(bound 0.05 on O(10) logits) and a token may differ where two candidates' logits are within that
of each other (a near-tie: counted, and required rare; 0 of 12 responses observed, as the XLA
path rounds the normalised probabilities as dense does).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

from dvp_jax.model import TRAIN_POLICY, ModelConfig, Transformer, decode_kernels, paged
from dvp_jax.model.config import DTypePolicy
from dvp_jax.model.kv_cache import from_storage, to_storage
from dvp_jax.rollout.engine import EngineConfig, RolloutEngine
from dvp_jax.rollout.offline import generate_rollouts
from dvp_jax.sharding import ROLLOUT_RULES, MeshConfig, Sharder, make_mesh

CFG = ModelConfig.preset("tiny", init_std=0.5)
# 1 = BOS of the char tokenizer; prompts in both prefill buckets (8 and 16).
PROMPTS = [[1, 4, 14, 5, 18], [1, 6, 16, 7, 18, 9, 9, 9, 9, 9, 9], [1, 3], [1, 8, 8, 2]]
STATS = ("behaviour_logp", "behaviour_logp_full", "behaviour_pruned_mass")


def _config(**kw) -> EngineConfig:
    base = dict(
        max_concurrent_decodes=4,
        max_prefill_length=16,
        prefill_buckets=(8,),
        max_decode_length=24,
        log_rho=-3.0,
        page_size=8,
    )
    return EngineConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def master():
    return Transformer(CFG, TRAIN_POLICY, rngs=nnx.Rngs(0))


def _rollouts(master, **kw):
    """The engine, its rollouts, and how many responses the scheduler evicted for want of
    pages (the device's own guard must never fire)."""
    engine = RolloutEngine(CFG, _config(**kw), params=nnx.state(master))
    stats = []
    batch = generate_rollouts(engine, PROMPTS, 3, jax.random.key(1), stats=stats)
    assert stats[0].device_preemptions == 0
    return engine, batch, stats[0].evictions


def test_engine_config_checks_paged_fields_in_one_line():
    with pytest.raises(ValueError, match="decode_attention must be one of"):
        _config(decode_attention="flash")
    with pytest.raises(ValueError, match=r"kv_pages must be None or an int >= 5"):
        _config(kv_pages=4)  # one slot at full length: ceil((16 + 24) / 8) = 5 pages
    assert _config().num_pages == 4 * 5 and _config(kv_pages=7).num_pages == 7


def test_page_pool_takes_pages_in_order_and_returns_them():
    pages = paged.Pages.empty(slots=3, pages_per_slot=4, num_pages=5)
    want = jnp.zeros((3, 4), bool).at[0, :2].set(True).at[2, :2].set(True)
    pages, missed = paged.allocate(pages, want, most=8)
    np.testing.assert_array_equal(pages.table[:, :2], [[0, 1], [-1, -1], [2, 3]])
    assert not missed.any() and int(pages.free_count()) == 1
    # Two slots want one page each, one is left: the first in slot order gets it.
    want = jnp.zeros((3, 4), bool).at[1, 0].set(True).at[2, 2].set(True)
    pages, missed = paged.allocate(pages, want, most=3)
    np.testing.assert_array_equal(missed, [False, False, True])
    assert int(pages.table[1, 0]) == 4 and int(pages.free_count()) == 0
    pages = paged.release(pages, jnp.asarray([True, False, False]))
    np.testing.assert_array_equal(pages.table[0], [-1] * 4)
    np.testing.assert_array_equal(np.flatnonzero(~np.asarray(pages.used)), [0, 1])


def test_paged_rollouts_equal_dense_in_float32_with_slots_refilled_and_pages_reused(master):
    """12 responses through 4 slots; the small pool (7 pages of 8 positions, 1.4 slots at full
    length) forces pages back into the pool and responses to wait or be preempted."""
    _, dense, _ = _rollouts(master, dtype="float32", decode_attention="dense")
    engine, small, preempted = _rollouts(
        master, dtype="float32", decode_attention="paged", kv_pages=7
    )
    assert engine.paged_impl == "xla"  # "paged" on CPU runs the ragged XLA path
    assert preempted > 0  # responses yielded their pages and were decoded again
    lengths = dense.response_lengths
    assert len(set(lengths.tolist())) > 2 and lengths.min() < 24  # finishes at different steps
    pages_needed = int(np.sum(-(-(dense.prompt_lengths + lengths) // 8)))
    assert pages_needed > 2 * 7  # so the pool's pages were taken and returned several times
    np.testing.assert_array_equal(small.tokens, dense.tokens)
    np.testing.assert_array_equal(small.response_lengths, dense.response_lengths)
    np.testing.assert_array_equal(small.behaviour_safe_size, dense.behaviour_safe_size)
    for name in STATS:
        np.testing.assert_allclose(getattr(small, name), getattr(dense, name), atol=2e-5)


def test_paged_rollouts_in_bfloat16_agree_with_dense_but_for_counted_near_ties(master):
    _, dense, _ = _rollouts(master, decode_attention="dense")
    _, paged_, _ = _rollouts(master, decode_attention="paged")
    same = np.all(paged_.tokens == dense.tokens, axis=1)
    # A response that diverges does so at a near-tie; up to there, the statistics agree.
    print(f"near-tie divergences: {np.sum(~same)} of {same.size} responses")
    assert np.sum(~same) <= 2, np.sum(~same)
    for i in np.flatnonzero(~same):
        first = np.flatnonzero(paged_.tokens[i] != dense.tokens[i])[0]
        assert abs(dense.behaviour_logp_full[i, first] - paged_.behaviour_logp_full[i, first]) < 1
    rows = same
    np.testing.assert_array_equal(paged_.behaviour_safe_size[rows], dense.behaviour_safe_size[rows])
    for name in STATS:
        np.testing.assert_allclose(
            getattr(paged_, name)[rows], getattr(dense, name)[rows], atol=0.05
        )


def _kernel_inputs(heads: int, h: int, g: int, dtype: str):
    """Three slots: 19 positions over 3 scattered pages, a finished slot (length 0), and a full
    one (32 positions); a 2-layer pool of 12 pages of 8. Returns (q, k, v, table, lengths)."""
    layers, pool, size = 2, 12, 8
    rng = np.random.default_rng(0)
    cache = [
        to_storage(
            jnp.asarray(rng.normal(size=(layers, pool, size, heads * h)), jnp.float32), dtype
        )
        for _ in range(2)
    ]
    table = jnp.asarray([[3, 7, 1, -1], [0, -1, -1, -1], [5, 2, 9, 11]], jnp.int32)
    lengths = jnp.asarray([19, 0, 32], jnp.int32)
    q = jnp.asarray(rng.normal(size=(3, heads, g, h)), dtype)
    return q, *cache, table, lengths


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_tpu_kernel_in_interpret_mode_equals_the_ragged_xla_path(dtype):
    """Layer 1 of the pool of `_kernel_inputs`. float32 agrees to float32 rounding (1e-5);
    bfloat16 to one bf16 ulp of O(1) outputs (8e-3): the kernel rounds the unnormalised
    probabilities to bf16 before p.v, the XLA path the normalised ones."""
    q, k, v, table, lengths = _kernel_inputs(heads=2, h=16, g=2, dtype=dtype)
    policy = DTypePolicy.named(dtype)
    load = lambda a: from_storage(a, dtype)
    ref = paged.ragged_attention(q, k, v, 1, table, lengths, 8, load, policy)
    out = decode_kernels.paged_decode_attention(q, k, v, jnp.int32(1), table, lengths, dtype)
    atol = 1e-5 if dtype == "float32" else 8e-3
    np.testing.assert_allclose(np.float32(out), np.float32(ref), atol=atol)
    assert np.all(np.float32(out)[1] == 0)


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_tpu_kernel_on_tensor_parallel_4_with_kv_heads_below_or_equal_to_it(kv_heads):
    """Tensor parallelism 4 over 4 fake CPU devices, 8 query heads. kv 4: the pool's merged
    `[k h]` axis splits into whole heads (one per shard). kv 2: 4 does not divide k, so the
    pool is whole on every shard, as the dense cache's kv-head axis is; split by k h (32 lanes
    over 4) it was cut mid-head and the kernel's per-head slices failed. The kernel (Pallas
    interpret mode, under shard_map) equals the ragged XLA path on the same mesh and the XLA
    path without one to float32 rounding (1e-5)."""
    mesh = make_mesh(MeshConfig(1, 1, 4), jax.devices()[:4])
    sharder = Sharder(mesh, ROLLOUT_RULES)
    q, k, v, table, lengths = _kernel_inputs(heads=kv_heads, h=16, g=8 // kv_heads, dtype="float32")
    spec = paged.paged_cache_spec(sharder, k.shape, kv_heads)
    assert spec == PartitionSpec(None, None, None, "tensor" if kv_heads == 4 else None)
    cache = paged.paged_cache_sharding(sharder, k.shape, kv_heads)
    # q as the model leaves it: its 8 query heads split over the tensor axis.
    q = jax.device_put(q, sharder.sharding(("act_batch", None, "act_heads", None), q.shape))
    k, v = jax.device_put(k, cache), jax.device_put(v, cache)
    policy = DTypePolicy.named("float32")
    load = lambda a: a

    @jax.jit
    def both(q, k, v, table, lengths):
        layer = jnp.int32(1)
        kernel = decode_kernels.paged_decode_attention(
            q, k, v, layer, table, lengths, "float32", sharder
        )
        return kernel, paged.ragged_attention(q, k, v, layer, table, lengths, 8, load, policy)

    kernel, ragged = both(q, k, v, table, lengths)
    host = [np.asarray(x) for x in (q, k, v, table, lengths)]
    ref = paged.ragged_attention(*host[:3], 1, *host[3:], 8, load, policy)
    np.testing.assert_allclose(np.asarray(kernel), np.asarray(ref), atol=1e-5)
    np.testing.assert_allclose(np.asarray(ragged), np.asarray(ref), atol=1e-5)
    assert np.all(np.asarray(kernel)[1] == 0)


def test_decode_step_on_tensor_parallel_4_with_2_kv_heads_runs_the_kernel_as_the_xla_path():
    """A whole decode step of the tiny model (4 query, 2 KV heads of 8) on a tensor-parallel-4
    mesh, the pool and the page table of `_kernel_inputs`: the kernel's logits equal the ragged
    XLA path's on the same mesh and the XLA path's on one device to float32 rounding of O(1)
    logits (1e-5; the new keys written, float32 sums in another order on 4 shards, too), and the
    step leaves the pool whole on every shard (`paged_cache_spec`)."""
    mesh = make_mesh(MeshConfig(1, 1, 4), jax.devices()[:4])
    policy = DTypePolicy.named("float32")
    _, k, v, table, lengths = _kernel_inputs(heads=2, h=8, g=2, dtype="float32")
    tokens = jnp.asarray([3, 5, 7], jnp.int32)
    positions = jnp.maximum(lengths - 1, 0)

    def step(sharder, impl):
        model = Transformer(CFG, policy, sharder, rngs=nnx.Rngs(0))
        graphdef, state = nnx.split(model)

        @jax.jit
        def run(state, k, v):
            view = paged.PageView(table, lengths, 8, impl)
            return nnx.merge(graphdef, state).decode(tokens, positions, (k, v), pages=view)

        return run(state, k, v)

    sharder = Sharder(mesh, ROLLOUT_RULES)
    (kernel, cache), (xla, _) = step(sharder, "kernel"), step(sharder, "xla")
    ref, ref_cache = step(Sharder(None, ROLLOUT_RULES), "xla")
    assert cache.k.sharding.is_fully_replicated
    np.testing.assert_allclose(np.asarray(kernel), np.asarray(ref), atol=1e-5)
    np.testing.assert_allclose(np.asarray(xla), np.asarray(ref), atol=1e-5)
    np.testing.assert_allclose(np.asarray(cache.k), np.asarray(ref_cache.k), atol=1e-5)
