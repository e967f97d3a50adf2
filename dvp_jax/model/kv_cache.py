"""The functional KV cache of the dense decode: its layouts, shape, storage dtype, writes and reads.

The cache is `k, v: [L, b, k, S, h]` (kv heads before positions: the layout both decode matmuls
read as stored), `[L, b, S, k, h]` on TPU (`cache_layout`); rows are right-padded and a 16- or
8-bit cache is stored as its bits (`cache_storage`). `attention.Attention.decode` writes and
reads it; the engine (`rollout/`) allocates and shards it. The paged pool is `paged.py`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dvp_jax.model.config import ModelConfig

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
