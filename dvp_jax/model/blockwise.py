"""Memory-efficient causal attention in JAX: query and key blocks, an online softmax, causal
blocks skipped, and a custom VJP that recomputes each block in the backward pass.

`blockwise_attention` computes what the explicit path (`attention._masked_softmax_attention`)
computes, `out[t] = sum_s softmax_s(q[t] . k[s] / sqrt(h) + mask[t, s]) v[s]` with the causal,
key-padded mask, without holding the T x T scores: the forward keeps one `[B, B]` score block
per (row, head) and, per query, the running max m, the running sum of exp(s - m) and the output
accumulator; it saves only the output and lse = m + log(sum). The backward recomputes each block's
probabilities from lse (`p = exp(s - lse)`) and accumulates dq, dk, dv (FlashAttention-2's
algorithm). Key blocks after a query block are skipped (`lax.cond`). Every dot, forward and
backward, takes the policy's precision and accumulates in float32, so the float32 trainer stays
true fp32 (`highest`) at 16k tokens. A query with no visible key (padding before a row's first
token) gets a finite output, the average of the values in its own and earlier key blocks (the
explicit path averages all keys); both are padding, never read by the loss.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# Default query / key block (tokens).
BLOCK = 512
_MASKED = jnp.finfo(jnp.float32).min


def block_size(seq_len: int, block: int = 0) -> int:
    """The block for sequences of `seq_len` tokens: `block` if given, else 512, or the length
    rounded up to a multiple of 8 when it is shorter."""
    block = block or BLOCK
    return min(block, -(-seq_len // 8) * 8)


def blockwise_attention(q, k, v, valid, precision, block: int = 0):
    """Causal, key-padded GQA attention by blocks (module docstring).

    Args:
      q: [b, t, n, h] queries (head n reads KV head n // g).
      k, v: [b, t, kv, h].
      valid: [b, t] bool, False on padding keys.
      precision: the matmul precision of every dot (the policy's).
      block: query / key block in tokens (`block_size`); T is padded up to a multiple of it.
    Returns:
      [b, t, n, h] in q's dtype.
    """
    b, t, n, h = q.shape
    kv = k.shape[2]
    size = block_size(t, block)
    padded = -(-t // size) * size
    if padded != t:
        pad = ((0, 0), (0, padded - t), (0, 0), (0, 0))
        q, k, v = (jnp.pad(x, pad) for x in (q, k, v))
        valid = jnp.pad(valid, ((0, 0), (0, padded - t)))
    grouped = q.reshape(b, padded, kv, n // kv, h)
    out = _attend(grouped, k, v, valid, precision, size)
    return out.reshape(b, padded, n, h)[:, :t]


def _blocks(x, size: int):
    """[b, T, ...] -> [T / size, b, size, ...] (the block axis leads, for scans)."""
    b, t = x.shape[:2]
    return jnp.moveaxis(x.reshape(b, t // size, size, *x.shape[2:]), 1, 0)


def _unblocks(x):
    """Inverse of `_blocks`."""
    nb, b, size = x.shape[:3]
    return jnp.moveaxis(x, 0, 1).reshape(b, nb * size, *x.shape[3:])


def _scores(qb, kb, kvalid, qi, kj, size: int, precision):
    """Scaled, masked float32 scores of query block qi against key block kj: [b, k, g, B, B].

    qb: [b, B, k, g, h]; kb: [b, B, k, h]; kvalid: [b, B] bool.
    """
    h = qb.shape[-1]
    s = jnp.einsum(
        "bqkgh,bskh->bkgqs", qb, kb, precision=precision, preferred_element_type=jnp.float32
    )
    s = s * (h**-0.5)
    rows = qi * size + jnp.arange(size)
    cols = kj * size + jnp.arange(size)
    visible = (cols[None, :] <= rows[:, None])[None, :, :] & kvalid[:, None, :]  # [b, Bq, Bk]
    return jnp.where(visible[:, None, None], s, _MASKED)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _attend(q, k, v, valid, precision, size):
    return _forward(q, k, v, valid, precision, size)[0]


def _forward(q, k, v, valid, precision, size):
    """Output [b, T, k, g, h] and lse [b, k, g, T] (float32)."""
    qs, ks, vs, valids = _blocks(q, size), _blocks(k, size), _blocks(v, size), _blocks(valid, size)
    nb = qs.shape[0]
    b, _, kv, g, h = q.shape

    def query_block(qi):
        qb = qs[qi]

        def key_block(carry, kj):
            def visit(carry):
                m, total, acc = carry
                s = _scores(qb, ks[kj], valids[kj], qi, kj, size, precision)
                m_new = jnp.maximum(m, s.max(axis=-1))
                p = jnp.exp(s - m_new[..., None])
                correction = jnp.exp(m - m_new)
                pv = jnp.einsum(
                    "bkgqs,bskh->bkgqh",
                    p.astype(v.dtype),
                    vs[kj],
                    precision=precision,
                    preferred_element_type=jnp.float32,
                )
                total = total * correction + p.sum(axis=-1)
                return m_new, total, acc * correction[..., None] + pv

            return jax.lax.cond(kj <= qi, visit, lambda c: c, carry), None

        init = (
            jnp.full((b, kv, g, size), _MASKED, jnp.float32),
            jnp.zeros((b, kv, g, size), jnp.float32),
            jnp.zeros((b, kv, g, size, h), jnp.float32),
        )
        (m, total, acc), _ = jax.lax.scan(key_block, init, jnp.arange(nb))
        out = (acc / total[..., None]).astype(q.dtype)  # [b, k, g, B, h]
        return jnp.moveaxis(out, 3, 1), m + jnp.log(total)  # [b, B, k, g, h], [b, k, g, B]

    outs, lses = jax.lax.map(query_block, jnp.arange(nb))
    out = _unblocks(outs)
    lse = jnp.moveaxis(lses, 0, 3).reshape(b, kv, g, nb * size)
    return out, lse


def _attend_fwd(q, k, v, valid, precision, size):
    out, lse = _forward(q, k, v, valid, precision, size)
    return out, (q, k, v, valid, out, lse)


def _attend_bwd(precision, size, residuals, d_out):
    q, k, v, valid, out, lse = residuals
    qs, ks, vs, valids = _blocks(q, size), _blocks(k, size), _blocks(v, size), _blocks(valid, size)
    dos = _blocks(d_out, size)
    nb = qs.shape[0]
    h = q.shape[-1]
    # D[t] = sum_h dout[t] . out[t], per query: the softmax's backward term.
    delta = jnp.einsum(
        "btkgh,btkgh->bkgt",
        d_out.astype(jnp.float32),
        out.astype(jnp.float32),
        precision=precision,
    )
    lses = jnp.moveaxis(lse.reshape(*lse.shape[:3], nb, size), 3, 0)  # [nb, b, k, g, B]
    deltas = jnp.moveaxis(delta.reshape(*delta.shape[:3], nb, size), 3, 0)
    dot = functools.partial(jnp.einsum, precision=precision, preferred_element_type=jnp.float32)

    def key_block(dq, kj):
        kb, vb = ks[kj], vs[kj]

        def query_block(carry, qi):
            def visit(carry):
                dk, dv, dq = carry
                qb, dob = qs[qi], dos[qi]
                s = _scores(qb, kb, valids[kj], qi, kj, size, precision)
                p = jnp.exp(s - lses[qi][..., None])  # [b, k, g, Bq, Bk]
                dv = dv + dot("bkgqs,bqkgh->bskh", p.astype(dob.dtype), dob)
                dp = dot("bqkgh,bskh->bkgqs", dob, vb)
                ds = p * (dp - deltas[qi][..., None]) * (h**-0.5)
                dk = dk + dot("bkgqs,bqkgh->bskh", ds.astype(qb.dtype), qb)
                dq_block = dot("bkgqs,bskh->bqkgh", ds.astype(kb.dtype), kb)
                dq = jax.lax.dynamic_update_index_in_dim(dq, dq[qi] + dq_block, qi, 0)
                return dk, dv, dq

            return jax.lax.cond(qi >= kj, visit, lambda c: c, carry), None

        zeros = jnp.zeros(kb.shape, jnp.float32)
        (dk, dv, dq), _ = jax.lax.scan(query_block, (zeros, zeros, dq), jnp.arange(nb))
        return dq, (dk, dv)

    dq0 = jnp.zeros(qs.shape, jnp.float32)
    dq, (dks, dvs) = jax.lax.scan(key_block, dq0, jnp.arange(nb))
    return (
        _unblocks(dq).astype(q.dtype),
        _unblocks(dks).astype(k.dtype),
        _unblocks(dvs).astype(v.dtype),
        None,
    )


_attend.defvjp(_attend_fwd, _attend_bwd)
