"""Grouped-query attention with per-head q/k RMSNorm, RoPE, and a functional KV cache.

The KV cache is a pair of arrays `k, v: [L, b, k, S, h]` (layers, batch slots, kv heads, cache
length, head dim) in the policy's cache dtype. Rows are right-padded: a row's tokens occupy cache
positions `0 .. pos`, so a decode step at position `p` attends to cache positions `<= p`. The kv
heads come before the positions because that is the layout both decode matmuls take as stored
(a kv head is a batch dimension of q.k and of p.v): with positions first, XLA re-lays out every
layer's live keys and values on every step (docs/design.md section 3).

`Attention(..., layers=L)` holds the parameters of L layers (leading `[L]` axis) and is called on
one layer's slice inside `nnx.scan`; every matmul runs at the policy's precision.

Full-sequence attention (training forward and prefill) computes, per query head n of KV group
k = n // g, `out[t] = sum_s softmax_s(q[t] . k[s] / sqrt(h) + mask[t, s]) v[s]` with
`mask[t, s] = 0` where `s <= t` and key s is valid, a large negative number elsewhere, by one of
`ATTENTION_IMPLS` (`DTypePolicy.attention_impl`, resolved by `select_attention_impl`):

* "xla": the explicit einsum softmax (`_masked_softmax_attention`): T x T scores in float32,
  both matmuls at the policy's precision. Any `valid` pattern; a query with no visible key
  (a padding row, e.g. left padding) gets a uniform softmax over all keys: finite, never NaN.
* "dot_product": `jax.nn.dot_product_attention(implementation="xla")` with `is_causal` and the
  key mask: the same values as "xla" (padding rows included); its matmuls take the policy's
  precision through a scoped `jax.default_matmul_precision` (the function has no precision
  argument), so a float32 policy stays `highest`.
* "blockwise": `blockwise.blockwise_attention`, query and key blocks with an online softmax and
  a recomputing custom VJP in plain JAX: no T x T array, causal blocks skipped, every dot at the
  policy's precision (the fp32 trainer at 16k tokens). Equal to "xla" on valid queries to float
  rounding; a padding query with no visible key averages its block's values instead of all.
* "cudnn": cuDNN flash attention through `jax.nn.dot_product_attention(implementation=
  "cudnn")`, 16-bit compute only, no T x T array. Key padding reaches the kernel as per-row
  key lengths (cuDNN's PADDING_CAUSAL mask), which is exact when each row's valid tokens are a
  prefix (right padding: every batch the trainer, the rollout prefill and the tests build).
  A row whose `valid` is not a prefix cannot be expressed this way: its output is NaN (a loud
  failure instead of a silently wrong mask); use "xla" or "dot_product" for left padding.
* "splash": the Pallas splash-attention kernel (`jax.experimental.pallas.ops.tpu.
  splash_attention`), TPU and 16-bit compute only, T a multiple of 128; causal block mask,
  padding as segment ids (valid = 1, padding = 0), so any `valid` pattern is exact on valid
  queries and a padding query attends to padding keys (never an empty row). XLA cannot
  partition a Mosaic kernel, so on a mesh it runs per shard under `shard_map`.

"auto" is "cudnn" on an NVIDIA GPU and "splash" on a TPU for 16-bit compute dtypes where the
shapes allow; otherwise (CPU, float32 policies) "blockwise" from `BLOCKWISE_FROM` tokens and
"xla" below (a float32 policy never runs a fused kernel: neither runs fp32 matmuls at the
policy's precision). Decode (one query against the
cache) always runs the explicit path, over the first `kv_len` cache positions (a static length
bucket the engine picks per dispatch, docs/design.md section 3), and writes its new key and value
in place (`write_cache`; 16- and 8-bit caches are carried as their bits, `cache_storage`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from dvp_jax.model.blockwise import blockwise_attention
from dvp_jax.model.config import ATTENTION_IMPLS, DTypePolicy, ModelConfig
from dvp_jax.model.layers import RMSNorm, matmul, param, rope
from dvp_jax.sharding import Sharder

# KV-cache layouts: the order of the kv-head and position axes of `[L, b, ., ., h]`, one per
# platform, shared by every program that touches the cache (prefill, insert, decode), so the
# cache is never re-laid out between them. "heads_first" `[L, b, k, S, h]` is the layout both
# decode matmuls take as stored on CPU / GPU (a kv head is a batch dimension of q.k and p.v);
# the TPU compiler wants the positions before the heads inside the scatter and the attention
# and, given heads first, copies each of k and v in and out of the decode loop (a second cache:
# 97 GiB for a 45 GiB cache in the paper config), so on TPU the cache is "positions_first"
# `[L, b, S, k, h]` (docs/design.md section 3).
CACHE_LAYOUTS = ("heads_first", "positions_first")
CACHE_AXES = ("cache_layers", "cache_batch", "act_kv_heads", "cache_seq", "act_head_dim")
_POSITIONS_FIRST_AXES = ("cache_layers", "cache_batch", "cache_seq", "act_kv_heads", "act_head_dim")


def cache_layout(platform: str) -> str:
    """The KV-cache layout of programs on `platform` ("positions_first" on TPU)."""
    return "positions_first" if platform == "tpu" else "heads_first"


def cache_axes(layout: str) -> tuple[str, ...]:
    """The logical axis names of a cache in `layout`."""
    return _POSITIONS_FIRST_AXES if layout == "positions_first" else CACHE_AXES


def cache_shape(cfg: ModelConfig, batch: int, length: int, layout: str) -> tuple[int, ...]:
    """The shape of k (and v) of a cache of `batch` rows and `length` positions."""
    kv, h = cfg.n_kv_heads, cfg.head_dim
    if layout == "positions_first":
        return (cfg.n_layers, batch, length, kv, h)
    return (cfg.n_layers, batch, kv, length, h)


def seq_axis(layout: str) -> int:
    """The position axis of a cache in `layout`."""
    return 2 if layout == "positions_first" else 3


# Backend names (`jax.default_backend()`, or a device's platform) of each fused kernel. JAX's
# cuDNN attention is NVIDIA-only; on a ROCm "gpu" set attention_impl to "xla" or "dot_product".
_GPU_BACKENDS = ("gpu", "cuda")
_TPU_BACKENDS = ("tpu",)
_FUSED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# "auto" runs the blockwise path (no T x T scores) from this many tokens where no fused kernel
# serves the policy: at 2,048 the explicit path's float32 scores are 16 MiB per row and head.
BLOCKWISE_FROM = 2048
# What `jax.nn.dot_product_attention(implementation="cudnn")` raises at trace time when it cannot
# run: NotImplementedError for a shape or dtype the kernel lacks, RuntimeError when cuDNN itself
# is missing or too old ("cuDNN is not detected"), ValueError for a layout it refuses. "auto"
# falls back to the explicit path on any of them; an explicit "cudnn" re-raises.
_KERNEL_REFUSALS = (NotImplementedError, RuntimeError, ValueError)
# The splash kernel's default tiles (BlockSizes.get_default()) are 128 x 128 blocks.
_SPLASH_BLOCK = 128


class KVCache(NamedTuple):
    """Keys and values of every layer: `k, v: [L, b, k, S, h]` (or `[L, b, S, k, h]` in the
    "positions_first" layout of TPU programs, `cache_layout`)."""

    k: jax.Array
    v: jax.Array

    @classmethod
    def zeros(
        cls, cfg: ModelConfig, batch: int, length: int, dtype, layout: str = "heads_first"
    ) -> KVCache:
        shape = cache_shape(cfg, batch, length, layout)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def _masked_softmax(scores, visible, head_dim: int, policy: DTypePolicy):
    """softmax(scores / sqrt(head_dim), masked to `visible`) over the last (key) axis, in the
    compute dtype; `scores` are the float32 q.k products, `visible` broadcasts against them."""
    scores = scores * (head_dim**-0.5)
    # A large finite negative (not -inf): a query with no visible key (a padding row) gets a
    # uniform, finite softmax instead of NaN.
    scores = jnp.where(visible, scores, jnp.finfo(jnp.float32).min)
    return jax.nn.softmax(scores, axis=-1).astype(policy.compute_dtype)


def _masked_softmax_attention(q, k, v, mask, policy: DTypePolicy):
    """softmax(q k^T / sqrt(h) + mask) v with GQA, both matmuls at `policy.precision`.

    Args:
      q: [b, t, k, g, h] queries grouped by kv head.
      k, v: [b, s, k, h].
      mask: [b, t, s] bool, True where the key is visible.
      policy: compute dtype and matmul precision.
    Returns:
      [b, t, k, g, h] in compute dtype.
    """
    h = q.shape[-1]
    # [b, t, k, g, h] x [b, s, k, h] -> [b, k, g, t, s]; scores and softmax in float32.
    scores = jnp.einsum(
        "btkgh,bskh->bkgts", q, k, precision=policy.precision, preferred_element_type=jnp.float32
    )
    probs = _masked_softmax(scores, mask[:, None, None, :, :], h, policy)
    # [b, k, g, t, s] x [b, s, k, h] -> [b, t, k, g, h]
    return matmul("bkgts,bskh->btkgh", probs, v, policy)


def causal_mask(valid: jax.Array) -> jax.Array:
    """[b, t(query), s(key)] bool: the key is at or before the query and is not padding.

    Args:
      valid: [b, t] bool, False on padding.
    """
    t = valid.shape[1]
    causal = jnp.tril(jnp.ones((t, t), bool))
    return causal[None] & valid[:, None, :]


def select_attention_impl(
    impl: str, backend: str, compute_dtype, seq_len: int, head_dim: int
) -> str:
    """The attention kernel that runs: "auto" resolved, an explicit choice checked.

    Args:
      impl: `DTypePolicy.attention_impl`, one of `ATTENTION_IMPLS`.
      backend: the platform name, e.g. `jax.default_backend()`: "cpu", "gpu" / "cuda", "tpu".
      compute_dtype: the policy's compute dtype (the dtype of q, k, v).
      seq_len: T, the query and key length.
      head_dim: h.
    Returns:
      One of "xla", "dot_product", "blockwise", "cudnn", "splash". "auto" gives "cudnn" on a
      GPU and "splash" on a TPU (T and h multiples of 128) for a bfloat16 / float16 compute
      dtype; otherwise (CPU, float32 policies, other shapes) "blockwise" from
      `BLOCKWISE_FROM` tokens, where the explicit path's T x T scores stop fitting (1 GiB per
      row and head at 16k), and "xla" below.
    Raises:
      ValueError: naming the field, for an unknown name, a fused kernel on a backend that cannot
        run it, a fused kernel under a float32 policy, or splash with T not a multiple of 128.
    """
    if impl not in ATTENTION_IMPLS:
        raise ValueError(
            f"DTypePolicy.attention_impl {impl!r} is unknown; allowed: {ATTENTION_IMPLS}"
        )
    fused_dtype = jnp.dtype(compute_dtype) in _FUSED_DTYPES
    if impl == "auto":
        if backend in _GPU_BACKENDS and fused_dtype:
            return "cudnn"
        tiled = seq_len % _SPLASH_BLOCK == 0 and head_dim % _SPLASH_BLOCK == 0
        if backend in _TPU_BACKENDS and fused_dtype and tiled:
            return "splash"
        return "blockwise" if seq_len >= BLOCKWISE_FROM else "xla"
    if impl in ("cudnn", "splash"):
        backends = _GPU_BACKENDS if impl == "cudnn" else _TPU_BACKENDS
        if backend not in backends:
            raise ValueError(
                f"DTypePolicy.attention_impl={impl!r} runs only on backend {backends}, this "
                f"program runs on {backend!r}; use 'auto', 'xla' or 'dot_product'"
            )
        if not fused_dtype:
            raise ValueError(
                f"DTypePolicy.attention_impl={impl!r} needs a bfloat16 or float16 compute "
                f"dtype, the policy computes in {jnp.dtype(compute_dtype).name}: the fused "
                "kernels do not run float32 matmuls at the policy's precision; use 'xla' or "
                "'dot_product' (or 'auto') for a float32 policy"
            )
        if impl == "splash" and seq_len % _SPLASH_BLOCK:
            raise ValueError(
                f"DTypePolicy.attention_impl='splash' needs the sequence length to be a "
                f"multiple of {_SPLASH_BLOCK} (the kernel's block), got {seq_len}; pad the "
                "batch to a multiple or use 'xla'"
            )
    return impl


def full_attention(
    q, k, v, valid, policy: DTypePolicy, backend: str | None = None, sharder: Sharder | None = None
):
    """Causal, key-padded GQA attention of a whole sequence by the policy's kernel.

    Computes the module docstring's equation with the kernel `select_attention_impl` picks for
    `policy.attention_impl`; with "auto", a call cuDNN refuses at trace time (a head dim over
    its limit, a missing or old cuDNN: `_KERNEL_REFUSALS`) falls back to "xla" with a warning.

    Args:
      q: [b, t, n, h] queries (head n uses KV head n // g).
      k, v: [b, t, k, h] keys and values.
      valid: [b, t] bool, False on padding keys.
      policy: compute dtype, matmul precision, `attention_impl` and `attention_block`.
      backend: platform name; default the platform of `sharder`'s mesh, else
        `jax.default_backend()` (a program compiled for a TPU topology from a CPU host runs
        the TPU choice).
      sharder: the mesh and rules q, k, v are sharded by; the splash kernel runs per shard
        under `shard_map` on them (a Mosaic kernel cannot be partitioned by XLA).
    Returns:
      [b, t, n, h] in the compute dtype.
    """
    b, t, n, h = q.shape
    backend = backend or (sharder.platform if sharder is not None else jax.default_backend())
    impl = select_attention_impl(policy.attention_impl, backend, policy.compute_dtype, t, h)
    if impl == "dot_product":
        return _dot_product_attention(q, k, v, valid, policy.precision)
    if impl == "blockwise":
        return blockwise_attention(q, k, v, valid, policy.precision, policy.attention_block)
    if impl == "splash":
        return _splash_attention(q, k, v, valid, sharder, policy.attention_block)
    if impl == "cudnn":
        try:
            return _cudnn_attention(q, k, v, valid)
        except _KERNEL_REFUSALS as err:
            if policy.attention_impl != "auto":
                raise
            logging.warning(
                "attention_impl 'auto': cuDNN attention refused q %s, k %s (%s); running the "
                "explicit path, which holds the T x T scores",
                q.shape,
                k.shape,
                err,
            )
    kv = k.shape[2]
    grouped = q.reshape(b, t, kv, n // kv, h)
    out = _masked_softmax_attention(grouped, k, v, causal_mask(valid), policy)
    return out.reshape(b, t, n, h)


def _matmul_precision(precision: jax.lax.Precision | None):
    """A scoped `jax.default_matmul_precision` for code without a precision argument.

    Only the trace of the `with` body sees it (each dot records its precision when it is
    traced, and its transposes reuse it), so nothing global changes.
    """
    if precision is None:
        return contextlib.nullcontext()
    return jax.default_matmul_precision(jax.lax.Precision(precision).name.lower())


def _dot_product_attention(q, k, v, valid, precision):
    """`jax.nn.dot_product_attention` on XLA with the explicit path's mask semantics.

    `is_causal` and the key mask `valid[:, None, None, :]` (broadcast over heads and queries)
    combine into `causal_mask(valid)`; a query with no visible key gets the same uniform
    softmax as the explicit path (every logit the same large negative number). The function's
    float32 q.k and p.v matmuls take `precision` (bf16 q.k runs its BF16_BF16_F32 algorithm).

    Args:
      q: [b, t, n, h]; k, v: [b, t, k, h]; valid: [b, t] bool.
      precision: the policy's matmul precision.
    Returns:
      [b, t, n, h] in q's dtype.
    """
    with _matmul_precision(precision):
        return jax.nn.dot_product_attention(
            q, k, v, mask=valid[:, None, None, :], is_causal=True, implementation="xla"
        )


def _cudnn_attention(q, k, v, valid, implementation: str = "cudnn"):
    """cuDNN flash attention; key padding as per-row key lengths (right padding only).

    cuDNN's PADDING_CAUSAL mask with key lengths `L = sum(valid)` and query length T equals
    `causal_mask(valid)` when each row's valid tokens are the prefix `[0, L)`. Other rows
    (left padding) come out NaN. A row with no valid token gets `L = 1` (its queries attend
    to key 0; cuDNN is not asked for an empty softmax): finite, and its output is padding.

    Args:
      q: [b, t, n, h]; k, v: [b, t, k, h] in bfloat16 / float16; valid: [b, t] bool.
      implementation: "cudnn"; tests pass "xla" to check these semantics on CPU (the same
        `jax.nn.dot_product_attention` contract, computed by XLA).
    Returns:
      [b, t, n, h] in q's dtype.
    """
    t = valid.shape[1]
    lengths = jnp.sum(valid, axis=-1, dtype=jnp.int32)  # [b]
    prefix = jnp.all(valid == (jnp.arange(t)[None, :] < lengths[:, None]), axis=-1)  # [b]
    out = jax.nn.dot_product_attention(
        q,
        k,
        v,
        is_causal=True,
        key_value_seq_lengths=jnp.maximum(lengths, 1),
        implementation=implementation,
    )
    return jnp.where(prefix[:, None, None, None], out, jnp.nan)


def splash_block(seq_len: int, block: int = 0) -> int:
    """The splash kernel's query / key tile for sequences of `seq_len` tokens.

    `block` > 0 is used as given (it must divide T and be a multiple of 128). 0 picks the
    largest of 512, 256, 128 that divides T: the kernel's own default of 128 x 128 tiles runs
    16x the grid steps of 512 x 512 at 16k tokens, and MaxText's defaults for long sequences
    are 512 (docs/design.md section 3 has the compiler's cost figures).
    """
    if block:
        if block % _SPLASH_BLOCK or seq_len % block:
            raise ValueError(
                f"DTypePolicy.attention_block={block} must be a multiple of {_SPLASH_BLOCK} "
                f"that divides the sequence length {seq_len}; 0 chooses one"
            )
        return block
    return next(b for b in (512, 256, _SPLASH_BLOCK) if seq_len % b == 0)


def _splash_attention(q, k, v, valid, sharder=None, block: int = 0, interpret: bool = False):
    """The Pallas splash-attention kernel (TPU); padding as segment ids; per shard on a mesh.

    A causal `MultiHeadMask` of T x T blocks, and segment ids `valid` (1 real, 0 padding):
    a query attends to keys at or before it in its own segment, which is `causal_mask(valid)`
    on valid queries, and every row keeps its diagonal (the kernel forbids empty rows). The
    kernel does not scale the scores, so q is scaled by 1/sqrt(h) in float32 and cast back to
    its dtype first (one extra rounding of q in bf16, as MaxText does).

    On a mesh the kernel runs under `shard_map`: rows split like the activations' batch axis,
    heads like their head axis (the `sharder`'s specs for q and k), one kernel per shard over
    its local heads. Query head n reads KV head n // g; when the KV heads cannot be split like
    the query heads (fewer KV heads than tensor shards), each query head gets its own copy of
    its KV head first, so every shard holds the KV heads its queries read.

    Args:
      q: [b, t, n, h]; k, v: [b, t, k, h]; valid: [b, t] bool; T a multiple of 128.
      sharder: the mesh and rules of q, k, v (None or no mesh: one kernel call).
      block: query / key tile (`splash_block`).
      interpret: run the kernel in the Pallas interpreter (tests, on CPU).
    Returns:
      [b, t, n, h] in q's dtype.
    """
    b, t, n, h = q.shape
    q = (q.astype(jnp.float32) * np.float32(h**-0.5)).astype(q.dtype)
    local = functools.partial(_splash_local, block=splash_block(t, block), interpret=interpret)
    if sharder is None or sharder.mesh is None or sharder.mesh.size == 1:
        return local(q, k, v, valid)
    q_spec = sharder.spec(("act_batch", None, "act_heads", None), q.shape)
    kv_spec = sharder.spec(("act_batch", None, "act_kv_heads", None), k.shape)
    if kv_spec[2] != q_spec[2]:
        k, v = (jnp.repeat(x, n // k.shape[2], axis=2) for x in (k, v))
        kv_spec = q_spec
    return jax.shard_map(
        local,
        mesh=sharder.mesh,
        in_specs=(q_spec, kv_spec, kv_spec, PartitionSpec(q_spec[0], None)),
        out_specs=q_spec,
        check_vma=False,
    )(q, k, v, valid)


def _splash_local(q, k, v, valid, *, block: int, interpret: bool):
    """One splash kernel over the rows and heads it is given (q already scaled)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as splash,
    )
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_mask as splash_mask,
    )

    _, t, n, _ = q.shape
    mask = splash_mask.MultiHeadMask([splash_mask.CausalMask((t, t))] * n)
    sizes = splash.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=block,
        block_kv_dq=block,
    )
    # The kernel takes one row's heads first: [n, t, h] queries, [k, t, h] keys and values.
    heads_first = (0, 2, 1, 3)

    def run(q, k, v, segments):
        # Built inside the traced function: the kernel holds its mask tables as arrays of the
        # trace it is made in.
        kernel = splash.make_splash_mha(
            mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret
        )
        ids = splash.SegmentIds(q=segments, kv=segments)
        return jax.vmap(kernel)(q, k, v, segment_ids=ids)

    q, k, v = (x.transpose(heads_first) for x in (q, k, v))
    out = _at_default_precision(run)(q, k, v, valid.astype(jnp.int32))
    return out.transpose(heads_first)


def _at_default_precision(fn):
    """`fn(q, k, v, segments)` and its backward pass traced at the DEFAULT matmul precision.

    The splash kernel's dots take the global default precision; a "highest" default (set for
    fp32 work elsewhere, as the tests do) makes Mosaic refuse the bf16 kernel ("Bad lhs
    type"). 16-bit inputs run one pass whatever the precision, so nothing is lost. The
    backward pass is traced when the caller differentiates, outside any scope set here, so
    the scope goes into a custom VJP around both passes (the integer segments get no
    cotangent).
    """

    @jax.custom_vjp
    def wrapped(q, k, v, segments):
        with jax.default_matmul_precision("default"):
            return fn(q, k, v, segments)

    def forward(q, k, v, segments):
        with jax.default_matmul_precision("default"):
            return jax.vjp(lambda q, k, v: fn(q, k, v, segments), q, k, v)

    def backward(vjp, cotangent):
        with jax.default_matmul_precision("default"):
            return (*vjp(cotangent), None)

    wrapped.defvjp(forward, backward)
    return wrapped


class Attention(nnx.Module):
    """Grouped-query attention (Qwen3): q/k/v projections, per-head q/k RMSNorm, RoPE, output.

    Args:
      cfg: architecture.
      policy: dtypes and matmul precision.
      sharder: activation constraints.
      rngs: initialisation randomness.
      layers: None for one layer's parameters; L for a stack with a leading `[L]` axis.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        policy: DTypePolicy,
        sharder: Sharder,
        *,
        rngs: nnx.Rngs,
        layers: int | None = None,
    ):
        d, n, k, h, std = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.init_std
        dt, ls = policy.param_dtype, layers
        self.q_proj = param(rngs, (d, n, h), ("embed", "q_heads", "head_dim"), std, dt, ls)
        self.k_proj = param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), std, dt, ls)
        self.v_proj = param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), std, dt, ls)
        self.o_proj = param(rngs, (n, h, d), ("q_heads", "head_dim", "embed"), std, dt, ls)
        self.q_norm = RMSNorm(h, cfg.rms_norm_eps, policy, "head_dim", ls)
        self.k_norm = RMSNorm(h, cfg.rms_norm_eps, policy, "head_dim", ls)
        self.cfg = cfg
        self.policy = policy
        self.sharder = sharder

    def _qkv(self, x, positions):
        p = self.policy
        # [b, t, d] x [d, n, h] -> [b, t, n, h]
        q = matmul("btd,dnh->btnh", x, self.q_proj[...], p)
        # [b, t, d] x [d, k, h] -> [b, t, k, h]
        k = matmul("btd,dkh->btkh", x, self.k_proj[...], p)
        v = matmul("btd,dkh->btkh", x, self.v_proj[...], p)
        q = rope(self.q_norm(q), positions, self.cfg.rope_theta)
        k = rope(self.k_norm(k), positions, self.cfg.rope_theta)
        q = self.sharder.constrain(q, ("act_batch", "act_seq", "act_heads", "act_head_dim"))
        k = self.sharder.constrain(k, ("act_batch", "act_seq", "act_kv_heads", "act_head_dim"))
        v = self.sharder.constrain(v, ("act_batch", "act_seq", "act_kv_heads", "act_head_dim"))
        return q, k, v

    def _out(self, attn):
        b, t = attn.shape[:2]
        attn = attn.reshape(b, t, self.cfg.n_heads, self.cfg.head_dim)
        # [b, t, n, h] x [n, h, d] -> [b, t, d]
        return matmul("btnh,nhd->btd", attn, self.o_proj[...], self.policy)

    def _group(self, q):
        b, t = q.shape[:2]
        return q.reshape(b, t, self.cfg.n_kv_heads, self.cfg.group_size, self.cfg.head_dim)

    def __call__(self, x, positions, valid):
        """Full-sequence causal attention by the policy's kernel (`full_attention`).

        Args:
          x: [b, t, d]; positions: [b, t]; valid: [b, t] bool, False on padding keys.
        Returns:
          (out [b, t, d], (k, v) each [b, t, k, h]) so that prefill can fill a cache.
        """
        q, k, v = self._qkv(x, positions)
        attn = full_attention(q, k, v, valid, self.policy, sharder=self.sharder)
        return self._out(attn), (k, v)

    def decode(self, x, positions, k_all, v_all, layer, kv_len: int | None = None):
        """One new token per row, attending to the live prefix of the cache.

        Args:
          x: [b, 1, d] the new token's activations; positions: [b] its position (= cache slot).
          k_all, v_all: [L, b, k, S, h] the whole stacked cache, stored as `cache_storage`
            (the bits of a 16- or 8-bit cache dtype, the values of a float32 one).
          layer: [] int32 (traced under `nnx.scan`) or int, this layer's index in the cache.
          kv_len: static number of leading cache positions attended to (default S). Rows whose
            `positions` are >= kv_len get wrong outputs: the caller picks kv_len above every
            live row's position (`RolloutEngine` picks a length bucket per dispatch).
        Returns:
          (out [b, 1, d], k_all, v_all) with the new key/value written at
          `[layer, row, :, positions[row]]` (`write_cache`, in place in the donated cache).
        """
        q, k, v = self._qkv(x, positions[:, None])
        dtype, layout = self.policy.cache_dtype, cache_layout(self.sharder.platform)
        k_all = write_cache(k_all, layer, positions, k[:, 0], dtype, layout)
        v_all = write_cache(v_all, layer, positions, v[:, 0], dtype, layout)
        kv_len = k_all.shape[seq_axis(layout)] if kv_len is None else kv_len
        cd, p = self.policy.compute_dtype, self.policy.precision
        # [b, k, s, h] heads first, [b, s, k, h] positions first: read in the stored layout.
        keys = from_storage(read_cache(k_all, layer, kv_len, layout), dtype).astype(cd)
        values = from_storage(read_cache(v_all, layer, kv_len, layout), dtype).astype(cd)
        kv = "bksh" if layout == "heads_first" else "bskh"
        q = self._group(q)[:, 0]  # [b, k, g, h]
        # [b, k, g, h] x keys -> [b, k, g, s]: kv head and row are batch dimensions; scores and
        # softmax in float32.
        scores = jnp.einsum(
            f"bkgh,{kv}->bkgs", q, keys, precision=p, preferred_element_type=jnp.float32
        )
        visible = jnp.arange(kv_len)[None, :] <= positions[:, None]  # [b, s]
        probs = _masked_softmax(scores, visible[:, None, None, :], q.shape[-1], self.policy)
        # [b, k, g, s] x values -> [b, k, g, h] -> [b, 1, k, g, h]
        attn = matmul(f"bkgs,{kv}->bkgh", probs, values, self.policy)[:, None]
        return self._out(attn), k_all, v_all


# A KV cache of a 16- or 8-bit float dtype is stored and written as the unsigned integers of the
# same width (its bits): XLA's CPU backend has no 16-/8-bit float scatter and would convert the
# whole stacked [L, b, k, S, h] cache to float32 and back around every layer's write (4 full
# passes over the cache per layer and decode step). An integer scatter is native on every
# backend and updates the donated buffer in place; readers bitcast the slice they read, which
# fuses into the attention. float32 caches are stored as they are.
def cache_storage(dtype) -> jnp.dtype:
    """The dtype a KV cache of `dtype` is stored in during decode (`write_cache`)."""
    dtype = jnp.dtype(dtype)
    return jnp.dtype(f"uint{8 * dtype.itemsize}") if dtype.itemsize < 4 else dtype


def to_storage(x: jax.Array, dtype) -> jax.Array:
    """Cache values (any float dtype) -> `cache_storage(dtype)` (rounded to dtype, bitcast);
    an array already in `cache_storage(dtype)` is returned as is."""
    storage = cache_storage(dtype)
    if x.dtype == storage:
        return x
    x = x.astype(dtype)
    return x if storage == x.dtype else jax.lax.bitcast_convert_type(x, storage)


def from_storage(x: jax.Array, dtype) -> jax.Array:
    """`cache_storage(dtype)` (or already `dtype`) -> values in `dtype`."""
    dtype = jnp.dtype(dtype)
    return x if x.dtype == dtype else jax.lax.bitcast_convert_type(x, dtype)


def write_cache(
    cache: jax.Array, layer, positions: jax.Array, new: jax.Array, dtype, layout="heads_first"
) -> jax.Array:
    """`cache[layer, row, :, positions[row]] = new[row]` for every row, in place (heads first;
    `cache[layer, row, positions[row]]` positions first).

    Args:
      cache: [L, b, k, S, h] (or [L, b, S, k, h]) in `cache_storage(dtype)`.
      layer: [] int (traced) layer index.
      positions: [b] int32 write positions.
      new: [b, k, h] the new keys or values (rounded to `dtype`).
      dtype: the cache dtype.
      layout: one of `CACHE_LAYOUTS`.
    Returns:
      The updated cache (the same buffer when donated).
    """
    rows = jnp.arange(cache.shape[1])
    # The advanced indices (layer, rows, positions) broadcast to [b] and lead the indexed
    # shape, so the update is [b, k, h]: one scatter of b rows.
    if layout == "positions_first":
        return cache.at[layer, rows, positions].set(to_storage(new, dtype))
    return cache.at[layer, rows, :, positions].set(to_storage(new, dtype))


def read_cache(cache: jax.Array, layer, kv_len: int, layout: str = "heads_first") -> jax.Array:
    """The first `kv_len` positions of layer `layer` (traced), static kv_len: [b, k, kv_len, h]
    heads first, [b, kv_len, k, h] positions first."""
    size = list(cache.shape)
    size[0], size[seq_axis(layout)] = 1, kv_len
    return jax.lax.dynamic_slice(cache, (layer, 0, 0, 0, 0), size)[0]
