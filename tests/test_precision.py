"""The dtype policy decides every matmul's precision (docs/design.md section 3).

Each test lowers a model entry point to StableHLO and reads the `precision` attribute of every
`dot_general`. The global `jax_default_matmul_precision` is set to the *opposite* value around
each lowering, so a precision found in the program can only come from the policy.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from dvp_jax.model import (
    MIXED_TRAIN_POLICY,
    PRECISIONS,
    TRAIN_POLICY,
    TRAIN_PRECISIONS,
    DTypePolicy,
    ModelConfig,
    Transformer,
)
from dvp_jax.model.kv_cache import KVCache

HIGHEST, DEFAULT = jax.lax.Precision.HIGHEST, jax.lax.Precision.DEFAULT
# Matmuls of one forward pass (the block body is compiled once, whatever the depth): q, k, v and
# o projections, q.k and p.v, the MLP's gate, up and down, and the unembedding.
FORWARD_DOTS = 10
_DOT = re.compile(r"stablehlo\.dot_general .*")
_PRECISION = re.compile(r"precision = \[(\w+), (\w+)\]")
_OPERANDS = re.compile(r": \(tensor<[^>]*x(\w+)>, tensor<[^>]*x(\w+)>\) -> tensor<[^>]*x(\w+)>")


_ALGORITHM = re.compile(
    r"algorithm = <lhs_precision_type = (\w+), .*num_primitive_operations = (\d+)"
)


def _dots(text: str) -> list[dict]:
    """Every dot_general of a StableHLO module: its precision pair, its algorithm (the 16-bit
    operand type and pass count, when one is set) and its operand/result types."""
    dots = []
    for line in _DOT.findall(text):
        precision = _PRECISION.search(line)
        algorithm = _ALGORITHM.search(line)
        types = _OPERANDS.search(line)
        dots.append(
            dict(
                precision=precision.groups() if precision else None,
                algorithm=algorithm.groups() if algorithm else None,
                types=types.groups() if types else None,
            )
        )
    return dots


def _model(policy, **overrides):
    cfg = ModelConfig.preset("tiny", **overrides)
    return nnx.split(Transformer(cfg, policy, rngs=nnx.Rngs(0)))


def _lower(fn, *args, global_precision: str) -> list[dict]:
    with jax.default_matmul_precision(global_precision):
        return _dots(jax.jit(fn).lower(*args).as_text())


def _inputs(b=2, t=8):
    tokens = jnp.zeros((b, t), jnp.int32)
    return tokens, jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))


def _train_step_dots(policy, global_precision):
    """Dots of value_and_grad of a mean log-prob loss: forward and backward."""
    graphdef, params = _model(policy, tie_embeddings=False)
    tokens, positions = _inputs()

    def loss(params):
        logits = nnx.merge(graphdef, params)(tokens, positions)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 3])

    return _lower(jax.value_and_grad(loss), params, global_precision=global_precision)


def _inference_dots(policy, global_precision):
    """Dots of the full forward, prefill and one decode step."""
    graphdef, params = _model(policy)
    tokens, positions = _inputs()
    cfg = ModelConfig.preset("tiny")
    cache = KVCache.zeros(cfg, 2, 16, policy.cache_dtype)
    forward = _lower(
        lambda p: nnx.merge(graphdef, p)(tokens, positions),
        params,
        global_precision=global_precision,
    )
    prefill = _lower(
        lambda p: nnx.merge(graphdef, p).prefill(tokens, jnp.array([8, 5]), 16),
        params,
        global_precision=global_precision,
    )
    decode = _lower(
        lambda p, c: nnx.merge(graphdef, p).decode(tokens[:, 0], jnp.array([8, 5]), c),
        params,
        cache,
        global_precision=global_precision,
    )
    return forward, prefill, decode


def test_train_policy_runs_every_matmul_forward_and_backward_at_highest():
    # Global default "default": HIGHEST can only come from TRAIN_POLICY.
    dots = _train_step_dots(TRAIN_POLICY, global_precision="default")
    assert len(dots) > FORWARD_DOTS  # the backward pass adds the transposed matmuls
    assert all(d["precision"] == ("HIGHEST", "HIGHEST") for d in dots), dots
    assert all(d["types"] == ("f32", "f32", "f32") for d in dots), dots


def test_the_three_pass_policy_runs_every_matmul_as_three_16_bit_passes():
    """`float32_x3`: float32 parameters and activations, every matmul forward and backward the
    backend's three-pass fp32-class algorithm, whatever the global default: bf16 x 3 on TPU
    (lowered here for this CPU, which computes it exactly), 3xTF32 on an NVIDIA GPU (a CPU
    cannot lower that algorithm: only the policy's value is checked)."""
    policy = DTypePolicy.named("float32_x3").for_platform("tpu")
    dots = _train_step_dots(policy, global_precision="highest")
    assert len(dots) > FORWARD_DOTS
    assert all(d["algorithm"] == ("bf16", "3") for d in dots), dots
    assert all(d["types"] == ("f32", "f32", "f32") for d in dots), dots
    gpu = DTypePolicy.named("float32_x3").for_platform("gpu")
    assert gpu.precision == jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    assert DTypePolicy.named("float32").for_platform("gpu").precision == HIGHEST


@pytest.mark.parametrize(
    "name, expected",
    [
        ("float32", "HIGHEST"),
        ("bfloat16", "DEFAULT"),
        ("bfloat16_fp8kv", "DEFAULT"),
    ],
)
def test_rollout_policies_name_their_precision_in_forward_prefill_and_decode(name, expected):
    # The global default is the opposite of what the policy names: bf16 rollouts keep the
    # backend default even where a user sets "highest" globally (as tests/conftest.py does), and
    # a float32 rollout is true fp32 (no precision mismatch) even under "default". The two
    # weight-quantized rungs are "bfloat16_fp8kv" but for `weight_quant`, which only the weight
    # sync reads: the same model programs, so they are not lowered again.
    for quantized in ("bfloat16_fp8kv_fp8w", "bfloat16_fp8kv_int4w"):
        base = dataclasses.replace(DTypePolicy.named(quantized), weight_quant="none")
        assert base == DTypePolicy.named("bfloat16_fp8kv"), quantized
    opposite = "default" if expected == "HIGHEST" else "highest"
    for dots in _inference_dots(DTypePolicy.named(name), global_precision=opposite):
        assert len(dots) == FORWARD_DOTS
        assert all(d["precision"] == (expected, expected) for d in dots), (name, dots)


def test_mixed_policy_multiplies_in_bf16_with_fp32_params_and_fp32_logits():
    graphdef, params = _model(MIXED_TRAIN_POLICY, tie_embeddings=False)
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
    tokens, positions = _inputs()
    forward = _lower(
        lambda p: nnx.merge(graphdef, p)(tokens, positions), params, global_precision="highest"
    )
    # Every forward matmul takes bf16 operands; two produce float32: the attention scores (the
    # softmax input) and the logits.
    assert len(forward) == FORWARD_DOTS
    assert all(d["types"][:2] == ("bf16", "bf16") for d in forward), forward
    assert sum(d["types"][2] == "f32" for d in forward) == 2, forward
    # Forward and backward at the backend default, whatever the global flag. The transposes of
    # those two fp32-output matmuls take the fp32 cotangent (f32 x f32 at DEFAULT: TF32 on
    # GPUs, one bf16 pass on TPUs); every other backward matmul is bf16.
    dots = _train_step_dots(MIXED_TRAIN_POLICY, global_precision="highest")
    assert all(d["precision"] == ("DEFAULT", "DEFAULT") for d in dots), dots
    f32_dots = [d for d in dots if d["types"][:2] != ("bf16", "bf16")]
    assert len(f32_dots) == 2 * 2, f32_dots  # scores and logits, two transposes each
    model = nnx.merge(graphdef, params)
    assert model(tokens, positions).dtype == jnp.float32
    assert model(tokens, positions, return_hidden=True).dtype == jnp.bfloat16


def test_policy_names_and_precision_values():
    assert TRAIN_POLICY.precision is HIGHEST
    assert DTypePolicy.named("bfloat16").precision is DEFAULT
    assert DTypePolicy(precision="highest").precision is HIGHEST
    # The rollout list stays the rollout list; the mixed policy is a trainer precision only.
    assert "mixed_bf16" not in PRECISIONS and TRAIN_PRECISIONS == (
        "float32",
        "float32_x3",
        "mixed_bf16",
    )
    assert MIXED_TRAIN_POLICY == DTypePolicy(jnp.float32, jnp.bfloat16, jnp.bfloat16, DEFAULT)
    with pytest.raises(ValueError, match="DTypePolicy.precision 'fast'.*allowed"):
        DTypePolicy(precision="fast")
    with pytest.raises(ValueError, match="unknown dtype policy 'fp16'.*mixed_bf16"):
        DTypePolicy.named("fp16")
    # Every named policy: weight quantization only on the two weight-quantized rollout rungs,
    # and the attention kernel passed through.
    quantized = {n: DTypePolicy.named(n).weight_quant for n in PRECISIONS + TRAIN_PRECISIONS}
    assert {n for n, q in quantized.items() if q != "none"} == {
        "bfloat16_fp8kv_fp8w",
        "bfloat16_fp8kv_int4w",
    }
    assert DTypePolicy.named("bfloat16_fp8kv_int4w", attention_impl="xla").attention_impl == "xla"
