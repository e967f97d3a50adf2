"""Shared pieces of the science experiments (e002, e003): base config, shared warm start, analysis.

* `base_config(method)`: configs/tiny_cpu.py plus a `model.hf_path` field (so a sweep can start
  every unit from the same exported policy) and the e002/e003 sizes.
* `prepare_init(root)`: one supervised warm-up run (600 SFT steps, 0 RL steps) exported as
  Hugging Face safetensors; every unit of e002/e003 starts RL from it (`model.hf_path`,
  `sft.steps=0`), like the paper where every method starts from the same base model. Seeds then
  vary only the RL randomness (rollout sampling keys and the prompt order).
* `run_sweep(...)`: prepare_init + experiments/launch.py's local runner with the init exported to
  the units through the environment variable `DVP_INIT_HF`.
* `load_runs`, `mean_curve`, `markdown_table`: analysis from the workdirs (metrics.jsonl,
  summary.json).

Hardware for every number quoted in the experiment docstrings: 2 shared CPU cores.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from collections.abc import Sequence

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INIT_ENV = "DVP_INIT_HF"  # a local hf_export directory every unit starts from


def _load(relpath: str, name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, relpath))
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module


def launch_module():
    return _load("experiments/launch.py", "dvp_launch")


def base_config(method: str = "dvp"):
    """configs/tiny_cpu.py with `model.hf_path` (empty: random init + in-run SFT warm-up)."""
    cfg = _load("configs/tiny_cpu.py", "dvp_tiny_cpu_config").get_config(method)
    cfg.model.hf_path = ""
    return cfg


def init_overrides(sft_steps_fallback: int = 600) -> dict:
    """Start-from overrides of a unit: the shared warm start when `DVP_INIT_HF` is set.

    Without it (a plain `launch.py` run), each unit does its own `sft_steps_fallback`-step
    warm-up from its own random init (slower, and seeds then also vary the init).
    """
    path = os.environ.get(INIT_ENV, "")
    if path:
        return {"model.hf_path": os.path.abspath(path), "sft.steps": 0}
    return {"sft.steps": sft_steps_fallback}


# Sizes of the shared warm start: the default demo's SFT, no RL.
INIT_OVERRIDES = {"train.steps": 0, "plots": False, "eval.num_prompts": 128}


def prepare_init(root: str, sft_steps: int = 600, extra: dict | None = None) -> str:
    """Runs (once) the supervised warm-up and returns its hf_export directory."""
    launch = launch_module()
    workdir = os.path.join(os.path.abspath(root), f"_init_sft{sft_steps}")
    export = os.path.join(workdir, "hf_export")
    if os.path.exists(os.path.join(export, "config.json")):
        return export
    os.makedirs(workdir, exist_ok=True)
    overrides = {**INIT_OVERRIDES, "sft.steps": sft_steps, **(extra or {})}
    argv = [
        sys.executable,
        "-m",
        "dvp_jax.main",
        "--config",
        "configs/tiny_cpu.py",
        "--workdir",
        workdir,
    ]
    argv += [f"--config.{k}={launch.format_value(v)}" for k, v in overrides.items()]
    print("[init] " + " ".join(argv), flush=True)
    with open(os.path.join(workdir, "launch.log"), "w") as log:
        subprocess.run(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, check=True)
    return export


def run_sweep(
    experiment_path: str,
    root: str,
    parallel: int,
    init_sft_steps: int = 600,
    only: Sequence[int] | None = None,
    init_extra: dict | None = None,
):
    """Shared warm start, then every work unit of the experiment through launch.py."""
    launch = launch_module()
    os.environ[INIT_ENV] = prepare_init(root, init_sft_steps, init_extra)
    exp = launch.load_experiment(experiment_path)  # get_sweep() sees DVP_INIT_HF
    if only is not None:
        exp = exp.__class__(
            **{**exp.__dict__, "units": tuple(u for u in exp.units if u.index in set(only))}
        )
    results = launch.run_local(exp, root, parallel, dry_run=False, timeout=None)
    print(launch.summary_table(results, exp.summary_keys), flush=True)
    return exp, results


# ------------------------------------------------------------------------------------------------
# Analysis.
# ------------------------------------------------------------------------------------------------
def read_rows(workdir: str) -> list[dict]:
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def unit_overrides(workdir: str) -> dict:
    """The `--config.a.b=v` flags of a unit, read back from the command line in its launch.log."""
    import shlex

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

    Scans the unit workdirs (not launch.py's results.json, which only lists the last launch),
    so units run in several batches (`--only`) are all found.
    """
    base = os.path.join(os.path.abspath(root), experiment)
    runs = []
    for name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        workdir = os.path.join(base, name)
        summary_path = os.path.join(workdir, "summary.json")
        if name.startswith("_") or not os.path.exists(summary_path):
            continue
        with open(summary_path) as fh:
            summary = json.load(fh)
        runs.append(
            {
                "name": name,
                "workdir": workdir,
                "overrides": unit_overrides(workdir),
                "summary": summary,
                "rows": read_rows(workdir),
            }
        )
    return runs


def series(rows: list[dict], key: str) -> dict[int, float]:
    """step -> value over RL steps (>= 0); the last row of a step wins (the final eval row)."""
    out = {}
    for row in rows:
        if row["step"] >= 0 and key in row and row[key] is not None:
            out[row["step"]] = float(row[key])
    return out


def mean_curve(runs: list[dict], key: str, smooth: int = 1):
    """Steps present in every run, mean and std over runs (optionally a trailing moving mean)."""
    curves = [series(r["rows"], key) for r in runs]
    curves = [c for c in curves if c]
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


def tail_mean(rows: list[dict], key: str, last: int = 20) -> float:
    vals = [r[key] for r in rows if r["step"] > 0 and "loss" in r and key in r][-last:]
    return float(np.mean(vals)) if vals else math.nan


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


def copy_small_outputs(runs: list[dict], dest: str, files=("summary.json", "metrics.jsonl")):
    """Copies each unit's summary/metrics (no checkpoints, no event files) under dest/units/."""
    import shutil

    for r in runs:
        out = os.path.join(dest, "units", r["name"])
        os.makedirs(out, exist_ok=True)
        for f in files:
            src = os.path.join(r["workdir"], f)
            if os.path.exists(src):
                shutil.copy(src, out)


# ------------------------------------------------------------------------------------------------
# Post-hoc evaluation of a unit's exported policy (hf_export) without the rollout mismatch.
# ------------------------------------------------------------------------------------------------
def eval_engine(cfg, model, dtype: str, tokenizer):
    """An unpruned rollout engine of `dtype` for `model`, shaped for `cfg`'s task (64 slots)."""
    from dvp_jax.rollout.engine import EngineConfig, RolloutEngine

    return RolloutEngine(
        cfg.model,
        EngineConfig(
            dtype=dtype,
            max_concurrent_decodes=64,
            max_prefill_length=cfg.data.max_prompt_len,
            prefill_buckets=(cfg.data.max_prompt_len,),
            max_decode_length=cfg.rollout.max_new_tokens,
            log_rho=-math.inf,
        ),
        tokenizer=tokenizer,
        params=model,
    )


def clean_accuracy(
    hf_dir: str, num_prompts: int = 256, k: int = 4, seed: int = 1234, dtype: str = "bfloat16"
) -> float:
    """Held-out avg@k of a policy sampled by a noise-free engine (bf16, full vocabulary).

    The trainer's own eval samples with the unit's rollout engine (logit noise included), which
    measures the rollout, not the learned policy. Every unit is scored here on the same prompts
    with the same keys (common random numbers).
    """
    import jax
    import numpy as np

    from dvp_jax.data import rewards
    from dvp_jax.model import TRAIN_POLICY
    from dvp_jax.model.hf_import import load_hf
    from dvp_jax.rollout.offline import generate_rollouts
    from dvp_jax.rollout.tokenizers import load_tokenizer
    from dvp_jax.train.config import ExperimentConfig

    tokenizer = load_tokenizer("char")
    cfg = ExperimentConfig.from_config_dict(base_config("rloo"), tokenizer.vocab_size)
    model = load_hf(hf_dir, TRAIN_POLICY, cfg=cfg.model)
    engine = eval_engine(cfg, model, dtype, tokenizer)
    task = cfg.data.arithmetic_task()
    examples = task.heldout_examples(num_prompts)
    batch = generate_rollouts(
        engine,
        [ex.prompt for ex in examples],
        k,
        jax.random.key(seed),
        prompt_len=cfg.data.max_prompt_len,
    )
    stop = set(tokenizer.stop_tokens)
    texts = [
        tokenizer.decode([int(t) for t in batch.response(i) if int(t) not in stop])
        for i in range(batch.num_rows)
    ]
    answers = [ex.answer for ex in examples for _ in range(k)]
    return float(np.mean(rewards.compute_rewards("exact_match", texts, answers)))
