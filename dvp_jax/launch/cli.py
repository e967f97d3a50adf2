"""The launcher's command line: `python -m dvp_jax.launch ACTION ...`.

  local  EXPERIMENT [--sweep NAME=VALUE ...] [--parallel N] [--root DIR] [--only 0,2] [--dry_run]
  create --tpu NAME --zone Z [--project P] --accelerator v5p-64 [--spot] [--queued [--best_effort]]
  setup  --tpu NAME --zone Z [--stage gs://BUCKET/PATH=/LOCAL/PATH ...] [--sync git ...]
  run    EXPERIMENT --tpu NAME --zone Z --root gs://BUCKET/runs [--only 0,2] [--detach]
  status | delete  --tpu NAME --zone Z [--queued]
`local` and `run` take an experiment file, or `--config FILE[:ARG]` for a single unit; flags
after `--` go to every unit's `python -m dvp_jax.main` as they are (after the sweep's, so they
win). The TPU actions print their gcloud commands, numbered, and run them only with `--run`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from dvp_jax.launch import local, sweep, tpu, workers


def _slice_args(p: argparse.ArgumentParser, queued: bool) -> None:
    p.add_argument("--tpu", default=None, help="the slice's name, e.g. dvp-v5p")
    p.add_argument("--zone", default=None, help="e.g. us-east5-a")
    p.add_argument("--project", default=None, help="default: gcloud's configured project")
    p.add_argument("--run", action="store_true", help="execute the printed commands, in order")
    if queued:
        p.add_argument("--queued", action="store_true", help="a queued resource (create --queued)")


def _layout_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--remote_dir", default="dvp_jax", help="project dir on workers (under ~)")
    p.add_argument("--venv", default="dvp_jax_venv", help="venv on workers (under ~)")
    p.add_argument("--remote_python", default=None, help="use this interpreter instead of the venv")


def _experiment_args(p: argparse.ArgumentParser, root_help: str) -> None:
    p.add_argument("experiment", nargs="?", default=None, help="experiments/eNNN_name.py")
    p.add_argument("--config", default=None, help="FILE[:ARG]: one unit of this config instead")
    p.add_argument(
        "--sweep",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an argument of the experiment's get_sweep(), e.g. seeds=3 (repeatable)",
    )
    p.add_argument("--root", default=None, help=root_help)
    p.add_argument("--only", default=None, help="comma-separated unit indices to run")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m dvp_jax.launch",
        description=__doc__,
        epilog="Trainer flags after `--` are forwarded to every unit: -- --config.train.steps=2",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="action", required=True)
    loc = sub.add_parser("local", help="an experiment's work units on this machine")
    _experiment_args(loc, f"root of the workdirs (default {sweep.DEFAULT_ROOT})")
    loc.add_argument("--parallel", type=int, default=1, help="units run at a time")
    loc.add_argument("--dry_run", action="store_true", help="print the commands, run nothing")
    loc.add_argument("--timeout", type=float, default=None, help="seconds per unit")
    create = sub.add_parser("create", help="create the slice (or queue a request for it)")
    _slice_args(create, queued=True)
    create.add_argument("--accelerator", default=None, help="accelerator type, e.g. v5p-64")
    create.add_argument("--version", default=None, help="runtime image (default: per generation)")
    create.add_argument("--spot", action="store_true", help="Spot VMs (preemptible, cheaper)")
    create.add_argument("--best_effort", action="store_true", help="with --queued (gcloud alpha)")
    setup = sub.add_parser("setup", help="project, Python, jax[tpu] and data on every worker")
    _slice_args(setup, queued=False)
    _layout_args(setup)
    setup.add_argument("--sync", default="scp", choices=("scp", "git"))
    setup.add_argument("--git_remote", default=None)
    setup.add_argument("--git_ref", default=None, help="default: this checkout's HEAD commit")
    setup.add_argument("--python_version", default="", help="default: pyproject's lowest")
    setup.add_argument("--skip_install", action="store_true", help="sync only: no Python, no pip")
    setup.add_argument(
        "--stage",
        action="append",
        default=[],
        metavar="gs://BUCKET/PATH=/LOCAL/PATH",
        help="copy a gs:// object or folder to this path on every worker (repeatable)",
    )
    run = sub.add_parser("run", help="an experiment's work units on every worker of the slice")
    _experiment_args(run, f"root of the workdirs, gs://BUCKET/PATH (default {sweep.DEFAULT_ROOT})")
    _slice_args(run, queued=False)
    _layout_args(run)
    run.add_argument("--detach", action="store_true", help="start all units under nohup, return")
    for name, text in (("status", "the slice's state"), ("delete", "delete the slice")):
        _slice_args(sub.add_parser(name, help=text), queued=True)
    args = p.parse_args(argv)
    if args.action == "local" and args.parallel < 1:
        p.error(f"--parallel must be >= 1, got {args.parallel}")
    return args


def experiment_from(args: argparse.Namespace, trainer_flags: Sequence[str]) -> sweep.Experiment:
    """The experiment file's units (or `--config`'s one unit), restricted to `--only`."""
    if (args.experiment is None) == (args.config is None):
        raise ValueError("give an experiment file (experiments/eNNN_name.py) or --config FILE")
    if args.config is not None:
        if args.sweep:
            raise ValueError("--sweep needs an experiment file (its get_sweep's arguments)")
        exp = sweep.single_run(args.config, trainer_flags)
    else:
        sweep_args = sweep.parse_assignments(args.sweep)
        exp = sweep.load_experiment(args.experiment, sweep_args, trainer_flags)
    return sweep.select(exp, sweep.parse_only(args.only))


def _steps(args: argparse.Namespace, trainer_flags: Sequence[str]) -> list[tpu.Step]:
    """The gcloud steps of a TPU action."""
    where = tpu.Slice(args.tpu or "", args.zone or "", args.project, getattr(args, "queued", False))
    if args.action == "create":
        return tpu.create_steps(where, args.accelerator, args.version, args.spot, args.best_effort)
    if args.action == "status":
        return tpu.status_steps(where)
    if args.action == "delete":
        return tpu.delete_steps(where)
    layout = workers.Layout(
        args.remote_dir, args.venv, getattr(args, "python_version", ""), args.remote_python
    )
    if args.action == "setup":
        return workers.setup_steps(
            where,
            layout,
            sync=args.sync,
            git_remote=args.git_remote,
            git_ref=args.git_ref,
            install=not args.skip_install,
            stages=[tpu.parse_stage(s) for s in args.stage],
        )
    exp = experiment_from(args, trainer_flags)
    return workers.run_steps(exp, where, layout, args.root or sweep.DEFAULT_ROOT, args.detach)


def main(argv: Sequence[str] | None = None) -> int:
    own, trainer_flags = sweep.split_trainer_flags(sys.argv[1:] if argv is None else argv)
    args = parse_args(own)
    try:
        if trainer_flags and args.action not in ("local", "run"):
            raise ValueError(f"{args.action} runs no trainer: flags after `--` go to local or run")
        if args.action != "local":
            return tpu.execute(_steps(args, trainer_flags), args.run)
        exp = experiment_from(args, trainer_flags)
    except ValueError as e:
        raise SystemExit(f"[launch] {e}") from None
    root = args.root or sweep.DEFAULT_ROOT
    results = local.run_local(exp, root, args.parallel, args.dry_run, args.timeout)
    return 0 if args.dry_run else local.report(results, exp.summary_keys)
