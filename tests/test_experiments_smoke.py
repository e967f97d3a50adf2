"""CI smoke variants of the science experiments (e001 mismatch bound, e002 methods, e003 rho).

Real runs at minimal sizes: e001 `--smoke` (3 SFT steps, 16 held-out sequences, one setting) and
one 2-step work unit of e002 and of e003 through experiments/launch.py (2 SFT steps, 4 prompts x
2 responses, 8 eval prompts). The three start together as subprocesses (one `launch.py`/script
each, without the test session's 8 fake devices) so the file stays near a minute on 2 cores; the
assertions read their real outputs. Then the analyses run on those outputs, and e003's bias check
runs in-process at small sizes.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXP = os.path.join(REPO, "experiments")


def _load(name: str, file: str):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, os.path.join(EXP, file))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


launch = _load("dvp_launch", "launch.py")
e002 = _load("dvp_experiments_e002", "e002_methods.py")
e003 = _load("dvp_experiments_e003", "e003_rho_ablation.py")


def _clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "DVP_INIT_HF")}
    env.update(JAX_PLATFORMS="cpu", **extra)
    return env


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory):
    """Starts e001 --smoke and one tiny unit each of e002 and e003; yields their locations."""
    root = tmp_path_factory.mktemp("experiments")
    py = sys.executable
    jobs = {
        "e001": [
            py,
            os.path.join(EXP, "e001_mismatch_bound.py"),
            "--smoke",
            "--out",
            str(root / "e001"),
        ],
        # Unit 1 of e002's smoke sweep is mis_dvp (pruning + sequence MIS + logit noise).
        "e002": [
            py,
            os.path.join(EXP, "launch.py"),
            os.path.join(EXP, "e002_methods.py"),
            "--root",
            str(root),
            "--only",
            "1",
        ],
        "e003": [
            py,
            os.path.join(EXP, "launch.py"),
            os.path.join(EXP, "e003_rho_ablation.py"),
            "--root",
            str(root),
        ],
    }
    procs = {
        name: subprocess.Popen(
            argv,
            cwd=REPO,
            env=_clean_env(DVP_SMOKE="1"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name, argv in jobs.items()
    }
    outputs = {}
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=600)
        outputs[name] = (proc.returncode, out)
    return root, outputs


def _finite(x) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)


# ------------------------------------------------------------------------------------------------
# Sweeps (no runs).
# ------------------------------------------------------------------------------------------------
def test_full_sweeps_expand_to_the_documented_units(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("DVP_SMOKE", raising=False)
    monkeypatch.setenv("DVP_INIT_HF", "/nonexistent/hf_export")
    exp = launch.load_experiment(os.path.join(EXP, "e002_methods.py"))
    methods = [dict(u.overrides)["method"] for u in exp.units]
    noisy = [dict(u.overrides) for u in exp.units if dict(u.overrides)["rollout.logit_noise"]]
    assert sorted({(o["method"], o["train.seed"]) for o in noisy}) == sorted(
        (m, s) for m in e002.METHODS for s in e002.SEEDS
    )
    assert methods.count("rloo") == 2 * len(e002.SEEDS)  # noisy + the no-noise reference
    for u in exp.units:
        ov = dict(u.overrides)
        assert ov["model.hf_path"] == "/nonexistent/hf_export" and ov["sft.steps"] == 0
        assert ov["train.steps"] == e002.STEPS
    exp3 = launch.load_experiment(os.path.join(EXP, "e003_rho_ablation.py"))
    rhos = {dict(u.overrides).get("loss.log_rho", "off") for u in exp3.units}
    assert rhos == {-8.0, -10.0, -13.0, -16.0, "off"}
    assert all(dict(u.overrides)["method"] == "dvp" for u in exp3.units)
    assert any(dict(u.overrides).get("loss.prune") is False for u in exp3.units)
    # The launcher's dry run prints one trainer command per unit and creates nothing.
    assert (
        launch.main([os.path.join(EXP, "e002_methods.py"), "--dry_run", "--root", str(tmp_path)])
        == 0
    )
    out = capsys.readouterr().out
    assert out.count("-m dvp_jax.main") == len(exp.units)
    assert "--config experiments/e002_methods.py:dvp" in out
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
    [unit] = [d for d in os.listdir(root / experiment) if not d.endswith(".json")]
    workdir = root / experiment / unit
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["steps"] == 2
    for key in (
        "start_eval_accuracy",
        "eval_accuracy",
        "final_ppl_gap",
        "final_frac_responses_excluded",
    ):
        assert _finite(summary[key]), key
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r["step"] > 0 and "loss" in r]
    assert len(rl) == 2 and all(_finite(r["ppl_gap"]) and _finite(r["loss"]) for r in rl)
    assert (workdir / "hf_export" / "config.json").exists()


def test_analyses_and_bias_check_on_smoke_outputs(smoke_runs, tmp_path):
    root, outputs = smoke_runs
    assert outputs["e002"][0] == 0 and outputs["e003"][0] == 0
    res2 = e002.analyse(str(root), str(tmp_path / "e002"), clean=False)
    assert list(res2) == ["MIS+DVP"] and (tmp_path / "e002" / "e002_methods.png").exists()
    assert "| MIS+DVP | 1 |" in (tmp_path / "e002" / "results.md").read_text()
    res3 = e003.analyse(str(root), str(tmp_path / "e003"), check=False)
    assert list(res3["rho"]) == ["-8"] and (tmp_path / "e003" / "e003_rho.png").exists()

    # The bias check at a threshold that prunes something, on the unit's exported policy.
    [unit] = [d for d in os.listdir(root / "e003_rho_ablation") if not d.endswith(".json")]
    hf = str(root / "e003_rho_ablation" / unit / "hf_export")
    [c] = e003.bias_check(hf, (-2.0,), num_prompts=8, samples=2)
    assert c["chain_ok"] and c["within_bound"]
    assert c["B2_E[sum delta]"] > 0 and abs(c["delta_hat"]) <= 1.0
