"""e002 methods: RLOO vs TIS vs MIS vs DVP vs MIS+DVP under a controlled rollout/trainer mismatch.

Question: at a mismatch level where unpruned RLOO measurably degrades, does the paper's ordering
  reproduce (MIS+DVP best; DVP keeps the rollout/training PPL gap stable)?
Setup: the default task and tiny model (configs/tiny_cpu.py). Every unit starts RL from the same
  supervised warm start (600 SFT steps, exported once; `analyze.prepare_init`), rollout in bf16
  with additive Gaussian logit noise of std `NOISE` (`rollout.noise_std`) on the rollout side
  only (before pruning; the trainer stays fp32, noise-free). bf16 alone is far too weak at this
  scale (e001: mean |l_t| <= 0.04 in every probability bin, no sampled token ever leaves the
  trainer's e^-13 safe set).
  Level: pilots (100 steps, 1 seed) at sigma = 1 and 2 showed no exclusions at all (DVP == RLOO);
  sigma = 3 is the smallest tried where pruning acts (1-4% of responses excluded, MIS masks ~7%).
  Plus RLOO at sigma = 0 (bf16 only) as the no-mismatch reference, and a post-hoc noise-free
  re-evaluation of every final policy (`analyze.clean_accuracy`), since the trainer's own eval
  samples with the unit's noisy engine. Held-out accuracy avg@4 on 128 prompts is
  measured with the same (noisy) rollout engine every method trains with.
Command (from the repository root; the committed results, experiments/results/e002/):
  python -m experiments.e002_methods --root /tmp/dvp_jax_runs --parallel 2 \
      --out experiments/results/e002
  (= the warm start, then `python -m dvp_jax.launch local experiments/e002_methods.py --sweep
  init_hf=<init> --parallel 2`, then the analysis; `--analyze_only` redoes only the plots and
  the table, from the unit workdirs under --root: metrics.jsonl and launch.log are not
  committed). Full version: `--seeds 3` (the default). Smoke (CI): `--sweep smoke=True`.
Hardware: 2 CPU cores shared with other jobs (load 4-7). Time: 27 min for the 18 units
  (120-220 s each, 2 at a time), then ~4 min of analysis (19 noise-free re-evaluations).
Expected: see experiments/results/e002/results.md (written by the analysis, not by hand).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from experiments import analyze

CONFIG = analyze.TINY_CPU
CONFIG_ARG = "dvp"

METHODS = ("rloo", "tis", "mis", "dvp", "mis_dvp")
SEEDS = 3  # seeds 0..SEEDS-1 of every method
NOISE = 3.0  # rollout.noise_std of the committed sweep (chosen by the pilots, see README)
STEPS = 150
# Per-unit sizes: the demo's RL batch (16 prompts x 8), eval every 25 steps on 128 prompts x 4.
SIZES = {
    "train.steps": STEPS,
    # Pinned to the values of the committed run (the demo's defaults have moved since): RL
    # learning rate 5e-4, and the trainer's eval sampling with the unit's logit noise (the
    # noise-free figures come from analyze's clean re-evaluation).
    "train.learning_rate": 5e-4,
    "eval.with_rollout_noise": True,
    "eval.every": 25,
    "eval.num_prompts": 128,
    "eval.k": 4,
    "checkpoint.every": 0,
    "plots": False,
}


def unit(method: str, seed: int, noise: float, init_hf: str, **extra) -> dict:
    """One RL unit at these sizes from the warm start `init_hf` (e003's units too)."""
    return {
        "method": method,
        **extra,
        "train.seed": seed,
        "data.seed": seed,
        "rollout.noise_std": noise,
        **SIZES,
        **analyze.init_overrides(init_hf),
    }


def smoke_unit(method: str, noise: float, **extra) -> dict:
    """One unit at the CI sizes (`analyze.SMOKE`): its own 2-step warm-up, 2 RL steps."""
    return {"method": method, **extra, "rollout.noise_std": noise, "train.seed": 0, **analyze.SMOKE}


def get_sweep(
    seeds: int = SEEDS, noise: float = NOISE, init_hf: str = "", smoke: bool = False
) -> list[dict]:
    """METHODS x seeds at logit noise `noise`, plus RLOO x seeds without noise (the no-mismatch
    reference); `smoke`: RLOO and MIS+DVP at the CI sizes."""
    noise = float(noise)
    if smoke:
        return [smoke_unit(m, noise) for m in ("rloo", "mis_dvp")]
    units = [unit(m, s, noise, init_hf) for m in METHODS for s in range(seeds)]
    if noise != 0:
        units += [unit("rloo", s, 0.0, init_hf) for s in range(seeds)]
    return units


# ------------------------------------------------------------------------------------------------
# Analysis: curves (mean over seeds) and the results table.
# ------------------------------------------------------------------------------------------------
LABELS = {"rloo": "RLOO", "tis": "TIS", "mis": "MIS", "dvp": "DVP", "mis_dvp": "MIS+DVP"}
REF = ", no noise (ref.)"
TAILS = (  # metrics whose mean over the last 20 RL steps the table reports
    "ppl_gap",
    "full_ppl_gap",
    "frac_responses_excluded",
    "frac_responses_masked",
    "frac_tokens_outside_train_safe",
)


def _group_label(run) -> str:
    ov = run["overrides"]
    label = LABELS.get(ov.get("method"), str(ov.get("method")))
    return label if float(ov.get("rollout.noise_std", 0.0)) else label + REF


def _clean(workdir: str) -> float | None:
    """Noise-free held-out accuracy of a unit's final policy, cached in its workdir."""
    cache = os.path.join(workdir, "clean_eval.json")
    if os.path.exists(cache):
        with open(cache) as fh:
            return json.load(fh)["clean_accuracy"]
    hf = os.path.join(workdir, "hf_export")
    if not os.path.exists(os.path.join(hf, "config.json")):
        return None
    acc = analyze.clean_accuracy(hf)
    with open(cache, "w") as fh:
        how = "analyze.clean_accuracy (bf16, no noise, 256 held-out prompts x 4)"
        json.dump({"clean_accuracy": acc, "how": how}, fh)
    return acc


def _plot(groups: dict, noise: list, path: str) -> None:
    plt = analyze.pyplot()
    panels = [
        ("eval_accuracy", "held-out accuracy avg@4 (unit's own rollout engine)", 1),
        ("reward_mean", "train reward (rollouts), 10-step mean", 10),
        ("ppl_gap", "PPL gap (pruned objective), 10-step mean", 10),
        ("log_ppl_diff", "log PPL diff (rollout - training), 10-step mean", 10),
        ("frac_responses_excluded", "responses excluded (E5), 10-step mean", 10),
        ("frac_responses_masked", "responses masked (MIS), 10-step mean", 10),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (key, title, smooth) in zip(axes.flat, panels, strict=True):
        for g, rs in groups.items():
            c = analyze.mean_curve(rs, key, smooth)
            if c is None:
                continue
            steps, mean, std = c
            marker = "o" if key == "eval_accuracy" else None
            ax.plot(steps, mean, label=g, marker=marker, ms=3, ls=":" if REF in g else "-")
            if not key.endswith("ppl_gap"):  # a ± std band is meaningless on a log axis
                ax.fill_between(steps, mean - std, mean + std, alpha=0.12)
        ax.set(title=title, xlabel="RL step")
        if key.endswith("ppl_gap"):
            ax.set_yscale("log")
    axes[0, 0].legend(fontsize=8)
    nseeds = max(len(v) for v in groups.values()) if groups else 0
    fig.suptitle(
        f"e002: methods, rollout bf16 + logit noise {noise} (mean ± std over {nseeds} seeds)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def analyse(root: str, out: str, experiment: str = "e002_methods", clean: bool = True) -> dict:
    """Curves (mean over seeds), results.md and results.json from the unit workdirs."""
    runs = analyze.load_runs(root, experiment)
    os.makedirs(out, exist_ok=True)
    groups = analyze.group_runs(
        runs, _group_label, [g for m in METHODS for g in (LABELS[m], LABELS[m] + REF)]
    )
    noise = sorted({float(r["overrides"].get("rollout.noise_std", 0.0)) for r in runs})
    init_dir = analyze.init_workdir(root)
    init_clean = _clean(init_dir) if clean and os.path.isdir(init_dir) else None
    _plot(groups, noise, os.path.join(out, "e002_methods.png"))

    header = [
        "method",
        "seeds",
        "acc start",
        "acc final (mean ± std)",
        "Δ acc",
        "acc best",
        "clean acc final (no noise)",
        "PPL gap (last 20)",
        "unpruned PPL gap (last 20)",
        "excluded",
        "masked",
        "tokens outside train V_S",
    ]
    table, rows_json = [], {}
    for g, rs in groups.items():
        final, start, best = analyze.accuracies(rs)
        cl = [_clean(r["workdir"]) for r in rs] if clean else []
        cl = np.array([c for c in cl if c is not None])
        tails = {k: np.array([analyze.tail_mean(r["rows"], k) for r in rs]) for k in TAILS}
        rows_json[g] = {
            "seeds": len(rs),
            "final_acc": final.tolist(),
            "start_acc": start.tolist(),
            "best_acc": best.tolist(),
            "clean_final_acc": cl.tolist(),
            **{k: v.tolist() for k, v in tails.items()},
            "wall_time_s": [r["summary"]["wall_time_s"] for r in rs],
        }
        table.append(
            [
                g,
                len(rs),
                analyze.fmt(start.mean()),
                analyze.fmt(final.mean(), final.std()),
                f"{(final - start).mean():+.3f}",
                analyze.fmt(best.mean()),
                analyze.fmt(cl.mean(), cl.std()) if len(cl) else "-",
                analyze.fmt(tails["ppl_gap"].mean(), digits=2),
                analyze.fmt(tails["full_ppl_gap"].mean(), digits=2),
                analyze.fmt(tails["frac_responses_excluded"].mean()),
                analyze.fmt(tails["frac_responses_masked"].mean()),
                analyze.fmt(tails["frac_tokens_outside_train_safe"].mean(), digits=4),
            ]
        )
    steps = sorted({r["summary"]["steps"] for r in runs})
    md = (
        f"# e002 results (rollout bf16 + logit noise {noise}, {steps} RL steps, shared "
        "warm start)\n\n" + analyze.markdown_table(header, table)
    )
    if init_clean is not None:
        md += f"\nClean (noise-free) accuracy of the shared warm start: {init_clean:.3f}.\n"
    results = {"noise": noise, "init_clean_acc": init_clean, "groups": rows_json}
    analyze.write_results(out, md, results, runs)
    return rows_json


def main(argv=None) -> int:
    run = lambda root, out, clean: analyse(root, out, clean=clean)
    out = "experiments/results/e002"
    return analyze.sweep_main(argv, __file__, __doc__, out, SEEDS, NOISE, "no_clean", run)


if __name__ == "__main__":
    sys.exit(main())
