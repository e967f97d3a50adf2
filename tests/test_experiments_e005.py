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
from tests.helpers import assert_close_tree


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


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """The whole pipeline at CI sizes (random init, 2 prompts x 2 responses of <= 17 tokens)."""
    from experiments import e005_mechanism as mech

    base = tmp_path_factory.mktemp("e005")
    root, out = str(base / "root"), str(base / "out")
    assert mech.main(["--smoke", "--root", root, "--out", out]) == 0
    return root, out


def test_smoke_pipeline_records_and_verdict(smoke):
    import json
    import os

    from experiments import e005_gradients as grads

    root, out = smoke
    units = v.load_units(out)
    assert {"sample_M0_c0", "sample_M1_c0", "grad_M0_c0", "grad_M1_c0", "grad_M1"} <= set(units)
    with open(os.path.join(out, "verdict.json")) as fh:
        written = json.load(fh)
    assert set(written["claims"]) == {"1", "2_selection", "2_accumulation", "3"}
    assert "sample_M1_c3" in written["missing_units"]  # the registered sizes: incomplete
    # Every sampled response token is in exactly one bin and one prefix sum of the last T.
    rec = units["sample_M1_c0"]
    with np.load(os.path.join(root, "samples", "M1_c0.npz")) as f:
        tokens = int(f["response_mask"].sum())
    assert np.sum(rec["bins"]["sampled"]["count"]) == tokens
    assert np.sum(np.asarray(rec["accumulation"]["D"]["n"])[:, -1]) == tokens
    assert {"sampled", "sampled_tf", "reference"} <= set(rec["bins"])
    ratio = np.asarray(rec["bins"]["sampled_tf"]["within_exact"]).sum()
    assert ratio == np.sum(rec["bins"]["sampled_tf"]["count"])  # E10 holds for every token
    # The same reading at the smoke's sizes: each status is its rule applied to the records.
    res = v.verdict_from_units(units, chunks=1, min_a=0, min_d=0)
    fig = v.rung_figures(v.merge_chunks([rec]))
    c1 = res["claims"]["1"]["per_rung"].get("M1")
    if fig["head_abs"] is None or fig["tail_abs"] is None:  # a random init has no p > 0.9
        assert c1 is None
    else:
        assert c1 == v.claim1(fig["head_abs"], fig["tail_abs"])
    sel = res["claims"]["2_selection"]["per_rung"]["M1"]
    assert sel == v.claim2_selection(fig["tail"], fig["control"])
    c3 = res["claims"]["3"]["per_rung"]["M1"]
    assert c3 == v.claim3(units["grad_M1"]["T"])
    acc = res["claims"]["2_accumulation"]["per_rung"]["M1"]
    assert acc["b_per_token"] == pytest.approx(
        np.sum(rec["bins"]["sampled"]["sum"]) / tokens, rel=1e-6
    )
    for t in v.T_GRID:
        row = units["grad_M1"]["T"][str(t)]
        assert set(v.METHODS) <= set(row) and math.isfinite(row["dvp_objective"]["B2"])
    m0 = grads.combine(root, "M0", 1, samples=2)  # M0 against itself: no pruned sample
    assert set(m0["T"]["48"]) & set(v.METHODS) == {"rloo"}


def test_gradient_sketch_equals_the_sketched_library_vjp():
    """The closed-form unembedding gradient, sketched, against the sketch of the VJP of the
    library's chunked log-probs (pruned and full) with respect to W, for random cotangents."""
    import types

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from dvp_jax.dvp.chunked import chunked_token_stats
    from experiments import e005_gradients as grads
    from tests.helpers import padded_batch, tiny_model

    # Built and differentiated under jit: one program each instead of one per operation.
    model = nnx.jit(lambda: tiny_model(tie_embeddings=True))()
    cfg = types.SimpleNamespace(loss=types.SimpleNamespace(temperature=1.0))
    params, sketch, (m_v, m_d) = grads._sketch_fns(model, cfg)
    rng = np.random.default_rng(0)
    tokens, positions, valid = padded_batch(rng, model.cfg.vocab_size, [9, 12], 12)
    c_pruned, c_full = (jnp.asarray(rng.normal(size=(2, 2, 11)), jnp.float32) for _ in "ab")
    got = np.asarray(sketch(params, tokens, positions, valid, c_pruned, c_full))

    @nnx.jit
    def library_vjp(model, tokens, positions, valid, c_pruned, c_full):  # [C, d, V]
        h = model(tokens, positions, valid, return_hidden=True)[:, :-1].reshape(22, -1)
        y = tokens[:, 1:].reshape(22)

        def logps(w):
            tl = chunked_token_stats(h, w, y, log_rho=-13.0)[0]
            return tl.logp, tl.logp_full

        _, vjp = jax.vjp(logps, model.unembedding())
        return jnp.stack([vjp((c_pruned[c].reshape(22), c_full[c].reshape(22)))[0] for c in (0, 1)])

    dws = np.asarray(library_vjp(model, tokens, positions, valid, c_pruned, c_full))
    for c in range(2):
        want = (m_d.T @ dws[c] @ m_v).T.reshape(-1)  # [K_V, K_D] flattened
        np.testing.assert_allclose(got[c], want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


def test_prefix_reward_counts_correct_steps_in_order():
    from experiments.e005_gradients import prefix_reward

    words = "+ 12 = 12 kobe + 7 = 19 babe".split()
    assert prefix_reward(words, [12, 7]) == 1.0
    assert prefix_reward(words[:5], [12, 7]) == 0.5
    assert prefix_reward("+ 11 = 11 + 7 = 18".split(), [12, 7]) == 0.0
    assert prefix_reward("+ 12 = 12 + 7 = 20".split(), [12, 7]) == 0.5


def test_centred_interval_covers_a_zero_bias_where_the_first_did_not():
    """e005_coverage at small sizes: the first interval (percentiles of resampled corrected
    norms) almost never contains a zero bias once the noise term dominates; the centred one
    does, at about its level (a fixed seed; 60 draws, so the bound is loose)."""
    from experiments.e005_coverage import simulate

    out = simulate(reps=60, groups=64, dim=128, boot=200, spectrum="flat")
    assert out["first_contains_0"] <= 0.2
    assert out["centred_contains_0"] >= 0.88
    hit = simulate(reps=20, groups=64, dim=128, boot=200, spectrum="flat", bias_sq=64.0)
    assert hit["centred_lower_above_0"] >= 0.9  # a bias well above the noise is detected


@pytest.mark.committed_results
def test_committed_verdict_follows_from_the_committed_records():
    """results/e005/verdict.json (outcomes and reading) is what the rules and the reading give
    on results/e005/units: rerunning `e005_verdict` would not change it, up to another machine's
    rounding (tests.helpers' RESULT_RTOL / RESULT_ATOL; labels and sentences exactly)."""
    import json
    import os

    from experiments.e005_reading import reading

    out = os.path.join(os.path.dirname(__file__), "..", "experiments", "results", "e005")
    units = v.load_units(out)
    result = v.verdict_from_units(units)
    result["reading"] = reading(result, units, v)
    with open(os.path.join(out, "verdict.json")) as fh:
        assert_close_tree(json.loads(json.dumps(result)), json.load(fh))
    assert result["reading"]["3"]["per_rung"]["M3"]["corrected_gate"] is False
    # Where RLOO's bias is floored is read from the records, rung by rung (bf16 differs).
    floors = result["reading"]["2_accumulation"]["could_detect"]
    assert "T = 96, 192 at M1, M2, M3, M4" in floors and "T = 48, 96 at bf16" in floors
