"""The Qwen3-style decoder and its three entry points.

* `__call__(tokens, positions, segment_ids)`: full-sequence forward (training and teacher
  forcing); causal mask within segments (a row may hold several packed sequences, each with
  positions from 0), explicit positions; returns float32 logits, or the final normed hidden
  states with `return_hidden=True` (the DVP loss applies the unembedding in vocabulary chunks).
* `prefill(tokens, lengths, cache_len)`: a right-padded prompt batch -> logits of each row's last
  real token and a KV cache holding the prompt.
* `decode(tokens, positions, cache)`: one token per row at per-row positions, updating the cache.

The decoder blocks are one `Block` holding every layer's parameters stacked on a leading `[L]`
axis (logical name "layers"); all three entry points run them under `nnx.scan`, so the program
holds one compiled block body whatever the depth. The training forward may rematerialise each
block (`remat`, one of `REMAT_POLICIES`). The dtype policy decides parameter, activation and
cache dtypes, the matmul precision and the attention kernel of the forward and prefill
(`attention_impl`, `dvp_jax/model/attention.py`); logits are always float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dvp_jax.model import paged
from dvp_jax.model.attention import Attention
from dvp_jax.model.config import REMAT_POLICIES, TRAIN_POLICY, DTypePolicy, ModelConfig
from dvp_jax.model.kv_cache import (
    KVCache,
    cache_axes,
    cache_layout,
    cache_storage,
    from_storage,
    seq_axis,
    to_storage,
)
from dvp_jax.model.layers import MLP, RMSNorm, matmul, param
from dvp_jax.sharding import Sharder

ACT = ("act_batch", "act_seq", "act_embed")

# jax.checkpoint policies of `REMAT_POLICIES` ("none" is no remat at all).
_REMAT = {
    "full": None,  # save nothing but the block's inputs
    "save_dots": jax.checkpoint_policies.dots_saveable,
    "save_dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def _scan(fn, *, in_axes, out_axes):
    """`nnx.scan` over the stacked blocks (axis 0 of their parameters).

    The blocks only read their parameters, so no graph updates flow back
    (`graph_updates=False`); this also lets a jit close over the model
    (`jax.jit(model.prefill)`) instead of taking it as an argument.
    """
    return nnx.scan(fn, in_axes=in_axes, out_axes=out_axes, graph_updates=False)


def remat_policy_name(remat: bool | str) -> str:
    """`remat` as one of `REMAT_POLICIES`: False -> "none", True -> "full", names unchanged."""
    if remat is True or remat is False:
        return "full" if remat else "none"
    if remat not in REMAT_POLICIES:
        raise ValueError(f"remat policy {remat!r} is unknown; allowed: {REMAT_POLICIES} or a bool")
    return remat


class Block(nnx.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then x + mlp(norm(x)).

    It holds the parameters of all `cfg.n_layers` blocks, each with a leading `[L]` axis, and
    its methods are called on one layer's slice (inside `nnx.scan`).
    """

    def __init__(self, cfg: ModelConfig, policy: DTypePolicy, sharder: Sharder, rngs: nnx.Rngs):
        eps, ls = cfg.rms_norm_eps, cfg.n_layers
        self.input_norm = RMSNorm(cfg.d_model, eps, policy, layers=ls)
        self.attn = Attention(cfg, policy, sharder, rngs=rngs, layers=ls)
        self.post_attn_norm = RMSNorm(cfg.d_model, eps, policy, layers=ls)
        self.mlp = MLP(cfg.d_model, cfg.d_ff, cfg.init_std, policy, sharder, rngs=rngs, layers=ls)
        self.sharder = sharder

    def __call__(self, x, positions, segment_ids):
        attn, kv = self.attn(self.input_norm(x), positions, segment_ids)
        x = self.sharder.constrain(x + attn, ACT)
        x = self.sharder.constrain(x + self.mlp(self.post_attn_norm(x)), ACT)
        return x, kv

    def decode(self, x, positions, k_all, v_all, layer, kv_len=None, pages=None):
        if pages is None:
            attn, k_all, v_all = self.attn.decode(
                self.input_norm(x), positions, k_all, v_all, layer, kv_len
            )
        else:
            attn, k_all, v_all = self.attn.decode_paged(
                self.input_norm(x), positions, k_all, v_all, layer, pages
            )
        x = x + attn
        return x + self.mlp(self.post_attn_norm(x)), k_all, v_all


class Transformer(nnx.Module):
    """Qwen3-style decoder LM.

    Parameters: `embed [v, d]`, `blocks` (every layer's block parameters stacked on a leading
    `[L]` axis, e.g. `blocks.attn.q_proj [L, d, n, h]`), `final_norm.weight [d]` and, untied,
    `lm_head [d, v]`.

    Args:
      cfg: architecture.
      policy: dtypes and matmul precision (`TRAIN_POLICY` fp32 at `highest`, `MIXED_TRAIN_POLICY`,
        `ROLLOUT_POLICY` bf16).
      sharder: mesh + logical rules used for activation constraints (no-op without a mesh).
      rngs: parameter initialisation randomness.
      remat: rematerialisation of each block in the backward pass of the full-sequence forward
        (prefill and decode never remat): a bool (True is "full") or one of `REMAT_POLICIES`.
        Trades compute for the memory of long training sequences.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        policy: DTypePolicy = TRAIN_POLICY,
        sharder: Sharder = Sharder(),
        *,
        rngs: nnx.Rngs,
        remat: bool | str = False,
    ):
        self.cfg = cfg
        self.policy = policy
        self.sharder = sharder
        self.remat = remat_policy_name(remat)
        dt = policy.param_dtype
        self.embed = param(
            rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), cfg.init_std, dt
        )
        self.blocks = Block(cfg, policy, sharder, rngs)
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
        """[..., d] final hidden states -> [..., v] float32 logits (fp32 accumulation).

        W is cast to the compute dtype; the matmul runs at the policy's precision.
        """
        # [..., d] x [d, v] -> [..., v]
        return matmul(
            "...d,dv->...v",
            hidden,
            self.unembedding(),
            self.policy,
            preferred_element_type=jnp.float32,
        )

    def _embed(self, tokens):
        x = jnp.take(self.embed[...], tokens, axis=0).astype(self.policy.compute_dtype)
        return self.sharder.constrain(x, ACT)

    # ------------------------------------------------------------------------------------------
    def __call__(self, tokens, positions, segment_ids=None, *, return_hidden: bool = False):
        """Full-sequence forward.

        Args:
          tokens: [b, t] int32 token ids.
          positions: [b, t] int32 positions (RoPE); need not start at 0 (left padding), and
            restart at 0 for each packed sequence.
          segment_ids: [b, t] int32 sequence of each token within its row, 0 on padding (packed
            rows: a token attends to earlier tokens of its own sequence only), or bool valid
            (one sequence per row, False on padding). Padding keys are never attended to, so
            padding never changes the outputs at real tokens. Default: all valid. Any pattern
            works except a bool one under the "cudnn" kernel, which needs right padding (each
            row's valid tokens a prefix) and gives NaN on other rows
            (`dvp_jax/model/attention.py`).
          return_hidden: return final normed hidden states [b, t, d] instead of logits.
        Returns:
          [b, t, v] float32 logits, or [b, t, d] hidden states in the compute dtype.
        """
        x = self._embed(tokens)
        if segment_ids is None:
            segment_ids = jnp.ones(tokens.shape, bool)

        # One block per scan step: x [b, t, d] is the carry, the block's parameters are sliced
        # from the [L]-stacked ones; with remat only each block's input is saved (or as the
        # policy says) and the rest is recomputed in the backward pass.
        def block_fn(block, x, positions, segment_ids):
            return block(x, positions, segment_ids)[0]

        if self.remat != "none":
            block_fn = nnx.remat(
                block_fn, prevent_cse=False, policy=_REMAT[self.remat], graph_updates=False
            )
        scan = _scan(block_fn, in_axes=(0, nnx.Carry, None, None), out_axes=nnx.Carry)
        hidden = self.final_norm(scan(self.blocks, x, positions, segment_ids))
        if return_hidden:
            return hidden
        logits = self.logits(hidden)
        return self.sharder.constrain(logits, ("act_batch", "act_seq", "act_vocab"))

    def prefill(self, tokens, lengths, cache_len: int):
        """Runs a right-padded prompt batch and returns its KV cache.

        Args:
          tokens: [b, P] int32, row i real on `[0, lengths[i])`, padding after.
          lengths: [b] int32 true prompt lengths (>= 1).
          cache_len: S >= P, the cache length (static).
        Returns:
          (logits [b, v] float32 at each row's last real token, KVCache with k, v [L, b, k, S, h]
          or, on TPU, [L, b, S, k, h] (`kv_cache.cache_layout`)).
        """
        b, p = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
        valid = positions < lengths[:, None]
        x = self._embed(tokens)
        cd, layout = self.policy.cache_dtype, cache_layout(self.sharder.platform)
        axes = cache_axes(layout)

        # Each scan step emits its layer's keys and values [b, P, k, h] in the cache layout
        # ([b, k, S, h] heads first, [b, S, k, h] positions first: `kv_cache.cache_layout`),
        # padded to the cache length and cast to the cache dtype: the stacked outputs are the
        # cache.
        def to_cache(x):
            if layout == "heads_first":
                x = jnp.swapaxes(x, 1, 2)
            pad = [(0, 0)] * 4
            pad[seq_axis(layout) - 1] = (0, cache_len - p)
            return jnp.pad(x.astype(cd), pad)

        def block_fn(block, x, positions, valid):
            x, (k, v) = block(x, positions, valid)
            return x, (to_cache(k), to_cache(v))

        scan = _scan(block_fn, in_axes=(0, nnx.Carry, None, None), out_axes=(nnx.Carry, 0))
        x, (k, v) = scan(self.blocks, x, positions, valid)
        hidden = self.final_norm(x)
        last = jnp.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]  # [b, d]
        cache = KVCache(self.sharder.constrain(k, axes), self.sharder.constrain(v, axes))
        return self.logits(last), cache

    def decode(self, tokens, positions, cache: KVCache, kv_len: int | None = None, pages=None):
        """One decode step.

        Args:
          tokens: [b] int32, the token at `positions` for each row.
          positions: [b] int32 per-row positions (also the cache slot written).
          cache: KVCache with k, v [L, b, k, S, h] ([L, b, S, k, h] on TPU), in the policy's
            cache dtype or stored as
            `kv_cache.cache_storage` (its bits for 16- and 8-bit dtypes; the engine keeps
            its cache so, and then no step converts the cache).
          kv_len: static count of leading cache positions attention reads (default S); rows
            with `positions >= kv_len` get wrong logits (`Attention.decode`).
          pages: a `paged.PageView` when `cache` is paged (k, v `[L, P, ps, k h]`,
            `model/paged.py`): each row attends to its own pages; `kv_len` is then unused.
        Returns:
          (logits [b, v] float32 predicting position `positions + 1`, the updated KVCache: in
          `cache_storage` if it came so, else in the cache dtype).
        """
        x = self._embed(tokens[:, None])

        # The whole cache rides in the scan carry and each step scatters its layer's new key and
        # value into it (`kv_cache.write_cache`): the loop updates the donated buffer in place
        # instead of emitting a second [L, b, k, S, h] cache as stacked outputs. A 16-/8-bit
        # cache rides as its bits (an integer scatter; a float one would be converted to
        # float32 and back per layer on CPU); a caller passing bits pays no conversion at all.
        # A paged cache: the table and lengths ride as broadcast arguments, the static size and
        # path in the closure.
        static = None if pages is None else (pages.live_pages, pages.impl)

        def block_fn(block, layer, carry, positions, table, lengths):
            x, k_all, v_all = carry
            view = None if static is None else paged.PageView(table, lengths, *static)
            return block.decode(x, positions, k_all, v_all, layer, kv_len, view)

        scan = _scan(block_fn, in_axes=(0, 0, nnx.Carry, None, None, None), out_axes=nnx.Carry)
        layers = jnp.arange(self.cfg.n_layers, dtype=jnp.int32)
        dtype = self.policy.cache_dtype
        storage = cache_storage(dtype)
        table, lengths = (None, None) if pages is None else (pages.table, pages.lengths)
        x, k_all, v_all = scan(
            self.blocks,
            layers,
            (x, *(to_storage(c, dtype) for c in cache)),
            positions,
            table,
            lengths,
        )
        # Back in the dtype the caller gave: the storage as is, else the cache dtype's values.
        out = [
            c if a.dtype == storage else from_storage(c, dtype)
            for c, a in zip((k_all, v_all), cache, strict=True)
        ]
        if pages is None:
            axes = cache_axes(cache_layout(self.sharder.platform))
            cache = KVCache(*(self.sharder.constrain(c, axes) for c in out))
        else:
            kv = self.cfg.n_kv_heads
            cache = KVCache(*(paged.constrain_paged_cache(self.sharder, c, kv) for c in out))
        return self.logits(self.final_norm(x)[:, 0]), cache
