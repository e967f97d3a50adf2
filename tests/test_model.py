"""Model invariances: cached == uncached, padding-invariance, bf16 vs fp32 mismatch; the
stacked layer layout under `nnx.scan` (one compiled block body) and its remat policies."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dvp_jax.model import (
    MIXED_TRAIN_POLICY,
    REMAT_POLICIES,
    ROLLOUT_POLICY,
    DTypePolicy,
    ModelConfig,
)
from dvp_jax.model.kv_cache import KVCache, cache_storage, to_storage
from tests import DEFAULT_CPU_CODEGEN
from tests.helpers import forward, padded_batch, tiny_model


def _abstract_model(**kwargs):
    """`tiny_model(**kwargs)` with shapes and metadata only: for programs that are lowered or
    compiled, never run."""
    return nnx.eval_shape(lambda: tiny_model(**kwargs))


@pytest.mark.parametrize("tie", [True, False])
def test_prefill_then_decode_matches_fullforward(tie):
    # fp32: prefill + N decode steps reproduce the full-forward logits at every position to
    # <= 1e-5 (only summation order differs between the two paths).
    model = tiny_model(tie_embeddings=tie)
    rng = np.random.default_rng(0)
    total, prompt_len, cache_len = 12, 5, 16
    lengths = np.array([5, 3, 1])
    tokens = jnp.asarray(rng.integers(1, 64, size=(3, total)).astype(np.int32))
    positions = jnp.broadcast_to(jnp.arange(total), (3, total))
    # [b, t, v], no padding: the continuation is real.
    full = forward(model, tokens, positions)

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
    padded = forward(model, tokens, positions, valid)
    # Right padding with different junk in the padded slots.
    junk = jnp.where(valid, tokens, 17)
    padded_junk = forward(model, junk, positions, valid)
    np.testing.assert_allclose(padded[1, :4], padded_junk[1, :4], atol=1e-6)
    # Unpadded, alone.
    alone = forward(model, tokens[1:2, :4], positions[1:2, :4])
    np.testing.assert_allclose(padded[1, :4], alone[0], atol=1e-5)
    # Left padding with explicit positions gives the same logits as the unpadded row.
    left_tokens = jnp.concatenate([jnp.full((1, 3), 9), tokens[1:2, :4]], axis=1)
    left_pos = jnp.concatenate([jnp.zeros((1, 3), jnp.int32), positions[1:2, :4]], axis=1)
    left_valid = jnp.arange(7)[None] >= 3
    left = forward(model, left_tokens, left_pos, left_valid)
    np.testing.assert_allclose(left[0, 3:], alone[0], atol=1e-5)
    assert np.isfinite(np.asarray(left)).all()


def test_return_hidden_and_unembedding_give_logits():
    model = tiny_model(tie_embeddings=False)
    tokens, positions, valid = padded_batch(np.random.default_rng(2), 64, [6, 6], 6)
    hidden = forward(model, tokens, positions, valid, return_hidden=True)
    assert hidden.shape == (2, 6, model.cfg.d_model)
    w = model.unembedding()
    assert w.shape == (model.cfg.d_model, model.cfg.vocab_size)
    np.testing.assert_allclose(hidden @ w, forward(model, tokens, positions, valid), atol=1e-5)


def test_bf16_policy_runs_and_differs_by_small_measured_amount():
    fp32 = tiny_model(seed=3)
    bf16 = tiny_model(seed=3, policy=ROLLOUT_POLICY)
    assert bf16.embed[...].dtype == jnp.bfloat16
    tokens, positions, valid = padded_batch(np.random.default_rng(3), 64, [16, 16], 16)
    z = forward(fp32, tokens, positions, valid)
    z_bf16 = forward(bf16, tokens, positions, valid)
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
    logits, cache = jax.jit(model.prefill, static_argnums=2)(tokens, jnp.array([3]), 8)
    assert cache.k.dtype == jnp.float8_e4m3fn
    logits2, cache = jax.jit(model.decode)(jnp.array([6]), jnp.array([3]), cache)
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
    assert KVCache.zeros(ModelConfig.preset("tiny"), 2, 8, jnp.bfloat16).k.shape == (2, 2, 2, 8, 8)


def test_remat_policies_give_the_same_loss_and_gradients():
    # Rematerialisation recomputes the same fp32 operations: equal up to fusion-order rounding.
    tokens, positions, valid = padded_batch(np.random.default_rng(5), 64, [8, 5], 8)

    def loss(model):
        return jnp.mean(jax.nn.log_softmax(model(tokens, positions, valid))[..., 3])

    # Every policy's loss and gradients in one program (one compile instead of one per policy);
    # each model is its own argument, so no policy's computation is shared with another's.
    value_and_grads = nnx.jit(lambda models: [nnx.value_and_grad(loss)(m) for m in models])
    models = [tiny_model(seed=5)] + [tiny_model(seed=5, remat=r) for r in REMAT_POLICIES[1:]]
    assert [m.remat for m in models[1:]] == list(REMAT_POLICIES[1:])
    assert tiny_model(seed=5, remat=True).remat == "full"  # True is "full": the same program
    (l1, g1), *others = value_and_grads(models)
    for remat, (l2, g2) in zip(REMAT_POLICIES[1:], others, strict=True):
        np.testing.assert_allclose(l1, l2, rtol=1e-6, err_msg=str(remat))
        for a, b in zip(
            jax.tree.leaves(nnx.state(g1)), jax.tree.leaves(nnx.state(g2)), strict=True
        ):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg=str(remat))
    with pytest.raises(ValueError, match="remat policy 'some'.*allowed"):
        tiny_model(remat="some")


def _count(pattern: str, text: str) -> int:
    return len(re.findall(pattern, text))


def test_layers_are_stacked_and_the_block_body_is_compiled_once():
    """Every block parameter is `[L, ...]` with logical axis "layers" first, and the train
    step's program holds one block body whatever L: the number of matmuls is the same for 2
    and 5 layers (an unrolled loop would have 5/2 times as many)."""
    tokens, positions, valid = padded_batch(np.random.default_rng(6), 64, [8, 5], 8)
    programs = {}
    for n_layers in (2, 5):
        model = _abstract_model(seed=6, n_layers=n_layers, remat="full")
        for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
            axes = var.get_metadata()["logical_axes"]
            assert len(axes) == var.get_value().ndim, path
            if path[0] == "blocks":
                assert var.get_value().shape[0] == n_layers and axes[0] == "layers", path
            else:
                assert "layers" not in axes, path
        graphdef, params = nnx.split(model)

        def loss(params, graphdef=graphdef):
            logits = nnx.merge(graphdef, params)(tokens, positions, valid)
            return jnp.mean(jax.nn.log_softmax(logits)[..., 3])

        programs[n_layers] = jax.jit(jax.value_and_grad(loss)).lower(params).as_text()
    dots = {n: _count(r"stablehlo\.dot_general", text) for n, text in programs.items()}
    assert dots[2] == dots[5] > 0, dots
    assert _count(r"stablehlo\.while", programs[5]) == _count(r"stablehlo\.while", programs[2])


# Opcodes that may produce a cache-shaped array in a decode program without a pass over it.
_IN_PLACE_OPS = ("parameter", "get-tuple-element", "bitcast", "scatter", "tuple")


def _instructions(hlo: str):
    """(name, shape, opcode, line) of each instruction of a compiled HLO text."""
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%(\S+) = [a-z0-9]+\[([0-9,]*)\]\S* ([a-z-]+)\(", line)
        if m:
            shape = tuple(int(d) for d in m.group(2).split(",") if d)
            yield m.group(1), shape, m.group(3), line.strip()[:160]


def _cache_passes(hlo: str, shape: tuple) -> list[str]:
    """Instructions of a compiled program that produce a `shape` array by a full pass over it
    (copy, convert, elementwise fusion...): everything but the in-place ops and scatter
    fusions."""
    return [
        line
        for name, dims, op, line in _instructions(hlo)
        if dims == tuple(shape)
        and op not in _IN_PLACE_OPS
        and not (op == "fusion" and "scatter" in name)
    ]


def _abstract_cache(cfg, batch: int, length: int, policy) -> KVCache:
    """The shapes and dtypes of `KVCache.zeros` in the policy's storage dtype."""
    return jax.eval_shape(
        lambda: KVCache.zeros(cfg, batch, length, cache_storage(policy.cache_dtype))
    )


@pytest.mark.parametrize("name", ["float32", "bfloat16"])
def test_decode_updates_the_cache_in_place(name):
    """The layer scan carries the whole donated cache and scatters each layer's new entry into
    it: the compiled decode step's scratch memory stays below the size of one cache array (a
    scan emitting the updated cache as stacked outputs, or a copy, would need at least that),
    and no instruction passes over a whole cache array. A bfloat16 cache is carried as its bits
    (`cache_storage`): a bf16 scatter on CPU converts the whole cache to float32 and back
    around every layer's write (before this layout: 4 such passes per layer)."""
    policy = DTypePolicy.named(name)
    model = _abstract_model(seed=7, n_layers=6, policy=policy)
    graphdef, params = nnx.split(model)
    b, cache_len = 8, 1024
    cache = _abstract_cache(model.cfg, b, cache_len, policy)
    step = jax.jit(
        lambda p, t, pos, c: nnx.merge(graphdef, p).decode(t, pos, c), donate_argnums=(3,)
    )
    zeros = jax.ShapeDtypeStruct((b,), jnp.int32)
    compiled = step.lower(params, zeros, zeros, cache).compile(DEFAULT_CPU_CODEGEN)
    scratch = compiled.memory_analysis().temp_size_in_bytes
    cache_bytes = cache.k.size * cache.k.dtype.itemsize
    assert scratch < cache_bytes, (scratch, cache_bytes)
    assert _cache_passes(compiled.as_text(), cache.k.shape) == []


def _relayouts(hlo: str, elements: int) -> list[str]:
    """Transposes and copies of a compiled program that produce an array of `elements` values
    (a pass that rewrites that many cache entries in another layout)."""
    return [
        line
        for _, dims, op, line in _instructions(hlo)
        if op in ("transpose", "copy") and dims and math.prod(dims) == elements
    ]


@pytest.mark.parametrize("name", ["float32", "bfloat16"])
def test_decode_reads_the_live_cache_in_its_stored_layout(name):
    """The cache is laid out `[L, b, k, S, h]`, the layout both attention matmuls of a decode
    step take as they are (kv heads as a batch dimension, positions then head dim): no layer
    transposes or copies its live `[b, k, kv_len, h]` keys or values. The earlier `[L, b, S, k,
    h]` layout made XLA re-lay out both per layer and step (2 extra passes over the live cache;
    on a GPU at batch 256 those passes dominate the step)."""
    policy = DTypePolicy.named(name)
    model = _abstract_model(seed=7, policy=policy)
    graphdef, params = nnx.split(model)
    b, cache_len, kv_len = 8, 1024, 256
    cache = _abstract_cache(model.cfg, b, cache_len, policy)
    step = jax.jit(
        lambda p, t, pos, c: nnx.merge(graphdef, p).decode(t, pos, c, kv_len), donate_argnums=(3,)
    )
    zeros = jax.ShapeDtypeStruct((b,), jnp.int32)
    hlo = step.lower(params, zeros, zeros, cache).compile(DEFAULT_CPU_CODEGEN).as_text()
    live = b * kv_len * model.cfg.n_kv_heads * model.cfg.head_dim
    assert _relayouts(hlo, live) == []


def test_decode_over_a_length_bucket_equals_the_whole_cache():
    """`decode(..., kv_len)` attends over the first kv_len cache positions: with every row's
    position below kv_len it gives the logits of attending over the whole cache (the masked
    tail adds exact zeros; only the softmax's summation order differs: float32 logits within
    1e-6 of O(1) values), and caches that agree to float rounding (they are two programs: the
    summation order moves a hidden state in its last bit and the next layer's keys follow,
    seen up to 4.8e-7 on one machine; 1e-5 bounds that on O(1) values). The last step writes
    position kv_len - 1, the bucket's edge."""
    policy = DTypePolicy.named("float32")
    model = tiny_model(seed=9, policy=policy)
    rng = np.random.default_rng(9)
    lengths, cache_len, kv_len = np.array([5, 2, 13]), 64, 16
    prompt = jnp.asarray(rng.integers(1, 64, size=(3, 16)).astype(np.int32))
    _, cache = jax.jit(model.prefill, static_argnums=2)(prompt, jnp.asarray(lengths), cache_len)
    cache = KVCache(*(to_storage(c, policy.cache_dtype) for c in cache))
    decode = jax.jit(model.decode, static_argnums=3)
    full, bucket = cache, cache
    pos = jnp.asarray(lengths)
    for _ in range(kv_len - lengths.max()):
        tokens = jnp.asarray(rng.integers(1, 64, size=(3,)).astype(np.int32))
        a, full = decode(tokens, pos, full, None)
        b, bucket = decode(tokens, pos, bucket, kv_len)
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
        pos = pos + 1
    for x, y in zip(full, bucket, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=1e-5)


def test_mixed_policy_keeps_fp32_params_and_is_close_to_fp32():
    fp32 = tiny_model(seed=8)
    mixed = tiny_model(seed=8, policy=MIXED_TRAIN_POLICY)
    for a, b in zip(
        jax.tree.leaves(nnx.state(fp32)), jax.tree.leaves(nnx.state(mixed)), strict=True
    ):
        assert b.dtype == jnp.float32
        np.testing.assert_array_equal(a, b)  # the same fp32 master weights
    tokens, positions, valid = padded_batch(np.random.default_rng(8), 64, [16, 9], 16)
    z, z_mixed = forward(fp32, tokens, positions, valid), forward(mixed, tokens, positions, valid)
    assert z_mixed.dtype == jnp.float32
    diff = float(jnp.abs(z - z_mixed)[valid].max())
    print(f"mixed_bf16 vs float32 tiny model: max |dz| = {diff:.3e}")
    # bf16 activations: a non-zero gap, small against the logit scale (same bound as the bf16
    # rollout test above).
    assert 0.0 < diff < 0.05 * float(jnp.abs(z).max()) + 1e-2
