"""Pruning (E1-E3) and chunked pruned log-probabilities with a custom VJP.

Tolerances: values 1e-5 relative (fp32 vs the float64 reference, plus 1e-6 absolute for entries
near 0); gradients 1e-4 relative to the reference (composed: matmul + softmax, fp32 accumulation
over V) and, between chunk sizes or between a mesh and one device, 1e-5 of the largest entry
(entries that are sums of cancelling terms differ by summation order only; observed <= 2e-7 of
the largest entry on the vocabulary-parallel mesh).
"""

import math
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from dvp_jax.dvp import chunked, pruning, vocab_mesh
from dvp_jax.sharding import TRAIN_RULES
from tests import DEFAULT_CPU_CODEGEN
from tests import reference as ref

N, D, V = 24, 8, 50


def _inputs(seed=0, n=N, d=D, v=V, scale=1.0):
    rng = np.random.default_rng(seed)
    h = rng.normal(size=(n, d)).astype(np.float32)
    w = (scale * rng.normal(size=(d, v))).astype(np.float32)
    y = rng.integers(0, v, size=(n,)).astype(np.int32)
    return h, w, y


def _objective(out, g):
    """A scalar touching every differentiable output (cotangents g = (g_logp, g_full, g_mass))."""
    return (
        jnp.sum(g[0] * out.logp) + jnp.sum(g[1] * out.logp_full) + jnp.sum(g[2] * out.pruned_mass)
    )


# The functions under test as one compiled program per call signature (an eager call compiles
# and dispatches each operation on its own).
_token_logprobs = jax.jit(pruning.pruned_token_logprobs, static_argnums=(2, 3))
_chunked = jax.jit(
    chunked.chunked_pruned_logprobs, static_argnames=("log_rho", "temperature", "chunk_size")
)
_token_stats = jax.jit(chunked.chunked_token_stats, static_argnames=("log_rho", "chunk_size"))


def test_four_token_vocab_by_hand():
    # z = [2, 1, -1, -3], log_rho = -2.5: max 2, threshold -0.5 -> V_S = {0, 1}.
    # logsumexp over V_S = log(e^2 + e^1) = 2 + log(1 + e^-1) = 2.3132617
    # log pi_S(0) = 2 - 2.3132617 = -0.3132617; log pi_S(1) = -1.3132617; tokens 2, 3 outside.
    # delta_S = (e^-1 + e^-3) / (e^2 + e^1 + e^-1 + e^-3) = 0.4176665 / 10.5250036 = 0.0396833.
    z = jnp.array([[2.0, 1.0, -1.0, -3.0]])
    every = jnp.arange(4)  # each token of the vocabulary as a target, one row each
    out = _token_logprobs(jnp.repeat(z, 4, axis=0), every, -2.5)
    np.testing.assert_array_equal(out.in_safe, [True, True, False, False])
    lse = 2.0 + math.log1p(math.exp(-1.0))
    np.testing.assert_allclose(out.logp[:2], [2.0 - lse, 1.0 - lse], rtol=1e-6)
    np.testing.assert_array_equal(out.logp[2:], [pruning.LOGP_FLOOR] * 2)
    np.testing.assert_allclose(out.pruned_mass, [0.4176665 / 10.5250036] * 4, rtol=1e-5)
    np.testing.assert_array_equal(out.safe_size, [2] * 4)
    # The gradient of a pruned log-prob is zero outside V_S (the floor is a constant) and, inside,
    # that of z_a - logsumexp over V_S: 1[b = a] - q_b, q = softmax over V_S = (e^2, e^1) / sum.
    grad = jax.jit(jax.grad(lambda z: pruning.pruned_token_logprobs(z, every[:3], -2.5).logp.sum()))
    q = np.exp(np.array([2.0, 1.0]) - lse)
    np.testing.assert_allclose(
        grad(jnp.repeat(z, 3, axis=0)),
        [[1 - q[0], -q[1], 0, 0], [-q[0], 1 - q[1], 0, 0], [0, 0, 0, 0]],
        rtol=1e-6,
        atol=1e-7,
    )
    # tau = 2: z / tau = [1, 0.5, -0.5, -1.5], threshold 1 - 2.5 = -1.5 (exact in binary), and
    # E1 is ">=": token 3 sits exactly on the threshold, so all four are safe and delta_S = 0.
    hot = _token_logprobs(jnp.repeat(z, 4, axis=0), every, -2.5, 2.0)
    np.testing.assert_array_equal(hot.in_safe, [True] * 4)
    np.testing.assert_array_equal(hot.pruned_mass, [0.0] * 4)
    # The same case through the chunked path (h = [[1], [1]], W = z, so h W = z): y = 1 is
    # inside, y = 3 is not.
    h = jnp.ones((2, 1))
    w = z  # [d=1, V=4]
    out = _chunked(h, w, jnp.array([1, 3]), log_rho=-2.5, chunk_size=3)
    np.testing.assert_allclose(out.logp[0], 1.0 - lse, rtol=1e-6)
    assert out.logp[1] == pruning.LOGP_FLOOR
    np.testing.assert_array_equal(out.in_safe, [True, False])
    np.testing.assert_array_equal(out.safe_size, [2, 2])


def test_tiny_pruned_mass_is_accurate():
    # z = (20, 0, -1, -30), rho = e^-13: V_S = {0} and
    # delta_S = (1 + e^-1 + e^-30) / (e^20 + 1 + e^-1 + e^-30) = 2.8194e-9, far below float32's
    # 1 - S/F resolution; both paths compute it from the pruned terms themselves.
    z = np.array([[20.0, 0.0, -1.0, -30.0]], np.float32)
    expect = ref.pruned_token_logprob(z[0], 0, -13.0)["pruned_mass"]
    assert 2.8e-9 < expect < 2.83e-9
    stats = _token_logprobs(z, jnp.array([0]), -13.0)
    np.testing.assert_allclose(stats.pruned_mass, [expect], rtol=1e-5)
    out = _chunked(jnp.ones((1, 1)), z, jnp.array([0]), log_rho=-13.0, chunk_size=2)
    np.testing.assert_allclose(out.pruned_mass, [expect], rtol=1e-5)


LOGITS_CASES = [(r, tau) for r in (-2.0, -13.0, None) for tau in (1.0, 0.7)]


@pytest.fixture(scope="module")
def logits_path():
    """{(log_rho, temperature): (record, safe-set mask)} of every `test_logits_path_matches_
    reference` case, in one program."""
    h, w, y = _inputs(scale=1.5)
    logits, y = jnp.asarray(h @ w), jnp.asarray(y)

    @jax.jit
    def run(logits, y):
        return [
            (
                pruning.pruned_token_logprobs(logits, y, log_rho, tau),
                pruning.safe_set_sums(logits / tau, log_rho).safe,
            )
            for log_rho, tau in LOGITS_CASES
        ]

    return dict(zip(LOGITS_CASES, run(logits, y), strict=True))


@pytest.mark.parametrize("log_rho", [-2.0, -13.0, None])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logits_path_matches_reference(logits_path, log_rho, temperature):
    h, w, y = _inputs(scale=1.5)
    logits = h @ w
    lr = -math.inf if log_rho is None else log_rho
    expect = ref.pruned_token_logprobs(logits, y, lr, temperature)
    got, mask = logits_path[log_rho, temperature]
    _assert_matches_reference(got, expect)
    for n in range(N):
        assert set(np.flatnonzero(mask[n])) == ref.safe_set(logits[n], lr, temperature)


@pytest.mark.parametrize("log_rho", [-2.0, -math.inf])
def test_log_rho_may_be_a_traced_array(log_rho):
    """The in-memory core takes log_rho as a traced array (the sampler's `SamplingParams`), with
    -inf meaning no pruning; the same record as with a Python float. The two are different
    programs (a constant may be folded): membership and sizes exact, values to 1e-6 relative."""
    h, w, y = _inputs(seed=7, scale=1.5)
    logits, y = jnp.asarray(h @ w), jnp.asarray(y)
    traced = jax.jit(pruning.pruned_token_logprobs)(logits, y, jnp.float32(log_rho), 0.9)
    static = jax.jit(pruning.pruned_token_logprobs, static_argnums=(2, 3))(logits, y, log_rho, 0.9)
    for field in ("in_safe", "safe_size"):
        np.testing.assert_array_equal(getattr(traced, field), getattr(static, field), field)
    for field in ("logp", "pruned_mass", "logp_full"):
        np.testing.assert_allclose(
            getattr(traced, field), getattr(static, field), rtol=1e-6, atol=1e-9, err_msg=field
        )
    _assert_matches_reference(static, ref.pruned_token_logprobs(h @ w, np.asarray(y), log_rho, 0.9))
    if log_rho == -math.inf:
        np.testing.assert_array_equal(traced.safe_size, V)
    else:
        assert 0 < int(np.sum(traced.in_safe)) < N  # both sides of the safe set


def _assert_matches_reference(got, expect):
    np.testing.assert_array_equal(got.in_safe, expect["in_safe"])
    np.testing.assert_array_equal(got.safe_size, expect["safe_size"])
    inside = expect["in_safe"]
    np.testing.assert_allclose(got.logp[inside], expect["logp"][inside], rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(got.logp)[~inside] == pruning.LOGP_FLOOR)
    np.testing.assert_allclose(got.logp_full, expect["logp_full"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got.pruned_mass, expect["pruned_mass"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("log_rho", [-2.0, None])
def test_chunked_matches_reference_values_and_grads(log_rho):
    temperature = 0.8
    h, w, y = _inputs(seed=1, scale=1.5)
    lr = -math.inf if log_rho is None else log_rho
    expect = ref.pruned_token_logprobs(h @ w, y, lr, temperature)
    if log_rho is not None:  # the case must exercise both sides of the safe set
        assert 0 < expect["in_safe"].sum() < N
    rng = np.random.default_rng(2)
    g = [rng.normal(size=N) for _ in range(3)]

    fn = lambda h, w: chunked.chunked_pruned_logprobs(
        h, w, jnp.asarray(y), log_rho=log_rho, temperature=temperature, chunk_size=16
    )
    _assert_matches_reference(jax.jit(fn)(h, w), expect)
    grads = jax.jit(jax.grad(lambda h, w: _objective(fn(h, w), g), argnums=(0, 1)))(h, w)
    g_logits = ref.objective_grad_logits(h @ w, y, lr, temperature, *g)  # [N, V] float64
    np.testing.assert_allclose(grads[0], g_logits @ w.astype(np.float64).T, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(grads[1], h.astype(np.float64).T @ g_logits, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("log_rho", [-3.0, None])
def test_chunk_sizes_agree(log_rho):
    h, w, y = _inputs(seed=3, scale=2.0)
    g = [jnp.linspace(-1, 1, N), jnp.ones(N), jnp.full(N, 0.5)]

    chunk_sizes = (V, math.ceil(V / 7), 1024, 13)

    @jax.jit
    def run_all(h, w):  # every chunk size in one program
        results = []
        for chunk_size in chunk_sizes:
            fn = lambda h, w, c=chunk_size: chunked.chunked_pruned_logprobs(
                h, w, jnp.asarray(y), log_rho=log_rho, chunk_size=c
            )
            grads = jax.grad(lambda h, w, fn=fn: _objective(fn(h, w), g), argnums=(0, 1))(h, w)
            results.append((fn(h, w), grads))
        return results

    (base_out, base_grads), *others = run_all(h, w)
    for out, grads in others:
        for a, b in zip(out, base_out, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        for a, b in zip(grads, base_grads, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())


def test_chunked_leading_dims_bf16_and_extreme_logits_are_finite():
    h, w, y = _inputs(seed=4)
    h_bf16, w_bf16 = jnp.asarray(h, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
    out = _chunked(h_bf16.reshape(4, 6, D), w_bf16, y.reshape(4, 6), log_rho=-2.0, chunk_size=16)
    assert out.logp.shape == (4, 6) and out.logp.dtype == jnp.float32
    # Logits in the thousands: exponentials are of z - max <= 0, so nothing overflows.
    fn = lambda h, w: jnp.sum(
        chunked.chunked_pruned_logprobs(h, w, jnp.asarray(y), log_rho=-5.0, chunk_size=16).logp
    )
    value_and_grad = jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))
    value, grads = value_and_grad(h * 1e3, w)
    assert np.isfinite(value) and all(np.isfinite(g).all() for g in grads)
    _, grads = value_and_grad(h_bf16, w_bf16)
    assert grads[0].dtype == jnp.bfloat16 and grads[1].dtype == jnp.bfloat16


def test_no_n_by_v_array_in_forward_or_backward():
    n, d, v, chunk = 96, 16, 2048, 256
    h, w, y = _inputs(n=n, d=d, v=v)
    fn = lambda h, w: jnp.sum(
        chunked.chunked_pruned_logprobs(h, w, jnp.asarray(y), log_rho=-13.0, chunk_size=chunk).logp
    )
    vg = jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))
    hlo = vg.lower(h, w).compile(DEFAULT_CPU_CODEGEN).as_text()
    assert f"[{n},{v}]" not in hlo and f"[{v},{n}]" not in hlo
    assert f"f32[{n},{chunk}]" in hlo  # the chunk logits are there instead


@pytest.mark.parametrize("axis_type", ["explicit", "auto"])
def test_sharded_equals_single_device(axis_type):
    kind = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}[axis_type]
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(kind,) * 3)
    b, t, v = 8, 4, 64
    h, w, y = _inputs(seed=5, n=b * t, v=v, scale=1.5)
    h, y = h.reshape(b, t, D), y.reshape(b, t)

    def fn(h, w, y):
        out = chunked.chunked_pruned_logprobs(h, w, y, log_rho=-2.0, chunk_size=24)
        return _objective(out, [1.0, 0.5, 2.0]), out

    vg = jax.jit(jax.value_and_grad(fn, argnums=(0, 1), has_aux=True))
    expect = vg(h, w, y)
    hs = jax.device_put(h, NamedSharding(mesh, P(("data", "fsdp"), None, None)))
    ys = jax.device_put(y, NamedSharding(mesh, P(("data", "fsdp"), None)))
    for w_spec in (P(None, "tensor"), P("fsdp", "tensor")):
        ws = jax.device_put(w, NamedSharding(mesh, w_spec))
        got = vg(hs, ws, ys)
        chex.assert_trees_all_close(got, expect, rtol=1e-5, atol=1e-6)
        assert got[1][0].sharding.is_equivalent_to(hs.sharding, 3)  # dh laid out like h


def test_no_retrace_on_second_call():
    h, w, y = _inputs(seed=6)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(h, w, y):
        fn = lambda h, w: jnp.sum(
            chunked.chunked_pruned_logprobs(h, w, y, log_rho=-2.0, chunk_size=16).logp
        )
        return jax.value_and_grad(fn, argnums=(0, 1))(h, w)

    step(h, w, y)
    step(h + 1.0, w * 2.0, (y + 1) % V)


def test_argument_errors():
    h, w, y = _inputs()
    with pytest.raises(ValueError, match="chunk_size"):
        chunked.chunked_pruned_logprobs(h, w, y, log_rho=-1.0, chunk_size=0)
    with pytest.raises(ValueError, match="log_rho"):
        chunked.chunked_pruned_logprobs(h, w, y, log_rho=1.0, chunk_size=8)
    with pytest.raises(ValueError, match="temperature"):
        chunked.chunked_pruned_logprobs(h, w, y, log_rho=-1.0, temperature=0.0, chunk_size=8)
    with pytest.raises(ValueError, match="y must have shape"):
        chunked.chunked_pruned_logprobs(h, w, y[:3], log_rho=-1.0, chunk_size=8)
    with pytest.raises(ValueError, match="precision must be"):
        chunked.chunked_pruned_logprobs(h, w, y, log_rho=-1.0, chunk_size=8, precision="fp32")


# Vocabulary-parallel path: a (data, fsdp, tensor) mesh with W [d, V] split over tensor on V.
# V = 200 over tensor = 4 gives 50 local columns: chunks of 16 leave a ragged last chunk.
VP_N, VP_D, VP_V, VP_CHUNK = 32, 8, 200, 16


def _vp_inputs(v=VP_V):
    h, w, y = _inputs(seed=8, n=VP_N, d=VP_D, v=v, scale=1.5)
    y[::2] = np.argmax(h[::2] @ w, axis=-1)  # half the targets are safe for any rho
    return h, w, y


def _vp_weights():
    return (jnp.linspace(-1.0, 1.0, VP_N), jnp.full(VP_N, 0.5), jnp.full(VP_N, 2.0))


def _vp_value_and_grad(y, log_rho, mesh=None, g=None):
    """jit(value_and_grad) over (h, W) of `_objective` (weights g, default `_vp_weights()`) at
    tau = 0.7, chunks of `VP_CHUNK`."""
    g = _vp_weights() if g is None else g

    def fn(h, w):
        out = chunked.chunked_pruned_logprobs(
            h, w, y, log_rho=log_rho, temperature=0.7, chunk_size=VP_CHUNK, mesh=mesh
        )
        return _objective(out, g), out

    return jax.jit(jax.value_and_grad(fn, argnums=(0, 1), has_aux=True))


def _vp_mesh(shape, kind=AxisType.Auto):
    return jax.make_mesh(shape, ("data", "fsdp", "tensor"), axis_types=(kind,) * 3)


def _vp_put(mesh, h, w, y):
    """Rows over (data, fsdp); W as `Sharder` lays it out (vocab on tensor when it divides V)."""
    rows = P(("data", "fsdp"))
    vocab = "tensor" if w.shape[1] % mesh.shape["tensor"] == 0 else None
    return (
        jax.device_put(h, NamedSharding(mesh, P(*rows, None))),
        jax.device_put(w, NamedSharding(mesh, P("fsdp", vocab))),
        jax.device_put(y, NamedSharding(mesh, rows)),
    )


def test_mesh_axes_follow_train_rules():
    rules = dict(TRAIN_RULES)
    assert (rules["vocab"], rules["embed"]) == (
        vocab_mesh.VOCAB_MESH_AXIS,
        vocab_mesh.EMBED_MESH_AXIS,
    )
    mesh = _vp_mesh((1, 2, 4))
    assert vocab_mesh.mesh_axes(mesh, VP_N, VP_D, VP_V) == (("fsdp",), "tensor", "fsdp", 4)
    # V not divisible by tensor: no vocabulary split, tensor joins the row axes.
    assert vocab_mesh.mesh_axes(mesh, VP_N, VP_D, 201) == (("fsdp", "tensor"), None, "fsdp", 1)
    # d not divisible by fsdp: W's d is not split on entry.
    assert vocab_mesh.mesh_axes(mesh, VP_N, 7, VP_V) == (("fsdp",), "tensor", None, 4)


@pytest.mark.parametrize(
    "shape, axis_type, v, log_rho",
    [
        ((1, 2, 4), "auto", VP_V, -2.0),
        ((1, 2, 4), "auto", VP_V, None),
        ((2, 1, 4), "explicit", VP_V, -2.0),
        ((2, 1, 4), "explicit", VP_V, None),
        ((1, 2, 4), "auto", VP_V + 1, -2.0),  # V % tensor != 0: rows over tensor instead
    ],
)
def test_vocab_parallel_equals_single_device(shape, axis_type, v, log_rho):
    """Forward values and dh, dW on the mesh equal one device's. Auto axes get the mesh as an
    argument (what the trainer does); Explicit axes are found from the arrays' types."""
    kind = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}[axis_type]
    mesh = _vp_mesh(shape, kind)
    h, w, y = _vp_inputs(v)
    (_, expect), expect_grads = _vp_value_and_grad(y, log_rho)(h, w)
    if log_rho is not None:  # both sides of the safe set
        assert 0 < int(np.sum(expect.in_safe)) < VP_N
    hs, ws, ys = _vp_put(mesh, h, w, y)
    vg = _vp_value_and_grad(ys, log_rho, mesh if kind == AxisType.Auto else None)
    (_, got), (dh, dw) = vg(hs, ws)
    chex.assert_trees_all_close(got, expect, rtol=1e-5, atol=1e-6)
    for a, b in zip((dh, dw), expect_grads, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())
    if v % shape[2] == 0:  # (else rows are split over tensor as well)
        assert dh.sharding.is_equivalent_to(hs.sharding, 2)  # rows stay split
        assert dw.sharding.is_equivalent_to(ws.sharding, 2)  # dW stays vocabulary-sharded


def test_inside_callers_shard_map_equals_single_device():
    """Called inside the caller's own shard_map (rows split over all 8 devices, W replicated):
    the plain path runs per device and dW is summed over the row shards by autodiff."""
    mesh = _vp_mesh((2, 2, 2))
    h, w, y = _vp_inputs()
    _, expect_grads = _vp_value_and_grad(y, -2.0)(h, w)
    rows = P(("data", "fsdp", "tensor"))

    def per_device(h, w, y, g):
        return _vp_value_and_grad(y, -2.0, g=g)(h, w)[1]

    in_specs = (P(*rows, None), P(), rows, (rows,) * 3)
    sharded = jax.shard_map(per_device, mesh=mesh, in_specs=in_specs, out_specs=(rows, P()))
    grads = jax.jit(sharded)(h, w, y, _vp_weights())
    for a, b in zip(grads, expect_grads, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())


_COLLECTIVE = re.compile(
    r"=\s*(.*?)\s(all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(?:-start)?\("
)


def _collectives(hlo: str) -> list[tuple[str, list[tuple[int, ...]]]]:
    """(op, result shapes) of every collective in optimized HLO text."""
    found = []
    for line in hlo.splitlines():
        match = _COLLECTIVE.search(line)
        if match:
            shapes = re.findall(r"[a-z]+[0-9]*\[([0-9,]*)\]", match.group(1))
            found.append(
                (match.group(2), [tuple(int(x) for x in s.split(",") if x) for s in shapes])
            )
    return found


def _moves_vocab(collectives, v=VP_V) -> list:
    """The collectives that produce an array with a full-vocabulary dimension."""
    return [(op, shapes) for op, shapes in collectives if any(v in s for s in shapes)]


def test_vocab_parallel_hlo_never_gathers_w_over_vocab():
    """Compiled fwd + bwd on the tensor-sharded mesh: no collective produces a V-sized dim (W is
    never gathered along V); W's local shard is gathered over fsdp only, to [d, V / 4]. The
    control, the same call without a mesh (GSPMD partitions the chunk loop), does gather W to
    [d / 2, V], so the check can fail."""
    mesh = _vp_mesh((1, 2, 4))
    h, w, y = _vp_put(mesh, *_vp_inputs())

    def hlo(mesh_arg):
        vg = _vp_value_and_grad(y, -2.0, mesh_arg)
        return _collectives(vg.lower(h, w).compile(DEFAULT_CPU_CODEGEN).as_text())

    new = hlo(mesh)
    assert not _moves_vocab(new), new
    kinds = {op for op, _ in new}
    assert "all-reduce" in kinds and "reduce-scatter" in kinds, new  # the parse sees collectives
    gathered = [s for op, shapes in new if op == "all-gather" for s in shapes]
    assert (VP_D, VP_V // 4) in gathered, new  # the fsdp gather of the local shard
    old = hlo(None)
    assert any(op == "all-gather" for op, _ in _moves_vocab(old)), old


@pytest.mark.parametrize("on_mesh", [False, True])
def test_precision_reaches_every_matmul(on_mesh):
    """Every dot of the forward and the custom-VJP backward carries the requested precision
    (conftest's global default is HIGHEST, so an einsum that ignored the argument shows it)."""
    h, w, y = _vp_inputs()
    mesh = _vp_mesh((1, 2, 4)) if on_mesh else None
    if mesh is not None:
        h, w, y = _vp_put(mesh, h, w, y)

    def fn(h, w):
        out = chunked.chunked_pruned_logprobs(
            h, w, y, log_rho=-2.0, chunk_size=VP_CHUNK, precision="high", mesh=mesh
        )
        return jnp.sum(out.logp)

    text = jax.jit(jax.grad(fn, argnums=(0, 1))).lower(h, w).as_text()
    dots = [line for line in text.splitlines() if "dot_general" in line]
    assert len(dots) >= 5, text  # pass 1, pass 2, backward: logits, dh, dW
    assert all("precision = [HIGH, HIGH]" in line for line in dots), dots


def _dense_stats(h, w, y, temperature):
    """float64 reference: entropy -sum p log p of softmax(h W / tau), and z_y - max z."""
    z = (h.astype(np.float64) @ w.astype(np.float64)) / temperature
    log_p = z - z.max(-1, keepdims=True)
    log_p -= np.log(np.exp(log_p).sum(-1, keepdims=True))
    entropy = -np.sum(np.exp(log_p) * log_p, axis=-1)
    return entropy, z[np.arange(len(y)), y] - z.max(-1)


@pytest.mark.parametrize("log_rho", [-2.0, None])  # pass-2 sums / online rescaled sums
@pytest.mark.parametrize("on_mesh", [False, True])
def test_streaming_entropy_and_log_rel_equal_dense_reference(log_rho, on_mesh):
    """H = log s - u / s accumulated over ragged chunks (and vocabulary shards) equals
    -sum p log p; log_rel = z_y - max z decides E1 membership; both carry no gradient.
    Tolerance 1e-5 relative and 1e-5 absolute: fp32 sums over V = 200 columns (observed < 1e-6)."""
    h, w, y = _vp_inputs()
    expect_h, expect_rel = _dense_stats(h, w, y, 0.7)
    mesh = _vp_mesh((1, 2, 4)) if on_mesh else None
    if mesh is not None:
        h, w, y = _vp_put(mesh, h, w, y)

    def fn(h, w):
        out, stats = chunked.chunked_token_stats(
            h, w, y, log_rho=log_rho, temperature=0.7, chunk_size=VP_CHUNK, mesh=mesh
        )
        return jnp.sum(stats.entropy) + jnp.sum(stats.log_rel), (out, stats)

    (_, (out, stats)), grads = jax.jit(jax.value_and_grad(fn, (0, 1), has_aux=True))(h, w)
    np.testing.assert_allclose(stats.entropy, expect_h, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(stats.log_rel, expect_rel, rtol=1e-5, atol=1e-5)
    assert 0.1 < float(np.min(expect_h)) and float(np.max(expect_h)) < math.log(VP_V)
    if log_rho is not None:  # the record's E1 membership is log_rel >= log rho
        np.testing.assert_array_equal(out.in_safe, expect_rel >= log_rho)
    assert all(float(jnp.abs(g).max()) == 0.0 for g in grads)  # diagnostics: zero gradient


def test_streaming_entropy_of_extreme_and_uniform_logits():
    # Rows 0..N-1: one dominant column (logits in the thousands), H ~ 0 and finite. Rows N..2N-1:
    # all-equal logits, H = log V.
    h, w, y = _inputs(seed=9)
    h2, y2 = np.concatenate([h * 1e3, h * 0.0]), np.concatenate([y, y])
    for log_rho in (-2.0, None):
        _, stats = _token_stats(h2, w, y2, log_rho=log_rho, chunk_size=16)
        assert np.isfinite(stats.entropy).all()
        assert 0.0 <= float(stats.entropy[:N].min()) and float(stats.entropy[:N].max()) < 1e-3
        np.testing.assert_allclose(stats.entropy[N:], math.log(V), rtol=1e-6)
