"""What one step's rollout costs at real lengths: the bytes its decode steps read from HBM, and
the time that takes at the chip's HBM bandwidth (a memory-bound lower bound).

At the paper's size a decode step is memory-bound: every step reads the engine's weights once
(the whole batch of slots shares that read) and the KV of what its attention covers. The two
decodes differ in the second:

* dense (today, `decode_attention="dense"`): a dispatch of k steps attends over one length
  bucket for all B slots (`EngineConfig.kv_buckets`, the smallest above every occupied slot's
  position + k), so each step reads B x bucket positions, finished slots included;
* paged: a slot reads its own live pages, ceil((pos + 1) / page_size) x page_size positions, and
  a finished slot reads none.

`schedule` replays what `offline.generate_rollouts` does with a host's responses (continuous
batching: a dispatch ends after the step in which a slot finishes while prompts wait, and the
slot is refilled) and counts the positions each decode reads. Bytes per position and per chip
come from the engine's cache shardings, the weights' bytes per chip from its parameter
shardings (`dvp_jax.aot`); the KV bytes are this block arithmetic, not the compiler's cost
analysis, which cannot see inside the Pallas kernel and counts a while loop's body once. The
time ignores compute, collectives, prefill and the host's work between dispatches: a lower
bound. Hosts decode in parallel; the step waits for the slowest.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One host's rollout: decode steps, and positions read over all of them (per slot)."""

    steps: int
    dense_positions: float  # B x the dispatch's bucket, every step
    paged_positions: float  # each active slot's whole live pages
    live_positions: float  # each active slot's positions attended (pos + 1)


def schedule(
    prompt_lengths,
    response_lengths,
    *,
    slots: int,
    steps_per_sync: int,
    kv_buckets: tuple[int, ...],
    page_size: int,
) -> Schedule:
    """Replays continuous batching over one host's responses (the module docstring).

    Args:
      prompt_lengths, response_lengths: `[n]` the host's sequences in the order they are
        admitted (prompt-major, as `generate_rollouts` queues them).
      slots: B, `max_concurrent_decodes`.
      steps_per_sync: k, decode steps per dispatch.
      kv_buckets: the dense decode's length buckets (`EngineConfig.kv_buckets`).
      page_size: positions per page.
    """
    prompts, responses = np.asarray(prompt_lengths), np.asarray(response_lengths)
    pending = collections.deque(range(len(responses)))
    pos = np.zeros((slots,), np.int64)
    left = np.zeros((slots,), np.int64)  # tokens the slot's response still generates
    occupied = np.zeros((slots,), bool)
    steps, dense, paged, live = 0, 0.0, 0.0, 0.0
    while pending or occupied.any():
        for s in np.flatnonzero(~occupied)[: len(pending)]:
            i = pending.popleft()
            occupied[s], pos[s], left[s] = True, prompts[i], responses[i]
        top = int(pos[occupied].max()) + steps_per_sync
        bucket = kv_buckets[min(bisect.bisect_left(kv_buckets, top), len(kv_buckets) - 1)]
        for _ in range(steps_per_sync):
            active = occupied & (left > 0)
            attended = pos[active] + 1
            dense += slots * bucket
            paged += float(np.sum(-(-attended // page_size))) * page_size
            live += float(np.sum(attended))
            pos[active] += 1
            left[active] -= 1
            steps += 1
            finished = active & (left == 0)
            occupied &= ~finished
            if not occupied.any() or (finished.any() and pending):
                break
    return Schedule(steps, dense, paged, live)


@dataclasses.dataclass(frozen=True)
class RolloutCost:
    """One step's rollout by one decode, on the slowest host, per chip.

    Attributes:
      decode: "dense (today)" or "paged".
      steps: decode steps.
      weight_gb: weight bytes read (GB, 1e9), every step reading them once.
      kv_gb: KV bytes read (GB).
      kv_over_live: KV positions read over positions attended (1 = no padding read).
      seconds: (weights + KV) at the chip's HBM bandwidth: a lower bound.
    """

    decode: str
    steps: int
    weight_gb: float
    kv_gb: float
    kv_over_live: float
    seconds: float

    def row(self) -> dict:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in vars(self).items()}


def rollout_costs(
    prompt_lengths,
    response_lengths,
    *,
    hosts: int,
    slots: int,
    steps_per_sync: int,
    kv_buckets: tuple[int, ...],
    page_size: int,
    weight_bytes: float,
    kv_bytes_per_position: float,
    hbm_bytes_per_s: float,
) -> list[RolloutCost]:
    """The step's rollout, dense and paged (module docstring).

    Args:
      prompt_lengths, response_lengths: `[prompts_per_step * group_size]`, prompt-major; host
        h decodes the h-th contiguous share (as the trainer splits prompts over hosts).
      hosts: hosts of the slice, each with its own engine.
      slots, steps_per_sync, kv_buckets, page_size: the engine's (`schedule`).
      weight_bytes: the engine's weights per chip.
      kv_bytes_per_position: k and v of one position, all layers, per chip.
      hbm_bytes_per_s: the chip's HBM bandwidth.
    """
    per_host = len(response_lengths) // hosts
    runs = [
        schedule(
            prompt_lengths[h * per_host : (h + 1) * per_host],
            response_lengths[h * per_host : (h + 1) * per_host],
            slots=slots,
            steps_per_sync=steps_per_sync,
            kv_buckets=kv_buckets,
            page_size=page_size,
        )
        for h in range(hosts)
    ]
    out = []
    for name, field in (("dense (today)", "dense_positions"), ("paged", "paged_positions")):
        cost = None
        for run in runs:
            kv = getattr(run, field) * kv_bytes_per_position
            weights = run.steps * weight_bytes
            seconds = (kv + weights) / hbm_bytes_per_s
            if cost is None or seconds > cost.seconds:
                cost = RolloutCost(
                    decode=name,
                    steps=run.steps,
                    weight_gb=weights / 1e9,
                    kv_gb=kv / 1e9,
                    kv_over_live=getattr(run, field) / max(run.live_positions, 1.0),
                    seconds=seconds,
                )
        out.append(cost)
    return out


def table(costs: list[RolloutCost], hbm_bytes_per_s: float) -> str:
    """The costs as lines of text, paged's bytes over today's."""
    head = (
        f"{'rollout':<14} {'steps':>7} {'weights GB':>11} {'KV GB':>9} {'KV/live':>8} "
        f"{'lower bound':>12}"
    )
    lines = [head, "-" * len(head)]
    for c in costs:
        lines.append(
            f"{c.decode:<14} {c.steps:>7,} {c.weight_gb:>11,.0f} {c.kv_gb:>9,.0f} "
            f"{c.kv_over_live:>7.1f}x {c.seconds:>11,.1f}s"
        )
    dense, paged = costs
    ratio = (paged.weight_gb + paged.kv_gb) / (dense.weight_gb + dense.kv_gb)
    lines.append(f"paged / dense bytes read: {ratio:.3f}")
    lines.append(
        f"(per chip, slowest host; time = bytes at {hbm_bytes_per_s / 1e12:.2f} TB/s HBM: a "
        "memory-bound lower bound, weights + KV only; KV from the block arithmetic)"
    )
    return "\n".join(lines)
