"""The chunked E1-E3 on one shard of the vocabulary: two passes over chunks of W and the custom
VJP that recomputes each chunk's logits (`chunked.py` is the public entry: shapes, the mesh and
`shard_map`). The math of the passes is in `chunked.chunked_token_stats`' docstring; the
diagnostics of the full distribution it carries are `PositionStats`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dvp_jax.dvp.pruning import LOGP_FLOOR, TokenLogprobs, pruning_enabled
from dvp_jax.dvp.vocab_mesh import (
    first_column,
    gather_w,
    reduce_dw,
    vocab_max,
    vocab_sum,
)


class PositionStats(NamedTuple):
    """Diagnostics of the full trainer distribution pi = softmax(z) at each position (no gradient),
    and, when asked for, the differentiable entropy of the objective's distribution.

    Attributes:
      entropy: `[N]` float32, H(pi) = -sum_b pi_b log pi_b in nats, over the whole vocabulary
        (unpruned, at temperature tau).
      log_rel: `[N]` float32, z_y - max_b z_b = log(pi(y) / max_b pi(b)) <= 0: y is inside the
        safe set V_S of any threshold rho iff log_rel >= log rho (E1).
      policy_entropy: `[N]` float32 H(pi_S) over V_S (H(pi) without pruning), differentiable
        (the entropy bonus, E12); None unless `policy_entropy=True`.
    """

    entropy: jax.Array
    log_rel: jax.Array
    policy_entropy: jax.Array | None = None


# ---------------------------------------------------------------------------------------------


def tagged_zeros(shape, h, w, y) -> jax.Array:
    """float32 zeros of `shape` typed like the chunk logits: varying over every mesh axis that
    h, W or y vary over when traced under `shard_map` (ours or the caller's), as `check_vma`
    requires of scan carries. Plain zeros elsewhere."""
    tag = sum(jnp.zeros_like(x, jnp.float32, shape=()) for x in (h, w, y))
    return jnp.zeros(shape, jnp.float32) + tag


def _chunk_geometry(vocab: int, chunk_size: int) -> tuple[int, int]:
    chunk = min(chunk_size, vocab)
    return chunk, -(-vocab // chunk)


def _chunk_logits(h, w, i, chunk, inv_tau, precision, col0):
    """Chunk i of the local W: `([N, C] float32 z, [C] global column ids, [C] valid, start,
    [d, C] W chunk)`; `col0` is the global id of the local shard's first column.

    The last chunk is shifted back to end at the local V instead of being padded: its columns that
    an earlier chunk already covered are marked invalid. Equivalent to padding V up to a multiple of
    C with masked columns, without copying W.
    """
    first_new = i * chunk
    start = jnp.minimum(first_new, w.shape[1] - chunk)
    w_c = jax.lax.dynamic_slice_in_dim(w, start, chunk, axis=1)
    # [N, d] x [d, C] -> [N, C], accumulated and returned in float32.
    z = jnp.einsum("nd,dv->nv", h, w_c, preferred_element_type=jnp.float32, precision=precision)
    local = start + jnp.arange(chunk)
    return z * inv_tau, col0 + local, local >= first_new, start, w_c


def _kept_chunk(kept, cols):
    """`[N, C]` bool: column `cols` (`[C]` consecutive global ids) in each row's kept set K
    (E13; `kept` `[N, W]` ids, -1 padded; a row of -1 only keeps everything). A scatter of the
    W ids into the chunk, N W writes, instead of an `[N, C, W]` comparison."""
    n, c = kept.shape[0], cols.shape[0]
    local = kept - cols[0]
    local = jnp.where((kept >= 0) & (local >= 0) & (local < c), local, c)  # c: dump column
    mask = jnp.zeros((n, c + 1), bool).at[jnp.arange(n)[:, None], local].set(True)[:, :c]
    return mask | jnp.all(kept < 0, axis=-1, keepdims=True)


def _forward(h, w, y, kept, log_rho, temperature, chunk_size, precision, axes, with_h):
    """Both passes on the local vocabulary shard, combined across shards. Returns
    `((TokenLogprobs, PositionStats), residuals)`; `with_h` adds `policy_entropy`; `kept`
    `[N, W]` the rollout's truncation sets (E13; W = 0: none)."""
    w_local = w
    w = gather_w(w, axes)
    chunk, n_chunks = _chunk_geometry(w.shape[1], chunk_size)
    inv_tau = 1.0 / temperature
    col0 = first_column(w, axes)
    n = h.shape[0]
    idx = jnp.arange(n_chunks)
    zeros = tagged_zeros((n,), h, w, y)
    neg_inf = zeros - jnp.inf
    logits = lambda i: _chunk_logits(h, w, i, chunk, inv_tau, precision, col0)

    def target_logit(z, cols, valid):
        hit = valid & (cols[None, :] == y[:, None])
        return jnp.sum(jnp.where(hit, z, 0.0), axis=-1)

    truncated = kept.shape[-1] > 0  # static
    in_kept = lambda valid, cols: valid & _kept_chunk(kept, cols) if truncated else valid
    if pruning_enabled(log_rho) or truncated:
        # Pass 1: row max m over all valid columns (local max, then across vocabulary shards);
        # with truncation also the max m_K over the kept set K, E1's reference there (E13).
        def max_body(carry, i):
            z, cols, valid, _, _ = logits(i)
            top = lambda mask: jnp.max(jnp.where(mask, z, -jnp.inf), axis=-1)
            if not truncated:
                return jnp.maximum(carry, top(valid)), None
            m, m_kept = carry
            return (
                jnp.maximum(m, top(valid)),
                jnp.maximum(m_kept, top(in_kept(valid, cols))),
            ), None

        init = (neg_inf, neg_inf) if truncated else neg_inf
        m = vocab_max(jax.lax.scan(max_body, init, idx)[0], axes)
        m, m_kept = m if truncated else (m, m)
        thr = m_kept + (log_rho if pruning_enabled(log_rho) else -jnp.inf)

        # Pass 2: sums of exp(z - m) (each term <= 1) inside and outside V_S, |V_S| and the
        # target logit. The outside sum gives delta_S without 1 - S/F cancellation. u is the
        # entropy's sum of exp(z - m) (z - m) over all columns; u_safe (with_h) the same over V_S.
        def sum_body(carry, i):
            s_safe, s_out, size, z_y, u, *u_safe = carry
            z, cols, valid, _, _ = logits(i)
            safe = in_kept(valid, cols) & (z >= thr[:, None])
            shifted = z - m[:, None]
            e = jnp.exp(shifted)
            out = (
                s_safe + jnp.sum(jnp.where(safe, e, 0.0), axis=-1),
                s_out + jnp.sum(jnp.where(valid & ~safe, e, 0.0), axis=-1),
                size + jnp.sum(safe, axis=-1, dtype=jnp.int32),
                z_y + target_logit(z, cols, valid),
                u + jnp.sum(jnp.where(valid, e * shifted, 0.0), axis=-1),
            )
            return out + tuple(
                x + jnp.sum(jnp.where(safe, e * shifted, 0.0), -1) for x in u_safe
            ), None

        init = (zeros, zeros, zeros.astype(jnp.int32), zeros, zeros) + ((zeros,) if with_h else ())
        # Each shard's partial sums share the global m, so they add; z_y is nonzero on the one
        # shard holding column y. One [N]-sized psum per quantity.
        s_safe, s_out, size, z_y, u, *u_safe = vocab_sum(jax.lax.scan(sum_body, init, idx)[0], axes)
        s_full = s_safe + s_out
        pruned_mass = s_out / s_full
        in_safe = z_y >= thr
        if truncated:  # y in K; s_safe >= exp(m_K - m) > 0 unless K lies ~87 nats under m
            in_safe = in_safe & (jnp.any(kept == y[:, None], -1) | jnp.all(kept < 0, -1))
            s_safe = jnp.maximum(s_safe, jnp.finfo(jnp.float32).tiny)
    else:
        # No pruning: one pass with an online (rescaled) logsumexp per shard, then the shards'
        # (max, sum) pairs are rescaled to the global max and added. The entropy sum
        # u = sum exp(z - m) (z - m) moves with the max: u' = c (u + s (m - m')), c = exp(m - m').
        def online_body(carry, i):
            m, s_full, z_y, u = carry
            z, cols, valid, _, _ = logits(i)
            m_new = jnp.maximum(m, jnp.max(jnp.where(valid, z, -jnp.inf), axis=-1))
            shifted = z - m_new[:, None]
            e = jnp.where(valid, jnp.exp(shifted), 0.0)
            u = _rescale_u(u, s_full, m, m_new) + jnp.sum(jnp.where(valid, e * shifted, 0.0), -1)
            s_full = s_full * jnp.exp(m - m_new) + jnp.sum(e, axis=-1)
            return (m_new, s_full, z_y + target_logit(z, cols, valid), u), None

        init = (neg_inf, zeros, zeros, zeros)
        (m_local, s_local, z_y, u_local), _ = jax.lax.scan(online_body, init, idx)
        m = vocab_max(m_local, axes)
        u_local = _rescale_u(u_local, s_local, m_local, m)
        s_full, z_y, u = vocab_sum((s_local * jnp.exp(m_local - m), z_y, u_local), axes)
        s_safe, u_safe = s_full, [u]
        thr = neg_inf
        pruned_mass = jnp.zeros_like(s_full)
        size = jnp.full((n,), w.shape[1] * axes.n_vocab, jnp.int32)
        in_safe = jnp.ones((n,), bool)

    lse_safe = m + jnp.log(s_safe)  # s_safe >= 1: the argmax is always safe (E13: > 0)
    lse_full = m + jnp.log(s_full)
    # H = -sum p (z - lse) = log s - u / s with p = exp(z - m) / s (s >= 1, u <= 0).
    stats = PositionStats(entropy=jnp.log(s_full) - u / s_full, log_rel=z_y - m)
    if with_h:  # the same identity over V_S: H(pi_S) = log s_S - u_S / s_S
        stats = stats._replace(policy_entropy=jnp.log(s_safe) - u_safe[0] / s_safe)
    out = TokenLogprobs(
        logp=jnp.where(in_safe, z_y - lse_safe, LOGP_FLOOR),
        in_safe=in_safe,
        pruned_mass=pruned_mass,
        safe_size=size,
        logp_full=z_y - lse_full,
    )
    # The local (un-gathered) W shard is kept; the backward pass gathers it again.
    residuals = (h, w_local, y, kept, m, thr, lse_safe, lse_full, in_safe, pruned_mass)
    return (out, stats), residuals + (stats.policy_entropy,)


def _rescale_u(u, s, m, m_new):
    """The entropy sum u = sum exp(z - m) (z - m) re-expressed at a new max m' >= m:
    exp(m - m') (u + s (m - m')); 0 while nothing has been summed (m = -inf, s = 0)."""
    gap = jnp.where(jnp.isfinite(m), m - m_new, 0.0)
    return jnp.exp(m - m_new) * (u + s * gap)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8, 9))
def chunked_shard(h, w, y, kept, log_rho, temperature, chunk_size, precision, axes, with_h):
    """(TokenLogprobs, PositionStats) of rows `h` `[N, d]` against this shard's `w` `[d, V /
    shards]` (`axes`: the mesh axes the vocabulary is split over), differentiable in h and w."""
    return _forward(h, w, y, kept, log_rho, temperature, chunk_size, precision, axes, with_h)[0]


def _chunked_fwd(h, w, y, kept, log_rho, temperature, chunk_size, precision, axes, with_h):
    return _forward(h, w, y, kept, log_rho, temperature, chunk_size, precision, axes, with_h)


def _chunked_bwd(log_rho, temperature, chunk_size, precision, axes, with_h, residuals, all_cts):
    """Recomputes each chunk's logits and accumulates dL/dh and dL/dW.

    With p = softmax(z), q = softmax over V_S, S the safe indicator (treated as constant):
      d logp / dz_b        = [y in V_S] (1[b = y] - q_b)
      d logp_full / dz_b   = 1[b = y] - p_b
      d pruned_mass / dz_b = p_b ((1 - delta_S) - S_b)
      d policy_entropy / dz_b = -q_b (log q_b + H(q))   (with_h; q = p without pruning)
    and dz/d(h W) = 1/tau. With a truncation set K (E13) V_S is V_T = K cap {z >= m_K + log rho}
    and q is computed as exp(z - lse_safe) directly (lse_safe may lie far below lse_full).
    Every factor is per column given the global (m, lse_safe, lse_full)
    of the forward pass, so each vocabulary shard computes its own columns' dz: dW stays on its
    shard (summed over the row shards) and dh is summed over the vocabulary shards. The
    `PositionStats` diagnostics' cotangents are ignored (the public functions return them under
    stop-gradient, so theirs are always zero); `policy_entropy`'s is used.
    """
    cts = all_cts[0]
    h, w_local, y, kept, m, thr, lse_safe, lse_full, in_safe, pruned_mass, h_policy = residuals
    truncated = kept.shape[-1] > 0
    w = gather_w(w_local, axes)
    chunk, n_chunks = _chunk_geometry(w.shape[1], chunk_size)
    inv_tau = 1.0 / temperature
    col0 = first_column(w, axes)
    g_logp = jnp.where(in_safe, cts.logp.astype(jnp.float32), 0.0)
    g_full = cts.logp_full.astype(jnp.float32)
    g_mass = cts.pruned_mass.astype(jnp.float32)
    full_over_safe = jnp.exp(lse_full - lse_safe)  # 1 / (1 - delta_S)
    g_h = all_cts[1].policy_entropy.astype(jnp.float32) if with_h else None

    def body(carry, i):
        dh, dw = carry
        z, cols, valid, start, w_c = _chunk_logits(h, w, i, chunk, inv_tau, precision, col0)
        if truncated:
            safe = valid & _kept_chunk(kept, cols) & (z >= thr[:, None])
        else:
            safe = valid & (z >= thr[:, None])
        p = jnp.where(valid, jnp.exp(z - lse_full[:, None]), 0.0)
        if truncated:
            q = jnp.where(safe, jnp.exp(z - lse_safe[:, None]), 0.0)
        else:
            q = jnp.where(safe, p * full_over_safe[:, None], 0.0)  # softmax over V_S, one exp
        onehot = (valid & (cols[None, :] == y[:, None])).astype(jnp.float32)
        dz = (
            g_logp[:, None] * (onehot - q)
            + g_full[:, None] * (onehot - p)
            + g_mass[:, None] * p * ((1.0 - pruned_mass)[:, None] - safe)
        )
        if with_h:
            log_q = jnp.where(safe, z - lse_safe[:, None], 0.0)
            dz = dz - g_h[:, None] * q * (log_q + h_policy[:, None])
        dz = dz * inv_tau
        # [N, C] x [d, C] -> [N, d]
        dh = dh + jnp.einsum(
            "nv,dv->nd", dz, w_c, preferred_element_type=jnp.float32, precision=precision
        )
        # [N, d] x [N, C] -> [d, C]; overlapping columns of the last chunk carry dz = 0.
        dw_c = jnp.einsum(
            "nd,nv->dv", h, dz, preferred_element_type=jnp.float32, precision=precision
        )
        old = jax.lax.dynamic_slice_in_dim(dw, start, chunk, axis=1)
        dw = jax.lax.dynamic_update_slice_in_dim(dw, old + dw_c, start, axis=1)
        return (dh, dw), None

    init = (tagged_zeros(h.shape, h, w, y), tagged_zeros(w.shape, h, w, y))
    (dh, dw), _ = jax.lax.scan(body, init, jnp.arange(n_chunks))
    dh = vocab_sum(dh, axes)
    dw = reduce_dw(dw, axes)
    return dh.astype(h.dtype), dw.astype(w_local.dtype), None, None


chunked_shard.defvjp(_chunked_fwd, _chunked_bwd)
