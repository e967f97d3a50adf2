"""e004 gates: reads the stage results under experiments/results/e004/ and writes verdict.json.

Command (from the repository root, after any stage of experiments/e004_running_sum.py):
  python -m experiments.e004_verdict --out experiments/results/e004

Inputs (written by experiments/e004_running_sum.py as each stage finishes):
  stage1_levels.json  sampling statistics of the warm start at each ladder level (>= 1,000
                      responses, the trainer's teacher-forced statistics);
  units/<unit>.json   one RL unit each: method, level, seed, role ("gain", "final"), start and
                      final held-out avg@16 (fp32 evaluation), collapse indicators, tail means.

The pre-registered gates, each a pure function of plain numbers below
(tests/test_experiments_e004.py checks each passing and failing on synthetic inputs):

* Power (`power_gate`): from the warm start, mean response length >= 150 tokens; policy entropy
  >= 1 nat; |E[L]| >= 2 nats and the share of E[L] from tokens outside the trainer's e^-13 safe
  set >= 0.25, both under the strongest level measured (the level every later stage uses); and a
  short M0 RLOO run (pilot seeds) gains >= 0.05 avg@16 over the warm start, each accuracy scored
  on >= `MIN_GAIN_EVAL_RESPONSES` held-out responses (pilot units scored on fewer are listed in
  `gain_units_excluded` and not counted). Any failure: verdict "no power".
* Premise (`premise_gate`): at that level, RLOO's final avg@16 is >= 0.05 below M0 RLOO's (mean
  over the final seeds) with a one-sided Welch t-test p < 0.05, and a collapse indicator fires in
  a majority of the RLOO seeds (`collapse_indicators`). Failure: "premise does not reproduce";
  it is decided before all seeds finish once a majority with an indicator is out of reach.
* C1 stability (`c1_gate`): DVP and MIS+DVP each end with a mean final avg@16 no more than 0.03
  below M0 RLOO, with no indicator firing in >= 4 of 5 seeds; and their pruned |E[L]| is <= 0.5x
  the unpruned |E[L]| of the same batches.
* C2 ordering (`c2_gate`): MIS+DVP minus the best (by mean) of RLOO, TIS, MIS at the level: the
  95% bootstrap CI of the mean difference (seeds resampled within each method) lies above 0; the
  headline in the paper's form is the relative difference (MIS+DVP / best - 1) with its CI.
* `verdict`: "no power", "premise does not reproduce", "claim refuted at this scale" (C1 or C2
  fails), "claim reproduces" (both pass), or "incomplete: <stage>" for the first stage not run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence

import numpy as np

from experiments.e004_reading import reading
from experiments.stats import welch_one_sided_p

# ------------------------------------------------------------------------------------------------
# Thresholds (pre-registered).
# ------------------------------------------------------------------------------------------------
MIN_LENGTH = 150.0  # mean response length, tokens
MIN_ENTROPY = 1.0  # nats per response token
MIN_ABS_SEQ_LOG_RATIO = 2.0  # |E[L]|, nats, under the strongest level
MIN_OUTSIDE_SHARE = 0.25  # share of E[L] from tokens outside the trainer's safe set
MIN_GAIN = 0.05  # M0 RLOO avg@16 gain over the warm start
# The gain is read only from pilot units whose every accuracy figure rests on at least this many
# held-out responses (the pre-registered protocol: all 39 problems x 64 samples = 2,496). The v3
# design pilot's 32 x 16 = 512 put a binomial SE of ~0.02 on the gain, 40% of the threshold.
MIN_GAIN_EVAL_RESPONSES = 2000
PREMISE_DROP = 0.05  # RLOO at the level vs M0 RLOO, final avg@16
PREMISE_P = 0.05  # one-sided p of that drop
C1_TOLERANCE = 0.03  # DVP / MIS+DVP may end at most this far below M0 RLOO
C1_MIN_CLEAN_SEEDS = 4  # of 5: seeds without any collapse indicator
C1_PRUNED_RATIO = 0.5  # pruned |E[L]| <= this x unpruned |E[L]|
BOOTSTRAP = 10_000
# The pre-registered run lengths and seed count (experiments/e004_running_sum.py runs them): a
# unit counts once it has run its full length, and a stage-2/3 arm once all its final seeds have.
GAIN_STEPS = 300
FINAL_STEPS = 300
N_FINAL_SEEDS = 5
# Weakest to strongest; M4 is the synthetic tail-noise rung (configs/e004_running_sum.py).
LEVEL_ORDER = ("M0", "M1", "M2", "M3", "M4")
# Collapse indicators (pre-registered): over the RL steps of one unit, with windows of WINDOW steps.
WINDOW = 50
PPL_FACTOR = 2.0  # mean |log PPL diff| of the last window >= 2x the first window's
GRAD_FACTOR = 3.0  # p95 of grad_norm over the run >= 3x the initial grad norm
ENTROPY_FACTOR = 1.5  # mean entropy of the last window >= 1.5x the first window's (+50%)
INITIAL_STEPS = 5  # "initial" grad norm: median of the first INITIAL_STEPS steps


def _check(name: str, value, threshold, ok: bool, rule: str) -> dict:
    return {"name": name, "value": value, "threshold": threshold, "rule": rule, "pass": bool(ok)}


# ------------------------------------------------------------------------------------------------
# Collapse indicators of one unit.
# ------------------------------------------------------------------------------------------------
def collapse_indicators(
    log_ppl_diff: Sequence[float], grad_norm: Sequence[float], entropy: Sequence[float]
) -> dict:
    """The three collapse indicators of one RL unit, from its per-step series (step order).

    With w = min(WINDOW, steps // 2) (runs shorter than 100 steps use half their length):
    `ppl` fires when mean |log_ppl_diff| over the last w steps >= PPL_FACTOR x that of the first
    w; `grad` when the 95th percentile of grad_norm over the run >= GRAD_FACTOR x the median of
    the first INITIAL_STEPS steps; `entropy` when the mean entropy of the last w steps >=
    ENTROPY_FACTOR x the first w's. `any` is their or. Series too short (< 2 steps) fire nothing.
    """
    out = {}
    n = min(len(log_ppl_diff), len(grad_norm), len(entropy))
    w = min(WINDOW, n // 2)
    if w < 1:
        return {"window": w, "ppl": False, "grad": False, "entropy": False, "any": False}
    lp = np.abs(np.asarray(log_ppl_diff[:n], float))
    first, last = lp[:w].mean(), lp[-w:].mean()
    out["ppl_first"], out["ppl_last"] = float(first), float(last)
    out["ppl"] = bool(last >= PPL_FACTOR * first and last > 0)
    g = np.asarray(grad_norm[:n], float)
    g0 = float(np.median(g[: min(INITIAL_STEPS, n)]))
    out["grad_initial"], out["grad_p95"] = g0, float(np.percentile(g, 95))
    out["grad"] = bool(out["grad_p95"] >= GRAD_FACTOR * g0)
    e = np.asarray(entropy[:n], float)
    out["entropy_first"], out["entropy_last"] = float(e[:w].mean()), float(e[-w:].mean())
    out["entropy"] = bool(out["entropy_last"] >= ENTROPY_FACTOR * out["entropy_first"])
    out["window"] = w
    out["any"] = out["ppl"] or out["grad"] or out["entropy"]
    return out


# ------------------------------------------------------------------------------------------------
# Gates: pure functions of numbers.
# ------------------------------------------------------------------------------------------------
def strongest_level(levels: Mapping[str, dict]) -> str | None:
    """The strongest level among `levels` (M4 > M3 > M2 > M1 > M0), None if none."""
    present = [lv for lv in LEVEL_ORDER if lv in levels]
    return present[-1] if present else None


def power_gate(
    levels: Mapping[str, dict], level: str, gain: Sequence[tuple[float, float]] | None
) -> dict:
    """Power gate from the warm start's sampling statistics and the M0 RLOO pilot run(s).

    Args:
      levels: {level: {"responses", "response_length", "entropy", "seq_log_ratio",
        "seq_log_ratio_outside_share"}} (stage1_levels.json).
      level: the mismatch level the later stages use (the strongest measured); every sampling
        figure is gated under it.
      gain: (start avg@16, final avg@16) of each M0 RLOO pilot unit; None: not run yet.
    Returns:
      {"level", "checks": [...], "pass": True / False / None (incomplete), "missing": [...]}.
    """
    if level not in levels:
        missing = [f"stage 1 sampling at {level}"]
        return {"level": level, "checks": [], "pass": None, "missing": missing}
    s = levels[level]
    checks = [
        _check("responses", s["responses"], 1000, s["responses"] >= 1000, ">="),
        _check(
            "mean_response_length",
            s["response_length"],
            MIN_LENGTH,
            s["response_length"] >= MIN_LENGTH,
            ">=",
        ),
        _check("entropy_nats", s["entropy"], MIN_ENTROPY, s["entropy"] >= MIN_ENTROPY, ">="),
        _check(
            "abs_seq_log_ratio",
            abs(s["seq_log_ratio"]),
            MIN_ABS_SEQ_LOG_RATIO,
            abs(s["seq_log_ratio"]) >= MIN_ABS_SEQ_LOG_RATIO,
            ">=",
        ),
        _check(
            "seq_log_ratio_outside_share",
            s["seq_log_ratio_outside_share"],
            MIN_OUTSIDE_SHARE,
            s["seq_log_ratio_outside_share"] >= MIN_OUTSIDE_SHARE,
            ">=",
        ),
    ]
    missing = []
    if gain:
        d = float(np.mean([f - st for st, f in gain]))
        checks.append(_check("m0_rloo_gain_avg16", d, MIN_GAIN, d >= MIN_GAIN, ">="))
    else:
        missing.append("M0 RLOO gain run")
    failed = any(not c["pass"] for c in checks)
    passed = None if (missing and not failed) else not failed
    return {"level": level, "checks": checks, "pass": passed, "missing": missing}


def premise_gate(
    rloo_level: Sequence[float],
    rloo_m0: Sequence[float],
    fired: Sequence[bool],
    n_seeds: int = N_FINAL_SEEDS,
) -> dict:
    """RLOO at the level ends >= PREMISE_DROP below M0 RLOO (p < PREMISE_P) and collapses.

    The gate reads each arm once all `n_seeds` seeds have finished, with one exception: the
    collapse criterion is a count, so once so many RLOO-at-level seeds have finished without an
    indicator that a majority of `n_seeds` is out of reach even if every remaining seed fired,
    the premise fails whatever those seeds do (`decided_early`; the drop and p over the seeds
    finished so far are reported alongside as `interim`, not as checks).

    Args:
      rloo_level: final avg@16 of RLOO at the level, one per finished seed.
      rloo_m0: final avg@16 of M0 RLOO, one per finished seed.
      fired: per finished RLOO-at-level seed, whether any collapse indicator fired.
      n_seeds: the pre-registered number of seeds per arm.
    """
    if len(fired) != len(rloo_level):
        raise ValueError(f"{len(fired)} indicator flags for {len(rloo_level)} RLOO seeds")
    n_seeds = max(n_seeds, len(rloo_level))  # a sweep run with more seeds than registered
    n_fired = int(sum(bool(f) for f in fired))
    majority = n_seeds // 2 + 1
    collapse = _check(
        "seeds_with_collapse_indicator",
        n_fired,
        f">= {majority} of {n_seeds}",
        n_fired >= majority,
        "majority",
    )
    quiet = len(fired) - n_fired
    if len(rloo_level) < n_seeds and n_seeds - quiet < majority:
        out = {"checks": [collapse], "pass": False, "missing": []}
        out["decided_early"] = (
            f"{quiet} of {len(fired)} finished seeds without a collapse indicator: "
            f"a majority of {n_seeds} is out of reach"
        )
        if len(rloo_level) >= 2 and len(rloo_m0) >= 2:
            out["interim"] = {
                "seeds": [len(rloo_level), len(rloo_m0)],
                "drop_vs_m0_rloo": float(np.mean(rloo_m0) - np.mean(rloo_level)),
                "one_sided_p": welch_one_sided_p(rloo_level, rloo_m0),
            }
        return out
    if len(rloo_level) < n_seeds or len(rloo_m0) < n_seeds:
        return {"checks": [], "pass": None, "missing": [f"stage 2 units ({n_seeds} seeds each)"]}
    drop = float(np.mean(rloo_m0) - np.mean(rloo_level))
    p = welch_one_sided_p(rloo_level, rloo_m0)
    checks = [
        _check("drop_vs_m0_rloo", drop, PREMISE_DROP, drop >= PREMISE_DROP, ">="),
        _check("one_sided_p", p, PREMISE_P, p < PREMISE_P, "<"),
        collapse,
    ]
    return {"checks": checks, "pass": all(c["pass"] for c in checks), "missing": []}


def c1_gate(
    methods: Mapping[str, dict], rloo_m0: Sequence[float], min_clean: int = C1_MIN_CLEAN_SEEDS
) -> dict:
    """C1 stability of DVP and MIS+DVP.

    Args:
      methods: {"dvp": {...}, "mis_dvp": {...}}, each with "final" (avg@16 per seed), "fired"
        (any indicator per seed), "abs_L_pruned" and "abs_L_unpruned" (mean |E[L]| of the
        pruned objective and unpruned, over the unit's RL steps, per seed).
      rloo_m0: final avg@16 of M0 RLOO per seed.
    """
    if not rloo_m0 or any(m not in methods or not methods[m]["final"] for m in ("dvp", "mis_dvp")):
        return {"checks": [], "pass": None, "missing": ["stage 3 units (dvp, mis_dvp, M0 rloo)"]}
    ref = float(np.mean(rloo_m0))
    checks = []
    for m in ("dvp", "mis_dvp"):
        d = methods[m]
        gap = float(np.mean(d["final"])) - ref
        clean = int(sum(not f for f in d["fired"]))
        ratio = float(np.mean(d["abs_L_pruned"]) / max(np.mean(d["abs_L_unpruned"]), 1e-12))
        checks += [
            _check(f"{m}_minus_m0_rloo", gap, -C1_TOLERANCE, gap >= -C1_TOLERANCE, ">="),
            _check(
                f"{m}_seeds_without_indicator",
                clean,
                f">= {min_clean} of {len(d['fired'])}",
                clean >= min_clean,
                ">=",
            ),
            _check(
                f"{m}_pruned_over_unpruned_abs_L",
                ratio,
                C1_PRUNED_RATIO,
                ratio <= C1_PRUNED_RATIO,
                "<=",
            ),
        ]
    return {"checks": checks, "pass": all(c["pass"] for c in checks), "missing": []}


def _bootstrap(a, b, n: int = BOOTSTRAP, seed: int = 0) -> dict:
    """Percentile bootstrap of mean(a) - mean(b) and mean(a) / mean(b) - 1 (each group resampled
    with replacement on its own), `n` resamples, a fixed seed."""
    rng = np.random.default_rng(seed)
    a, b = np.asarray(a, float), np.asarray(b, float)
    ma = a[rng.integers(0, len(a), (n, len(a)))].mean(1)
    mb = b[rng.integers(0, len(b), (n, len(b)))].mean(1)
    diff = ma - mb
    rel = np.where(mb > 0, ma / np.where(mb > 0, mb, 1.0) - 1, np.nan)
    q = lambda x: [float(v) for v in np.nanpercentile(x, [2.5, 97.5])]
    mean_b = b.mean()
    return {
        "diff": float(a.mean() - mean_b),
        "diff_ci95": q(diff),
        "relative": float(a.mean() / mean_b - 1) if mean_b > 0 else None,
        "relative_ci95": q(rel) if np.isfinite(rel).any() else None,
    }


def c2_gate(finals: Mapping[str, Sequence[float]]) -> dict:
    """C2 ordering: MIS+DVP minus the best (by mean final avg@16) of RLOO, TIS, MIS.

    Args:
      finals: {method: final avg@16 per seed} at the level, for "mis_dvp", "rloo", "tis", "mis".
    """
    base = [m for m in ("rloo", "tis", "mis") if finals.get(m)]
    if not finals.get("mis_dvp") or len(base) < 3:
        return {"checks": [], "pass": None, "missing": ["stage 3 units (rloo, tis, mis, mis_dvp)"]}
    best = max(base, key=lambda m: float(np.mean(finals[m])))
    bs = _bootstrap(finals["mis_dvp"], finals[best])
    lo = bs["diff_ci95"][0]
    checks = [_check(f"mis_dvp_minus_{best}_ci95_low", lo, 0.0, lo > 0, ">")]
    return {"best_unpruned": best, **bs, "checks": checks, "pass": lo > 0, "missing": []}


def verdict(power: dict, premise: dict, c1: dict, c2: dict) -> str:
    """The e004 verdict string from the four gates (each `pass` True, False or None)."""
    if power["pass"] is False:
        return "no power"
    if power["pass"] is None:
        return "incomplete: stage 1 (power gate: " + ", ".join(power["missing"]) + ")"
    if premise["pass"] is False:
        return "premise does not reproduce"
    if premise["pass"] is None:
        return "incomplete: stage 2 (premise)"
    if c1["pass"] is False or c2["pass"] is False:
        return "claim refuted at this scale"
    if c1["pass"] is None or c2["pass"] is None:
        return "incomplete: stage 3 (C1, C2)"
    return "claim reproduces"


# ------------------------------------------------------------------------------------------------
# Reading the stage results and writing verdict.json.
# ------------------------------------------------------------------------------------------------
def load_units(out: str) -> list[dict]:
    """Every units/<unit>.json under `out` (one RL unit each)."""
    base = os.path.join(out, "units")
    units = []
    for name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        if name.endswith(".json"):
            with open(os.path.join(base, name)) as fh:
                units.append(json.load(fh))
    return units


def _name(unit: dict) -> str:
    """A unit record's name (its seed when the record has none)."""
    return str(unit.get("unit", unit["seed"]))


def gates_from_results(levels: Mapping[str, dict], units: Sequence[dict]) -> dict:
    """All four gates and the verdict from stage1_levels.json's levels and the unit records."""
    level = strongest_level({k: v for k, v in levels.items() if k != "M0"}) or "M1"
    length = {"gain": GAIN_STEPS, "final": FINAL_STEPS}
    in_progress = sorted(
        f"{_name(u)}: step {u['steps']} of {length[u['role']]}"
        for u in units
        if u["role"] in length and u["steps"] < length[u["role"]]
    )
    units = [u for u in units if u["role"] in length and u["steps"] >= length[u["role"]]]
    pilots = [u for u in units if u["role"] == "gain"]
    precise = [u for u in pilots if u.get("eval_responses", 0) >= MIN_GAIN_EVAL_RESPONSES]
    gain = [(u["start_acc"], u["final_acc"]) for u in precise]
    power = power_gate(levels, level, gain or None)
    if len(precise) < len(pilots):
        power["gain_units_excluded"] = sorted(
            f"{_name(u)}: {u.get('eval_responses', 'unknown')} eval responses "
            f"(< {MIN_GAIN_EVAL_RESPONSES})"
            for u in pilots
            if u not in precise
        )
    final = [u for u in units if u["role"] == "final"]

    def arm(method: str, lv: str) -> list[dict]:
        """An arm's finished units."""
        return [u for u in final if u["method"] == method and u["level"] == lv]

    def pick(method: str, lv: str) -> list[dict]:
        """An arm's finished units, once all N_FINAL_SEEDS of them have finished."""
        done = arm(method, lv)
        return done if len(done) >= N_FINAL_SEEDS else []

    m0 = [u["final_acc"] for u in pick("rloo", "M0")]
    # The premise reads partial arms too: its collapse count can be decided before all seeds end.
    rl = arm("rloo", level)
    premise = premise_gate(
        [u["final_acc"] for u in rl],
        [u["final_acc"] for u in arm("rloo", "M0")],
        [u["indicators"]["any"] for u in rl],
    )
    methods = {
        m: {
            "final": [u["final_acc"] for u in pick(m, level)],
            "fired": [u["indicators"]["any"] for u in pick(m, level)],
            "abs_L_pruned": [u["abs_seq_log_ratio_pruned"] for u in pick(m, level)],
            "abs_L_unpruned": [u["abs_seq_log_ratio"] for u in pick(m, level)],
        }
        for m in ("dvp", "mis_dvp")
    }
    c1 = c1_gate(methods, m0)
    c2 = c2_gate(
        {m: [u["final_acc"] for u in pick(m, level)] for m in ("rloo", "tis", "mis", "mis_dvp")}
    )
    return {
        "level": level,
        "power": power,
        "premise": premise,
        "c1": c1,
        "c2": c2,
        "in_progress": in_progress,
        "verdict": verdict(power, premise, c1, c2),
    }


def read_levels(out: str) -> dict:
    """The levels of stage1_levels.json under `out` ({} before stage 1 has run)."""
    path = os.path.join(out, "stage1_levels.json")
    if not os.path.exists(path):
        return {}
    with open(path) as fh:
        return json.load(fh)["levels"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="experiments/results/e004", help="the e004 results folder")
    args = p.parse_args(argv)
    levels, units = read_levels(args.out), load_units(args.out)
    result = gates_from_results(levels, units)
    # What the records show, beside the decision (which the gates above made).
    result["reading"] = reading(levels, units, result["level"])
    with open(os.path.join(args.out, "verdict.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    print(json.dumps({"level": result["level"], "verdict": result["verdict"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
