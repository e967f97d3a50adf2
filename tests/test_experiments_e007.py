"""e007 (experiments/e007_verdict.py, e007_gate.py, e007_tail.py, e007_plots.py): the seed count's
power calculation on e006's committed figures, the gate and every pre-registered outcome on
fixture records, the plots and tables on partial data, and the gate's and runner's smoke."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from experiments import e007_verdict as v

ROOT = os.path.join(os.path.dirname(__file__), "..")
SEEDS = v.SEEDS


def _rec(arm, seed, start, growth, acc=(0.1, 0.2), steps=v.STEPS, noise=0.0, control=None):
    rng = np.random.default_rng(seed)
    t = np.arange(1, steps + 1)
    y = start + growth * t / steps + noise * rng.standard_normal(steps)
    rec = {
        "run": f"{arm}_s{seed}",
        "arm": arm,
        "seed": seed,
        "steps": steps,
        "steps_logged": t.tolist(),
        "curves": {v.PRIMARY: y.tolist(), "full_kl_k1_inside": (0.5 * y).tolist()},
        "evals": [[0, acc[0]], [steps, acc[1]]],
    }
    if control is not None:  # (start, growth) of the M3 mismatch on the fp32 arm's weights
        rec["control"] = [
            {"step": s, v.PRIMARY: control[0] + control[1] * s / steps}
            for s in range(0, steps + 1, 20)
        ]
    return rec


def _units(g_m3, methods=None, control_growth=0.0, seeds=SEEDS, noise=None):
    units = {}
    for s in seeds:
        g = g_m3[s] if isinstance(g_m3, list | tuple) else g_m3
        units[f"rloo_fp32_s{s}"] = _rec("rloo_fp32", s, 1e-9, 0.0, control=(1e-3, control_growth))
        units[f"rloo_M3_s{s}"] = _rec("rloo_M3", s, 1e-3, g)
        for arm, gm in (methods or {}).items():
            gm = gm[s] if isinstance(gm, list | tuple) else gm
            units[f"{arm}_s{s}"] = _rec(arm, s, 1e-3, gm)
    return units


GATE_OK = {"outside_share": 0.07, "tail_abs_share": 0.5}


def test_seed_count_is_the_power_calculation_on_e006s_committed_figures():
    with open(os.path.join(ROOT, v.E006_VERDICT)) as fh:
        design = v.design_power(json.load(fh))
    assert design["n_seeds"] == v.N_SEEDS == len(v.SEEDS) >= v.MIN_SEEDS
    assert design["power"] == pytest.approx(v.POWER_AT_N_SEEDS, abs=0.005)
    assert v.paired_t_power(design["effect"], design["sd"], v.N_SEEDS - 1) < v.POWER_TARGET
    # Hand-checked: a paired t-test at d = 1 over 10 pairs has power ~0.80 (two-sided 5%).
    assert v.paired_t_power(1.0, 1.0, 10) == pytest.approx(0.80, abs=0.01)


@pytest.mark.parametrize(
    "gate, status",
    [
        (None, "not measured"),
        (GATE_OK, "passes"),
        ({"outside_share": 0.049, "tail_abs_share": 0.9}, "fails"),
        ({"outside_share": 0.2, "tail_abs_share": 0.29}, "fails"),
    ],
)
def test_gate(gate, status):
    assert v.gate_status(gate) == status


def test_premise_is_measured_against_the_weight_drift_control():
    """RLOO M3 grows by 1e-3 (m0 1e-3). With a flat control the premise appears; with a control
    that grows as much (weights drifting alone), it does not."""
    flat = v.verdict_from_units(_units(1e-3, control_growth=0.0), GATE_OK)
    assert flat["premise"] == "the premise appears at this scale"
    m0 = 1e-3 + 1e-3 * np.mean(np.arange(1, v.START_WINDOW + 1)) / v.STEPS
    assert flat["relative_excess_growth_rloo_M3"]["mean"] == pytest.approx(1e-3 / m0, rel=1e-6)
    drift = v.verdict_from_units(_units(1e-3, control_growth=1e-3), GATE_OK)
    assert drift["premise"] == "the premise does not appear at this scale"
    noisy = v.verdict_from_units(_units([2e-3, -1.5e-3] * 5), GATE_OK)
    assert noisy["premise"] == "inconclusive"
    part = v.verdict_from_units({k: u for k, u in _units(1e-3).items() if "_s9" not in k}, GATE_OK)
    assert part["premise"] == "incomplete"


def test_each_method_outcome_on_paired_fixture_records():
    g = 1e-3
    rng = np.random.default_rng(0)
    wide = (g + 2e-3 * rng.standard_normal(len(SEEDS))).tolist()
    res = v.verdict_from_units(
        _units(
            g,
            {
                "dvp_M3": 0.0,  # removes all of it, every seed
                # +-10% of RLOO's growth around it: rules out removing half
                "mis_dvp_M3": [g * (1 + 0.1 * (-1) ** s) for s in SEEDS],
                "icepop_M3": wide,  # spread over seeds: nothing resolved
            },
        ),
        GATE_OK,
    )
    m = res["methods"]
    assert m["dvp_M3"]["status"] == "removes growth"
    assert m["dvp_M3"]["share_removed"] == pytest.approx(1.0, rel=1e-6)
    assert m["mis_dvp_M3"]["status"] == "does not remove half"
    assert m["icepop_M3"]["status"] == "no effect detectable at this size"
    more = v.verdict_from_units(_units(g, {"dvp_M3": 2 * g}), GATE_OK)
    assert more["methods"]["dvp_M3"]["status"] == "adds growth"
    absent = v.verdict_from_units(_units(g, {"dvp_M3": 0.0}, control_growth=g), GATE_OK)
    assert absent["methods"]["dvp_M3"]["status"] == "premise absent: removes growth"
    assert res["status"]["gate"] == "passes"


def test_tables_and_plots_render_the_verdict_on_partial_data(tmp_path):
    from experiments import e007_plots

    units = _units(1e-3, {"dvp_M3": 0.0}, seeds=(0, 1))
    os.makedirs(tmp_path / "units")
    for name, rec in units.items():
        rec["curves"]["full_kl_k1_outside"] = rec["curves"][v.PRIMARY]
        rec["curves"]["frac_tokens_outside_safe"] = [0.07] * len(rec["steps_logged"])
        (tmp_path / "units" / f"{name}.json").write_text(json.dumps(rec))
    (tmp_path / "gate.json").write_text(json.dumps(GATE_OK))
    assert v.main(["--out", str(tmp_path)]) == 0
    md = e007_plots.plot_all(str(tmp_path))
    verdict = json.loads((tmp_path / "verdict.json").read_text())
    assert verdict["premise"] == "incomplete" and "**Gate** (passes)" in md
    assert verdict["methods"]["dvp_M3"]["status"] in md
    assert (tmp_path / "e007_mismatch.png").exists()


def test_gate_smoke_measures_a_random_model_and_refuses_the_committed_folder(tmp_path):
    from experiments import e007_gate as g

    assert g.main(["--smoke", "--out", str(tmp_path)]) == 0
    rec = json.loads((tmp_path / "gate.json").read_text())
    assert rec["status"] in ("passes", "fails") and rec["tokens"] > 0
    assert 0.0 <= rec["outside_share"] <= 1.0 and 0.0 <= rec["tail_abs_share"] <= 1.0
    assert rec["code_version"]["commit"] is None or len(rec["code_version"]["commit"]) == 40
    assert (tmp_path / "e007_gate.png").exists()
    with pytest.raises(SystemExit):
        g.main(["--smoke", "--out", g.OUT])


def test_gate_figures_by_hand():
    from experiments.e007_gate import figures

    d = np.array([[0.1, -0.2, 0.5, 0.0]])
    log_rel = np.array([[0.0, -1.0, -14.0, -20.0]])
    mask = np.array([[True, True, True, False]])
    f = figures(d, log_rel, np.ones_like(d), mask)
    assert f["outside_share"] == pytest.approx(1 / 3)
    assert f["tail_abs_share"] == pytest.approx(0.5 / 0.8)
    assert f[v.PRIMARY] == pytest.approx(0.4 / 3)
    assert f["full_kl_k1_inside"] + f["full_kl_k1_outside"] == pytest.approx(f[v.PRIMARY])


def test_units_lanes_and_sweep():
    from experiments import e007_tail as t

    order = t.unit_order()
    assert len(order) == len(v.ARMS) * v.N_SEEDS * -(-v.STEPS // t.UNIT_STEPS)
    assert order[0][0] == "rloo_fp32" and order[-1][0] == "icepop_M3"
    lanes = [t.lane_runs(f"{i}/2") for i in range(2)]
    assert not lanes[0] & lanes[1] and len(lanes[0] | lanes[1]) == len(v.ARMS) * v.N_SEEDS
    units = t.get_sweep(init_hf="/x")
    assert len(units) == len(v.ARMS) * v.N_SEEDS
    assert {u["rollout.dtype"] for u in units} == set(t.LEVELS.values())


def test_device_tier_smoke_validates_its_configs_and_the_tasks_law():
    from experiments import e007_device

    out = e007_device.smoke()
    assert out["units"] == 1 + 3 * len(v.ARMS)
    assert out["methods"] == ["dvp", "icepop", "mis_dvp", "rloo"]
    assert out["vocab_size"] > 100_000 and out["max_decode_length"] > out["response_tokens"]
    assert out["data_mass_outside_safe"] == pytest.approx(0.1)  # the whole tail, at that size
    assert out["data_gate_on_outside_share"] == "passes"


def test_gate_splits_the_mismatch_by_the_kind_of_sampled_token():
    """by_kind on a hand-made batch: head word, a tail word, a number; shares add to 1."""
    from dvp_jax.data import running_sum
    from dvp_jax.tokenizers import load_tokenizer
    from experiments import e007_gate as g

    cfg = g.config("rloo", v.RUNG, smoke=True)
    tok = load_tokenizer(cfg.data.tokenizer)
    head, tail = (tok.encode_ids(w)[0] for w in running_sum.thought_words(2))
    number = tok.encode_ids("7")[0]
    targets = np.array([[head, tail, number, head]])
    d = np.array([[0.1, 0.5, 0.4, 9.0]])
    log_rel = np.array([[0.0, -14.0, -0.1, 0.0]])
    mask = np.array([[True, True, True, False]])
    out = g.by_kind(cfg, targets, d, log_rel, mask)
    assert out["tail_word"]["share_abs_d"] == pytest.approx(0.5)
    assert out["tail_word"]["frac_outside"] == 1.0 and out["head"]["frac_outside"] == 0.0
    assert out["structure"]["mean_abs_d"] == pytest.approx(0.4)
    assert sum(k["share_tokens"] for k in out.values()) == pytest.approx(1.0)


def test_reading_splits_sampled_tail_words_by_whether_the_warmup_showed_them():
    from experiments import e007_reading as r

    count, last = {"ba": 2, "be": 1}, {"ba": 599, "be": 10}
    out = r.split_by_seen(["ba", "be", "bi", "ba"], [-12.0, -13.5, -16.0, -12.5], count, last, 600)
    assert out["share_seen"] == 0.75 and out["share_seen_recently"] == 0.5
    assert out["unseen"] == {"median_log_rel": -16.0, "frac_outside": 1.0}
    assert out["seen"]["frac_outside"] == pytest.approx(1 / 3)
    task = __import__("dvp_jax.data.tail_sum", fromlist=["x"]).TailSumTask(n_words=50)
    count, last = r.warmup_tail_words(task, steps=2, batch=4)
    assert 0 < len(count) <= 49 and max(last.values()) <= 1
