"""e007's figures from results/e007/units and its tables from verdict.json (never typed by hand).

`plot_mismatch`: per arm, the per-step mismatch of the sampled tokens inside and outside the
trainer's safe set (full_kl_k1_inside / _outside; seeds faint, the mean over the seeds present
bold), the weight-drift control beside RLOO fp32, and held-out accuracy. `tables`: verdict.md.
Works on partial data. The gate's distribution plot is e007_gate's (e007_gate.png).

Command (from the repository root): python -m experiments.e007_plots --out experiments/results/e007
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from dvp_jax.workdir import write_atomic
from experiments import e007_verdict as rules
from experiments.analyze import markdown_table, pyplot
from experiments.records import fmt_interval, fmt_num, mean_curve

COLORS = {
    "rloo_fp32": "tab:gray",
    "rloo_M3": "tab:red",
    "dvp_M3": "tab:blue",
    "mis_dvp_M3": "tab:green",
    "icepop_M3": "tab:purple",
}
PANELS = (
    ("full_kl_k1_inside", "log mu - log pi, tokens inside the safe set (per response token)"),
    ("full_kl_k1_outside", "log mu - log pi, tokens outside the safe set (per response token)"),
    ("frac_tokens_outside_safe", "sampled tokens outside the trainer's e^-13 safe set"),
)


def plot_mismatch(units: dict, path: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(PANELS) + 1, figsize=(19, 4))
    for ax, (metric, title) in zip(axes, PANELS, strict=False):
        for arm, color in COLORS.items():
            runs = [u for u in units.values() if u["arm"] == arm and u["steps_logged"]]
            for r in runs:
                ys = [np.nan if v is None else v for v in r["curves"][metric]]
                ax.plot(r["steps_logged"], ys, color=color, alpha=0.2, lw=0.8)
            if runs:
                x, m = mean_curve(runs, metric)
                ax.plot(x, m, color=color, lw=2.2, label=f"{arm} ({len(runs)} seeds)")
        if metric != "frac_tokens_outside_safe":  # the control: M3 on the fp32 arm's weights
            key = metric.replace("full_kl_k1_", "full_kl_k1_")
            for u in units.values():
                pts = [(c["step"], c[key]) for c in u.get("control", []) if key in c]
                if pts:
                    ax.plot(*zip(*pts, strict=True), color="k", ls=":", marker="x", alpha=0.5)
        ax.axhline(0, color="k", lw=0.5)
        ax.set(title=title, xlabel="RL step")
        ax.title.set_fontsize(8)
    ax = axes[-1]
    for arm, color in COLORS.items():
        runs = [u for u in units.values() if u["arm"] == arm and u["evals"]]
        for r in runs:
            s, a = zip(*r["evals"], strict=True)
            ax.plot(s, a, color=color, alpha=0.2, marker="o", lw=0.8)
        if runs:
            steps = sorted(set.intersection(*[{s for s, _ in r["evals"]} for r in runs]))
            mean = [np.mean([dict(map(tuple, r["evals"]))[s] for r in runs]) for s in steps]
            ax.plot(steps, mean, color=color, lw=2.2, marker="o", label=arm)
    ax.set(title="held-out avg@k (fp32 engine)", xlabel="RL step", ylabel="accuracy")
    axes[0].legend(fontsize=7)
    axes[1].plot([], [], color="k", ls=":", marker="x", label="control: M3 on fp32's weights")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    tmp = f"{path}.{os.getpid()}.tmp.png"  # whole or not at all, lanes side by side
    fig.savefig(tmp, dpi=80)
    os.replace(tmp, path)
    plt.close(fig)


def tables(verdict: dict) -> str:
    """verdict.json as markdown: the gate, the premise with its control, each method, held-out."""
    g = verdict["gate"]
    f = g["figures"]
    md = [
        f"**Gate** ({g['status']}): "
        + (
            f"{fmt_num(f.get('outside_share'))} of sampled tokens outside the trainer's safe set "
            f"(>= {rules.GATE_MIN_OUTSIDE}), the tail carrying {fmt_num(f.get('tail_abs_share'))} "
            f"of sum |log mu - log pi| (>= {rules.GATE_MIN_TAIL_SHARE})."
            if f
            else "not measured."
        ),
        f"\nComplete runs ({rules.STEPS} steps): {len(verdict['complete_runs'])} of "
        f"{len(rules.ARMS) * rules.N_SEEDS}.\n",
        "**Premise**: r_s = (G(RLOO M3) - G(control)) / |m0|, 95% t interval: "
        f"{fmt_interval(verdict['relative_excess_growth_rloo_M3'])}, "
        f"m0 = {fmt_num(verdict['m0_rloo_M3'])}: "
        f"**{verdict['premise']}**.\n",
        "**Methods**, paired by seed with RLOO M3: d_s = (G(method) - G(RLOO M3)) / |m0|; "
        "held-out gain (last minus step 0) minus RLOO M3's:\n",
    ]
    rows = [
        [
            arm,
            fmt_interval(m["paired_growth_vs_rloo_M3"]),
            fmt_num(m["share_removed"]),
            fmt_interval(verdict["heldout"]["gain_vs_rloo_M3"][arm]),
            m["status"],
        ]
        for arm, m in verdict["methods"].items()
    ]
    header = ["arm", "d", "share removed", "held-out gain vs RLOO M3", "outcome"]
    md.append(markdown_table(header, rows))
    md.append(
        "\nHeld-out drop of RLOO M3 against RLOO fp32 at the last step (paired): "
        f"{fmt_interval(verdict['heldout']['drop_rloo_M3_vs_fp32'])}; reported, not a gate.\n"
    )
    return "\n".join(md) + "\n"


def plot_all(out: str) -> str | None:
    units = rules.load_units(out)
    if units:
        plot_mismatch(units, os.path.join(out, "e007_mismatch.png"))
    path = os.path.join(out, "verdict.json")
    if not os.path.exists(path):
        return None
    with open(path) as fh:
        text = tables(json.load(fh))
    head = "# e007 verdict (rendered from verdict.json by experiments/e007_plots.py)\n\n"
    write_atomic(os.path.join(out, "verdict.md"), head + text)
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="experiments/results/e007")
    args = p.parse_args(argv)
    plot_all(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
