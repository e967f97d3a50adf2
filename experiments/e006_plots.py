"""e006's figures from results/e006/units: the per-step mismatch of each arm (seeds faint, the
mean over the seeds present bold) and held-out accuracy per arm. Works on partial data: an arm
with no record is left out, a mean is over the runs (and steps) that exist.

Command (from the repository root): python -m experiments.e006_plots --out experiments/results/e006
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from experiments import e006_verdict as rules
from experiments.analyze import pyplot

COLORS = {
    "rloo_fp32": "tab:gray",
    "rloo_M3": "tab:red",
    "dvp_M3": "tab:blue",
    "mis_dvp_M3": "tab:green",
    "icepop_M3": "tab:purple",
}
TITLES = {
    rules.PRIMARY: "mean log mu - log pi of sampled tokens (full_kl_k1)",
    rules.SECONDARY: "log-PPL gap (full_log_ppl_diff)",
}


def _mean_curve(runs: list[dict], metric: str) -> tuple[np.ndarray, np.ndarray]:
    """Mean over the runs at each step that every run present has reached."""
    n = min(len(r["steps_logged"]) for r in runs)
    ys = np.array([[np.nan if v is None else v for v in r["curves"][metric][:n]] for r in runs])
    return np.asarray(runs[0]["steps_logged"][:n]), np.nanmean(ys, axis=0)


def plot_mismatch(units: dict, path: str) -> None:
    plt = pyplot()
    metrics = (rules.PRIMARY, rules.SECONDARY)
    fig, axes = plt.subplots(1, len(metrics) + 1, figsize=(15, 4))
    for ax, metric in zip(axes, metrics, strict=False):
        for arm, color in COLORS.items():
            runs = [u for u in units.values() if u["arm"] == arm and u["steps_logged"]]
            for r in runs:
                ys = [np.nan if v is None else v for v in r["curves"][metric]]
                ax.plot(r["steps_logged"], ys, color=color, alpha=0.25, lw=0.8)
            if runs:
                x, m = _mean_curve(runs, metric)
                ax.plot(x, m, color=color, lw=2.2, label=f"{arm} ({len(runs)} seeds)")
        ax.axhline(0, color="k", lw=0.5)
        ax.set(title=TITLES[metric], xlabel="RL step", ylabel="nats per token")
    ax = axes[-1]
    for arm, color in COLORS.items():
        runs = [u for u in units.values() if u["arm"] == arm and u["evals"]]
        for r in runs:
            s, a = zip(*r["evals"], strict=True)
            ax.plot(s, a, color=color, alpha=0.25, marker="o", lw=0.8)
        if runs:
            steps = sorted(set.intersection(*[{s for s, _ in r["evals"]} for r in runs]))
            mean = [np.mean([dict(map(tuple, r["evals"]))[s] for r in runs]) for s in steps]
            ax.plot(steps, mean, color=color, lw=2.2, marker="o", label=arm)
    ax.set(title="held-out avg@16 (fp32 engine)", xlabel="RL step", ylabel="accuracy")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    tmp = f"{path}.{os.getpid()}.tmp.png"  # whole or not at all, lanes side by side
    fig.savefig(tmp, dpi=80)
    os.replace(tmp, path)
    plt.close(fig)


def plot_all(out: str) -> None:
    units = rules.load_units(out)
    if units:
        plot_mismatch(units, os.path.join(out, "e006_mismatch.png"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="experiments/results/e006")
    args = p.parse_args(argv)
    plot_all(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
