"""What a compiled program costs: per-chip bytes, dot FLOPs with loop trip counts, the table.

`plan.specs` builds a run's programs (`Spec`s) for a TPU topology; this module compiles one
(`compile_spec`) and reads into a `Program` per chip: argument, output, temporary and aliased
(donated) bytes, the peak (args + outputs + temps - aliases + code) plus what the other phase
keeps resident meanwhile (the trainer state during rollout, the engine's weights during the
update), and the dot FLOPs of one call with every loop counted by its trip count (the
compiler's `cost_analysis` counts a loop body once); `table` and `failures` render them. It
knows nothing of the trainer, the engine or topologies.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

from dvp_jax.plan.tables import Column, render

_GIB = 1024**3


# ==============================================================================================
# FLOPs with loop trip counts
# ==============================================================================================
def dot_flops(closed_jaxpr, while_trips: int = 1, scope: str = "") -> float:
    """Multiply-add FLOPs (2 per MAC) of every dot in a jaxpr, loops counted by trip count.

    Scans count `length` times; a `while` (trip count known only at run time) counts
    `while_trips` times; a `cond` counts its costliest branch (a skipped block or micro-batch
    is counted as run: the count is the program's, not the data's); `shard_map` bodies count
    once per shard; Pallas kernels count their own cost estimate, and one without (the splash
    kernel gives none) counts 0: see `uncounted_kernels`. Elementwise work is not counted
    (small beside a transformer's matmuls). With `scope`, only the dots traced under
    `jax.named_scope(scope)` (and its transposes and rematerialisations), e.g.
    `attention.ATTENTION_SCOPE`.
    """
    return _flops(closed_jaxpr.jaxpr, while_trips, scope=scope, inside=not scope)


def uncounted_kernels(closed_jaxpr) -> int:
    """Pallas kernel calls in a jaxpr that give no cost estimate (their FLOPs are not in
    `dot_flops`)."""
    counts = []
    _flops(closed_jaxpr.jaxpr, 1, counts)
    return len(counts)


def _flops(
    jaxpr, while_trips: int, uncounted: list | None = None, scope: str = "", inside: bool = True
) -> float:
    total = 0.0
    for eqn in jaxpr.eqns:
        name, params = eqn.primitive.name, eqn.params
        here = inside or scope in str(eqn.source_info.name_stack)
        recurse = lambda inner, here=here: _flops(inner, while_trips, uncounted, scope, here)
        if name == "dot_general":
            if not here:
                continue
            (lhs_contract, _), _ = params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            out = eqn.outvars[0].aval.shape
            total += 2.0 * math.prod(out) * math.prod(lhs[i] for i in lhs_contract)
        elif name == "scan":
            total += params["length"] * recurse(params["jaxpr"].jaxpr)
        elif name == "while":
            total += while_trips * recurse(params["body_jaxpr"].jaxpr)
        elif name == "cond":
            total += max(recurse(b.jaxpr) for b in params["branches"])
        elif name == "shard_map":
            total += params["mesh"].size * recurse(_inner(params["jaxpr"]))
        elif name == "pallas_call":
            estimate = params.get("cost_estimate")
            if estimate is None and uncounted is not None:
                uncounted.append(eqn)
            if here:
                total += float(getattr(estimate, "flops", 0) or 0)
        else:
            for value in params.values():
                inner = _inner(value)
                if inner is not None:
                    total += recurse(inner)
    return total


def _inner(value):
    """The Jaxpr of a ClosedJaxpr / Jaxpr parameter, else None."""
    from jax.extend import core

    if isinstance(value, core.ClosedJaxpr):
        return value.jaxpr
    if isinstance(value, core.Jaxpr):
        return value
    return None


# ==============================================================================================
# Programs
# ==============================================================================================
@dataclasses.dataclass
class Program:
    """One compiled program's per-chip bytes (or why it did not compile)."""

    name: str
    argument: int = 0
    output: int = 0
    temp: int = 0
    alias: int = 0
    code: int = 0
    resident: int = 0  # bytes the other phase keeps on the chip while this one runs
    moved: int = 0  # weight sync: bytes a chip (on device) or a host (via host) receives
    flops: float = 0.0  # per chip, per call, loops by trip count
    attention_flops: float = 0.0  # of `flops`, the full-sequence attention's (its name scope)
    compile_s: float = 0.0
    mosaic_kernels: int = 0  # Pallas (Mosaic) kernel calls in the program, e.g. splash
    uncounted_kernels: int = 0  # of those, the ones whose FLOPs `flops` leaves out
    warning: str = ""  # what explains a number the config makes worse than it needs to be
    error: str = ""

    @property
    def peak(self) -> int:
        return self.argument + self.output + self.temp - self.alias + self.code + self.resident

    def row(self, hbm: float) -> dict[str, Any]:
        gib = lambda b: round(b / _GIB, 3)
        return {
            "program": self.name,
            "argument_gib": gib(self.argument),
            "output_gib": gib(self.output),
            "temp_gib": gib(self.temp),
            "alias_gib": gib(self.alias),
            "resident_gib": gib(self.resident),
            "moved_gib": gib(self.moved),
            "peak_gib": gib(self.peak),
            "hbm_fraction": round(self.peak / (hbm * _GIB), 4),
            "tflop_per_call": round(self.flops / 1e12, 6),
            "attention_tflop_per_call": round(self.attention_flops / 1e12, 6),
            "compile_s": round(self.compile_s, 2),
            "warning": self.warning,
            "mosaic_kernels": self.mosaic_kernels,
            "uncounted_kernels": self.uncounted_kernels,
            "error": self.error,
        }


@dataclasses.dataclass
class Spec:
    """A program to build: the jitted function a run calls and its (abstract) arguments;
    `while_trips` counts the trips of its while loops for the FLOPs; `resident` is bytes per
    chip the other phase keeps meanwhile."""

    name: str
    jitted: Any
    args: tuple
    chips: int
    while_trips: int = 1
    resident: int = 0
    moved: int = 0  # weight sync: bytes a chip (on device) or a host (via host) receives
    warning: str = ""


def per_chip_bytes(tree) -> int:
    """Largest per-device bytes of a tree of sharded ShapeDtypeStructs / arrays."""
    import jax

    per_device: dict[Any, int] = {}
    for x in jax.tree.leaves(tree):
        sharding = x.sharding
        shard = math.prod(sharding.shard_shape(x.shape)) * x.dtype.itemsize
        for d in sharding.device_set:
            per_device[d] = per_device.get(d, 0) + shard
    return max(per_device.values(), default=0)


def compile_spec(spec: Spec) -> Program:
    """Lowers and compiles one program; errors become the program's `error`."""
    program = Program(spec.name, resident=spec.resident, moved=spec.moved, warning=spec.warning)
    start = time.time()
    try:
        traced = spec.jitted.trace(*spec.args)
        lowered = traced.lower()
        program.mosaic_kernels = lowered.as_text().count("@tpu_custom_call(")
        compiled = lowered.compile()
    except Exception as e:  # the compiler's reason, first line
        program.error = _reason(e)
        program.compile_s = time.time() - start
        return program
    program.compile_s = time.time() - start
    m = compiled.memory_analysis()
    program.argument = m.argument_size_in_bytes
    program.output = m.output_size_in_bytes
    program.temp = m.temp_size_in_bytes
    program.alias = m.alias_size_in_bytes
    program.code = m.generated_code_size_in_bytes
    from dvp_jax.model.attention import ATTENTION_SCOPE

    program.flops = dot_flops(traced.jaxpr, spec.while_trips) / spec.chips
    program.attention_flops = (
        dot_flops(traced.jaxpr, spec.while_trips, ATTENTION_SCOPE) / spec.chips
    )
    program.uncounted_kernels = uncounted_kernels(traced.jaxpr)
    return program


def _reason(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = lines[0] if lines else type(error).__name__
    for line in lines:  # the compiler's own diagnosis beats the wrapper's first line
        if any(key in line for key in ("RESOURCE_EXHAUSTED", "RET_CHECK", "NotImplemented")):
            text = line
            break
    return f"{type(error).__name__}: {text}"[:400]


# ==============================================================================================
# Reporting
# ==============================================================================================
def failures(programs: list[Program], hbm: float, fraction: float) -> list[str]:
    lines = []
    for p in programs:
        if p.error:
            lines.append(f"{p.name} does not compile: {p.error}")
        elif p.peak > fraction * hbm * _GIB:
            lines.append(
                f"{p.name} does not fit: peak {p.peak / _GIB:.1f} GiB per chip (resident "
                f"{p.resident / _GIB:.1f}) > {fraction:.0%} of {hbm} GiB"
            )
    return lines


_COLUMNS = (
    Column("program", 34, left=True),
    *(Column(title, 7, ".2f") for title in ("args", "out", "temp", "alias", "resid", "peak")),
    Column("%HBM", 6, ".1f", "%"),
    Column("TFLOP", 9),
    Column("compile", 8, ".1f", "s"),
)


def table(programs: list[Program], hbm: float) -> str:
    rows = []
    for p in programs:
        if p.error:
            rows.append(f"{p.name:<34} FAILED  {p.error[:120]}")
            continue
        gib = [b / _GIB for b in (p.argument, p.output, p.temp, p.alias, p.resident, p.peak)]
        mark = "*" if p.uncounted_kernels else " "
        share = 100 * p.peak / (hbm * _GIB)
        rows.append([p.name, *gib, share, f"{p.flops / 1e12:.3f}{mark}", p.compile_s])
    notes = []
    for p in programs:
        if p.warning:
            notes.append(f"warning: {p.name}: {p.warning}")
        if p.moved:
            where = "per chip, over the devices' links" if "on_device" in p.name else "per host"
            notes.append(f"{p.name}: {p.moved / _GIB:.2f} GiB received {where} per sync")
    notes.append(
        f"(GiB per chip; HBM {hbm} GiB; resid: the other phase's arrays on the chip; TFLOP per "
        "chip per call, loops by trip count; * leaves out Mosaic kernels without a cost "
        "estimate, e.g. splash attention)"
    )
    return render(_COLUMNS, rows, notes)
