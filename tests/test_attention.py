"""Attention kernels against the explicit einsum softmax.

The explicit path ("xla") is the reference. On CPU "dot_product" (`jax.nn.dot_product_attention`
on XLA) runs as it does anywhere; the cuDNN branch's mask semantics (causal + key lengths) run
through the same `jax.nn.dot_product_attention` contract computed by XLA; the splash kernel runs
in the Pallas interpreter. The selection logic is checked per backend name.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dvp_jax.model import TRAIN_POLICY, DTypePolicy, Transformer, attention, blockwise, kernels
from dvp_jax.model.attention import full_attention, select_attention_impl
from dvp_jax.model.config import ATTENTION_IMPLS, POLICY_NAMES
from tests import DEFAULT_CPU_CODEGEN
from tests.helpers import tiny_config

B16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32


def _qkv(t: int, dtype, b: int = 4, n: int = 4, kv: int = 2, h: int = 8, seed: int = 0):
    """Random GQA queries [b, t, n, h] and keys / values [b, t, kv, h] (2 query heads per KV)."""
    rng = np.random.default_rng(seed)
    q, k, v = (rng.normal(size=(b, t, m, h)) for m in (n, kv, kv))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def _valid(t: int, kinds) -> jax.Array:
    """[len(kinds), t] bool rows: ("right", L) the prefix [0, L); ("left", P) all but the first
    P tokens (left padding: queries 0..P-1 see no key); ("none",) an all-padding row."""
    ar = np.arange(t)
    rows = {"right": lambda n: ar < n, "left": lambda n: ar >= n, "none": lambda: ar < 0}
    return jnp.asarray(np.stack([rows[kind](*args) for kind, *args in kinds]))


def _attend(impl: str, name: str = "float32"):
    """full_attention under the named policy with `impl`, as a function of (q, k, v, valid)."""
    policy = DTypePolicy.named(name, attention_impl=impl)
    return jax.jit(lambda q, k, v, valid: full_attention(q, k, v, valid, policy))


def _forward_and_grads(fn, q, k, v, valid, cotangent):
    """(fn(q, k, v, valid), d/d(q, k, v) of sum(fn(q, k, v) * cotangent)), one program."""

    def loss(q, k, v):
        out = fn(q, k, v, valid)
        return jnp.sum(out.astype(F32) * cotangent), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return out, grads


def _on_valid_queries(fn, q, k, v, valid, seed: int = 1):
    """`_forward_and_grads` of a random loss read on valid queries only (as the trainer's loss
    is); `valid` is bool, or segment ids (0 padding)."""
    cotangent = jnp.asarray(np.random.default_rng(seed).normal(size=q.shape), F32)
    real = (jnp.asarray(valid) != 0)[:, :, None, None]
    return _forward_and_grads(fn, q, k, v, valid, cotangent * real)


def _assert_grads_match(ga_all, gb_all, name: str):
    """`gb_all` equal `ga_all` to 1e-5 of their largest magnitude."""
    for ga, gb in zip(ga_all, gb_all, strict=True):
        print(f"{name} grad max diff = {_max_diff(ga, gb):.3e}")
        np.testing.assert_allclose(ga, gb, atol=1e-5 * float(jnp.abs(ga).max()), rtol=0)


def _max_diff(a, b, where=None) -> float:
    d = jnp.abs(jnp.asarray(a, F32) - jnp.asarray(b, F32))
    return float(d[where].max() if where is not None else d.max())


# ---------------------------------------------------------------------------------------------
# Selection
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "backend, dtype, t, h, expected",
    [
        ("cpu", F32, 256, 128, "xla"),
        ("cpu", B16, 256, 128, "xla"),
        ("gpu", B16, 100, 8, "cudnn"),
        ("cuda", F16, 256, 128, "cudnn"),
        ("gpu", F32, 256, 128, "xla"),  # the fp32 trainer stays on the explicit path
        ("tpu", B16, 256, 128, "splash"),
        ("tpu", B16, 100, 128, "xla"),  # T not a multiple of the kernel's 128 block
        ("tpu", B16, 256, 64, "xla"),
        ("tpu", F32, 256, 128, "xla"),
        # From 2,048 tokens, where no fused kernel serves the policy: blockwise (no T x T).
        ("cpu", F32, 2048, 128, "blockwise"),
        ("cpu", B16, 18_432, 128, "blockwise"),
        ("gpu", F32, 16_384, 128, "blockwise"),
        ("tpu", F32, 18_432, 128, "blockwise"),
        ("tpu", B16, 18_432, 128, "splash"),
        ("gpu", B16, 16_384, 128, "cudnn"),
        ("cpu", F32, 2047, 128, "xla"),
    ],
)
def test_auto_picks_the_kernel_per_backend_dtype_and_shape(backend, dtype, t, h, expected):
    assert select_attention_impl("auto", backend, dtype, t, h) == expected


def test_explicit_choices_are_checked_against_backend_and_dtype():
    for backend in ("cpu", "gpu", "tpu"):
        for impl in ("xla", "dot_product", "blockwise"):
            assert select_attention_impl(impl, backend, F32, 16, 8) == impl
    assert select_attention_impl("cudnn", "gpu", B16, 17, 8) == "cudnn"
    assert select_attention_impl("splash", "tpu", B16, 256, 64) == "splash"
    with pytest.raises(ValueError, match="'cudnn' runs only on backend.*'cpu'"):
        select_attention_impl("cudnn", "cpu", B16, 16, 8)
    with pytest.raises(ValueError, match="'splash' runs only on backend.*'gpu'"):
        select_attention_impl("splash", "gpu", B16, 256, 128)
    with pytest.raises(ValueError, match="'cudnn' needs a bfloat16 or float16.*float32"):
        select_attention_impl("cudnn", "gpu", F32, 16, 8)
    with pytest.raises(
        ValueError, match="'splash' needs the sequence length.*multiple of 128.*got 100"
    ):
        select_attention_impl("splash", "tpu", B16, 100, 128)
    with pytest.raises(ValueError, match="attention_impl 'flash' is unknown.*allowed"):
        select_attention_impl("flash", "gpu", B16, 16, 8)
    with pytest.raises(ValueError, match="attention_impl 'flash' is unknown.*splash"):
        DTypePolicy(attention_impl="flash")
    # Every named policy defaults to "auto"; a named policy takes another kernel by name.
    assert {DTypePolicy.named(n).attention_impl for n in POLICY_NAMES} == {"auto"}
    assert DTypePolicy.named("mixed_bf16", attention_impl="cudnn").attention_impl == "cudnn"
    assert set(ATTENTION_IMPLS) == {"auto", "xla", "dot_product", "blockwise", "cudnn", "splash"}


def test_a_fused_kernel_the_backend_cannot_run_is_refused_by_the_model():
    policy = DTypePolicy.named("bfloat16", attention_impl="cudnn")
    tokens = jnp.zeros((1, 4), jnp.int32)

    def forward():
        return Transformer(tiny_config(), policy, rngs=nnx.Rngs(0))(tokens, jnp.arange(4)[None])

    with pytest.raises(ValueError, match="'cudnn' runs only on backend.*'cpu'"):
        jax.eval_shape(forward)  # traced: the check needs no parameters


def test_auto_on_cpu_lowers_to_the_explicit_path():
    q, k, v = _qkv(16, F32)
    valid = _valid(16, [("right", 16), ("right", 9), ("left", 5), ("none",)])
    texts = {
        impl: jax.jit(_attend(impl)).lower(q, k, v, valid).as_text() for impl in ("auto", "xla")
    }
    assert texts["auto"] == texts["xla"]


# ---------------------------------------------------------------------------------------------
# Kernels against the explicit path
# ---------------------------------------------------------------------------------------------
# Right padding, full rows, left padding (queries with no visible key) and an all-padding row.
KINDS = [("right", 16), ("right", 9), ("left", 5), ("none",)]


@pytest.mark.parametrize(
    "name, atol",
    [
        # Same operations in the same order (one fp32 einsum per matmul, fp32 softmax): equal
        # to fp32 rounding; observed 0.
        ("float32", 1e-6),
        # bf16 q, k, v and probabilities: a different fusion may round one bf16 value
        # differently (one bf16 ulp at |x| ~ 2 is 1.6e-2); observed 0. "mixed_bf16" runs the
        # same attention program (asserted below), so it is not compiled again.
        ("bfloat16", 1.6e-2),
    ],
)
def test_dot_product_equals_explicit_forward_and_gradients(name, atol):
    policy = DTypePolicy.named(name)
    mixed, bf16 = DTypePolicy.named("mixed_bf16"), DTypePolicy.named("bfloat16")
    assert (mixed.compute_dtype, mixed.precision) == (bf16.compute_dtype, bf16.precision)
    q, k, v = _qkv(16, policy.compute_dtype)
    valid = _valid(16, KINDS)
    explicit, fused = _attend("xla", name), _attend("dot_product", name)
    cotangent = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), F32)
    a, grads_a = _forward_and_grads(explicit, q, k, v, valid, cotangent)
    b, grads_b = _forward_and_grads(fused, q, k, v, valid, cotangent)
    assert a.dtype == b.dtype == policy.compute_dtype
    assert np.isfinite(np.asarray(b, F32)).all()
    # Every row, padding rows included: a query with no visible key (left padding, the
    # all-padding row) gets the same uniform softmax over all keys in both.
    print(f"{name}: dot_product vs explicit max |d out| = {_max_diff(a, b):.3e}")
    np.testing.assert_allclose(np.asarray(a, F32), np.asarray(b, F32), atol=atol, rtol=0)
    for ga, gb, what in zip(grads_a, grads_b, "qkv", strict=True):
        print(f"{name}: d{what} max diff = {_max_diff(ga, gb):.3e}")
        scale = float(jnp.abs(ga.astype(F32)).max())
        np.testing.assert_allclose(
            np.asarray(ga, F32), np.asarray(gb, F32), atol=atol * max(scale, 1.0), rtol=0
        )


def test_cudnn_mask_semantics_equal_explicit_on_right_padding_and_nan_on_left():
    """The cuDNN branch gives padding to the kernel as key lengths with a causal mask; through
    XLA (same `jax.nn.dot_product_attention` contract) this equals the explicit path on the
    real queries of every right-padded row (padding queries see the row's keys there, none in
    the explicit path: both are padding, never read), stays finite on an all-padding row and is
    NaN on a left-padded row."""
    q, k, v = _qkv(16, F32)
    valid = _valid(16, KINDS)
    cudnn_on_xla = jax.jit(functools.partial(kernels.cudnn_attention, implementation="xla"))
    explicit = _attend("xla")
    right = np.array([True, True, False, False])
    real = valid & right[:, None]  # the real queries of the right-padded rows
    cotangent = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), F32)
    cotangent = cotangent * real[:, :, None, None]
    a, explicit_grads = _forward_and_grads(explicit, q, k, v, valid, cotangent)
    c = cudnn_on_xla(q, k, v, valid)
    np.testing.assert_allclose(a[real], c[real], atol=1e-6, rtol=0)
    assert np.isfinite(np.asarray(c[3])).all()  # all padding: finite (and unused)
    assert np.isnan(np.asarray(c[2])).all()  # left padding cannot be given as lengths
    _, cudnn_grads = _forward_and_grads(
        lambda q, k, v, valid: jnp.where(
            right[:, None, None, None], cudnn_on_xla(q, k, v, valid), 0.0
        ),
        q,
        k,
        v,
        valid,
        cotangent,
    )
    for ga, gc in zip(explicit_grads, cudnn_grads, strict=True):
        np.testing.assert_allclose(ga[right], gc[right], atol=1e-6, rtol=0)


# The splash kernel's inputs (one kernel block, T = 128: the padding and the sharding, not the
# block loop, are under test) and its unsharded result, shared by the tests below: right
# padding, left padding (queries with no visible key), an all-padding row and a short row.
SPLASH_T, SPLASH_KINDS = 128, [("right", 100), ("left", 30), ("none",), ("right", 7)]


@pytest.fixture(scope="module")
def splash_one():
    """(inputs, output, gradients) of one unsharded splash kernel call, interpreted."""
    q, k, v = _qkv(SPLASH_T, F32, b=4, n=4, kv=2)
    valid = _valid(SPLASH_T, SPLASH_KINDS)
    one = functools.partial(kernels.splash_attention, block=128, interpret=True)
    inputs = (q, k, v, valid)
    return inputs, *_on_valid_queries(one, *inputs)


def test_splash_kernel_in_the_interpreter_equals_explicit(splash_one):
    """The TPU splash branch (segment ids for padding, GQA, q pre-scaled) run by the Pallas
    interpreter on CPU: equal to the explicit path on valid queries, forward and gradients, to
    1e-5 (blockwise online softmax: another summation order); finite on padding queries."""
    (q, k, v, valid), s, splash_grads = splash_one
    explicit = _attend("xla")
    a, explicit_grads = _on_valid_queries(explicit, q, k, v, valid)
    assert np.isfinite(np.asarray(s)).all()
    print(f"splash (interpreted) vs explicit max |d out| = {_max_diff(a, s, valid):.3e}")
    np.testing.assert_allclose(a[valid], s[valid], atol=1e-5, rtol=0)
    # The loss reads valid queries only (as the trainer's does).
    _assert_grads_match(explicit_grads, splash_grads, "splash")


def test_blockwise_attention_equals_explicit():
    """The blockwise path (online softmax over 64-token blocks; T = 200 is padded to 256, so
    the last block is partly padding) equals the explicit path on valid queries, forward and
    gradients, to 1e-5 relative (fp32, every dot at `highest`; another summation order), with
    GQA and right-, left- and heavily padded rows; padding queries stay finite."""
    t = 200
    q, k, v = _qkv(t, F32, b=4)
    valid = _valid(t, [("right", 150), ("right", 200), ("left", 30), ("right", 3)])
    blockwise = jax.jit(
        lambda q, k, v, valid: full_attention(
            q, k, v, valid, DTypePolicy.named("float32", "blockwise", attention_block=0)
        )
    )
    small = jax.jit(
        lambda q, k, v, valid: attention.blockwise_attention(
            q, k, v, valid, jax.lax.Precision.HIGHEST, 64
        )
    )
    a, explicit_grads = _on_valid_queries(_attend("xla"), q, k, v, valid)
    small_out, small_grads = _on_valid_queries(small, q, k, v, valid)
    for b in (blockwise(q, k, v, valid), small_out):
        assert np.isfinite(np.asarray(b)).all()
        print(f"blockwise vs explicit max |d out| = {_max_diff(a, b, valid):.3e}")
        np.testing.assert_allclose(a[valid], b[valid], atol=1e-5, rtol=0)
    _assert_grads_match(explicit_grads, small_grads, "blockwise")


def test_blockwise_attention_holds_no_t_by_t_array():
    """The compiled fp32 forward + backward at T = 4096 (one row, two heads): the explicit path
    holds the scores and probabilities (2 x 4096^2 floats per head, 128 MiB per array); the
    blockwise path's temporaries are a few [512, 512] blocks and q-sized accumulators (10 MiB
    here)."""
    t = 4096
    q, k, v = _qkv(t, F32, b=1, n=2, kv=1, h=16)
    valid = jnp.ones((1, t), bool)

    def temp(impl):
        policy = DTypePolicy.named("float32", impl)
        loss = lambda q, k, v: jnp.sum(full_attention(q, k, v, valid, policy) ** 2)
        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        compiled = grad.lower(q, k, v).compile(DEFAULT_CPU_CODEGEN)
        return compiled.memory_analysis().temp_size_in_bytes

    explicit, blockwise = temp("xla"), temp("blockwise")
    scores = 2 * t * t * 4  # one float32 [heads, T, T] array
    print(f"temp bytes: explicit {explicit / 2**20:.0f} MiB, blockwise {blockwise / 2**20:.1f} MiB")
    assert explicit >= scores
    assert blockwise < scores / 8


@pytest.mark.parametrize(
    "error",
    [RuntimeError("cuDNN is not detected."), NotImplementedError("head dim"), ValueError("x")],
)
def test_auto_falls_back_to_the_explicit_path_when_cudnn_cannot_run(monkeypatch, error):
    """With "auto" on a GPU, a cuDNN call that raises at trace time (no cuDNN: RuntimeError;
    an unsupported shape: NotImplementedError; a refused layout: ValueError) runs the explicit
    path instead; an explicit "cudnn" lets the error through."""
    monkeypatch.setattr(attention, "_GPU_BACKENDS", ("cpu",))

    def refuse(*args, **kwargs):
        raise error

    monkeypatch.setattr(kernels, "cudnn_attention", refuse)
    q, k, v = _qkv(16, B16)
    valid = _valid(16, [("right", 16), ("right", 9), ("right", 4), ("right", 1)])
    auto = DTypePolicy.named("bfloat16", attention_impl="auto")
    out = full_attention(q, k, v, valid, auto, backend="cpu")
    ref = full_attention(q, k, v, valid, DTypePolicy.named("bfloat16", "xla"), backend="cpu")
    # The fallback runs the explicit path's own code on the same inputs: exact.
    np.testing.assert_array_equal(np.asarray(out, F32), np.asarray(ref, F32))
    with pytest.raises(type(error)):
        full_attention(q, k, v, valid, DTypePolicy.named("bfloat16", "cudnn"), backend="cpu")


@pytest.mark.parametrize("tensor", [2, 4])
def test_splash_per_shard_on_a_mesh_equals_one_kernel(splash_one, tensor):
    """On a mesh the splash kernel runs under shard_map, one kernel per (rows, heads) shard:
    the same values and gradients as one unsharded kernel call (interpreted on 8 CPU devices),
    with the 2 KV heads split like the query heads (tensor 2) and, when there are fewer KV heads
    than tensor shards (tensor 4), each query head given its own KV head copy."""
    from dvp_jax.sharding import TRAIN_RULES, MeshConfig, Sharder, make_mesh

    (q, k, v, valid), a, one_grads = splash_one
    sharder = Sharder(make_mesh(MeshConfig(1, 8 // tensor, tensor)), TRAIN_RULES)
    sharded = functools.partial(
        kernels.splash_attention, block=128, interpret=True, sharder=sharder
    )
    s, sharded_grads = _on_valid_queries(sharded, q, k, v, valid)
    # The same kernel on the same rows and heads: only XLA's handling of the shards differs.
    np.testing.assert_allclose(a, s, atol=1e-6, rtol=0)
    _assert_grads_match(one_grads, sharded_grads, "splash per shard")


def test_splash_block_defaults_to_the_largest_tile_that_divides_t():
    assert [kernels.splash_block(t) for t in (128, 256, 384, 1024, 18_432)] == [
        128,
        256,
        128,
        512,
        512,
    ]
    assert kernels.splash_block(1024, 256) == 256
    with pytest.raises(ValueError, match="attention_block=192 must be a multiple of 128"):
        kernels.splash_block(1024, 192)
    with pytest.raises(ValueError, match="attention_block must be 0"):
        DTypePolicy.named("mixed_bf16", attention_block=100)


# ---------------------------------------------------------------------------------------------
# The whole model under each kernel
# ---------------------------------------------------------------------------------------------
def _batch(t: int):
    """Right-padded rows and one left-padded row (explicit positions), [3, t]."""
    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(1, 64, size=(3, t)).astype(np.int32))
    valid = _valid(t, [("right", t), ("right", t // 2 + 1), ("left", 3)])
    positions = jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0).astype(jnp.int32)
    return tokens, positions, valid


def _models(name: str, impls, seed: int = 11) -> dict:
    """{impl: (graphdef, params)}: one set of parameters, a graph per attention kernel (the
    kernel is a static attribute of the policy; only the first model is built, the others are
    traced with eval_shape)."""

    def build(impl):
        policy = DTypePolicy.named(name, attention_impl=impl)
        return Transformer(tiny_config(), policy, rngs=nnx.Rngs(seed))

    params = nnx.split(build(impls[0]))[1]
    return {impl: (nnx.split(nnx.eval_shape(lambda i=impl: build(i)))[0], params) for impl in impls}


def test_model_forward_gradients_and_prefill_equal_under_xla_and_dot_product():
    tokens, positions, valid = _batch(12)

    def run(params, graphdef):
        def loss(params):
            logits = nnx.merge(graphdef, params)(tokens, positions, valid)
            logp = jax.nn.log_softmax(logits)
            return jnp.sum(jnp.where(valid, logp[..., 5], 0.0)), logits

        (value, logits), grads = jax.value_and_grad(loss, has_aux=True)(params)
        prefill = nnx.merge(graphdef, params).prefill(tokens[:2], jnp.array([12, 7]), 16)
        return logits, value, grads, prefill

    results = {}
    # "auto" lowers to "xla" on CPU (test above).
    for impl, (graphdef, params) in _models("float32", ("xla", "dot_product")).items():
        results[impl] = jax.tree.leaves(jax.jit(run, static_argnums=1)(params, graphdef))
    # fp32 model: the same attention values (see the kernel test) at every position, the
    # left-padded row's padding positions included; logits, loss, every gradient, the prefill
    # logits and KV cache. Tolerances: 1e-5 for a composed fp32 computation (design.md 5.8).
    for a, b in zip(results["xla"], results["dot_product"], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_model_forward_under_the_fused_branches_on_cpu(monkeypatch):
    """The model's bf16 forward through the cuDNN branch (its mask given to XLA) and the splash
    branch (Pallas interpreter) on CPU, with this backend let through the selection: equal to
    the explicit path on real tokens to bf16 rounding."""
    monkeypatch.setattr(attention, "_GPU_BACKENDS", ("cpu",))
    monkeypatch.setattr(attention, "_TPU_BACKENDS", ("cpu",))
    monkeypatch.setattr(
        kernels, "cudnn_attention", functools.partial(kernels.cudnn_attention, implementation="xla")
    )
    monkeypatch.setattr(
        kernels, "splash_attention", functools.partial(kernels.splash_attention, interpret=True)
    )
    tokens, positions, valid = _batch(128)
    right = np.array([True, True, False])  # cuDNN: right padding only

    models = _models("mixed_bf16", ("xla", "cudnn", "splash"))

    def forward(impl):
        graphdef, params = models[impl]
        return jax.jit(lambda p: nnx.merge(graphdef, p)(tokens, positions, valid))(params)

    ref = forward("xla")
    scale = float(jnp.abs(ref).max())
    for impl, rows in (("cudnn", right), ("splash", np.ones(3, bool))):
        logits = forward(impl)
        where = valid & rows[:, None]
        diff = _max_diff(ref, logits, where)
        print(f"mixed_bf16 model, {impl} vs xla: max |d logits| = {diff:.3e} (scale {scale:.2f})")
        # bf16 activations: the branches round q (splash pre-scales it) and the probabilities
        # at other points than the explicit path; the gap stays far below the logit scale.
        assert diff < 0.02 * scale, (impl, diff, scale)
        if impl == "cudnn":
            assert np.isnan(np.asarray(logits[2])).all()


# ---------------------------------------------------------------------------------------------
# Precision
# ---------------------------------------------------------------------------------------------
_PRECISION = re.compile(r"stablehlo\.dot_general .*?precision = \[(\w+), (\w+)\]")


def _train_step_precisions(policy, global_precision):
    graphdef, params = nnx.split(Transformer(tiny_config(), policy, rngs=nnx.Rngs(0)))
    tokens, positions, valid = _batch(8)

    def loss(params):
        logits = nnx.merge(graphdef, params)(tokens, positions, valid)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 3])

    with jax.default_matmul_precision(global_precision):
        text = jax.jit(jax.value_and_grad(loss)).lower(params).as_text()
    return [m for m in _PRECISION.findall(text)], len(re.findall(r"dot_general", text))


def test_dot_product_attention_takes_the_policy_precision():
    # float32 trainer under a "default" global flag: every dot, attention's forward and
    # backward included, is HIGHEST (the scoped default_matmul_precision reaches
    # jax.nn.dot_product_attention's einsums).
    found, n_dots = _train_step_precisions(DTypePolicy.named("float32", "dot_product"), "default")
    assert len(found) == n_dots > 10
    assert set(found) == {("HIGHEST", "HIGHEST")}, found
    # bf16 rollout policy under a "highest" global flag: no dot is HIGHEST (its bf16 q.k runs
    # the BF16_BF16_F32 algorithm, the rest at the policy's DEFAULT).
    found, _ = _train_step_precisions(DTypePolicy.named("bfloat16", "dot_product"), "highest")
    assert found and ("HIGHEST", "HIGHEST") not in found, found
    # The blockwise path (forward and its custom backward) under the float32 policy.
    found, n_dots = _train_step_precisions(DTypePolicy.named("float32", "blockwise"), "default")
    assert len(found) == n_dots > 10
    assert set(found) == {("HIGHEST", "HIGHEST")}, found
    assert TRAIN_POLICY.attention_impl == "auto"


# ---------------------------------------------------------------------------------------------
# Packed rows: several sequences per row, told apart by segment ids
# ---------------------------------------------------------------------------------------------
def _packed_segments(t: int, rows) -> jax.Array:
    """[len(rows), t] int32 segment ids: each row's sequence lengths laid out left to right as
    segments 1, 2, ..., padding (0) after."""
    out = np.zeros((len(rows), t), np.int32)
    for r, lengths in enumerate(rows):
        start = 0
        for k, n in enumerate(lengths, 1):
            out[r, start : start + n] = k
            start += n
    return jnp.asarray(out)


# T = 128 (one splash block): a row of three sequences and padding, a whole row, a row of ten
# short sequences, a row of padding only.
PACKED_T, PACKED_ROWS = 128, [(40, 50, 30), (128,), (12,) * 10, ()]


@pytest.fixture(scope="module")
def packed_explicit():
    """(inputs, explicit output, gradients) on packed rows, loss read on real queries."""
    q, k, v = _qkv(PACKED_T, F32, b=4, seed=5)
    seg = _packed_segments(PACKED_T, PACKED_ROWS)
    inputs = (q, k, v, seg)
    return inputs, *_on_valid_queries(_attend("xla"), q, k, v, seg)


def test_packed_rows_attend_within_their_own_sequence(packed_explicit):
    """The explicit path on a packed row equals each of its sequences attended alone (its own
    row, right-padded): attention never crosses a sequence. Same operations on each query's
    visible keys, so equal to float32 rounding (1e-6)."""
    (q, k, v, seg), packed, _ = packed_explicit
    explicit = _attend("xla")
    for r, lengths in enumerate(PACKED_ROWS):
        start = 0
        for n in lengths:
            span = slice(start, start + n)
            alone = [
                jnp.pad(x[r : r + 1, span], ((0, 0), (0, PACKED_T - n), (0, 0), (0, 0)))
                for x in (q, k, v)
            ]
            out = explicit(*alone, jnp.arange(PACKED_T)[None] < n)[0, :n]
            np.testing.assert_allclose(packed[r, span], out, atol=1e-6, rtol=0)
            start += n


@pytest.mark.parametrize("impl", ["dot_product", "blockwise", "cudnn", "splash"])
def test_every_kernel_equals_explicit_on_packed_rows(packed_explicit, impl):
    """Each kernel on packed segment ids equals the explicit path on real queries, forward and
    gradients: dot_product (XLA's own softmax; 1e-6), blockwise (32-token blocks, so rows skip
    block pairs; another summation order: 1e-5), cuDNN's mask branch (through XLA; 1e-6) and
    splash (Pallas interpreter; 1e-5)."""
    (q, k, v, seg), a, explicit_grads = packed_explicit
    fns = {
        "dot_product": _attend("dot_product"),
        "blockwise": lambda q, k, v, s: attention.blockwise_attention(
            q, k, v, s, jax.lax.Precision.HIGHEST, 32
        ),
        "cudnn": functools.partial(kernels.cudnn_attention, implementation="xla"),
        "splash": functools.partial(kernels.splash_attention, block=128, interpret=True),
    }
    out, grads = _on_valid_queries(fns[impl], q, k, v, seg)
    real = np.asarray(seg > 0)
    atol = 1e-6 if impl in ("dot_product", "cudnn") else 1e-5
    print(f"{impl} vs explicit on packed rows: max |d out| = {_max_diff(a, out, real):.3e}")
    np.testing.assert_allclose(a[real], out[real], atol=atol, rtol=0)
    assert np.isfinite(np.asarray(out, F32)).all()
    _assert_grads_match(explicit_grads, grads, impl)


def test_blockwise_visits_only_the_block_pairs_a_row_needs():
    """`block_visits` (the pairs the blockwise kernel computes): causal, within a sequence,
    none for padding. A row of two 64-token sequences in 32-token blocks needs the 3 causal
    pairs inside each sequence (6 of the 10 causal pairs of 4 blocks); a sequence that ends
    mid-block shares that block with the next; a padding row needs none."""
    seg = _packed_segments(128, [(64, 64), (40, 88), (), (128,)])
    visits = np.asarray(blockwise.block_visits(seg, 32))
    assert visits.shape == (4, 4, 4)
    assert visits[0].sum() == 6 and not visits[0][2:, :2].any()
    assert visits[1].sum() == 8  # (40, 88): block 1 holds both sequences, block 0 only one
    assert visits[2].sum() == 0
    assert visits[3].sum() == 10 and not np.triu(visits[3], 1).any()
    # The host's NumPy count (the cost model's) is the kernel's.
    np.testing.assert_array_equal(blockwise.block_visits(np.asarray(seg), 32, np), visits)


def test_blockwise_per_shard_on_a_mesh_equals_one_call(packed_explicit):
    """On a mesh the blockwise path runs per (rows, heads) shard (each shard skips its own
    rows' block pairs): the same values and gradients as one unsharded call."""
    from dvp_jax.sharding import TRAIN_RULES, MeshConfig, Sharder, make_mesh

    (q, k, v, seg), _, _ = packed_explicit
    sharder = Sharder(make_mesh(MeshConfig(1, 4, 2)), TRAIN_RULES)
    fn = lambda sh: (
        lambda q, k, v, s: attention.blockwise_attention(
            q, k, v, s, jax.lax.Precision.HIGHEST, 32, sh
        )
    )
    one, one_grads = _on_valid_queries(fn(None), q, k, v, seg)
    sharded, sharded_grads = _on_valid_queries(fn(sharder), q, k, v, seg)
    np.testing.assert_allclose(one, sharded, atol=1e-6, rtol=0)
    _assert_grads_match(one_grads, sharded_grads, "blockwise per shard")
