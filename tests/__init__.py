"""The test suite. `SUITE_XLA_FLAGS` are the XLA flags of every process it runs: this one
(tests/conftest.py) and each it starts (`child_env`).

The suite's programs are tiny and compiling them is most of its time, so two of XLA's CPU
code-generation choices are made for compile speed: LLVM's optimizations off
(`--xla_backend_optimization_level=0`) and fusions emitted by the older elemental emitters
(`--xla_cpu_use_fusion_emitters=false`). Every process of the suite uses the same flags, so a
run in a child process and the same run in the test process stay the same programs. The TPU
compiler ignores both (its memory figures are unchanged). The emitter choice also decides which
fusions XLA forms (an in-place cache update is one), so the tests that check a compiled CPU
program's structure compile it with `DEFAULT_CPU_CODEGEN`, the compiler a user's process runs.
"""

import os

SUITE_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
# `Lowered.compile(compiler_options=DEFAULT_CPU_CODEGEN)`: XLA's default fusion emitters for one
# compile, for assertions about the structure of the program a user's process compiles.
DEFAULT_CPU_CODEGEN = {"xla_cpu_use_fusion_emitters": True}


def child_env(devices: int | None = None, **extra: str) -> dict[str, str]:
    """The environment of a process a test starts: this one's, on the CPU, with the suite's XLA
    flags and `devices` fake CPU devices (None: the process's own default)."""
    flags = SUITE_XLA_FLAGS
    if devices:
        flags += f" --xla_force_host_platform_device_count={devices}"
    return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags, **extra}
