"""Fake weight quantization of the rollout weights: error bounds, edge cases, the mismatch ladder.

The ladder of e004: M0 "float32", M1 "bfloat16_fp8kv", M2 "bfloat16_fp8kv_fp8w", M3
"bfloat16_fp8kv_int4w". Each rung adds a deterministic error to the rollout copy of the weights
(`dvp_jax/rollout/quantize.py`), so KL(mu || pi) against the fp32 trainer must grow along it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dvp_jax.model import PRECISIONS, TRAIN_POLICY, DTypePolicy, ModelConfig, Transformer
from dvp_jax.model.config import WEIGHT_QUANTS
from dvp_jax.rollout import quantize
from tests.helpers import forward

LADDER = ("float32", "bfloat16_fp8kv", "bfloat16_fp8kv_fp8w", "bfloat16_fp8kv_int4w")
# fp32 rounding of the product q * s and of w / s: a few ulps of the channel/group scale.
F32_SLACK = 4 * 2.0**-23


def _weights(seed=0, shape=(2, 40, 6)):
    """[L, K, O] weights over several orders of magnitude, with an all-zero output channel, a
    constant one, and (for int4) an all-zero group and a constant group."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape) * np.exp(rng.uniform(-6, 2, shape))
    w[0, :, 1] = 0.0  # zero channel (fp8) / zero groups (int4)
    w[1, :, 2] = -0.37  # constant channel / groups
    w[1, 32:, 3] = 0.0  # the short last int4 group (K = 40 = 32 + 8) all zero
    return w.astype(np.float32)


def test_fp8_channel_error_within_e4m3_rounding_per_output_channel():
    w = _weights()
    got = np.asarray(quantize.fp8_channel(jnp.asarray(w)))
    assert got.shape == w.shape and got.dtype == np.float32 and np.isfinite(got).all()
    scale = np.abs(w).max(axis=1, keepdims=True) / 448.0  # [L, 1, O]
    err = np.abs(got - w)
    # e4m3: 3 mantissa bits, half an ulp is 2^-4 relative in the normal range; below 2^-6 (in
    # units of the scale) the subnormal spacing is 2^-9, so half of it is 2^-10 s.
    bound = np.maximum(2.0**-4 * np.abs(w), 2.0**-10 * scale) + F32_SLACK * 448 * scale
    assert (err <= bound).all(), float((err - bound).max())
    # The absmax entry of every channel is represented exactly (it maps to 448); zeros stay 0.
    np.testing.assert_allclose(np.abs(got).max(axis=1), np.abs(w).max(axis=1), rtol=1e-6)
    assert (got[0, :, 1] == 0).all() and (got[w == 0] == 0).all()
    np.testing.assert_allclose(got[1, :, 2], -0.37, rtol=1e-6)
    # Not a no-op: most entries move.
    assert np.mean(err > 0) > 0.5


def test_int4_group_error_at_most_half_a_step_per_group_of_32():
    w = _weights()
    got = np.asarray(quantize.int4_group(jnp.asarray(w)))
    assert got.shape == w.shape and got.dtype == np.float32 and np.isfinite(got).all()
    for start, stop in ((0, 32), (32, 40)):  # K = 40: one full group and a short one
        g, q = w[:, start:stop], got[:, start:stop]
        scale = np.abs(g).max(axis=1, keepdims=True) / 7.0  # [L, 1, O]
        assert (np.abs(q - g) <= scale / 2 + F32_SLACK * 7 * scale).all()
        # At most 15 levels (-7 .. 7) times the group's scale.
        levels = np.divide(q, scale, out=np.zeros_like(q), where=scale > 0)
        np.testing.assert_allclose(levels, np.round(levels), atol=1e-4)
        assert np.abs(levels).max() <= 7 + 1e-4
    assert (got[0, :, 1] == 0).all() and (got[1, 32:, 3] == 0).all()  # zero scale: no NaN
    np.testing.assert_allclose(got[1, :, 2], -0.37, rtol=1e-6)  # constant groups are exact
    # Coarser than fp8: the int4 error is larger on this data.
    fp8 = np.asarray(quantize.fp8_channel(jnp.asarray(w)))
    assert np.abs(got - w).mean() > 2 * np.abs(fp8 - w).mean()


@pytest.mark.parametrize("fmt", ["fp8_channel", "int4_group32"])
def test_fake_quantization_is_idempotent(fmt):
    w = jnp.asarray(_weights(1, (3, 64, 4, 8)))
    once = quantize.fake_quantize(w, fmt, 1, jnp.float32)
    twice = quantize.fake_quantize(once, fmt, 1, jnp.float32)
    # Re-quantizing lands on the same grid points; the recomputed scale may differ from the first
    # by an fp32 ulp, hence a relative tolerance of a few ulps.
    np.testing.assert_allclose(np.asarray(twice), np.asarray(once), rtol=F32_SLACK, atol=0)
    assert not np.array_equal(np.asarray(once), np.asarray(w))


def test_contraction_axes_of_o_proj_are_heads_and_head_dim():
    # o_proj [L, n, h, d]: the int4 groups run along n * h (the contraction), so a kernel whose
    # output channel d0 is scaled by 1000 quantizes channel d0 exactly like the unscaled kernel
    # (scaled by 1000); had the groups run along d, d0's scale would swamp the other channels.
    w = jnp.asarray(_weights(2, (2, 4, 8, 5)))
    scaled = w.at[..., 0].multiply(1000.0)
    a = quantize.fake_quantize(w, "int4_group32", 2, jnp.float32)
    b = quantize.fake_quantize(scaled, "int4_group32", 2, jnp.float32)
    np.testing.assert_allclose(np.asarray(b[..., 1:]), np.asarray(a[..., 1:]), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(b[..., 0]), 1000 * np.asarray(a[..., 0]), rtol=1e-5)


@pytest.fixture(scope="module")
def trainer():
    """The fp32 tiny model, with init_std 0.1 for spread-out logits as in a trained model."""
    cfg = ModelConfig.preset("tiny", init_std=0.1)
    return cfg, Transformer(cfg, TRAIN_POLICY, rngs=nnx.Rngs(0))


def _rollout_params(cfg, policy, trainer):
    """What `RolloutEngine.update_params` builds: quantize the trainer's leaves, cast.

    Returns (graphdef, rollout params, parameter paths, the trainer's leaves by path)."""
    abstract = nnx.eval_shape(lambda: Transformer(cfg, policy, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    abstract_leaves, treedef = jax.tree.flatten(state)
    paths = [p for p, _ in nnx.to_flat_state(state)]
    src = {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(trainer, nnx.Param))}
    leaves = quantize.quantize_leaves([src[p] for p in paths], paths, policy)
    leaves = [x.astype(a.dtype) for x, a in zip(leaves, abstract_leaves, strict=True)]
    return graphdef, jax.tree.unflatten(treedef, leaves), paths, src


def test_quantize_leaves_touches_only_block_kernels_and_keeps_shapes_and_dtypes(trainer):
    cfg, trainer = trainer
    policy = DTypePolicy.named("bfloat16_fp8kv_int4w")
    _, _, paths, src = _rollout_params(cfg, policy, trainer)
    assert set(quantize.KERNEL_CONTRACTION_AXES) <= set(paths)  # the table names the model
    leaves = [src[p] for p in paths]
    out = quantize.quantize_leaves(leaves, paths, policy)
    for path, before, after in zip(paths, leaves, out, strict=True):
        if path in quantize.KERNEL_CONTRACTION_AXES:
            assert after.shape == before.shape and after.dtype == jnp.bfloat16, path
            assert not np.array_equal(np.asarray(after, np.float32), np.asarray(before)), path
        else:  # embedding, norms: untouched (the caller casts them)
            assert after is before, path
    none = quantize.quantize_leaves(leaves, paths, DTypePolicy.named("bfloat16_fp8kv"))
    assert all(a is b for a, b in zip(none, leaves, strict=True))
    with pytest.raises(ValueError, match="blocks/attn/q_proj.*KERNEL_CONTRACTION_AXES"):
        keep = [i for i, p in enumerate(paths) if p != ("blocks", "attn", "q_proj")]
        quantize.quantize_leaves([leaves[i] for i in keep], [paths[i] for i in keep], policy)
    with pytest.raises(ValueError, match="weight_quant 'int8'"):
        DTypePolicy(weight_quant="int8")


def test_ladder_policies_are_rollout_precisions():
    assert set(LADDER) <= set(PRECISIONS)
    quants = [DTypePolicy.named(n).weight_quant for n in LADDER]
    assert quants == ["none", "none", "fp8_channel", "int4_group32"]
    assert set(quants) <= set(WEIGHT_QUANTS)
    for name in LADDER[1:]:
        policy = DTypePolicy.named(name)
        assert (policy.param_dtype, policy.cache_dtype) == (jnp.bfloat16, jnp.float8_e4m3fn)


def _decode_logprobs(graphdef, params, tokens, prompt):
    """Teacher-forced rollout log-probs [b, t - prompt, v]: prefill, then one decode step per
    token, so the KV cache (and its fp8 rounding) is on the path as in a rollout."""
    model = nnx.merge(graphdef, params)
    b, t = tokens.shape
    first, cache = model.prefill(tokens[:, :prompt], jnp.full((b,), prompt), t)

    def step(cache, i):
        logits, cache = model.decode(tokens[:, i], jnp.full((b,), i), cache)
        return cache, logits

    _, rest = jax.lax.scan(step, cache, jnp.arange(prompt, t - 1))
    return jax.nn.log_softmax(jnp.concatenate([first[None], rest]).transpose(1, 0, 2))


def test_mismatch_ladder_is_ordered_on_the_tiny_model(trainer):
    cfg, trainer = trainer
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (4, 20)), jnp.int32)
    prompt, t = 4, tokens.shape[1]
    positions = jnp.broadcast_to(jnp.arange(t), tokens.shape)
    log_pi = np.asarray(jax.nn.log_softmax(forward(trainer, tokens, positions)[:, prompt - 1 : -1]))
    kl, max_diff, compiled = [], [], {}
    for name in LADDER:
        graphdef, params, _, _ = _rollout_params(cfg, DTypePolicy.named(name), trainer)
        # The weights carry the quantization; the forward of M1-M3 is one program (the model
        # never reads `weight_quant`), compiled once with the parameters as its argument.
        key = "float32" if name == "float32" else "bf16"
        if key not in compiled:
            fn = lambda params, g=graphdef: _decode_logprobs(g, params, tokens, prompt)
            compiled[key] = jax.jit(fn)
        log_mu = np.asarray(compiled[key](params))
        log_mu, lp = log_mu.astype(np.float64), log_pi.astype(np.float64)
        kl.append(float(np.mean(np.sum(np.exp(log_mu) * (log_mu - lp), axis=-1))))
        max_diff.append(float(np.abs(log_mu - lp).max()))
    # Measured (init_std 0.1): KL 1e-8 / 1.3e-4 / 1.1e-3 / 7.8e-3 and max |d log p| 1.4e-6 / 0.12 /
    # 0.20 / 0.63; each rung is required to be at least 1.5x the one below. M0 compares two float32
    # programs (decode loop vs full forward): their rounding gives a first-order KL of ~1e-8 (each
    # log-softmax is normalised only to float32), so M0's bound sits 100x under M1's.
    assert kl[0] < 1e-6 and max_diff[0] < 1e-4, (kl, max_diff)  # M0: no mismatch
    for lower, upper in zip(kl[:-1], kl[1:], strict=True):
        assert upper > 1.5 * lower, kl
    for lower, upper in zip(max_diff[:-1], max_diff[1:], strict=True):
        assert upper > 1.5 * lower, max_diff


@pytest.mark.parametrize("name", ["bfloat16_fp8kv_fp8w", "bfloat16_fp8kv_int4w"])
def test_engine_weight_sync_quantizes_the_block_kernels_without_recompiling(trainer, name):
    from dvp_jax.rollout.engine import EngineConfig, RolloutEngine

    cfg, model = trainer
    policy = DTypePolicy.named(name)
    engine = RolloutEngine(cfg, EngineConfig(dtype=name, max_decode_length=4), params=model)
    src = {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    got = {p: v.get_value() for p, v in nnx.to_flat_state(engine.load_params())}
    for path, value in got.items():
        if path in quantize.KERNEL_CONTRACTION_AXES:
            want = quantize.fake_quantize(
                src[path], policy.weight_quant, quantize.KERNEL_CONTRACTION_AXES[path], jnp.bfloat16
            )
        else:  # embedding and norms: a plain bf16 cast
            want = jnp.asarray(src[path]).astype(jnp.bfloat16)
        np.testing.assert_array_equal(np.asarray(value), np.asarray(want), err_msg=str(path))
    casts = engine.programs.cast._cache_size()
    engine.update_params(model)
    assert engine.programs.cast._cache_size() == casts  # weight sync compiles nothing new
