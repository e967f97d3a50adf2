"""A staged experiment's runs and records (e005-e007): the run order in segments and its lanes;
`<out>/units/<run>.json`, one JSON record per run, written atomically and read back by the
verdict and the plots; and how their figures print in the tables. Light on purpose: the
verdicts import it without JAX.
"""

from __future__ import annotations

import json
import os

import numpy as np

from dvp_jax.workdir import write_atomic


def run_name(arm: str, seed: int) -> str:
    return f"{arm}_s{seed}"


def unit_order(arm_groups, seeds, steps: int, unit_steps: int) -> list[tuple[str, int, int]]:
    """Every (arm, seed, segment end) in run order: each group of arms (`arm_groups`, e.g. the
    premise arms first) over every seed; a run's segments of `unit_steps` one after another."""
    ends = [*range(unit_steps, steps, unit_steps), steps]
    return [(arm, s, e) for group in arm_groups for s in seeds for arm in group for e in ends]


def lane_runs(lane: str, order) -> set[str]:
    """The runs of lane "i/n": every n-th run of `order` (`unit_order`) from the i-th, so n
    processes (one per core) share the units without two ever touching the same run."""
    try:
        i, n = (int(x) for x in lane.split("/"))
        if not 0 <= i < n:
            raise ValueError
    except ValueError:
        raise SystemExit(f"--lane: {lane!r} is not i/n with 0 <= i < n (e.g. 0/2)") from None
    runs = list(dict.fromkeys(run_name(a, s) for a, s, _ in order))
    return set(runs[i::n])


def write_unit(out: str, rec: dict) -> None:
    """`rec` as `<out>/units/<rec['run']>.json` (whole or not at all)."""
    os.makedirs(os.path.join(out, "units"), exist_ok=True)
    write_atomic(os.path.join(out, "units", f"{rec['run']}.json"), json.dumps(rec, indent=1))


def load_units(out: str) -> dict[str, dict]:
    """Every `<out>/units/<run>.json`, run name -> record, in name order ({} before any)."""
    base = os.path.join(out, "units")
    units = {}
    for name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        if name.endswith(".json"):
            with open(os.path.join(base, name)) as fh:
                units[name[:-5]] = json.load(fh)
    return units


def mean_curve(runs: list[dict], metric: str) -> tuple[np.ndarray, np.ndarray]:
    """Mean of the records' `curves[metric]` at each step every run present has reached (a None
    value is left out of that step's mean)."""
    n = min(len(r["steps_logged"]) for r in runs)
    ys = np.array([[np.nan if v is None else v for v in r["curves"][metric][:n]] for r in runs])
    return np.asarray(runs[0]["steps_logged"][:n]), np.nanmean(ys, axis=0)


def fmt_num(x) -> str:
    """A figure to 3 significant digits; "-" for None."""
    return "-" if x is None else f"{x:.3g}"


def fmt_interval(iv: dict) -> str:
    """A verdict's interval ({n, mean, lo, hi}) as "mean [lo, hi] (n = ...)"; the mean alone
    with fewer than 2 seeds; "-" before any."""
    if iv["mean"] is None:
        return "-"
    if iv["lo"] is None:
        return f"{fmt_num(iv['mean'])} (n = {iv['n']})"
    return f"{fmt_num(iv['mean'])} [{fmt_num(iv['lo'])}, {fmt_num(iv['hi'])}] (n = {iv['n']})"
