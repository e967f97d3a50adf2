"""Experiments as sets of work units, and the trainer command of each unit.

An experiment is a Python file (xmanager-style) that defines
  CONFIG = "configs/tiny_cpu.py"     # the base config, relative to the repository root
  CONFIG_ARG = "dvp"                 # optional: the `get_config` argument (`--config FILE:ARG`)
  SUMMARY_KEYS = ("eval_accuracy",)  # optional: summary.json columns of the final table
  def get_sweep(seeds=2) -> list[dict]:  # one dict of dotted config overrides per work unit
The sweep's inputs are `get_sweep`'s arguments (`--sweep NAME=VALUE`, VALUE a Python literal,
else a string). A unit's overrides become `--config.a.b=value` flags of `python -m dvp_jax.main`,
followed by the flags forwarded from the launcher's command line; the key `_name` names the unit.
Each unit gets its own workdir ROOT/EXPERIMENT/UNIT. This module only builds argument lists: it
reads no config and knows nothing of the model (the trainer parses and checks every flag).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from dvp_jax.pyfile import load_file

# The repository root (an editable install): CONFIG paths are relative to it, units run in it.
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_ROOT = "/tmp/dvp_jax_runs"
# A key missing from summary.json is also looked up as `final_<key>` (the trainer's tail means).
DEFAULT_SUMMARY_KEYS = (
    "start_eval_accuracy",
    "eval_accuracy",
    "ppl_gap",
    "frac_responses_excluded",
    "wall_time_s",
)
_MISSING = object()


@dataclasses.dataclass(frozen=True)
class WorkUnit:
    index: int
    name: str
    overrides: tuple[tuple[str, Any], ...]  # (dotted key, value), in the sweep's order


@dataclasses.dataclass(frozen=True)
class Experiment:
    """The units of one experiment file (or of one config, `single_run`).

    Attributes:
      name: the file's stem, e.g. "e000_smoke"; the workdirs are ROOT/name/UNIT.
      config: the base config, relative to the repository root.
      config_arg: its `get_config` argument, or None.
      summary_keys: the summary.json columns of the local runner's table.
      units: the work units.
      sweep_call: the call that made the units, e.g. "get_sweep(seeds=3)".
      trainer_flags: flags given to every unit's trainer verbatim, after the unit's overrides
        (so they win over the sweep: absl keeps the last value of a flag).
    """

    name: str
    config: str
    config_arg: str | None
    summary_keys: tuple[str, ...]
    units: tuple[WorkUnit, ...]
    sweep_call: str = "get_sweep()"
    trainer_flags: tuple[str, ...] = ()

    @property
    def config_flag(self) -> str:
        return self.config if not self.config_arg else f"{self.config}:{self.config_arg}"

    def argv(
        self, unit: WorkUnit, workdir: str, python: str, extra_flags: Sequence[str] = ()
    ) -> list[str]:
        """The trainer command of `unit` (`extra_flags`: the launcher's own, e.g. distributed)."""
        argv = unit_argv(self.config_flag, unit.overrides, workdir, python, extra_flags)
        return argv + list(self.trainer_flags)


def split_trainer_flags(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """The launcher's own arguments, and the trainer flags after the first `--` (verbatim)."""
    argv = list(argv)
    if "--" not in argv:
        return argv, []
    return argv[: argv.index("--")], argv[argv.index("--") + 1 :]


def parse_assignments(items: Sequence[str], what: str = "--sweep") -> dict[str, Any]:
    """`["seeds=3", "init_hf=/p"]` -> `{"seeds": 3, "init_hf": "/p"}` (Python literal, else str)."""
    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{what} {item!r}: want NAME=VALUE")
        try:
            out[key] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            out[key] = raw
    return out


def _check_config(source: str, config: str) -> None:
    if not os.path.exists(os.path.join(REPO, config)):
        raise ValueError(f"{source}: config {config!r} does not exist under {REPO}")


def load_experiment(
    path: str, sweep_args: Mapping[str, Any] | None = None, trainer_flags: Sequence[str] = ()
) -> Experiment:
    """Imports an experiment file and expands `get_sweep(**sweep_args)` into work units."""
    module = load_file(path)
    for attr in ("CONFIG", "get_sweep"):
        if not hasattr(module, attr):
            raise ValueError(
                f"{path}: an experiment must define {attr} (see dvp_jax/launch/sweep.py)"
            )
    _check_config(path, module.CONFIG)
    sweep_args = dict(sweep_args or {})
    signature = inspect.signature(module.get_sweep)
    try:
        signature.bind(**sweep_args)
    except TypeError as e:
        takes = ", ".join(
            p.name + ("" if p.default is p.empty else f"={p.default!r}")
            for p in signature.parameters.values()
        )
        raise ValueError(f"{path}: get_sweep({takes}) {e} (from --sweep)") from None
    call = "get_sweep(" + ", ".join(f"{k}={v!r}" for k, v in sweep_args.items()) + ")"
    return Experiment(
        name=os.path.splitext(os.path.basename(path))[0],
        config=module.CONFIG,
        config_arg=getattr(module, "CONFIG_ARG", None),
        summary_keys=tuple(getattr(module, "SUMMARY_KEYS", DEFAULT_SUMMARY_KEYS)),
        units=expand_sweep(module.get_sweep(**sweep_args), source=path),
        sweep_call=call,
        trainer_flags=tuple(trainer_flags),
    )


def single_run(config_flag: str, trainer_flags: Sequence[str] = ()) -> Experiment:
    """One unit of `--config FILE[:ARG]` and the forwarded flags: no experiment file needed.

    The experiment is named after the config file, its one unit `00_base`.
    """
    config, _, arg = config_flag.partition(":")
    _check_config("--config", config)
    return Experiment(
        name=os.path.splitext(os.path.basename(config))[0],
        config=config,
        config_arg=arg or None,
        summary_keys=DEFAULT_SUMMARY_KEYS,
        units=(WorkUnit(0, "00_base", ()),),
        sweep_call="--config " + config_flag,
        trainer_flags=tuple(trainer_flags),
    )


def select(exp: Experiment, only: Sequence[int] | None) -> Experiment:
    """The experiment restricted to the units with these indices (None: all)."""
    if only is None:
        return exp
    units = tuple(u for u in exp.units if u.index in set(only))
    if not units:
        raise ValueError(f"--only {','.join(map(str, only))}: no such work units in {exp.name}")
    return dataclasses.replace(exp, units=units)


def parse_only(only: str | None) -> list[int] | None:
    """`--only 0,2` -> [0, 2]."""
    try:
        return [int(i) for i in only.split(",")] if only else None
    except ValueError:
        raise ValueError(f"--only {only!r}: want comma-separated unit indices, e.g. 0,2") from None


def expand_sweep(
    sweep: Sequence[dict[str, Any]], source: str = "get_sweep()"
) -> tuple[WorkUnit, ...]:
    """Checks a sweep (a list of dicts of dotted overrides) and names its units uniquely.

    A unit's default name is its index plus the overrides that vary across the sweep, e.g.
    `03_method=dvp,seed=1` (the last part of the key, or the whole key where two would clash).
    """
    if not isinstance(sweep, list | tuple) or not sweep:
        raise ValueError(f"{source}: get_sweep() must return a non-empty list of dicts")
    for i, wu in enumerate(sweep):
        if not isinstance(wu, dict):
            raise ValueError(f"{source}: work unit {i} is {type(wu).__name__}, not a dict")
        for key in wu:
            if key != "_name" and not (
                isinstance(key, str) and re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", key)
            ):
                raise ValueError(
                    f"{source}: work unit {i} has a bad override key {key!r} "
                    "(want a dotted config path such as 'train.seed')"
                )
    overrides = [{k: v for k, v in wu.items() if k != "_name"} for wu in sweep]
    keys = list(dict.fromkeys(k for wu in overrides for k in wu))
    varying = [k for k in keys if len({repr(wu.get(k, _MISSING)) for wu in overrides}) > 1]
    short = {k: k.rsplit(".", 1)[-1] for k in varying}
    clash = {k for k in varying if list(short.values()).count(short[k]) > 1}
    units, names = [], set()
    for i, (wu, ov) in enumerate(zip(sweep, overrides, strict=True)):
        slug = wu.get("_name") or ",".join(
            f"{k if k in clash else short[k]}={format_value(ov[k])}" for k in varying if k in ov
        )
        name = f"{i:02d}_" + (re.sub(r"[^A-Za-z0-9._=,+-]", "_", str(slug))[:80] or "base")
        if name in names:
            raise ValueError(f"{source}: two work units are named {name!r}")
        names.add(name)
        units.append(WorkUnit(index=i, name=name, overrides=tuple(ov.items())))
    return tuple(units)


def format_value(value: Any) -> str:
    """A config value as absl `config_flags` parses it back (`--config.a.b=<this>`)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, list | tuple):
        return repr(tuple(value))
    if value is None:
        raise ValueError("None cannot be passed as a config override")
    return str(value)


def unit_argv(
    config_flag: str,
    overrides: Sequence[tuple[str, Any]],
    workdir: str,
    python: str,
    extra_flags: Sequence[str] = (),
) -> list[str]:
    """The trainer command of one work unit, as an argument list."""
    argv = [python, "-m", "dvp_jax.main", "--config", config_flag, "--workdir", workdir]
    argv += [*extra_flags, *(f"--config.{k}={format_value(v)}" for k, v in overrides)]
    return argv


def join_path(root: str, *parts: str) -> str:
    """os.path.join that leaves `gs://` roots alone."""
    return "/".join([root.rstrip("/"), *parts]) if "://" in root else os.path.join(root, *parts)
