"""The trainer's E1-E3 from final hidden states, in vocabulary chunks (no `[N, V]` array).

`chunked_pruned_logprobs(h, W, y)` computes what `pruning.pruned_token_logprobs` computes from
logits z = (h W) / tau, without materialising them: two passes over vocabulary chunks and a
custom VJP that recomputes each chunk's logits (the math is in `chunked_token_stats` and
`_chunked_bwd`). `chunked_token_stats` adds `PositionStats`, diagnostics of the full trainer
distribution (entropy, z_y - max z) from the same pass. On a mesh it runs under `shard_map`,
laid out by `dvp_jax/dvp/vocab_mesh.py`. It does not build logits for anything else, and the
in-memory E1-E3 core stays in `pruning` (numerics as there).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from dvp_jax.dvp.pruning import LOGP_FLOOR, TokenLogprobs, _check_static_args, pruning_enabled
from dvp_jax.dvp.vocab_mesh import (
    LOCAL,
    find_mesh,
    first_column,
    gather_w,
    mesh_axes,
    reduce_dw,
    reshape_to,
    vocab_max,
    vocab_sum,
)

# Default vocabulary chunk for `chunked_pruned_logprobs` (benchmarks/pruned_logprobs.py).
DEFAULT_CHUNK_SIZE = 8192


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


def _zeros(shape, h, w, y) -> jax.Array:
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
    zeros = _zeros((n,), h, w, y)
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
def _chunked(h, w, y, kept, log_rho, temperature, chunk_size, precision, axes, with_h):
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

    init = (_zeros(h.shape, h, w, y), _zeros(w.shape, h, w, y))
    (dh, dw), _ = jax.lax.scan(body, init, jnp.arange(n_chunks))
    dh = vocab_sum(dh, axes)
    dw = reduce_dw(dw, axes)
    return dh.astype(h.dtype), dw.astype(w_local.dtype), None, None


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def chunked_pruned_logprobs(h: jax.Array, w: jax.Array, y: jax.Array, **kwargs) -> TokenLogprobs:
    """Pruned token log-probabilities (E1-E3) of targets y, in vocabulary chunks: the
    `TokenLogprobs` of `chunked_token_stats`, which takes the same (keyword) arguments."""
    return chunked_token_stats(h, w, y, **kwargs)[0]


def chunked_token_stats(
    h: jax.Array,
    w: jax.Array,
    y: jax.Array,
    *,
    log_rho: float | None,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    precision: jax.lax.Precision | str | None = None,
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
    policy_entropy: bool = False,
    kept_ids: jax.Array | None = None,
) -> tuple[TokenLogprobs, PositionStats]:
    """Pruned token log-probabilities (E1-E3) of targets y and per-position diagnostics, in
    vocabulary chunks.

    With logits z = (h W) / tau: log pi_S(y) = z_y - logsumexp_{b in V_S} z_b (E2), where
    V_S = {a : z_a >= max_b z_b + log_rho} (E1), and delta_S = 1 - sum_{V_S} softmax(z) (E3).

    Forward: pass 1 takes the row max over chunks; pass 2 accumulates the safe-set and full sums
    of exp(z - max), |V_S| and the target logit (one pass with an online logsumexp when pruning is
    off). Backward (custom VJP): recomputes each chunk's logits and accumulates the gradients for
    `h` and `W`. No `[N, V]` array exists in either direction; the largest temporaries are
    `[N, chunk_size]` float32. The safe-set indicator is piecewise constant in z and is given zero
    gradient; `logp` is the constant `LOGP_FLOOR` (zero gradient) where y is outside V_S.
    `logp`, `logp_full` and `pruned_mass` are all differentiable.

    The same pass accumulates `PositionStats` of the full distribution pi = softmax(z): the
    entropy (pass 2 adds u = sum_b exp(z_b - m) (z_b - m) beside s = sum_b exp(z_b - m), and
    H = log s - u / s; the online pass rescales u with its running max) and z_y - max_b z. They
    are returned under stop-gradient (diagnostics, not objectives). With `policy_entropy` the
    pass also sums u over V_S and returns H(pi_S) (H(pi) unpruned) with its gradient (E12).

    On a mesh (`mesh`, else the mesh of Explicit-sharded `h` / `w`, else the context mesh of
    `jax.set_mesh`) the computation runs under `jax.shard_map`, laid out as
    `dvp_jax.sharding.TRAIN_RULES` lays out the unembedding:

    * vocabulary-parallel over "tensor" (`vocab_mesh.VOCAB_MESH_AXIS`) when it divides V: each
      device runs the chunk loop over its own V / n_tensor columns, and the shards combine
      through [N]-sized collectives only (pmax of the row max, psum of the safe and full sums,
      |V_S| and the target logit; backward, psum of dh over tensor). W is never gathered along
      V, and dW stays vocabulary-sharded;
    * rows of h, y and the outputs split over the other mesh axes (those that divide N, in mesh
      order; e.g. ("data", "fsdp"));
    * W's d split over "fsdp" (`vocab_mesh.EMBED_MESH_AXIS`) on entry when fsdp is a row axis
      and divides d: the local shard `[d / n_fsdp, V / n_tensor]` is all-gathered over fsdp to
      `[d, V / n_tensor]` once in the forward and once in the backward pass (ZeRO-3), and dW is
      reduce-scattered back over fsdp and psum'd over the remaining row axes.

    Inputs laid out differently are resharded by the partitioner on entry. Without a mesh the
    call is a plain program (jit partitions it by GSPMD if the inputs are sharded). Under jit with
    Auto mesh axes the arrays carry no mesh, so pass `mesh` (or call under `jax.set_mesh`) to get
    the vocabulary-parallel path. V need not be a multiple of `chunk_size`: the last chunk of each
    shard is shifted back and its repeated columns masked.

    Args:
      h: `[N, d]` final hidden states (leading dims `[..., d]` are flattened and restored).
      w: `[d, V]` unembedding matrix.
      y: `[N]` int target ids in [0, V) (give padding positions any valid id and mask them later).
      log_rho: static log min-p threshold (<= 0); None or -inf means no pruning.
      temperature: static tau > 0.
      chunk_size: static number of vocabulary columns per chunk (clamped to the local V).
      precision: static matmul precision of every einsum, forward and backward (a
        `jax.lax.Precision` or its name, e.g. "highest", or a `jax.lax.DotAlgorithmPreset`);
        None is the backend default.
      mesh: the device mesh to partition over (see above); None looks it up from the arrays'
        types or the context.
      policy_entropy: static; also return `PositionStats.policy_entropy` (differentiable).
      kept_ids: `[..., W]` int the rollout's truncation set K of each position (E13: ids, -1
        padded, a row of -1 only = no truncation); None or W = 0: none. With K, V_S becomes
        V_T = {a in K : z_a >= max_{b in K} z_b + log_rho}: pass 1 also takes max over K, each
        chunk marks K's columns by a scatter of the W ids, and the backward pass does the same.

    Returns:
      `(TokenLogprobs, PositionStats)` whose fields have the leading shape of `h` (`[N]`):
      `logp` (E2, floor outside V_S), `in_safe`, `pruned_mass` (E3), `safe_size` (int32),
      `logp_full`; `entropy`, `log_rel` (and `policy_entropy`, else None).
    """
    log_rho = _check_static_args(log_rho, temperature)
    if not isinstance(chunk_size, int | np.integer) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}.")
    if h.ndim < 1 or w.ndim != 2 or h.shape[-1] != w.shape[0]:
        raise ValueError(f"need h [..., d] and w [d, V]; got h {h.shape}, w {w.shape}.")
    if y.shape != h.shape[:-1]:
        raise ValueError(f"y must have shape h.shape[:-1] = {h.shape[:-1]}, got {y.shape}.")
    precision = _as_precision(precision)
    n = math.prod(h.shape[:-1])
    mesh = find_mesh(h, w, mesh)
    axes = LOCAL if mesh is None else mesh_axes(mesh, n, *w.shape)
    if kept_ids is None:
        kept_ids = jnp.zeros(h.shape[:-1] + (0,), jnp.int32)
    if kept_ids.shape[:-1] != h.shape[:-1]:
        raise ValueError(
            f"kept_ids must have shape h.shape[:-1] + (W,) = {h.shape[:-1]} + (W,), "
            f"got {kept_ids.shape}."
        )
    width = kept_ids.shape[-1]

    def run(h, w, y, kept):
        args = (log_rho, float(temperature), int(chunk_size), precision, axes, policy_entropy)
        return _chunked(h, w, y, kept, *args)

    lead, y = h.shape[:-1], y.astype(jnp.int32)
    kept_ids = kept_ids.astype(jnp.int32)
    if mesh is None:
        if jax.sharding.AxisType.Manual in jax.sharding.get_abstract_mesh().axis_types:
            # Inside the caller's shard_map: h and W are made to vary over every axis that h, W
            # or y vary over, so the custom VJP's cotangents have their primal's type; autodiff
            # then sums dh / dW over the axes added here.
            tag = _zeros((), h, w, y)
            h, w = h + tag.astype(h.dtype), w + tag.astype(w.dtype)
        out = run(h.reshape(n, h.shape[-1]), w, y.reshape(n), kept_ids.reshape(n, width))
        return _outputs(out, lambda x: x.reshape(lead))
    row = axes.rows or None
    h_spec, w_spec, y_spec = P(row, None), P(axes.embed, axes.vocab), P(row)
    explicit = jax.sharding.AxisType.Explicit in mesh.axis_types
    # Outputs are laid out like the leading dims of h (on Explicit axes, where h has a type).
    lead_spec = P(
        *(tuple(getattr(jax.typeof(h).sharding, "spec", ())) + (None,) * h.ndim)[: len(lead)]
    )

    def placed(spec):
        """Explicit axes: typed shardings must equal the in_specs (resharding is a no-op where
        they already do); a concrete mesh names its devices (needed outside jit), an abstract
        one comes from the types under jit. Auto axes: None, the partitioner places."""
        if not explicit:
            return None
        return (
            jax.sharding.NamedSharding(mesh, spec) if isinstance(mesh, jax.sharding.Mesh) else spec
        )

    with jax.sharding.use_abstract_mesh(getattr(mesh, "abstract_mesh", mesh)):
        h = reshape_to(h, (n, h.shape[-1]), placed(h_spec))
        y = reshape_to(y, (n,), placed(y_spec))
        kept_spec = P(row, None)
        kept_ids = reshape_to(kept_ids, (n, width), placed(kept_spec))
        w = jax.sharding.reshard(w, placed(w_spec)) if explicit else w
        out = jax.shard_map(
            run, mesh=mesh, in_specs=(h_spec, w_spec, y_spec, kept_spec), out_specs=y_spec
        )(h, w, y, kept_ids)
        return _outputs(out, lambda x: reshape_to(x, lead, placed(lead_spec)))


def _outputs(out, reshape) -> tuple[TokenLogprobs, PositionStats]:
    """`_chunked`'s (TokenLogprobs, PositionStats) reshaped; the diagnostics under stop-gradient
    (`policy_entropy` keeps its gradient)."""
    logprobs, stats = jax.tree.map(reshape, out)
    diag = jax.lax.stop_gradient((stats.entropy, stats.log_rel))
    return TokenLogprobs(*logprobs), PositionStats(*diag, stats.policy_entropy)


def _as_precision(precision) -> jax.lax.Precision | jax.lax.DotAlgorithmPreset | None:
    if precision is None or isinstance(precision, jax.lax.Precision | jax.lax.DotAlgorithmPreset):
        return precision
    try:
        return jax.lax.Precision(precision)
    except ValueError:
        names = [p.name.lower() for p in jax.lax.Precision]
        raise ValueError(
            f"precision must be None, a jax.lax.Precision, a jax.lax.DotAlgorithmPreset or one "
            f"of {names}; got {precision!r}."
        ) from None
