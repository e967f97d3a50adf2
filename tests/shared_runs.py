"""Training runs shared by the trainer, workdir, fault, resume and multi-process tests, each built
once per session, also when pytest-xdist runs the tests in several workers (fixtures, imported by
tests/conftest.py).

`tiny_run`: one uninterrupted run of the test-size tiny config (`TINY_RUN` steps) in this
process, in a workdir whose path has spaces, started from an empty current directory, with the
final policy exported as `main --export_hf` does. Its processes' counterparts
(`train_utils.main_command` with the same overrides) load the same compiled programs from the
session's compilation cache: same programs, same inputs, so they are compared exactly; runs of
other programs (several processes, another mesh) within a stated tolerance.
Tests read it and never write into it: copy it (`TinyRun.copy_to`) to build on it.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import pathlib
import shutil

import pytest

from dvp_jax.metrics import read_metrics

# Six RL steps: checkpoints at 0, 2, 4, 6 and evaluations at 0, 2, 4, 6 (every 2).
TINY_RUN = {"train.steps": 6}
# Wall-clock figures differ between any two runs; every other metric is compared.
TIMING = ("rollout_s", "train_s", "rollout_tok_s")


def timeless(rows: list[dict]) -> list[dict]:
    """Metric rows without their wall-clock figures."""
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def tiny_trainer(workdir, **overrides):
    """A `Trainer` on `workdir` of the test-size tiny config with `overrides` (imported here:
    conftest imports this module before any test needs the trainer)."""
    from dvp_jax.tokenizers import CharTokenizer
    from dvp_jax.train.config import ExperimentConfig
    from dvp_jax.train.trainer import Trainer
    from tests.train_utils import tiny_config_dict

    config = tiny_config_dict(**overrides)
    return Trainer(ExperimentConfig.from_config_dict(config, CharTokenizer().vocab_size), workdir)


def run_trainer(workdir, **overrides) -> dict:
    """One `Trainer.run()` on `workdir` of the test-size tiny config with `overrides`."""
    trainer = tiny_trainer(str(workdir), **overrides)
    try:
        return trainer.run()
    finally:
        trainer.close()


def export_hf(trainer, path) -> None:
    """The trained policy and tokenizer as `main --export_hf` writes them (one process)."""
    import jax
    from flax import nnx

    from dvp_jax.model.hf_import import save_hf

    save_hf(nnx.merge(trainer.graphdef, jax.device_get(trainer.state.params)), str(path))
    trainer.tokenizer.save_hf(str(path))


@dataclasses.dataclass(frozen=True)
class TinyRun:
    root: pathlib.Path  # holds only "cwd" (the run's current directory) and "my runs"
    workdir: pathlib.Path
    summary: dict
    update_compiles: int  # compiled versions of the update after the whole run

    def rows(self) -> list[dict]:
        return read_metrics(str(self.workdir))

    def copy_to(self, dest) -> pathlib.Path:
        shutil.copytree(self.workdir, dest)
        return pathlib.Path(dest)


def _build_tiny_run(root: pathlib.Path) -> TinyRun:
    (root / "cwd").mkdir(parents=True)
    workdir = root / "my runs" / "run 1"
    previous = os.getcwd()
    os.chdir(root / "cwd")  # nothing may land in the current directory
    try:
        trainer = tiny_trainer(str(workdir), **TINY_RUN)
        try:
            summary = trainer.run()
            compiles = trainer.parts.update._cache_size()
            export_hf(trainer, workdir / "hf_export")
        finally:
            trainer.close()
    finally:
        os.chdir(previous)
    return TinyRun(root, workdir, summary, compiles)


def session_dir(tmp_path_factory) -> pathlib.Path:
    """A directory of this test session that every pytest-xdist worker of it sees (the
    session's base temporary directory; a worker's own is one below it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> TinyRun:
    """Built once per session: by the first pytest-xdist worker that asks (under a file lock),
    read back from disk by the others."""
    shared = session_dir(tmp_path_factory)
    root, record = shared / "tiny_run", shared / "tiny_run.json"
    with open(shared / "tiny_run.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not record.exists():
            run = _build_tiny_run(root)
            record.write_text(json.dumps([run.summary, run.update_compiles]))
    summary, compiles = json.loads(record.read_text())
    return TinyRun(root, root / "my runs" / "run 1", summary, compiles)
