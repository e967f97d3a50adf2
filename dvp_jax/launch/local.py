"""Runs an experiment's work units on this machine: a subprocess per unit, N at a time.

Each unit's output goes to WORKDIR/launch.log (first line: `$ the command`); at the end
ROOT/EXPERIMENT/results.json lists every unit and a table shows the requested summary.json keys.
Nothing here parses or checks a config: the trainer does.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from dvp_jax.launch.sweep import REPO, Experiment, WorkUnit, join_path


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
    rc = run_logged(exp.argv(unit, workdir, sys.executable), workdir, timeout)
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
    """Runs every unit (or, `dry_run`, prints its command and creates nothing)."""
    workdirs = {u.name: os.path.abspath(join_path(root, exp.name, u.name)) for u in exp.units}
    if dry_run:
        print(f"# {exp.name}.{exp.sweep_call}: {len(exp.units)} work units")
        for u in exp.units:
            print(f"# {u.name}\n{shlex.join(exp.argv(u, workdirs[u.name], sys.executable))}")
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
    rows = [
        dict(
            name=r.unit.name,
            overrides=dict(r.unit.overrides),
            workdir=r.workdir,
            returncode=r.returncode,
            wall_s=r.wall_s,
            summary=r.summary,
        )
        for r in ordered
    ]
    with open(os.path.join(os.path.abspath(root), exp.name, "results.json"), "w") as f:
        json.dump(rows, f, indent=1)
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


def report(results: Sequence[UnitResult], keys: Sequence[str]) -> int:
    """Prints the table and the failed units; the exit status of the launch (1: any failed)."""
    print(summary_table(results, keys))
    failed = [r.unit.name for r in results if not r.ok]
    if failed:
        print(
            f"[launch] {len(failed)} of {len(results)} units failed: {', '.join(failed)}",
            file=sys.stderr,
        )
    return 1 if failed else 0
