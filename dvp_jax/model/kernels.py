"""The library kernels `attention.full_attention` hands a whole sequence to.

* `dot_product_attention`: `jax.nn.dot_product_attention` on XLA ("dot_product"), its matmuls at
  the policy's precision through a scoped default (the function takes no precision argument).
* `cudnn_attention`: cuDNN flash attention ("cudnn"), NVIDIA GPU, 16-bit compute: one
  sequence per row as per-row key lengths (exact for right padding; other rows come out NaN,
  loudly); packed rows as a same-segment mask (a [b, 1, t, t] bias cuDNN adds to the scores).
* `splash_attention`: the Pallas splash kernel ("splash"), TPU, 16-bit compute, T a multiple of
  128, padding and packed sequences as segment ids; per shard under `shard_map` on a mesh.

Each takes q `[b, t, n, h]`, k, v `[b, t, k, h]` and segment ids `[b, t]` (int32, 0 padding; or
bool valid, one segment per row) and computes the masked softmax attention of
`dvp_jax/model/attention.py` (its explicit path is the reference). Which kernel runs, and when
one is refused, is decided there (`select_attention_impl`), not here. `per_shard` runs a kernel
per (rows, heads) shard of a mesh (splash, and the blockwise path's per-row block skipping).
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

# The splash kernel's default tiles (BlockSizes.get_default()) are 128 x 128 blocks.
SPLASH_BLOCK = 128


def _matmul_precision(precision: jax.lax.Precision | None):
    """A scoped `jax.default_matmul_precision` for code without a precision argument.

    Only the trace of the `with` body sees it (each dot records its precision when it is
    traced, and its transposes reuse it), so nothing global changes.
    """
    if precision is None:
        return contextlib.nullcontext()
    return jax.default_matmul_precision(jax.lax.Precision(precision).name.lower())


def same_segment(segment_ids) -> jax.Array:
    """[b, 1, t(query), s(key)] bool: the key is in the query's segment and not padding (the
    non-causal part of `attention.causal_mask`, shaped for `jax.nn.dot_product_attention`)."""
    seg = jnp.asarray(segment_ids).astype(jnp.int32)
    return ((seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] != 0))[:, None]


def dot_product_attention(q, k, v, segment_ids, precision):
    """`jax.nn.dot_product_attention` on XLA with the explicit path's mask semantics.

    `is_causal` and the mask `same_segment(segment_ids)` combine into
    `attention.causal_mask(segment_ids)`; a query with no visible key gets the same uniform
    softmax as the explicit path (every logit the same large negative number). The function's
    float32 q.k and p.v matmuls take `precision` (bf16 q.k runs its BF16_BF16_F32 algorithm).

    Args:
      q: [b, t, n, h]; k, v: [b, t, k, h]; segment_ids: [b, t] int32 (or bool valid).
      precision: the policy's matmul precision.
    Returns:
      [b, t, n, h] in q's dtype.
    """
    with _matmul_precision(precision):
        return jax.nn.dot_product_attention(
            q, k, v, mask=same_segment(segment_ids), is_causal=True, implementation="xla"
        )


def cudnn_attention(q, k, v, segment_ids, implementation: str = "cudnn"):
    """cuDNN flash attention: key padding as per-row key lengths (bool valid, right padding
    only), packed rows as a same-segment mask.

    Bool `valid` (one sequence per row): cuDNN's PADDING_CAUSAL mask with key lengths
    `L = sum(valid)` and query length T equals `attention.causal_mask(valid)` when each row's
    valid tokens are the prefix `[0, L)`. Other rows (left padding) come out NaN. A row with no
    valid token gets `L = 1` (its queries attend to key 0; cuDNN is not asked for an empty
    softmax): finite, and its output is padding.
    Int segment ids (packed rows): the causal mask and `same_segment`, which cuDNN takes as an
    additive [b, 1, t, t] bias (JAX turns a bool mask into one): exact for any segment pattern,
    at the cost of that bias in memory (t^2 per row: fine at the GPU configs' lengths).

    Args:
      q: [b, t, n, h]; k, v: [b, t, k, h] in bfloat16 / float16; segment_ids: [b, t] bool
        valid or int32 segment ids.
      implementation: "cudnn"; tests pass "xla" to check these semantics on CPU (the same
        `jax.nn.dot_product_attention` contract, computed by XLA).
    Returns:
      [b, t, n, h] in q's dtype.
    """
    if jnp.asarray(segment_ids).dtype != jnp.bool_:
        return jax.nn.dot_product_attention(
            q,
            k,
            v,
            mask=same_segment(segment_ids),
            is_causal=True,
            implementation=implementation,
        )
    valid = segment_ids
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
        if block % SPLASH_BLOCK or seq_len % block:
            raise ValueError(
                f"DTypePolicy.attention_block={block} must be a multiple of {SPLASH_BLOCK} "
                f"that divides the sequence length {seq_len}; 0 chooses one"
            )
        return block
    return next(b for b in (512, 256, SPLASH_BLOCK) if seq_len % b == 0)


def splash_attention(q, k, v, segment_ids, sharder=None, block: int = 0, interpret: bool = False):
    """The Pallas splash-attention kernel (TPU); padding and packed sequences as segment ids;
    per shard on a mesh (`per_shard`).

    A causal `MultiHeadMask` of T x T blocks, and the segment ids (int32, 0 padding; a bool
    valid is 1 real, 0 padding): a query attends to keys at or before it in its own segment,
    which is `attention.causal_mask(segment_ids)` on real queries, and every row keeps its
    diagonal (the kernel forbids empty rows; padding queries attend to earlier padding). The
    kernel does not scale the scores, so q is scaled by 1/sqrt(h) in float32 and cast back to
    its dtype first (one extra rounding of q in bf16, as MaxText does).

    Args:
      q: [b, t, n, h]; k, v: [b, t, k, h]; segment_ids: [b, t]; T a multiple of 128.
      sharder: the mesh and rules of q, k, v (None or no mesh: one kernel call).
      block: query / key tile (`splash_block`).
      interpret: run the kernel in the Pallas interpreter (tests, on CPU).
    Returns:
      [b, t, n, h] in q's dtype.
    """
    b, t, n, h = q.shape
    q = (q.astype(jnp.float32) * np.float32(h**-0.5)).astype(q.dtype)
    local = functools.partial(_splash_local, block=splash_block(t, block), interpret=interpret)
    return per_shard(local, q, k, v, segment_ids, sharder)


def per_shard(local, q, k, v, segment_ids, sharder=None):
    """`local(q, k, v, segment_ids)` once per (rows, heads) shard of `sharder`'s mesh.

    A Mosaic kernel cannot be partitioned by XLA, and a loop over rows must not run over a
    sharded axis, so on a mesh the kernel runs under `shard_map`: rows split like the
    activations' batch axis, heads like their head axis (the `sharder`'s specs for q and k),
    one call per shard over its local rows and heads. Query head n reads KV head n // g; when
    the KV heads cannot be split like the query heads (fewer KV heads than tensor shards), each
    query head gets its own copy of its KV head first, so every shard holds the KV heads its
    queries read. Without a mesh (or on one device): one call.
    """
    n = q.shape[2]
    segment_ids = jnp.asarray(segment_ids).astype(jnp.int32)
    if sharder is None or sharder.mesh is None or sharder.mesh.size == 1:
        return local(q, k, v, segment_ids)
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
    )(q, k, v, segment_ids)


def _splash_local(q, k, v, segment_ids, *, block: int, interpret: bool):
    """One splash kernel over the rows and heads it is given (q already scaled)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as splash,
    )
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_mask as splash_mask,
    )

    _, t, n, _ = q.shape
    mask = splash_mask.MultiHeadMask([splash_mask.CausalMask((t, t))] * n)
    # One tile for every block size of the forward and both backward kernels.
    tiles = ("q", "kv", "kv_compute", "q_dkv", "kv_dkv", "kv_dkv_compute", "q_dq", "kv_dq")
    sizes = splash.BlockSizes(**{f"block_{name}": block for name in tiles})
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
    out = _at_default_precision(run)(q, k, v, segment_ids)
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
