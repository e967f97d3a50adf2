"""What one step's rollout costs at real lengths: the bytes its decode steps read from HBM, and
the time that takes at the chip's HBM bandwidth (a memory-bound lower bound).

At the paper's size a decode step is memory-bound: every step reads the engine's weights once
(the whole batch of slots shares that read) and the KV of what its attention covers. The
decodes differ in the second:

* dense (`decode_attention="dense"`): a dispatch attends over one length bucket for all B slots
  (`EngineConfig.kv_buckets`), so each step reads B x bucket positions, finished slots included;
* paged, the Pallas kernel (TPU, 16- and 32-bit caches): a slot reads its own live pages,
  ceil((pos + 1) / page_size) x page_size positions, and a finished slot reads none;
* paged, the ragged XLA path (GPUs, CPUs, every fp8-KV rollout, `"paged_xla"`): each step
  gathers a static `page_buckets` count of pages (the smallest above the dispatch's live pages),
  padding entries included.

`schedule` runs the engine's own scheduler (`scheduler.py`: admission, pages, evictions and
dispatch sizing) against `replay.simulate`, a replay of the device loop over the host's
response lengths, and counts the positions each decode step reads, so its decode steps are the
engine's (a test compares them). Bytes per position and per chip come from the engine's cache
shardings, the weights' bytes per chip from its parameter shardings (`dvp_jax.aot`); the KV bytes
are this block arithmetic, not the compiler's cost analysis, which cannot see inside the Pallas
kernel and counts a while loop's body once. The time ignores compute, collectives, prefill and
the host's work between dispatches: a lower bound. Hosts decode in parallel; the step waits for
the slowest.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dvp_jax.plan.replay import simulate
from dvp_jax.plan.tables import Column, render
from dvp_jax.rollout.scheduler import Limits, Scheduler
from dvp_jax.rollout.state import EngineConfig

# The decodes priced: (name, EngineConfig.decode_attention, the paged path).
DECODES = (
    ("dense", "dense", None),
    ("paged kernel", "paged", "kernel"),
    ("paged XLA", "paged_xla", "xla"),
)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One host's rollout by one decode: decode steps, positions read and attended over all of
    them (per slot), and the scheduler's evictions."""

    steps: int
    positions: float  # KV positions read
    live_positions: float  # each active slot's positions attended (pos + 1)
    evictions: int = 0


def schedule(prompt_lengths, response_lengths, lim: Limits) -> Schedule:
    """Replays one host's rollout through the scheduler (the module docstring).

    Args:
      prompt_lengths, response_lengths: `[n]` the host's sequences in the order they are
        queued (prompt-major, as `generate_rollouts` queues them).
      lim: the engine's limits (`scheduler.Limits.of`).
    """
    read = [0.0, 0.0]  # positions read, positions attended

    def count(dispatch, active, pos):
        attended = pos[active] + 1
        if dispatch.span.kind == "positions":
            read[0] += lim.slots * dispatch.span.size
        elif dispatch.span.kind == "pages":
            read[0] += dispatch.span.size * lim.page_size
        else:
            read[0] += float(np.sum(-(-attended // lim.page_size))) * lim.page_size
        read[1] += float(np.sum(attended))

    stats = simulate(Scheduler(lim, prompt_lengths), response_lengths, read_hook=count)
    return Schedule(stats.steps, read[0], read[1], stats.evictions)


@dataclasses.dataclass(frozen=True)
class RolloutCost:
    """One step's rollout by one decode, on the slowest host, per chip.

    Attributes:
      decode: one of `DECODES`' names.
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
    config: EngineConfig,
    weight_bytes: float,
    kv_bytes_per_position: float,
    hbm_bytes_per_s: float,
) -> list[RolloutCost]:
    """The step's rollout by each of `DECODES` (module docstring).

    Args:
      prompt_lengths, response_lengths: `[prompts_per_step * group_size]`, prompt-major; host
        h decodes the h-th contiguous share (as the trainer splits prompts over hosts).
      hosts: hosts of the slice, each with its own engine.
      config: the engine's settings (slots, lengths, page size and pool); each decode runs
        them with its own `decode_attention`.
      weight_bytes: the engine's weights per chip.
      kv_bytes_per_position: k and v of one position, all layers, per chip.
      hbm_bytes_per_s: the chip's HBM bandwidth.
    """
    per_host = len(response_lengths) // hosts
    out = []
    for name, attention, impl in DECODES:
        lim = Limits.of(dataclasses.replace(config, decode_attention=attention), impl)
        cost = None
        for h in range(hosts):
            share = slice(h * per_host, (h + 1) * per_host)
            run = schedule(prompt_lengths[share], response_lengths[share], lim)
            kv = run.positions * kv_bytes_per_position
            weights = run.steps * weight_bytes
            seconds = (kv + weights) / hbm_bytes_per_s
            if cost is None or seconds > cost.seconds:
                cost = RolloutCost(
                    decode=name,
                    steps=run.steps,
                    weight_gb=weights / 1e9,
                    kv_gb=kv / 1e9,
                    kv_over_live=run.positions / max(run.live_positions, 1.0),
                    seconds=seconds,
                )
        out.append(cost)
    return out


_COLUMNS = (
    Column("rollout", 14, left=True),
    Column("steps", 7, ","),
    Column("weights GB", 11, ",.0f"),
    Column("KV GB", 9, ",.0f"),
    Column("KV/live", 8, ".1f", "x"),
    Column("lower bound", 12, ",.1f", "s"),
    Column("bytes/dense", 12, ".3f"),
)


def table(costs: list[RolloutCost], hbm_bytes_per_s: float) -> str:
    """The costs as lines of text, each decode's bytes over the dense decode's."""
    dense = costs[0].weight_gb + costs[0].kv_gb
    rows = [
        [c.decode, c.steps, c.weight_gb, c.kv_gb, c.kv_over_live, c.seconds]
        + [(c.weight_gb + c.kv_gb) / dense]
        for c in costs
    ]
    note = (
        f"(per chip, slowest host; time = bytes at {hbm_bytes_per_s / 1e12:.2f} TB/s HBM: a "
        "memory-bound lower bound, weights + KV only; KV from the block arithmetic; the kernel "
        "runs on TPU with a 16- or 32-bit cache, the XLA path elsewhere and with fp8 KV)"
    )
    return render(_COLUMNS, rows, [note])
