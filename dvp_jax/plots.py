"""End-of-run PNG plots from `<workdir>/metrics.jsonl` (host side, matplotlib Agg)."""

from __future__ import annotations

import io
import os
import re

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from dvp_jax.metrics import read_metrics, series  # noqa: E402
from dvp_jax.workdir import as_path  # noqa: E402


def _line(ax, rows, key, label=None, **kw):
    steps, values = series([r for r in rows if r["step"] >= 0], key)
    if steps:
        ax.plot(steps, values, label=label or key, **kw)


def lt_bins(rows, last: int = 10) -> dict[str, np.ndarray]:
    """Count-weighted mean of the (1-p) bin statistics over the last `last` RL steps."""
    rl = [r for r in rows if "lt_bin0_count" in r][-last:]
    if not rl:
        return {}
    num_bins = len([k for k in rl[0] if re.fullmatch(r"lt_bin\d+_count", k)])
    out = {"signed": [], "abs": [], "count": []}
    for b in range(num_bins):
        c = np.array([r[f"lt_bin{b}_count"] for r in rl])
        total = c.sum()
        out["count"].append(total)
        for stat, key in (("signed", "mean_signed"), ("abs", "mean_abs")):
            v = np.array([r[f"lt_bin{b}_{key}"] for r in rl])
            out[stat].append(float((v * c).sum() / total) if total else np.nan)
    return {k: np.asarray(v) for k, v in out.items()}


def plot_run(workdir: str | os.PathLike) -> list[str]:
    """Writes reward/accuracy, PPL gap, excluded fractions and (1-p) bin plots; returns paths.

    The workdir may be any epath (e.g. `gs://`): each PNG is rendered in memory, then written.
    """
    workdir = as_path(workdir)
    rows = read_metrics(workdir)
    if not rows:
        return []
    paths = []

    def save(fig, name):
        path = workdir / name
        fig.tight_layout()
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=110)
        plt.close(fig)
        path.write_bytes(png.getvalue())
        paths.append(os.fspath(path))

    fig, ax = plt.subplots(figsize=(6, 4))
    _line(ax, rows, "reward_mean", "train reward (rollouts)")
    _line(ax, rows, "eval_accuracy", "held-out accuracy avg@k", marker="o")
    ax.set(xlabel="RL step", ylabel="accuracy", title="Reward and held-out accuracy")
    ax.legend()
    save(fig, "reward_accuracy.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    _line(ax, rows, "ppl_gap", "pruned (objective)")
    _line(ax, rows, "full_ppl_gap", "unpruned")
    ax.set(
        xlabel="RL step", ylabel="rollout PPL - training PPL", title="Rollout vs training PPL gap"
    )
    ax.axhline(0, color="k", lw=0.5)
    ax.legend()
    save(fig, "ppl_gap.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    for key in (
        "frac_responses_excluded",
        "frac_responses_masked",
        "frac_tokens_masked",
        "frac_tokens_outside_train_safe",
    ):
        _line(ax, rows, key)
    ax.set(xlabel="RL step", ylabel="fraction", title="Excluded / masked")
    ax.legend(fontsize=8)
    save(fig, "excluded_fractions.png")

    bins = lt_bins(rows)
    if bins:
        k = len(bins["count"])
        centers = (np.arange(k) + 0.5) / k
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(centers, bins["abs"], marker="o", label="mean |l_t|")
        ax.plot(centers, bins["signed"], marker="s", label="mean signed l_t")
        ax.axhline(0, color="k", lw=0.5)
        ax.set(
            xlabel="1 - p (trainer probability of the sampled token)",
            ylabel="l_t = log pi - log mu",
            title="Token log-ratio by (1 - p) bin",
        )
        ax.legend()
        save(fig, "lt_by_p_bins.png")
    return paths
