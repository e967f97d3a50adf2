"""e001's figure per setting: the mismatch against p, normalised by eps, the tail bias of
sampled vs teacher-forced tokens, and the sequence log-ratio against length (4 panels).

Reads the result dict of `e001_mismatch_bound.analyse_setting` (its `_plot` arrays); computes
nothing of its own.
"""

from __future__ import annotations

import math

import numpy as np

from experiments import analyze


# ------------------------------------------------------------------------------------------------
def plot_setting(res: dict, path: str, max_points: int = 30_000) -> None:
    plt = analyze.pyplot()
    d = res["_plot"]
    p, diff = d["p"].ravel(), d["diff"].ravel()
    eps = np.broadcast_to(d["eps"][:, None], d["p"].shape).ravel()
    rng = np.random.default_rng(0)
    idx = rng.choice(p.size, min(max_points, p.size), replace=False)
    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    ps = np.logspace(-12, 0, 200)

    ax = axes[0, 0]
    ax.scatter(p[idx], diff[idx] + 1e-12, s=2, alpha=0.3)
    for q, style in ((np.median(d["eps"]), "--"), (d["eps"].max(), "-")):
        ax.plot(ps, 2 * q * (1 - ps), "r" + style, label=f"2 eps (1-p), eps={q:.3g}")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="trainer probability p (every vocab entry)",
        ylabel="|log p' - log p|",
        title=f"{res['setting']}: mismatch vs p",
    )
    ax.set_xlim(max(p[idx].min(), 1e-12), 1.0)
    ax.legend(fontsize=8)

    ax = axes[0, 1]
    ax.scatter(p[idx], diff[idx] / np.maximum(eps[idx], 1e-30), s=2, alpha=0.3)
    ax.plot(ps, 2 * (1 - ps), "r-", label="2 (1-p) (E10, first order)")
    ax.set(
        xscale="log",
        xlabel="p",
        ylabel="|log p' - log p| / eps",
        title=f"normalised; exact bound holds for {100 * res['frac_within_exact_bound']:.2f}%",
    )
    ax.legend(fontsize=8)

    ax = axes[1, 0]
    for key, label, m in (
        ("sampled_bins", "sampled by the rollout (mu)", "o"),
        ("teacher_forced_bins", "teacher-forced (held-out answers)", "s"),
    ):
        rows = [r for r in res[key] if r["count"] > 1]
        centers = [math.sqrt(max(r["p_lo"], 1e-6) * r["p_hi"]) for r in rows]
        ax.errorbar(
            centers,
            [r["mean_signed"] for r in rows],
            yerr=[r["stderr"] for r in rows],
            marker=m,
            capsize=3,
            label=label,
        )
    ax.axhline(0, color="k", lw=0.5)
    ax.set(
        xscale="log",
        xlabel="trainer probability p of the token (bin)",
        ylabel="mean signed l = log pi - log mu (± s.e.)",
        title="tail bias",
    )
    ax.legend(fontsize=8)

    ax = axes[1, 1]
    g = res["growth"]
    t, m, s = np.array(g["t"]), np.array(g["mean_L"]), np.array(g["std_L"])
    ax.plot(t, m, label="mean L_t")
    ax.fill_between(t, m - s, m + s, alpha=0.2, label="± std")
    ax.plot(t, g["mean_abs_L"], label="mean |L_t|")
    ax.axhline(0, color="k", lw=0.5)
    ax.set(
        xlabel="response length t (tokens)",
        ylabel="L_t = sum_{s<=t} l_s",
        title="sequence log-ratio vs length (sampled continuations)",
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
