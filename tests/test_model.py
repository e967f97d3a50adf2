"""Model invariances: cached == uncached, padding-invariance, bf16 vs fp32 mismatch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dvp_jax.model import ROLLOUT_POLICY, DTypePolicy, ModelConfig
from dvp_jax.model.attention import KVCache
from tests.helpers import padded_batch, tiny_model


@pytest.mark.parametrize("tie", [True, False])
def test_prefill_then_decode_matches_full_forward(tie):
    # fp32: prefill + N decode steps reproduce the full-forward logits at every position to
    # <= 1e-5 (only summation order differs between the two paths).
    model = tiny_model(tie_embeddings=tie)
    rng = np.random.default_rng(0)
    total, prompt_len, cache_len = 12, 5, 16
    lengths = np.array([5, 3, 1])
    tokens = jnp.asarray(rng.integers(1, 64, size=(3, total)).astype(np.int32))
    positions = jnp.broadcast_to(jnp.arange(total), (3, total))
    full = model(tokens, positions)  # [b, t, v], no padding: the continuation is real.

    prompt = jnp.where(jnp.arange(prompt_len)[None] < lengths[:, None], tokens[:, :prompt_len], 0)
    logits, cache = jax.jit(model.prefill, static_argnums=2)(
        prompt, jnp.asarray(lengths), cache_len
    )
    np.testing.assert_allclose(logits, full[np.arange(3), lengths - 1], atol=1e-5)
    decode = jax.jit(model.decode)
    pos = jnp.asarray(lengths)
    for _ in range(total - lengths.max()):
        logits, cache = decode(tokens[np.arange(3), pos], pos, cache)
        np.testing.assert_allclose(logits, full[np.arange(3), pos], atol=1e-5)
        pos = pos + 1


def test_padding_never_changes_real_logits():
    model = tiny_model()
    rng = np.random.default_rng(1)
    tokens, positions, valid = padded_batch(rng, 64, [7, 4], 7)
    padded = model(tokens, positions, valid)
    # Right padding with different junk in the padded slots.
    junk = jnp.where(valid, tokens, 17)
    padded_junk = model(junk, positions, valid)
    np.testing.assert_allclose(padded[1, :4], padded_junk[1, :4], atol=1e-6)
    # Unpadded, alone.
    alone = model(tokens[1:2, :4], positions[1:2, :4])
    np.testing.assert_allclose(padded[1, :4], alone[0], atol=1e-5)
    # Left padding with explicit positions gives the same logits as the unpadded row.
    left_tokens = jnp.concatenate([jnp.full((1, 3), 9), tokens[1:2, :4]], axis=1)
    left_pos = jnp.concatenate([jnp.zeros((1, 3), jnp.int32), positions[1:2, :4]], axis=1)
    left_valid = jnp.arange(7)[None] >= 3
    left = model(left_tokens, left_pos, left_valid)
    np.testing.assert_allclose(left[0, 3:], alone[0], atol=1e-5)
    assert np.isfinite(np.asarray(left)).all()


def test_return_hidden_and_unembedding_give_logits():
    model = tiny_model(tie_embeddings=False)
    tokens, positions, valid = padded_batch(np.random.default_rng(2), 64, [6, 6], 6)
    hidden = model(tokens, positions, valid, return_hidden=True)
    assert hidden.shape == (2, 6, model.cfg.d_model)
    w = model.unembedding()
    assert w.shape == (model.cfg.d_model, model.cfg.vocab_size)
    np.testing.assert_allclose(hidden @ w, model(tokens, positions, valid), atol=1e-5)


def test_bf16_policy_runs_and_differs_by_small_measured_amount():
    fp32 = tiny_model(seed=3)
    bf16 = tiny_model(seed=3, policy=ROLLOUT_POLICY)
    assert bf16.embed[...].dtype == jnp.bfloat16
    tokens, positions, valid = padded_batch(np.random.default_rng(3), 64, [16, 16], 16)
    z = fp32(tokens, positions, valid)
    z_bf16 = bf16(tokens, positions, valid)
    assert z_bf16.dtype == jnp.float32  # logits are upcast
    diff = float(jnp.abs(z - z_bf16).max())
    dlogp = float(jnp.abs(jax.nn.log_softmax(z) - jax.nn.log_softmax(z_bf16)).max())
    print(f"bf16 vs fp32 tiny model: max |dz| = {diff:.3e}, max |dlogp| = {dlogp:.3e}")
    # The parameters are the same values rounded to bf16, so the gap is non-zero but small
    # relative to the logit scale.
    assert 0.0 < diff < 0.05 * float(jnp.abs(z).max()) + 1e-2


def test_fp8_kv_cache_policy_decodes():
    cfg_policy = DTypePolicy.named("bfloat16_fp8kv")
    model = tiny_model(seed=4, policy=cfg_policy)
    tokens = jnp.array([[3, 4, 5, 0]], jnp.int32)
    logits, cache = model.prefill(tokens, jnp.array([3]), 8)
    assert cache.k.dtype == jnp.float8_e4m3fn
    logits2, cache = model.decode(jnp.array([6]), jnp.array([3]), cache)
    assert np.isfinite(np.asarray(logits2)).all()


def test_config_validation_and_presets():
    with pytest.raises(ValueError, match="n_kv_heads"):
        ModelConfig(
            vocab_size=8, d_model=8, n_layers=1, n_heads=3, n_kv_heads=2, head_dim=4, d_ff=8
        )
    with pytest.raises(ValueError, match="unknown model preset"):
        ModelConfig.preset("qwen9")
    with pytest.raises(ValueError, match="dtype policy"):
        DTypePolicy.named("int4")
    assert KVCache.zeros(ModelConfig.preset("tiny"), 2, 8, jnp.bfloat16).k.shape == (2, 2, 8, 2, 8)


def test_remat_gives_the_same_loss_and_gradients():
    from flax import nnx

    plain = tiny_model(seed=5)
    remat = tiny_model(seed=5, remat=True)
    tokens, positions, valid = padded_batch(np.random.default_rng(5), 64, [8, 5], 8)

    def loss(model):
        return jnp.mean(jax.nn.log_softmax(model(tokens, positions, valid))[..., 3])

    l1, g1 = nnx.value_and_grad(loss)(plain)
    l2, g2 = nnx.value_and_grad(loss)(remat)
    np.testing.assert_allclose(l1, l2, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(nnx.state(g1)), jax.tree.leaves(nnx.state(g2)), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
