"""What partial rollouts save (`rollout.partial`, `rollout/partial.py`): decode steps, bytes and
the memory-bound lower bound of one RL step's rollout, synchronous vs partial at several
over-samplings, with the staleness each costs.

One host is replayed for `steps` RL steps (the first `warmup` fill the pipeline and are not
counted): each step draws new groups (G responses each, lengths drawn from the length mix) until
ceil(oversample x P) are in flight, and runs the engine's scheduler in partial mode
(`Scheduler(resume=True, target_groups=...)` against `replay.simulate`) until P groups are
complete; the unfinished responses carry over with what they generated, and a response holding
a token older than `max_staleness` steps starts again (as `PartialRollout` does). Synchronous:
each step's P groups decoded to their end. Bytes are the paged kernel's (each slot's own pages)
plus the weights once per decode step, at the chip's HBM bandwidth: a lower bound that also
leaves out the prefill of carried responses (compute-bound, once per carried response per
step). Hosts are alike in distribution; the table is one host's mean step.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from dvp_jax.plan.replay import simulate
from dvp_jax.plan.tables import Column, render
from dvp_jax.rollout.scheduler import Limits, Scheduler


@dataclasses.dataclass(frozen=True)
class PartialCost:
    """One rollout mode's mean RL step on one host, per chip.

    Attributes:
      mode: "synchronous" or "partial x<oversample>".
      steps: decode steps per RL step.
      weight_gb, kv_gb: bytes read per RL step (GB).
      seconds: (weights + KV) at the HBM bandwidth: a lower bound.
      mean_age: mean over trained tokens of the weight versions between sampling and update.
      stale_share: trained tokens sampled under older weights (age >= 1).
      restarts: responses started again per RL step (past max_staleness).
    """

    mode: str
    steps: float
    weight_gb: float
    kv_gb: float
    seconds: float
    mean_age: float
    stale_share: float
    restarts: float

    def row(self) -> dict:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in vars(self).items()}


@dataclasses.dataclass(eq=False)
class _Response:
    total: int  # its length once finished
    done: int = 0  # tokens generated so far
    chunks: list = dataclasses.field(default_factory=list)  # (RL step, tokens generated)


def replay(
    lim: Limits,
    *,
    groups_per_step: int,
    group_size: int,
    prompt_length: int,
    lengths: np.ndarray,
    oversample: float | None,
    max_staleness: int,
    steps: int,
    warmup: int,
    seed: int = 0,
) -> dict[str, float]:
    """One host's RL steps (module docstring); `oversample` None: synchronous. Returns per-step
    means over the counted steps: decode steps, KV positions read, token ages, restarts."""
    rng = np.random.default_rng(seed)
    pool = np.asarray(lengths)  # the length mix, drawn from at random group by group
    capacity = groups_per_step if oversample is None else math.ceil(oversample * groups_per_step)
    groups: list[list[_Response]] = []
    totals = {"steps": 0.0, "positions": 0.0, "restarts": 0.0}
    ages: list[tuple[int, int]] = []  # (age, tokens) of the counted steps' trained tokens
    ps = lim.page_size
    for t in range(steps):
        counted = t >= warmup
        if oversample is not None:  # past max_staleness: start again
            for group in groups:
                for r in group:
                    if r.chunks and t - min(s for s, _ in r.chunks) > max_staleness:
                        r.done, r.chunks = 0, []
                        totals["restarts"] += counted
        while len(groups) < capacity:
            lengths = rng.choice(pool, group_size)
            groups.append([_Response(int(n)) for n in lengths])
        requests = [(gi, r) for gi, g in enumerate(groups) for r in g if r.done < r.total]
        complete = [gi for gi, g in enumerate(groups) if all(r.done == r.total for r in g)]
        if oversample is None:
            target = None
        else:
            target = max(groups_per_step - len(complete), 0)
        read = [0.0]

        def count(dispatch, active, pos, read=read):
            read[0] += float(np.sum(-(-(pos[active] + 1) // ps))) * ps

        if requests and (target is None or target > 0):
            sched = Scheduler(
                lim,
                [prompt_length] * len(requests),
                resume=True,
                generated=[r.done for _, r in requests],
                groups=[gi for gi, _ in requests],
                target_groups=target,
            )
            stats = simulate(sched, [r.total for _, r in requests], read_hook=count)
            now = dict(sched.unfinished())
            for i, (_, r) in enumerate(requests):
                new = (r.total if i in sched.finished else now.get(i, r.done)) - r.done
                if new:
                    r.chunks.append((t, new))
                    r.done += new
            complete += sched.complete
            totals["steps"] += stats.steps * counted
            totals["positions"] += read[0] * counted
        taken = complete[:groups_per_step]
        if counted:
            for gi in taken:
                ages += [(t - s, n) for r in groups[gi] for s, n in r.chunks]
        groups = [g for gi, g in enumerate(groups) if gi not in set(taken)]
    n = max(steps - warmup, 1)
    tokens = sum(k for _, k in ages) or 1
    return {
        "steps": totals["steps"] / n,
        "positions": totals["positions"] / n,
        "mean_age": sum(a * k for a, k in ages) / tokens,
        "stale_share": sum(k for a, k in ages if a >= 1) / tokens,
        "restarts": totals["restarts"] / n,
    }


def partial_costs(
    lim: Limits,
    *,
    groups_per_step: int,
    group_size: int,
    prompt_length: int,
    lengths: np.ndarray,
    oversamples: tuple[float, ...],
    max_staleness: int,
    weight_bytes: float,
    kv_bytes_per_position: float,
    hbm_bytes_per_s: float,
    steps: int = 12,
    warmup: int = 4,
) -> list[PartialCost]:
    """Synchronous, then partial at each over-sampling (the module docstring), each drawing
    its groups' lengths from `lengths` (a length mix) with the same seed."""
    out = []
    for o in (None, *oversamples):
        r = replay(
            lim,
            groups_per_step=groups_per_step,
            group_size=group_size,
            prompt_length=prompt_length,
            lengths=lengths,
            oversample=o,
            max_staleness=max_staleness,
            steps=steps,
            warmup=warmup,
        )
        weights, kv = r["steps"] * weight_bytes, r["positions"] * kv_bytes_per_position
        out.append(
            PartialCost(
                mode="synchronous" if o is None else f"partial x{o:g}",
                steps=r["steps"],
                weight_gb=weights / 1e9,
                kv_gb=kv / 1e9,
                seconds=(weights + kv) / hbm_bytes_per_s,
                mean_age=r["mean_age"],
                stale_share=r["stale_share"],
                restarts=r["restarts"],
            )
        )
    return out


def table(costs: list[PartialCost]) -> str:
    """The costs as lines of text, each mode's lower bound over the synchronous one's."""
    sync = costs[0].seconds
    columns = [
        Column("rollout", 15, left=True),
        Column("decode steps", 12, ",.0f"),
        Column("weights GB", 11, ",.0f"),
        Column("KV GB", 9, ",.0f"),
        Column("lower bound", 12, ",.1f", "s"),
        Column("/sync", 6, ".2f"),
        Column("mean age", 9, ".2f"),
        Column("stale share", 11, ".2f"),
        Column("restarts", 9, ".1f"),
    ]
    rows = [
        (
            c.mode,
            c.steps,
            c.weight_gb,
            c.kv_gb,
            c.seconds,
            c.seconds / sync,
            c.mean_age,
            c.stale_share,
            c.restarts,
        )
        for c in costs
    ]
    notes = [
        "(one host's mean RL step, per chip; the paged kernel's KV plus the weights once per "
        "decode step at the HBM bandwidth: a lower bound, leaving out the prefill of carried "
        "responses; age: weight versions between a token's sampling and its update)"
    ]
    return render(columns, rows, notes)
