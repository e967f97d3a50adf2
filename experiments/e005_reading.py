"""What e005's records could show, per claim, beside the pre-registered rule outcomes.

The rules (experiments/e005_verdict.py) are kept as registered and their outcomes stay in
verdict.json `claims`. This module reads the same committed records (results/e005/units/*.json)
for what each rule's test could detect, and writes `reading` beside the outcomes: a label per
claim and the figures it rests on. It adds no threshold and reruns nothing. The verdict module
passes its own design constants in (`rules`: RUNGS, REAL, T_GRID, P_EDGES, CHUNKS, REF_CHUNKS),
so this module imports no verdict and the imports run one way (e005_verdict -> e005_reading).

* 2a (selection): the rule compares the sampled tail's d with 0, but the teacher-forced control
  tail (reference tokens mu did not choose) is itself many s.e. below 0: rounding shifts every
  tail token, so the rule could pass only if selection outweighed that shift. The quantity that
  isolates selection is sampled minus reference per bin.
* 2b (accumulation): b = E_mu[log mu - log pi] = KL(mu || pi) >= 0 by construction, so its sign
  re-tests 2a's; the slope rule reads RLOO's relative gradient bias, floored at 0 at two of the
  three T at every rung (which two: `floors_text`), the M4 positive control included: the test
  cannot see its own control.
* 3 (DVP): DVP changes only tokens outside the e^-13 safe set (their share of the sampled tokens
  and of RLOO's bias), so "DVP's bias < 0.5x RLOO's" is out of reach at any number of groups; the
  gate (RLOO's interval above 0) used an interval biased upward (at M3's noise ratios it
  contained a zero bias in none of 400 simulated draws: experiments/e005_coverage.py); an
  interval centred on the corrected estimate has its lower end <= 0 wherever the point estimate
  is floored at 0. The per-group sketches (grads/*.npz)
  were not committed, so the corrected interval elsewhere needs the gradient units rerun.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

LABELS = {
    "1": "holds",
    "2_selection": "sign of d contradicted at the real rungs; selection not resolved by this rule",
    "2_accumulation": "not detectable with this design",
    "3": "not testable at this scale",
}
# experiments/e005_coverage.py, 400 draws each at e005's D (128 groups, 1,024 coordinates, the
# difference's noise term 50x ||E ref||^2): the corrected interval's coverage of a zero bias and
# the smallest ||b||^2 / ||E ref||^2 it detects (lower end above 0) in >= 99% of the draws.
COVERAGE = {
    "first_interval_contains_0": {"power": 0.0, "flat": 0.0, "t3": 0.0125},
    "centred_interval_contains_0": {"power": 0.9875, "flat": 0.965, "t3": 0.9975},
    "detected_bias_sq_over_ref_sq": {"power": 64, "flat": 16},
    "command": "python -m experiments.e005_coverage --reps 400 [--spectrum flat] [--dist t3]",
}


def _diff(a: list, b: list) -> list[float]:
    return [a[0] - b[0], float(np.hypot(a[1], b[1]))]


def selection(rules, claim: Mapping[str, dict], bins: Mapping[str, dict]) -> dict:
    """Per real rung: the control tail's distance from 0 (in s.e.) and sampled - reference."""
    out = {}
    for r in rules.REAL:
        c = claim["per_rung"].get(r)
        b = bins.get(r, {}).get("bins", {})
        if c is None or "reference" not in b:
            continue
        tails = [[row["mean_d"], row["se"]] for row in b["sampled"]]
        refs = [[row["mean_d"], row["se"]] for row in b["reference"]]
        out[r] = {
            "control_tail_se_from_0": [abs(m) / s for m, s in c["control_d"]],
            "sampled_minus_reference_by_bin": [
                _diff(a, x) for a, x in zip(tails, refs, strict=True)
            ],
            "p_edges": list(rules.P_EDGES[:-1]),
        }
    return out


def accumulation(rules, claim: Mapping[str, dict], units: Mapping[str, dict]) -> dict:
    """Per rung: where RLOO's relative bias is floored at 0, and E[D_T] at the last T."""
    out = {}
    for r, c in claim["per_rung"].items():
        recs = [units[f"sample_{r}_c{k}"] for k in range(rules.CHUNKS)]
        s = sum(np.asarray(u["accumulation"]["D"]["sum"])[:, -1].sum() for u in recs)
        n = sum(u["responses"] for u in recs)
        floored = [
            t for t, v in zip(rules.T_GRID, c["rloo_rel_bias_by_T"], strict=True) if v == 0.0
        ]
        out[r] = {"rloo_rel_bias_floored_at_T": floored, "mean_D_last_T_nats": float(s / n)}
    return out


def floors_text(acc: Mapping[str, dict]) -> str:
    """Where RLOO's relative bias is floored at 0, read from `accumulation`'s per-rung lists:
    "at T = 96, 192 at M1, M2, M3, M4; at T = 48, 96 at bf16"."""
    by: dict[tuple, list[str]] = {}
    for r, a in acc.items():
        by.setdefault(tuple(a["rloo_rel_bias_floored_at_T"]), []).append(r)
    parts = [
        f"at T = {', '.join(map(str, ts))} at {', '.join(rs)}"
        if ts
        else f"nowhere at {', '.join(rs)}"
        for ts, rs in sorted(by.items(), key=lambda kv: -len(kv[1]))
    ]
    return "; ".join(parts)


def dvp(rules, claim: Mapping[str, dict], units: Mapping[str, dict]) -> dict:
    """Per rung: DVP's reach (tokens outside the safe set) and the corrected gate, if known."""
    out = {}
    for r in rules.RUNGS:
        g = units.get(f"grad_{r}")
        recs = [units.get(f"sample_{r}_c{k}") for k in range(rules.CHUNKS)]
        if g is None or not all(recs):
            continue
        last = g["T"][str(rules.T_GRID[-1])]
        point = last["rloo"]["rel_bias"]
        rewards = [units[f"grad_{r}_c{k}"] for k in range(rules.REF_CHUNKS)]
        out[r] = {
            "frac_sampled_tokens_outside_safe": float(
                np.mean([u["frac_outside_safe"] for u in recs])
            ),
            "rloo_bias_outside_share_by_T": [
                g["T"][str(t)]["rloo_outside_share"] for t in rules.T_GRID
            ],
            "pruned_minus_unpruned_prefix_reward_by_T": np.mean(
                [
                    np.subtract(
                        u["pruned"]["mean_prefix_reward_by_T"],
                        u["unpruned"]["mean_prefix_reward_by_T"],
                    )
                    for u in rewards
                ],
                axis=0,
            ).tolist()
            if all("pruned" in u for u in rewards)
            else None,
            "registered_gate_fired": claim["per_rung"].get(r, {}).get("status")
            not in (None, "no bias to remove"),
            # An interval centred on a point estimate floored at 0 has its lower end <= 0.
            "corrected_gate": False if point == 0.0 else None,
        }
    return out


def reading(result: Mapping[str, dict], units: Mapping[str, dict], rules) -> dict:
    """The `reading` block of verdict.json from the rule outcomes, the unit records and the
    verdict's design constants (`rules`, the e005_verdict module)."""
    c = result["claims"]
    if result["missing_units"]:
        return {"missing": "incomplete records: the reading needs every registered unit"}
    sel = selection(rules, c["2_selection"], result["rungs"])
    acc = accumulation(rules, c["2_accumulation"], units)
    reach = dvp(rules, c["3"], units)
    ctrl = [x for r in sel.values() for x in r["control_tail_se_from_0"]]
    outside = [reach[r]["frac_sampled_tokens_outside_safe"] for r in rules.REAL if r in reach]
    share = [reach[r]["rloo_bias_outside_share_by_T"][-1] for r in rules.REAL if r in reach]
    m4 = acc.get("M4", {})
    return {
        "1": {
            "rule_outcome": c["1"]["status"],
            "label": LABELS["1"],
            "could_detect": "yes: head/tail |d| ratios far below 0.2 with s.e. far below the "
            "means at 4,096 responses per rung",
        },
        "2_selection": {
            "rule_outcome": c["2_selection"]["status"],
            "label": LABELS["2_selection"],
            "could_detect": "no: the rule needs the control tail within 2 s.e. of 0, but it is "
            f"{min(ctrl):.0f}-{max(ctrl):.0f} s.e. below 0 at every real rung (rounding moves "
            "every tail token), so it could pass only if selection outweighed that shift; "
            "sampled minus reference isolates selection (per rung and bin below)",
            "per_rung": sel,
        },
        "2_accumulation": {
            "rule_outcome": c["2_accumulation"]["status"],
            "label": LABELS["2_accumulation"],
            "could_detect": "no: b = E_mu[log mu - log pi] = KL(mu || pi) >= 0 by construction, "
            "so sign(b) = sign(tail d) re-tests 2a; the slope rule reads RLOO's relative gradient "
            f"bias, floored at 0 {floors_text(acc)}: at two of the three T at every rung, the M4 "
            f"control included (E[D_192] = {m4.get('mean_D_last_T_nats', float('nan')):.0f} nats "
            "there), so no slope over T is read",
            "per_rung": acc,
        },
        "3": {
            "rule_outcome": c["3"]["status"],
            "label": LABELS["3"],
            "could_detect": "no: DVP changes only the "
            f"{100 * min(outside):.3f}-{100 * max(outside):.3f}% of sampled tokens outside the "
            f"safe set, which carry {100 * min(share):.1f}-{100 * max(share):.1f}% of RLOO's "
            "gradient bias at T = 192 at M1-M3, so DVP < 0.5x RLOO's bias is out of reach at any "
            "number of groups; the gate's interval was biased upward (at M3's noise ratios it "
            "contained a zero bias in 0 of 400 simulated draws: coverage below); "
            "centred on the corrected estimate, the gate is false at every rung whose point "
            "estimate is floored at 0, which is every real rung at T = 192",
            "per_rung": reach,
            "interval_coverage": COVERAGE,
        },
    }
