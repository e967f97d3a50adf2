"""The Qwen3-style decoder and its three entry points.

* `__call__(tokens, positions, valid)`: full-sequence forward (training and teacher forcing);
  causal + padding mask, explicit positions; returns float32 logits, or the final normed hidden
  states with `return_hidden=True` (the DVP loss applies the unembedding in vocabulary chunks).
* `prefill(tokens, lengths, cache_len)`: a right-padded prompt batch -> logits of each row's last
  real token and a KV cache holding the prompt.
* `decode(tokens, positions, cache)`: one token per row at per-row positions, updating the cache.

The dtype policy decides parameter, activation and cache dtypes; logits are always float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dvp_jax.model.attention import CACHE_AXES, Attention, KVCache
from dvp_jax.model.config import TRAIN_POLICY, DTypePolicy, ModelConfig
from dvp_jax.model.layers import MLP, RMSNorm, param
from dvp_jax.sharding import Sharder

ACT = ("act_batch", "act_seq", "act_embed")


class Block(nnx.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, policy: DTypePolicy, sharder: Sharder, *, rngs: nnx.Rngs):
        self.input_norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps, policy)
        self.attn = Attention(cfg, policy, sharder, rngs=rngs)
        self.post_attn_norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps, policy)
        self.mlp = MLP(cfg.d_model, cfg.d_ff, cfg.init_std, policy, sharder, rngs=rngs)
        self.sharder = sharder

    def __call__(self, x, positions, mask):
        attn, kv = self.attn(self.input_norm(x), positions, mask)
        x = self.sharder.constrain(x + attn, ACT)
        x = self.sharder.constrain(x + self.mlp(self.post_attn_norm(x)), ACT)
        return x, kv

    def decode(self, x, positions, k_all, v_all, layer: int):
        attn, k_all, v_all = self.attn.decode(self.input_norm(x), positions, k_all, v_all, layer)
        x = x + attn
        return x + self.mlp(self.post_attn_norm(x)), k_all, v_all


class Transformer(nnx.Module):
    """Qwen3-style decoder LM.

    Args:
      cfg: architecture.
      policy: dtype policy (`TRAIN_POLICY` fp32, `ROLLOUT_POLICY` bf16).
      sharder: mesh + logical rules used for activation constraints (no-op without a mesh).
      rngs: parameter initialisation randomness.
      remat: recompute each block's activations in the backward pass (full-sequence forward
        only), trading compute for the memory of long training sequences.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        policy: DTypePolicy = TRAIN_POLICY,
        sharder: Sharder = Sharder(),
        *,
        rngs: nnx.Rngs,
        remat: bool = False,
    ):
        self.cfg = cfg
        self.policy = policy
        self.sharder = sharder
        self.remat = remat
        dt = policy.param_dtype
        self.embed = param(
            rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), cfg.init_std, dt
        )
        self.layers = nnx.List(
            [Block(cfg, policy, sharder, rngs=rngs) for _ in range(cfg.n_layers)]
        )
        self.final_norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps, policy)
        if not cfg.tie_embeddings:
            self.lm_head = param(
                rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), cfg.init_std, dt
            )

    # ------------------------------------------------------------------------------------------
    def unembedding(self) -> jax.Array:
        """The output projection `W: [d, v]` in the parameter dtype (embedding^T when tied)."""
        if self.cfg.tie_embeddings:
            return self.embed[...].T
        return self.lm_head[...]

    def logits(self, hidden: jax.Array) -> jax.Array:
        """[..., d] final hidden states -> [..., v] float32 logits (fp32 accumulation)."""
        w = self.unembedding().astype(self.policy.compute_dtype)
        # [..., d] x [d, v] -> [..., v]
        return jnp.einsum("...d,dv->...v", hidden, w, preferred_element_type=jnp.float32)

    def _embed(self, tokens):
        x = jnp.take(self.embed[...], tokens, axis=0).astype(self.policy.compute_dtype)
        return self.sharder.constrain(x, ACT)

    # ------------------------------------------------------------------------------------------
    def __call__(self, tokens, positions, valid=None, *, return_hidden: bool = False):
        """Full-sequence forward.

        Args:
          tokens: [b, t] int32 token ids.
          positions: [b, t] int32 positions (RoPE); need not start at 0 (left padding).
          valid: [b, t] bool, False on padding. Padding keys are never attended to, so padding
            never changes the outputs at real tokens. Default: all valid.
          return_hidden: return final normed hidden states [b, t, d] instead of logits.
        Returns:
          [b, t, v] float32 logits, or [b, t, d] hidden states in the compute dtype.
        """
        hidden, _ = self._forward(tokens, positions, valid)
        if return_hidden:
            return hidden
        logits = self.logits(hidden)
        return self.sharder.constrain(logits, ("act_batch", "act_seq", "act_vocab"))

    def _forward(self, tokens, positions, valid):
        b, t = tokens.shape
        if valid is None:
            valid = jnp.ones((b, t), bool)
        causal = jnp.tril(jnp.ones((t, t), bool))
        mask = causal[None] & valid[:, None, :]  # [b, t(query), t(key)]
        x = self._embed(tokens)
        kvs = []
        for block in self.layers:
            if self.remat:
                x, kv = nnx.remat(lambda b, *args: b(*args))(block, x, positions, mask)
            else:
                x, kv = block(x, positions, mask)
            kvs.append(kv)
        return self.final_norm(x), kvs

    def prefill(self, tokens, lengths, cache_len: int):
        """Runs a right-padded prompt batch and returns its KV cache.

        Args:
          tokens: [b, P] int32, row i real on `[0, lengths[i])`, padding after.
          lengths: [b] int32 true prompt lengths (>= 1).
          cache_len: S >= P, the cache length (static).
        Returns:
          (logits [b, v] float32 at each row's last real token, KVCache with k, v [L, b, S, k, h]).
        """
        b, p = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
        valid = positions < lengths[:, None]
        hidden, kvs = self._forward(tokens, positions, valid)
        last = jnp.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]  # [b, d]
        pad = ((0, 0), (0, cache_len - p), (0, 0), (0, 0))
        cd = self.policy.cache_dtype
        k = jnp.stack([jnp.pad(k.astype(cd), pad) for k, _ in kvs])
        v = jnp.stack([jnp.pad(v.astype(cd), pad) for _, v in kvs])
        cache = KVCache(
            self.sharder.constrain(k, CACHE_AXES), self.sharder.constrain(v, CACHE_AXES)
        )
        return self.logits(last), cache

    def decode(self, tokens, positions, cache: KVCache):
        """One decode step.

        Args:
          tokens: [b] int32, the token at `positions` for each row.
          positions: [b] int32 per-row positions (also the cache slot written).
          cache: KVCache with k, v [L, b, S, k, h].
        Returns:
          (logits [b, v] float32 predicting position `positions + 1`, updated KVCache).
        """
        x = self._embed(tokens[:, None])
        k_all, v_all = cache
        for i, block in enumerate(self.layers):
            x, k_all, v_all = block.decode(x, positions, k_all, v_all, i)
        cache = KVCache(*(self.sharder.constrain(c, CACHE_AXES) for c in (k_all, v_all)))
        return self.logits(self.final_norm(x)[:, 0]), cache
