"""Committed results are compared with a stated tolerance, and the CPU that `make test`'s second
pass emulates is the one it says (docs/design.md, "Which outputs are bit-exact").

The tolerance helper (tests/helpers.py `assert_close_tree`) passes another machine's rounding
and fails a wrong label or a figure off by more than the tolerance. The second pass (Makefile,
`AVX2_CPU`) runs the tests marked `committed_results` with numpy's AVX-512 paths, OpenBLAS's
AVX-512 kernels and XLA's AVX-512 code turned off; the last test here checks each took effect.
"""

from __future__ import annotations

import ctypes
import glob
import math
import os

import numpy as np
import pytest

from tests.helpers import RESULT_ATOL, RESULT_RTOL, assert_close_tree

COMMITTED = {
    "verdict": "the premise appears at this scale",
    "passed": True,
    "n": 3,
    "note": None,
    "metrics": {"r": {"mean": 1.4812, "lo": 0.0074, "values": [0.5, -0.25, 2.0]}},
    "zero": 0.0,
    "missing": float("nan"),
}


def _with(path, value):
    """COMMITTED with the leaf at `path` (keys and indices) replaced by `value`."""
    import copy

    tree = copy.deepcopy(COMMITTED)
    node = tree
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return tree


def test_another_machines_rounding_passes():
    assert_close_tree(COMMITTED, COMMITTED)
    # A few ulps (another CPU's summation order): 1e-14 relative.
    r = COMMITTED["metrics"]["r"]
    assert_close_tree(_with(("metrics", "r", "mean"), r["mean"] * (1 + 1e-14)), COMMITTED)
    assert_close_tree(_with(("metrics", "r", "values", 1), -0.25 - 3e-16), COMMITTED)
    assert_close_tree(_with(("zero",), 1e-19), COMMITTED)  # a rounding residue elsewhere
    assert_close_tree(_with(("zero",), 0), COMMITTED)  # an int where the rounding gave 0.0


@pytest.mark.parametrize(
    "path, value, message",
    [
        (("metrics", "r", "mean"), 1.4812 * (1 + 10 * RESULT_RTOL), "metrics.r.mean"),
        (("metrics", "r", "lo"), 0.0074 + 2 * RESULT_RTOL * 0.0074, "metrics.r.lo"),
        (("metrics", "r", "values", 2), 2.0 + 1e-6, r"values\[2\]"),
        (("zero",), 10 * RESULT_ATOL, "zero"),
        (("missing",), 0.0, "missing"),
        (("metrics", "r", "mean"), float("nan"), "metrics.r.mean"),
        (("verdict",), "the premise does not appear at this scale", "verdict"),
        (("passed",), False, "passed"),
        (("passed",), 1.0, "passed"),  # a bool is not a number
        (("n",), 4, "n"),
        (("note",), "", "note"),
        (("metrics", "r", "values"), [0.5, -0.25], "values: 2 items"),
        (("metrics", "r"), {"mean": 1.4812, "lo": 0.0074}, "keys"),
    ],
)
def test_a_wrong_label_or_a_figure_beyond_the_tolerance_fails(path, value, message):
    with pytest.raises(AssertionError, match=message):
        assert_close_tree(_with(path, value), COMMITTED)


def test_the_tolerance_hides_no_committed_figure():
    """RESULT_ATOL is at most ten times RESULT_RTOL times the smallest non-zero figure of every
    committed verdict, so every committed figure is held to ~1e-8 relative or better; RESULT_RTOL
    is far below any reported precision (the READMEs print 3 significant digits)."""
    import json

    root = os.path.join(os.path.dirname(__file__), "..", "experiments", "results")

    def floats(x):
        if isinstance(x, dict):
            x = list(x.values())
        if isinstance(x, list):
            return [f for item in x for f in floats(item)]
        return [abs(x)] if isinstance(x, float) and math.isfinite(x) and x != 0 else []

    for path in sorted(glob.glob(os.path.join(root, "*", "verdict.json"))):
        with open(path) as fh:
            smallest = min(floats(json.load(fh)))
        assert RESULT_ATOL <= 10 * RESULT_RTOL * smallest, (path, smallest)
    assert RESULT_RTOL <= 1e-6


def _openblas_core() -> str | None:
    """The kernel set numpy's bundled OpenBLAS picked at load time; None where numpy links
    another BLAS."""
    libs = os.path.join(os.path.dirname(np.__file__) + ".libs", "*openblas*.so*")
    for path in glob.glob(libs):
        lib = ctypes.CDLL(path)
        for name in ("scipy_openblas_get_corename64_", "openblas_get_corename64_"):
            if hasattr(lib, name):
                getter = getattr(lib, name)
                getter.restype = ctypes.c_char_p
                return getter().decode()
    return None


@pytest.mark.committed_results
@pytest.mark.skipif(
    "NPY_DISABLE_CPU_FEATURES" not in os.environ, reason="only in the emulated-CPU pass"
)
def test_the_emulated_cpu_takes_effect():
    """In `make test`'s second pass: numpy dispatches to no AVX-512 path (it ignores names it does
    not know, silently), OpenBLAS runs its Haswell kernels, and XLA took the AVX2 cap (an unknown
    XLA flag aborts the process, so a jitted call is the check that it was read; its effect was
    checked by disassembly: no EVEX instruction in the compiled exp kernel, 100 without it)."""
    import jax
    import jax.numpy as jnp
    from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__

    on = [t for t in __cpu_dispatch__ if __cpu_features__.get(t)]
    assert not [t for t in on if "512" in t or t == "X86_V4"], on
    if os.environ.get("OPENBLAS_CORETYPE"):
        core = _openblas_core()
        assert core is None or core.lower() == os.environ["OPENBLAS_CORETYPE"].lower(), core
    assert "--xla_cpu_max_isa=AVX2" in os.environ.get("XLA_FLAGS", "")
    assert float(jax.jit(lambda x: jnp.exp(x).sum())(jnp.zeros(64))) == 64.0
