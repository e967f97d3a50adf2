"""The learner's rows: a step's (prompt + response) sequences packed several to a row, on the host.

The update is one compiled shape whatever the lengths (`Layout`): `rows` rows of `row_length`
tokens, cut into `micro_batches` micro-batches. `pack` places one update's sequences: first-fit
decreasing (the longest first, each into the first row with room; ties by index, so the same
sequences always give the same rows), sequence k of a row getting segment id k and positions
from 0, so attention and RoPE see each sequence as if it were alone (`attention.causal_mask`).
The fullest rows fill micro-batch 0 first, then 1, ..., and the step skips a micro-batch that
holds no response token (`step.rl_update`), so the work follows the real tokens while the shape
stays fixed. `rows` is the most any mix of lengths can need: with q = floor(row_length /
longest sequence), first fit opens a new row only when every row holds q sequences, so
ceil(n / q) rows always suffice. With `packed` False every sequence gets its own row: the padded
layout, kept for comparison.

Each host packs its own share of a step (its prompts' responses) into its own rows; the global
batch is the hosts' rows one after the other. Micro-batch m is rows m, m + M, m + 2M, ... of the
global batch (`micro_batch_split`), so it spreads over the row-sharded devices instead of sitting
on one.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from dvp_jax.dvp.segments import Segments
from dvp_jax.rollout.offline import RolloutBatch
from dvp_jax.train.batch import RLBatch

# The shortest sequence the packer places: a prompt token and a response token.
MIN_SEQUENCE = 2


@dataclasses.dataclass(frozen=True)
class Layout:
    """One update's rows on one host: the shape the update is compiled for.

    Attributes:
      row_length: tokens per row (>= the longest prompt + response).
      rows: this host's rows per update, a multiple of `micro_batches`.
      micro_batches: calls of the model per update (gradients accumulated).
      packed: several sequences per row (False: one per row, the padded layout).
    """

    row_length: int
    rows: int
    micro_batches: int
    packed: bool = True

    @property
    def sequences_per_row(self) -> int:
        """The most sequences a row can hold (`Segments.count`)."""
        return self.row_length // MIN_SEQUENCE if self.packed else 1

    def segments(self, segment_ids) -> Segments:
        """Which response each target of `segment_ids` `[B, T]` rows belongs to: packed rows by
        their ids (the target tokens[:, t + 1]'s sequence), or one response per row."""
        if not self.packed:
            return Segments()
        return Segments(segment_ids[:, 1:], self.sequences_per_row)


def make_layout(
    *, sequences: int, longest: int, row_length: int, micro_batches: int, packed: bool
) -> Layout:
    """The layout for `sequences` sequences per update on a host, each at most `longest` tokens.

    Args:
      sequences: an update's sequences on this host.
      longest: max prompt + max response tokens.
      row_length: tokens per row; 0 means `longest`.
      micro_batches: micro-batches per update.
      packed: several sequences per row.
    Raises:
      ValueError: a row shorter than the longest sequence (`ExperimentConfig` refuses such a
        `train.row_length` by name).
    """
    length = row_length or longest
    if length < longest:
        raise ValueError(f"rows of {length} tokens cannot hold sequences of {longest}")
    per_row = length // longest if packed else 1
    rows = -(-max(math.ceil(sequences / per_row), 1) // micro_batches) * micro_batches
    return Layout(length, rows, micro_batches, packed)


def first_fit_decreasing(lengths, capacity: int) -> list[list[int]]:
    """Bins of total length <= `capacity` holding every index of `lengths`, by first-fit
    decreasing: in order of decreasing length (ties by index), each into the first bin with
    room, else a new one. Deterministic; bins in the order they were opened (fullest first)."""
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = int(lengths[i])
        for b, left in enumerate(room):
            if n <= left:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(capacity - n)
    return bins


def row_order(filled: int, layout: Layout) -> np.ndarray:
    """This host's row index of each of `filled` rows in fill order: filled row p goes to
    micro-batch p // R as its (p % R)-th row, R rows per micro-batch, and micro-batch m holds
    rows m, m + M, m + 2M, ... (`micro_batch_split`)."""
    per = layout.rows // layout.micro_batches
    p = np.arange(filled)
    return (p % per) * layout.micro_batches + p // per


def micro_batch_split(x: jax.Array, micro_batches: int) -> jax.Array:
    """`[rows, ...]` -> `[M, rows / M, ...]`, micro-batch m holding rows m, m + M, ...: with the
    rows sharded over the devices, every micro-batch has rows on every device."""
    per = x.shape[0] // micro_batches
    return x.reshape(per, micro_batches, *x.shape[1:]).swapaxes(0, 1)


def micro_batch_join(x: jax.Array) -> jax.Array:
    """Inverse of `micro_batch_split`: `[M, R, ...]` -> `[M R, ...]` in row order."""
    return x.swapaxes(0, 1).reshape(-1, *x.shape[2:])


def pack(
    rollouts: RolloutBatch,
    advantages: np.ndarray,
    layout: Layout,
    indices=None,
    version: int | None = None,
) -> RLBatch:
    """One update's sequences (rows `indices` of `rollouts`, default all) as the layout's rows.

    A sequence is its prompt then its response, with its targets' statistics shifted by one
    column as `batch.from_rollouts` does and its advantage on each of its targets. Sequences
    without a response token have no target and are left out.

    Args:
      rollouts: this host's rollouts (`offline.generate_rollouts`).
      advantages: `[N]` A_i per rollout row (E8).
      layout: the update's rows (`make_layout`).
      indices: the rows of `rollouts` this update trains on, in order.
      version: this update's weight version (partial rollouts): the batch then carries each
        target's age, `version - rollouts.behaviour_version`.
    Returns:
      A host `RLBatch` of `layout.rows` x `layout.row_length` (per-token advantages).
    Raises:
      ValueError: the sequences do not fit the layout (a layout made for fewer or shorter ones).
    """
    indices = np.arange(rollouts.num_rows) if indices is None else np.asarray(indices)
    indices = indices[rollouts.response_lengths[indices] > 0]
    lengths = rollouts.prompt_lengths[indices] + rollouts.response_lengths[indices]
    if lengths.size and lengths.max() > layout.row_length:
        raise ValueError(
            f"a sequence of {lengths.max()} tokens does not fit rows of {layout.row_length}"
        )
    if layout.packed:
        bins = first_fit_decreasing(lengths, layout.row_length)
    else:
        bins = [[i] for i in range(len(indices))]
    if len(bins) > layout.rows:
        raise ValueError(
            f"{len(indices)} sequences need {len(bins)} rows, the layout has {layout.rows}"
        )
    rows, t = layout.rows, layout.row_length
    out = _empty(rows, t, rollouts.behaviour_kept_ids.shape[-1], version is not None)
    for row, members in zip(row_order(len(bins), layout), bins, strict=True):
        start = 0
        for segment, j in enumerate(members, 1):
            i, n = indices[j], int(lengths[j])
            _place(out, rollouts, advantages[i], i, row, start, n, segment, version)
            start += n
    return RLBatch(**out)


def _empty(rows: int, t: int, kept_width: int = 0, ages: bool = False) -> dict[str, np.ndarray]:
    full = lambda dtype: np.zeros((rows, t), dtype)
    target = lambda dtype: np.zeros((rows, t - 1), dtype)
    truncation = {}
    if kept_width:  # E13: -1 (untruncated) off the responses
        truncation = dict(
            behaviour_kept_ids=np.full((rows, t - 1, kept_width), -1, np.int32),
            behaviour_truncated_mass=target(np.float32),
        )
    if ages:
        truncation["behaviour_age"] = target(np.int32)
    return dict(
        **truncation,
        tokens=full(np.int32),
        positions=full(np.int32),
        segment_ids=full(np.int32),
        response_mask=target(bool),
        behaviour_logp=target(np.float32),
        behaviour_logp_full=target(np.float32),
        behaviour_pruned_mass=target(np.float32),
        behaviour_safe_size=target(np.float32),
        advantages=target(np.float32),
        old_logp=target(np.float32),
        old_in_safe=np.ones((rows, t - 1), bool),
    )


def _place(out, rollouts: RolloutBatch, advantage, i, row, start, n, segment, version) -> None:
    """Rollout row `i`'s first `n` tokens into `row` at `start`, as segment `segment`."""
    cols, targets = slice(start, start + n), slice(start, start + n - 1)
    out["tokens"][row, cols] = rollouts.tokens[i, :n]
    out["positions"][row, cols] = np.arange(n)
    out["segment_ids"][row, cols] = segment
    # The target of column c is token c + 1: the rollout's statistics from column 1 on.
    out["response_mask"][row, targets] = rollouts.response_mask[i, 1:n]
    for name in ("behaviour_logp", "behaviour_logp_full", "behaviour_pruned_mass"):
        out[name][row, targets] = getattr(rollouts, name)[i, 1:n]
    out["behaviour_safe_size"][row, targets] = rollouts.behaviour_safe_size[i, 1:n]
    if "behaviour_kept_ids" in out:  # the response's kept sets (E13); prompt targets keep -1
        response = rollouts.response_mask[i, 1:n]
        out["behaviour_kept_ids"][row, targets] = np.where(
            response[:, None], rollouts.behaviour_kept_ids[i, 1:n], -1
        )
        out["behaviour_truncated_mass"][row, targets] = rollouts.behaviour_truncated_mass[i, 1:n]
    out["advantages"][row, targets] = advantage
    if "behaviour_age" in out and rollouts.behaviour_version is not None:
        response = rollouts.response_mask[i, 1:n]
        ages = version - rollouts.behaviour_version[i, 1:n]
        out["behaviour_age"][row, targets] = np.where(response, ages, 0)
