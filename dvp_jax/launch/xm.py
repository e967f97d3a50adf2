"""Runs an experiment's work units through the XManager API (`xm_local`, no Docker).

  pip install -e '.[xm]'
  python -m dvp_jax.launch.xm experiments/e000_smoke.py [--root DIR] [--sweep NAME=VALUE ...] \
      [--sequential] [--python .venv/bin/python] [-- TRAINER FLAGS]

The experiment file and the trainer commands are `sweep.py`'s: an interpreter with dvp_jax
installed is packaged once as an `xm.binary` (`python -m dvp_jax.main`), and each work unit
becomes one `xm.Job` whose args are that unit's flags. xm_local starts every unit at once
(`--sequential`: one after another), streams their output prefixed with the unit's name and
records the experiment in ~/.xmanager. The summary table and exit status are the local
runner's. For Vertex AI, swap the executable for `xm.python_container` and the executor for
`xm_local.Vertex`; Vertex has single-host TPUs only, so multi-host slices go through
`python -m dvp_jax.launch run`. xmanager is optional: it is imported when this runs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
from collections.abc import Sequence

from dvp_jax.launch import local, sweep


def build_jobs(xm, xm_local, executable, exp: sweep.Experiment, root: str) -> list[tuple]:
    """(unit name, workdir, xm.Job) for every work unit of `exp`."""
    jobs = []
    for unit in exp.units:
        workdir = os.path.abspath(sweep.join_path(root, exp.name, unit.name))
        # The argv is [python, -m, dvp_jax.main, *flags]; the executable holds the first three.
        unit_flags = exp.argv(unit, workdir, sys.executable)[3:]
        # xm_local shlex-quotes plain args and then execs without a shell, which would put literal
        # quotes into any arg with a space or quote; ShellSafeArg passes each one through as is.
        job = xm.Job(
            executable=executable,
            executor=xm_local.Local(experimental_stream_output=True),
            name=re.sub(r"[^A-Za-z0-9_.-]", "_", unit.name),  # prefixes the streamed output
            args=[xm.ShellSafeArg(a) for a in unit_flags],
        )
        jobs.append((unit.name, workdir, job))
    return jobs


async def _launch(xm, xm_local, exp, python: str, root: str, sequential: bool):
    """Adds one work unit per sweep entry; returns (unit name, workdir) pairs."""
    env = dict(os.environ)  # xm_local gives a local job exactly this environment
    async with xm_local.create_experiment(experiment_title=exp.name) as experiment:
        [executable] = experiment.package(
            [
                xm.binary(
                    path=python,
                    args=[xm.ShellSafeArg("-m"), xm.ShellSafeArg("dvp_jax.main")],
                    env_vars=env,
                    executor_spec=xm_local.Local.Spec(),
                )
            ]
        )
        jobs = build_jobs(xm, xm_local, executable, exp, root)
        for name, workdir, job in jobs:
            os.makedirs(workdir, exist_ok=True)
            print(f"[xm] work unit {name} -> {workdir}", flush=True)
            work_unit = await experiment.add(job)  # returns once launched
            if sequential:
                try:
                    await work_unit.wait_until_complete()
                except xm.ExperimentUnitError as e:
                    print(f"[xm] {name} failed: {e}", flush=True)
        # Leaving the block waits for every local job.
    return [(name, workdir) for name, workdir, _ in jobs]


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dvp_jax.launch.xm", description=__doc__)
    p.add_argument("experiment", help="experiments/eNNN_name.py")
    p.add_argument("--root", default=sweep.DEFAULT_ROOT, help="root of the per-unit workdirs")
    p.add_argument("--python", default=None, help="the jobs' interpreter (default: this one)")
    p.add_argument("--sequential", action="store_true", help="wait for each unit in turn")
    p.add_argument("--sweep", action="append", default=[], metavar="NAME=VALUE")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    own, trainer_flags = sweep.split_trainer_flags(sys.argv[1:] if argv is None else argv)
    args = parse_args(own)
    try:
        # Optional dependency: imported here so that nothing else in the project needs it.
        from xmanager import xm, xm_local
    except ImportError:
        raise SystemExit(
            "[xm] xmanager is not installed: `pip install -e '.[xm]'`, or use "
            "`python -m dvp_jax.launch local`, which needs nothing beyond the project"
        ) from None
    try:
        sweep_args = sweep.parse_assignments(args.sweep)
        exp = sweep.load_experiment(args.experiment, sweep_args, trainer_flags)
    except ValueError as e:
        raise SystemExit(f"[xm] {e}") from None
    os.chdir(sweep.REPO)  # CONFIG paths are relative to the repository root; jobs inherit the cwd
    python = args.python or sys.executable
    units = asyncio.run(_launch(xm, xm_local, exp, python, args.root, args.sequential))
    results = []
    for unit, (_, workdir) in zip(exp.units, units, strict=True):
        summary = local.read_summary(workdir)
        results.append(local.UnitResult(unit, workdir, 0 if summary else 1, summary=summary))
    return local.report(results, exp.summary_keys)


if __name__ == "__main__":
    sys.exit(main())
