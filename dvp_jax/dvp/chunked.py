"""The trainer's E1-E3 from final hidden states, in vocabulary chunks (no `[N, V]` array).

`chunked_pruned_logprobs(h, W, y)` computes what `pruning.pruned_token_logprobs` computes from
logits z = (h W) / tau, without materialising them: two passes over vocabulary chunks and a
custom VJP that recomputes each chunk's logits (the math is in `chunked_token_stats`; the passes
and the VJP on one vocabulary shard are `chunked_vjp.py`). `chunked_token_stats` adds
`PositionStats`, diagnostics of the full trainer distribution (entropy, z_y - max z) from the
same pass. On a mesh it runs under `shard_map`,
laid out by `dvp_jax/dvp/vocab_mesh.py`. It does not build logits for anything else, and the
in-memory E1-E3 core stays in `pruning` (numerics as there).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from dvp_jax.dvp.chunked_vjp import PositionStats, chunked_shard, tagged_zeros
from dvp_jax.dvp.pruning import TokenLogprobs, _check_static_args
from dvp_jax.dvp.vocab_mesh import (
    LOCAL,
    find_mesh,
    mesh_axes,
    reshape_to,
)

# Default vocabulary chunk for `chunked_pruned_logprobs` (benchmarks/pruned_logprobs.py).
DEFAULT_CHUNK_SIZE = 8192


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
        return chunked_shard(h, w, y, kept, *args)

    lead, y = h.shape[:-1], y.astype(jnp.int32)
    kept_ids = kept_ids.astype(jnp.int32)
    if mesh is None:
        if jax.sharding.AxisType.Manual in jax.sharding.get_abstract_mesh().axis_types:
            # Inside the caller's shard_map: h and W are made to vary over every axis that h, W
            # or y vary over, so the custom VJP's cotangents have their primal's type; autodiff
            # then sums dh / dW over the axes added here.
            tag = tagged_zeros((), h, w, y)
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
    """`chunked_shard`'s (TokenLogprobs, PositionStats) reshaped; the diagnostics under
    stop-gradient (`policy_entropy` keeps its gradient)."""
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
