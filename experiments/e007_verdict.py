"""e007 decision rules: the gate, then the premise with its weight-drift control, then the methods
paired by seed. Reads results/e007/gate.json and units/*.json, writes results/e007/verdict.json.

Pre-registered: committed with the runner before any e007 arm data (the commit order is the
evidence); each rule is a pure function of the figures below (tests/test_experiments_e007.py
checks each outcome on fixture records). Not pre-registered readings go under "reading", never
into an outcome.

Why e007 (issue 46): e006's tasks had no tail (0.0012% of DVP's sampled tokens outside the
trainer's e^-13 safe set; the tail carried ~1% of RLOO's gradient bias), so DVP had nothing to act
on; its premise passed narrowly without a weight-drift control; 3 seeds could not resolve a method.
e007 runs on the tail-sum task (configs/e007_tail_sum.py), whose free positions put ~10% of their
mass on ~100k words each below e^-13 x p_max.

Gate (measured on the warm start before any arm runs, `gate.json`, by experiments/e007_gate.py):
RLOO's sampler at the rung (M3, unpruned) draws responses to GATE_PROMPTS x GATE_SAMPLES train
prompts; the fp32 trainer scores them. The gate passes iff
  - outside_share >= GATE_MIN_OUTSIDE: the share of sampled response tokens outside the trainer's
    safe set (log pi(y) - max log pi < -13), and
  - tail_abs_share >= GATE_MIN_TAIL_SHARE: sum over those tokens of |log mu - log pi| over the
    sum over all response tokens.
If it fails, no arm runs: the task is changed and the gate measured again; these rules are not.

Arms (`ARMS`), `SEEDS` x `STEPS` RL steps each from the same warm start; per step each run records
(`CURVES`): m_t = `full_kl_k1` (mean over response tokens of log mu - log pi of the sampled
tokens, unpruned whatever the method; primary), its parts inside / outside the trainer's safe set,
the outside share, the |d| tail share, the entropy, the masked and excluded shares, the reward;
held-out avg@k at step 0 and every segment end. The weight-drift control: at step 0 and at every
segment end of the fp32 arm (`rloo_fp32`), the M3 engine samples from the fp32 arm's current
weights and the fp32 trainer scores them (`control` in that run's record: step, full_kl_k1, ...):
the mismatch the rung would show on weights that drift by training alone, without M3's samples
steering them.

Figures: per run and series, G = b x STEPS with b the least-squares slope on the step (the
control's over its measured steps); m0 = the mean of RLOO M3's steps 1..START_WINDOW, averaged
over the seeds (|m0|).

Rules:
* Premise: per seed s, r_s = (G(RLOO M3, s) - G(control, s)) / |m0|; its 95% t interval over the
  seeds: "the premise appears at this scale" if lower end > 0 and mean >= MATERIAL_GROWTH; "the
  premise does not appear at this scale" (the null, stated in advance) if upper end <
  MATERIAL_GROWTH; else "inconclusive". Held-out: the drop of RLOO M3 against RLOO fp32 at STEPS,
  paired by seed, reported with its interval (not a gate).
* Methods (DVP, MIS+DVP, IcePop at M3), each paired by seed with RLOO M3: d_s = (G(method, s) -
  G(RLOO M3, s)) / |m0|, its 95% t interval; R = the mean of r_s (RLOO M3's excess growth):
    - "removes growth" if its upper end < 0 (the share removed, -mean d / R, reported);
    - "adds growth" if its lower end > 0;
    - "does not remove half" (the null, stated in advance) if its lower end > -REMOVED_SHARE x R
      (the interval rules out removing half of RLOO's excess growth);
    - "no effect detectable at this size" otherwise (the interval contains 0 and reaches below
      -REMOVED_SHARE x R).
  Judged whatever the premise's outcome; if the premise does not appear each status is prefixed
  "premise absent: ". Held-out gain (step STEPS minus step 0) against RLOO M3's, paired,
  reported.
* Seeds: `N_SEEDS` from `seeds_for_power` on e006's committed figures: the smallest n >= 5 at which
  a two-sided paired t-test at 5% has power >= POWER_TARGET to detect d = -REMOVED_SHARE x R,
  with e006's R (1.48) and the pooled SD of its three paired differences (0.71): n = 10, power
  0.83 (`design_power()` recomputes both; a test checks them).
A rule reads a run only once it has STEPS steps; fewer complete seeds than SEEDS: "incomplete".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence

import numpy as np

from dvp_jax.workdir import write_atomic
from experiments.records import load_units  # noqa: F401 (the verdict's reader)
from experiments.stats import t_interval

# ------------------------------------------------------------------------------------------------
# Design and thresholds (pre-registered).
# ------------------------------------------------------------------------------------------------
ARMS = {  # arm -> (method, rung); M0 = fp32 rollouts, M3 = bf16 + fp8 KV + int4 weights
    "rloo_fp32": ("rloo", "M0"),
    "rloo_M3": ("rloo", "M3"),
    "dvp_M3": ("dvp", "M3"),
    "mis_dvp_M3": ("mis_dvp", "M3"),
    "icepop_M3": ("icepop", "M3"),
}
ARM_GROUPS = (("rloo_fp32", "rloo_M3"), ("dvp_M3", "mis_dvp_M3"), ("icepop_M3",))  # run order
METHOD_ARMS = ("dvp_M3", "mis_dvp_M3", "icepop_M3")
RUNG = "M3"
N_SEEDS = 10
POWER_AT_N_SEEDS = 0.83
SEEDS = tuple(range(N_SEEDS))
STEPS = 40
PRIMARY = "full_kl_k1"
START_WINDOW = 10
MATERIAL_GROWTH = 0.25
REMOVED_SHARE = 0.5
CONFIDENCE = 0.95
POWER_TARGET = 0.8
MIN_SEEDS = 5
# The gate.
GATE_MIN_OUTSIDE = 0.05
GATE_MIN_TAIL_SHARE = 0.30
GATE_PROMPTS, GATE_SAMPLES = 32, 8
E006_VERDICT = "experiments/results/e006/verdict.json"


# ------------------------------------------------------------------------------------------------
# Power: the seed count (pre-registered from e006's figures).
# ------------------------------------------------------------------------------------------------
def paired_t_power(effect: float, sd: float, n: int, confidence: float = CONFIDENCE) -> float:
    """Power of a two-sided paired t-test at 1 - `confidence` to detect a mean difference
    `effect` with per-pair SD `sd` over `n` pairs (noncentral t)."""
    from scipy import stats

    df, nc = n - 1, abs(effect) / sd * np.sqrt(n)
    tc = stats.t.ppf(0.5 + confidence / 2, df)
    return float(1 - stats.nct.cdf(tc, df, nc) + stats.nct.cdf(-tc, df, nc))


def seeds_for_power(effect: float, sd: float, target: float = POWER_TARGET, least=MIN_SEEDS):
    """(n, power): the smallest n >= `least` whose power reaches `target`."""
    n = least
    while paired_t_power(effect, sd, n) < target:
        n += 1
    return n, paired_t_power(effect, sd, n)


def design_power(e006_verdict: Mapping) -> dict:
    """The seed count from e006's committed verdict: R = RLOO M3's mean r, the pooled SD of the
    methods' paired differences against RLOO M3 (`reading.paired_growth_vs_rloo_M3`)."""
    r = e006_verdict["metrics"][PRIMARY]["relative_excess_growth_rloo_M3"]["mean"]
    paired = e006_verdict["reading"]["paired_growth_vs_rloo_M3"]
    sd = float(np.sqrt(np.mean([np.var(p["values"], ddof=1) for p in paired.values()])))
    n, power = seeds_for_power(REMOVED_SHARE * r, sd)
    return {"R": r, "sd": sd, "effect": REMOVED_SHARE * r, "n_seeds": n, "power": power}


# ------------------------------------------------------------------------------------------------
# Figures.
# ------------------------------------------------------------------------------------------------
def growth(steps: Sequence[int], values: Sequence[float], horizon: int = STEPS) -> float:
    """b x horizon, b the least-squares slope of `values` on `steps`."""
    x, y = np.asarray(steps, float), np.asarray(values, float)
    return float(np.polyfit(x, y, 1)[0] * horizon)


def series(rec: Mapping, metric: str = PRIMARY) -> tuple[list, list]:
    pairs = [
        (s, v)
        for s, v in zip(rec["steps_logged"], rec["curves"][metric], strict=True)
        if v is not None
    ]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def control_growth(rec: Mapping, horizon: int = STEPS) -> float | None:
    """G of the weight-drift control (the M3 engine on the fp32 arm's weights), None with < 2."""
    pts = [(c["step"], c[PRIMARY]) for c in rec.get("control", []) if c["step"] <= horizon]
    if len(pts) < 2:
        return None
    s, v = zip(*pts, strict=True)
    return growth(s, v, horizon)


def final_acc(rec: Mapping, steps: int = STEPS) -> float | None:
    return next((a for s, a in rec["evals"] if s == steps), None)


def start_acc(rec: Mapping) -> float | None:
    return next((a for s, a in rec["evals"] if s == 0), None)


def _interval(xs: Sequence[float]) -> dict:
    if len(xs) < 2:
        return {"n": len(xs), "mean": float(np.mean(xs)) if xs else None, "lo": None, "hi": None}
    m, lo, hi = t_interval(xs, CONFIDENCE)
    return {"n": len(xs), "mean": m, "lo": lo, "hi": hi, "values": list(map(float, xs))}


# ------------------------------------------------------------------------------------------------
# The rules: pure functions of the figures.
# ------------------------------------------------------------------------------------------------
def gate_status(gate: Mapping | None) -> str:
    if not gate:
        return "not measured"
    ok = gate["outside_share"] >= GATE_MIN_OUTSIDE and gate["tail_abs_share"] >= GATE_MIN_TAIL_SHARE
    return "passes" if ok else "fails"


def premise_status(rel: Mapping, complete: bool) -> str:
    if not complete or rel["lo"] is None:
        return "incomplete"
    if rel["lo"] > 0 and rel["mean"] >= MATERIAL_GROWTH:
        return "the premise appears at this scale"
    if rel["hi"] < MATERIAL_GROWTH:
        return "the premise does not appear at this scale"
    return "inconclusive"


def method_status(d: Mapping, r_mean: float | None, premise: str, complete: bool) -> str:
    if not complete or d["lo"] is None or r_mean is None:
        return "incomplete"
    if d["hi"] < 0:
        status = "removes growth"
    elif d["lo"] > 0:
        status = "adds growth"
    elif d["lo"] > -REMOVED_SHARE * abs(r_mean):
        status = "does not remove half"
    else:
        status = "no effect detectable at this size"
    if premise == "the premise does not appear at this scale":
        return "premise absent: " + status
    return status


# ------------------------------------------------------------------------------------------------
# Reading the records and writing verdict.json.
# ------------------------------------------------------------------------------------------------


def load_gate(out: str) -> dict | None:
    path = os.path.join(out, "gate.json")
    if not os.path.exists(path):
        return None
    with open(path) as fh:
        return json.load(fh)


def verdict_from_units(
    units: Mapping[str, dict],
    gate: Mapping | None,
    steps: int = STEPS,
    seeds: Sequence[int] = SEEDS,
) -> dict:
    """Every rule's status and figures (`steps`, `seeds`: the registered sizes; the smoke passes
    its own)."""
    out = {"gate": {"status": gate_status(gate), "figures": dict(gate or {})}}
    done = {
        (u["arm"], u["seed"]): u
        for u in units.values()
        if u["steps"] >= steps and u["seed"] in seeds
    }
    out["complete_runs"] = sorted(f"{a}_s{s}" for a, s in done)
    g = {}
    for k, u in done.items():
        x, y = series(u)
        g[k] = growth(x, y, steps) if len(x) >= 2 else None
    ctrl = {s: control_growth(u, steps) for (a, s), u in done.items() if a == "rloo_fp32"}
    starts = [np.mean(series(done["rloo_M3", s])[1][:START_WINDOW]) for s in seeds if
              ("rloo_M3", s) in done]  # fmt: skip
    m0 = abs(float(np.mean(starts))) if starts else None
    both = [s for s in seeds if g.get(("rloo_M3", s)) is not None and ctrl.get(s) is not None]
    r = _interval([(g["rloo_M3", s] - ctrl[s]) / m0 for s in both] if m0 else [])
    premise = premise_status(r, len(both) == len(seeds))
    out |= {
        "m0_rloo_M3": m0,
        "growth_per_run": {f"{a}_s{s}": v for (a, s), v in sorted(g.items())},
        "control_growth": {f"rloo_fp32_s{s}": v for s, v in sorted(ctrl.items())},
        "relative_excess_growth_rloo_M3": r,
        "premise": premise,
    }
    methods = {}
    for arm in METHOD_ARMS:
        pairs = [s for s in seeds if g.get((arm, s)) is not None and g.get(("rloo_M3", s))
                 is not None]  # fmt: skip
        d = _interval([(g[arm, s] - g["rloo_M3", s]) / m0 for s in pairs] if m0 else [])
        share = -d["mean"] / r["mean"] if d["mean"] is not None and r["mean"] else None
        methods[arm] = {
            "paired_growth_vs_rloo_M3": d,
            "share_removed": share,
            "status": method_status(d, r["mean"], premise, len(pairs) == len(seeds)),
        }
    out["methods"] = methods
    acc, acc0 = (
        {k: final_acc(u, steps) for k, u in done.items()},
        {k: start_acc(u) for k, u in done.items()},
    )
    paired = lambda a, b, f: [  # noqa: E731
        f(a, s) - f(b, s) for s in seeds if f(a, s) is not None and f(b, s) is not None
    ]
    final = lambda a, s: acc.get((a, s))  # noqa: E731
    gain = lambda a, s: (  # noqa: E731
        None if acc.get((a, s)) is None or acc0.get((a, s)) is None else acc[a, s] - acc0[a, s]
    )
    out["heldout"] = {
        "final_acc": {f"{a}_s{s}": v for (a, s), v in sorted(acc.items())},
        "start_acc": {f"{a}_s{s}": v for (a, s), v in sorted(acc0.items())},
        "drop_rloo_M3_vs_fp32": _interval(paired("rloo_fp32", "rloo_M3", final)),
        "gain_vs_rloo_M3": {a: _interval(paired(a, "rloo_M3", gain)) for a in METHOD_ARMS},
    }
    out["status"] = {"gate": out["gate"]["status"], "premise": premise} | {
        a: methods[a]["status"] for a in METHOD_ARMS
    }
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="experiments/results/e007", help="the e007 results folder")
    p.add_argument("--smoke", action="store_true", help="the smoke's sizes (2 steps, seed 0)")
    args = p.parse_args(argv)
    kw = dict(steps=2, seeds=(0,)) if args.smoke else {}
    result = verdict_from_units(load_units(args.out), load_gate(args.out), **kw)
    os.makedirs(args.out, exist_ok=True)
    write_atomic(os.path.join(args.out, "verdict.json"), json.dumps(result, indent=1))
    print(json.dumps(result["status"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
