"""RolloutEngine, its JetStream adapter and RL rollouts (`offline.generate_rollouts`).

One tiny model (init_std 0.5, so next-token distributions are peaked and `log_rho = -3` prunes
~10% of the mass) is shared by all tests; engines are module fixtures so each compiles once.

Tolerances are stated per comparison, each a little above what was observed on CPU (jax 0.10.2,
matmul precision `highest` from conftest); float32 statistics of O(10) logits carry errors of a
few ulp (ulp(8) = 9.5e-7).
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jetstream.engine import engine_api

from dvp_jax.dvp.pruning import pruned_token_logprobs
from dvp_jax.model import TRAIN_POLICY, ModelConfig, Transformer
from dvp_jax.rollout import weights
from dvp_jax.rollout.engine import EngineConfig, Prefix, RolloutEngine
from dvp_jax.rollout.offline import RolloutBatch, generate_rollouts
from dvp_jax.rollout.scheduler import MIN_STEPS
from dvp_jax.serve.jetstream import JetStreamEngine
from dvp_jax.sharding import TRAIN_RULES, MeshConfig, Sharder, init_sharded, make_mesh
from tests import DEFAULT_CPU_CODEGEN

LOG_RHO = -3.0
CFG = ModelConfig.preset("tiny", init_std=0.5)
ENGINE = EngineConfig(
    max_concurrent_decodes=4,
    max_prefill_length=16,
    prefill_buckets=(8,),
    max_decode_length=10,
    log_rho=LOG_RHO,
)
# Three prompts over both prefill buckets (8 and 16); 1 = BOS of the char tokenizer.
PROMPTS = [[1, 4, 14, 5, 18], [1, 6, 16, 7, 18, 9, 9, 9, 9, 9, 9], [1, 3]]


@pytest.fixture(scope="module")
def master():
    """The fp32 trainer model (master weights)."""
    return Transformer(CFG, TRAIN_POLICY, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def bf16(master):
    return RolloutEngine(CFG, ENGINE, params=nnx.state(master))


def _engine_config(dtype: str) -> EngineConfig:
    """ENGINE in another precision, with one prefill bucket (fewer compiles)."""
    return EngineConfig(**{**ENGINE.__dict__, "dtype": dtype, "prefill_buckets": ()})


@pytest.fixture(scope="module")
def fp32(master):
    return RolloutEngine(CFG, _engine_config("float32"), params=nnx.state(master))


@pytest.fixture(scope="module")
def fp32_long(master):
    """fp32, 40 tokens per response and no stop token (the decode-loop tests), on the dense
    cache: its length buckets are what these tests check (paged decode: test_paged_attention)."""
    config = EngineConfig(
        **{
            **_engine_config("float32").__dict__,
            "max_decode_length": 40,
            "stop_tokens": (),
            "decode_attention": "dense",
        }
    )
    return RolloutEngine(CFG, config, params=nnx.state(master))


@pytest.fixture(scope="module")
def batch(bf16) -> RolloutBatch:
    return generate_rollouts(bf16, PROMPTS, 3, jax.random.key(1))


# G = 4 samples per prompt fill the 4 slots from one prompt at a time, so every prefill has one
# row: the engines other tests build for comparison compile one prefill and one insert.
G_REF, KEY_REF = 4, 3


@pytest.fixture(scope="module")
def reference(fp32) -> RolloutBatch:
    """fp32 rollouts (default `steps_per_sync`) that the sharded, TPU-layout and single-step
    runs are compared with, and the fp32 figure of the mismatch test."""
    return generate_rollouts(fp32, PROMPTS, G_REF, jax.random.key(KEY_REF))


@pytest.fixture(scope="module")
def trainer():
    """Trainer weights (seed 2) born sharded over the trainer's (1, 4, 2) mesh of the 8 fake
    CPU devices: the weight-sync tests' source."""
    sharder = Sharder(make_mesh(MeshConfig(1, 4, 2)), TRAIN_RULES)
    return init_sharded(lambda: Transformer(CFG, TRAIN_POLICY, sharder, rngs=nnx.Rngs(2)), sharder)


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, tokens, valid):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    return nnx.merge(graphdef, state)(tokens, positions, valid)


# The trainer's E1-E3 as one program (op-by-op dispatch compiles every op for every shape).
_pruned_token_logprobs = jax.jit(pruned_token_logprobs, static_argnums=2)


# Rows of every full forward: batches are padded to it (with copies of their first row; rows
# are independent), so each model's forward compiles once.
FORWARD_ROWS = 12


def teacher_forced(model, b: RolloutBatch, log_rho=LOG_RHO):
    """Full-forward E2-E4 stats of each batch token given its prefix: arrays [N, T-1]
    aligned with columns 1..T-1, plus the logits."""
    graphdef, state = nnx.split(model)
    n = b.num_rows
    rows = np.r_[np.arange(n), np.zeros(FORWARD_ROWS - n, int)]
    valid = jnp.asarray((b.prompt_mask | b.response_mask)[rows])
    logits = _forward(graphdef, state, jnp.asarray(b.tokens[rows]), valid)
    logits = logits[:n, :-1]
    stats = _pruned_token_logprobs(logits, jnp.asarray(b.tokens[:, 1:]), log_rho)
    return stats, np.asarray(logits)


# ----------------------------------------------------------------------------------------------
# Engine API.
# ----------------------------------------------------------------------------------------------
def test_jetstream_adapter_implements_every_abstract_method(bf16):
    served = JetStreamEngine(bf16, tokenizer_path="char")
    assert isinstance(served, engine_api.Engine)
    assert not JetStreamEngine.__abstractmethods__
    for name in engine_api.Engine.__abstractmethods__:
        assert getattr(JetStreamEngine, name) is not getattr(engine_api.Engine, name), name
    assert served.get_tokenizer().path == "char"
    assert served.build_tokenizer(served.get_tokenizer()) is bf16.tokenizer
    assert served.max_concurrent_decodes == 4 and served.max_prefill_length == 16
    assert served.samples_per_slot == 1
    assert served.colocated_cpus is None and served.mesh.size == 1
    prefix = served.prefill(
        params=served.load_params(), padded_tokens=np.array(PROMPTS[0]), true_length=5
    )
    moved = jax.device_put(prefix, served.get_prefix_destination_sharding())
    assert isinstance(moved, Prefix) and moved.cache.k.dtype == jnp.bfloat16
    assert moved.logits.shape == (1, CFG.vocab_size)  # a request is a one-row prefix
    with pytest.raises(ValueError, match="max_prefill_length"):
        served.prefill(params=served.params, padded_tokens=np.ones(17), true_length=17)
    with pytest.raises(ValueError, match="slot"):
        served.insert(prefix, served.init_decode_state(), 4)
    # Single requests run the batched programs with one row: one prefill per bucket.
    before = bf16.compile_cache_sizes()["prefill"]
    for n in range(1, 17):
        served.prefill(params=served.params, padded_tokens=np.arange(n) % 50 + 1, true_length=n)
    assert bf16.compile_cache_sizes()["prefill"] - before <= len(ENGINE.buckets) == 2
    # The n-th request without a key gets fold_in(seed key, n) (the refused one counts not).
    seed = jax.random.key(ENGINE.seed)
    expect = np.asarray(jax.random.key_data(jax.random.fold_in(seed, 17)))[None]
    nth = served.prefill(params=served.params, padded_tokens=PROMPTS[2], true_length=2)
    np.testing.assert_array_equal(nth.key, expect)


def test_behaviour_logprobs_equal_teacher_forced_bf16(bf16, batch):
    """E4 statistics recorded while sampling == full forward of the same bf16 model, with the
    trainer's reference E1-E3 (`pruned_token_logprobs`) on its logits.

    Both paths run bf16 weights and activations with float32 accumulation; decode (one cached
    query) and full forward (all queries) reduce in different orders, so a logit may differ by
    float32 rounding, and a bf16 rounding flip of a hidden state would move it by ~1e-2.
    Observed: |d logp| 4.8e-7, |d logp_full| 6.6e-7, pruned mass 3.4e-7 relative (masses up to
    0.19), safe sets identical. Bounds: 2e-6 absolute (a few ulp of O(10) logits) and 2e-6
    relative for the mass: a bf16 flip, or any second E1-E3 implementation that differs by more
    than rounding, fails them.
    """
    tf, _ = teacher_forced(bf16.model(), batch)
    mask = batch.response_mask[:, 1:]
    # Every sampled token lies in the rollout safe set.
    assert np.asarray(tf.in_safe)[mask].all()
    np.testing.assert_allclose(
        np.asarray(tf.logp)[mask], batch.behaviour_logp[:, 1:][mask], rtol=0, atol=2e-6
    )
    np.testing.assert_allclose(
        np.asarray(tf.logp_full)[mask], batch.behaviour_logp_full[:, 1:][mask], rtol=0, atol=2e-6
    )
    np.testing.assert_allclose(
        np.asarray(tf.pruned_mass)[mask],
        batch.behaviour_pruned_mass[:, 1:][mask],
        rtol=2e-6,
        atol=1e-12,
    )
    np.testing.assert_array_equal(
        np.asarray(tf.safe_size)[mask], batch.behaviour_safe_size[:, 1:][mask]
    )
    assert batch.behaviour_pruned_mass[batch.response_mask].max() > 0.01  # pruning was exercised


def test_greedy_decode_equals_full_forward_argmax(fp32, bf16, master):
    # The fp32 engine's weights are the master's, so the trainer model is its full forward.
    # G as in `reference` and `batch`: the engines' programs for those rollouts serve here too.
    for engine, model, g in ((fp32, master, G_REF), (bf16, bf16.model(), 3)):
        greedy = engine.config.sampling_params(greedy=True)
        b = generate_rollouts(engine, PROMPTS, g, jax.random.key(0), sampling=greedy)
        _, logits = teacher_forced(model, b)
        mask = b.response_mask[:, 1:]
        argmax = logits.argmax(-1)
        same = argmax[mask] == b.tokens[:, 1:][mask]
        if engine is fp32:
            assert same.all()
        else:
            # bf16: a differing argmax is only allowed on a near-tie, closer than the decode vs
            # full-forward logit difference (observed < 1e-6, see above; bound 1e-5). Observed:
            # no differing argmax, smallest top-2 gap 1.0e-2.
            top2 = np.sort(logits, -1)[..., -2:]
            assert (same | (top2[..., 1] - top2[..., 0] < 1e-5)[mask]).all()


# ----------------------------------------------------------------------------------------------
# RL rollouts.
# ----------------------------------------------------------------------------------------------
def test_rollout_batch_layout(bf16, batch):
    n, t = 9, ENGINE.max_prefill_length + ENGINE.max_decode_length
    assert (
        batch.tokens.shape
        == batch.behaviour_logp.shape
        == batch.behaviour_safe_size.shape
        == (n, t)
    )
    np.testing.assert_array_equal(batch.prompt_index, np.repeat(np.arange(3), 3))
    np.testing.assert_array_equal(batch.group_index, np.tile(np.arange(3), 3))
    assert not (batch.prompt_mask & batch.response_mask).any()
    for i in range(n):
        prompt = PROMPTS[batch.prompt_index[i]]
        np.testing.assert_array_equal(batch.tokens[i, : len(prompt)], prompt)
        r = batch.response(i)
        assert 1 <= len(r) <= ENGINE.max_decode_length
        assert batch.finished[i] == (r[-1] in bf16.stop_tokens)
        assert batch.finished[i] or len(r) == ENGINE.max_decode_length
        assert not any(tok in bf16.stop_tokens for tok in r[:-1])
    resp = batch.response_mask
    # Exact in float32 (same z_y - max z minus the log of a smaller or equal sum).
    assert (batch.behaviour_logp[resp] >= batch.behaviour_logp_full[resp]).all()
    assert (batch.behaviour_logp[resp] <= 0).all()
    assert (
        (batch.behaviour_pruned_mass[resp] >= 0) & (batch.behaviour_pruned_mass[resp] < 1)
    ).all()
    assert (
        (batch.behaviour_safe_size[resp] >= 1) & (batch.behaviour_safe_size[resp] <= CFG.vocab_size)
    ).all()
    assert (batch.behaviour_logp[~resp] == 0).all()
    assert (batch.tokens[~(resp | batch.prompt_mask)] == 0).all()


def test_one_prefill_per_prompt_and_seed_reproduces(bf16, batch, monkeypatch):
    calls = {"prefill_batch": [], "insert_batch": []}
    prompt_keys = []
    for name in calls:
        original = getattr(bf16, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            calls[_name].append(len(args[1] if _name == "prefill_batch" else args[2]))
            if _name == "prefill_batch":
                prompt_keys.extend(map(tuple, np.asarray(args[2])))
            return _original(*args, **kwargs)

        monkeypatch.setattr(bf16, name, counted)
    # 3 prompts x 4 samples over 4 slots: continuous batching refills slots as they free up;
    # every prompt is prefilled once and its samples inserted in batches.
    rng = jax.random.key(7)
    b = generate_rollouts(bf16, PROMPTS, 4, rng, first_prompt_index=5)
    assert sum(calls["prefill_batch"]) == 3 and sum(calls["insert_batch"]) == 12, calls
    assert calls["insert_batch"][0] == 4  # the first prompt's 4 samples in one call
    # Prompt p's key is fold_in(rng, first_prompt_index + p) (the slot keys fold in g).
    expect = [
        tuple(np.asarray(jax.random.key_data(jax.random.fold_in(rng, 5 + p)))) for p in range(3)
    ]
    assert prompt_keys == expect
    assert (b.response_lengths >= 1).all()
    again = generate_rollouts(bf16, PROMPTS, 3, jax.random.key(1))
    for field in RolloutBatch.__dataclass_fields__:
        np.testing.assert_array_equal(getattr(again, field), getattr(batch, field), err_msg=field)
    other = generate_rollouts(bf16, PROMPTS, 3, jax.random.key(2))
    assert not np.array_equal(other.tokens, batch.tokens)
    # The G samples of one prompt differ from each other (distinct per-sample keys).
    assert len({tuple(batch.response(i)) for i in range(3)}) > 1


def test_update_params_casts_reshards_without_recompiling(bf16, batch, master, trainer):
    before = bf16.compile_cache_sizes()
    # New trainer weights, born sharded over the trainer's (1, 4, 2) mesh (split over fsdp and
    # tensor); the one-device engine is no tensor row of it, so they are cast and copied.
    try:
        params = bf16.update_params(nnx.state(trainer))
        emb = params["embed"].get_value()
        assert emb.dtype == jnp.bfloat16 and emb.sharding.device_set == set(bf16.mesh.devices.flat)
        np.testing.assert_array_equal(
            np.asarray(emb), np.asarray(trainer.embed.get_value().astype(jnp.bfloat16))
        )
        new = generate_rollouts(bf16, PROMPTS, 3, jax.random.key(1))
        assert not np.array_equal(new.tokens, batch.tokens)
        assert bf16.compile_cache_sizes() == before
    finally:
        bf16.update_params(nnx.state(master))
    with pytest.raises(ValueError, match="update_params"):
        bf16.update_params(
            nnx.state(Transformer(ModelConfig.preset("tiny", d_ff=32), rngs=nnx.Rngs(0)))
        )


def test_weight_sync_into_a_tensor_row_of_the_trainer_mesh_stays_on_the_devices(trainer):
    """The run's rollout side (`Rollout`) on the trainer's (1, 4, 2) mesh places its engine on
    one tensor row of it (`weights.engine_mesh`, decided once) and takes the trainer's sharded
    fp32 params by one cast whose outputs are split over tensor on the trainer's mesh
    (`WeightSync.row_meshes`): the engine's arrays are the shards already on its two devices,
    each holding half of every split parameter, and equal what the copying path (cast where
    the trainer's arrays are, then `device_put`) gives, to float rounding (int4 weights: the
    group absmax is computed by another program)."""
    from dvp_jax.rollout.rollout import Rollout

    trainer_mesh = trainer.embed.get_value().sharding.mesh
    assert trainer_mesh.devices.shape == (1, 4, 2)
    config = _engine_config("bfloat16_fp8kv_int4w")  # the cast quantizes too
    # Filled from the trainer's weights by the sync (not a random init of its own).
    rollout = Rollout(CFG, config, params=trainer, trainer_mesh=trainer_mesh, tensor_parallel=2)
    engine, mesh = rollout.engine, rollout.mesh
    assert list(mesh.devices.flat) == list(trainer_mesh.devices[0, 0])
    assert rollout.engines == (engine,) and rollout.eval_engine is engine
    assert rollout.sync.row_meshes == (trainer_mesh,) and rollout.sync.paths == ("on_device",)
    params = engine.load_params()
    leaves = jax.tree.leaves(nnx.state(trainer, nnx.Param))
    # Devices that are not, in order, a row of the trainer's mesh take the copying path.
    other = make_mesh(MeshConfig(1, 1, 2), jax.devices()[1:3])
    assert weights.trainer_row_mesh(other, trainer_mesh) is None
    assert weights.WeightSync([engine], None).paths == ("via_host",)
    cast = engine.programs.cast(leaves)
    reference = [jax.device_put(x, s) for x, s in zip(cast, engine.param_shardings, strict=True)]
    for x, ref, sharding in zip(
        jax.tree.leaves(params), reference, engine.param_shardings, strict=True
    ):
        assert x.sharding == sharding and x.sharding.device_set == set(mesh.devices.flat)
        np.testing.assert_allclose(
            np.asarray(x, np.float32), np.asarray(ref, np.float32), rtol=1e-6, atol=0
        )
    q_proj = params["blocks"]["attn"]["q_proj"].get_value()  # [L, d, n, h]: n split over tensor
    assert q_proj.addressable_shards[0].data.shape[2] == CFG.n_heads // 2
    # The trainer's rollouts are the engine's, with the synced weights; close drops them.
    got = rollout.generate(PROMPTS[:2], 2, jax.random.key(5))
    want = generate_rollouts(engine, PROMPTS[:2], 2, jax.random.key(5), params=params)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    rollout.close()
    assert engine.params is None
    with pytest.raises(ValueError, match="params"):
        Rollout(CFG, config, trainer_mesh=trainer_mesh)


def _mismatch(b: RolloutBatch, master) -> dict:
    """Rollout log mu_S vs trainer log pi_S (fp32 full forward + its own pruning, E2/E5)."""
    tf, _ = teacher_forced(master, b)
    mask = b.response_mask[:, 1:]
    in_safe = np.asarray(tf.in_safe)[mask]
    diff = np.abs(np.asarray(tf.logp)[mask] - b.behaviour_logp[:, 1:][mask])[in_safe]
    return dict(
        mean_abs=float(diff.mean()),
        max_abs=float(diff.max()),
        outside_trainer_safe=float(1 - in_safe.mean()),
        tokens=int(mask.sum()),
    )


def test_fp32_rollout_matches_trainer_and_bf16_mismatch_is_measured(bf16, batch, master, reference):
    # G_REF samples per prompt (as `reference`): the fp8 engine compiles one-row prefills only.
    key = jax.random.key(KEY_REF)
    fp8 = RolloutEngine(CFG, _engine_config("bfloat16_fp8kv"), params=nnx.state(master))
    noisy = bf16.config.sampling_params(noise_std=0.3)
    figures = {
        "float32": _mismatch(reference, master),
        "bfloat16": _mismatch(batch, master),
        "bfloat16_fp8kv": _mismatch(generate_rollouts(fp8, PROMPTS, G_REF, key), master),
        "bfloat16+noise0.3": _mismatch(
            generate_rollouts(bf16, PROMPTS, G_REF, key, sampling=noisy), master
        ),
    }
    print("\nrollout vs trainer |log mu_S - log pi_S| (tokens in both safe sets):")
    for name, f in figures.items():
        print(f"  {name:18s} " + " ".join(f"{k}={v:.3g}" for k, v in f.items()))
    # fp32: the split is off; decode vs full forward differ only in fp32 op order through the
    # whole model (observed max 4.3e-6; bound 1e-5).
    assert figures["float32"]["max_abs"] < 1e-5 and figures["float32"]["outside_trainer_safe"] == 0
    # bf16: a real, measured mismatch, well above fp32 round-off.
    assert figures["bfloat16"]["mean_abs"] > 1e-3
    for name in ("bfloat16_fp8kv", "bfloat16+noise0.3"):
        assert figures[name]["mean_abs"] > figures["float32"]["max_abs"]
        assert math.isfinite(figures[name]["mean_abs"])


def test_steps_per_sync_gives_the_same_rollouts(fp32, reference):
    """Sized dispatches (the default, `scheduler.py`: at least 8 steps, one compiled loop whose
    step count is traced, ending early when a slot finishes while prompts wait) == single
    steps: same tokens and statistics. The loop is compiled separately, so fusion may round
    differently: float32 statistics within 1e-6 (about one ulp of O(1) log-probs); observed
    bit-identical. 12 rows over 4 slots refill slots mid-run. (k = 2 dispatches run in the
    length-bucket test.)"""
    assert MIN_STEPS == 8
    a = generate_rollouts(fp32, PROMPTS, G_REF, jax.random.key(KEY_REF), steps_per_sync=1)
    b = reference
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.response_mask, b.response_mask)
    np.testing.assert_array_equal(a.behaviour_safe_size, b.behaviour_safe_size)
    for field in ("behaviour_logp", "behaviour_logp_full", "behaviour_pruned_mass"):
        np.testing.assert_allclose(
            getattr(a, field), getattr(b, field), rtol=0, atol=1e-6, err_msg=field
        )


def test_sharded_engine_equals_single_device(fp32, master, reference):
    """(data 2, tensor 2) rollout mesh: params split over `tensor`, KV cache over slots and KV
    heads; same tokens and fp32 statistics as the one-device engine. Tensor-parallel matmuls
    sum partial products in another order: observed |d logp| 3.3e-6, |d logp_full| 2.9e-6,
    |d mass| 2.2e-7 (2e-6 relative); bounds 1e-5 and 1e-5 relative."""
    mesh = make_mesh(MeshConfig(2, 1, 2), jax.devices()[:4])
    sharded = RolloutEngine(CFG, fp32.config, params=nnx.state(master), mesh=mesh)
    q_proj = sharded.params["blocks"]["attn"]["q_proj"].get_value()  # [L, d, n, h]
    assert q_proj.sharding.spec[2] == "tensor"
    a = reference
    b = generate_rollouts(sharded, PROMPTS, G_REF, jax.random.key(KEY_REF))
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.behaviour_safe_size, b.behaviour_safe_size)
    np.testing.assert_allclose(a.behaviour_logp, b.behaviour_logp, rtol=0, atol=1e-5)
    np.testing.assert_allclose(a.behaviour_logp_full, b.behaviour_logp_full, rtol=0, atol=1e-5)
    np.testing.assert_allclose(
        a.behaviour_pruned_mass, b.behaviour_pruned_mass, rtol=1e-5, atol=1e-12
    )


def test_the_tpu_cache_layout_gives_the_same_rollouts(fp32, master, reference, monkeypatch):
    """TPU programs keep the KV cache positions first, `[L, b, S, k, h]`
    (`kv_cache.cache_layout`). Forced on CPU, an engine in that layout (prefill, insert, the
    decode loop over length buckets, the whole-cache `generate`) samples the same tokens as
    the heads-first engine, with the same statistics to float rounding (the attention reads
    its operands in another layout, so XLA may sum in another order; bound 1e-5)."""
    import dvp_jax.model.transformer
    import dvp_jax.rollout.engine
    from dvp_jax.model import attention

    a = reference  # traced heads first, before the patch
    for module in (attention, dvp_jax.model.transformer, dvp_jax.rollout.engine):
        monkeypatch.setattr(module, "cache_layout", lambda platform: "positions_first")
    s = fp32.config.cache_length
    # The dense cache in that layout, and the paged cache filled from prefixes in that layout.
    for mode in ("paged", "dense"):
        config = dataclasses.replace(fp32.config, decode_attention=mode)
        tpu = RolloutEngine(CFG, config, params=nnx.state(master))
        assert tpu.cache_layout == "positions_first"
        state = tpu.init_decode_state()
        if mode == "dense":
            assert state.cache.k.shape == (CFG.n_layers, 4, s, CFG.n_kv_heads, CFG.head_dim)
        b = generate_rollouts(tpu, PROMPTS, G_REF, jax.random.key(KEY_REF))
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.behaviour_logp, b.behaviour_logp, rtol=0, atol=1e-5)
        np.testing.assert_allclose(a.behaviour_logp_full, b.behaviour_logp_full, rtol=0, atol=1e-5)
    # JetStream's one-request path in the same layout.
    served = JetStreamEngine(tpu)
    prefix = served.prefill(params=tpu.params, padded_tokens=PROMPTS[0], true_length=5)
    state = served.insert(prefix, state, 1)
    state, result = served.generate(tpu.params, state)
    assert int(result.data[1, 1]) == 1  # slot 1 produced a valid token


# ----------------------------------------------------------------------------------------------
# Batched prefill and insert, length-bucketed decode, in-place cache, bad input.
# ----------------------------------------------------------------------------------------------
def _raw_keys(seed: int, n: int) -> np.ndarray:
    key = jax.random.key(seed)
    return np.stack([np.asarray(jax.random.key_data(jax.random.fold_in(key, i))) for i in range(n)])


def test_batched_prefill_and_insert_equal_per_prompt(fp32):
    """`prefill_batch` + `insert_batch` (one call each) put into the slots what per-prompt
    `prefill` + `insert` put: the same keys (fold_in(prompt key, sample index)), positions and
    flags exactly, and the same next-token logits and prompt KV up to float32 rounding (the
    batch pads the short prompts to the longest prompt's bucket, so padding and matmul shapes
    differ: observed |d| <= 1e-6, bound 1e-5); the next generated tokens are identical. The
    second part inserts one prompt's G = 4 samples into 4 slots in one call."""
    keys = _raw_keys(3, len(PROMPTS))
    params, served = fp32.params, JetStreamEngine(fp32)
    single = fp32.init_decode_state()
    for i, prompt in enumerate(PROMPTS):
        prefix = served.prefill(
            params=params, padded_tokens=prompt, true_length=len(prompt), rng=keys[i]
        )
        single = served.insert(prefix, single, slot=3 - i, sample_index=i)
    batch = fp32.prefill_batch(params, PROMPTS, keys)
    assert batch.cache.k.shape[1] == 4  # 3 prompts padded to the row bucket 4
    batched = fp32.insert_batch(batch, fp32.init_decode_state(), [3, 2, 1], [0, 1, 2], [0, 1, 2])
    for field in ("key", "pos", "step", "done"):
        np.testing.assert_array_equal(getattr(single, field), getattr(batched, field), field)
    np.testing.assert_allclose(single.logits, batched.logits, rtol=0, atol=1e-5)
    for a, b in zip(_slot_cache(single), _slot_cache(batched), strict=True):
        for i, prompt in enumerate(PROMPTS):
            live = np.s_[:, 3 - i, :, : len(prompt)]  # [L, slot, k, S, h]
            np.testing.assert_allclose(np.asarray(a)[live], np.asarray(b)[live], atol=1e-5)
    single, _ = served.generate(params, single)
    batched, _ = served.generate(params, batched)
    np.testing.assert_array_equal(single.tokens, batched.tokens)

    # One prompt's 4 samples into 4 slots in one call == 4 single inserts.
    prefix = served.prefill(params=params, padded_tokens=PROMPTS[1], true_length=11, rng=keys[1])
    single = fp32.init_decode_state()
    for g in range(4):
        single = served.insert(prefix, single, slot=g, sample_index=g)
    group = fp32.insert_batch(batch, fp32.init_decode_state(), [0, 1, 2, 3], [1] * 4, range(4))
    np.testing.assert_array_equal(single.key, group.key)
    assert len({tuple(k) for k in np.asarray(group.key)}) == 4


def _slot_cache(state):
    """The cache as `[L, B, k, S, h]` slot rows: the dense cache, or each slot's pages in order
    (a page it lacks reads page 0)."""
    if state.pages is None:
        return state.cache
    table = np.maximum(np.asarray(state.pages.table), 0)  # [B, C]
    rows = []
    for pages in state.cache:  # [L, P, ps, k h] -> [L, B, C, ps, k, h] -> [L, B, k, C ps, h]
        got = np.asarray(pages)[:, table]
        k, h = CFG.n_kv_heads, CFG.head_dim
        got = got.reshape(got.shape[:4] + (k, h))
        n, b, c, ps = got.shape[:4]
        rows.append(got.transpose(0, 1, 4, 2, 3, 5).reshape(n, b, k, c * ps, h))
    return rows


def test_length_buckets_equal_the_whole_cache_and_the_decode_loop_stops_where_a_slot_finishes(
    fp32_long,
):
    """Two checks on the fp32 40-token engine, in this order: the first compiles the 2-step
    loops the second reuses (one compile per loop, and a count the first asserts).

    Length buckets: rollouts whose decode attends over length buckets (`kv_buckets`, chosen on
    the host per dispatch) equal rollouts attending over the whole cache: the same tokens,
    log-probs within 1e-5 (float32; only the attention softmax's summation order differs, and
    its few-ulp differences in O(10) logits carry through 40 decode steps; observed <= 2.9e-6
    over 60). One compiled decode loop per bucket reached (2 of `kv_buckets` (32, 56)), and a
    second batch (new key, weights unchanged) compiles nothing.

    Where the loop stops: `generate_steps(..., stop_at_finish=True)` ends the dispatch after
    the step in which a slot finishes (here slot 0 reaches max_decode_length M two steps
    before slot 1), so the host can refill it at once; without the flag the loop runs on until
    every slot is done. Either way the loop never runs past `num_steps`, and stops once every
    slot is done."""
    engine, config = fp32_long, fp32_long.config
    # Length buckets.
    assert config.kv_buckets == (32, 56)
    key = jax.random.key(11)
    loops = engine.compile_cache_sizes()["loop"]
    bucketed = generate_rollouts(engine, PROMPTS, 1, key, steps_per_sync=2)
    sizes = engine.compile_cache_sizes()
    assert sizes["loop"] - loops == len(config.kv_buckets), sizes
    generate_rollouts(engine, PROMPTS, 1, jax.random.key(12), steps_per_sync=2)
    assert engine.compile_cache_sizes() == sizes
    with pytest.MonkeyPatch.context() as m:  # every dispatch over the whole cache
        m.setattr(engine, "kv_bucket", lambda length: config.cache_length)
        whole = generate_rollouts(engine, PROMPTS, 1, key, steps_per_sync=2)
    np.testing.assert_array_equal(bucketed.tokens, whole.tokens)
    for field in ("behaviour_logp", "behaviour_logp_full", "behaviour_pruned_mass"):
        np.testing.assert_allclose(
            getattr(bucketed, field), getattr(whole, field), rtol=0, atol=1e-5, err_msg=field
        )

    # Where the loop stops (its 2-step dispatches attend over the whole cache, as above).
    m = config.max_decode_length
    keys = _raw_keys(4, len(PROMPTS))

    def two_slots():
        # All prompts prefilled (the rollouts' prefill and insert programs), two inserted.
        prefix = engine.prefill_batch(engine.params, PROMPTS, keys)
        state = engine.insert_batch(prefix, engine.init_decode_state(), [0], [0], [0])
        state = engine.generate_steps(engine.params, state, 2)
        return engine.insert_batch(prefix, state, [1], [1], [0])

    stopped = engine.generate_steps(engine.params, two_slots(), 2 * m, stop_at_finish=True)
    np.testing.assert_array_equal(stopped.step[:2], [m, m - 2])
    np.testing.assert_array_equal(stopped.done[:2], [True, False])
    ran_on = engine.generate_steps(engine.params, two_slots(), 2 * m)
    np.testing.assert_array_equal(ran_on.step[:2], [m, m])
    assert bool(ran_on.done.all())
    capped = engine.generate_steps(engine.params, two_slots(), 2, stop_at_finish=True)
    np.testing.assert_array_equal(capped.step[:2], [4, 2])
    # The two-step dispatches sampled what the single long ones did.
    np.testing.assert_array_equal(
        np.asarray(capped.tokens)[1, :2], np.asarray(ran_on.tokens)[1, :2]
    )


def test_resuming_sequences_of_two_length_buckets_in_one_call_equals_never_stopping(fp32_long):
    """`resume_batch` prefills each kv bucket's sequences apart (a short one is not padded to a
    long one's length): two slots stopped at 3 and 23 tokens (prompt + prefix 8 and 34
    positions: buckets 32 and 56) and resumed in one call go on to the tokens of a decode that
    never stopped (float32, same keys)."""
    engine = fp32_long
    keys = _raw_keys(5, 2)
    prefix = engine.prefill_batch(engine.params, PROMPTS[:2], keys)

    def placed():
        return engine.insert_batch(prefix, engine.init_decode_state(), [0, 1], [0, 1], [0, 0])

    m = engine.config.max_decode_length
    never = engine.generate_steps(engine.params, placed(), m)
    state = engine.generate_steps(engine.params, placed(), 3)
    state = engine.evict(state, [0])
    state = engine.generate_steps(engine.params, state, 20)
    state = engine.evict(state, [1])
    steps = [int(x) for x in np.asarray(state.step)[:2]]
    assert steps == [3, 23]
    tokens = np.asarray(state.tokens)
    sequences = [np.concatenate([PROMPTS[i], tokens[i, : steps[i]]]) for i in range(2)]
    widths = []
    prefill = engine.programs.prefill
    with pytest.MonkeyPatch.context() as mp:  # the prefill calls' padded lengths
        spy = lambda p, t, *a: widths.append(t.shape[1]) or prefill(p, t, *a)
        mp.setattr(engine, "programs", dataclasses.replace(engine.programs, prefill=spy))
        state = engine.resume_batch(engine.params, state, [0, 1], sequences, steps)
    assert widths == [32, 56]
    state = engine.generate_steps(engine.params, state, m)
    np.testing.assert_array_equal(np.asarray(state.step)[:2], [m, m])
    np.testing.assert_array_equal(np.asarray(state.tokens)[:2], np.asarray(never.tokens)[:2])


def test_the_decode_loop_updates_the_cache_in_place(bf16):
    """The compiled k-step decode loop of the bf16 engine never passes over a whole cache
    array (no copy, no float32 convert of the bf16 cache around a scatter; the state carries
    the cache's bits): only parameters, loop plumbing and in-place scatters have its shape.
    The loop is the one rollouts run (k = `MIN_STEPS`, the whole cache, the flag as
    `generate_steps` passes it), compiled as a user's process compiles it
    (`DEFAULT_CPU_CODEGEN`)."""
    from tests.test_model import _cache_passes

    state = bf16.init_decode_state()
    assert state.cache.k.dtype == jnp.uint16
    flag = np.bool_(True)
    steps = np.int32(MIN_STEPS)
    hlo = bf16.programs.loop.lower(bf16.params, state, steps, ENGINE.cache_length, flag)
    hlo = hlo.compile(DEFAULT_CPU_CODEGEN).as_text()
    assert _cache_passes(hlo, state.cache.k.shape) == []


def test_bad_input_gets_clear_errors_and_the_engine_keeps_working(bf16):
    params, state = bf16.params, bf16.init_decode_state()
    keys = _raw_keys(0, 5)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        bf16.prefill_batch(params, [[1, 2], []], keys[:2])
    with pytest.raises(ValueError, match="max_prefill_length=16"):
        bf16.prefill_batch(params, [[1] * 17], keys[:1])
    with pytest.raises(ValueError, match="max_concurrent_decodes=4"):
        bf16.prefill_batch(params, [[1]] * 5, keys)
    with pytest.raises(ValueError, match=r"prompt 0 has token ids outside \[0, 64\)"):
        bf16.prefill_batch(params, [[1, 64]], keys[:1])
    with pytest.raises(ValueError, match=r"keys must have shape \(2, 2\)"):
        bf16.prefill_batch(params, [[1], [2]], keys[:1])
    prefix = bf16.prefill_batch(params, [[1, 2]], keys[:1])
    with pytest.raises(ValueError, match="max_concurrent_decodes=4 slots"):
        bf16.insert_batch(prefix, state, range(5), [0] * 5, range(5))
    with pytest.raises(ValueError, match="distinct"):
        bf16.insert_batch(prefix, state, [0, 0], [0, 0], [0, 1])
    with pytest.raises(ValueError, match="outside the prefix"):
        bf16.insert_batch(prefix, state, [0], [7], [0])
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        generate_rollouts(bf16, [[]], 1, jax.random.key(0))
    with pytest.raises(ValueError, match="max_prefill_length=16"):
        generate_rollouts(bf16, [[1] * 17], 1, jax.random.key(0))
    # G larger than the slots is not an error for generate_rollouts: the prompt's samples
    # span several refills (6 samples over 4 slots), each its own sample key.
    b = generate_rollouts(bf16, [PROMPTS[2]], 6, jax.random.key(4))
    assert b.num_rows == 6 and (b.response_lengths >= 1).all()
    assert len({tuple(b.response(i)) for i in range(6)}) > 1


def test_logit_noise_is_shared_by_a_prompts_samples_and_fixed_across_calls(bf16):
    """noise_std is a deterministic function of the context: the G samples of a prompt start
    from one noisy distribution (every row that drew the same first token records the same
    log mu), and another rollout key meets the same noise there. Fresh per-sample noise would
    give each row its own value."""
    noisy = bf16.config.sampling_params(noise_std=3.0)
    prompt = [PROMPTS[0]]
    runs = [
        generate_rollouts(bf16, prompt, 8, jax.random.key(seed), sampling=noisy) for seed in (3, 4)
    ]
    first = {}
    for b in runs:
        col = b.prompt_lengths[0]
        for i in range(b.num_rows):
            first.setdefault(int(b.tokens[i, col]), set()).add(float(b.behaviour_logp_full[i, col]))
    assert sum(len(v) for v in first.values()) == len(first)  # one log mu per first token
    assert sum(1 for b in runs for _ in range(b.num_rows)) > len(first)  # repeats were checked
    clean = generate_rollouts(bf16, prompt, 8, jax.random.key(3))
    col = clean.prompt_lengths[0]
    y = int(clean.tokens[0, col])
    if y in first:  # the noise really moved the distribution
        assert float(clean.behaviour_logp_full[0, col]) not in first[y]


def test_engine_config_has_one_builder_and_errors_name_its_fields():
    """A run's `rollout` section holds `EngineConfig` fields with the engine's defaults and
    its one validation (`EngineConfig.check_fields`), naming where the value was given;
    `build.engine_config` is the one place it becomes the engine's config, with the prompt
    length, the loss's min-p rule and the seed. The temperature and min-p rules are
    `pruning.check_temperature` / `check_log_rho` wherever the value is given."""
    import dataclasses

    from dvp_jax.dvp.losses import LossConfig
    from dvp_jax.train.build import engine_config
    from dvp_jax.train.config import ExperimentConfig, default_config
    from dvp_jax.train.sections import RolloutConfig

    c = default_config("dvp")
    c.rollout.temperature, c.rollout.max_concurrent_decodes, c.train.seed = 0.7, 6, 3
    cfg = ExperimentConfig.from_config_dict(c, CFG.vocab_size)
    got = engine_config(cfg, "float32")
    assert (got.dtype, got.temperature, got.max_concurrent_decodes) == ("float32", 0.7, 6)
    assert (got.seed, got.log_rho, got.max_prefill_length) == (
        3,
        cfg.loss.effective_log_rho,
        cfg.data.max_prompt_len,
    )
    assert got.max_decode_length == cfg.rollout.max_decode_length
    assert engine_config(cfg).dtype == cfg.rollout.dtype
    # One default per field: the section's unset fields are the engine's defaults.
    own = (
        "tensor_parallel",
        "partial",
        "oversample",
        "max_staleness",
    )  # the run's, not the engine's
    shared = [f.name for f in dataclasses.fields(RolloutConfig) if f.name not in own]
    assert shared and all(
        getattr(RolloutConfig(), n) == getattr(EngineConfig(), n) for n in shared
    ), shared
    # One validation per field, naming where the value was given.
    bad = dict(
        temperature=0.0,
        noise_std=-1.0,
        max_decode_length=0,
        max_concurrent_decodes=1.5,
        decode_attention="flash",
        page_size=0,
        kv_pages=0,
    )
    for name, value in bad.items():
        with pytest.raises(ValueError, match=rf"^config\.rollout\.{name} must be"):
            RolloutConfig(**{name: value})
        with pytest.raises(ValueError, match=rf"^EngineConfig\.{name} must be"):
            EngineConfig(**{name: value})
    with pytest.raises(ValueError, match=r"config\.rollout\.temperature must be a finite number"):
        ExperimentConfig.from_config_dict(
            default_config("dvp", rollout=dict(temperature=float("inf"))), CFG.vocab_size
        )
    # The pool rule needs the cache length: checked where it is known, by the engine's rule.
    with pytest.raises(
        ValueError, match=r"^config\.rollout\.kv_pages must be None or an int >= 40"
    ):
        ExperimentConfig.from_config_dict(
            default_config("dvp", rollout=dict(kv_pages=39, page_size=2)), CFG.vocab_size
        )
    for make, where in [
        (lambda t: LossConfig(temperature=t), "LossConfig"),
        (lambda t: ENGINE.sampling_params(temperature=t), "SamplingParams"),
    ]:
        with pytest.raises(ValueError, match=rf"^{where}\.temperature must be a finite number"):
            make(-1.0)
    with pytest.raises(ValueError, match=r"EngineConfig\.log_rho"):
        EngineConfig(log_rho=0.5)
    with pytest.raises(ValueError, match=r"SamplingParams\.log_rho"):
        ENGINE.sampling_params(log_rho=0.5)
