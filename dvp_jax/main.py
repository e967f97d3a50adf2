"""Entry point: `python -m dvp_jax.main --config configs/tiny_cpu.py --workdir DIR`.

Overrides: `--config.train.steps=10`, `--config.method=mis_dvp`, or a config argument
`--config configs/tiny_cpu.py:rloo`. Rerunning with the same `--workdir` resumes from its newest
intact checkpoint (a workdir started with a different config is refused, naming the fields).
Exit status: 0 done, 75 preempted by SIGTERM (checkpoint saved: rerun to resume), 1 error.
Multi-process: on Cloud TPU VMs `jax.distributed.initialize()` auto-detects the slice
(`--distributed`); elsewhere pass `--coordinator_address`, `--num_processes` and `--process_id`.

This module (with tests/conftest.py) is the only place that touches `jax.config`.
"""

from __future__ import annotations

import logging as std_logging
import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

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

# Exit status of a run stopped by SIGTERM after checkpointing (EX_TEMPFAIL: "try again"); a
# rerun of the same command resumes it.
PREEMPTED_EXIT_CODE = 75


class _QuietLibraries:
    """Drops INFO records logged from the files of chatty libraries (Orbax logs each save step
    by step), keeping their warnings and everything of ours.

    absl routes every library's records through one "absl" logger, so a per-logger level (absl's
    `--logger_levels`) cannot tell Orbax from us; the record's source path can. Levels here are
    the standard library's (a record's `levelno`); absl's own `logging.WARNING` is -1.
    """

    PREFIXES = tuple(os.sep + name + os.sep for name in ("orbax", "etils", "grain", "jetstream"))

    def filter(self, record) -> bool:
        noisy = any(part in record.pathname for part in self.PREFIXES)
        return record.levelno >= std_logging.WARNING or not noisy


def _init_jax():
    if _CPU_DEVICES.value:
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "")
            + f" --xla_force_host_platform_device_count={_CPU_DEVICES.value}"
        )
    import jax

    if _COORDINATOR.value or (_NUM_PROCESSES.value or 1) > 1:
        # Cross-process collectives on CPU need gloo; harmless on accelerators.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            _COORDINATOR.value, num_processes=_NUM_PROCESSES.value, process_id=_PROCESS_ID.value
        )
    elif _DISTRIBUTED.value:
        jax.distributed.initialize()
    logging.info(
        "JAX: process %d of %d, %d local / %d global devices (%s)",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
        jax.devices()[0].platform,
    )


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
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.get_absl_handler().addFilter(_QuietLibraries())
    _init_jax()
    import jax

    from dvp_jax.rollout.tokenizers import load_tokenizer
    from dvp_jax.train.builders import WorkdirMismatchError
    from dvp_jax.train.config import ExperimentConfig
    from dvp_jax.train.trainer import Trainer

    tokenizer = load_tokenizer(_CONFIG.value.data.tokenizer)
    try:
        cfg = ExperimentConfig.from_config_dict(_CONFIG.value, tokenizer.vocab_size)
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    try:
        trainer = Trainer(cfg, _WORKDIR.value)
    except (WorkdirMismatchError, OSError) as e:  # a workdir that does not fit or cannot be written
        raise app.UsageError(str(e)) from None
    try:
        try:
            summary = trainer.run()
        except WorkdirMismatchError as e:  # a checkpoint past train.steps: found on restore
            raise app.UsageError(str(e)) from None
        if "preempted_at" in summary:
            preempted = True
        else:
            preempted = False
            if _EXPORT_HF.value:
                _export_hf(trainer)
            if cfg.plots and jax.process_index() == 0:
                from dvp_jax import plots

                for path in plots.plot_run(trainer.workdir):
                    logging.info("wrote %s", path)
            logging.info("summary: %s", summary)
    finally:
        trainer.close()
    if preempted:
        # Distinct from success (0) and failure (1): "preempted, checkpoint saved, rerun".
        sys.exit(PREEMPTED_EXIT_CODE)


if __name__ == "__main__":
    app.run(main)
