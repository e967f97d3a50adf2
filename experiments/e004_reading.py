"""What e004's stage-2 records show, recomputed from results/e004/units/*.json and stage 1.

The pre-registered gates (experiments/e004_verdict.py) decided "premise does not reproduce"
because no collapse indicator fired. This module reads the same records for what they do show
and writes it into verdict.json as `reading`, beside the recorded decision (which it does not
change): each arm's gain from the common start, the drop and its Welch and paired one-sided p,
where M4's accuracy stalled, why the collapse indicators could hardly fire (the PPL rule's first
window holds M4's largest mismatch; the gradient norms sit far below Adam's clip), the upper
confidence bound on a per-seed collapse probability after zero collapses, and how M4 compares
per token with the real rungs M1-M3. It adds no threshold and reruns nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from experiments.stats import (
    paired_one_sided_p,
    welch_interval,
    welch_one_sided_p,
    zero_event_upper_bound,
)

LABEL = (
    "collapse not observed within 300 steps; RLOO at M4's mean gain was about half of M0's, "
    "but the drop's 95% interval includes 0 (3 seeds); M4 is synthetic and far larger than the "
    "real rungs; underpowered for the paper's premise"
)
CONFIDENCE = 0.95  # of the upper bound on the per-seed collapse probability
REAL_RUNGS = ("M1", "M2", "M3")


def _mean_eval(units: Sequence[dict], step: int) -> float | None:
    vals = [a for u in units for s, a in u["evals"] if s == step]
    return float(np.mean(vals)) if len(vals) == len(units) else None


def reading(levels: Mapping[str, dict], units: Sequence[dict], level: str = "M4") -> dict:
    """The reading of the stage-2 records at `level` against M0 RLOO (seed-matched)."""
    final = [u for u in units if u["role"] == "final" and u["method"] == "rloo"]
    by_seed = {lv: {u["seed"]: u for u in final if u["level"] == lv} for lv in (level, "M0")}
    seeds = sorted(set(by_seed[level]) & set(by_seed["M0"]))
    if len(seeds) < 2:
        return {"label": None, "missing": "fewer than 2 seeds with both arms"}
    need = ("start_acc", "final_acc", "evals", "indicators", "curves")
    lacking = sorted({k for u in final for k in need if k not in u})
    if lacking:
        return {"label": None, "missing": f"record fields {lacking}"}
    arm = {lv: [by_seed[lv][s] for s in seeds] for lv in (level, "M0")}
    acc = {lv: [u["final_acc"] for u in arm[lv]] for lv in arm}
    start = float(np.mean([u["start_acc"] for u in arm["M0"]]))
    gain = {lv: float(np.mean(acc[lv]) - start) for lv in arm}
    ind = [u["indicators"] for u in arm[level]]
    grad = np.concatenate([u["curves"]["grad_norm"] for u in final])
    ent_margin = [i["entropy_last"] / i["entropy_first"] / 1.5 - 1 for i in ind]
    per_token = {
        lv: abs(s["seq_log_ratio"]) / s["response_length"]
        for lv, s in levels.items()
        if lv in (*REAL_RUNGS, level)
    }
    real = [per_token[lv] for lv in REAL_RUNGS if lv in per_token]
    sm = levels.get(level, {})
    sigma = float(sm.get("noise_std", 0.0))
    return {
        "label": LABEL,
        "seeds": seeds,
        "common_start_acc": start,
        "mean_final_acc": {lv: float(np.mean(acc[lv])) for lv in acc},
        "gain_from_common_start": gain,
        "share_of_m0_gain_kept": gain[level] / gain["M0"] if gain["M0"] > 0 else None,
        "drop_vs_m0_rloo": float(np.mean(acc["M0"]) - np.mean(acc[level])),
        "welch_one_sided_p": welch_one_sided_p(acc[level], acc["M0"]),
        "paired_one_sided_p": paired_one_sided_p(acc[level], acc["M0"]),
        "drop_ci95_welch": list(welch_interval(acc["M0"], acc[level])),
        "fell_after_step_200_per_seed": {
            str(s): dict(u["evals"]).get(300, math.nan) < dict(u["evals"]).get(200, math.nan)
            for s, u in zip(seeds, arm[level], strict=True)
        },
        "mean_acc_by_step": {
            lv: {str(s): _mean_eval(arm[lv], s) for s in (100, 200, 300)} for lv in arm
        },
        "ppl_rule_first_last_window": [[i["ppl_first"], i["ppl_last"]] for i in ind],
        "ppl_fell_in_every_seed": all(i["ppl_last"] < i["ppl_first"] for i in ind),
        "grad_norm_p5_p95_all_final_runs": [float(v) for v in np.percentile(grad, [5, 95])],
        "grad_clip": 1.0,
        "entropy_rule_margin_per_seed": ent_margin,  # last / first / 1.5 - 1: >= 0 fires
        "collapses": int(sum(i["any"] for i in ind)),
        "collapse_probability_upper_bound": zero_event_upper_bound(len(seeds), CONFIDENCE)
        if not any(i["any"] for i in ind)
        else None,
        "collapse_bound_confidence": CONFIDENCE,
        "abs_E_L_per_token": per_token,
        "per_token_ratio_to_real_rungs": [
            per_token[level] / max(real),
            per_token[level] / min(real),
        ]
        if real and level in per_token
        else None,
        "tail_noise_std": sigma,
        "lognormal_factor_mean": math.exp(sigma**2 / 2),  # E[exp(sigma n)], n ~ N(0, 1)
        "share_of_E_L_inside_safe_set": 1.0 - float(sm.get("seq_log_ratio_outside_share", 0.0)),
        "share_dvp_could_remove_at_most": float(sm.get("seq_log_ratio_outside_share", 0.0)),
    }
