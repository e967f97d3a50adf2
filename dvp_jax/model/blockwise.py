"""Memory-efficient causal attention in JAX: query and key blocks, an online softmax, unneeded
blocks skipped, and a custom VJP that recomputes each block in the backward pass.

`blockwise_attention` computes what the explicit path (`attention._masked_softmax_attention`)
computes, `out[t] = sum_s softmax_s(q[t] . k[s] / sqrt(h) + mask[t, s]) v[s]` with the causal,
same-segment mask (`attention.causal_mask`: a packed row's sequences never see each other),
without holding the T x T scores: the forward keeps one `[B, B]` score block per head and, per
query, the running max m, the running sum of exp(s - m) and the output accumulator; it saves
only the output and lse = m + log(sum). The backward recomputes each block's probabilities from
lse (`p = exp(s - lse)`) and accumulates dq, dk, dv (FlashAttention-2's algorithm). Every dot,
forward and backward, takes the policy's precision and accumulates in float32, so the float32
trainer stays true fp32 (`highest`) at 16k tokens.

Rows run one at a time (`lax.map`; on a mesh per shard of rows and heads, `kernels.per_shard`),
so each row skips the block pairs it does not need (`block_visits`): key blocks after the query
block (causal), and blocks whose segments cannot meet the query block's (another packed
sequence, or padding). The work is then that of the causal pairs within each sequence, rounded
out to blocks, whatever the row holds. A padding query in a visited block gets a finite output
(the average of the values of the blocks visited); one in a block no segment needs gets 0. Both
are padding, never read by the loss.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dvp_jax.model.kernels import per_shard

# Default query / key block (tokens).
BLOCK = 512
_MASKED = jnp.finfo(jnp.float32).min
_NO_SEGMENT = np.iinfo(np.int32).max  # the low end of a block without a segment


def block_size(seq_len: int, block: int = 0) -> int:
    """The block for sequences of `seq_len` tokens: `block` if given, else 512, or the length
    rounded up to a multiple of 8 when it is shorter."""
    block = block or BLOCK
    return min(block, -(-seq_len // 8) * 8)


def block_visits(segment_ids, size: int, xp=jnp):
    """Which (query block, key block) pairs of each row the kernel computes: `[b, nb, nb]` bool.

    Pair (i, j) is visited when j <= i (causal) and some query of block i and some key of block
    j can share a segment: the ranges [lo, hi] of their non-zero segment ids overlap. The
    packer numbers a row's sequences 1, 2, ... left to right, so a block's ids are a run of
    consecutive integers and overlapping ranges share an id: the test is exact there, and safe
    (never skips a needed pair) for any ids. A block of padding only (id 0) is never visited.

    Args:
      segment_ids: `[b, T]` int segment ids (0 padding), T a multiple of `size`.
      size: the block.
      xp: `jax.numpy` (inside the kernel) or `numpy` (the cost model, on the host).
    """
    b, t = segment_ids.shape
    blocks = segment_ids.reshape(b, t // size, size)
    hi = blocks.max(axis=-1)  # [b, nb]
    lo = xp.where(blocks > 0, blocks, _NO_SEGMENT).min(axis=-1)
    meet = (hi[:, None, :] >= lo[:, :, None]) & (lo[:, None, :] <= hi[:, :, None])
    nb = t // size
    causal = xp.tril(xp.ones((nb, nb), bool))
    return meet & causal[None]


def blockwise_attention(q, k, v, segment_ids, precision, block: int = 0, sharder=None):
    """Causal GQA attention within segments, by blocks (module docstring).

    Args:
      q: [b, t, n, h] queries (head n reads KV head n // g).
      k, v: [b, t, kv, h].
      segment_ids: [b, t] int32 segment of each token (0 padding), or bool valid.
      precision: the matmul precision of every dot (the policy's).
      block: query / key block in tokens (`block_size`); T is padded up to a multiple of it.
      sharder: the mesh and rules of q, k, v: on a mesh, one kernel per (rows, heads) shard.
    Returns:
      [b, t, n, h] in q's dtype.
    """
    t = q.shape[1]
    size = block_size(t, block)
    padded = -(-t // size) * size
    segment_ids = jnp.asarray(segment_ids).astype(jnp.int32)
    if padded != t:
        pad = ((0, 0), (0, padded - t), (0, 0), (0, 0))
        q, k, v = (jnp.pad(x, pad) for x in (q, k, v))
        segment_ids = jnp.pad(segment_ids, ((0, 0), (0, padded - t)))
    local = functools.partial(_local, precision=precision, size=size)
    return per_shard(local, q, k, v, segment_ids, sharder)[:, :t]


def _local(q, k, v, segment_ids, *, precision, size):
    """The rows and heads of one shard, one row at a time."""
    b, t, n, h = q.shape
    kv = k.shape[2]
    grouped = q.reshape(b, t, kv, n // kv, h)
    row = lambda args: _attend(*args, precision, size)
    return jax.lax.map(row, (grouped, k, v, segment_ids)).reshape(b, t, n, h)


def _blocks(x, size: int):
    """[T, ...] -> [T / size, size, ...]."""
    return x.reshape(x.shape[0] // size, size, *x.shape[1:])


def _scores(qb, kb, qseg, kseg, qi, kj, size: int, precision):
    """Scaled, masked float32 scores of query block qi against key block kj: [k, g, B, B].

    qb: [B, k, g, h]; kb: [B, k, h]; qseg, kseg: [B] int32 segment ids.
    """
    h = qb.shape[-1]
    s = jnp.einsum(
        "qkgh,skh->kgqs", qb, kb, precision=precision, preferred_element_type=jnp.float32
    )
    s = s * (h**-0.5)
    rows = qi * size + jnp.arange(size)
    cols = kj * size + jnp.arange(size)
    visible = (cols[None, :] <= rows[:, None]) & (qseg[:, None] == kseg[None, :])
    visible = visible & (kseg[None, :] != 0)  # [Bq, Bk]
    return jnp.where(visible, s, _MASKED)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _attend(q, k, v, seg, precision, size):
    return _forward(q, k, v, seg, precision, size)[0]


def _forward(q, k, v, seg, precision, size):
    """One row: output [T, k, g, h] and lse [k, g, T] (float32)."""
    qs, ks, vs, segs = _blocks(q, size), _blocks(k, size), _blocks(v, size), _blocks(seg, size)
    visits = block_visits(seg[None], size)[0]  # [nb, nb]
    nb = qs.shape[0]
    _, kv, g, h = q.shape

    def query_block(qi):
        qb = qs[qi]

        def key_block(carry, kj):
            def visit(carry):
                m, total, acc = carry
                s = _scores(qb, ks[kj], segs[qi], segs[kj], qi, kj, size, precision)
                m_new = jnp.maximum(m, s.max(axis=-1))
                p = jnp.exp(s - m_new[..., None])
                correction = jnp.exp(m - m_new)
                pv = jnp.einsum(
                    "kgqs,skh->kgqh",
                    p.astype(v.dtype),
                    vs[kj],
                    precision=precision,
                    preferred_element_type=jnp.float32,
                )
                total = total * correction + p.sum(axis=-1)
                return m_new, total, acc * correction[..., None] + pv

            return jax.lax.cond(visits[qi, kj], visit, lambda c: c, carry), None

        init = (
            jnp.full((kv, g, size), _MASKED, jnp.float32),
            jnp.zeros((kv, g, size), jnp.float32),
            jnp.zeros((kv, g, size, h), jnp.float32),
        )
        (m, total, acc), _ = jax.lax.scan(key_block, init, jnp.arange(nb))
        # A query block no segment needs visits nothing: output 0 (padding, never read).
        seen = total > 0
        out = jnp.where(seen[..., None], acc / jnp.where(seen, total, 1.0)[..., None], 0.0)
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, total, 1.0)), 0.0)
        return jnp.moveaxis(out.astype(q.dtype), 2, 0), lse  # [B, k, g, h], [k, g, B]

    outs, lses = jax.lax.map(query_block, jnp.arange(nb))
    out = outs.reshape(nb * size, kv, g, h)
    lse = jnp.moveaxis(lses, 0, 2).reshape(kv, g, nb * size)
    return out, lse


def _attend_fwd(q, k, v, seg, precision, size):
    out, lse = _forward(q, k, v, seg, precision, size)
    return out, (q, k, v, seg, out, lse)


def _attend_bwd(precision, size, residuals, d_out):
    q, k, v, seg, out, lse = residuals
    qs, ks, vs, segs = _blocks(q, size), _blocks(k, size), _blocks(v, size), _blocks(seg, size)
    visits = block_visits(seg[None], size)[0]
    dos = _blocks(d_out, size)
    nb = qs.shape[0]
    h = q.shape[-1]
    # D[t] = sum_h dout[t] . out[t], per query: the softmax's backward term.
    delta = jnp.einsum(
        "tkgh,tkgh->kgt", d_out.astype(jnp.float32), out.astype(jnp.float32), precision=precision
    )
    lses = jnp.moveaxis(lse.reshape(*lse.shape[:2], nb, size), 2, 0)  # [nb, k, g, B]
    deltas = jnp.moveaxis(delta.reshape(*delta.shape[:2], nb, size), 2, 0)
    dot = functools.partial(jnp.einsum, precision=precision, preferred_element_type=jnp.float32)

    def key_block(dq, kj):
        kb, vb = ks[kj], vs[kj]

        def query_block(carry, qi):
            def visit(carry):
                dk, dv, dq = carry
                qb, dob = qs[qi], dos[qi]
                s = _scores(qb, kb, segs[qi], segs[kj], qi, kj, size, precision)
                p = jnp.exp(s - lses[qi][..., None])  # [k, g, Bq, Bk]
                dv = dv + dot("kgqs,qkgh->skh", p.astype(dob.dtype), dob)
                dp = dot("qkgh,skh->kgqs", dob, vb)
                ds = p * (dp - deltas[qi][..., None]) * (h**-0.5)
                dk = dk + dot("kgqs,qkgh->skh", ds.astype(qb.dtype), qb)
                dq_block = dot("kgqs,skh->qkgh", ds.astype(kb.dtype), kb)
                dq = jax.lax.dynamic_update_index_in_dim(dq, dq[qi] + dq_block, qi, 0)
                return dk, dv, dq

            return jax.lax.cond(visits[qi, kj], visit, lambda c: c, carry), None

        zeros = jnp.zeros(kb.shape, jnp.float32)
        (dk, dv, dq), _ = jax.lax.scan(query_block, (zeros, zeros, dq), jnp.arange(nb))
        return dq, (dk, dv)

    dq0 = jnp.zeros(qs.shape, jnp.float32)
    dq, (dks, dvs) = jax.lax.scan(key_block, dq0, jnp.arange(nb))
    unblock = lambda x: x.reshape(nb * size, *x.shape[2:])
    return (
        unblock(dq).astype(q.dtype),
        unblock(dks).astype(k.dtype),
        unblock(dvs).astype(v.dtype),
        None,
    )


_attend.defvjp(_attend_fwd, _attend_bwd)
