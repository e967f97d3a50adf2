"""Pallas decode attention over a paged KV cache (`model/paged.py`): the TPU kernel.

`paged_decode_attention` runs one program per slot; each copies only the slot's live pages
`j < ceil(length / ps)` of its layer (all the shard's kv heads: a `[ps, k h]` tile) from HBM
into VMEM (two buffers: page j + 1 is in flight while page j is used) and keeps a running
softmax per kv head (max m, sum l, accumulator) over them, so a decode step reads each
response's own tokens and no page past them. The layer index, the lengths and the page table
are scalar-prefetched: the kernel reads the stacked `[L, P, ps, k h]` cache in place, inside
the layer scan, without slicing a layer out first. Its dots run in float32 on values rounded to
the compute dtype (the probabilities unnormalised: `_kernel`). It computes what
`paged.ragged_attention` (XLA) computes, to one ulp of the compute dtype; tests run it in
Pallas's TPU interpret mode on CPU and compare, and `dvp_jax.aot` compiles it for v5p. The GPU
has no kernel here yet: paged decode runs the ragged XLA path there (JAX's
`pallas.ops.gpu.paged_attention` is the candidate; it needs a GPU to test).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec

from dvp_jax.model.paged import paged_cache_spec

_LOWEST = float(jnp.finfo(jnp.float32).min)


def _kernel(
    lengths_ref, table_ref, layer_ref, q_ref, k_hbm, v_hbm, o_ref, k_buf, v_buf, sem, *, dtype
):
    """One slot: q `[k, g, h]` against the slot's live pages `[ps, k h]` of `k_hbm`, `v_hbm`."""
    b, layer = pl.program_id(0), layer_ref[0]
    page_size = k_buf.shape[1]
    kv, g, h = q_ref.shape
    length = lengths_ref[b]
    n = (length + page_size - 1) // page_size

    def copies(j, buf):
        page = table_ref[b, j]
        return (
            pltpu.make_async_copy(k_hbm.at[layer, page], k_buf.at[buf], sem.at[0, buf]),
            pltpu.make_async_copy(v_hbm.at[layer, page], v_buf.at[buf], sem.at[1, buf]),
        )

    @pl.when(n > 0)
    def _():
        for c in copies(0, 0):
            c.start()

    # The dots run in float32 on values of the compute dtype (exact products, as the XLA path's
    # bf16 dots with float32 accumulation; Mosaic refused bf16 operands of some shapes: "Bad lhs
    # type" at g = 2).
    def load(buf_ref, buf, head):  # one head's [ps, h]: the stored bits -> the cache dtype
        x = buf_ref[buf, :, pl.ds(head * h, h)]
        if x.dtype != jnp.dtype(dtype):
            x = jax.lax.bitcast_convert_type(x, dtype)
        return x.astype(q_ref.dtype).astype(jnp.float32)

    def body(j, carry):
        buf = j % 2
        for c in copies(j, buf):
            c.wait()

        @pl.when(j + 1 < n)
        def _():
            for c in copies(j + 1, 1 - buf):
                c.start()

        out = []
        for head in range(kv):  # static: the shard's kv heads
            m, total, acc = carry[head]
            q = q_ref[head].astype(jnp.float32)  # [g, h]
            keys, values = load(k_buf, buf, head), load(v_buf, buf, head)
            # [g, h] x [s, h] -> [g, s] float32 scores.
            scores = jax.lax.dot_general(
                q, keys, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
            )
            scores = scores * h**-0.5
            position = j * page_size + jax.lax.broadcasted_iota(jnp.int32, scores.shape, 1)
            scores = jnp.where(position < length, scores, _LOWEST)
            m_new = jnp.maximum(m, jnp.max(scores, axis=1, keepdims=True))
            probs = jnp.exp(scores - m_new)
            alpha = jnp.exp(m - m_new)
            # [g, s] x [s, h] -> [g, h] on the probabilities rounded to the compute dtype before
            # normalising (exp(score - running max), in (0, 1]); the sum `total` and the final
            # division stay float32. The XLA paths round the normalised probabilities instead
            # (they divide by the slot's sum first), so in bfloat16 the two agree to one bf16
            # ulp of the output, not bit for bit; in float32 the rounding is the identity.
            rounded = probs.astype(q_ref.dtype).astype(jnp.float32)
            pv = jnp.dot(rounded, values, preferred_element_type=jnp.float32)
            total = alpha * total + jnp.sum(probs, axis=1, keepdims=True)
            out.append((m_new, total, alpha * acc + pv))
        return tuple(out)

    init = tuple(
        (
            jnp.full((g, 1), _LOWEST, jnp.float32),
            jnp.zeros((g, 1), jnp.float32),
            jnp.zeros((g, h), jnp.float32),
        )
        for _ in range(kv)
    )
    final = jax.lax.fori_loop(0, n, body, init)
    for head, (_, total, acc) in enumerate(final):
        o_ref[head] = (acc / jnp.maximum(total, 1e-30)).astype(o_ref.dtype)


def _local(q, k_all, v_all, layer, table, lengths, *, dtype, interpret):
    b, kv, g, h = q.shape
    page_size = k_all.shape[2]
    q_spec = pl.BlockSpec((None, kv, g, h), lambda i, *_: (i, 0, 0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(b,),
        in_specs=[q_spec, pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=q_spec,
        scratch_shapes=[
            pltpu.VMEM((2, page_size, kv * h), k_all.dtype),
            pltpu.VMEM((2, page_size, kv * h), v_all.dtype),
            pltpu.SemaphoreType.DMA((2, 2)),
        ],
    )
    return pl.pallas_call(
        functools.partial(_kernel, dtype=dtype),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="paged_decode_attention",
    )(lengths, table, jnp.reshape(layer, (1,)).astype(jnp.int32), q, k_all, v_all)


def paged_decode_attention(q, k_all, v_all, layer, table, lengths, dtype, sharder=None):
    """Decode attention of each slot over its own pages (the module docstring), Pallas TPU.

    Args:
      q: `[B, k, g, h]` queries grouped by kv head (compute dtype).
      k_all, v_all: `[L, P, ps, k h]` the paged cache, stored as `kv_cache.cache_storage`
        of `dtype` (a 16-bit cache as its bits; a float32 one as is).
      layer: [] int32 (traced) the layer read.
      table: `[B, C]` int32 page ids (`paged.Pages.table`).
      lengths: `[B]` int32 positions each slot attends to (0: the slot's output is 0).
      dtype: the cache dtype.
      sharder: the mesh and rules; the kernel runs per shard under `shard_map` (kv heads split
        like the cache's, `paged.paged_cache_spec`; slots like the activations' batch). On a
        CPU mesh it runs in Pallas's TPU interpret mode (tests).
    Returns:
      `[B, k, g, h]` in q's dtype.
    """
    platform = sharder.platform if sharder is not None else jax.default_backend()
    local = functools.partial(_local, dtype=jnp.dtype(dtype), interpret=platform != "tpu")
    # On a mesh the kernel runs under `shard_map` even on one device: lowered outside it for a
    # TPU topology from a CPU host, Pallas asks this host's devices for the TPU kind.
    if sharder is None or sharder.mesh is None:
        return local(q, k_all, v_all, layer, table, lengths)
    # q's kv-head axis and the cache's merged one split by the same rule on k
    # (`paged.paged_cache_spec`): over whole kv heads where the tensor axis divides k, else
    # whole on every shard, where each shard then runs every kv head (the same bytes per chip
    # as giving each shard its own q heads would read: a page's copy is its whole `[ps, k h]`
    # tile either way; only the dots are repeated).
    q_spec = sharder.spec(("act_batch", "act_kv_heads", None, None), q.shape)
    kv_spec = paged_cache_spec(sharder, k_all.shape, q.shape[1])
    return jax.shard_map(
        local,
        mesh=sharder.mesh,
        in_specs=(
            q_spec,
            kv_spec,
            kv_spec,
            PartitionSpec(),
            PartitionSpec(q_spec[0], None),
            PartitionSpec(q_spec[0]),
        ),
        out_specs=q_spec,
        check_vma=False,
    )(q, k_all, v_all, layer, table, lengths)
