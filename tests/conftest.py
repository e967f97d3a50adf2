"""Test setup: 8 fake CPU devices so sharding tests can build a (2, 2, 2) mesh.

This is one of the two places (with `dvp_jax/main.py`) allowed to touch XLA flags and
`jax.config` (device count, matmul precision, the persistent compilation cache). The flag
must be set before JAX initialises its backends.
"""

import os
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests must never reach a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import jax  # noqa: E402

# Test modules import JetStream directly: its seqio stand-in must be in place first.
import dvp_jax.rollout  # noqa: E402, F401

jax.config.update("jax_default_matmul_precision", "highest")
# One persistent compilation cache for the session, shared with the processes tests start
# (`dvp_jax.main` reads DVP_JAX_COMPILATION_CACHE): the same tiny programs are compiled once.
# A fresh directory per session, so no entry outlives the code that compiled it.
os.environ.setdefault("DVP_JAX_COMPILATION_CACHE", tempfile.mkdtemp(prefix="dvp_jax_jit_cache."))
jax.config.update("jax_compilation_cache_dir", os.environ["DVP_JAX_COMPILATION_CACHE"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

# Runs shared across test files (built on first use, once per session).
from tests.shared_runs import tiny_run  # noqa: E402, F401
