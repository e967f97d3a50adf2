"""The end-of-run plots (dvp_jax/plots.py) of the shared tiny run: which panels, titles, axes
and lines each figure has, their data against the run's metrics, and the PNG files."""

from __future__ import annotations

import json

import matplotlib.image
import matplotlib.pyplot as plt
import numpy as np
import pytest

from dvp_jax import plots
from dvp_jax.metrics import series


def _longer(rows, times: int) -> list[dict]:
    """The run's rows with its RL steps repeated `times` times (steps renumbered), so the
    curves are long enough to be smoothed."""
    warm_and_start = [r for r in rows if r["step"] <= 0]
    rl = [r for r in rows if r["step"] > 0 and "loss" in r]
    return warm_and_start + [
        {**r, "step": i * len(rl) + r["step"]} for i in range(times) for r in rl
    ]


def test_trailing_mean_matches_a_loop():
    values = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0]
    expected = [np.mean(values[max(0, i - 2) : i + 1]) for i in range(len(values))]
    np.testing.assert_allclose(plots.trailing_mean(values, 3), expected, rtol=1e-12)
    assert plots.window(6) == 1 and plots.window(250) == 17 and plots.window(10_000) == 25


def test_the_dashboard_of_a_run_names_it_and_has_its_panels(tiny_run):
    rows = tiny_run.rows()
    config = json.loads((tiny_run.workdir / "config.json").read_text())
    figs = plots.figures(rows, config, "run 1")
    try:
        assert list(figs) == [
            "dashboard.png",
            "reward_accuracy.png",
            "ppl_gap.png",
            "excluded_fractions.png",
            "policy.png",
            "warmup.png",
            "lt_by_p_bins.png",
        ]
        for fig in figs.values():  # every title names the method, rollout dtype, trainer policy
            assert fig._suptitle.get_text() == "run 1: dvp | rollout bfloat16 | trainer float32"
        dash = figs["dashboard.png"]
        reward, gap, warm, entropy, length, grad, start_acc = dash.axes  # the last: a twin
        assert [a.get_title() for a in (reward, gap, warm, entropy, length, grad)] == [
            "Reward and held-out accuracy",
            "Rollout vs training PPL gap (log)",
            "Supervised warm-up (before RL)",
            "Policy entropy",
            "Response length",
            "Gradient norm",
        ]
        assert gap.get_yscale() == "log" and reward.get_yscale() == "linear"

        # Pruned and unpruned gaps: one line each (6 steps: no smoothing window), told apart by
        # colour and line style and named in the legend; the data are the run's.
        pruned, unpruned = gap.get_lines()
        assert pruned.get_linestyle() != unpruned.get_linestyle()
        assert pruned.get_color() != unpruned.get_color()
        assert [t.get_text() for t in gap.get_legend().get_texts()] == [
            "pruned (objective)",
            "unpruned",
        ]
        train = [r for r in rows if r["step"] > 0 and "loss" in r]
        for line, key in ((pruned, "ppl_gap"), (unpruned, "full_ppl_gap")):
            steps, values = series(train, key)
            np.testing.assert_array_equal(line.get_xdata(), steps)
            np.testing.assert_allclose(line.get_ydata(), values)

        # Held-out accuracy at every evaluation (0, 2, 4 and the final one at 6).
        acc = next(ln for ln in reward.get_lines() if ln.get_label() == "held-out avg@k")
        np.testing.assert_array_equal(acc.get_xdata(), [0, 2, 4, 6])
        np.testing.assert_allclose(acc.get_ydata(), series(rows, "eval_accuracy")[1])

        # The warm-up is drawn before step 0, with the accuracy it reached at step 0.
        [loss, zero] = warm.get_lines()
        assert list(zero.get_xdata()) == [0, 0]  # the vertical line at step 0
        np.testing.assert_array_equal(loss.get_xdata(), [-2, -1])
        np.testing.assert_allclose(loss.get_ydata(), series(rows, "sft_loss")[1])
        [star] = start_acc.get_lines()
        assert star.get_xdata()[0] == 0 and star.get_ydata()[0] == rows[2]["eval_accuracy"]
        for ax, key in ((entropy, "entropy"), (length, "response_length"), (grad, "grad_norm")):
            [line] = ax.get_lines()
            np.testing.assert_allclose(line.get_ydata(), series(train, key)[1])
    finally:
        for fig in figs.values():
            plt.close(fig)


def test_a_longer_run_draws_raw_values_faint_under_their_trailing_mean(tiny_run):
    rows = _longer(tiny_run.rows(), 8)  # 48 RL steps: a 3-step window
    fig = plots.dashboard(rows, {"method": "rloo", "rollout.dtype": "float32"})
    try:
        assert fig._suptitle.get_text() == "rloo | rollout float32 | trainer ?"
        gap = fig.axes[1]
        raw, mean, full_raw, full_mean = gap.get_lines()
        assert raw.get_alpha() < 1 and mean.get_alpha() is None
        assert raw.get_linestyle() == mean.get_linestyle() != full_mean.get_linestyle()
        _, values = series([r for r in rows if r["step"] > 0], "ppl_gap")
        np.testing.assert_allclose(raw.get_ydata(), values)
        median = [np.median(values[max(0, i - 2) : i + 1]) for i in range(len(values))]
        np.testing.assert_allclose(mean.get_ydata(), median, rtol=1e-12)
        assert mean.get_label() == "pruned (objective) (3-step median)"
        [_, entropy] = fig.axes[3].get_lines()  # the other curves: trailing means
        _, values = series([r for r in rows if r["step"] > 0], "entropy")
        np.testing.assert_allclose(entropy.get_ydata(), plots.trailing_mean(values, 3))
    finally:
        plt.close(fig)


def test_plot_run_writes_the_dashboard_first_and_every_png(tiny_run, tmp_path):
    workdir = tiny_run.copy_to(tmp_path / "run")
    paths = plots.plot_run(workdir)
    assert [p.rsplit("/", 1)[1] for p in paths][:2] == ["dashboard.png", "reward_accuracy.png"]
    assert len(paths) == 7
    height, width, _ = matplotlib.image.imread(paths[0]).shape
    assert (width, height) == pytest.approx((16 * plots.DPI, 8.5 * plots.DPI), abs=2)
    assert plots.plot_run(tmp_path / "empty") == []  # no metrics: nothing to plot


def test_a_partial_run_s_dashboard_splits_the_mismatch_by_staleness(tiny_run):
    """With the per-age metrics of partial rollouts (rollout.partial), the dashboard's last
    panel is the mismatch by staleness: age 0 and older tokens, and the share of age 0."""
    rows = [dict(r) for r in tiny_run.rows()]
    for r in rows:
        if "loss" in r:
            r.update(mismatch_abs_age0=0.01, mismatch_abs_stale=0.04, age_share_0=0.75)
    fig = plots.dashboard(rows, {"method": "dvp", "rollout.dtype": "bfloat16"})
    try:
        titles = [a.get_title() for a in fig.axes]
        assert "Mismatch by staleness" in titles and "Gradient norm" not in titles
        panel = fig.axes[titles.index("Mismatch by staleness")]
        labels = [line.get_label() for line in panel.get_lines()]
        assert labels == ["age 0 (precision)", "age >= 1 (precision + lag)"]
    finally:
        plt.close(fig)
