"""e006 (experiments/e006_verdict.py, e006_plots.py): each pre-registered outcome on synthetic
run records, and the plots on partial data; and the CPU tier's runner end to end at CI sizes
(`e006_premise --smoke`: one IcePop run at M3, trained, resumed and recorded)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from experiments import e006_verdict as v
from tests.helpers import assert_close_tree


def _rec(arm, seed, start, growth, acc=(0.15, 0.2), steps=v.STEPS, noise=0.0):
    """A run whose primary and secondary series rise linearly by `growth` over STEPS steps."""
    rng = np.random.default_rng(seed)
    t = np.arange(1, steps + 1)
    y = start + growth * t / v.STEPS + noise * rng.standard_normal(steps)
    curves = {k: [None] * steps for k in ("reward_mean",)}
    curves |= {v.PRIMARY: y.tolist(), v.SECONDARY: (2 * y).tolist()}
    return {
        "run": f"{arm}_s{seed}",
        "arm": arm,
        "seed": seed,
        "steps": steps,
        "steps_logged": t.tolist(),
        "curves": curves,
        "evals": [[0, acc[0]], [steps, acc[1]]],
    }


def _units(growth_m3, growth_methods=None, acc_m3=0.2):
    units = {}
    for s in v.SEEDS:
        g = growth_m3[s] if isinstance(growth_m3, list | tuple) else growth_m3
        units[f"rloo_fp32_s{s}"] = _rec("rloo_fp32", s, 1e-8, 0.0)
        units[f"rloo_M3_s{s}"] = _rec("rloo_M3", s, 4e-4, g, acc=(0.15, acc_m3))
        for arm, gm in (growth_methods or {}).items():
            units[f"{arm}_s{s}"] = _rec(arm, s, 4e-4, gm)
    return units


def test_premise_appears_when_growth_is_material_in_every_seed():
    res = v.verdict_from_units(_units([2e-4, 2.2e-4, 1.8e-4], {"dvp_M3": 0.0, "mis_dvp_M3": 2e-4}))
    assert res["premise"] == "the premise appears at this scale"
    rel = res["metrics"][v.PRIMARY]["relative_excess_growth_rloo_M3"]
    # 2e-4 over the start level, the mean of steps 1..10: 4e-4 + 2e-4 x 5.5 / 100
    assert rel["mean"] == pytest.approx(2e-4 / (4e-4 + 2e-4 * 0.055), rel=1e-6)
    assert res["methods"]["dvp_M3"] == "removes the growth"
    assert res["methods"]["mis_dvp_M3"] == "does not remove it"
    assert res["methods"]["icepop_M3"] == "incomplete"  # no records


def test_null_outcome_when_the_growth_bound_is_small():
    res = v.verdict_from_units(_units([1e-5, -1e-5, 2e-5], {"dvp_M3": 0.0}))
    assert res["premise"] == "the premise does not appear at this scale"
    assert res["methods"]["dvp_M3"] == "nothing to remove (premise absent)"
    drop = res["heldout"]["drop_rloo_M3_vs_fp32"]
    assert drop["mean"] == pytest.approx(0.0) and drop["n"] == 3


def test_inconclusive_when_the_interval_straddles_the_threshold_and_incomplete_runs():
    res = v.verdict_from_units(_units([2e-4, -1e-4, 1e-4]))
    assert res["premise"] == "inconclusive"
    units = _units([2e-4, 2e-4, 2e-4])
    units["rloo_M3_s2"] = _rec("rloo_M3", 2, 4e-4, 2e-4, steps=50)  # half a run: not read
    res = v.verdict_from_units(units)
    assert res["premise"] == "incomplete" and "rloo_M3_s2" not in res["complete_runs"]


def test_reading_pairs_each_method_with_rloo_by_seed_and_takes_out_the_start_offset():
    units = _units([2e-4, 3e-4, 4e-4], {"dvp_M3": 1e-4})
    for s in v.SEEDS:  # per seed: DVP starts 0.01 below RLOO and gains 0.01 x (s + 1) more
        start = 0.1 + 0.02 * s
        units[f"rloo_M3_s{s}"]["evals"] = [[0, start], [v.STEPS, start + 0.05]]
        units[f"dvp_M3_s{s}"]["evals"] = [[0, start - 0.01], [v.STEPS, start + 0.05 + 0.01 * s]]
    res = v.verdict_from_units(units)
    m0 = abs(res["metrics"][v.PRIMARY]["start_level_rloo_M3"])
    growth = res["reading"]["paired_growth_vs_rloo_M3"]["dvp_M3"]
    assert growth["values"] == pytest.approx([(1e-4 - g) / m0 for g in (2e-4, 3e-4, 4e-4)])
    gain = res["reading"]["heldout_gain_vs_rloo_M3"]["dvp_M3"]
    assert gain["values"] == pytest.approx([0.01, 0.02, 0.03]) and gain["n"] == 3
    # The rule's step-100 difference carries the start offset the gain takes out.
    step100 = res["heldout"]["gain_vs_rloo_M3"]["dvp_M3"]
    assert step100["values"] == pytest.approx([0.0, 0.01, 0.02])
    assert res["reading"]["start_acc"]["dvp_M3_s1"] == pytest.approx(0.11)
    assert res["reading"]["paired_growth_vs_rloo_M3"]["icepop_M3"]["n"] == 0


def test_growth_is_the_least_squares_slope_times_the_horizon():
    assert v.growth([1, 2, 3, 4], [1.0, 1.5, 2.0, 2.5], horizon=100) == pytest.approx(50.0)
    assert v.start_level(list(range(20))) == pytest.approx(4.5)


def test_plots_work_on_partial_data(tmp_path):
    import os

    from experiments import e006_plots

    units = _units([2e-4, 2e-4, 2e-4])
    os.makedirs(tmp_path / "units")
    for name, rec in list(units.items())[:3]:  # seed 0's fp32, seed 0's M3, seed 1's fp32
        (tmp_path / "units" / f"{name}.json").write_text(json.dumps(rec))
    e006_plots.plot_all(str(tmp_path))
    assert (tmp_path / "e006_mismatch.png").stat().st_size > 0
    assert not (tmp_path / "verdict.md").exists()  # no verdict.json yet: no tables


def test_tables_render_the_verdict_not_a_copy_of_it(tmp_path):
    """verdict.md is rendered from verdict.json: the outcome strings and the interval of r_s
    appear as the rules computed them, and a missing seed shows as "-"."""
    from experiments import e006_plots

    units = _units([4e-4, 3e-4, 5e-4], {"dvp_M3": 1e-5, "mis_dvp_M3": 4e-4})
    result = v.verdict_from_units(units)
    (tmp_path / "verdict.json").write_text(json.dumps(result))
    e006_plots.plot_all(str(tmp_path))
    md = (tmp_path / "verdict.md").read_text()
    r = result["metrics"][v.PRIMARY]["relative_excess_growth_rloo_M3"]
    assert result["premise"] == "the premise appears at this scale"
    assert f"{r['mean']:.3g} [{r['lo']:.3g}, {r['hi']:.3g}] (n = 3)" in md
    assert "| dvp_M3 | `full_kl_k1` |" in md and "removes the growth" in md
    assert "does not remove it" in md  # mis_dvp keeps RLOO's growth
    assert "| icepop_M3 | - | - | - |" in md  # no icepop record
    g = result["reading"]["paired_growth_vs_rloo_M3"]["dvp_M3"]
    assert f"| dvp_M3 | {g['mean']:.3g} [{g['lo']:.3g}, {g['hi']:.3g}] (n = 3) |" in md


def test_run_record_keeps_earlier_segment_evaluations_and_one_row_per_step(tmp_path):
    """A resumed segment rewrites metrics.jsonl from its checkpoint (earlier evaluation rows
    gone, replayed steps logged again): the record keeps the previous evaluations and one row
    per step."""
    from experiments.e006_premise import run_record

    (tmp_path / "summary.json").write_text(json.dumps({"steps": 4}))
    rows = [{"step": 0, "eval_accuracy": 0.1}]
    rows += [{"step": s, "loss": 0.0, v.PRIMARY: s * 1e-4} for s in (1, 2, 3, 3, 4)]
    rows += [{"step": 4, "eval_accuracy": 0.3}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rec = run_record(str(tmp_path), "rloo_M3", 0, [1.0, 2.0], evals_before=[[0, 0.1], [2, 0.2]])
    assert rec["evals"] == [[0, 0.1], [2, 0.2], [4, 0.3]]
    assert rec["steps_logged"] == [1, 2, 3, 4] and rec["curves"][v.PRIMARY][-1] == 4e-4


def test_lanes_split_the_runs_without_sharing_one():
    from experiments import e006_premise as p

    runs = {p.run_name(a, s) for a, s, _ in p.unit_order()}
    for n in (1, 2, 3):
        lanes = [p.lane_runs(f"{i}/{n}") for i in range(n)]
        assert set().union(*lanes) == runs
        assert sum(len(x) for x in lanes) == len(runs)  # disjoint
    # The premise runs alternate between two lanes, so both start on the premise.
    assert {"rloo_fp32_s2", "rloo_M3_s2"} & p.lane_runs("0/2") == {"rloo_fp32_s2"}
    for bad in ("2/2", "x", "1/0", "-1/2"):
        with pytest.raises(SystemExit, match="--lane"):
            p.lane_runs(bad)


def test_premise_smoke_trains_an_icepop_run_at_m3_into_its_own_folder(tmp_path, capsys):
    """The runner end to end at CI sizes (a random model, 2 RL steps): the record holds both
    steps of the M3 mismatch (well above fp32's rounding level) and IcePop's masked fraction;
    the verdict and plot go under --root, and the committed results folder is refused."""
    from experiments import e006_premise as p

    assert p.main(["--smoke", "--root", str(tmp_path)]) == 0
    rec = json.loads((tmp_path / "results" / "units" / "icepop_M3_s0.json").read_text())
    assert rec["steps_logged"] == [1, 2] and rec["method"] == "icepop"
    assert all(m > 1e-5 for m in rec["curves"][v.PRIMARY])  # M3's rounding, not fp32's ~1e-9
    assert all(0.0 <= f <= 1.0 for f in rec["curves"]["frac_tokens_masked"])
    assert [s for s, _ in rec["evals"]] == [0, 2]
    assert json.loads((tmp_path / "results" / "verdict.json").read_text())["premise"]
    assert "icepop_M3_s0 to step 2: ok" in capsys.readouterr().out
    assert p.main(["--smoke", "--root", str(tmp_path)]) == 0  # done: nothing reruns
    assert "to step" not in capsys.readouterr().out
    with pytest.raises(SystemExit):
        p.main(["--smoke", "--root", str(tmp_path), "--out", p.OUT])


@pytest.mark.committed_results
def test_readme_quotes_the_committed_verdict():
    """experiments/README.md's e006 tables are verdict.md's, which are rendered from the
    committed verdict.json, which the rules give on the committed records: no figure is typed.

    The recomputed verdict is another machine's figures: it matches the committed one to
    tests.helpers' RESULT_RTOL / RESULT_ATOL (labels exactly); the tables are the rendering of
    the committed figures, so they are compared exactly."""
    import os

    from experiments import e006_plots

    root = os.path.join(os.path.dirname(__file__), "..")
    out = os.path.join(root, "experiments", "results", "e006")
    result = v.verdict_from_units(v.load_units(out))
    with open(os.path.join(out, "verdict.json")) as fh:
        committed = json.load(fh)
    assert_close_tree(json.loads(json.dumps(result)), committed)
    md = e006_plots.tables(committed)
    with open(os.path.join(out, "verdict.md")) as fh:
        assert fh.read().endswith(md)
    with open(os.path.join(root, "experiments", "README.md")) as fh:
        readme = fh.read()
    assert e006_plots.readme_block(readme, md) == readme


def test_a_complete_record_is_done_without_its_workdir_and_a_partial_one_starts_over(tmp_path):
    from experiments import e006_premise as p

    root, out = str(tmp_path / "root"), str(tmp_path / "out")
    (tmp_path / "out" / "units").mkdir(parents=True)
    for run, steps in (("rloo_M3_s0", p.STEPS), ("dvp_M3_s1", 3 * p.UNIT_STEPS)):
        (tmp_path / "out" / "units" / f"{run}.json").write_text(json.dumps({"steps": steps}))
    order = p.unit_order()
    todo, notes = p.pending(order, root, out)
    runs = [p.run_name(a, s) for a, s, _ in todo]
    assert "rloo_M3_s0" not in runs  # its record is the result; the checkpoint only resumed it
    per_run = [p.run_name(a, s) for a, s, _ in order].count("dvp_M3_s1")
    assert runs.count("dvp_M3_s1") == per_run  # every segment again, from step 0
    assert len(todo) == len(order) - per_run
    assert notes == [
        f"[e006] dvp_M3_s1: its record reaches step {3 * p.UNIT_STEPS} but its workdir under "
        f"{root} is gone; rerunning it from step 0"
    ]


def test_a_rerun_from_step_0_keeps_nothing_of_the_old_record_and_a_resume_keeps_its_own(
    tmp_path, monkeypatch
):
    """run_segment's bookkeeping, with the launcher replaced by a stand-in that writes what a
    segment writes (summary.json, metrics.jsonl rows; the real launch is the smoke test's)."""
    import os
    from types import SimpleNamespace

    from experiments import e006_premise as p

    root, out = tmp_path / "root", tmp_path / "out"
    old = {"steps": 75, "evals": [[0, 0.1], [25, 0.2], [50, 0.3], [75, 0.4]]}
    old["segment_seconds"] = [1.0, 2.0, 3.0]
    (out / "units").mkdir(parents=True)
    record = out / "units" / "rloo_M3_s0.json"
    record.write_text(json.dumps(old))

    def run_unit(exp, unit, workdir, timeout):
        os.makedirs(workdir, exist_ok=True)
        start = p.reached(str(root), "rloo_M3", 0)
        rows = [{"step": 0, "eval_accuracy": 0.5}] if start == 0 else []
        rows += [{"step": t, "loss": 0.0, v.PRIMARY: 1e-4} for t in range(start + 1, exp.end + 1)]
        rows += [{"step": exp.end, "eval_accuracy": 0.5 + exp.end / 1000}]
        with open(os.path.join(workdir, "metrics.jsonl"), "a") as fh:
            fh.write("".join(json.dumps(r) + "\n" for r in rows))
        with open(os.path.join(workdir, "summary.json"), "w") as fh:
            json.dump({"steps": exp.end}, fh)
        return SimpleNamespace(ok=True)

    def load_experiment(path, sweep):
        return SimpleNamespace(end=sweep["steps"], units=[SimpleNamespace(name="0_rloo_M3_s0")])

    monkeypatch.setattr(p.sweeps, "load_experiment", load_experiment)
    monkeypatch.setattr(p.local, "run_unit", run_unit)
    # The workdir is gone: the rerun from step 0 takes no time or evaluation from the old record.
    _, rec = p.run_segment(str(root), str(out), "rloo_M3", 0, 25, "")
    assert rec["evals"] == [[0, 0.5], [25, 0.525]] and len(rec["segment_seconds"]) == 1
    # Resuming keeps the record's own earlier segments.
    _, rec = p.run_segment(str(root), str(out), "rloo_M3", 0, 50, "")
    assert rec["evals"] == [[0, 0.5], [25, 0.525], [50, 0.55]] and len(rec["segment_seconds"]) == 2
    # A record ahead of the workdir it resumes (a segment died before rewriting the record) gives
    # up its later evaluations and its times.
    record.write_text(json.dumps(old))
    _, rec = p.run_segment(str(root), str(out), "rloo_M3", 0, 75, "")
    assert [s for s, _ in rec["evals"]] == [0, 25, 50, 75] and rec["evals"][-1] == [75, 0.575]
    assert len(rec["segment_seconds"]) == 1 and rec["steps_logged"] == list(range(1, 76))


def test_reading_labels_hold_the_outcomes_to_what_the_design_could_detect():
    """Issue 46: a method whose paired interval contains 0 reads "no effect detectable", a premise
    pass whose lower end is below the materiality threshold reads "a narrow pass without a
    weight-drift control", the rule outcomes themselves unchanged."""
    noisy = _units([4e-4, 1.2e-3, 2e-4], {"dvp_M3": 1e-3, "icepop_M3": 0.0}, acc_m3=0.2)
    res = v.verdict_from_units(noisy)
    lab = res["reading"]["labels"]
    assert res["premise"] in ("the premise appears at this scale", "inconclusive")
    if res["premise"] == "the premise appears at this scale":
        assert lab["premise"].startswith(v.NARROW_PASS)
    assert v.NO_DEGRADATION in lab["premise"]  # held-out the same for fp32 and M3
    # Every seed's DVP growth is 1e-3 while RLOO M3's varies: the paired interval straddles 0.
    assert lab["methods"]["dvp_M3"]["label"] == v.NO_EFFECT
    assert lab["methods"]["dvp_M3"]["resolves_half"] is False
    # A method with a consistent growth far below RLOO M3's every seed: an effect is detected.
    clean = v.verdict_from_units(_units(1e-3, {"dvp_M3": 0.0}))
    assert clean["reading"]["labels"]["methods"]["dvp_M3"]["label"] == "an effect detected"
    assert clean["reading"]["labels"]["methods"]["icepop_M3"]["label"] == "incomplete"


def test_records_carry_the_code_version(tmp_path):
    from experiments.provenance import code_version

    here = code_version()
    assert set(here) >= {"commit", "dirty"}
    assert here["commit"] is None or len(here["commit"]) == 40
    gone = code_version(str(tmp_path))  # not a git checkout: no commit, the reason given
    assert gone["commit"] is None and "error" in gone
