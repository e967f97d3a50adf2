"""Grouped-query attention with per-head q/k RMSNorm, RoPE, and a functional KV cache.

The KV cache is a pair of arrays `k, v: [L, b, S, k, h]` (layers, batch slots, cache length, kv
heads, head dim) in the policy's cache dtype. Rows are right-padded: a row's tokens occupy cache
positions `0 .. pos`, so a decode step at position `p` attends to cache positions `<= p`.

`Attention(..., layers=L)` holds the parameters of L layers (leading `[L]` axis) and is called on
one layer's slice inside `nnx.scan`; every matmul runs at the policy's precision.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dvp_jax.model.config import DTypePolicy, ModelConfig
from dvp_jax.model.layers import RMSNorm, matmul, param, rope
from dvp_jax.sharding import Sharder

CACHE_AXES = ("cache_layers", "cache_batch", "cache_seq", "act_kv_heads", "act_head_dim")


class KVCache(NamedTuple):
    """Keys and values of every layer: `k, v: [L, b, S, k, h]`."""

    k: jax.Array
    v: jax.Array

    @classmethod
    def zeros(cls, cfg: ModelConfig, batch: int, length: int, dtype) -> KVCache:
        shape = (cfg.n_layers, batch, length, cfg.n_kv_heads, cfg.head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


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
    scores = scores * (h**-0.5)
    visible = mask[:, None, None, :, :]
    # A large finite negative (not -inf): a query with no visible key (a padding row) gets a
    # uniform, finite softmax instead of NaN.
    scores = jnp.where(visible, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(policy.compute_dtype)
    # [b, k, g, t, s] x [b, s, k, h] -> [b, t, k, g, h]
    return matmul("bkgts,bskh->btkgh", probs, v, policy)


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

    def __call__(self, x, positions, mask):
        """Full-sequence attention.

        Args:
          x: [b, t, d]; positions: [b, t]; mask: [b, t, t] bool (query, key).
        Returns:
          (out [b, t, d], (k, v) each [b, t, k, h]) so that prefill can fill a cache.
        """
        q, k, v = self._qkv(x, positions)
        attn = _masked_softmax_attention(self._group(q), k, v, mask, self.policy)
        return self._out(attn), (k, v)

    def decode(self, x, positions, k_all, v_all, layer):
        """One new token per row, attending to the cache.

        Args:
          x: [b, 1, d] the new token's activations; positions: [b] its position (= cache slot).
          k_all, v_all: [L, b, S, k, h] the whole stacked cache.
          layer: [] int32 (traced under `nnx.scan`) or int, this layer's index in the cache.
        Returns:
          (out [b, 1, d], k_all, v_all) with the new key/value written at
          `[layer, row, positions[row]]`: a scatter into the stacked cache, which the layer scan
          carries, so a decode step updates the (donated) cache in place and never copies it.
        """
        q, k, v = self._qkv(x, positions[:, None])
        rows = jnp.arange(x.shape[0])
        k_all = k_all.at[layer, rows, positions].set(k[:, 0].astype(k_all.dtype))
        v_all = v_all.at[layer, rows, positions].set(v[:, 0].astype(v_all.dtype))
        cache_len = k_all.shape[2]
        mask = (jnp.arange(cache_len)[None, :] <= positions[:, None])[:, None, :]  # [b, 1, S]
        cd = self.policy.compute_dtype
        attn = _masked_softmax_attention(
            self._group(q), k_all[layer].astype(cd), v_all[layer].astype(cd), mask, self.policy
        )
        return self._out(attn), k_all, v_all
