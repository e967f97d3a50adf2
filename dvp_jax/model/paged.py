"""A paged KV cache and decode attention over each slot's own live pages.

The cache is a pool of P pages of `page_size` (ps) positions shared by the B decode slots:
`k, v: [L, P, ps, k h]` (kv heads and head dim as one axis), stored as
`kv_cache.cache_storage`. Positions come before kv heads for the reason the dense cache is
positions first on TPU (`kv_cache.cache_layout`): with the heads first the TPU compiler copies
k and v in and out of the decode loop (97 GiB of temporaries for the paper config's 45 GiB
pool). Heads and head dim are one axis so that a page is a `[ps, k h]` tile the TPU kernel
copies whole and slices per head at multiples of 128 lanes (with `[ps, k, h]` the compiler
tiles the small k axis and a per-head copy is refused as unaligned).

`Pages` maps slot b's j-th page (positions `[j ps, (j + 1) ps)`) to a page id; a slot takes a
page when its response reaches it (`allocate`) and returns all of them when it finishes
(`release`), so the pool holds what is live rather than B full-length rows. Decode attention
for slot b reads only pages `j < ceil(length_b / ps)`:

* `ragged_attention` (XLA, every backend): the live pages of all slots as one flat list, bounded
  by a static `live_pages` bucket; the scores of a slot's pages share one softmax (its max and
  sum are segment reductions over the list), and each page's p.v is summed into its slot:
  out_b = sum_{j of b} p_j v_j. Work and bytes grow with the live tokens, not with B x the
  longest slot.
* `decode_kernels.paged_decode_attention` (Pallas, TPU): the same per slot with a running
  softmax, copying only the live pages into VMEM.

Dense decode (`attention.Attention.decode`) is the reference both are tested against. Nothing
here picks pages for a request or refills slots: `rollout/decode.py` does, on the device.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec

from dvp_jax.model.config import ModelConfig
from dvp_jax.sharding import Sharder

# The logical axes of a paged cache `[L, P, ps, k h]`: pages are not sharded (any slot may own
# any page); kv heads split like the dense cache's, whole heads only (`paged_cache_spec`).
PAGED_AXES = ("cache_layers", None, None, "act_kv_heads")
# How decode attention reads the pages: the Pallas kernel or the ragged XLA path.
PAGED_IMPLS = ("kernel", "xla")


class PageView(NamedTuple):
    """What paged decode attention reads besides the cache (`Transformer.decode(pages=)`).

    Attributes:
      table: `[B, C]` int32 page ids (`Pages.table`).
      lengths: `[B]` int32 positions each slot attends to, the new token's included (0 for a
        finished slot).
      live_pages: static bound on the slots' live pages together (the ragged XLA path's size).
      impl: one of `PAGED_IMPLS` (static).
    """

    table: jax.Array
    lengths: jax.Array
    live_pages: int
    impl: str


@struct.dataclass
class Pages:
    """The page pool's bookkeeping (B slots, C = pages per slot, P pages).

    Attributes:
      table: `[B, C]` int32 page id of each slot's j-th page, -1 where it holds none.
      used: `[P]` bool, True for a page some slot holds.
      preempted: `[B]` bool, True for a slot that found the pool empty and was stopped (its
        request must be decoded again: `offline.generate_rollouts` requeues it).
    """

    table: jax.Array
    used: jax.Array
    preempted: jax.Array

    @classmethod
    def empty(cls, slots: int, pages_per_slot: int, num_pages: int) -> Pages:
        return cls(
            table=jnp.full((slots, pages_per_slot), -1, jnp.int32),
            used=jnp.zeros((num_pages,), bool),
            preempted=jnp.zeros((slots,), bool),
        )

    @property
    def num_pages(self) -> int:
        return self.used.shape[0]

    def free_count(self) -> jax.Array:
        """[] int32 pages no slot holds."""
        return jnp.sum(~self.used, dtype=jnp.int32)


def paged_cache_shape(cfg: ModelConfig, num_pages: int, page_size: int) -> tuple[int, ...]:
    """The shape of k (and v) of a paged cache."""
    return (cfg.n_layers, num_pages, page_size, cfg.n_kv_heads * cfg.head_dim)


def paged_cache_spec(sharder: Sharder, shape: tuple[int, ...], n_kv_heads: int) -> PartitionSpec:
    """The partition of a paged cache of `shape` `[L, P, ps, k h]` holding `n_kv_heads` (k).

    The dense cache's rule for its kv-head axis, applied to whole heads: the merged `[k h]` axis
    is split over the mesh axes of `act_kv_heads` where they divide k, and is replicated where
    they do not (tensor parallelism above, or not dividing, the kv-head count: each shard then
    holds every kv head, as the dense cache's `[.., k, .., h]` does by `Sharder.spec`'s rule).
    Checked against k h instead, the axis would be cut mid-head (kv 2, head dim 32 over 4:
    16 lanes of a head per shard) while q's kv-head axis stays whole, which the kernel's
    per-head slices cannot read.
    """
    return sharder.spec(PAGED_AXES, (*shape[:-1], n_kv_heads))


def paged_cache_sharding(sharder: Sharder, shape: tuple[int, ...], n_kv_heads: int):
    """`paged_cache_spec` as a NamedSharding on the sharder's mesh (None without one)."""
    if sharder.mesh is None:
        return None
    return NamedSharding(sharder.mesh, paged_cache_spec(sharder, shape, n_kv_heads))


def constrain_paged_cache(sharder: Sharder, cache: jax.Array, n_kv_heads: int) -> jax.Array:
    """`with_sharding_constraint` to `paged_cache_spec`; the identity without a mesh."""
    if sharder.mesh is None:
        return cache
    return jax.lax.with_sharding_constraint(
        cache, paged_cache_sharding(sharder, cache.shape, n_kv_heads)
    )


def release(pages: Pages, slots: jax.Array) -> Pages:
    """Returns every page of the slots where `slots` [B] is True to the pool."""
    p = pages.num_pages
    ids = jnp.where(slots[:, None] & (pages.table >= 0), pages.table, p)  # p: dropped
    return pages.replace(
        table=jnp.where(slots[:, None], -1, pages.table),
        used=pages.used.at[ids.reshape(-1)].set(False, mode="drop"),
    )


def allocate(pages: Pages, want: jax.Array, most: int) -> tuple[Pages, jax.Array]:
    """Gives slot b a free page at column j wherever `want[b, j]` (and it holds none there).

    Pages go to the wanted (slot, column) pairs in row-major order, at most `most` (static) in
    one call; a pair left without one (pool empty) is reported.

    Args:
      pages: the pool.
      want: `[B, C]` bool.
      most: a static bound on the wanted pairs (the size of the free-page search).
    Returns:
      (the pool, `[B]` bool: the slot wanted a page and got none).
    """
    p = pages.num_pages
    want = want & (pages.table < 0)
    flat = want.reshape(-1)
    free = jnp.nonzero(~pages.used, size=min(most, p), fill_value=p)[0]  # first free pages
    rank = jnp.cumsum(flat) - 1
    page = jnp.where(flat & (rank < free.shape[0]), free[jnp.clip(rank, 0, free.shape[0] - 1)], p)
    got = flat & (page < p)
    table = jnp.where(got, page, pages.table.reshape(-1)).reshape(pages.table.shape)
    used = pages.used.at[jnp.where(got, page, p)].set(True, mode="drop")
    missed = jnp.any((flat & ~got).reshape(want.shape), axis=1)
    return pages.replace(table=table, used=used), missed


def page_of(table: jax.Array, positions: jax.Array, page_size: int) -> tuple[jax.Array, jax.Array]:
    """(page id [B] holding each slot's position, -1 if none; the offset in it [B])."""
    column = jnp.clip(positions // page_size, 0, table.shape[1] - 1)
    return jnp.take_along_axis(table, column[:, None], axis=1)[:, 0], positions % page_size


def write_pages(cache, layer, page, offset, new, to_storage_fn):
    """`cache[layer, page[b], offset[b]] = new[b]` for every slot b with a page (>= 0).

    Args:
      cache: `[L, P, ps, k h]` in the storage dtype.
      layer: [] int (traced) layer index.
      page, offset: `[B]` int32 (`page_of`); page -1 drops the write (a finished slot).
      new: `[B, k, h]` the new keys or values.
      to_storage_fn: values -> the storage dtype (`kv_cache.to_storage` with the cache dtype).
    """
    page = jnp.where(page >= 0, page, cache.shape[1])  # past the pool: dropped
    # Indices (layer, page, offset) broadcast to [B]: the update is [B, k h], one row per slot.
    new = to_storage_fn(new).reshape(new.shape[0], -1)
    return cache.at[layer, page, offset].set(new, mode="drop")


def live_page_list(table: jax.Array, lengths: jax.Array, page_size: int, live_pages: int):
    """Every slot's live pages as one flat list of `live_pages` (static) entries.

    Slot b's pages `j < ceil(lengths[b] / ps)` come in slot order; entries past the total are
    padding. Returns (owner [n] slot of each entry (clipped to B - 1 on padding), column [n] j,
    page [n] id (0 on padding), valid [n] bool).
    """
    b = table.shape[0]
    counts = -(-lengths // page_size)
    ends = jnp.cumsum(counts)
    i = jnp.arange(live_pages, dtype=jnp.int32)
    slot = jnp.searchsorted(ends, i, side="right").astype(jnp.int32)
    valid = slot < b
    owner = jnp.minimum(slot, b - 1)
    column = jnp.clip(i - (ends - counts)[owner], 0, table.shape[1] - 1)
    page = jnp.where(valid, table[owner, column], 0)
    return owner, column, jnp.maximum(page, 0), valid


def ragged_attention(q, k_all, v_all, layer, table, lengths, live_pages, from_storage_fn, policy):
    """Decode attention of each slot over its own live pages (module docstring), in XLA.

    Args:
      q: `[B, k, g, h]` queries grouped by kv head (compute dtype).
      k_all, v_all: `[L, P, ps, k h]` the paged cache in its storage dtype.
      layer: [] int (traced) this layer.
      table: `[B, C]` int32 page ids (`Pages.table`).
      lengths: `[B]` int32 positions each slot attends to (0 for a finished slot: zeros out).
      live_pages: static bound on sum_b ceil(lengths[b] / ps).
      from_storage_fn: storage -> cache-dtype values.
      policy: compute dtype and matmul precision.
    Returns:
      `[B, k, g, h]` in the compute dtype.
    """
    b, ps = q.shape[0], k_all.shape[2]
    cd, prec = policy.compute_dtype, policy.precision
    owner, column, page, valid = live_page_list(table, lengths, ps, live_pages)
    # [n, s, k, h]: one gather of this layer's live pages.
    keys, values = (
        from_storage_fn(c[layer, page])
        .astype(cd)
        .reshape(page.shape + (ps,) + q.shape[1:2] + (-1,))
        for c in (k_all, v_all)
    )
    # [n, k, g, h] x [n, s, k, h] -> [n, k, g, s]; scores and softmax statistics in float32.
    scores = jnp.einsum(
        "nkgh,nskh->nkgs", q[owner], keys, precision=prec, preferred_element_type=jnp.float32
    )
    scores = scores * (q.shape[-1] ** -0.5)
    position = column[:, None] * ps + jnp.arange(ps)[None, :]  # [n, s]
    visible = (valid[:, None] & (position < lengths[owner][:, None]))[:, None, None, :]
    lowest = jnp.finfo(jnp.float32).min
    scores = jnp.where(visible, scores, lowest)
    # The slot's softmax over all its pages, as the dense path's: max and sum per slot first
    # (segment reductions over the page list), then the normalised probabilities in the compute
    # dtype, so a bf16 engine rounds what dense decode rounds.
    top = jax.ops.segment_max(jnp.max(scores, axis=-1), owner, num_segments=b)  # [B, k, g]
    exp = jnp.where(visible, jnp.exp(scores - top[owner][..., None]), 0.0)
    norm = jax.ops.segment_sum(jnp.sum(exp, axis=-1), owner, num_segments=b)  # [B, k, g]
    probs = exp / jnp.maximum(norm, 1e-30)[owner][..., None]
    # [n, k, g, s] x [n, s, k, h] -> [n, k, g, h], accumulated in float32 over each slot's pages.
    partial = jnp.einsum(
        "nkgs,nskh->nkgh",
        probs.astype(cd),
        values,
        precision=prec,
        preferred_element_type=jnp.float32,
    )
    # A slot with no live page (finished) sums nothing and comes out 0.
    return jax.ops.segment_sum(partial, owner, num_segments=b).astype(cd)
