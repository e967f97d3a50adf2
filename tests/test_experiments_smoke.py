"""CI smoke variants of the science experiments (e001 mismatch bound, e002 methods, e003 rho).

Real runs at minimal sizes: one 2-step work unit of e002 and of e003 through the launcher (2 SFT
steps, 4 prompts x 2 responses, 8 eval prompts), then e001 `--smoke` (the units' 2-step warm-up,
16 held-out sequences with one sampled response each, one setting). They run one after the other
(subprocesses without the session's 8 fake devices), each later one loading the programs it
shares with the earlier ones from the session's compilation cache; the assertions read their
real outputs. Then the analyses run on those outputs, and e003's bias check runs in-process at
small sizes.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from dvp_jax.launch import cli, sweep
from dvp_jax.metrics import read_metrics
from experiments import analyze
from experiments import e002_methods as e002
from experiments import e003_rho_ablation as e003
from tests import child_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
E002 = os.path.join("experiments", "e002_methods.py")
E003 = os.path.join("experiments", "e003_rho_ablation.py")


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory):
    """Runs one tiny unit each of e002 and e003, then e001 --smoke; yields their locations."""
    root = tmp_path_factory.mktemp("experiments")
    module = [sys.executable, "-m"]
    jobs = {
        "e001": [
            *module,
            "experiments.e001_mismatch_bound",
            "--smoke",
            "--out",
            str(root / "e001"),
        ],
        # Unit 1 of e002's smoke sweep is mis_dvp (pruning + sequence MIS + logit noise).
        "e002": [
            *module,
            "dvp_jax.launch",
            "local",
            E002,
            "--sweep",
            "smoke=True",
            "--root",
            str(root),
            "--only",
            "1",
        ],
        "e003": [
            *module,
            "dvp_jax.launch",
            "local",
            E003,
            "--sweep",
            "smoke=True",
            "--root",
            str(root),
        ],
    }
    # Without the test session's 8 fake devices, one after another (CPU time is the cost, two at
    # once only share the cores): e003's unit and e001's warm-up load the programs they share
    # with e002's unit (the warm-up; e003 also the rollouts and evaluation) from the session's
    # compilation cache.
    outputs = {}
    for name in ("e002", "e003", "e001"):
        run = subprocess.run(
            jobs[name],
            cwd=REPO,
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=600,
        )
        outputs[name] = (run.returncode, run.stdout)
    return root, outputs


def _finite(x) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)


# ------------------------------------------------------------------------------------------------
# Sweeps (no runs).
# ------------------------------------------------------------------------------------------------
def test_full_sweeps_expand_to_the_documented_units(tmp_path, capsys):
    exp = sweep.load_experiment(E002, {"init_hf": "/nonexistent/hf_export"})
    assert exp.config_flag == "configs/tiny_cpu.py:dvp"
    methods = [dict(u.overrides)["method"] for u in exp.units]
    noisy = [dict(u.overrides) for u in exp.units if dict(u.overrides)["rollout.noise_std"]]
    assert {o["rollout.noise_std"] for o in noisy} == {e002.NOISE}
    assert sorted((o["method"], o["train.seed"]) for o in noisy) == sorted(
        (m, s) for m in e002.METHODS for s in range(e002.SEEDS)
    )
    assert methods.count("rloo") == 2 * e002.SEEDS  # noisy + the no-noise reference
    for u in exp.units:
        ov = dict(u.overrides)
        assert ov["model.hf_path"] == "/nonexistent/hf_export" and ov["sft.steps"] == 0
        assert ov["train.steps"] == e002.STEPS
    exp3 = sweep.load_experiment(E003, {"init_hf": "/nonexistent/hf_export"})
    rhos = {dict(u.overrides).get("loss.log_rho", "off") for u in exp3.units}
    assert rhos == {-8.0, -10.0, -13.0, -16.0, "off"}
    assert all(dict(u.overrides)["method"] == "dvp" for u in exp3.units)
    assert any(dict(u.overrides).get("loss.prune") is False for u in exp3.units)
    assert [u.name for u in exp3.units][-1] == "04_prune=false"
    # Every override is a declared field of the locked base config, with a valid value.
    for u in (*exp.units, *exp3.units):
        cfg = analyze.tiny_config(dict(u.overrides))
        assert cfg.train.steps == e002.STEPS and cfg.init_hf_path == "/nonexistent/hf_export"
    # Without a warm start each unit does its own 600-step SFT; the sweep's inputs are arguments.
    ov = dict(sweep.load_experiment(E003).units[0].overrides)
    assert "model.hf_path" not in ov and ov["sft.steps"] == 600
    assert len(sweep.load_experiment(E002, {"seeds": 1, "noise": 0.0}).units) == len(e002.METHODS)
    # The launcher's dry run prints one trainer command per unit and creates nothing.
    assert cli.main(["local", E002, "--dry_run", "--root", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("-m dvp_jax.main") == len(exp.units)
    assert "--config configs/tiny_cpu.py:dvp" in out and "--config.sft.steps=600" in out
    assert not os.listdir(tmp_path)


# ------------------------------------------------------------------------------------------------
# e001.
# ------------------------------------------------------------------------------------------------
def test_e001_smoke_holds_the_exact_bound(smoke_runs):
    root, outputs = smoke_runs
    rc, log = outputs["e001"]
    assert rc == 0, log[-3000:]
    with open(root / "e001" / "e001.json") as fh:
        report = json.load(fh)
    assert report["smoke"] and report["settings"]
    for s in report["settings"]:
        assert s["frac_within_exact_bound"] == 1.0  # E10 is exact, not first order
        assert 0 < s["eps"]["median"] <= s["eps"]["max"] and _finite(s["eps"]["max"])
        assert s["positions"] > 0 and s["sampled_tokens"] > 0
        assert all(_finite(v) for v in s["growth"]["mean_L"])
        assert sum(b["count"] for b in s["sampled_bins"]) == s["sampled_tokens"]
        # The engine's recorded log mu matches the script's teacher-forced rollout path up to bf16
        # batch-shape rounding (typically < 1e-2; the tail can differ by more, see e001.json).
        assert s["engine_vs_teacher_forced_abs_diff"]["median"] < 1e-2
        assert (root / "e001" / f"e001_{s['setting']}.png").stat().st_size > 0


# ------------------------------------------------------------------------------------------------
# e002 / e003: one real 2-step unit each, then the analyses on their outputs.
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, experiment", [("e002", "e002_methods"), ("e003", "e003_rho_ablation")]
)
def test_smoke_unit_runs_through_launch(smoke_runs, name, experiment):
    root, outputs = smoke_runs
    rc, log = outputs[name]
    assert rc == 0, log[-3000:]
    assert "get_sweep(smoke=True)" in log
    [unit] = [d for d in os.listdir(root / experiment) if not d.endswith(".json")]
    workdir = root / experiment / unit
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["steps"] == 2
    for key in (
        "start_eval_accuracy",
        "eval_accuracy",
        "final_ppl_gap",
        "final_frac_responses_excluded",
        "final_frac_tokens_outside_train_safe",
    ):
        assert _finite(summary[key]), key
    rl = [r for r in read_metrics(str(workdir)) if r["step"] > 0 and "loss" in r]
    assert len(rl) == 2 and all(_finite(r["ppl_gap"]) and _finite(r["loss"]) for r in rl)
    assert (workdir / "hf_export" / "config.json").exists()


def test_analyses_and_bias_check_on_smoke_outputs(smoke_runs, tmp_path):
    root, outputs = smoke_runs
    assert outputs["e002"][0] == 0 and outputs["e003"][0] == 0
    res2 = e002.analyse(str(root), str(tmp_path / "e002"), clean=False)
    assert list(res2) == ["MIS+DVP"] and (tmp_path / "e002" / "e002_methods.png").exists()
    assert "| MIS+DVP | 1 |" in (tmp_path / "e002" / "results.md").read_text()
    # The table's numbers are the unit's: summary.json, and the mean of its 2 RL rows.
    [unit] = [d for d in os.listdir(root / "e002_methods") if not d.endswith(".json")]
    summary = json.loads((root / "e002_methods" / unit / "summary.json").read_text())
    rl = [r for r in read_metrics(str(root / "e002_methods" / unit)) if "loss" in r]
    assert res2["MIS+DVP"]["final_acc"] == [summary["eval_accuracy"]]
    assert res2["MIS+DVP"]["ppl_gap"] == [pytest.approx(sum(r["ppl_gap"] for r in rl) / 2)]
    assert (tmp_path / "e002" / "units" / unit / "summary.json").exists()
    res3 = e003.analyse(str(root), str(tmp_path / "e003"), check=False)
    assert list(res3["rho"]) == ["-8"] and (tmp_path / "e003" / "e003_rho.png").exists()
    assert json.loads((tmp_path / "e003" / "results.json").read_text())["noise"] == [e002.NOISE]

    # The bias check at a threshold that prunes something, on the unit's exported policy.
    [unit] = [d for d in os.listdir(root / "e003_rho_ablation") if not d.endswith(".json")]
    hf = str(root / "e003_rho_ablation" / unit / "hf_export")
    [c] = e003.bias_check(hf, (-2.0,), num_prompts=8, samples=2)
    assert c["chain_ok"] and c["within_bound"]
    assert c["B2_E[sum delta]"] > 0 and abs(c["delta_hat"]) <= 1.0


def test_analysis_looks_up_only_declared_metrics():
    with pytest.raises(KeyError, match="not declared"):
        analyze.series([{"step": 0, "eval_accuracy": 0.5}], "eval_acuracy")
    with pytest.raises(KeyError, match="not declared"):
        analyze.tail_mean([{"step": 1, "loss": 0.0}], "frac_outside_train_safe")


def test_e003_table_reports_each_policys_bias_check(smoke_runs, tmp_path, monkeypatch):
    """The analysis checks one policy per rho, at its own rho, and puts the result in the table."""
    root, outputs = smoke_runs
    assert outputs["e003"][0] == 0
    calls = []

    def fake_check(hf_dir, log_rhos):
        calls.append((os.path.basename(os.path.dirname(hf_dir)), tuple(log_rhos)))
        bounds = {"B1_E[1-prod(1-delta)]": 2e-3, "B2_E[sum delta]": 3e-3, "B3_T_max_delta": 4e-3}
        return [
            {"log_rho": r, "delta_hat": -2e-3, "se": 1e-3, **bounds, "within_bound": True}
            for r in log_rhos
        ]

    monkeypatch.setattr(e003, "bias_check", fake_check)
    res = e003.analyse(str(root), str(tmp_path), check=True)
    [unit] = [d for d in os.listdir(root / "e003_rho_ablation") if not d.endswith(".json")]
    assert calls == [(unit, (-8.0,))] and res["bias_checks"]["-8"]["unit"] == unit
    assert "| -2.0e-03 ± 1e-03 / 3.0e-03 (ok) |" in (tmp_path / "results.md").read_text()


# ------------------------------------------------------------------------------------------------
# e006.
# ------------------------------------------------------------------------------------------------
def test_e006_sweeps_and_the_device_tier_smoke():
    """e006's CPU-tier sweep holds every arm x seed from e005's warm start, its unit order runs
    the premise arms first; the device tier's `--smoke` validates every unit's config at the
    device sizes and counts the model under `nnx.eval_shape` (nothing runs; seconds)."""
    from experiments import e006_device, e006_premise
    from experiments import e006_verdict as rules

    path = os.path.join("experiments", "e006_premise.py")
    exp = sweep.load_experiment(path)
    runs = {(dict(u.overrides)["method"], dict(u.overrides)["rollout.dtype"]) for u in exp.units}
    assert len(exp.units) == len(rules.ARMS) * len(rules.SEEDS) and len(runs) == len(rules.ARMS)
    assert all(dict(u.overrides)["model.hf_path"] == e006_premise.WARM_START for u in exp.units)
    order = e006_premise.unit_order()
    premise = 2 * len(rules.SEEDS) * (rules.STEPS // e006_premise.UNIT_STEPS)
    assert {a for a, _, _ in order[:premise]} == {"rloo_fp32", "rloo_M3"}
    out = e006_device.smoke()
    assert out["units"] == 1 + len(rules.ARMS) * len(rules.SEEDS)
    assert 10e6 <= out["params"] <= 20e6 and out["vocab_size"] >= 32_000
    assert out["max_decode_length"] >= 1_000 and out["tail_log_ratio_last_rank"] < -13
    assert 0.0 < out["data_mass_outside_safe"] < 0.01  # the tail exists, thin (the docstring)
