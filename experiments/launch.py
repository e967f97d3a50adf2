"""Runs an experiment's work units locally, or on every worker of a Cloud TPU VM slice.

An experiment is a Python file `experiments/eNNN_name.py` (xmanager-style: a set of work units):

  CONFIG = "configs/tiny_cpu.py"     # the base config, relative to the repository root
  CONFIG_ARG = "dvp"                 # optional: the `get_config` argument (`--config FILE:ARG`)
  SUMMARY_KEYS = ("eval_accuracy",)  # optional: summary.json columns of the final table
  def get_sweep(seeds=2) -> list[dict]:  # one dict of dotted config overrides per work unit
      return [{"method": m, "train.seed": s} for m in ("rloo", "dvp") for s in range(seeds)]

The sweep's inputs are `get_sweep`'s arguments, given on the command line as `--sweep NAME=VALUE`
(repeatable; VALUE is a Python literal, else a string), e.g. `--sweep seeds=3 --sweep
init_hf=/path`; the launcher prints the call it made. A unit's overrides become
`--config.a.b=value` flags of `python -m dvp_jax.main`; the optional key `_name` names the unit
(default: its index and the overrides that vary across the sweep, e.g. `01_method=dvp,seed=1`).
Each unit gets its own workdir `ROOT/EXPERIMENT/UNIT`, where the trainer writes `summary.json`
at the end of the run.

Run from the repository root (experiment files and CONFIG paths are relative to it).

Local (a subprocess per unit, N at a time; logs in each workdir's `launch.log`; a summary table
from the summary.json files at the end; exit status 1 if any unit failed):
  python -m experiments.launch experiments/e000_smoke.py [--sweep NAME=VALUE ...] \
      [--parallel N] [--root DIR] [--dry_run] [--only 0,2] [--timeout SECONDS]

Cloud TPU VM slice (multi-host; experiments/tpu.py): `ACTION --tpu NAME --zone Z ...` with
ACTION one of create, setup, run, status, delete prints the gcloud commands (`--run` executes
them), e.g.
  python -m experiments.launch run experiments/e002_methods.py --tpu NAME --zone Z \
      --root gs://BUCKET/runs [--sweep NAME=VALUE ...] [--run]
The older `python -m experiments.launch EXPERIMENT --tpu NAME --zone Z ...` is setup + run.
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import dataclasses
import inspect
import json
import math
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from dvp_jax.pyfile import load_file

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_ROOT = "/tmp/dvp_jax_runs"
# A key missing from summary.json is also looked up as `final_<key>` (the trainer's tail means).
DEFAULT_SUMMARY_KEYS = (
    "start_eval_accuracy",
    "eval_accuracy",
    "ppl_gap",
    "frac_responses_excluded",
    "wall_time_s",
)
# `python -m experiments.launch ACTION ...` with these actions goes to experiments/tpu.py.
TPU_ACTIONS = ("create", "setup", "run", "status", "delete")


# ------------------------------------------------------------------------------------------------
# Experiments and work units.
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Experiment:
    name: str  # the file's stem, e.g. "e000_smoke"
    config: str  # path relative to the repository root
    config_arg: str | None
    summary_keys: tuple[str, ...]
    units: tuple[WorkUnit, ...]
    sweep_call: str = "get_sweep()"  # the call that made the units, e.g. "get_sweep(seeds=3)"

    @property
    def config_flag(self) -> str:
        return self.config if not self.config_arg else f"{self.config}:{self.config_arg}"


@dataclasses.dataclass(frozen=True)
class WorkUnit:
    index: int
    name: str
    overrides: tuple[tuple[str, Any], ...]  # (dotted key, value), in the sweep's order


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


def load_experiment(path: str, sweep_args: Mapping[str, Any] | None = None) -> Experiment:
    """Imports an experiment file and expands `get_sweep(**sweep_args)` into work units."""
    module = load_file(path)
    for attr in ("CONFIG", "get_sweep"):
        if not hasattr(module, attr):
            raise ValueError(
                f"{path}: an experiment must define {attr} (see experiments/launch.py)"
            )
    config = module.CONFIG
    if not os.path.exists(os.path.join(REPO, config)):
        raise ValueError(f"{path}: CONFIG={config!r} does not exist under {REPO}")
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
        config=config,
        config_arg=getattr(module, "CONFIG_ARG", None),
        summary_keys=tuple(getattr(module, "SUMMARY_KEYS", DEFAULT_SUMMARY_KEYS)),
        units=expand_sweep(module.get_sweep(**sweep_args), source=path),
        sweep_call=call,
    )


def select(exp: Experiment, only: Sequence[int] | None) -> Experiment:
    """The experiment restricted to the units with these indices (None: all)."""
    if only is None:
        return exp
    units = tuple(u for u in exp.units if u.index in set(only))
    if not units:
        raise ValueError(f"--only {','.join(map(str, only))}: no such work units in {exp.name}")
    return dataclasses.replace(exp, units=units)


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


_MISSING = object()


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


# ------------------------------------------------------------------------------------------------
# Local runs.
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class UnitResult:
    unit: WorkUnit
    workdir: str
    returncode: int | None = None  # None: not run (dry run)
    wall_s: float = 0.0
    summary: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.summary is not None


def run_logged(argv: Sequence[str], workdir: str, timeout: float | None = None) -> int:
    """Runs `argv` in REPO, output to `workdir/launch.log` (first line `$ command`); exit status."""
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "launch.log"), "w") as log:
        log.write("$ " + shlex.join(argv) + "\n")
        log.flush()
        try:
            return subprocess.run(
                argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, check=False
            ).returncode
        except subprocess.TimeoutExpired:
            log.write(f"\n[launch] killed after the {timeout} s timeout\n")
            return 124


def run_unit(exp: Experiment, unit: WorkUnit, workdir: str, timeout: float | None) -> UnitResult:
    start = time.time()
    argv = unit_argv(exp.config_flag, unit.overrides, workdir, sys.executable)
    rc = run_logged(argv, workdir, timeout)
    return UnitResult(unit, workdir, rc, time.time() - start, read_summary(workdir))


def read_summary(workdir: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(workdir, "summary.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def run_local(
    exp: Experiment, root: str, parallel: int, dry_run: bool, timeout: float | None
) -> list[UnitResult]:
    workdirs = {u.name: os.path.abspath(join_path(root, exp.name, u.name)) for u in exp.units}
    if dry_run:
        print(f"# {exp.name}.{exp.sweep_call}: {len(exp.units)} work units")
        for u in exp.units:
            argv = unit_argv(exp.config_flag, u.overrides, workdirs[u.name], sys.executable)
            print(f"# {u.name}\n{shlex.join(argv)}")
        return [UnitResult(u, workdirs[u.name]) for u in exp.units]
    print(
        f"[launch] {exp.name}.{exp.sweep_call}: {len(exp.units)} work units, {parallel} at a "
        f"time, root {root}",
        flush=True,
    )
    results = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=parallel) as pool:
        futures = {pool.submit(run_unit, exp, u, workdirs[u.name], timeout): u for u in exp.units}
        for fut in concurrent.futures.as_completed(futures):
            r = fut.result()
            results[r.unit.name] = r
            status = "ok" if r.ok else f"FAILED (exit {r.returncode}, log {r.workdir}/launch.log)"
            print(f"[launch] {r.unit.name}: {status} in {r.wall_s:.0f} s", flush=True)
    ordered = [results[u.name] for u in exp.units]
    with open(os.path.join(os.path.abspath(root), exp.name, "results.json"), "w") as f:
        json.dump(
            [
                dict(
                    name=r.unit.name,
                    overrides=dict(r.unit.overrides),
                    workdir=r.workdir,
                    returncode=r.returncode,
                    wall_s=r.wall_s,
                    summary=r.summary,
                )
                for r in ordered
            ],
            f,
            indent=1,
        )
    return ordered


def summary_table(results: Sequence[UnitResult], keys: Sequence[str]) -> str:
    """A fixed-width table: one row per unit, the requested summary.json keys as columns."""
    header = ["unit", "status", *keys]
    rows = [header]
    for r in results:
        status = "-" if r.returncode is None else ("ok" if r.ok else f"fail({r.returncode})")
        cells = [r.unit.name, status]
        for k in keys:
            summary = r.summary or {}
            v = summary.get(k, summary.get(f"final_{k}"))
            cells.append("-" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v)))
        rows.append(cells)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows
    )


# ------------------------------------------------------------------------------------------------
# Command line.
# ------------------------------------------------------------------------------------------------
def parse_only(only: str | None) -> list[int] | None:
    """`--only 0,2` -> [0, 2]."""
    try:
        return [int(i) for i in only.split(",")] if only else None
    except ValueError:
        raise ValueError(f"--only {only!r}: want comma-separated unit indices, e.g. 0,2") from None


def add_experiment_args(p: argparse.ArgumentParser) -> None:
    """The experiment and its sweep (shared by local runs and `run` on a TPU slice)."""
    p.add_argument("experiment", help="experiments/eNNN_name.py")
    p.add_argument(
        "--sweep",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an argument of the experiment's get_sweep(), e.g. seeds=3 (repeatable)",
    )
    p.add_argument(
        "--root",
        default=None,
        help=f"root of the workdirs (default {DEFAULT_ROOT}; a gs:// path on TPU)",
    )
    p.add_argument("--only", default=None, help="comma-separated unit indices to run")


def experiment_from(args: argparse.Namespace) -> Experiment:
    """The experiment of `add_experiment_args`'s flags, restricted to `--only`."""
    exp = load_experiment(args.experiment, parse_assignments(args.sweep))
    return select(exp, parse_only(args.only))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    from experiments import tpu  # tpu.py imports this module

    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Cloud TPU slices: python -m experiments.launch {create,setup,run,status,delete} "
        "--help (experiments/tpu.py)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_experiment_args(p)
    p.add_argument("--parallel", type=int, default=1, help="local units run at a time")
    p.add_argument("--dry_run", action="store_true", help="print the local commands, run nothing")
    p.add_argument("--timeout", type=float, default=None, help="seconds per local unit")
    g = p.add_argument_group("Cloud TPU VM (setup + run; see `launch.py setup/run --help`)")
    tpu.add_slice_args(g, queued=False)
    g.add_argument("--detach", action="store_true", help="start all units under nohup, return")
    tpu.add_layout_args(g)
    tpu.add_setup_args(g)
    args = p.parse_args(argv)
    if args.parallel < 1:
        p.error(f"--parallel must be >= 1, got {args.parallel}")
    if args.tpu and not args.zone:
        p.error("--tpu needs --zone (e.g. --zone us-east5-a)")
    if not args.tpu and (args.run or args.detach or args.zone or args.stage):
        p.error("--run / --detach / --zone / --stage only apply with --tpu")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in TPU_ACTIONS:
        from experiments import tpu  # tpu.py imports this module

        return tpu.main(argv)
    args = parse_args(argv)
    try:
        exp = experiment_from(args)
    except ValueError as e:
        raise SystemExit(f"[launch] {e}") from None
    if args.tpu:
        from experiments import tpu

        return tpu.legacy_main(args, exp)
    root = args.root or DEFAULT_ROOT
    results = run_local(exp, root, args.parallel, args.dry_run, args.timeout)
    if args.dry_run:
        return 0
    print(summary_table(results, exp.summary_keys))
    failed = [r.unit.name for r in results if not r.ok]
    if failed:
        print(
            f"[launch] {len(failed)} of {len(results)} units failed: {', '.join(failed)}",
            file=sys.stderr,
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
