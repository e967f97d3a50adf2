"""e004 (experiments/e004_running_sum.py, e004_measure.py, e004_verdict.py): smoke run, gates.

The smoke run is real and minimal, on a random tiny model exported here: one MIS+DVP work unit
at M3 through the launcher (`python -m dvp_jax.launch local`; started from the export as real
units start from the warm start, 2 RL steps, 2 prompts x 2 responses of <= 17 tokens) in a
subprocess, while this process runs stage 1's measurement on the same export (`measure`: engine
sampling at M4, i.e. M3's int4 weights plus the synthetic tail-shaped logit noise, and the
trainer's teacher-forced statistics). Then the unit's record and the verdict are built from the
real outputs. The gates are pure functions,
each checked passing and failing on synthetic numbers.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from flax import nnx

from dvp_jax.launch import local, sweep
from experiments import e004_measure as measure_lib
from experiments import e004_running_sum as e004
from experiments import e004_verdict as v
from tests import child_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
E004 = os.path.join("experiments", "e004_running_sum.py")


def _smoke_overrides() -> dict:
    return dict(sweep.load_experiment(E004, {"smoke": True}).units[0].overrides)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """Exports a random model, starts the smoke unit from it and measures M4 on it meanwhile;
    yields both."""
    from dvp_jax.model import TRAIN_POLICY
    from dvp_jax.model.hf_import import save_hf
    from dvp_jax.model.transformer import Transformer

    root = tmp_path_factory.mktemp("e004")
    overrides = _smoke_overrides()
    cfg = measure_lib.level_config("M4", overrides)
    hf = str(root / "random_hf")
    # Initialised under jit: one program instead of one per parameter shape.
    save_hf(nnx.jit(lambda: Transformer(cfg.model, TRAIN_POLICY, rngs=nnx.Rngs(0)))(), hf)
    env = child_env()  # one CPU device
    argv = [sys.executable, "-m", "dvp_jax.launch", "local", E004, "--sweep", "smoke=True"]
    proc = subprocess.Popen(
        [*argv, "--sweep", f"init_hf={hf}", "--root", str(root)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    measured = measure_lib.measure(hf, "M4", num_prompts=2, samples=3, overrides=overrides)
    out, _ = proc.communicate(timeout=600)
    return root, hf, proc.returncode, out, measured


def test_stage_sweeps_name_roles_levels_and_seeds():
    premise = sweep.load_experiment(E004, {"stage": "premise", "init_hf": "/x/hf_export"})
    names = [u.name for u in premise.units]
    assert names[0] == "00_final_rloo_M4_s0" and names[-1] == "09_final_rloo_M0_s4"
    assert names[1] == "01_final_rloo_M0_s0"  # seed-major: both arms of a seed, then the next
    for u in premise.units:
        ov = dict(u.overrides)
        assert ov["model.hf_path"] == "/x/hf_export" and ov["sft.steps"] == 0
        assert ov["rollout.dtype"] in ("bfloat16_fp8kv_int4w", "float32")
        measure_lib.level_config("M0", ov)  # every override is a declared field with a valid value
    gain = sweep.load_experiment(E004, {"stage": "gain", "init_hf": "/x/hf_export"}).units
    assert [dict(u.overrides)["train.seed"] for u in gain] == list(e004.PILOT_SEEDS)
    assert not set(e004.PILOT_SEEDS) & set(e004.FINAL_SEEDS)
    methods = sweep.load_experiment(E004, {"stage": "methods", "level": "M1"}).units
    assert {dict(u.overrides)["method"] for u in methods} == {"tis", "mis", "dvp", "mis_dvp"}
    assert {dict(u.overrides)["rollout.dtype"] for u in methods} == {"bfloat16_fp8kv"}
    with pytest.raises(ValueError, match="want 'gain', 'premise' or 'methods'"):
        e004.get_sweep(stage="nope")
    assert e004.segment_ends(300, 100) == [100, 200, 300]
    assert e004.segment_ends(250, 100) == [100, 200, 250] and e004.segment_ends(40, 100) == [40]
    # Every unit is scored on all held-out problems (no more exist: a 40th is refused).
    ov = dict(gain[0].overrides)
    task = measure_lib.level_config("M0", ov).data.make_task()
    assert len(task.heldout_examples(ov["eval.num_prompts"])) == ov["eval.num_prompts"] == 39
    with pytest.raises(ValueError, match="found only 39 distinct held-out problems"):
        task.heldout_examples(40)
    # The synthetic rung: M3's precision plus the tail-shaped noise, and back from a unit.
    m4 = sweep.load_experiment(E004, {"stage": "methods", "level": "M4", "seeds": 1}).units
    conf = measure_lib.config_module()
    for u in m4:
        ov = dict(u.overrides)
        assert ov["rollout.dtype"] == "bfloat16_fp8kv_int4w"
        assert ov["rollout.noise_tail_gap"] == 13.0 and ov["rollout.noise_std"] > 0
        assert conf.level_of(ov) == "M4" and u.name.endswith("_M4_s0")
        measure_lib.level_config("M0", ov)
    assert [conf.level_of(conf.level_overrides(lv)) for lv in v.LEVEL_ORDER] == list(v.LEVEL_ORDER)
    assert v.strongest_level({"M3": {}, "M4": {}}) == "M4"


def test_a_stage_runs_whole_runs_in_segments_and_stops_at_a_failure(monkeypatch, tmp_path):
    calls = []

    def run_unit(exp, unit, workdir, timeout):
        steps = dict(unit.overrides)["train.steps"]
        assert workdir.endswith(os.path.join("e004_running_sum", unit.name))
        calls.append(([unit.name], steps))
        failed = "M0_s0" in unit.name and steps == 200
        return local.UnitResult(unit, workdir, 1 if failed else 0, 0.0, {})

    monkeypatch.setattr(local, "run_unit", run_unit)
    monkeypatch.setattr(e004, "write_records", lambda root, out: [])
    sweep = {"stage": "premise", "level": "M4", "seeds": 1, "steps": 250}
    with pytest.raises(RuntimeError, match="01_final_rloo_M0_s0 failed at the segment to step 200"):
        e004.run_stage(str(tmp_path), str(tmp_path), "premise", 1, sweep, unit_steps=100)
    # One run at a time, its segments in order, then the next run of the same seed.
    first, second = "00_final_rloo_M4_s0", "01_final_rloo_M0_s0"
    assert calls == [([first], 100), ([first], 200), ([first], 250)] + [
        ([second], 100),
        ([second], 200),
    ]
    # Rerun, two at a time, with the first run finished and the second through step 100: only
    # the segments not yet done are launched (a checkpoint past a segment's end is refused).
    for name, steps in ((first, 250), (second, 100)):
        os.makedirs(tmp_path / "e004_running_sum" / name)
        (tmp_path / "e004_running_sum" / name / "summary.json").write_text(f'{{"steps": {steps}}}')
    calls.clear()
    with pytest.raises(RuntimeError, match=f"{second} failed at the segment to step 200"):
        e004.run_stage(str(tmp_path), str(tmp_path), "premise", 2, sweep, unit_steps=100)
    assert calls == [([second], 200)]


def test_the_premise_stage_stops_once_its_gate_is_decided(monkeypatch, tmp_path):
    """Three quiet RLOO-at-M4 seeds decide the premise: no later run of the sweep starts."""
    done = []

    def run_unit(exp, unit, workdir, timeout):
        done.append(unit.name)
        return local.UnitResult(unit, workdir, 0, 0.0, {})

    def write_records(root, out):
        recs = []
        for name in done:
            method, level, seed = name.split("_")[2:]
            recs.append(
                {
                    "unit": name,
                    "role": "final",
                    "method": method,
                    "level": level,
                    "seed": int(seed[1:]),
                    "steps": v.FINAL_STEPS,
                    "final_acc": 0.1 if level == "M4" else 0.2,
                    "indicators": {"any": False},
                }
            )
        return recs

    monkeypatch.setattr(local, "run_unit", run_unit)
    monkeypatch.setattr(e004, "write_records", write_records)
    levels = {"M0": _level(seq_log_ratio=0.0), "M4": _level()}
    (tmp_path / "stage1_levels.json").write_text(json.dumps({"levels": levels}))
    sweep = {"stage": "premise", "level": "M4", "seeds": 5, "steps": v.FINAL_STEPS}
    e004.run_stage(str(tmp_path), str(tmp_path), "premise", 1, sweep, unit_steps=v.FINAL_STEPS)
    # Seed-major: M4 s0, M0 s0, M4 s1, M0 s1, M4 s2 -- the third quiet M4 seed decides it.
    assert done == [
        "00_final_rloo_M4_s0",
        "01_final_rloo_M0_s0",
        "02_final_rloo_M4_s1",
        "03_final_rloo_M0_s1",
        "04_final_rloo_M4_s2",
    ]
    # Relaunching the stage on those records starts nothing.
    (tmp_path / "units").mkdir(exist_ok=True)
    for rec in write_records(None, None):
        (tmp_path / "units" / f"{rec['unit']}.json").write_text(json.dumps(rec))
    done.clear()
    assert e004.main(["--stage", "2", "--root", str(tmp_path), "--out", str(tmp_path)]) == 0
    assert done == []


def test_config_meets_the_task_budget():
    cfg = measure_lib.level_config("M2")
    assert cfg.rollout.max_decode_length >= cfg.data.running_sum["max_response_len"] + 1
    assert cfg.model.max_position_embeddings >= (
        cfg.data.max_prompt_len + cfg.rollout.max_decode_length
    )
    assert cfg.eval.dtype == "float32" and cfg.eval.k == 16
    assert (
        cfg.rollout.dtype == "bfloat16_fp8kv_fp8w"
        and cfg.data.running_sum["min_response_len"] >= 150
    )
    with pytest.raises(ValueError, match="level 'M9'"):
        measure_lib.config_module().get_config("rloo:M9")
    m4 = measure_lib.level_config("M4")
    assert (m4.rollout.dtype, m4.rollout.noise_tail_gap) == ("bfloat16_fp8kv_int4w", 13.0)
    assert cfg.rollout.noise_std == 0.0 and cfg.rollout.noise_tail_gap == 0.0  # M0-M3: none


def test_smoke_unit_and_stage1_measurement(smoke, tmp_path):
    root, hf, rc, out, m = smoke
    assert rc == 0, out[-3000:]
    assert f"get_sweep(smoke=True, init_hf={hf!r})" in out
    workdir = root / "e004_running_sum" / "00_smoke_mis_dvp_M3"
    # The unit started from the exported model (no warm-up), as every real unit starts.
    config = json.loads((workdir / "config.json").read_text())
    assert config["init_hf_path"] == hf and config["sft.steps"] == 0
    rec = e004.unit_record(str(workdir), _smoke_overrides())
    assert rec["role"] == "smoke" and rec["level"] == "M3" and rec["steps"] == 2
    assert rec["eval_responses"] == 2 * 2  # eval.num_prompts x eval.k of the smoke sizes
    assert rec["evals"] == [[0, rec["start_acc"]], [2, rec["final_acc"]]]
    # A later segment keeps the accuracy an earlier one recorded, inside the run's steps only.
    earlier = {"start_acc": rec["start_acc"], "evals": [[0, 0.5], [1, 0.25], [7, 0.75]]}
    again = e004.unit_record(str(workdir), _smoke_overrides(), earlier)
    assert again["evals"] == [[0, rec["start_acc"]], [1, 0.25], [2, rec["final_acc"]]]
    other_run = earlier | {"start_acc": rec["start_acc"] + 1.0}  # a record of another start
    assert e004.unit_record(str(workdir), _smoke_overrides(), other_run)["evals"] == rec["evals"]
    assert len(rec["curves"]["entropy"]) == 2 and all(e > 0 for e in rec["curves"]["entropy"])
    assert all(math.isfinite(x) for k in ("log_ppl_diff", "grad_norm") for x in rec["curves"][k])
    assert set(rec["indicators"]) >= {"ppl", "grad", "entropy", "any"}
    # Stage 1 on a random model: 6 responses, statistics of the trainer's functions.
    assert m["responses"] == 6 and m["level"] == "M4" and m["rollout_dtype"].endswith("int4w")
    assert m["noise_tail_gap"] == 13.0 and m["noise_std"] > 0
    assert 0 < m["response_length"] <= 17 and 0 <= m["truncation_rate"] <= 1
    # A random model over ~7,000 ids is near uniform: entropy close to log V (within 1 nat).
    assert abs(m["entropy"] - math.log(7008)) < 1.0
    assert 0.0 <= m["seq_log_ratio_outside_share"] <= 1.0
    assert m["seq_log_ratio"] != 0.0  # int4 weights, bf16, fp8 KV, tail noise: a mismatch
    assert abs(m["seq_log_ratio"]) <= m["seq_log_ratio_abs_mean"] + 1e-6
    # The verdict on a results folder with only these: incomplete at stage 1 (no gain run).
    (tmp_path / "stage1_levels.json").write_text(json.dumps({"levels": {"M4": m}}))
    assert v.main(["--out", str(tmp_path)]) == 0
    verdict = json.loads((tmp_path / "verdict.json").read_text())
    assert verdict["level"] == "M4" and verdict["power"]["checks"]


# ------------------------------------------------------------------------------------------------
# Gate logic on synthetic inputs.
# ------------------------------------------------------------------------------------------------
def _level(**kw) -> dict:
    base = {
        "responses": 1024,
        "response_length": 170.0,
        "entropy": 3.0,
        "seq_log_ratio": -3.0,
        "seq_log_ratio_outside_share": 0.4,
    }
    return base | kw


def test_power_gate_passes_and_fails_on_each_figure():
    ok = v.power_gate({"M3": _level()}, "M3", [(0.1, 0.2)])
    assert ok["pass"] is True and all(c["pass"] for c in ok["checks"])
    for bad in (
        {"response_length": 120.0},
        {"entropy": 0.5},
        {"seq_log_ratio": 1.5},
        {"seq_log_ratio_outside_share": 0.1},
        {"responses": 512},
    ):
        g = v.power_gate({"M3": _level(**bad)}, "M3", [(0.1, 0.2)])
        assert g["pass"] is False, bad
    assert v.power_gate({"M3": _level()}, "M3", [(0.1, 0.12)])["pass"] is False  # gain 0.02
    assert v.power_gate({"M3": _level()}, "M3", None)["pass"] is None  # gain run missing
    assert v.power_gate({"M3": _level(entropy=0.1)}, "M3", None)["pass"] is False
    assert v.power_gate({"M1": _level()}, "M3", None)["pass"] is None  # level not measured


def test_premise_gate():
    m0 = [0.40, 0.42, 0.41, 0.43, 0.39]
    low = [0.30, 0.31, 0.29, 0.32, 0.30]
    assert v.premise_gate(low, m0, [True, True, True, False, False])["pass"] is True
    assert v.premise_gate(low, m0, [True, True, False, False, False])["pass"] is False  # 2 of 5
    assert v.premise_gate([0.38, 0.39, 0.40, 0.41, 0.37], m0, [True] * 5)["pass"] is False
    noisy = [0.10, 0.60, 0.20, 0.55, 0.30]  # drop 0.056 but p > 0.05
    g = v.premise_gate(noisy, m0, [True] * 5)
    assert g["checks"][0]["pass"] and not g["checks"][1]["pass"] and g["pass"] is False
    assert v.premise_gate([0.3], m0, [True])["pass"] is None
    # The collapse count decides early: 3 of 5 quiet seeds leave a majority out of reach ...
    g = v.premise_gate(low[:3], m0[:2], [False] * 3)
    assert g["pass"] is False and "out of reach" in g["decided_early"]
    assert g["interim"]["seeds"] == [3, 2] and g["interim"]["drop_vs_m0_rloo"] > 0.05
    # ... 2 quiet of 3 (or of 4) do not: the remaining seeds could still make 3 of 5.
    assert v.premise_gate(low[:3], m0[:3], [False, False, True])["pass"] is None
    assert v.premise_gate(low[:4], m0, [False, False, True, True])["pass"] is None
    assert v.premise_gate(low[:3], m0, [False] * 3, n_seeds=7)["pass"] is None  # 4 of 7 left
    # More seeds than registered: the majority is of all of them (3 of 7 is not one).
    g = v.premise_gate(low + low[:2], m0 + m0[:2], [True] * 3 + [False] * 4)
    assert g["pass"] is False and g["checks"][2]["threshold"] == ">= 4 of 7"
    with pytest.raises(ValueError, match="2 indicator flags for 3 RLOO seeds"):
        v.premise_gate(low[:3], m0, [True, True])


def test_collapse_indicators():
    n = 100
    flat = v.collapse_indicators([0.01] * n, [1.0] * n, [3.0] * n)
    assert flat["any"] is False and flat["window"] == 50
    assert v.collapse_indicators([0.01] * 50 + [0.03] * 50, [1.0] * n, [3.0] * n)["ppl"]
    spikes = [1.0] * 90 + [5.0] * 10  # p95 = 5 >= 3 x 1
    assert v.collapse_indicators([0.01] * n, spikes, [3.0] * n)["grad"]
    assert v.collapse_indicators([0.01] * n, [1.0] * n, [2.0] * 50 + [3.1] * 50)["entropy"]
    assert not v.collapse_indicators([0.01] * n, [1.0] * n, [2.0] * 50 + [2.9] * 50)["entropy"]
    assert v.collapse_indicators([0.1] * 10, [1.0] * 10, [1.0] * 10)["window"] == 5
    assert v.collapse_indicators([], [], [])["any"] is False


def test_c1_gate():
    m0 = [0.40, 0.42, 0.41, 0.43, 0.39]

    def meth(final, fired=(False,) * 5, pruned=1.0, unpruned=3.0):
        return {
            "final": final,
            "fired": list(fired),
            "abs_L_pruned": [pruned] * 5,
            "abs_L_unpruned": [unpruned] * 5,
        }

    good = meth([0.40, 0.41, 0.42, 0.40, 0.39])
    assert v.c1_gate({"dvp": good, "mis_dvp": good}, m0)["pass"] is True
    worse = meth([0.36, 0.37, 0.38, 0.36, 0.37])  # 0.044 below
    assert v.c1_gate({"dvp": good, "mis_dvp": worse}, m0)["pass"] is False
    unstable = meth(good["final"], fired=(True, True, False, False, False))
    assert v.c1_gate({"dvp": unstable, "mis_dvp": good}, m0)["pass"] is False
    one_fired = meth(good["final"], fired=(True, False, False, False, False))
    assert v.c1_gate({"dvp": one_fired, "mis_dvp": good}, m0)["pass"] is True
    big_l = meth(good["final"], pruned=2.0, unpruned=3.0)
    assert v.c1_gate({"dvp": big_l, "mis_dvp": good}, m0)["pass"] is False
    assert v.c1_gate({"dvp": good}, m0)["pass"] is None


def test_c2_gate_and_bootstrap():
    base = {"rloo": [0.30, 0.31, 0.32, 0.30, 0.31], "tis": [0.28] * 5, "mis": [0.25] * 5}
    g = v.c2_gate(base | {"mis_dvp": [0.36, 0.37, 0.38, 0.36, 0.37]})
    assert g["pass"] is True and g["best_unpruned"] == "rloo"
    assert g["diff"] == pytest.approx(0.06) and g["diff_ci95"][0] > 0
    assert g["relative"] == pytest.approx(0.06 / 0.308) and g["relative_ci95"][0] > 0
    g = v.c2_gate(base | {"mis_dvp": [0.25, 0.40, 0.30, 0.35, 0.28]})  # CI straddles 0
    assert g["pass"] is False and g["diff_ci95"][0] < 0 < g["diff_ci95"][1]
    assert v.c2_gate({"mis_dvp": [0.3] * 5, "rloo": [0.2] * 5})["pass"] is None
    # Deterministic (fixed bootstrap seed).
    a = v._bootstrap([0.1, 0.2, 0.3], [0.1, 0.1, 0.2])
    assert a == v._bootstrap([0.1, 0.2, 0.3], [0.1, 0.1, 0.2])
    assert np.isclose(a["diff"], 0.2 / 3)


def test_verdict_strings():
    def gate(p):
        return {"pass": p, "missing": ["x"] if p is None else []}

    T, F, N = gate(True), gate(False), gate(None)
    assert v.verdict(F, N, N, N) == "no power"
    assert v.verdict(N, N, N, N).startswith("incomplete: stage 1")
    assert v.verdict(T, F, N, N) == "premise does not reproduce"
    assert v.verdict(T, N, N, N) == "incomplete: stage 2 (premise)"
    assert v.verdict(T, T, F, T) == "claim refuted at this scale"
    assert v.verdict(T, T, T, F) == "claim refuted at this scale"
    assert v.verdict(T, T, N, T) == "incomplete: stage 3 (C1, C2)"
    assert v.verdict(T, T, T, T) == "claim reproduces"


def test_gates_from_unit_records():
    levels = {"M0": _level(seq_log_ratio=0.0), "M3": _level()}

    def rec(method, level, seed, final, role="final", fired=False):
        return {
            "role": role,
            "method": method,
            "level": level,
            "seed": seed,
            "start_acc": 0.2,
            "final_acc": final,
            "eval_responses": 39 * 64,
            "steps": 300,
            "indicators": {"any": fired},
            "abs_seq_log_ratio": 3.0,
            "abs_seq_log_ratio_pruned": 1.0,
        }

    units = [rec("rloo", "M0", 100, 0.3, role="gain")]
    out = v.gates_from_results(levels, units)
    assert out["level"] == "M3" and out["power"]["pass"] is True
    assert out["verdict"] == "incomplete: stage 2 (premise)"
    units += [rec("rloo", "M0", s, 0.40 + 0.01 * s) for s in range(5)]
    units += [rec("rloo", "M3", s, 0.30 + 0.01 * s, fired=True) for s in range(4)]
    # A run still going, or an arm short of its 5 seeds, is not read as final.
    going = rec("rloo", "M3", 4, 0.9) | {"unit": "09_final_rloo_M3_s4", "steps": 100}
    out = v.gates_from_results(levels, units + [going])
    assert out["verdict"] == "incomplete: stage 2 (premise)"
    assert out["in_progress"] == ["09_final_rloo_M3_s4: step 100 of 300"]
    # Three quiet RLOO seeds at the level decide the premise before the other two finish.
    quiet = [rec("rloo", "M3", s, 0.30 + 0.01 * s) for s in range(3)]
    out = v.gates_from_results(levels, units[:6] + quiet)
    assert out["verdict"] == "premise does not reproduce" and out["premise"]["decided_early"]
    units += [rec("rloo", "M3", 4, 0.34, fired=True)]
    assert v.gates_from_results(levels, units)["verdict"] == "incomplete: stage 3 (C1, C2)"
    for m, acc in (("tis", 0.31), ("mis", 0.29), ("dvp", 0.42), ("mis_dvp", 0.43)):
        units += [rec(m, "M3", s, acc + 0.005 * s) for s in range(5)]
    out = v.gates_from_results(levels, units)
    assert out["c1"]["pass"] and out["c2"]["pass"] and out["verdict"] == "claim reproduces"
    no_gain = [rec("rloo", "M0", 100, 0.21, role="gain")] + units[1:]
    assert v.gates_from_results(levels, no_gain)["verdict"] == "no power"
    # A pilot scored on too few held-out responses does not count, for or against the gate.
    coarse = rec("rloo", "M0", 100, 0.21, role="gain") | {"unit": "00_gain", "eval_responses": 512}
    power = v.gates_from_results(levels, [coarse] + units[1:])["power"]
    assert power["pass"] is None and power["missing"] == ["M0 RLOO gain run"]
    assert power["gain_units_excluded"] == ["00_gain: 512 eval responses (< 2000)"]
    power = v.gates_from_results(levels, [coarse] + units)["power"]  # the precise pilot decides
    assert power["pass"] is True and power["checks"][-1]["value"] == pytest.approx(0.1)


def test_reading_recomputes_gains_tests_and_bounds_from_the_records():
    from experiments import e004_reading as r

    def rec(level, seed, start, evals, ppl=(0.3, 0.2), ent=(2.0, 2.9)):
        return {
            "role": "final",
            "method": "rloo",
            "level": level,
            "seed": seed,
            "start_acc": start,
            "final_acc": evals[-1],
            "evals": [[0, start]] + [[100 * (i + 1), a] for i, a in enumerate(evals)],
            "indicators": {
                "ppl_first": ppl[0],
                "ppl_last": ppl[1],
                "entropy_first": ent[0],
                "entropy_last": ent[1],
                "any": False,
            },
            "curves": {"grad_norm": [0.01, 0.02, 0.03, 0.04]},
        }

    units = [rec("M4", s, 0.1, [0.12, 0.14, 0.10 + 0.01 * s]) for s in range(3)]
    units += [rec("M0", s, 0.1, [0.13, 0.16, 0.20 + 0.01 * s]) for s in range(3)]
    levels = {
        "M1": {"seq_log_ratio": -0.02, "response_length": 100.0},
        "M3": {"seq_log_ratio": -0.04, "response_length": 100.0},
        "M4": {
            "seq_log_ratio": -40.0,
            "response_length": 100.0,
            "noise_std": 2.0,
            "seq_log_ratio_outside_share": 0.25,
        },
    }
    out = r.reading(levels, units)
    assert out["gain_from_common_start"]["M4"] == pytest.approx(0.01)
    assert out["gain_from_common_start"]["M0"] == pytest.approx(0.11)
    assert out["share_of_m0_gain_kept"] == pytest.approx(1 / 11)
    assert out["drop_vs_m0_rloo"] == pytest.approx(0.10)
    # Equal seed offsets in both arms: the paired differences have no spread, so p -> 0.
    assert out["paired_one_sided_p"] < 1e-6 and 0 < out["welch_one_sided_p"] < 0.01
    assert out["mean_acc_by_step"]["M4"]["200"] == pytest.approx(0.14)
    assert out["ppl_fell_in_every_seed"] is True
    assert out["entropy_rule_margin_per_seed"][0] == pytest.approx(2.9 / 2.0 / 1.5 - 1)
    assert out["collapse_probability_upper_bound"] == pytest.approx(1 - 0.05 ** (1 / 3))
    assert out["abs_E_L_per_token"]["M4"] == pytest.approx(0.4)
    assert out["per_token_ratio_to_real_rungs"] == pytest.approx([1000.0, 2000.0])
    assert out["lognormal_factor_mean"] == pytest.approx(math.exp(2.0))
    assert out["share_of_E_L_inside_safe_set"] == pytest.approx(0.75)
    assert r.reading(levels, units[:1] + units[3:4])["label"] is None  # one seed: no reading
