"""Fake weight quantization of the rollout copy of the weights (the mismatch ladder of e004).

A rollout policy whose `DTypePolicy.weight_quant` is not "none" samples from a model whose
decoder-block matmul kernels were quantized and dequantized back to the rollout parameter dtype
at weight sync (`RolloutEngine.update_params`). The error is deterministic for given weights
and context and the same for every sample and step until the next sync; the engine samples and
records log mu from exactly these weights, so mu is the behaviour distribution (E4). Formats:
`fp8_channel` and `int4_group` (`WEIGHT_QUANTS`); what is quantized: `KERNEL_CONTRACTION_AXES`.
The embedding (a gather), the unembedding `lm_head` (deployments keep it in 16 bits: its error
lands on the logits directly) and the RMSNorm weights stay in the rollout dtype, so the extra
mismatch comes from where it comes from in a deployed weight-quantized model: the blocks.
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
# leading [L] axis (they are always axes 1 .. c; the rest are output axes): q_proj [L, d, n, h],
# k_proj and v_proj [L, d, k, h] contract d; o_proj [L, n, h, d] contracts n h; gate and up
# [L, d, f] contract d; down [L, f, d] contracts f.
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

    s_{l,o} = max_k |w_{l,k,o}| / 448 (the largest e4m3fn value); returns fp8(w / s) s. The
    rounding error is at most 2^-4 |w| in e4m3fn's normal range (3 mantissa bits) and 2^-10 s
    below it (subnormal spacing 2^-9 s). A zero scale gives exact zeros, never NaN.
    """
    w = w.astype(jnp.float32)
    scale = jnp.max(jnp.abs(w), axis=1, keepdims=True) / FP8_E4M3_MAX  # [L, 1, O]
    q = _safe_div(w, scale).astype(jnp.float8_e4m3fn)
    return q.astype(jnp.float32) * scale


def int4_group(w: jax.Array, group: int = INT4_GROUP) -> jax.Array:
    """Symmetric int4 fake quantization of `w` `[L, K, O]` in groups of `group` along K.

    s = max |w_group| / 7 per (layer, group, output channel); returns clip(round(w / s), -7, 7) s
    in float32, so |w_hat - w| <= s / 2. K is zero-padded to a multiple of `group` (zeros never
    raise an absmax; a K that is not a multiple ends in one shorter group) and the padding is
    dropped again. A zero scale gives exact zeros, never NaN.
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
    """Quantizes and dequantizes one stacked kernel; same shape, dtype `dtype` (the cast to
    bf16 adds 2^-9 relative rounding, far below either format's error).

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
