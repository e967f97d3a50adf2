"""What a resumed run may change: a validated config flattened to "section.field" keys, the
fields in which it differs from the config.json a workdir was started with, and the check that
refuses it (`check_workdir`).

`check_workdir` refuses a rerun whose results-deciding fields differ; how long it runs,
how often it evaluates, saves and logs, and where it runs may change (`RESUMABLE_FIELDS`). Not
here: the config's validation (`config`).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from dvp_jax.errors import UserError
from dvp_jax.train.config import _SECTIONS, ExperimentConfig
from dvp_jax.train.sections import GENERATED_TASKS, field_default, task_knobs
from dvp_jax.workdir import as_path

# What a rerun on an existing workdir may change: how long it runs, how often it evaluates,
# saves and logs and to which trackers, where it runs (mesh, engine slots) and where the
# initial weights were read from. Every other field decides the results and must equal the
# workdir's config.json.
RESUMABLE_FIELDS = (
    "train.steps",
    "train.trackers",
    "train.wandb_",
    "eval.",
    "checkpoint.",
    "log_every",
    "plots",
    "mesh.",
    "rollout.max_concurrent_decodes",
    "rollout.tensor_parallel",
    "init_hf_path",
)


def flat_fields(cfg: ExperimentConfig) -> dict[str, Any]:
    """{"section.field": value} of every field of a validated config (JSON-serialisable); a
    task's knobs are "data.<task>.<knob>"."""
    return _flatten(dataclasses.asdict(cfg))


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out |= _flatten(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = list(v) if isinstance(v, tuple) else v
    return out


def _flat_defaults() -> dict[str, Any]:
    """{"section.field": dataclass default} for every section field and task knob that has one."""
    out = {
        s: {f.name: field_default(f) for f in dataclasses.fields(c)} for s, c in _SECTIONS.items()
    }
    out["data"] |= {name: task_knobs(cls) for name, cls in GENERATED_TASKS.items()}
    return {k: v for k, v in _flatten(out).items() if v is not None}


def resume_mismatch(saved: dict[str, Any], current: ExperimentConfig) -> list[str]:
    """The fields (other than `RESUMABLE_FIELDS`) whose value differs from a saved config.

    A field missing from `saved` (added to the config after the workdir was made) counts only
    when its value is not its default. Returns lines like "model.d_ff: workdir 64, now 128",
    sorted by field.
    """
    now = flat_fields(current)
    defaults = _flat_defaults()
    diff = []
    for key in sorted(set(saved) | set(now)):
        if key.startswith(RESUMABLE_FIELDS):
            continue
        if key not in saved and key in defaults and now[key] == defaults[key]:
            continue  # A field added after the workdir was made, at its default: no change.
        if saved.get(key, "<absent>") != now.get(key, "<absent>"):
            diff.append(
                f"{key}: workdir {saved.get(key, '<absent>')!r}, now {now.get(key, '<absent>')!r}"
            )
    return diff


class WorkdirMismatchError(ValueError, UserError):
    """The workdir holds a run started with a different config."""


def check_workdir(cfg: ExperimentConfig, workdir: str) -> None:
    """Raises `WorkdirMismatchError` (one line naming the fields) if `workdir`'s config.json
    differs from `cfg` in a field a resumed run may not change (`resume.RESUMABLE_FIELDS`)."""
    path = as_path(workdir) / "config.json"
    if not path.exists():
        return
    saved = json.loads(path.read_text())
    diff = resume_mismatch(saved, cfg)
    if diff:
        raise WorkdirMismatchError(
            f"{workdir} holds a run with a different config ({'; '.join(diff)}); rerun with "
            "that config to resume it, or pass a new --workdir"
        )
