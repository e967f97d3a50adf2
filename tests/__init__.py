"""The test suite. `SUITE_XLA_FLAGS` are the XLA flags of every process it runs: this one
(tests/conftest.py) and each it starts (`child_env`).

LLVM's optimizations are off (`--xla_backend_optimization_level=0`): the suite's programs are
tiny, compiling them is most of its time, and this saves much of it. XLA's own passes (fusion,
layouts, buffer assignment, donation) run as in a user's process, and the TPU compiler reports
the same memory figures; only the machine code is slower. Every process of the suite uses the same
flags, so a run in a child process and the same run in the test process stay the same programs.
"""

import os

SUITE_XLA_FLAGS = "--xla_backend_optimization_level=0"


def child_env(devices: int | None = None, **extra: str) -> dict[str, str]:
    """The environment of a process a test starts: this one's, on the CPU, with the suite's XLA
    flags and `devices` fake CPU devices (None: the process's own default)."""
    flags = SUITE_XLA_FLAGS
    if devices:
        flags += f" --xla_force_host_platform_device_count={devices}"
    return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags, **extra}
