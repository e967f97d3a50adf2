"""What a resumed run may change: a validated config flattened to "section.field" keys, the
fields in which it differs from the config.json a workdir was started with, and the check that
refuses it (`check_workdir`).

`check_workdir` refuses a rerun whose results-deciding fields differ; how long it runs,
how often it evaluates, saves and logs, and where it runs may change (`RESUMABLE_FIELDS`). A
workdir written before a field existed resumes where the run sets that field to the value that
reproduces the old run: its default, or its entry in `LEGACY_VALUES`. Not here: the config's
validation (`config`).
"""

from __future__ import annotations

import dataclasses
import json
import shlex
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

# A field added after a workdir may have been written is absent from that workdir's config.json;
# the run before it behaved as the field's default does, except for the fields here, whose value
# that reproduces the old behaviour is not their default. The one home of such values: a field
# added with a default that changes what an older run did gets its entry here.
LEGACY_VALUES = {
    # Before packed rows, the update took one sequence per row, padded to the longest.
    "train.packing": False,
    # Before paged decode, the engine kept one dense [B, S] KV cache.
    "rollout.decode_attention": "dense",
}


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


def legacy_values() -> dict[str, Any]:
    """{"section.field": the value that reproduces a run made before the field existed} for every
    section field and task knob with a default: `LEGACY_VALUES`' entry, else the default (None
    included). Fields without a default (the model's shape, from a preset) have none."""
    missing = dataclasses.MISSING
    has_default = lambda f: not (f.default is missing and f.default_factory is missing)
    out = {
        s: {f.name: field_default(f) for f in dataclasses.fields(c) if has_default(f)}
        for s, c in _SECTIONS.items()
    }
    out["data"] |= {name: task_knobs(cls) for name, cls in GENERATED_TASKS.items()}
    return _flatten(out) | LEGACY_VALUES


def _continue_with(key: str, value: Any) -> str:
    """How a run sets `key` to `value` on the command line (None: a placeholder left unset,
    since `--config.<key>=None` does not parse for a typed placeholder)."""
    if value is None:
        return f"leave config.{key} unset (None)"
    text = value if isinstance(value, str) else repr(value)
    return f"pass --config.{key}={shlex.quote(text)}"


def resume_mismatch(saved: dict[str, Any], current: ExperimentConfig) -> list[str]:
    """The fields (other than `RESUMABLE_FIELDS`) whose value differs from a saved config.

    A field missing from `saved` (added to the config after the workdir was made) counts only
    when its value is not the one that reproduces the old run (`legacy_values`). Returns lines
    like "model.d_ff: workdir 64, now 128" or "train.packing: new since the workdir was written,
    now True (pass --config.train.packing=False to resume it)", sorted by field.
    """
    now = flat_fields(current)
    legacy = legacy_values()
    diff = []
    for key in sorted(set(saved) | set(now)):
        if key.startswith(RESUMABLE_FIELDS):
            continue
        if key not in saved and key in now:
            if key in legacy and now[key] == legacy[key]:
                continue  # new since the workdir was made, at the value it ran with: no change
            hint = f" ({_continue_with(key, legacy[key])} to resume it)" if key in legacy else ""
            diff.append(f"{key}: new since the workdir was written, now {now[key]!r}{hint}")
        elif saved.get(key, "<absent>") != now.get(key, "<absent>"):
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
