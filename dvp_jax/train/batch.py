"""The learner's batch: a rollout batch (host) -> `RLBatch` (targets-aligned arrays) -> devices.

The rollout side records per-token statistics at the column of the token they describe
(`RolloutBatch`, docs/design.md E4); the train step predicts `tokens[:, 1:]` from
`tokens[:, :-1]`, so every per-token array is shifted by one column. The trainer's rows come
from the packer (`train/packing.py`: several sequences per row, segment ids, positions from 0
per sequence); `from_rollouts` lays out one response per row (the padded layout, for analysis
code). Names follow the glossary of docs/design.md section 4: the behaviour (rollout)
quantities keep their `behaviour_` names from the engine to the loss.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from dvp_jax.dvp.pruning import TokenLogprobs
from dvp_jax.rollout.offline import RolloutBatch
from dvp_jax.sharding import Sharder


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RLBatch:
    """One optimizer step's responses in B rows of T tokens; targets are tokens[:, 1:].

    Attributes:
      tokens, positions: [B, T] int32 (positions count from 0 in each sequence).
      segment_ids: [B, T] int32 sequence of each token within its row: 1, 2, ... for packed
        sequences (1 for the only one of a padded row), 0 on padding (`valid` is > 0).
      response_mask: [B, T-1] bool, True where target tokens[:, t+1] is a response token.
      behaviour_logp: [B, T-1] log mu_S of the target (E4); behaviour_logp_full: unpruned log mu.
      behaviour_pruned_mass, behaviour_safe_size: [B, T-1] rollout-side delta_S (E3) / |V_S|.
      advantages: (E8) [B, T-1], each target's response's A_i (the packer's rows), or [B] with
        one response per row (`from_rollouts`).
      old_logp, old_in_safe: [B, T-1] log pi_S_old and "inside the old safe set" for the
        decoupled PPO clip (E9; zeros / True when unused).
      ref_logp, ref_in_safe: [B, T-1] log pi_ref_S and "inside the reference's safe set" for the
        KL term (E11), set by the trainer before the update; None (absent) without it.
      behaviour_kept_ids: [B, T-1, W] int32 the rollout's truncation set K of each target (E13,
        -1 padded, all -1 off the responses); behaviour_truncated_mass: [B, T-1] mu's mass
        outside K. None (absent) when the rollout does not truncate (no top-k / top-p).
      behaviour_age: [B, T-1] int32 weight versions between the target's sampling and this
        update (partial rollouts); None (absent) otherwise.
    """

    tokens: jax.Array
    positions: jax.Array
    segment_ids: jax.Array
    response_mask: jax.Array
    behaviour_logp: jax.Array
    behaviour_logp_full: jax.Array
    behaviour_pruned_mass: jax.Array
    behaviour_safe_size: jax.Array
    advantages: jax.Array
    old_logp: jax.Array
    old_in_safe: jax.Array
    ref_logp: jax.Array | None = None
    ref_in_safe: jax.Array | None = None
    behaviour_kept_ids: jax.Array | None = None
    behaviour_truncated_mass: jax.Array | None = None
    behaviour_age: jax.Array | None = None

    @property
    def valid(self):
        """[B, T] bool: prompt and response tokens (segment id > 0)."""
        return self.segment_ids > 0


def from_rollouts(batch: RolloutBatch, advantages: np.ndarray) -> RLBatch:
    """Host `RolloutBatch` (stats at the column of the token they describe) -> host `RLBatch`
    with one response per row (segment 1) and `[N]` advantages.

    Every per-token array is shifted by one column (targets); the prompt and its response are
    contiguous in each row.
    """
    n, t = batch.tokens.shape
    shift = lambda x, dtype: np.ascontiguousarray(x[:, 1:]).astype(dtype)
    truncation = {}
    # (records saved before truncation existed, e.g. e005's samples, have no kept ids)
    kept_ids = getattr(batch, "behaviour_kept_ids", None)
    if kept_ids is not None and kept_ids.shape[-1] > 0:
        kept = np.where(batch.response_mask[..., None], batch.behaviour_kept_ids, -1)
        truncation = dict(
            behaviour_kept_ids=shift(kept, np.int32),
            behaviour_truncated_mass=shift(batch.behaviour_truncated_mass, np.float32),
        )
    return RLBatch(
        tokens=batch.tokens.astype(np.int32),
        positions=np.broadcast_to(np.arange(t, dtype=np.int32), (n, t)).copy(),
        segment_ids=(batch.prompt_mask | batch.response_mask).astype(np.int32),
        response_mask=shift(batch.response_mask, bool),
        behaviour_logp=shift(batch.behaviour_logp, np.float32),
        behaviour_logp_full=shift(batch.behaviour_logp_full, np.float32),
        behaviour_pruned_mass=shift(batch.behaviour_pruned_mass, np.float32),
        behaviour_safe_size=shift(batch.behaviour_safe_size, np.float32),
        advantages=advantages.astype(np.float32),
        old_logp=np.zeros((n, t - 1), np.float32),
        old_in_safe=np.ones((n, t - 1), bool),
        **truncation,
    )


def abstract_batch(
    rows: int, length: int, reference: bool = False, kept_width: int = 0, ages: bool = False
) -> RLBatch:
    """The `jax.ShapeDtypeStruct`s of a `rows` x `length` batch as the packer makes it (per-token
    advantages), with the reference fields when `reference` (`LossConfig.uses_reference`, E11)
    and the truncation fields when `kept_width` > 0 (`EngineConfig.kept_width`, E13), and the
    tokens' ages with `ages` (partial rollouts)."""

    def struct(name: str) -> jax.ShapeDtypeStruct:
        t = length if name in _FULL_LENGTH else length - 1
        dtype = jnp.int32 if name in _INT else jnp.bool_ if name in _BOOL else jnp.float32
        width = (kept_width,) if name == "behaviour_kept_ids" else ()
        return jax.ShapeDtypeStruct((rows, t) + width, dtype)

    names = [f.name for f in dataclasses.fields(RLBatch)]
    names = [n for n in names if reference or n not in _REFERENCE]
    names = [n for n in names if kept_width or n not in _TRUNCATION]
    names = [n for n in names if ages or n != "behaviour_age"]
    return RLBatch(**{n: struct(n) for n in names})


# [B, T]; the rest are targets-aligned [B, T-1]
_FULL_LENGTH = ("tokens", "positions", "segment_ids")
_INT = ("tokens", "positions", "segment_ids", "behaviour_kept_ids", "behaviour_age")
_BOOL = ("response_mask", "old_in_safe", "ref_in_safe")
_REFERENCE = ("ref_logp", "ref_in_safe")  # only with the KL term
_TRUNCATION = ("behaviour_kept_ids", "behaviour_truncated_mass")  # only with top-k / top-p


def batch_shardings(batch: RLBatch, sharder: Sharder):
    """Batch arrays shard their leading (batch) dim over the data axes; None without a mesh."""
    if sharder.mesh is None:
        return None
    return jax.tree.map(
        lambda x: sharder.sharding(("act_batch",) + (None,) * (x.ndim - 1), x.shape), batch
    )


def global_shardings(host_batch: RLBatch, sharder: Sharder):
    """Shardings of the global batch whose rows this host's `host_batch` holds a share of."""
    global_batch = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((x.shape[0] * jax.process_count(),) + x.shape[1:], x.dtype),
        host_batch,
    )
    return batch_shardings(global_batch, sharder)


def to_global(host_batch, shardings):
    """Host-local numpy arrays -> global jax Arrays (each process contributes its rows)."""
    if shardings is None:
        return jax.tree.map(jnp.asarray, host_batch)
    return jax.tree.map(
        lambda x, s: jax.make_array_from_process_local_data(s, x), host_batch, shardings
    )


def with_logprobs(host_batch: RLBatch, name: str, logprobs: TokenLogprobs) -> RLBatch:
    """`host_batch` with `<name>_logp` / `<name>_in_safe` ("old": E9's pi_S_old, "ref": E11's
    pi_ref_S) set to this host's rows of `logprobs`, computed on the global batch."""
    logp, in_safe = logprobs.logp, logprobs.in_safe
    if jax.process_count() > 1:  # every host computed the global batch: keep its own rows
        rows, pid = host_batch.tokens.shape[0], jax.process_index()
        logp, in_safe = (
            multihost_utils.process_allgather(x, tiled=True)[pid * rows : (pid + 1) * rows]
            for x in (logp, in_safe)
        )
    fields = {
        f"{name}_logp": np.asarray(jax.device_get(logp), np.float32),
        f"{name}_in_safe": np.asarray(jax.device_get(in_safe), bool),
    }
    return dataclasses.replace(host_batch, **fields)
