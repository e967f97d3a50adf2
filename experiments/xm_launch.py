"""Runs an experiment's work units through the real XManager API (`xm_local`, no Docker).

  pip install xmanager          # optional extra: `pip install -e '.[xm]'`
  python -m experiments.xm_launch --experiment experiments/e000_smoke.py [--root DIR] \
      [--sweep NAME=VALUE ...] [--sequential] [--python .venv/bin/python]

The experiment file is the same one `experiments/launch.py` reads (CONFIG, CONFIG_ARG,
`get_sweep(**--sweep)`). An interpreter with dvp_jax installed (`--python`, default the one
running this script, so xmanager may live in its own venv) is packaged once as an `xm.binary`
executable (`python -m dvp_jax.main`) for `xm_local.Local`; each work unit of the sweep becomes
one `xm.Job` whose args are the unit's `--config` / `--workdir` / `--config.a.b=value` flags.
xm_local starts every work unit at once (use `--sequential` to wait for each before adding the
next), streams their output prefixed with the job name, and records the experiment in its local
database (`~/.xmanager`). At the end the summary table is built from each workdir's summary.json,
exactly as `launch.py` does; the exit status is 1 if any unit produced none.

Cloud (not exercised here; needs Docker, a GCP project and `gcloud auth`): swap the executable
and executor for Vertex AI,
  [executable] = experiment.package([xm.python_container(
      executor_spec=xm_local.Vertex.Spec(), path=REPO, entrypoint=xm.ModuleName("dvp_jax.main"),
      base_image="python:3.11")])
  executor = xm_local.Vertex(requirements=xm.JobRequirements(tpu_v3=8))  # or A100=8, ...
and add the same per-unit args. Vertex custom training offers single-host TPU types only; the
paper's multi-host v5p-64 run goes through Cloud TPU VMs: `launch.py --tpu NAME --zone Z`.

xmanager is imported inside `main` only, so nothing else in the project needs it.
"""

from __future__ import annotations

import asyncio
import os
import re
import sys

from absl import app, flags

from experiments import launch

_EXPERIMENT = flags.DEFINE_string("experiment", None, "experiments/eNNN_name.py")
_ROOT = flags.DEFINE_string("root", "/tmp/dvp_jax_runs", "root of the per-unit workdirs")
_PYTHON = flags.DEFINE_string(
    "python", None, "interpreter of the jobs (one with dvp_jax installed); default: this one"
)
_SEQUENTIAL = flags.DEFINE_bool(
    "sequential", False, "wait for each work unit to finish before adding the next"
)
_SWEEP = flags.DEFINE_multi_string("sweep", [], "NAME=VALUE: an argument of get_sweep()")


def build_jobs(xm, xm_local, executable, exp, root: str) -> list[tuple[str, str, object]]:
    """(unit name, workdir, xm.Job) for every work unit of `exp`."""
    jobs = []
    for unit in exp.units:
        workdir = os.path.abspath(launch.join_path(root, exp.name, unit.name))
        # unit_argv = [python, -m, dvp_jax.main, *flags]; the executable holds the first three.
        unit_flags = launch.unit_argv(exp.config_flag, unit.overrides, workdir, sys.executable)[3:]
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
    # xm_local gives a local job exactly this environment (not the parent's).
    env = dict(os.environ)
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
            print(f"[xm_launch] work unit {name} -> {workdir}", flush=True)
            work_unit = await experiment.add(job)  # returns once launched
            if sequential:
                try:
                    await work_unit.wait_until_complete()
                except xm.ExperimentUnitError as e:
                    print(f"[xm_launch] {name} failed: {e}", flush=True)
        # Leaving the block waits for every local job.
    return [(name, workdir) for name, workdir, _ in jobs]


def main(argv) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not _EXPERIMENT.value:
        raise app.UsageError("--experiment experiments/eNNN_name.py is required")
    try:
        from xmanager import xm, xm_local
    except ImportError:
        raise app.UsageError(
            "xmanager is not installed: `pip install xmanager` (or the `xm` extra), or use "
            "experiments/launch.py, which needs nothing beyond the project"
        ) from None

    try:
        exp = launch.load_experiment(_EXPERIMENT.value, launch.parse_assignments(_SWEEP.value))
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    os.chdir(launch.REPO)  # CONFIG paths are relative to the repository root; jobs inherit the cwd
    python = _PYTHON.value or sys.executable
    units = asyncio.run(_launch(xm, xm_local, exp, python, _ROOT.value, _SEQUENTIAL.value))
    results = []
    for unit, (_, workdir) in zip(exp.units, units, strict=True):
        summary = launch.read_summary(workdir)
        results.append(launch.UnitResult(unit, workdir, 0 if summary else 1, summary=summary))
    print(launch.summary_table(results, exp.summary_keys))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    app.run(lambda argv: sys.exit(main(argv)))
