"""Grouped-query attention with per-head q/k RMSNorm, RoPE, and a functional KV cache.

Full-sequence attention (training forward, prefill) computes per query head n of KV group
k = n // g: out[t] = sum_s softmax_s(q[t] . k[s] / sqrt(h) + mask[t, s]) v[s], mask 0 where
s <= t and key s is in query t's segment (not padding), a large negative number elsewhere
(`causal_mask`): a row may hold several packed sequences, told apart by segment ids, and
attention never crosses one. The kernel is the one `select_attention_impl` picks for
`DTypePolicy.attention_impl`: the explicit einsum softmax ("xla", the reference, any segment
pattern, finite on padding rows), `blockwise.py`, or a library kernel of `kernels.py`. Decode
(one query against the cache) always runs the explicit path, over a static length bucket
`kv_len` (docs/design.md section 3).

The KV cache (its layouts, storage dtype, reads and writes) is `kv_cache.py`; decode here
writes one position per row into it and reads a `kv_len` prefix back. `Attention(..., layers=L)`
holds L layers' parameters and is called on one layer's slice inside `nnx.scan`.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
from flax import nnx

from dvp_jax.model import kernels, paged
from dvp_jax.model.blockwise import blockwise_attention
from dvp_jax.model.config import ATTENTION_IMPLS, DTypePolicy, ModelConfig
from dvp_jax.model.kv_cache import (
    cache_layout,
    from_storage,
    read_cache,
    seq_axis,
    to_storage,
    write_cache,
)
from dvp_jax.model.layers import RMSNorm, matmul, param, rope
from dvp_jax.sharding import Sharder

# Backend names (`jax.default_backend()`, or a device's platform) of each fused kernel. JAX's
# cuDNN attention is NVIDIA-only; on a ROCm "gpu" set attention_impl to "xla" or "dot_product".
_GPU_BACKENDS = ("gpu", "cuda")
_TPU_BACKENDS = ("tpu",)
_FUSED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# "auto" runs the blockwise path (no T x T scores) from this many tokens where no fused kernel
# serves the policy: at 2,048 the explicit path's float32 scores are 16 MiB per row and head.
BLOCKWISE_FROM = 2048
# The name scope of every full-sequence attention kernel call: the dots inside it (forward,
# rematerialised forward and backward) are the attention's FLOPs (`plan.compiled.dot_flops`).
ATTENTION_SCOPE = "full_attention"
# What `jax.nn.dot_product_attention(implementation="cudnn")` raises at trace time when it cannot
# run: NotImplementedError for a shape or dtype the kernel lacks, RuntimeError when cuDNN itself
# is missing or too old ("cuDNN is not detected"), ValueError for a layout it refuses. "auto"
# falls back to the explicit path on any of them; an explicit "cudnn" re-raises.
_KERNEL_REFUSALS = (NotImplementedError, RuntimeError, ValueError)


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


def as_segments(segment_ids: jax.Array) -> jax.Array:
    """[b, t] int32 segment ids: int ids as given (0 = padding), a bool `valid` as 1 / 0 (one
    segment per row)."""
    return jnp.asarray(segment_ids).astype(jnp.int32)


def causal_mask(segment_ids: jax.Array) -> jax.Array:
    """[b, t(query), s(key)] bool: the key is at or before the query, in the query's segment,
    and not padding (segment 0), so attention never crosses a packed sequence.

    Args:
      segment_ids: [b, t] int32 segment of each token (0 = padding), or bool valid (False on
        padding: one segment per row).
    """
    seg = as_segments(segment_ids)
    t = seg.shape[1]
    causal = jnp.tril(jnp.ones((t, t), bool))
    same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] != 0)
    return causal[None] & same


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
        tiled = seq_len % kernels.SPLASH_BLOCK == 0 and head_dim % kernels.SPLASH_BLOCK == 0
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
        if impl == "splash" and seq_len % kernels.SPLASH_BLOCK:
            raise ValueError(
                f"DTypePolicy.attention_impl='splash' needs the sequence length to be a "
                f"multiple of {kernels.SPLASH_BLOCK} (the kernel's block), got {seq_len}; pad the "
                "batch to a multiple or use 'xla'"
            )
    return impl


def full_attention(
    q,
    k,
    v,
    segment_ids,
    policy: DTypePolicy,
    backend: str | None = None,
    sharder: Sharder | None = None,
):
    """Causal GQA attention of whole sequences, within segments, by the policy's kernel.

    Computes the module docstring's equation with the kernel `select_attention_impl` picks for
    `policy.attention_impl`; with "auto", a call cuDNN refuses at trace time (a head dim over
    its limit, a missing or old cuDNN: `_KERNEL_REFUSALS`) falls back to "xla" with a warning.

    Args:
      q: [b, t, n, h] queries (head n uses KV head n // g).
      k, v: [b, t, k, h] keys and values.
      segment_ids: [b, t] int32 segment of each token, 0 on padding (packed rows: a query
        attends to the keys of its own segment only, `causal_mask`), or bool valid (one
        segment per row, False on padding).
      policy: compute dtype, matmul precision, `attention_impl` and `attention_block`.
      backend: platform name; default the platform of `sharder`'s mesh, else
        `jax.default_backend()` (a program compiled for a TPU topology from a CPU host runs
        the TPU choice).
      sharder: the mesh and rules q, k, v are sharded by; the splash kernel runs per shard
        under `shard_map` on them (a Mosaic kernel cannot be partitioned by XLA).
    Returns:
      [b, t, n, h] in the compute dtype.
    """
    with jax.named_scope(ATTENTION_SCOPE):
        return _full_attention(q, k, v, segment_ids, policy, backend, sharder)


def _full_attention(q, k, v, segment_ids, policy: DTypePolicy, backend, sharder):
    b, t, n, h = q.shape
    backend = backend or (sharder.platform if sharder is not None else jax.default_backend())
    impl = select_attention_impl(policy.attention_impl, backend, policy.compute_dtype, t, h)
    if impl == "dot_product":
        return kernels.dot_product_attention(q, k, v, segment_ids, policy.precision)
    if impl == "blockwise":
        return blockwise_attention(
            q, k, v, segment_ids, policy.precision, policy.attention_block, sharder
        )
    if impl == "splash":
        return kernels.splash_attention(q, k, v, segment_ids, sharder, policy.attention_block)
    if impl == "cudnn":
        try:
            return kernels.cudnn_attention(q, k, v, segment_ids)
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
    out = _masked_softmax_attention(grouped, k, v, causal_mask(segment_ids), policy)
    return out.reshape(b, t, n, h)


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

    def __call__(self, x, positions, segment_ids):
        """Full-sequence causal attention by the policy's kernel (`full_attention`).

        Args:
          x: [b, t, d]; positions: [b, t]; segment_ids: [b, t] int32 segments (0 padding) or
            bool valid (`full_attention`).
        Returns:
          (out [b, t, d], (k, v) each [b, t, k, h]) so that prefill can fill a cache.
        """
        q, k, v = self._qkv(x, positions)
        attn = full_attention(q, k, v, segment_ids, self.policy, sharder=self.sharder)
        return self._out(attn), (k, v)

    def decode_paged(self, x, positions, k_all, v_all, layer, pages: paged.PageView):
        """One new token per slot on a paged cache (`model/paged.py`), attending to the slot's
        own `pages.lengths[b]` positions.

        Args:
          x: [b, 1, d]; positions: [b] the new token's position (written to its page).
          k_all, v_all: [L, P, ps, k h] the paged cache in `cache_storage`.
          layer: [] int32 (traced under `nnx.scan`) this layer's index.
          pages: the page table, lengths and the static path (`paged.PageView`).
        Returns:
          (out [b, 1, d], k_all, v_all) with the new key and value written in place.
        """
        from dvp_jax.model import decode_kernels  # Pallas imports only where pages are used

        q, k, v = self._qkv(x, positions[:, None])
        dtype = self.policy.cache_dtype
        page, offset = paged.page_of(pages.table, positions, k_all.shape[2])
        store = lambda a: to_storage(a, dtype)
        k_all = paged.write_pages(k_all, layer, page, offset, k[:, 0], store)
        v_all = paged.write_pages(v_all, layer, page, offset, v[:, 0], store)
        q = self._group(q)[:, 0]  # [b, k, g, h]
        if pages.impl == "kernel":
            attn = decode_kernels.paged_decode_attention(
                q, k_all, v_all, layer, pages.table, pages.lengths, dtype, self.sharder
            )
        else:
            load = lambda a: from_storage(a, dtype)
            attn = paged.ragged_attention(
                q,
                k_all,
                v_all,
                layer,
                pages.table,
                pages.lengths,
                pages.live_pages,
                load,
                self.policy,
            )
        return self._out(attn[:, None]), k_all, v_all

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
