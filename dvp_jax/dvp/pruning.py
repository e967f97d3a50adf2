"""Dynamic vocabulary pruning: safe set (E1), pruned log-probabilities (E2), pruned mass (E3).

The one implementation of E1-E3 (docs/design.md section 2), in two forms:

* From logits `[..., V]` already in memory: `safe_set_sums` is the core (row max, safe mask,
  shifted exponentials exp(z - max), and their sums inside and outside V_S) and `token_logprobs`
  turns it into the E2-E3 record of given tokens. `pruned_log_softmax`, `pruned_token_logprobs`
  (the small-shape reference path) and the rollout sampler (`rollout/sampling.py`, whose
  exponential race reuses the same exponentials) are built on them.
* From final hidden states and the unembedding (`chunked_pruned_logprobs`): used by the trainer.
  It never materialises a `[N, V]` float32 array: the vocabulary is visited in chunks of
  `chunk_size` columns (pass 1: row max; pass 2: masked logsumexp, full logsumexp, target logit)
  and a custom VJP recomputes each chunk's logits in the backward pass. Same sums, chunked.

Temperature `tau` divides the logits before everything else (docs/design.md section 2). `log_rho`
is <= 0; `None` or `-inf` means no pruning (the safe set is the whole vocabulary). The in-memory
core takes `log_rho` as a Python number or a (traced) array; the chunked path takes it static.

Numerics: softmax statistics are float32 whatever the input dtype; exponentials are always taken
of `z - max(z) <= 0`, so they never overflow; the E2 value `-inf` outside the safe set is replaced
by the finite `LOGP_FLOOR`, selected with `jnp.where` so no inf/NaN reaches a reduction or a
gradient. The pruned mass is summed from the pruned terms themselves (never 1 - S/F).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# Stands in for E2's -inf outside the safe set. Finite so that it survives arithmetic (exp gives
# exactly 0 in float32), large enough that nobody mistakes it for a log-probability.
LOGP_FLOOR = -1e9

# Default vocabulary chunk for `chunked_pruned_logprobs` (benchmarks/pruned_logprobs.py).
DEFAULT_CHUNK_SIZE = 8192


class PruneStats(NamedTuple):
    """Per-position pruning statistics.

    Attributes:
      pruned_mass: `[...]` float32, delta_S = 1 - sum_{b in V_S} softmax(z)_b (E3).
      safe_size: `[...]` int32, |V_S| (E1).
    """

    pruned_mass: jax.Array
    safe_size: jax.Array


class TokenLogprobs(NamedTuple):
    """Log-probabilities of given tokens y under one distribution, pruned and full (E1-E3).

    The one record for "log-probs of given tokens": the trainer's (`chunked_pruned_logprobs`),
    the reference path's (`pruned_token_logprobs`) and the rollout sampler's (sampled tokens, E4).
    Stored on the rollout side, its fields take the `behaviour_` prefix (`behaviour_logp`, ...).

    Attributes:
      logp: `[N]` float32, log pi_S(y) (E2); `LOGP_FLOOR` where y is outside V_S.
      in_safe: `[N]` bool, whether y is in V_S (E1).
      pruned_mass: `[N]` float32, delta_S (E3).
      safe_size: `[N]` int32, |V_S| (E1).
      logp_full: `[N]` float32, unpruned log pi(y) = z_y - logsumexp_b z_b.
    """

    logp: jax.Array
    in_safe: jax.Array
    pruned_mass: jax.Array
    safe_size: jax.Array
    logp_full: jax.Array


def pruning_enabled(log_rho: float | None) -> bool:
    """Whether `log_rho` (a Python number or None) prunes anything (E1)."""
    return log_rho is not None and log_rho != -math.inf


def _check_static_args(log_rho, temperature) -> float:
    """Validates a static `log_rho` / `temperature` pair and returns log_rho as a float."""
    if log_rho is None:
        log_rho = -math.inf
    log_rho = float(log_rho)
    if math.isnan(log_rho) or log_rho > 0:
        raise ValueError(f"log_rho must be <= 0 or -inf (no pruning), got {log_rho}.")
    temperature = float(temperature)
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a finite float > 0, got {temperature}.")
    return log_rho


def _scaled_logits(logits: jax.Array, temperature) -> jax.Array:
    # Upcast before the temperature so every softmax statistic below is float32.
    return logits.astype(jnp.float32) / temperature


def _as_log_rho(log_rho) -> jax.Array:
    return jnp.asarray(-jnp.inf if log_rho is None else log_rho, jnp.float32)


class SafeSetSums(NamedTuple):
    """The E1-E3 building blocks of one distribution, from float32 scaled logits z `[..., V]`.

    Attributes:
      z_max: `[..., 1]` max_b z_b, under stop-gradient (the E1-E3 values built from these
        are invariant to the shift, so it needs no gradient).
      shifted: `[..., V]` z - z_max (<= 0).
      safe: `[..., V]` bool, V_S = {a : z_a >= z_max + log_rho} (E1); the argmax is inside.
      exp_shifted: `[..., V]` exp(z - z_max) in [0, 1], exactly 1 at the argmax.
      sum_safe: `[..., 1]` sum of `exp_shifted` over V_S (>= 1, the argmax is safe).
      sum_out: `[..., 1]` sum of `exp_shifted` outside V_S.
    """

    z_max: jax.Array
    shifted: jax.Array
    safe: jax.Array
    exp_shifted: jax.Array
    sum_safe: jax.Array
    sum_out: jax.Array

    @property
    def pruned_mass(self) -> jax.Array:
        """`[...]` delta_S = sum_out / (sum_safe + sum_out) (E3), from the pruned terms
        themselves: 1 - sum_safe / sum_full would lose masses of order 1e-7 (the typical size
        for rho = e^-13) to cancellation."""
        return (self.sum_out / (self.sum_safe + self.sum_out))[..., 0]

    @property
    def safe_size(self) -> jax.Array:
        """`[...]` int32 |V_S| (E1)."""
        return jnp.sum(self.safe, axis=-1, dtype=jnp.int32)


def safe_set_sums(z: jax.Array, log_rho: float | jax.Array | None) -> SafeSetSums:
    """The core of E1-E3 on already-scaled float32 logits z `[..., V]` (z = logits / tau).

    Args:
      z: `[..., V]` float32 scaled logits.
      log_rho: log min-p threshold (<= 0), a Python number or a (traced) float array broadcasting
        against `z[..., :1]`; None or -inf keeps the full vocabulary.

    Returns:
      `SafeSetSums`.
    """
    z_max = jax.lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))
    shifted = z - z_max
    safe = z >= z_max + _as_log_rho(log_rho)  # E1
    e = jnp.exp(shifted)  # <= 1, never overflows
    return SafeSetSums(
        z_max=z_max,
        shifted=shifted,
        safe=safe,
        exp_shifted=e,
        sum_safe=jnp.sum(jnp.where(safe, e, 0.0), axis=-1, keepdims=True),
        sum_out=jnp.sum(jnp.where(safe, 0.0, e), axis=-1, keepdims=True),
    )


def token_logprobs(sums: SafeSetSums, y: jax.Array) -> TokenLogprobs:
    """E2-E3 of tokens y under the distribution summarised by `sums` (from `safe_set_sums`).

    log pi_S(y) = (z_y - z_max) - log sum_safe for y in V_S, else `LOGP_FLOOR` (E2);
    log pi(y) = (z_y - z_max) - log(sum_safe + sum_out); delta_S and |V_S| as in `SafeSetSums`.

    Args:
      sums: the core of one distribution per row, leading shape `[...]`.
      y: `[...]` int token ids in [0, V).

    Returns:
      `TokenLogprobs` with fields of shape `[...]`.
    """
    take = lambda a: jnp.take_along_axis(a, y[..., None].astype(jnp.int32), axis=-1)[..., 0]
    shifted_y = take(sums.shifted)
    in_safe = take(sums.safe)
    return TokenLogprobs(
        logp=jnp.where(in_safe, shifted_y - jnp.log(sums.sum_safe[..., 0]), LOGP_FLOOR),
        in_safe=in_safe,
        pruned_mass=sums.pruned_mass,
        safe_size=sums.safe_size,
        logp_full=shifted_y - jnp.log((sums.sum_safe + sums.sum_out)[..., 0]),
    )


def safe_set(logits: jax.Array, log_rho: float | jax.Array | None, temperature=1.0) -> jax.Array:
    """Safe set V_S (E1): `z_a >= max_b z_b + log_rho` with `z = logits / tau`.

    Args:
      logits: `[..., V]` logits (any float dtype; compared in float32).
      log_rho: log of the min-p threshold rho (<= 0); None or -inf keeps the full vocabulary.
      temperature: tau > 0.

    Returns:
      `[..., V]` bool mask; the argmax is always inside.
    """
    return safe_set_sums(_scaled_logits(logits, temperature), log_rho).safe


def pruned_log_softmax(
    logits: jax.Array, log_rho: float | jax.Array | None, temperature=1.0
) -> tuple[jax.Array, PruneStats]:
    """Pruned log-softmax (E2) with pruned mass (E3) and safe-set size (E1).

    log pi_S(a) = z_a - logsumexp_{b in V_S} z_b for a in V_S, z = logits / tau. Entries outside
    V_S are `LOGP_FLOOR` (E2 says -inf); their gradient is exactly zero. The safe-set indicator
    is piecewise constant and gets zero gradient.

    Args:
      logits: `[..., V]` logits.
      log_rho: log min-p threshold (<= 0); None or -inf means no pruning.
      temperature: tau > 0, divides the logits first.

    Returns:
      `(logp [..., V] float32, PruneStats([...], [...]))`.
    """
    sums = safe_set_sums(_scaled_logits(logits, temperature), log_rho)
    logp = jnp.where(sums.safe, sums.shifted - jnp.log(sums.sum_safe), LOGP_FLOOR)
    return logp, PruneStats(pruned_mass=sums.pruned_mass, safe_size=sums.safe_size)


def pruned_token_logprobs(
    logits: jax.Array, y: jax.Array, log_rho: float | jax.Array | None, temperature=1.0
) -> TokenLogprobs:
    """Log pi_S(y) (E2) and friends from full logits, by gather (the unchunked path).

    Args:
      logits: `[..., V]` logits.
      y: `[...]` int token ids in [0, V).
      log_rho: log min-p threshold; None or -inf means no pruning.
      temperature: tau > 0.

    Returns:
      `TokenLogprobs` with fields of shape `[...]`.
    """
    return token_logprobs(safe_set_sums(_scaled_logits(logits, temperature), log_rho), y)


# ---------------------------------------------------------------------------------------------
# Chunked pruned token log-probabilities with a custom VJP.
# ---------------------------------------------------------------------------------------------


def _chunk_geometry(vocab: int, chunk_size: int) -> tuple[int, int]:
    chunk = min(chunk_size, vocab)
    return chunk, -(-vocab // chunk)


def _chunk_logits(h, w, i, chunk, vocab, inv_tau):
    """Chunk i: `([N, C] float32 z, [C] column ids, [C] valid, start, [d, C] W chunk)`.

    The last chunk is shifted back to end at column V instead of being padded: its columns that an
    earlier chunk already covered are marked invalid. Equivalent to padding V up to a multiple of
    C with masked columns, without copying W.
    """
    first_new = i * chunk
    start = jnp.minimum(first_new, vocab - chunk)
    w_c = jax.lax.dynamic_slice_in_dim(w, start, chunk, axis=1)
    # [N, d] x [d, C] -> [N, C], accumulated and returned in float32.
    z = jnp.einsum("nd,dv->nv", h, w_c, preferred_element_type=jnp.float32) * inv_tau
    cols = start + jnp.arange(chunk)
    return z, cols, cols >= first_new, start, w_c


def _forward(h, w, y, log_rho, temperature, chunk_size):
    """Both passes. Returns `(TokenLogprobs, residuals)`."""
    vocab = w.shape[1]
    chunk, n_chunks = _chunk_geometry(vocab, chunk_size)
    inv_tau = 1.0 / temperature
    n = h.shape[0]
    idx = jnp.arange(n_chunks)
    zeros = jnp.zeros((n,), jnp.float32)
    neg_inf = jnp.full((n,), -jnp.inf, jnp.float32)

    def target_logit(z, cols, valid):
        hit = valid & (cols[None, :] == y[:, None])
        return jnp.sum(jnp.where(hit, z, 0.0), axis=-1)

    if pruning_enabled(log_rho):
        # Pass 1: row max m over all valid columns.
        def max_body(m, i):
            z, _, valid, _, _ = _chunk_logits(h, w, i, chunk, vocab, inv_tau)
            return jnp.maximum(m, jnp.max(jnp.where(valid, z, -jnp.inf), axis=-1)), None

        m, _ = jax.lax.scan(max_body, neg_inf, idx)
        thr = m + log_rho

        # Pass 2: sums of exp(z - m) (each term <= 1) inside and outside V_S, |V_S| and the
        # target logit. The outside sum gives delta_S without 1 - S/F cancellation.
        def sum_body(carry, i):
            s_safe, s_out, size, z_y = carry
            z, cols, valid, _, _ = _chunk_logits(h, w, i, chunk, vocab, inv_tau)
            safe = valid & (z >= thr[:, None])
            e = jnp.exp(z - m[:, None])
            return (
                s_safe + jnp.sum(jnp.where(safe, e, 0.0), axis=-1),
                s_out + jnp.sum(jnp.where(valid & ~safe, e, 0.0), axis=-1),
                size + jnp.sum(safe, axis=-1, dtype=jnp.int32),
                z_y + target_logit(z, cols, valid),
            ), None

        init = (zeros, zeros, jnp.zeros((n,), jnp.int32), zeros)
        (s_safe, s_out, size, z_y), _ = jax.lax.scan(sum_body, init, idx)
        s_full = s_safe + s_out
        pruned_mass = s_out / s_full
        in_safe = z_y >= thr
    else:
        # No pruning: one pass with an online (rescaled) logsumexp.
        def online_body(carry, i):
            m, s_full, z_y = carry
            z, cols, valid, _, _ = _chunk_logits(h, w, i, chunk, vocab, inv_tau)
            m_new = jnp.maximum(m, jnp.max(jnp.where(valid, z, -jnp.inf), axis=-1))
            e = jnp.where(valid, jnp.exp(z - m_new[:, None]), 0.0)
            s_full = s_full * jnp.exp(m - m_new) + jnp.sum(e, axis=-1)
            return (m_new, s_full, z_y + target_logit(z, cols, valid)), None

        (m, s_full, z_y), _ = jax.lax.scan(online_body, (neg_inf, zeros, zeros), idx)
        s_safe = s_full
        pruned_mass = zeros
        size = jnp.full((n,), vocab, jnp.int32)
        in_safe = jnp.ones((n,), bool)

    lse_safe = m + jnp.log(s_safe)  # s_safe >= 1: the argmax is always safe
    lse_full = m + jnp.log(s_full)
    out = TokenLogprobs(
        logp=jnp.where(in_safe, z_y - lse_safe, LOGP_FLOOR),
        in_safe=in_safe,
        pruned_mass=pruned_mass,
        safe_size=size,
        logp_full=z_y - lse_full,
    )
    residuals = (h, w, y, m, lse_safe, lse_full, in_safe, pruned_mass)
    return out, residuals


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _chunked(h, w, y, log_rho, temperature, chunk_size):
    return _forward(h, w, y, log_rho, temperature, chunk_size)[0]


def _chunked_fwd(h, w, y, log_rho, temperature, chunk_size):
    return _forward(h, w, y, log_rho, temperature, chunk_size)


def _chunked_bwd(log_rho, temperature, chunk_size, residuals, cts):
    """Recomputes each chunk's logits and accumulates dL/dh and dL/dW.

    With p = softmax(z), q = softmax over V_S, S the safe indicator (treated as constant):
      d logp / dz_b        = [y in V_S] (1[b = y] - q_b)
      d logp_full / dz_b   = 1[b = y] - p_b
      d pruned_mass / dz_b = p_b ((1 - delta_S) - S_b)
    and dz/d(h W) = 1/tau.
    """
    h, w, y, m, lse_safe, lse_full, in_safe, pruned_mass = residuals
    vocab = w.shape[1]
    chunk, n_chunks = _chunk_geometry(vocab, chunk_size)
    inv_tau = 1.0 / temperature
    thr = m + (log_rho if pruning_enabled(log_rho) else -jnp.inf)
    g_logp = jnp.where(in_safe, cts.logp.astype(jnp.float32), 0.0)
    g_full = cts.logp_full.astype(jnp.float32)
    g_mass = cts.pruned_mass.astype(jnp.float32)
    full_over_safe = jnp.exp(lse_full - lse_safe)  # 1 / (1 - delta_S)

    def body(carry, i):
        dh, dw = carry
        z, cols, valid, start, w_c = _chunk_logits(h, w, i, chunk, vocab, inv_tau)
        safe = valid & (z >= thr[:, None])
        p = jnp.where(valid, jnp.exp(z - lse_full[:, None]), 0.0)
        q = jnp.where(safe, p * full_over_safe[:, None], 0.0)  # softmax over V_S, one exp
        onehot = (valid & (cols[None, :] == y[:, None])).astype(jnp.float32)
        dz = (
            g_logp[:, None] * (onehot - q)
            + g_full[:, None] * (onehot - p)
            + g_mass[:, None] * p * ((1.0 - pruned_mass)[:, None] - safe)
        ) * inv_tau
        # [N, C] x [d, C] -> [N, d]
        dh = dh + jnp.einsum("nv,dv->nd", dz, w_c, preferred_element_type=jnp.float32)
        # [N, d] x [N, C] -> [d, C]; overlapping columns of the last chunk carry dz = 0.
        dw_c = jnp.einsum("nd,nv->dv", h, dz, preferred_element_type=jnp.float32)
        old = jax.lax.dynamic_slice_in_dim(dw, start, chunk, axis=1)
        dw = jax.lax.dynamic_update_slice_in_dim(dw, old + dw_c, start, axis=1)
        return (dh, dw), None

    init = (jnp.zeros(h.shape, jnp.float32), jnp.zeros(w.shape, jnp.float32))
    (dh, dw), _ = jax.lax.scan(body, init, jnp.arange(n_chunks))
    return dh.astype(h.dtype), dw.astype(w.dtype), None


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def chunked_pruned_logprobs(
    h: jax.Array,
    w: jax.Array,
    y: jax.Array,
    *,
    log_rho: float | None,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> TokenLogprobs:
    """Pruned token log-probabilities (E1-E3) of targets y, in vocabulary chunks.

    With logits z = (h W) / tau: log pi_S(y) = z_y - logsumexp_{b in V_S} z_b (E2), where
    V_S = {a : z_a >= max_b z_b + log_rho} (E1), and delta_S = 1 - sum_{V_S} softmax(z) (E3).

    Forward: pass 1 takes the row max over chunks; pass 2 accumulates the safe-set and full sums
    of exp(z - max), |V_S| and the target logit (one pass with an online logsumexp when pruning is
    off). Backward (custom VJP): recomputes each chunk's logits and accumulates the gradients for
    `h` and `W`. No `[N, V]` array exists in either direction; the largest temporaries are
    `[N, chunk_size]` float32. The safe-set indicator is piecewise constant in z and is given zero
    gradient; `logp` is the constant `LOGP_FLOOR` (zero gradient) where y is outside V_S.
    `logp`, `logp_full` and `pruned_mass` are all differentiable.

    Works under jit with `h` / `w` sharded, on Auto or Explicit mesh axes (GSPMD partitions the
    scan body; on Explicit axes the loop runs under `auto_axes` and the outputs are sharded like
    the rows of `h`). V need not be a multiple of `chunk_size`: the last chunk is shifted back and
    its repeated columns masked.

    Args:
      h: `[N, d]` final hidden states (leading dims `[..., d]` are flattened and restored).
      w: `[d, V]` unembedding matrix.
      y: `[N]` int target ids in [0, V) (give padding positions any valid id and mask them later).
      log_rho: static log min-p threshold (<= 0); None or -inf means no pruning.
      temperature: static tau > 0.
      chunk_size: static number of vocabulary columns per chunk (clamped to V).

    Returns:
      `TokenLogprobs` whose fields have the leading shape of `h` (`[N]`): `logp` (E2, floor
      outside V_S), `in_safe`, `pruned_mass` (E3), `safe_size` (int32), `logp_full`.
    """
    log_rho = _check_static_args(log_rho, temperature)
    if not isinstance(chunk_size, int | np.integer) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}.")
    if h.ndim < 1 or w.ndim != 2 or h.shape[-1] != w.shape[0]:
        raise ValueError(f"need h [..., d] and w [d, V]; got h {h.shape}, w {w.shape}.")
    if y.shape != h.shape[:-1]:
        raise ValueError(f"y must have shape h.shape[:-1] = {h.shape[:-1]}, got {y.shape}.")

    def run(h, w, y):
        out = _chunked(
            h.reshape(-1, h.shape[-1]),
            w,
            y.reshape(-1).astype(jnp.int32),
            log_rho,
            float(temperature),
            int(chunk_size),
        )
        return TokenLogprobs(*(x.reshape(h.shape[:-1]) for x in out))

    mesh, spec = _explicit_mesh_and_row_spec(h, w)
    if mesh is None:
        return run(h, w, y)
    # Explicit-sharding mesh (what `jax.make_mesh` builds by default): the chunk loop's
    # contractions over a sharded vocab/batch dim have no single typed output sharding, so the
    # loop runs with those axes switched to Auto and GSPMD partitions it. Outputs are sharded
    # like the rows of h.
    explicit = tuple(
        name
        for name, kind in zip(mesh.axis_names, mesh.axis_types, strict=True)
        if kind == jax.sharding.AxisType.Explicit
    )
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.sharding.auto_axes(
            run, axes=explicit, out_sharding=TokenLogprobs(*([spec] * len(TokenLogprobs._fields)))
        )(h, w, y)


def _explicit_mesh_and_row_spec(h, w):
    """The abstract mesh of h or w if it has Explicit axes, and the spec of h's leading dims."""
    for x in (h, w):
        sharding = getattr(jax.typeof(x), "sharding", None)
        mesh = getattr(sharding, "mesh", None)
        if mesh is None or mesh.empty:
            continue
        if any(kind == jax.sharding.AxisType.Explicit for kind in mesh.axis_types):
            h_sharding = getattr(jax.typeof(h), "sharding", None)
            h_spec = tuple(h_sharding.spec) if h_sharding is not None else ()
            h_spec = (h_spec + (None,) * h.ndim)[: h.ndim]
            return mesh, jax.sharding.PartitionSpec(*h_spec[:-1])
    return None, None
