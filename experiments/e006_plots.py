"""e006's figures from results/e006/units: the per-step mismatch of each arm (seeds faint, the
mean over the seeds present bold) and held-out accuracy per arm; and verdict.md, the tables the
READMEs quote, rendered from verdict.json (never typed by hand). Works on partial data: an arm
with no record is left out, a mean is over the runs (and steps) that exist.

Command (from the repository root): python -m experiments.e006_plots --out experiments/results/e006
[--readme experiments/README.md] (and copy the tables into the README's e006 block)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from dvp_jax.workdir import write_atomic
from experiments import e006_verdict as rules
from experiments.analyze import markdown_table, pyplot
from experiments.records import fmt_interval, fmt_num, mean_curve

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
                x, m = mean_curve(runs, metric)
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


def tables(verdict: dict) -> str:
    """verdict.json as markdown: the premise per metric, each method, held-out accuracy."""
    seeds = rules.SEEDS
    md = [f"Complete runs ({rules.STEPS} steps): {', '.join(verdict['complete_runs']) or 'none'}."]
    md.append("\n**Premise**: r_s = (G(RLOO M3) - G(RLOO fp32)) / |m0(RLOO M3)|, 95% t interval.\n")
    rows = []
    for metric, e in verdict["metrics"].items():
        g = e["growth_per_run"]
        per_seed = lambda arm, g=g: ", ".join(fmt_num(g.get(f"{arm}_s{s}")) for s in seeds)  # noqa: E731
        rows.append(
            [
                f"`{metric}`",
                fmt_num(e["start_level_rloo_M3"]),
                per_seed("rloo_M3"),
                per_seed("rloo_fp32"),
                fmt_interval(e["relative_excess_growth_rloo_M3"]),
                e["premise"],
            ]
        )
    header = [
        "metric",
        "m0 (RLOO M3)",
        "G, RLOO M3 (seeds " + ", ".join(map(str, seeds)) + ")",
        "G, RLOO fp32",
        "r_s",
        "outcome",
    ]
    md.append(markdown_table(header, rows))
    heldout = verdict["heldout"]
    md.append(
        f"\n**Methods** at M3 (r over the same m0; held-out avg@16 at step {rules.STEPS} minus "
        "RLOO M3's, paired by seed):\n"
    )
    rows = []
    for metric, e in verdict["metrics"].items():
        for arm, m in e["methods"].items():
            gain = fmt_interval(heldout["gain_vs_rloo_M3"][arm]) if metric == rules.PRIMARY else ""
            share = fmt_num(m["share_removed"])
            rows.append(
                [
                    arm,
                    f"`{metric}`",
                    fmt_interval(m["relative_excess_growth"]),
                    share,
                    gain,
                    m["status"],
                ]
            )
    header = ["arm", "metric", "r", "share removed", "held-out vs RLOO M3", "outcome"]
    md.append(markdown_table(header, rows))
    acc = heldout["final_acc"]
    md.append(
        f"\n**Held-out avg@16 at step {rules.STEPS}** (the drop of RLOO M3 against fp32, paired: "
    )
    md[-1] += f"{fmt_interval(heldout['drop_rloo_M3_vs_fp32'])}; reported, not a gate):\n"
    rows = [[arm] + [fmt_num(acc.get(f"{arm}_s{s}")) for s in seeds] for arm in rules.ARMS]
    md.append(markdown_table(["arm"] + [f"seed {s}" for s in seeds], rows))
    if "reading" in verdict:  # verdict.json files written before the reading existed have none
        md.append(reading_table(verdict["reading"], seeds))
    return "\n".join(md) + "\n"


def reading_table(reading: dict, seeds) -> str:
    """The figures beside the rules (`e006_verdict.reading`), marked as not pre-registered."""
    md = [
        "\n**Reading** (not pre-registered; added after the data, no outcome reads it): each "
        "method against RLOO M3, paired by seed: its growth minus RLOO M3's over m0 (the share of "
        "m0 it adds; negative = removes), and its held-out gain (step "
        f"{rules.STEPS} minus step 0) minus RLOO M3's. Every arm is evaluated on the fp32 "
        "engine with its method's min-p rule (DVP and MIS+DVP sample inside the safe set), so "
        "the pruning arms start apart from RLOO on the same weights (step 0 below); the gain "
        "takes that offset out.\n"
    ]
    start = reading["start_acc"]
    labels = reading.get("labels", {}).get("methods", {})  # absent in verdicts before issue 46
    rows = [
        [
            arm,
            fmt_interval(reading["paired_growth_vs_rloo_M3"][arm]),
            fmt_interval(reading["heldout_gain_vs_rloo_M3"][arm]),
            ", ".join(fmt_num(start.get(f"{arm}_s{s}")) for s in seeds),
            labels.get(arm, {}).get("label", ""),
        ]
        for arm in reading["paired_growth_vs_rloo_M3"]
    ]
    rows.append(
        ["rloo_M3", "", "", ", ".join(fmt_num(start.get(f"rloo_M3_s{s}")) for s in seeds), ""]
    )
    header = [
        "arm",
        "(G - G(RLOO M3)) / m0",
        "held-out gain - RLOO M3's",
        "held-out at step 0 (seeds " + ", ".join(map(str, seeds)) + ")",
        "reading",
    ]
    md.append(markdown_table(header, rows))
    if "labels" in reading:
        lab = reading["labels"]
        md.append(
            f"\nReading of the premise (rule outcome kept above): **{lab['premise']}** (fp32 "
            "rollouts have zero mismatch by construction, so growth beyond fp32 is not told from "
            "ordinary weight drift; the held-out drop fp32 minus M3 is "
            f"{fmt_interval(_as_interval(lab['heldout_drop_interval']))}). "
            "Methods: a paired interval "
            "that contains 0 reads **no effect detectable at this size**; "
            + _resolved(lab["methods"])
            + " a method that removes half of RLOO M3's growth (half-widths "
            + ", ".join(fmt_num(m.get("half_width")) for m in lab["methods"].values())
            + f" of m0 against {fmt_num(REMOVED_HALF * lab['premise_interval'][0])}).\n"
        )
    return "\n".join(md)


REMOVED_HALF = rules.REMOVED_SHARE


def _resolved(methods: dict) -> str:
    k = sum(bool(m.get("resolves_half")) for m in methods.values())
    return "none of these intervals resolves" if k == 0 else f"{k} of {len(methods)} resolve"


def _as_interval(triple) -> dict:
    mean, lo, hi = triple
    return {"mean": mean, "lo": lo, "hi": hi, "n": len(rules.SEEDS)}


def plot_all(out: str) -> str | None:
    """The plot from the records and verdict.md from verdict.json (both written whole); returns
    verdict.md's tables, or None before there is a verdict.json."""
    units = rules.load_units(out)
    if units:
        plot_mismatch(units, os.path.join(out, "e006_mismatch.png"))
    path = os.path.join(out, "verdict.json")
    if not os.path.exists(path):
        return None
    with open(path) as fh:
        text = tables(json.load(fh))
    head = "# e006 verdict (rendered from verdict.json by experiments/e006_plots.py)\n\n"
    write_atomic(os.path.join(out, "verdict.md"), head + text)
    return text


BEGIN, END = "<!-- e006 verdict.md: begin -->", "<!-- e006 verdict.md: end -->"


def readme_block(readme: str, md: str) -> str:
    """`readme` with the text between BEGIN and END replaced by `md` (verdict.md's tables)."""
    head, sep, rest = readme.partition(BEGIN)
    _, sep2, tail = rest.partition(END)
    if not (sep and sep2):
        raise SystemExit(f"the README has no {BEGIN} ... {END} block for e006's tables")
    return f"{head}{BEGIN}\n{md}{END}{tail}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="experiments/results/e006")
    p.add_argument("--readme", default="", help="also copy verdict.md's tables into this README")
    args = p.parse_args(argv)
    md = plot_all(args.out)
    if args.readme:
        if md is None:
            raise SystemExit(f"--readme: no {args.out}/verdict.json to render (run e006_verdict)")
        with open(args.readme) as fh:
            write_atomic(args.readme, readme_block(fh.read(), md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
