"""e006 decision rules: reads results/e006/units/*.json and writes results/e006/verdict.json.

Committed with the runner before any e006 data (the commit order is the evidence); each rule is
a pure function of the figures below (tests/test_experiments_e006.py checks each outcome).

Records (experiments/e006_premise.py): one per run (arm x seed), with the per-step series of the
run's sampled tokens, unpruned whatever the method: m_t = `full_kl_k1`, the mean over response
tokens of log mu - log pi (primary), and g_t = `full_log_ppl_diff`, the paper's log-PPL gap
(secondary), and held-out avg@16 at step 0 and at each segment's end.

Figures, per run and metric: the growth G = b x STEPS, b the least-squares slope of the series
on the step over steps 1..STEPS (nats per token over the run), and the starting level
m0 = the mean of steps 1..START_WINDOW.

Rules (pre-registered):
* Premise (primary metric; the secondary is judged the same way and reported beside it). Per seed
  s with both premise arms complete, the relative excess growth r_s = (G(RLOO M3, s) -
  G(RLOO fp32, s)) / |m0(RLOO M3)| (m0 averaged over seeds); its 95% Student-t interval over the
  seeds (n = 3, t = 4.30):
    - "the premise appears at this scale" if the interval's lower end > 0 and its mean >=
      MATERIAL_GROWTH (the mismatch grows by at least a quarter of its starting level in STEPS
      steps, beyond what fp32 rollouts show);
    - "the premise does not appear at this scale" (the null outcome, stated in advance) if the
      interval's upper end < MATERIAL_GROWTH: any growth is smaller than a quarter of the
      starting level over the run;
    - "inconclusive" otherwise (neither of the above: the interval reaches 0, or its mean is
      below the threshold while its upper end is not), with its ends.
  Held-out accuracy: the drop of RLOO M3 against RLOO fp32 at step STEPS, paired by seed, mean and
  95% t interval; reported, not a gate (3 seeds resolve only a large drop).
* Methods (DVP, MIS+DVP, IcePop at M3), judged only if the premise appears: per method the
  relative excess growth over fp32 (as above, the method's run in place of RLOO M3's, over the
  same |m0(RLOO M3)|):
    - "removes the growth" if its interval's upper end < MATERIAL_GROWTH;
    - "does not remove it" if its interval's lower end >= the mean of RLOO M3's r_s x (1 -
      REMOVED_SHARE), i.e. it keeps most of RLOO's growth;
    - "partly, unresolved" otherwise; the share removed, 1 - mean r(method) / mean r(RLOO M3),
      is reported with the held-out accuracy difference against RLOO M3 (paired by seed).
  If the premise does not appear: "nothing to remove (premise absent)", the figures reported.
A rule reads a run only once it has STEPS steps; with fewer complete seeds than SEEDS a status
is "incomplete" (the figures of what exists are still written).
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
SEEDS = (0, 1, 2)
STEPS = 100
PRIMARY, SECONDARY = "full_kl_k1", "full_log_ppl_diff"
START_WINDOW = 10
MATERIAL_GROWTH = 0.25
REMOVED_SHARE = 0.5
CONFIDENCE = 0.95


# ------------------------------------------------------------------------------------------------
# Figures.
# ------------------------------------------------------------------------------------------------
def growth(steps: Sequence[int], values: Sequence[float], horizon: int = STEPS) -> float:
    """b x horizon, b the least-squares slope of `values` on `steps` (nats over the run)."""
    x, y = np.asarray(steps, float), np.asarray(values, float)
    return float(np.polyfit(x, y, 1)[0] * horizon)


def start_level(values: Sequence[float], window: int = START_WINDOW) -> float:
    return float(np.mean(np.asarray(values[:window], float)))


def run_figures(rec: Mapping, metric: str, horizon: int = STEPS) -> dict | None:
    pairs = [
        (s, v)
        for s, v in zip(rec["steps_logged"], rec["curves"][metric], strict=True)
        if v is not None
    ]
    if len(pairs) < 2:
        return None
    s, v = zip(*pairs, strict=True)
    return {"growth": growth(s, v, horizon), "start": start_level(v), "mean": float(np.mean(v))}


def final_acc(rec: Mapping, steps: int = STEPS) -> float | None:
    return next((a for s, a in rec["evals"] if s == steps), None)


def _interval(xs: Sequence[float]) -> dict:
    if len(xs) < 2:
        return {"n": len(xs), "mean": float(np.mean(xs)) if xs else None, "lo": None, "hi": None}
    m, lo, hi = t_interval(xs, CONFIDENCE)
    return {"n": len(xs), "mean": m, "lo": lo, "hi": hi, "values": list(map(float, xs))}


# ------------------------------------------------------------------------------------------------
# The rules: pure functions of the figures.
# ------------------------------------------------------------------------------------------------
def premise_status(rel: Mapping, complete: bool) -> str:
    """The premise from the interval of the relative excess growth r_s (`_interval`)."""
    if not complete or rel["lo"] is None:
        return "incomplete"
    if rel["lo"] > 0 and rel["mean"] >= MATERIAL_GROWTH:
        return "the premise appears at this scale"
    if rel["hi"] < MATERIAL_GROWTH:
        return "the premise does not appear at this scale"
    return "inconclusive"


def method_status(rel: Mapping, rloo_mean: float, premise: str, complete: bool) -> str:
    """A method at M3 from its own relative excess growth and RLOO M3's mean."""
    if premise != "the premise appears at this scale":
        if premise == "the premise does not appear at this scale":
            return "nothing to remove (premise absent)"
        return "not judged (premise " + premise + ")"
    if not complete or rel["lo"] is None:
        return "incomplete"
    if rel["hi"] < MATERIAL_GROWTH:
        return "removes the growth"
    if rel["lo"] >= rloo_mean * (1 - REMOVED_SHARE):
        return "does not remove it"
    return "partly, unresolved"


# ------------------------------------------------------------------------------------------------
# Reading the records and writing verdict.json.
# ------------------------------------------------------------------------------------------------


def verdict_from_units(
    units: Mapping[str, dict], steps: int = STEPS, seeds: Sequence[int] = SEEDS
) -> dict:
    """Every rule's status and figures from the run records (`steps`, `seeds`: the registered
    sizes; the smoke passes its own)."""
    done = {
        (u["arm"], u["seed"]): u
        for u in units.values()
        if u["steps"] >= steps and u["seed"] in seeds
    }
    out = {"complete_runs": sorted(f"{a}_s{s}" for a, s in done), "metrics": {}}
    for metric in (PRIMARY, SECONDARY):
        fig = {k: run_figures(u, metric, steps) for k, u in done.items()}
        both = [s for s in seeds if fig.get(("rloo_M3", s)) and fig.get(("rloo_fp32", s))]
        m0 = abs(np.mean([fig["rloo_M3", s]["start"] for s in both])) if both else None
        rel = lambda arm, m0=m0, fig=fig: [  # noqa: E731
            (fig[arm, s]["growth"] - fig["rloo_fp32", s]["growth"]) / m0
            for s in seeds
            if fig.get((arm, s)) and fig.get(("rloo_fp32", s)) and m0
        ]
        r_rloo = _interval(rel("rloo_M3"))
        premise = premise_status(r_rloo, len(both) == len(seeds))
        entry = {
            "start_level_rloo_M3": m0,
            "growth_per_run": {f"{a}_s{s}": f["growth"] for (a, s), f in fig.items() if f},
            "start_per_run": {f"{a}_s{s}": f["start"] for (a, s), f in fig.items() if f},
            "relative_excess_growth_rloo_M3": r_rloo,
            "premise": premise,
            "methods": {},
        }
        for arm in METHOD_ARMS:
            r = _interval(rel(arm))
            full = r["n"] == len(seeds)
            entry["methods"][arm] = {
                "relative_excess_growth": r,
                "share_removed": 1 - r["mean"] / r_rloo["mean"]
                if r["mean"] is not None and r_rloo["mean"]
                else None,
                "status": method_status(r, r_rloo["mean"] or 0.0, premise, full),
            }
        out["metrics"][metric] = entry
    acc = {k: final_acc(u, steps) for k, u in done.items()}
    paired = lambda a, b: [  # noqa: E731
        acc[a, s] - acc[b, s]
        for s in seeds
        if acc.get((a, s)) is not None and acc.get((b, s)) is not None
    ]
    out["heldout"] = {
        "final_acc": {f"{a}_s{s}": v for (a, s), v in acc.items()},
        "drop_rloo_M3_vs_fp32": _interval(paired("rloo_fp32", "rloo_M3")),
        "gain_vs_rloo_M3": {arm: _interval(paired(arm, "rloo_M3")) for arm in METHOD_ARMS},
    }
    out["premise"] = out["metrics"][PRIMARY]["premise"]
    out["methods"] = {a: out["metrics"][PRIMARY]["methods"][a]["status"] for a in METHOD_ARMS}
    m0 = out["metrics"][PRIMARY]["start_level_rloo_M3"]
    out["reading"] = reading(units, done, m0, steps, seeds)
    out["reading"]["labels"] = reading_labels(out)
    return out


def reading(
    units: Mapping[str, dict],
    done: Mapping[tuple[str, int], dict],
    m0: float | None,
    steps: int,
    seeds: Sequence[int],
) -> dict:
    """Figures beside the rules, added after the data (not pre-registered; no outcome reads them).

    * paired_growth_vs_rloo_M3: per method, (G(method, s) - G(RLOO M3, s)) / m0 by seed (primary
      metric, m0 the rule's |m0(RLOO M3)|): the share of m0 the method adds to RLOO M3's growth
      (negative: it removes some), paired on the seed's data order and start, where the rule's
      r compares each arm with fp32 separately.
    * heldout_gain_vs_rloo_M3: per method, the held-out gain (step `steps` minus step 0) minus
      RLOO M3's, by seed. Every arm is evaluated on the fp32 engine with its method's min-p rule
      (DVP and MIS+DVP sample inside the safe set; RLOO and IcePop do not), so the pruning arms
      start from another figure than RLOO on the same weights (`start_acc`, every run that has
      one); the rule's step-`steps` difference (`heldout.gain_vs_rloo_M3`) carries that offset,
      the gain does not. Both read complete runs only.
    """
    start_acc = {(u["arm"], u["seed"]): dict(map(tuple, u["evals"])).get(0) for u in units.values()}
    gain = {}
    for k, u in done.items():
        a, b = start_acc.get(k), final_acc(u, steps)
        if a is not None and b is not None:
            gain[k] = b - a
    fig = {k: run_figures(u, PRIMARY, steps) for k, u in done.items()}
    growth_diff, gain_diff = {}, {}
    for arm in METHOD_ARMS:
        pairs = [((arm, s), ("rloo_M3", s)) for s in seeds]
        growth_diff[arm] = [
            (fig[run]["growth"] - fig[ref]["growth"]) / m0
            for run, ref in pairs
            if m0 and fig.get(run) and fig.get(ref)
        ]
        gain_diff[arm] = [
            gain[run] - gain[ref] for run, ref in pairs if run in gain and ref in gain
        ]
    paired = {a: _interval(growth_diff[a]) for a in METHOD_ARMS}
    return {
        "note": "not pre-registered: figures beside the rules, added after the data",
        "paired_growth_vs_rloo_M3": paired,
        "heldout_gain_vs_rloo_M3": {a: _interval(gain_diff[a]) for a in METHOD_ARMS},
        "start_acc": {f"{a}_s{s}": v for (a, s), v in sorted(start_acc.items())},
    }


# What each outcome could detect (issue 46): the labels the READMEs use beside the rule outcomes.
NO_EFFECT = "no effect detectable at this size"
NARROW_PASS = "a narrow pass without a weight-drift control"
NO_DEGRADATION = "no degradation observed"


def reading_labels(verdict: Mapping) -> dict:
    """Labels held to what the design could detect, beside the rule outcomes (not pre-registered;
    added after the data, issue 46). Pure function of verdict.json's figures.

    * premise: NARROW_PASS when the rule passed with the interval's lower end below
      MATERIAL_GROWTH (the growth could be immaterial) - every e006 premise pass lacks the
      weight-drift control, since fp32 rollouts have zero mismatch by construction (the same
      numerics on both sides), so growth beyond fp32 cannot be told from weight drift; plus
      NO_DEGRADATION when the held-out drop's interval (fp32 minus M3) contains 0.
    * methods: NO_EFFECT when the paired interval of (G(method) - G(RLOO M3)) / m0 contains 0,
      with `resolves_half` whether its half-width is below half of RLOO M3's mean r (what a method
      removing half of RLOO's growth would need to be seen).
    """
    primary = verdict["metrics"][PRIMARY]
    r = primary["relative_excess_growth_rloo_M3"]
    drop = verdict["heldout"]["drop_rloo_M3_vs_fp32"]
    parts = []
    if verdict["premise"] == "the premise appears at this scale" and r["lo"] < MATERIAL_GROWTH:
        parts.append(NARROW_PASS)
    elif verdict["premise"] == "the premise appears at this scale":
        parts.append("a pass without a weight-drift control")
    if drop["lo"] is not None and drop["lo"] <= 0 <= drop["hi"]:
        parts.append(NO_DEGRADATION)
    methods = {}
    for arm, iv in verdict["reading"]["paired_growth_vs_rloo_M3"].items():
        if iv["lo"] is None:
            methods[arm] = {"label": "incomplete"}
            continue
        half = (iv["hi"] - iv["lo"]) / 2
        methods[arm] = {
            "label": NO_EFFECT if iv["lo"] <= 0 <= iv["hi"] else "an effect detected",
            "paired_interval": [iv["mean"], iv["lo"], iv["hi"]],
            "half_width": half,
            "resolves_half": bool(half < REMOVED_SHARE * (r["mean"] or 0.0)),
        }
    return {
        "note": "not pre-registered: labels held to what the design could detect (issue 46)",
        "premise": "; ".join(parts) if parts else verdict["premise"],
        "premise_interval": [r["mean"], r["lo"], r["hi"]],
        "heldout_drop_interval": [drop["mean"], drop["lo"], drop["hi"]],
        "methods": methods,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="experiments/results/e006", help="the e006 results folder")
    p.add_argument("--smoke", action="store_true", help="the smoke's sizes (2 steps, seed 0)")
    args = p.parse_args(argv)
    units = load_units(args.out)
    kw = dict(steps=2, seeds=(0,)) if args.smoke else {}
    result = verdict_from_units(units, **kw)
    os.makedirs(args.out, exist_ok=True)
    # Whole or not at all: lanes side by side rewrite it.
    write_atomic(os.path.join(args.out, "verdict.json"), json.dumps(result, indent=1))
    print(json.dumps({"premise": result["premise"], "methods": result["methods"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
