"""Test setup: 8 fake CPU devices so sharding tests can build a (2, 2, 2) mesh, and the suite's
XLA flags (tests/__init__.py).

This is one of the two places (with `dvp_jax/main.py`) allowed to touch XLA flags and
`jax.config` (device count, matmul precision, the persistent compilation cache). The flags
must be set before JAX initialises its backends.
"""

import os
import tempfile

from tests import SUITE_XLA_FLAGS  # jax-free

for _flag in (SUITE_XLA_FLAGS, "--xla_force_host_platform_device_count=8"):
    if _flag not in os.environ.get("XLA_FLAGS", ""):  # pytest-xdist workers inherit them
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests must never reach a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import jax  # noqa: E402

# Test modules import JetStream directly: its compatibility shim must be in place first.
import dvp_jax.serve.jetstream_compat  # noqa: E402, F401

jax.config.update("jax_default_matmul_precision", "highest")
# One persistent compilation cache for the session, shared with the processes tests start
# (`dvp_jax.main` reads DVP_JAX_COMPILATION_CACHE): the same tiny programs are compiled once.
# A fresh directory per session, so no entry outlives the code that compiled it; pytest-xdist's
# workers inherit the variable from the process that starts them, so they share it too.
os.environ.setdefault("DVP_JAX_COMPILATION_CACHE", tempfile.mkdtemp(prefix="dvp_jax_jit_cache."))
jax.config.update("jax_compilation_cache_dir", os.environ["DVP_JAX_COMPILATION_CACHE"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

# Runs shared across test files (built on first use, once per session).
from tests.shared_runs import tiny_run  # noqa: E402, F401

# `make test` runs the suite in pytest-xdist workers (`-n 2`, with `--dist loadfile` from
# pyproject.toml): each file runs in one worker, so a module-scoped fixture is built once, and the
# slowest files go first, so that no long file starts last while the other worker idles (only the
# order depends on this list). (`--dist loadgroup` would split files, but pytest-xdist 3.8 cannot
# rename pytest 9's node ids, so its groups are ignored.)
SLOW_FILES = (
    "test_tpu_compile.py",
    "test_rollout_engine.py",
    "test_experiments_smoke.py",
    "test_faults.py",  # after two whole-worker modules: one worker builds `tiny_run`, none waits
    "test_multiprocess.py",
    "test_model.py",
    "test_trainer.py",
    "test_experiments_e005.py",
    "test_train_step.py",
    "test_experiments_e004.py",
    "test_rollout_sampling.py",
    "test_kl_entropy.py",
    "test_dvp_pruning.py",
    "test_attention.py",
    "test_dvp_losses.py",
    "test_accelerator_check.py",
)


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        rank = {name: i for i, name in enumerate(SLOW_FILES)}
        items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FILES)))
