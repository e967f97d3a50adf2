"""What a run prints: a start banner, one progress line every few steps, a closing summary.

Everything else a run measures goes to `metrics.jsonl`, `samples.jsonl` and the trackers only
(`dvp_jax.trackers`: TensorBoard event files, W&B).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import jax
from absl import logging

from dvp_jax.train.config import ExperimentConfig


def duration(seconds: float) -> str:
    """`42s`, `3m05s`, `2h07m`."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def banner(cfg: ExperimentConfig, mesh, workdir, resumed_step: int | None) -> None:
    """Three lines: what runs, on what, and where."""
    m, t = cfg.model, cfg.train
    warm = f"{cfg.sft.steps} warm-up steps, then " if cfg.sft.steps and resumed_step is None else ""
    logging.info(
        "dvp_jax: method %s | model %d layers, d_model %d, vocab %d | train %s, rollout %s | "
        "%s%d RL steps of %d prompts x %d",
        cfg.method,
        m.n_layers,
        m.d_model,
        m.vocab_size,
        t.precision,
        cfg.rollout.dtype,
        warm,
        t.steps,
        t.prompts_per_step,
        t.group_size,
    )
    logging.info(
        "devices: %d x %s (process %d of %d) | mesh %s",
        jax.device_count(),
        jax.devices()[0].platform,
        jax.process_index(),
        jax.process_count(),
        ", ".join(f"{axis} {size}" for axis, size in mesh.shape.items()),
    )
    start = "fresh" if resumed_step is None else f"resuming from step {resumed_step}"
    trackers = t.trackers.replace(",", ", ") or "none"
    logging.info("workdir: %s (%s) | trackers: %s", workdir, start, trackers)


class Progress:
    """One line every `every` steps (and at the last): step, mean reward over the lines'
    window, the latest held-out accuracy, PPL gap, excluded fraction, steps/s over the window
    and the ETA at that rate."""

    def __init__(
        self, total_steps: int, first_step: int, every: int, eval_accuracy: float | None = None
    ):
        self.total, self.every = total_steps, max(1, every)
        self._since, self._time = first_step, time.time()
        self._rewards: list[float] = []
        self._eval = eval_accuracy  # until the first evaluation in the loop: the start one

    def __call__(self, step: int, metrics: Mapping[str, Any]) -> None:
        self._rewards.append(float(metrics["reward_mean"]))
        if "eval_accuracy" in metrics:
            self._eval = float(metrics["eval_accuracy"])
        if step % self.every and step != self.total:
            return
        now = time.time()
        rate = (step - self._since) / max(now - self._time, 1e-9)
        parts = [
            f"step {step}/{self.total}",
            f"reward {sum(self._rewards) / len(self._rewards):.3f}",
        ]
        if self._eval is not None:
            parts.append(f"held-out {self._eval:.1%}")
        parts += [
            f"ppl_gap {float(metrics['ppl_gap']):.4f}",
            f"excluded {float(metrics['frac_responses_excluded']):.3f}",
            f"{rate:.2f} steps/s",
            f"ETA {duration((self.total - step) / max(rate, 1e-9))}",
        ]
        logging.info(" | ".join(parts))
        self._since, self._time, self._rewards = step, now, []


def summary_line(summary: Mapping[str, Any]) -> str:
    """The closing line: whether RL improved held-out accuracy on where it started (the warm-up,
    if any), both figures, the PPL gap and the wall time."""
    parts = [f"done: {summary['steps']} RL steps ({summary['method']})"]
    start, end = summary.get("start_eval_accuracy"), summary.get("eval_accuracy")
    if start is not None and end is not None:
        gain = round(100 * (end - start), 1)  # the points as printed: +0.0 is no improvement
        verdict = "RL improved" if gain > 0 else "RL did not improve"
        parts.append(f"{verdict} held-out accuracy {start:.1%} -> {end:.1%} ({gain:+.1f} points)")
    if summary.get("final_ppl_gap") is not None:
        parts.append(f"ppl_gap {summary['final_ppl_gap']:.4f}")
    parts.append(f"{duration(summary['wall_time_s'])} of training")
    return " | ".join(parts)
