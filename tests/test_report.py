"""The run's closing line says plainly whether RL improved held-out accuracy on the warm-up."""

from __future__ import annotations

from dvp_jax.train.report import summary_line

BASE = {"steps": 250, "method": "dvp", "wall_time_s": 84.0, "final_ppl_gap": 0.02}


def test_an_improvement_is_named_with_both_figures_and_the_points():
    line = summary_line({**BASE, "start_eval_accuracy": 0.123, "eval_accuracy": 0.16})
    assert "RL improved held-out accuracy 12.3% -> 16.0% (+3.7 points)" in line
    assert line.startswith("done: 250 RL steps (dvp)") and line.endswith("1m24s of training")


def test_no_change_or_a_loss_is_not_an_improvement():
    same = summary_line({**BASE, "start_eval_accuracy": 0.102, "eval_accuracy": 0.10204})
    assert "RL did not improve held-out accuracy 10.2% -> 10.2% (+0.0 points)" in same
    worse = summary_line({**BASE, "start_eval_accuracy": 0.2, "eval_accuracy": 0.15})
    assert "RL did not improve held-out accuracy 20.0% -> 15.0% (-5.0 points)" in worse


def test_without_evaluations_the_line_makes_no_claim():
    line = summary_line(BASE)
    assert "improve" not in line and "ppl_gap 0.0200" in line
