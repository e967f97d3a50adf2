"""End-of-run PNG plots of one workdir, from its metrics.jsonl and config.json (matplotlib Agg).

`plot_run(workdir)` writes `dashboard.png`, the one to open first (reward and held-out
accuracy, the PPL gap on a log axis, entropy, response length, grad norm, the supervised
warm-up before step 0), and the detail plots: reward_accuracy, ppl_gap (pruned and unpruned),
excluded_fractions, policy (entropy, length, truncation, grad and update norms), warmup and
lt_by_p_bins. `figures(rows, config)` builds them without writing (tests read the axes).

Every per-step curve is drawn raw (faint) under its trailing mean (a median for the log-scale
PPL gap, which one spike would lift for a whole window); the pruned objective's figures are
solid, the unpruned ones dashed in another colour. Titles name the run's method, rollout dtype
and trainer precision. Not here: experiment-level plots over many runs (`experiments/`).
"""

from __future__ import annotations

import io
import json
import os
import re

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from dvp_jax.metrics import read_metrics, series  # noqa: E402
from dvp_jax.workdir import as_path  # noqa: E402

PRUNED = {"color": "C0", "ls": "-"}
UNPRUNED = {"color": "C3", "ls": "--"}
_EVAL_SET = re.compile(r"eval/([A-Za-z0-9_.-]+)/accuracy")
DPI = 110


def window(n: int) -> int:
    """Trailing-mean window for a curve of `n` points: about n / 15, at most 25."""
    return int(np.clip(round(n / 15), 1, 25))


def trailing_mean(values, w: int) -> np.ndarray:
    """Mean of the last `w` values at each point (fewer at the start: no padding bias)."""
    v = np.asarray(values, dtype=float)
    c = np.concatenate([[0.0], np.cumsum(v)])
    i = np.arange(1, len(v) + 1)
    lo = np.maximum(i - w, 0)
    return (c[i] - c[lo]) / (i - lo)


def trailing_median(values, w: int) -> np.ndarray:
    """Median of the last `w` values at each point (fewer at the start): a spike does not
    lift the `w` points after it, as it lifts a mean (the log-scale PPL gap)."""
    v = np.asarray(values, dtype=float)
    padded = np.concatenate([np.full(w - 1, np.nan), v])
    return np.nanmedian(np.lib.stride_tricks.sliding_window_view(padded, w), axis=1)


def run_title(config: dict, workdir_name: str = "") -> str:
    """ "<name>: <method> | rollout <dtype>[ + noise] | trainer <precision>" from config.json."""
    parts = [str(config.get("method", "?"))]
    rollout = f"rollout {config.get('rollout.dtype', '?')}"
    if config.get("rollout.noise_std"):
        rollout += f" + logit noise {config['rollout.noise_std']:g}"
    parts += [rollout, f"trainer {config.get('train.precision', '?')}"]
    title = " | ".join(parts)
    return f"{workdir_name}: {title}" if workdir_name else title


def _rl(rows):
    """Rows of RL steps (step >= 0)."""
    return [r for r in rows if r["step"] >= 0]


def curve(
    ax, rows, key, label=None, *, color=None, ls="-", smooth=True, marker=None, median=False
) -> bool:
    """Plots `key` over `rows`: raw (faint) under its trailing mean when `smooth` and the curve
    is long enough for a window > 1 (a trailing median if `median`), else one line (markers
    when not `smooth`). False if the rows have no `key`."""
    steps, values = series(rows, key)
    if not steps:
        return False
    label = label or key
    w = window(len(steps)) if smooth else 1
    if w > 1:
        ax.plot(steps, values, color=color, ls=ls, lw=0.8, alpha=0.3)
        smoothed = (trailing_median if median else trailing_mean)(values, w)
        stat = "median" if median else "mean"
        ax.plot(steps, smoothed, color=color, ls=ls, lw=1.7, label=f"{label} ({w}-step {stat})")
    elif smooth:
        ax.plot(steps, values, color=color, ls=ls, lw=1.5, label=label)
    else:
        ax.plot(steps, values, color=color, ls=ls, lw=1.5, marker=marker or "o", ms=4, label=label)
    return True


def _finish(ax, title, ylabel, xlabel="RL step", legend=True):
    ax.set_title(title, fontsize=10)
    ax.set(xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.25)
    if legend and ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def _empty(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} in this run", ha="center", va="center", transform=ax.transAxes)


# ==============================================================================================
# Panels (one axis each)
# ==============================================================================================
def reward_panel(ax, rows) -> None:
    """Train reward (smoothed) and held-out accuracy of every validation set (markers)."""
    rl = _rl(rows)
    curve(ax, [r for r in rl if "loss" in r], "reward_mean", "train reward", color="C2")
    curve(ax, rl, "eval_accuracy", "held-out avg@k", color="C1", smooth=False)
    curve(ax, rl, "eval_pass_at_k", "held-out pass@k", color="C1", ls=":", smooth=False)
    names = sorted({m.group(1) for r in rl for k in r if (m := _EVAL_SET.fullmatch(k))})
    for i, name in enumerate(names):
        curve(ax, rl, f"eval/{name}/accuracy", f"{name} avg@k", color=f"C{4 + i}", smooth=False)
    _finish(ax, "Reward and held-out accuracy", "mean reward / accuracy")


def ppl_gap_panel(ax, rows, key: str = "ppl_gap") -> None:
    """|rollout PPL - training PPL| of the pruned objective (solid) and unpruned (dashed),
    log y axis (one spike does not flatten the rest)."""
    rl = [r for r in _rl(rows) if "loss" in r]
    pruned = curve(ax, rl, key, "pruned (objective)", median=True, **PRUNED)
    unpruned = curve(ax, rl, "full_" + key, "unpruned", median=True, **UNPRUNED)
    positive = [v for r in rl for k in (key, "full_" + key) if k in r and (v := r[k]) > 0]
    if positive:
        ax.set_yscale("log", nonpositive="mask")
    if not (pruned or unpruned):
        _empty(ax, key)
    _finish(ax, "Rollout vs training PPL gap (log)", "|rollout PPL - training PPL|")


def log_ppl_diff_panel(ax, rows) -> None:
    rl = [r for r in _rl(rows) if "loss" in r]
    curve(ax, rl, "log_ppl_diff", "pruned (objective)", **PRUNED)
    curve(ax, rl, "full_log_ppl_diff", "unpruned", **UNPRUNED)
    ax.axhline(0, color="k", lw=0.5)
    _finish(ax, "log PPL difference (rollout - training)", "mean_t (log mu - log pi)")


def metric_panel(ax, rows, key: str, title: str, ylabel: str, color: str) -> None:
    """One smoothed RL-step metric, or a note that the run has none."""
    if not curve(ax, [r for r in _rl(rows) if "loss" in r], key, color=color):
        _empty(ax, key)
    _finish(ax, title, ylabel, legend=False)


def warmup_panel(ax, rows) -> None:
    """The supervised warm-up before step 0 (its rows have steps -sft.steps .. -1) and the
    held-out accuracy it reached (the evaluation at step 0)."""
    warm = [r for r in rows if r["step"] < 0]
    if not curve(ax, warm, "sft_loss", "warm-up loss", color="C5"):
        _empty(ax, "supervised warm-up")
        _finish(ax, "Supervised warm-up", "", xlabel="warm-up step (before RL step 0)")
        return
    ax.axvline(0, color="k", lw=0.5)
    start = [r["eval_accuracy"] for r in rows if r["step"] == 0 and "eval_accuracy" in r]
    if start:
        acc = ax.twinx()
        label = f"held-out at step 0: {start[0]:.1%}"
        acc.plot([0], start[:1], "*", color="C1", ms=12, label=label)
        acc.set_ylim(0, 1)
        acc.set_ylabel("held-out avg@k", fontsize=8)
        acc.legend(fontsize=7, loc="upper right")
    _finish(ax, "Supervised warm-up (before RL)", "NLL of the answer tokens", "warm-up step")


def excluded_panel(ax, rows) -> None:
    rl = [r for r in _rl(rows) if "loss" in r]
    for i, key in enumerate(
        (
            "frac_responses_excluded",
            "frac_responses_masked",
            "frac_tokens_masked",
            "frac_tokens_outside_train_safe",
        )
    ):
        curve(ax, rl, key, color=f"C{i}")
    _finish(ax, "Excluded / masked (E5, E7)", "fraction")


# ==============================================================================================
# Figures
# ==============================================================================================
def _figure(nrows, ncols, title, size):
    fig, axes = plt.subplots(nrows, ncols, figsize=size, squeeze=False)
    fig.suptitle(title, fontsize=11)
    return fig, axes


def dashboard(rows, config: dict, name: str = ""):
    """The figure a user opens first (2 x 3 panels)."""
    fig, ax = _figure(2, 3, run_title(config, name), (16, 8.5))
    reward_panel(ax[0, 0], rows)
    ppl_gap_panel(ax[0, 1], rows)
    warmup_panel(ax[0, 2], rows)
    metric_panel(ax[1, 0], rows, "entropy", "Policy entropy", "H(pi), nats per token", "C4")
    metric_panel(ax[1, 1], rows, "response_length", "Response length", "tokens", "C8")
    if any("mismatch_abs_age0" in r for r in rows):  # partial rollouts: the staleness split
        staleness_panel(ax[1, 2], rows)
    else:
        metric_panel(ax[1, 2], rows, "grad_norm", "Gradient norm", "global norm", "C7")
    return fig


def staleness_panel(ax, rows) -> None:
    """Partial rollouts: |log pi - log mu| of tokens sampled under this step's weights (the
    precision mismatch) and of older ones (plus policy lag), and the share of age-0 tokens."""
    rl = [r for r in _rl(rows) if "loss" in r]
    curve(ax, rl, "mismatch_abs_age0", "age 0 (precision)", color="C0")
    curve(ax, rl, "mismatch_abs_stale", "age >= 1 (precision + lag)", color="C3")
    twin = ax.twinx()
    curve(twin, rl, "age_share_0", "share of tokens of age 0", color="C7", ls=":")
    twin.set_ylabel("share of tokens")
    twin.set_ylim(0, 1)
    _finish(ax, "Mismatch by staleness", "mean |log pi - log mu|")


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


def figures(rows, config: dict, name: str = "") -> dict:
    """{file name: matplotlib Figure} of a run (the caller closes them; `plot_run` does)."""
    title = run_title(config, name)
    out = {"dashboard.png": dashboard(rows, config, name)}

    fig, ax = _figure(1, 1, title, (7, 4.5))
    reward_panel(ax[0, 0], rows)
    out["reward_accuracy.png"] = fig

    fig, ax = _figure(1, 2, title, (12, 4.5))
    ppl_gap_panel(ax[0, 0], rows)
    log_ppl_diff_panel(ax[0, 1], rows)
    out["ppl_gap.png"] = fig

    fig, ax = _figure(1, 1, title, (7, 4.5))
    excluded_panel(ax[0, 0], rows)
    out["excluded_fractions.png"] = fig

    fig, ax = _figure(2, 3, title, (16, 8))
    for a, (key, what, unit, color) in zip(
        ax.flat,
        [
            ("entropy", "Policy entropy", "nats per token", "C4"),
            ("response_length", "Response length", "tokens", "C8"),
            ("truncation_rate", "Truncated responses", "fraction", "C9"),
            ("grad_norm", "Gradient norm", "global norm", "C7"),
            ("update_norm", "Update norm", "global norm", "C6"),
            ("loss", "Loss (E9)", "objective", "C0"),
        ],
        strict=True,
    ):
        metric_panel(a, rows, key, what, unit, color)
    out["policy.png"] = fig

    if any(r["step"] < 0 for r in rows):
        fig, ax = _figure(1, 1, title, (7, 4.5))
        warmup_panel(ax[0, 0], rows)
        out["warmup.png"] = fig

    bins = lt_bins(rows)
    if bins:
        k = len(bins["count"])
        centers = (np.arange(k) + 0.5) / k
        fig, ax = _figure(1, 1, title, (7, 4.5))
        a = ax[0, 0]
        a.plot(centers, bins["abs"], marker="o", label="mean |l_t|")
        a.plot(centers, bins["signed"], marker="s", label="mean signed l_t")
        a.axhline(0, color="k", lw=0.5)
        _finish(
            a,
            "Token log-ratio by (1 - p) bin, last 10 steps",
            "l_t = log pi - log mu",
            xlabel="1 - p (trainer probability of the sampled token)",
        )
        out["lt_by_p_bins.png"] = fig
    return out


def read_config(workdir) -> dict:
    """The run's config.json (flat "section.field" keys), or {} if it has none."""
    path = as_path(workdir) / "config.json"
    return json.loads(path.read_text()) if path.exists() else {}


def plot_run(workdir: str | os.PathLike) -> list[str]:
    """Writes the run's plots (`figures`) into the workdir; returns their paths, the dashboard
    first. The workdir may be any epath (e.g. `gs://`): each PNG is rendered in memory, then
    written."""
    workdir = as_path(workdir)
    rows = read_metrics(workdir)
    if not rows:
        return []
    paths = []
    for name, fig in figures(rows, read_config(workdir), workdir.name).items():
        fig.tight_layout(rect=(0, 0, 1, 0.97))  # room for the suptitle
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=DPI)
        plt.close(fig)
        (workdir / name).write_bytes(png.getvalue())
        paths.append(os.fspath(workdir / name))
    return paths
