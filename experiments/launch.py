"""The old import path of the launcher, which now lives in `dvp_jax.launch`.

Kept only so that experiment files and tests that still write `from experiments import launch`
or `python -m experiments.launch EXPERIMENT ...` (a local run) keep working; new code imports
`dvp_jax.launch.sweep` / `dvp_jax.launch.local` and runs `python -m dvp_jax.launch local ...`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from dvp_jax.launch import cli
from dvp_jax.launch.local import (  # noqa: F401  (re-exported)
    UnitResult,
    read_summary,
    run_local,
    run_logged,
    run_unit,
    summary_table,
)
from dvp_jax.launch.sweep import (  # noqa: F401  (re-exported)
    DEFAULT_ROOT,
    REPO,
    Experiment,
    WorkUnit,
    expand_sweep,
    format_value,
    join_path,
    load_experiment,
    parse_assignments,
    parse_only,
    select,
    unit_argv,
)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m experiments.launch EXPERIMENT ...` is `python -m dvp_jax.launch local ...`."""
    return cli.main(["local", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
