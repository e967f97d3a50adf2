"""Entry point: `python -m dvp_jax.main --config configs/tiny_cpu.py --workdir DIR`.

Overrides: `--config.train.steps=10`, `--config.method=mis_dvp`, or a config argument
`--config configs/tiny_cpu.py:rloo`. Rerunning with the same `--workdir` resumes from its newest
intact checkpoint (a workdir started with a different config is refused, naming the fields).
Exit status: 0 done; 75 stopped by SIGTERM, 130 by SIGINT (checkpoint saved: rerun to resume);
2 a mistake in the input (config, flag, path, data, checkpoint, a workdir in use), printed as
one line naming what was wrong and what is allowed; 1 any other failure (a checkpoint write
that failed: one line with the path and the cause; a bug: its traceback). `--verbose` shows
tracebacks for every error and the libraries' INFO logs.
Multi-process: on Cloud TPU VMs `jax.distributed.initialize()` auto-detects the slice
(`--distributed`); elsewhere pass `--coordinator_address`, `--num_processes` and `--process_id`.

This module (with `cli.use_compilation_cache`, `dvp_jax.aot` and tests/conftest.py) is the only
place that touches `jax.config`.
"""

from __future__ import annotations

import logging as std_logging
import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from dvp_jax.cli import (
    BACKENDS,
    COMPILATION_CACHE_HELP,
    DEFAULT_COMPILATION_CACHE,
    USAGE_EXIT_CODE,
    fail,
    flag_error,
    parse_flags,
    require_backend,
    use_compilation_cache,
)

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config file (every field: dvp_jax.train.config.default_config)."
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (checkpoints, metrics, plots).")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0 for multi-process runs."
)
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Number of processes.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index.")
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed", False, "Call jax.distributed.initialize() with auto-detection (TPU)."
)
_CPU_DEVICES = flags.DEFINE_integer(
    "cpu_devices", None, "Fake CPU devices per process (testing sharding on CPU)."
)
_EXPORT_HF = flags.DEFINE_bool(
    "export_hf", True, "Export the final policy as Hugging Face safetensors."
)
flags.mark_flags_as_required(["config", "workdir"])
_VERBOSE = flags.DEFINE_bool(
    "verbose", False, "Tracebacks for every error, and the libraries' INFO logs."
)
_BACKEND = flags.DEFINE_enum(
    "backend",
    None,
    list(BACKENDS),
    "Refuse to run unless jax's default backend is this one (a missing accelerator jax would "
    "otherwise run on the CPU).",
)

_COMPILATION_CACHE = flags.DEFINE_string(
    "compilation_cache", DEFAULT_COMPILATION_CACHE, COMPILATION_CACHE_HELP
)

# Exit status of a run stopped by SIGTERM after checkpointing (EX_TEMPFAIL: "try again"); a
# rerun of the same command resumes it. SIGINT exits 130 (Preemption.EXIT_CODES).
PREEMPTED_EXIT_CODE = 75


class _QuietLibraries:
    """Drops INFO records logged from the files of chatty libraries (Orbax logs each save step
    by step, JAX the backends it could not start) and keeps their warnings and errors to one
    line each (Orbax logs a failed background write with two tracebacks; the run reports the
    cause itself). Records of ours pass unchanged.

    absl routes every library's records through one "absl" logger, so a per-logger level (absl's
    `--logger_levels`) cannot tell Orbax from us; the record's source path can. Levels here are
    the standard library's (a record's `levelno`); absl's own `logging.WARNING` is -1.
    """

    PREFIXES = tuple(
        os.sep + name + os.sep for name in ("jax", "flax", "orbax", "etils", "grain", "jetstream")
    )

    def filter(self, record) -> bool:
        if not any(part in record.pathname for part in self.PREFIXES):
            return True
        if record.levelno < std_logging.WARNING:
            return False
        message = record.getMessage().strip().splitlines()
        record.msg, record.args = (message[0] if message else ""), None
        record.exc_info = record.exc_text = record.stack_info = None
        return True


def _quiet_teardown_errors() -> None:
    """After a failed checkpoint write, TensorStore's threads call back into the asyncio loop
    Orbax has closed, and each call prints `RuntimeError: Event loop is closed` with its
    traceback (through `sys.excepthook`, from TensorStore's callbacks). Those say nothing
    the run's one error line does not; every other exception keeps its traceback."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        if not (isinstance(value, RuntimeError) and str(value) == "Event loop is closed"):
            previous(kind, value, tb)

    sys.excepthook = hook


def _init_jax():
    if _CPU_DEVICES.value:
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "")
            + f" --xla_force_host_platform_device_count={_CPU_DEVICES.value}"
        )
    import jax

    use_compilation_cache(_COMPILATION_CACHE.value)
    if _COORDINATOR.value or (_NUM_PROCESSES.value or 1) > 1:
        # Cross-process collectives on CPU need gloo; harmless on accelerators.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            _COORDINATOR.value, num_processes=_NUM_PROCESSES.value, process_id=_PROCESS_ID.value
        )
    elif _DISTRIBUTED.value:
        jax.distributed.initialize()


def _export_hf(trainer) -> None:
    """The final policy as Hugging Face safetensors + tokenizer files in `<workdir>/hf_export`.

    With several processes the parameters are sharded over hosts: every process joins the
    gather (`process_allgather`; a `device_get` of arrays other hosts hold would fail) and
    process 0 writes. Each host then briefly holds the full fp32 parameters in host memory.
    """
    import jax
    from flax import nnx
    from jax.experimental import multihost_utils

    from dvp_jax.model.hf_import import save_hf
    from dvp_jax.workdir import local_dir

    params = trainer.state.params
    if jax.process_count() > 1:
        params = multihost_utils.process_allgather(params, tiled=True)
    if jax.process_index() != 0:
        return
    export = trainer.workdir / "hf_export"
    with local_dir(export) as path:
        save_hf(nnx.merge(trainer.graphdef, jax.device_get(params)), path)
        trainer.tokenizer.save_hf(path)  # so transformers loads model and tokenizer
    logging.info("exported the policy and its tokenizer to %s", export)


def main(argv):
    if len(argv) > 1:
        fail(f"unexpected arguments {argv[1:]}: every option is a --flag", USAGE_EXIT_CODE)
    if not _VERBOSE.value:
        logging.get_absl_handler().addFilter(_QuietLibraries())
        _quiet_teardown_errors()
    _init_jax()
    require_backend(_BACKEND.value)
    import jax

    from dvp_jax.errors import RunFailure, UserError, one_line
    from dvp_jax.train.build import check_rollout_memory, load_run_tokenizer
    from dvp_jax.train.config import ExperimentConfig
    from dvp_jax.train.report import summary_line
    from dvp_jax.train.trainer import Trainer

    try:
        config = _CONFIG.value
        config.data  # noqa: B018  (a config file that failed to load raises on first use)
    except Exception as e:
        fail(flag_error(e, sys.argv), USAGE_EXIT_CODE, e)
    try:
        cfg = ExperimentConfig.from_config_dict(
            config, load_run_tokenizer(config.data.tokenizer).vocab_size
        )
    except (UserError, ValueError) as e:  # the config's checks raise ValueErrors
        fail(str(e), USAGE_EXIT_CODE, e)
    try:  # a KV cache no chip can hold, refused before the workdir is touched
        check_rollout_memory(cfg)
    except ValueError as e:
        fail(str(e), USAGE_EXIT_CODE, e)
    try:
        trainer = Trainer(cfg, _WORKDIR.value)
    except UserError as e:  # the workdir, the data, the tokenizer, the mesh, a checkpoint
        fail(str(e), USAGE_EXIT_CODE, e)
    except OSError as e:  # an unreachable or read-only workdir, a missing model directory
        fail(" ".join(str(e).split()) or one_line(e), USAGE_EXIT_CODE, e)
    status = 0
    try:
        summary = trainer.run()
        if "preempted_at" in summary:
            status = trainer.preemption.exit_code
        else:
            if _EXPORT_HF.value:
                _export_hf(trainer)
            if cfg.plots and jax.process_index() == 0:
                from dvp_jax import plots

                written = plots.plot_run(trainer.workdir)
                logging.info("plots: %s", ", ".join(os.path.basename(p) for p in written))
            logging.info("%s", summary_line(summary))
            logging.info("results in %s (summary.json, metrics.jsonl, hf_export/)", trainer.workdir)
    except UserError as e:  # a checkpoint that does not fit the config or cannot be restored
        _close_quietly(trainer)
        fail(str(e), USAGE_EXIT_CODE, e)
    except (RunFailure, OSError) as e:  # a write that failed: disk full, lost permissions
        error = e
        try:  # a log write that failed beside a checkpoint write: the checkpoint says more
            trainer.checkpointer.check()
        except RunFailure as checkpoint_error:
            error = checkpoint_error
        _close_quietly(trainer)
        fail(str(error) if isinstance(error, RunFailure) else one_line(error), 1, error)
    except KeyboardInterrupt:  # a second Ctrl-C: stop now, without a checkpoint
        _close_quietly(trainer)
        fail("interrupted (a second Ctrl-C): stopped without saving this step", 130)
    trainer.close()
    if status:
        # Distinct from success (0) and failure (1): "stopped, checkpoint saved, rerun".
        sys.exit(status)


def _close_quietly(trainer) -> None:
    """Closes after a failure; a second error from the same cause (the checkpointer's wait
    re-raising a failed write) is not reported twice."""
    try:
        trainer.close()
    except Exception:  # noqa: BLE001
        pass


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
