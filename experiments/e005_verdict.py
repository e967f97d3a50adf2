"""e005 decision rules: reads results/e005/units/*.json and writes results/e005/verdict.json.

Committed before any e005 data (the commit order is the evidence). Each rule is a pure function
of the figures below; tests/test_experiments_e005.py checks each passing and failing.

Records (written by experiments/e005_mechanism.py): `sample_<rung>_c<k>.json`, one chunk of
64 prompts x 16 responses sampled from the warm start at a rung, with per-prompt-group sums per
trainer-probability bin of d = log mu - log pi (engine-recorded log mu of the sampled tokens,
`sampled`; the same tokens through the rollout path teacher-forced, `sampled_tf`, with E10's
eps; reference tokens teacher-forced on both sides, `reference`, the control) and per-group sums
of D_T = sum_{t <= T} d_t (L_T = -D_T); `grad_<rung>.json`, the coupled gradient statistics.
A figure's s.e. is clustered by prompt group (groups are independent; tokens are not).

Rules (pre-registered), per rung; a claim's overall status reads the real rungs M1-M3 (`REAL`): it
holds where it holds at >= 2 of them, is refuted where it fails at >= 2 (bf16 is reported beside
them, M4 is the positive control and never counts).
* claim 1 ((1 - p) shape): holds if mean |d| of sampled tokens with p > 0.9 <= 0.2x that with
  p < 1e-3; refuted if the head's >= the tail's; else inconclusive.
* claim 2, selection: holds if every tail bin (p < 1e-3, >= MIN_BIN_TOKENS tokens) has d > 0
  with its 95% CI excluding 0, and every tail bin of the teacher-forced control lies within
  +-2 s.e. of 0; else fails.
* claim 2, accumulation: holds if b (mean d per sampled token, so E[D_T] ~ b T) has a 95% CI
  excluding 0 and the sign of the pooled tail d, RLOO's relative gradient bias grows with T
  (log-log slope over T_GRID >= 0.5) and >= half of its bias at the largest T comes from tokens
  outside the e^-13 safe set; `immaterial` when |b| x 16,384 < 0.5 nats at every real rung.
* claim 3: judged at a rung only where RLOO's bias at the largest T is non-zero (CI above 0);
  holds if DVP's objective bias is within its bound (e003's B2 + 2 s.e.) at every T, DVP's
  relative gradient bias < 0.5x RLOO's at the largest T and MIS+DVP has the lowest MSE there;
  refuted if DVP's relative bias >= RLOO's at every T.
* stage E (only if both parts of claim 2 hold): 5 seeds x 1,000 RL steps per arm; a run
  collapses when its held-out avg@16 falls >= 0.05 below its own running maximum (`collapsed`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Mapping, Sequence

import numpy as np

from experiments.e005_reading import reading

# ------------------------------------------------------------------------------------------------
# Design and thresholds (pre-registered).
# ------------------------------------------------------------------------------------------------
RUNGS = ("bf16", "M1", "M2", "M3", "M4")  # M4: the synthetic positive control
REAL = ("M1", "M2", "M3")
T_GRID = (48, 96, 192)
P_EDGES = (0.0, 1e-4, 1e-3, 1e-2, 0.1, 0.5, 0.9, 1.0 + 1e-9)
TAIL_P, HEAD_P = 1e-3, 0.9
CHUNKS = 4  # sample chunks per rung: 4 x 1,024 = 4,096 responses (claim A's minimum)
REF_CHUNKS = 2  # M0 (fp32, the reference of the gradients): 2,048
MIN_RESPONSES_A, MIN_RESPONSES_D = 4096, 2048
MIN_BIN_TOKENS = 100
CLAIM1_RATIO = 0.2
Z95 = 1.959964
CONTROL_SE = 2.0
MIN_BIAS_SLOPE = 0.5
MIN_OUTSIDE_SHARE = 0.5
PAPER_LENGTH = 16_384
IMMATERIAL_NATS = 0.5
DVP_OVER_RLOO = 0.5
METHODS = ("rloo", "tis", "mis", "dvp", "mis_dvp")
E_SEEDS, E_STEPS, COLLAPSE_DROP = 5, 1000, 0.05


# ------------------------------------------------------------------------------------------------
# Pooled figures from per-group sums.
# ------------------------------------------------------------------------------------------------
def pooled(count, total) -> tuple[float | None, float | None]:
    """Ratio mean sum(total) / sum(count) over groups and its group-clustered s.e."""
    c, s = np.asarray(count, float), np.asarray(total, float)
    n, g = c.sum(), len(c)
    if n <= 0:
        return None, None
    m = s.sum() / n
    se = math.sqrt(g / max(g - 1, 1) * float(((s - m * c) ** 2).sum())) / n if g > 1 else None
    return float(m), se


def bin_table(part: Mapping[str, list], edges=P_EDGES) -> list[dict]:
    """Per bin: tokens, mean d and its s.e., mean |d| (and |d| / eps, E10's bound if recorded).

    `part`: {"count", "sum", "sum_abs", ...}: [groups, bins] sums of 1, d, |d|, ... per group."""
    cnt = np.asarray(part["count"], float)  # [groups, bins]
    rows = []
    for j in range(len(edges) - 1):
        m, se = pooled(cnt[:, j], np.asarray(part["sum"])[:, j])
        row = {"p_lo": edges[j], "p_hi": min(edges[j + 1], 1.0), "count": int(cnt[:, j].sum())}
        row |= {"mean_d": m, "se": se}
        row["mean_abs_d"] = pooled(cnt[:, j], np.asarray(part["sum_abs"])[:, j])[0]
        for key in ("sum_abs_over_eps", "sum_first_order_bound", "within_exact"):
            if key in part:
                row[key.removeprefix("sum_")] = pooled(cnt[:, j], np.asarray(part[key])[:, j])[0]
        rows.append(row)
    return rows


def _pool_bins(part, lo: float, hi: float, key: str = "sum"):
    sel = [j for j in range(len(P_EDGES) - 1) if P_EDGES[j] >= lo and P_EDGES[j + 1] <= hi]
    c = np.asarray(part["count"], float)[:, sel].sum(1)
    return pooled(c, np.asarray(part[key], float)[:, sel].sum(1))


def merge_chunks(records: Sequence[dict]) -> dict:
    """One rung's sample chunks as one record: the per-group arrays concatenated."""
    out = {"rung": records[0]["rung"], "responses": sum(r["responses"] for r in records)}
    for section in ("bins", "accumulation"):
        out[section] = {}
        for part, fields in records[0][section].items():
            if not isinstance(fields, dict):
                out[section][part] = fields
                continue
            out[section][part] = {
                k: [row for r in records for row in r[section][part][k]] for k in fields
            }
    return out


# ------------------------------------------------------------------------------------------------
# The rules: pure functions of the figures.
# ------------------------------------------------------------------------------------------------
def claim1(head_abs: float, tail_abs: float) -> dict:
    """(1 - p) shape at one rung: head (p > 0.9) against tail (p < 1e-3) mean |d|."""
    status = "holds" if head_abs <= CLAIM1_RATIO * tail_abs else "inconclusive"
    if head_abs >= tail_abs:
        status = "refuted"
    ratio = head_abs / tail_abs if tail_abs > 0 else math.inf
    return {"head_abs_d": head_abs, "tail_abs_d": tail_abs, "ratio": ratio, "status": status}


def claim2_selection(tail_bins: Sequence[dict], control_bins: Sequence[dict]) -> dict:
    """Selection at one rung: each tail bin's d > 0 (95% CI) and the control within 2 s.e."""
    tail = [b for b in tail_bins if b["count"] >= MIN_BIN_TOKENS and b["se"] is not None]
    ctrl = [b for b in control_bins if b["count"] >= MIN_BIN_TOKENS and b["se"] is not None]
    positive = bool(tail) and all(b["mean_d"] - Z95 * b["se"] > 0 for b in tail)
    control = bool(ctrl) and all(abs(b["mean_d"]) <= CONTROL_SE * b["se"] for b in ctrl)
    return {
        "tail_d": [[b["mean_d"], b["se"]] for b in tail],
        "control_d": [[b["mean_d"], b["se"]] for b in ctrl],
        "tail_positive": positive,
        "control_null": control,
        "status": "holds" if positive and control else "fails",
    }


def loglog_slope(ts: Sequence[float], ys: Sequence[float]) -> float | None:
    """Least-squares slope of log y on log T (None if any y <= 0)."""
    if any(y is None or y <= 0 for y in ys):
        return None
    return float(np.polyfit(np.log(ts), np.log(ys), 1)[0])


def claim2_accumulation(b: float, b_se: float, tail_sign: float, rloo_bias, outside_share):
    """Accumulation at one rung. rloo_bias: RLOO's relative bias per T of T_GRID; outside_share:
    the share of RLOO's bias from tokens outside the safe set at the largest T."""
    nonzero = abs(b) > Z95 * b_se
    same_sign = bool(np.sign(b) == np.sign(tail_sign)) and tail_sign != 0
    slope = loglog_slope(T_GRID, rloo_bias)
    grows = slope is not None and slope >= MIN_BIAS_SLOPE
    outside = outside_share is not None and outside_share >= MIN_OUTSIDE_SHARE
    return {
        "b_per_token": b,
        "b_se": b_se,
        "b_times_16384": b * PAPER_LENGTH,
        "immaterial": abs(b) * PAPER_LENGTH < IMMATERIAL_NATS,
        "rloo_rel_bias_by_T": list(rloo_bias),
        "rloo_bias_loglog_slope": slope,
        "rloo_outside_share_largest_T": outside_share,
        "status": "holds" if nonzero and same_sign and grows and outside else "fails",
    }


def claim3(per_t: Mapping[str, dict]) -> dict:
    """DVP against RLOO at one rung from the gradient record's per-T figures."""
    ts = [str(t) for t in T_GRID]
    last = per_t[ts[-1]]
    if last["rloo"]["rel_bias_ci95"][0] <= 0:
        return {"status": "no bias to remove", "rloo_rel_bias_ci95": last["rloo"]["rel_bias_ci95"]}
    obj = [per_t[t]["dvp_objective"] for t in ts]
    within = all(abs(o["delta"]) <= o["B2"] + 2 * o["se"] for o in obj)
    dvp, rloo = (
        [per_t[t]["dvp"]["rel_bias"] for t in ts],
        [per_t[t]["rloo"]["rel_bias"] for t in ts],
    )
    below = dvp[-1] < DVP_OVER_RLOO * rloo[-1]
    mse = {m: last[m]["mse"] for m in METHODS}
    lowest = min(mse, key=mse.get) == "mis_dvp"
    status = "holds" if within and below and lowest else "inconclusive"
    if all(d >= r for d, r in zip(dvp, rloo, strict=True)):
        status = "refuted"
    return {
        "dvp_within_bound_every_T": within,
        "dvp_rel_bias_by_T": dvp,
        "rloo_rel_bias_by_T": rloo,
        "dvp_below_half_rloo_largest_T": below,
        "mse_largest_T": mse,
        "mis_dvp_lowest_mse": lowest,
        "status": status,
    }


def overall(per_rung: Mapping[str, dict], positive: str = "holds") -> str:
    """A claim's status over the real rungs: `positive` at >= 2, refuted at >= 2 failures."""
    st = [per_rung[r]["status"] for r in REAL if r in per_rung]
    if len(st) < len(REAL):
        return "incomplete"
    if st.count(positive) >= 2:
        return "holds"
    if sum(s in ("fails", "refuted") for s in st) >= 2:
        return "refuted at this scale"
    return "inconclusive"


def collapsed(evals: Sequence[Sequence[float]]) -> bool:
    """Stage E's collapse: a held-out avg@16 >= COLLAPSE_DROP below the run's running maximum."""
    best = -math.inf
    for _, acc in evals:
        if acc <= best - COLLAPSE_DROP:
            return True
        best = max(best, acc)
    return False


# ------------------------------------------------------------------------------------------------
# Reading the units and writing verdict.json.
# ------------------------------------------------------------------------------------------------
def expected_units() -> list[str]:
    names = [f"sample_{r}_c{k}" for r in RUNGS for k in range(CHUNKS)]
    names += [f"sample_M0_c{k}" for k in range(REF_CHUNKS)]
    # Gradient chunks (64 coupled groups each); `grad_<rung>.json` combines a rung's with M0's.
    return names + [f"grad_{r}_c{k}" for r in ("M0", *RUNGS) for k in range(REF_CHUNKS)]


def load_units(out: str) -> dict[str, dict]:
    base = os.path.join(out, "units")
    names = sorted(os.listdir(base)) if os.path.isdir(base) else []
    units = {}
    for name in names:
        if name.endswith(".json"):
            with open(os.path.join(base, name)) as fh:
                units[name[:-5]] = json.load(fh)
    return units


def rung_figures(rec: dict) -> dict:
    """A merged rung's tables and the rules' inputs from its sample chunks."""
    bins = {k: bin_table(v) for k, v in rec["bins"].items()}
    tail = [b for b in bins["sampled"] if b["p_hi"] <= TAIL_P]
    ctrl = [b for b in bins.get("reference", []) if b["p_hi"] <= TAIL_P]
    acc = rec["accumulation"]
    n, s = np.asarray(acc["D"]["n"], float), np.asarray(acc["D"]["sum"], float)
    b, b_se = pooled(n[:, -1], s[:, -1])  # the last T covers every response token
    head = _pool_bins(rec["bins"]["sampled"], HEAD_P, 2.0, "sum_abs")[0]
    tail_abs = _pool_bins(rec["bins"]["sampled"], 0.0, TAIL_P, "sum_abs")[0]
    tail_d = _pool_bins(rec["bins"]["sampled"], 0.0, TAIL_P)[0]
    return {
        "responses": rec["responses"],
        "bins": bins,
        "tail": tail,
        "control": ctrl,
        "b": b,
        "b_se": b_se,
        "tail_d": tail_d,
        "head_abs": head,
        "tail_abs": tail_abs,
    }


def verdict_from_units(
    units: Mapping[str, dict], chunks: int = CHUNKS, min_a: int = MIN_RESPONSES_A,
    min_d: int = MIN_RESPONSES_D,
) -> dict:  # fmt: skip
    """Every claim's status and figures. `chunks`, `min_a`, `min_d`: the registered sizes (the
    smoke test passes smaller ones to run the same reading on a tiny pipeline)."""
    missing = [n for n in expected_units() if n not in units]
    rungs, claims = {}, {"1": {}, "2_selection": {}, "2_accumulation": {}, "3": {}}
    for r in ("M0", *RUNGS):  # figures from whatever chunks exist; rules on complete rungs
        have = [units[f"sample_{r}_c{k}"] for k in range(chunks) if f"sample_{r}_c{k}" in units]
        if not have:
            continue
        f = rung_figures(merge_chunks(have))
        rungs[r] = {k: f[k] for k in ("responses", "b", "b_se", "tail_d", "head_abs", "tail_abs")}
        rungs[r]["bins"] = f["bins"]
        complete = len(have) == chunks and f["responses"] >= min_a and r != "M0"
        if not complete:
            continue
        if f["head_abs"] is not None and f["tail_abs"] is not None:  # both bins hold tokens
            claims["1"][r] = claim1(f["head_abs"], f["tail_abs"])
        claims["2_selection"][r] = claim2_selection(f["tail"], f["control"])
        g = units.get(f"grad_{r}")
        if g is None or g["responses"] < min_d:
            continue
        per_t = g["T"]
        bias = [per_t[str(t)]["rloo"]["rel_bias"] for t in T_GRID]
        share = per_t[str(T_GRID[-1])]["rloo_outside_share"]
        claims["2_accumulation"][r] = claim2_accumulation(
            f["b"], f["b_se"], f["tail_d"] or 0.0, bias, share
        )
        claims["3"][r] = claim3(per_t)
    result = {"rungs": rungs, "claims": {}, "missing_units": missing}
    for name, per_rung in claims.items():
        entry = {"status": overall(per_rung), "per_rung": per_rung}
        if name == "2_accumulation" and all(r in per_rung for r in REAL):
            entry["immaterial"] = all(per_rung[r]["immaterial"] for r in REAL)
        result["claims"][name] = entry
    c2 = [result["claims"][k]["status"] for k in ("2_selection", "2_accumulation")]
    result["stage_E"] = (
        f"run: {E_SEEDS} seeds x {E_STEPS} RL steps per arm, collapse = held-out avg@16 "
        f">= {COLLAPSE_DROP} below the run's running maximum"
        if c2 == ["holds", "holds"]
        else "not run: claim 2 does not hold (both parts must)"
    )
    return result


def status_line(units: Mapping[str, dict]) -> str:
    done = [n for n in expected_units() if n in units]
    todo = [n for n in expected_units() if n not in units]
    return f"e005: {len(done)} of {len(expected_units())} units done; missing: {', '.join(todo)}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="experiments/results/e005", help="the e005 results folder")
    p.add_argument("--status", action="store_true", help="print progress only")
    args = p.parse_args(argv)
    units = load_units(args.out)
    if args.status:
        print(status_line(units))
        return 0
    result = verdict_from_units(units)
    # What each test could detect, beside the outcomes (which the rules above decided).
    result["reading"] = reading(result, units, sys.modules[__name__])
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "verdict.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    print(json.dumps({k: v["status"] for k, v in result["claims"].items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
