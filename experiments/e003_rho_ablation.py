"""e003 rho ablation: DVP with log_rho in {-8, -10, -13, -16, off} at e002's mismatch level.

Question: how do held-out accuracy, the excluded fraction (E5) and the pruned mass (E3) depend on
  the min-p threshold rho, and does the bias of the pruned objective stay under its bound?
Setup: as e002 (same shared warm start, bf16 rollout + logit noise `e002_methods.NOISE`, 150 RL
  steps), method dvp (pruning + no correction); "off" is `loss.prune=False` (= RLOO).
The bias check (`bias_check`, run after training on each unit's final policy, in float32 on both
  sides so that pruning is the only difference between the two distributions):
  Let pi be the policy, pi_S its pruned version (E1-E2) and J(q) = E_{y ~ q}[R(y)] with rewards
  R in [0, R_max] (exact match: R_max = 1). Per position TV(pi_S(.|s), pi(.|s)) = delta_S(s)
  (E3), so by the chain rule of total variation
      |J(pi) - J(pi_S)| <= R_max E_{pi_S}[1 - prod_t (1 - delta_t)] <= R_max E_{pi_S}[sum_t delta_t]
                        <= R_max T max_t delta_t
  (pruned mass x response length x reward bound; B1 <= B2 <= B3 below). Measured: for every
  held-out prompt, G responses are sampled from pi_S and from pi with the *same* keys (the
  sampler's Gumbel-max draw then picks the same token unless pi's choice is a pruned one, so the
  two samples differ only where pruning changed the path: a paired, low-variance estimate of
  Delta = J(pi) - J(pi_S) = mean(R_pi - R_pi_S), with its standard error). The check passes when
  |Delta_hat| <= B2 + 2 SE (and reports B1, B2, B3, and P_pi(some token outside V_S) against
  1 - E_{pi_S}[prod_t (1 - delta_t)], the identity behind B1). Each policy is checked at its own
  rho; the "off" policy (no rho of its own) at every rho in `CHECK_RHOS` (which adds -2 and -4,
  where the bias is large enough to measure, to show the bound is not vacuous).
Command (from the repository root):
  python -m experiments.e003_rho_ablation --root /tmp/dvp_jax_runs --parallel 2 \
      --out experiments/results/e003
  (= the shared warm start, then `python -m dvp_jax.launch local experiments/e003_rho_ablation.py
  --sweep init_hf=<init> --parallel 2`, then the bias check and the table; `--analyze_only`
  skips training but needs the unit workdirs under --root: metrics.jsonl, launch.log and
  hf_export are not committed). Smoke (CI): `--sweep smoke=True`.
  Committed: 1 seed (`--seeds 2` or more for error bars; e002 already has 3 seeds of the -13
  (dvp) and off (rloo) points at the same level).
Hardware: 2 CPU cores shared with other jobs. Time: ~6.5 min for the 5 units (90-165 s each,
  2 at a time), then ~1.5 min for the bias checks.
Expected: see experiments/results/e003/results.md (written by the analysis).
"""

from __future__ import annotations

import math
import os
import sys

import numpy as np

from experiments import analyze, e002_methods

CONFIG = analyze.TINY_CPU  # the same base config as e002
CONFIG_ARG = "dvp"
LOG_RHOS = (-8.0, -10.0, -13.0, -16.0, None)  # None: pruning off
SEEDS = 1  # --seeds N for more; e002 has 3 seeds of the -13 (dvp) and off (rloo) points
CHECK_RHOS = (-2.0, -4.0, -8.0, -10.0, -13.0, -16.0)


def get_sweep(
    seeds: int = SEEDS, noise: float = e002_methods.NOISE, init_hf: str = "", smoke: bool = False
) -> list[dict]:
    """DVP at every rho of LOG_RHOS x seeds, e002's sizes; `smoke`: rho e^-8 at the CI sizes."""
    noise = float(noise)
    if smoke:
        return [e002_methods.smoke_unit("dvp", noise, **{"loss.log_rho": -8.0})]
    return [
        e002_methods.unit(
            "dvp",
            s,
            noise,
            init_hf,
            **({"loss.prune": False} if rho is None else {"loss.log_rho": rho}),
        )
        for rho in LOG_RHOS
        for s in range(seeds)
    ]


# ------------------------------------------------------------------------------------------------
# The bias check.
# ------------------------------------------------------------------------------------------------
def bias_check(
    hf_dir: str, log_rhos, num_prompts: int = 256, samples: int = 8, seed: int = 0
) -> list[dict]:
    """Paired estimate of J(pi) - J(pi_S) against its bounds (module docstring), per rho."""
    import jax

    cfg, engine, tokenizer = analyze.load_policy(hf_dir, "float32")
    examples = cfg.data.make_task().heldout_examples(num_prompts)
    key = jax.random.key(seed)

    def sample(log_rho):
        params = engine.config.sampling_params(log_rho=log_rho)
        return analyze.sample_rewards(cfg, engine, tokenizer, examples, samples, key, params)

    full, r_full = sample(-math.inf)
    out = []
    for rho in log_rhos:
        pruned, r_pruned = sample(rho)
        delta = np.where(
            pruned.response_mask, pruned.behaviour_pruned_mass, 0.0
        )  # [N, T], E3 per token
        keep = np.prod(1.0 - delta, axis=1)  # prod_t (1 - delta_t)
        diff = r_full - r_pruned
        # Same keys: the two samples differ only where pi's draw was a token outside V_S.
        changed = np.any(full.tokens != pruned.tokens, axis=1)
        r_max = 1.0
        n = len(diff)
        est = float(diff.mean())
        se = float(diff.std(ddof=1) / math.sqrt(n)) if n > 1 else 0.0
        b1 = r_max * float((1.0 - keep).mean())
        b2 = r_max * float(delta.sum(axis=1).mean())
        b3 = r_max * float(pruned.response_lengths.max()) * float(delta.max())
        out.append(
            {
                "log_rho": rho,
                "responses": n,
                "J_pi": float(r_full.mean()),
                "J_pi_S": float(r_pruned.mean()),
                "delta_hat": est,
                "se": se,
                "B1_E[1-prod(1-delta)]": b1,
                "B2_E[sum delta]": b2,
                "B3_T_max_delta": b3,
                "mean_pruned_mass_per_token": float(
                    delta.sum() / max(pruned.response_mask.sum(), 1)
                ),
                "frac_paths_changed_by_pruning": float(changed.mean()),
                "within_bound": bool(abs(est) <= b2 + 2 * se),
                "chain_ok": bool(b1 <= b2 + 1e-12 and b2 <= b3 + 1e-12),
            }
        )
    return out


# ------------------------------------------------------------------------------------------------
# Analysis.
# ------------------------------------------------------------------------------------------------
def _rho_of(run) -> float | None:
    ov = run["overrides"]
    return None if ov.get("loss.prune") is False else float(ov.get("loss.log_rho", -13.0))


def _label(rho):
    return "off" if rho is None else f"{rho:g}"


def _check_policies(groups: dict) -> dict:
    """The bias check of one policy per rho (seed 0): at its own rho, or at every CHECK_RHOS
    for the pruning-off policy."""
    checks = {}
    for rho, rs in groups.items():
        r0 = sorted(rs, key=lambda r: r["name"])[0]
        hf = os.path.join(r0["workdir"], "hf_export")
        if not os.path.exists(hf):
            continue
        rhos = CHECK_RHOS if rho is None else (rho,)
        checks[_label(rho)] = {"unit": r0["name"], "results": bias_check(hf, rhos)}
        for c in checks[_label(rho)]["results"]:
            print(
                f"[e003] policy rho={_label(rho)} checked at {c['log_rho']:g}: "
                f"Delta={c['delta_hat']:+.2e} ± {c['se']:.1e}, "
                f"B1={c['B1_E[1-prod(1-delta)]']:.2e}"
                f" B2={c['B2_E[sum delta]']:.2e} B3={c['B3_T_max_delta']:.2e} "
                f"within={c['within_bound']}",
                flush=True,
            )
    return checks


def _plot(groups: dict, checks: dict, out: str) -> None:
    plt = analyze.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for rho, rs in groups.items():
        c = analyze.mean_curve(rs, "eval_accuracy")
        if c is not None:
            axes[0].plot(c[0], c[1], marker="o", ms=3, label=f"log rho {_label(rho)}")
        for ax, key in (
            (axes[1], "frac_tokens_outside_train_safe"),
            (axes[2], "pruned_mass_train_mean"),
        ):
            c = analyze.mean_curve(rs, key, smooth=10)
            if c is not None and rho is not None:
                ax.plot(c[0], c[1], label=f"log rho {_label(rho)}")
    axes[0].set(title="held-out accuracy avg@4", xlabel="RL step")
    axes[1].set(title="sampled tokens outside trainer V_S (10-step mean)", xlabel="RL step")
    axes[2].set(title="pruned mass delta_S, trainer (10-step mean)", xlabel="RL step")
    axes[2].set_yscale("symlog", linthresh=1e-9)  # zero when nothing is pruned
    axes[0].legend(fontsize=8)
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "e003_rho.png"), dpi=100)
    plt.close(fig)

    if "off" not in checks:
        return
    res = checks["off"]["results"]
    fig, ax = plt.subplots(figsize=(6, 4.2))
    x = [c["log_rho"] for c in res]
    ax.errorbar(
        x,
        [abs(c["delta_hat"]) for c in res],
        yerr=[2 * c["se"] for c in res],
        marker="o",
        capsize=3,
        label="|J(pi) - J(pi_S)| measured (± 2 s.e.)",
    )
    b1 = [c["B1_E[1-prod(1-delta)]"] for c in res]
    ax.plot(x, b1, "s--", label="B1 = R_max E[1 - prod(1 - delta_t)]")
    ax.plot(x, [c["B2_E[sum delta]"] for c in res], "^--", label="B2 = R_max E[sum_t delta_t]")
    ax.plot(x, [c["B3_T_max_delta"] for c in res], "v:", label="B3 = R_max T max delta")
    ax.set(
        xlabel="log rho",
        ylabel="objective bias",
        title="pruned-objective bias vs its bound (RLOO-trained policy)",
    )
    ax.set_yscale("symlog", linthresh=1e-6)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "e003_bias_bound.png"), dpi=100)
    plt.close(fig)


TAILS = (  # metrics whose mean over the last 20 RL steps the table reports
    "frac_responses_excluded",
    "frac_tokens_outside_train_safe",
    "pruned_mass_train_mean",
    "pruned_mass_rollout_mean",
    "ppl_gap",
)


def analyse(root: str, out: str, experiment: str = "e003_rho_ablation", check: bool = True) -> dict:
    """Bias checks, curves, results.md and results.json from the unit workdirs."""
    runs = analyze.load_runs(root, experiment)
    os.makedirs(out, exist_ok=True)
    groups = analyze.group_runs(runs, _rho_of, LOG_RHOS)
    checks = _check_policies(groups) if check else {}
    _plot(groups, checks, out)

    header = [
        "log rho",
        "seeds",
        "start acc",
        "final acc (mean ± std)",
        "best acc",
        "excluded (last 20)",
        "tokens outside V_S",
        "pruned mass train",
        "pruned mass rollout",
        "PPL gap",
        "bias check at own rho: Δ̂ ± s.e. / B2",
    ]
    rows, table_json = [], {}
    for rho, rs in groups.items():
        final, start, best = analyze.accuracies(rs)
        tail = {k: float(np.mean([analyze.tail_mean(r["rows"], k) for r in rs])) for k in TAILS}
        chk = checks.get(_label(rho), {}).get("results", [])
        own = [c for c in chk if rho is not None and c["log_rho"] == rho]
        cell = (
            (
                f"{own[0]['delta_hat']:+.1e} ± {own[0]['se']:.0e} / {own[0]['B2_E[sum delta]']:.1e}"
                f" ({'ok' if own[0]['within_bound'] else 'VIOLATED'})"
            )
            if own
            else "-"
        )
        table_json[_label(rho)] = {
            "final_acc": final.tolist(),
            "start_acc": start.tolist(),
            "best_acc": best.tolist(),
            **tail,
        }
        rows.append(
            [
                _label(rho),
                len(rs),
                analyze.fmt(start.mean()),
                analyze.fmt(final.mean(), final.std()),
                analyze.fmt(best.mean()),
                analyze.fmt(tail["frac_responses_excluded"], digits=4),
                f"{tail['frac_tokens_outside_train_safe']:.1e}",
                f"{tail['pruned_mass_train_mean']:.1e}",
                f"{tail['pruned_mass_rollout_mean']:.1e}",
                analyze.fmt(tail["ppl_gap"], digits=2),
                cell,
            ]
        )
    noise = sorted({r["overrides"].get("rollout.noise_std") for r in runs})
    md = f"# e003 results (dvp, rollout bf16 + logit noise {noise})\n\n" + analyze.markdown_table(
        header, rows
    )
    if "off" in checks:
        md += (
            "\nBias check on the pruning-off (RLOO) policy at each rho (fp32 both sides, "
            f"{checks['off']['results'][0]['responses']} paired responses):\n\n"
        )
        md += analyze.markdown_table(
            [
                "log rho",
                "J(pi)",
                "Δ̂ = J(pi) - J(pi_S)",
                "s.e.",
                "B1",
                "B2",
                "B3",
                "paths changed",
                "within B2 + 2 s.e.",
            ],
            [
                [
                    f"{c['log_rho']:g}",
                    f"{c['J_pi']:.4f}",
                    f"{c['delta_hat']:+.2e}",
                    f"{c['se']:.1e}",
                    f"{c['B1_E[1-prod(1-delta)]']:.2e}",
                    f"{c['B2_E[sum delta]']:.2e}",
                    f"{c['B3_T_max_delta']:.2e}",
                    f"{c['frac_paths_changed_by_pruning']:.4f}",
                    str(c["within_bound"]),
                ]
                for c in checks["off"]["results"]
            ],
        )
    results = {"noise": noise, "rho": table_json, "bias_checks": checks}
    analyze.write_results(out, md, results, runs)
    return {"rho": table_json, "bias_checks": checks}


def main(argv=None) -> int:
    run = lambda root, out, check: analyse(root, out, check=check)
    out, noise = "experiments/results/e003", e002_methods.NOISE
    return analyze.sweep_main(argv, __file__, __doc__, out, SEEDS, noise, "no_check", run)


if __name__ == "__main__":
    sys.exit(main())
