"""Shared pieces of the science experiments (e001-e003): warm start, sweep runner, analysis.

* `tiny_config(overrides)`: configs/tiny_cpu.py (the base config of every experiment unit) with
  dotted overrides, as validated dataclasses.
* `prepare_init(root)`: one supervised warm-up run (600 SFT steps, 0 RL steps) exported as
  Hugging Face safetensors; every unit of e002/e003 starts RL from it (`model.hf_path`,
  `sft.steps=0`), like the paper where every method starts from the same base model. Seeds then
  vary only the RL randomness (rollout sampling keys and the prompt order).
* `sweep_parser`, `run_sweep`: the command line of e002/e003 and its sweep: prepare_init, then
  the experiment's units through the launcher's local runner (`dvp_jax.launch.local`), the
  warm start passed to `get_sweep(init_hf=...)`.
* `load_runs`, `mean_curve`, `tail_mean`, `markdown_table`: analysis of the unit workdirs
  (metrics.jsonl through `dvp_jax.metrics.read_metrics`, summary.json, launch.log).
* `load_policy`, `sample_rewards`, `clean_accuracy`: post-hoc evaluation of an exported policy.

Hardware for every number quoted in the experiment docstrings: 2 shared CPU cores.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import sys
from collections.abc import Callable, Sequence

import numpy as np

from dvp_jax import metrics
from dvp_jax.launch import local, sweep
from dvp_jax.pyfile import load_file

TINY_CPU = "configs/tiny_cpu.py"  # relative to the repository root
# CI sizes of a unit (e000, and the smoke variants of e002/e003): 2 SFT + 2 RL steps, 4 prompts
# x 2 responses, 8 eval prompts.
SMOKE = {
    "sft.steps": 2,
    "sft.warmup_steps": 0,
    "sft.batch_size": 8,
    "train.steps": 2,
    "train.prompts_per_step": 4,
    "train.group_size": 2,
    "eval.num_prompts": 8,
    "eval.k": 2,
    "eval.every": 0,
    "checkpoint.every": 0,
    "plots": False,
}
INIT_SFT_STEPS = 600  # the shared warm start: the default demo's SFT, no RL
INIT_OVERRIDES = {
    "train.steps": 0,
    "plots": False,
    "eval.num_prompts": 128,
    "sft.steps": INIT_SFT_STEPS,
}


def tiny_config(overrides: dict | None = None):
    """configs/tiny_cpu.py plus dotted `overrides`, as `ExperimentConfig` (char tokenizer)."""
    from dvp_jax.tokenizers import load_tokenizer
    from dvp_jax.train.config import ExperimentConfig

    cd = load_file(os.path.join(sweep.REPO, TINY_CPU)).get_config()
    cd.lock()  # as main.py does: an override of an undeclared field fails
    cd.update_from_flattened_dict(overrides or {})
    # A unit's warm start need not exist yet (a sweep checked before stage 0 runs).
    return ExperimentConfig.from_config_dict(
        cd, load_tokenizer("char").vocab_size, read_checkpoint=False
    )


# ------------------------------------------------------------------------------------------------
# The shared warm start and the sweep.
# ------------------------------------------------------------------------------------------------
def init_overrides(init_hf: str) -> dict:
    """Start-from overrides of a unit: the shared warm start `init_hf` (an hf_export directory).

    With `init_hf=""` (a plain `python -m dvp_jax.launch local` run), each unit does its own
    600-step warm-up from its own random init (slower, and seeds then also vary the init).
    """
    if init_hf:
        return {"model.hf_path": os.path.abspath(init_hf), "sft.steps": 0}
    return {"sft.steps": INIT_SFT_STEPS}


def init_workdir(root: str) -> str:
    return os.path.join(os.path.abspath(root), f"_init_sft{INIT_SFT_STEPS}")


def prepare_init(root: str) -> str:
    """Runs (once) the supervised warm-up and returns its hf_export directory."""
    workdir = init_workdir(root)
    export = os.path.join(workdir, "hf_export")
    if os.path.exists(os.path.join(export, "config.json")):
        return export
    argv = sweep.unit_argv(TINY_CPU, INIT_OVERRIDES.items(), workdir, sys.executable)
    print("[init] " + shlex.join(argv), flush=True)
    rc = local.run_logged(argv, workdir)
    if rc:
        raise RuntimeError(f"the warm start failed (exit {rc}); see {workdir}/launch.log")
    return export


def sweep_parser(doc: str, out: str, seeds: int, noise: float) -> argparse.ArgumentParser:
    """The command line of e002/e003: where units run, the sweep's inputs, what to skip."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--root", default=sweep.DEFAULT_ROOT, help="root of the unit workdirs")
    p.add_argument("--out", default=out, help="where the analysis writes its results")
    p.add_argument("--parallel", type=int, default=2, help="units run at a time")
    p.add_argument("--seeds", type=int, default=seeds, help="get_sweep(seeds=...)")
    p.add_argument("--noise", type=float, default=noise, help="get_sweep(noise=...)")
    p.add_argument("--only", default=None, help="comma-separated unit indices to run")
    p.add_argument("--analyze_only", action="store_true", help="analyse the workdirs, train none")
    return p


def run_sweep(path: str, args: argparse.Namespace):
    """Unless `--analyze_only`: the shared warm start, then the experiment's work units (the
    `--only` ones) through the launcher, with `get_sweep(seeds, noise, init_hf=<warm start>)`."""
    if args.analyze_only:
        return
    sweep_args = {"seeds": args.seeds, "noise": args.noise, "init_hf": prepare_init(args.root)}
    exp = sweep.select(sweep.load_experiment(path, sweep_args), sweep.parse_only(args.only))
    results = local.run_local(exp, args.root, args.parallel, dry_run=False, timeout=None)
    print(local.summary_table(results, exp.summary_keys), flush=True)


def sweep_main(argv, path: str, doc: str, out: str, seeds: int, noise: float, skip: str, analyse):
    """e002/e003's `main`: the sweep's command line plus one `--<skip>` flag, the units, then
    `analyse(root, out, not skip)`."""
    p = sweep_parser(doc, out, seeds, noise)
    p.add_argument(f"--{skip}", action="store_true", help=f"analyse without the {skip[3:]} step")
    args = p.parse_args(argv)
    run_sweep(path, args)
    analyse(args.root, args.out, not getattr(args, skip))
    return 0


# ------------------------------------------------------------------------------------------------
# Analysis of the unit workdirs.
# ------------------------------------------------------------------------------------------------
def unit_overrides(workdir: str) -> dict:
    """The `--config.a.b=v` flags of a unit, read back from the command line in its launch.log."""
    path = os.path.join(workdir, "launch.log")
    if not os.path.exists(path):
        return {}
    with open(path) as fh:
        first = fh.readline()
    out = {}
    for arg in shlex.split(first[2:] if first.startswith("$ ") else ""):
        if arg.startswith("--config.") and "=" in arg:
            key, value = arg[len("--config.") :].split("=", 1)
            out[key] = _parse_flag_value(value)
    return out


def _parse_flag_value(value: str):
    """The inverse of `sweep.format_value` for scalars."""
    if value in ("true", "false"):
        return value == "true"
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return value


def load_runs(root: str, experiment: str) -> list[dict]:
    """Every finished unit under `root/experiment` (name, workdir, overrides, summary, rows).

    Scans the unit workdirs (not the launcher's results.json, which only lists the last launch),
    so units run in several batches (`--only`) are all found.
    """
    base = os.path.join(os.path.abspath(root), experiment)
    runs = []
    for name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        workdir = os.path.join(base, name)
        summary = local.read_summary(workdir)
        if name.startswith("_") or summary is None:
            continue
        runs.append(
            {
                "name": name,
                "workdir": workdir,
                "overrides": unit_overrides(workdir),
                "summary": summary,
                "rows": metrics.read_metrics(workdir),
            }
        )
    return runs


def group_runs(runs: list[dict], key: Callable[[dict], object], order: Sequence) -> dict:
    """{group: runs} for the groups of `order` that have runs, in that order."""
    groups = {}
    for r in runs:
        groups.setdefault(key(r), []).append(r)
    return {g: groups[g] for g in order if g in groups}


def series(rows: list[dict], name: str) -> dict[int, float]:
    """step -> value of a declared metric over RL steps (>= 0); the last row of a step wins (the
    final eval row repeats the last periodic one's step)."""
    steps, values = metrics.series([r for r in rows if r["step"] >= 0], name)
    return dict(zip(steps, values, strict=True))


def mean_curve(runs: list[dict], name: str, smooth: int = 1):
    """Steps present in every run, mean and std over runs (optionally a trailing moving mean)."""
    curves = [c for c in (series(r["rows"], name) for r in runs) if c]
    if not curves:
        return None
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    if not steps:
        return None
    values = np.array([[c[s] for s in steps] for c in curves])  # [runs, steps]
    if smooth > 1:
        kernel = np.ones(smooth) / smooth
        values = np.array(
            [
                np.convolve(np.pad(v, (smooth - 1, 0), mode="edge"), kernel, mode="valid")
                for v in values
            ]
        )
    return np.array(steps), values.mean(0), values.std(0)


def tail_mean(rows: list[dict], name: str, last: int = 20) -> float:
    """Mean of a declared metric over the last `last` RL train rows (those with a loss); nan if
    none has it."""
    _, values = metrics.series([r for r in rows if r["step"] > 0 and "loss" in r], name)
    return float(np.mean(values[-last:])) if values else math.nan


def accuracies(runs: list[dict]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per run: final and start held-out accuracy (summary.json), and the best eval."""
    final = np.array([r["summary"]["eval_accuracy"] for r in runs])
    start = np.array([r["summary"]["start_eval_accuracy"] for r in runs])
    best = np.array([max(series(r["rows"], "eval_accuracy").values()) for r in runs])
    return final, start, best


def fmt(mean: float, std: float | None = None, digits: int = 3) -> str:
    if mean is None or not math.isfinite(mean):
        return "-"
    if std is None or not math.isfinite(std):
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_results(out: str, md: str, results: dict, runs: list[dict]) -> None:
    """results.md, results.json and each unit's summary.json (under out/units/) into `out`."""
    with open(os.path.join(out, "results.md"), "w") as fh:
        fh.write(md)
    with open(os.path.join(out, "results.json"), "w") as fh:
        json.dump(results, fh, indent=1)
    for r in runs:  # no checkpoints, event files or metrics: the committed results stay small
        dest = os.path.join(out, "units", r["name"])
        os.makedirs(dest, exist_ok=True)
        shutil.copy(os.path.join(r["workdir"], "summary.json"), dest)
    print(md)


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# ------------------------------------------------------------------------------------------------
# Post-hoc evaluation of a unit's exported policy (hf_export) without the rollout mismatch.
# ------------------------------------------------------------------------------------------------
def load_policy(hf_dir: str, dtype: str):
    """(cfg, an unpruned `dtype` rollout engine (64 slots) for the policy in hf_dir, tokenizer)."""
    from dvp_jax.model import TRAIN_POLICY
    from dvp_jax.model.hf_import import load_hf
    from dvp_jax.rollout.engine import EngineConfig, RolloutEngine
    from dvp_jax.tokenizers import load_tokenizer

    tokenizer = load_tokenizer("char")
    cfg = tiny_config()
    engine = RolloutEngine(
        cfg.model,
        EngineConfig(
            dtype=dtype,
            max_concurrent_decodes=64,
            max_prefill_length=cfg.data.max_prompt_len,
            prefill_buckets=(cfg.data.max_prompt_len,),
            max_decode_length=cfg.rollout.max_decode_length,
            log_rho=-math.inf,
        ),
        tokenizer=tokenizer,
        params=load_hf(hf_dir, TRAIN_POLICY, cfg=cfg.model),
    )
    return cfg, engine, tokenizer


def sample_rewards(cfg, engine, tokenizer, examples, k: int, key, sampling=None):
    """(RolloutBatch, exact-match rewards [P * k]) of k samples for each held-out example."""
    from dvp_jax.data import rewards
    from dvp_jax.rollout.offline import generate_rollouts

    batch = generate_rollouts(
        engine,
        [ex.prompt for ex in examples],
        k,
        key,
        sampling=sampling,
        prompt_len=cfg.data.max_prompt_len,
    )
    stop = set(tokenizer.stop_tokens)
    texts = [
        tokenizer.decode([int(t) for t in batch.response(i) if int(t) not in stop])
        for i in range(batch.num_rows)
    ]
    answers = [ex.answer for ex in examples for _ in range(k)]
    return batch, rewards.compute_rewards("exact_match", texts, answers)


def clean_accuracy(
    hf_dir: str, num_prompts: int = 256, k: int = 4, seed: int = 1234, dtype: str = "bfloat16"
) -> float:
    """Held-out avg@k of a policy sampled by a noise-free engine (bf16, full vocabulary).

    The trainer's own eval samples with the unit's rollout engine (logit noise included), which
    measures the rollout, not the learned policy. Every unit is scored here on the same prompts
    with the same keys (common random numbers).
    """
    import jax

    cfg, engine, tokenizer = load_policy(hf_dir, dtype)
    examples = cfg.data.make_task().heldout_examples(num_prompts)
    _, r = sample_rewards(cfg, engine, tokenizer, examples, k, jax.random.key(seed))
    return float(np.mean(r))
