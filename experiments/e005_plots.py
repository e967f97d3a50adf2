"""e005's figures from results/e005/units and verdict.json: the per-bin d with its control per
rung, E[L_T] against T, and the gradient bias / MSE per method. Computes no figure of its own
beyond what e005_verdict.py reads.

Command (from the repository root): python -m experiments.e005_plots --out experiments/results/e005
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import numpy as np

from experiments import e005_verdict as rules
from experiments.analyze import pyplot


def plot_bins(rungs: dict, path: str) -> None:
    """Mean d (± 1.96 s.e.) per trainer-probability bin: sampled, sampled through the
    teacher-forced rollout path, and the reference (control) tokens; one panel per rung."""
    plt = pyplot()
    names = [r for r in rules.RUNGS if r in rungs]
    fig, axes = plt.subplots(1, max(len(names), 1), figsize=(4.5 * max(len(names), 1), 3.6))
    for ax, r in zip(np.atleast_1d(axes), names, strict=False):
        for part, marker in (("sampled", "o"), ("sampled_tf", "^"), ("reference", "s")):
            rows = [b for b in rungs[r]["bins"].get(part, []) if b["se"] is not None]
            x = [math.sqrt(max(b["p_lo"], 1e-6) * b["p_hi"]) for b in rows]
            y = [b["mean_d"] for b in rows]
            e = [rules.Z95 * b["se"] for b in rows]
            ax.errorbar(x, y, yerr=e, marker=marker, capsize=3, label=part)
        ax.axhline(0, color="k", lw=0.5)
        ax.set(xscale="log", title=r, xlabel="trainer probability p of the token")
    np.atleast_1d(axes)[0].set_ylabel("d = log mu - log pi (95% CI)")
    np.atleast_1d(axes)[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot_accumulation(units: dict, path: str) -> None:
    """E[L_T] (= -E[D_T]) and its spread against T per rung, from the sample chunks."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))  # the real rungs; M0 and M4 (own scale)
    for r in ("M0", *rules.RUNGS):
        chunks = [u for n, u in units.items() if n.startswith(f"sample_{r}_c")]
        if not chunks:
            continue
        ax = axes[1] if r in ("M0", "M4") else axes[0]
        acc = rules.merge_chunks(chunks)["accumulation"]
        t = np.asarray(acc["T"])
        n_resp = sum(c["responses"] for c in chunks)
        s, sq = (np.asarray(acc["D"][k]).sum(0) for k in ("sum", "sum_sq"))
        mean = -s / n_resp
        std = np.sqrt(np.maximum(sq / n_resp - (s / n_resp) ** 2, 0))
        ax.errorbar(t, mean, yerr=std / math.sqrt(n_resp), marker="o", capsize=2, label=r)
    for ax, title in zip(axes, ("real rungs", "M0 and the synthetic M4"), strict=True):
        ax.axhline(0, color="k", lw=0.5)
        ax.set(xlabel="T (response tokens)", ylabel="E[L_T] (± s.e.)", title=title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot_gradients(units: dict, path: str) -> None:
    """Relative bias (95% CI) and relative MSE per method and T, one row per rung."""
    plt = pyplot()
    recs = [units[f"grad_{r}"] for r in rules.RUNGS if f"grad_{r}" in units]
    fig, axes = plt.subplots(max(len(recs), 1), 2, figsize=(11, 3.2 * max(len(recs), 1)))
    axes = np.atleast_2d(axes)
    for row, rec in zip(axes, recs, strict=False):
        for j, t in enumerate(rules.T_GRID):
            per = rec["T"][str(t)]
            x = np.arange(len(rules.METHODS)) + 0.25 * (j - 1)
            # An undefined bias (the reference's norm below its noise) is drawn as 0, no bar.
            bias = np.nan_to_num([per[m]["rel_bias"] for m in rules.METHODS])
            ci = np.nan_to_num([per[m]["rel_bias_ci95"] for m in rules.METHODS])  # [M, 2]
            err = np.clip([bias - ci[:, 0], ci[:, 1] - bias], 0, None)
            row[0].bar(x, bias, 0.25, yerr=err, capsize=2, label=f"T={t}")
            row[1].bar(x, [per[m]["rel_mse"] or 0 for m in rules.METHODS], 0.25, label=f"T={t}")
        for ax, title in zip(row, ("relative bias", "relative MSE"), strict=True):
            ax.set_xticks(range(len(rules.METHODS)), rules.METHODS)
            ax.set_title(f"{rec['rung']}: {title}")
        row[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot_all(out: str) -> None:
    import json

    units = rules.load_units(out)
    with open(os.path.join(out, "verdict.json")) as fh:
        rungs = json.load(fh)["rungs"]
    plot_bins(rungs, os.path.join(out, "e005_bins.png"))
    plot_accumulation(units, os.path.join(out, "e005_accumulation.png"))
    plot_gradients(units, os.path.join(out, "e005_gradients.png"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="experiments/results/e005")
    plot_all(p.parse_args(argv).out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
