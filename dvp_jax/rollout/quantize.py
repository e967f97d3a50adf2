"""Fake weight quantization of the rollout copy of the weights (the mismatch ladder, issue 14).

A rollout policy whose `DTypePolicy.weight_quant` is not "none" samples from a model whose
decoder-block matmul kernels were quantized and dequantized back to the rollout parameter dtype
when the trainer's weights were synced (`RolloutEngine.update_params`). The error is therefore
deterministic for given weights and context (no noise) and identical for every sample and step
until the next sync; and since the engine samples and records log mu from exactly these weights,
mu is the behaviour distribution (E4, docs/design.md section 2).

Formats (`WEIGHT_QUANTS`). Every kernel is viewed as `[L, K, O]`: L the stacked layers, K the
contraction (input) dimension, O the output channels:

* "fp8_channel": float8_e4m3fn with one absmax scale per output channel (per layer):
  s_{l,o} = max_k |W_{l,k,o}| / 448 (448 = largest e4m3fn value), W_hat = fp8(W / s) s. The
  rounding error is at most 2^-4 |W| for values in e4m3fn's normal range (3 mantissa bits) and
  2^-10 s below it (subnormal spacing 2^-9 s).
* "int4_group32": symmetric int4 with one absmax scale per group of 32 consecutive entries of
  the contraction dimension (per layer and output channel): s = max |W_group| / 7,
  W_hat = clip(round(W / s), -7, 7) s, so |W_hat - W| <= s / 2. K that is not a multiple of 32
  ends in one shorter group.

A zero scale (an all-zero channel or group) dequantizes to exact zeros, never NaN. Scales and the
product q * s are float32; the result is cast to the rollout `param_dtype` (bf16), which adds
bf16 rounding (2^-9 relative), far below either format's error.

What is quantized, and the contraction axes of each stacked kernel (the blocks are stacked on a
leading `[L]` axis under `nnx.scan`; `dvp_jax/model/attention.py`, `layers.py`):

| path | shape | contraction (K) | output (O) |
|---|---|---|---|
| blocks/attn/q_proj | [L, d, n, h] | d | n h |
| blocks/attn/k_proj, v_proj | [L, d, k, h] | d | k h |
| blocks/attn/o_proj | [L, n, h, d] | n h | d |
| blocks/mlp/gate, up | [L, d, f] | d | f |
| blocks/mlp/down | [L, f, d] | f | d |

Left in the rollout dtype (bf16): the embedding (a gather, not a matmul), the unembedding
`lm_head` (tied to the embedding in the small Qwen3 presets; weight-quantized deployments keep
the output projection in 16 bits because its error lands on the logits directly) and the RMSNorm
weights (vectors of elementwise scales, negligible in size, that would rescale every activation).
So the ladder's extra mismatch comes from the same place it comes from in a deployed
weight-quantized model: the transformer blocks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from dvp_jax.model.config import WEIGHT_QUANTS, DTypePolicy

# Largest finite float8_e4m3fn value.
FP8_E4M3_MAX = 448.0
# Symmetric int4: levels -7 .. 7 (-8 unused, so the grid is symmetric around 0).
INT4_MAX = 7.0
INT4_GROUP = 32

# Parameter path (as `nnx.to_flat_state` spells it) -> number of contraction axes after the
# leading [L] axis (they are always axes 1 .. c; the rest are output axes).
KERNEL_CONTRACTION_AXES: dict[tuple[str, ...], int] = {
    ("blocks", "attn", "q_proj"): 1,
    ("blocks", "attn", "k_proj"): 1,
    ("blocks", "attn", "v_proj"): 1,
    ("blocks", "attn", "o_proj"): 2,
    ("blocks", "mlp", "gate"): 1,
    ("blocks", "mlp", "up"): 1,
    ("blocks", "mlp", "down"): 1,
}


def _safe_div(x: jax.Array, scale: jax.Array) -> jax.Array:
    """x / scale, 0 where the scale is 0 (an all-zero channel or group)."""
    return x / jnp.where(scale > 0, scale, 1.0)


def fp8_channel(w: jax.Array) -> jax.Array:
    """Per-output-channel float8_e4m3fn fake quantization of `w` `[L, K, O]` (float32 out).

    s_{l,o} = max_k |w_{l,k,o}| / 448; returns fp8(w / s) s in float32.
    """
    w = w.astype(jnp.float32)
    scale = jnp.max(jnp.abs(w), axis=1, keepdims=True) / FP8_E4M3_MAX  # [L, 1, O]
    q = _safe_div(w, scale).astype(jnp.float8_e4m3fn)
    return q.astype(jnp.float32) * scale


def int4_group(w: jax.Array, group: int = INT4_GROUP) -> jax.Array:
    """Symmetric int4 fake quantization of `w` `[L, K, O]` in groups of `group` along K.

    s = max |w_group| / 7 per (layer, group, output channel); returns clip(round(w / s), -7, 7) s
    in float32. K is zero-padded to a multiple of `group` (zeros never raise an absmax) and the
    padding is dropped again.
    """
    w = w.astype(jnp.float32)
    layers, k, out = w.shape
    pad = -k % group
    wp = jnp.pad(w, ((0, 0), (0, pad), (0, 0))).reshape(layers, (k + pad) // group, group, out)
    scale = jnp.max(jnp.abs(wp), axis=2, keepdims=True) / INT4_MAX  # [L, K / group, 1, O]
    q = jnp.clip(jnp.round(_safe_div(wp, scale)), -INT4_MAX, INT4_MAX)
    return (q * scale).reshape(layers, k + pad, out)[:, :k]


_FORMATS = {"fp8_channel": fp8_channel, "int4_group32": int4_group}


def fake_quantize(w: jax.Array, weight_quant: str, contraction_axes: int, dtype) -> jax.Array:
    """Quantizes and dequantizes one stacked kernel; same shape, dtype `dtype`.

    Args:
      w: `[L, *contraction, *output]` kernel (any float dtype; quantized from its float32 value).
      weight_quant: one of `WEIGHT_QUANTS` other than "none".
      contraction_axes: c, the number of contraction axes (axes 1 .. c of `w`).
      dtype: dtype of the result (the rollout `param_dtype`).
    """
    if weight_quant not in _FORMATS:
        raise ValueError(
            f"weight_quant {weight_quant!r} is not a quantization; use {WEIGHT_QUANTS}"
        )
    shape = w.shape
    k = math.prod(shape[1 : 1 + contraction_axes])
    flat = w.reshape(shape[0], k, math.prod(shape[1 + contraction_axes :]))
    return _FORMATS[weight_quant](flat).reshape(shape).astype(dtype)


def quantize_leaves(
    leaves: Sequence[jax.Array], paths: Sequence[tuple], policy: DTypePolicy
) -> list[jax.Array]:
    """Fake-quantizes the decoder-block kernels among `leaves` as `policy.weight_quant` says.

    Traceable (the engine calls it inside its jitted weight cast). Kernels come back in
    `policy.param_dtype`; every other leaf is returned unchanged (the caller casts it).

    Args:
      leaves: parameter arrays, in the order of `paths`.
      paths: their `nnx.to_flat_state` paths (tuples of names), e.g. ("blocks", "mlp", "up").
      policy: the rollout policy; "none" returns `leaves` unchanged.
    Returns:
      The list of leaves, the kernels of `KERNEL_CONTRACTION_AXES` fake-quantized.
    Raises:
      ValueError: `leaves` and `paths` differ in length, or a quantizing policy finds none of
        the kernels of `KERNEL_CONTRACTION_AXES` among `paths` (the model's parameter names no
        longer match this table).
    """
    leaves = list(leaves)
    if len(leaves) != len(paths):
        raise ValueError(f"quantize_leaves: {len(leaves)} leaves but {len(paths)} paths")
    if policy.weight_quant == "none":
        return leaves
    paths = [tuple(str(p) for p in path) for path in paths]
    found = [i for i, path in enumerate(paths) if path in KERNEL_CONTRACTION_AXES]
    if len(found) != len(KERNEL_CONTRACTION_AXES):
        missing = sorted(set(KERNEL_CONTRACTION_AXES) - {paths[i] for i in found})
        raise ValueError(
            f"quantize_leaves: weight_quant={policy.weight_quant!r} needs the decoder-block "
            f"kernels {['/'.join(p) for p in missing]}, not among the parameter paths; update "
            "KERNEL_CONTRACTION_AXES in dvp_jax/rollout/quantize.py to the model's names"
        )
    for i in found:
        c = KERNEL_CONTRACTION_AXES[paths[i]]
        leaves[i] = fake_quantize(leaves[i], policy.weight_quant, c, policy.param_dtype)
    return leaves
