"""Orbax checkpoints of the train state and the data iterator: the trainer saves and resumes
(reading only a run's policy params, for the rollout server: `dvp_jax.run_params`).

One `CheckpointManager` per workdir (`<workdir>/checkpoints`) keeps the last `keep` steps; a
step holds `state` (the `TrainState` pytree), `data` (the iterator through Grain's handler: one
`process_<i>-of-<n>.json` per host, carrying the pipeline's fingerprint) and `extra` (small
JSON). Orbax writes a step into a temporary directory and renames it when complete, so a kill
leaves the previous step as the latest. Saves are asynchronous: `save` returns once the arrays
are on the host (the caller may donate them), `wait()` and `close()` block until the last one
is on disk and re-raise its error. `restore_latest` tries the steps newest first; a damaged
step (a truncated array file, missing metadata or item, bad JSON) is logged and moved to
`checkpoints/damaged/<step>-<UTC time>` once an older one restored; when none restores,
`NoRestorableCheckpointError` lists the paths.
It does not decide when to save (the trainer forces step 0, the last step and a SIGTERM step).
"""

from __future__ import annotations

import contextlib
import gc
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import grain.checkpoint as grain_checkpoint
import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from jax.experimental import multihost_utils

from dvp_jax.errors import RunFailure, UserError, one_line, root_cause
from dvp_jax.workdir import as_path, is_remote

ITEMS = ("state", "data", "extra")
DAMAGED_DIR = "damaged"


def _is_write_error(error: BaseException) -> bool:
    """Whether `error` is the storage refusing a write (an OSError somewhere in its chain, or
    TensorStore's status text for one), not a bug in what was saved."""
    text = str(error)
    return isinstance(root_cause(error), OSError) or any(
        status in text for status in ("RESOURCE_EXHAUSTED", "PERMISSION_DENIED", "Failed writing")
    )


class NoRestorableCheckpointError(UserError, RuntimeError):
    """Every step of a checkpoint directory failed to restore."""


class Checkpointer:
    """The checkpoints of one run: save, resume from the newest intact step, restore a step."""

    def __init__(self, workdir: str, keep: int, every: int = 0, *, asynchronous: bool = True):
        """Opens (creating it if needed) `<workdir>/checkpoints`.

        Args:
          workdir: the run directory (any epath: local, gs://, ...).
          keep: the number of newest steps kept (`max_to_keep`).
          every: `save_interval_steps`: `save` writes the multiples of `every` (and forced
            steps); 0 means no interval, only forced steps (and Orbax's preemption and
            initial saves).
          asynchronous: write the arrays in a background thread (`False`: a save is on disk
            when `save` returns).
        """
        if every < 0:
            raise ValueError(f"checkpoint.every must be >= 0 (0: only forced saves), got {every}")
        self.directory = as_path(workdir) / "checkpoints"  # an epath: local, gs://, ...
        self._writing: int | None = None  # the step of the last save started
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                save_interval_steps=every if every > 0 else None,
                max_to_keep=keep,
                create=True,
                enable_async_checkpointing=asynchronous,
            ),
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, data: Any, extra: dict, *, force: bool = False) -> bool:
        """Saves step `step` if the manager's policy asks for it (or `force`).

        The manager's policy: multiples of `every`, the first save of an empty directory, and
        a preemption step agreed by all hosts (`reached_preemption`). The same call must be
        made on every host (the decision depends only on the step and the shared directory).
        An existing step is never overwritten (skipped).

        Args:
          step: the step number.
          state: the `TrainState` pytree.
          data: the data iterator (a `PromptIterator`, a grain `DatasetIterator`, or anything
            with `get_state() -> JSON-able dict` / `set_state(dict)`); its state is read now.
          extra: small JSON-able dict.
          force: save even off the interval (step 0, the final step, SIGTERM).

        Returns:
          Whether a save was started (with `asynchronous`, `wait()` for it to be on disk).

        Raises:
          RuntimeError: `step` is older than the newest step in the directory (Orbax would
            decline or misorder it); resume from that step or use a new workdir.
        """
        if step in self.manager.all_steps():
            return False
        latest = self.latest_step()
        if latest is not None and step < latest:
            raise RuntimeError(
                f"checkpoint {step} was not saved: {self.directory} already holds the newer step "
                f"{latest}; resume from that step or use a new workdir"
            )
        if not (force or self.manager.should_save(step)):
            return False
        self.check()  # the previous save's background write
        self._writing = step
        self._check_free_space()
        with self._storage_errors():
            self.manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state),
                    data=grain_checkpoint.CheckpointSave(item=_IteratorItem(data)),
                    extra=ocp.args.JsonSave(extra),
                ),
                force=True,
            )
        logging.info("saving checkpoint %d to %s", step, self.directory)
        return True

    def _check_free_space(self) -> None:
        """On a local disk, refuses to start a save that cannot fit: less free space than the
        newest complete step took. A write that fails half-way makes Orbax's and TensorStore's
        background threads print dozens of tracebacks; this catches the usual case (a disk
        filling up between saves) before the write. Object stores are not checked."""
        if is_remote(self.directory) or not self.manager.all_steps():
            return
        newest = self.directory / str(max(self.manager.all_steps()))
        needed = sum(f.stat().st_size for f in Path(newest).rglob("*") if f.is_file())
        free = shutil.disk_usage(self.directory).free
        if free < needed:
            raise RunFailure(
                f"checkpoint {self._writing} was not written to {self.directory} (No space left "
                f"on device: {free / 2**20:.1f} MiB free, a checkpoint takes "
                f"{needed / 2**20:.1f} MiB); the newest complete checkpoint (step "
                f"{max(self.manager.all_steps())}) is the one a rerun resumes from"
            )

    def check(self) -> None:
        """Raises `RunFailure` if the last save's background write has failed (disk full, lost
        permissions): one line naming the step, the directory and the cause."""
        with self._storage_errors():
            self.manager.check_for_errors()

    def wait(self) -> None:
        """Blocks until the last save is on disk; raises `RunFailure` if its write failed."""
        with self._storage_errors():
            self.manager.wait_until_finished()

    @contextlib.contextmanager
    def _storage_errors(self):
        """The storage refusing a write becomes one `RunFailure` line naming the step, the
        directory, the cause and the checkpoint a rerun resumes from; a bug keeps its
        traceback."""
        try:
            yield
        except Exception as e:
            if not _is_write_error(e):
                raise
            complete = [s for s in self.manager.all_steps() if s != self._writing]
            previous = f"step {max(complete)}" if complete else "none yet"
            raise RunFailure(
                f"checkpoint {self._writing} could not be written to {self.directory} "
                f"({one_line(root_cause(e))}); the newest complete checkpoint ({previous}) is "
                "the one a rerun resumes from"
            ) from e

    def restore(self, abstract_state: Any, data: Any, step: int | None = None):
        """Restores (state, data, extra) at `step` (default: latest) into the given layout.

        Args:
          abstract_state: a TrainState of `jax.ShapeDtypeStruct`s carrying the target shardings
            (from `jax.eval_shape` + the step's shardings), so every array lands sharded.
          data: the data iterator (as for `save`), set in place to the saved position and
            returned.
        """
        step = self.latest_step() if step is None else step
        restored = self.manager.restore(step, args=_restore_args(abstract_state, data))
        logging.info("restored checkpoint %d from %s", step, self.directory)
        return restored["state"], data, restored["extra"]

    def restore_latest(self, abstract_state: Any, data: Any) -> tuple[int, Any, Any, dict] | None:
        """Restores the newest intact step, setting aside newer damaged ones.

        Steps are tried newest first. A step that fails to restore is logged (one warning line
        naming its directory and the error) and the next older one is tried. After a success,
        the newer damaged step directories are moved (not deleted) to
        `checkpoints/damaged/<step>-<time>`, where Orbax no longer lists them, so the next save
        of that step number writes a fresh checkpoint; the manager re-lists the directory, so
        `latest_step` and `save` see only intact steps. With several processes every process
        tries the same step and they agree (all must succeed) before a step is accepted; only
        process 0 moves directories.

        Args:
          abstract_state: as for `restore`.
          data: the data iterator, set in place to the restored step's position (a failed
            step may have set it; the step finally restored sets it again).

        Returns:
          (step, state, data, extra) of the restored step, or None when the directory holds
          no checkpoint (`data` untouched).

        Raises:
          NoRestorableCheckpointError: every step failed to restore; the message lists each
            step directory with its error. Nothing is moved, so the run can be inspected or
            repaired (a layout that no longer matches `abstract_state` fails every step this
            way too).
        """
        steps = sorted(self.manager.all_steps(), reverse=True)
        if not steps:
            return None
        damaged: list[tuple[str, str]] = []
        for step in steps:
            path = self._step_dir(step)
            try:
                _check_layout(path)
                restored = self._restore_here(path, abstract_state, data)
                error = None
            except Exception as e:  # any failure means "do not resume from here"
                restored, error = None, _one_line(e)
            if error is not None:
                _discard_abandoned_reads()
            failed = _failed_processes(error is not None)
            if not failed:
                state, _, extra = restored
                break
            if error is None:
                error = f"restored here but failed on process(es) {failed}"
            logging.warning(
                "checkpoint %d at %s is damaged or unreadable, trying an older step: %s",
                step,
                path,
                error,
            )
            damaged.append((path, error))
        else:
            listing = "; ".join(f"{path}: {error}" for path, error in damaged)
            raise NoRestorableCheckpointError(
                f"no checkpoint under {self.directory} can be restored: {listing}. Nothing was "
                "moved. If every step fails the same way, the checkpoints may be intact but no "
                "longer match this run's state (a changed model or optimizer config); otherwise "
                f"repair or remove the damaged step directories, or move {self.directory} away "
                "to start the run afresh"
            )
        if damaged:
            _discard_abandoned_reads()  # those still held by TensorStore at the first pass
            moved = self._set_aside([path for path, _ in damaged])
            logging.warning(
                "resumed from checkpoint %d, the newest intact step; damaged newer step(s) "
                "moved aside: %s",
                step,
                ", ".join(f"{src} -> {dst}" for src, dst in moved),
            )
        logging.info("restored checkpoint %d from %s", step, self.directory)
        return step, state, data, extra

    def _step_dir(self, step: int) -> str:
        return self.directory / str(step)

    def _restore_here(
        self, path: epath.Path, abstract_state: Any, data: Any
    ) -> tuple[Any, Any, dict]:
        """Restores one step directory in this process only.

        Orbax's own restore ends in a barrier over all processes; a process that failed before
        it would leave the others waiting, so this checkpointer is local to the process and
        `restore_latest` makes the processes agree afterwards.
        """
        local = ocp.options.MultiprocessingOptions(
            primary_host=jax.process_index(), active_processes={jax.process_index()}
        )
        handler = ocp.CompositeCheckpointHandler(
            composite_options=ocp.CompositeOptions(multiprocessing_options=local)
        )
        with ocp.Checkpointer(handler, multiprocessing_options=local) as checkpointer:
            restored = checkpointer.restore(path, args=_restore_args(abstract_state, data))
        return restored["state"], data, restored["extra"]

    def _set_aside(self, paths: list[str]) -> list[tuple[str, str]]:
        """Moves damaged step directories under `checkpoints/damaged/` and re-lists the steps.

        Only process 0 moves (and so knows the destinations); the others wait for it.

        Returns:
          (source, destination) of each move; on other processes the destination is the
          `damaged` folder.
        """
        root = self.directory / DAMAGED_DIR
        moved = [(src, root) for src in paths]
        if jax.process_index() == 0:
            root.mkdir(parents=True, exist_ok=True)
            stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
            moved = []
            for src in paths:
                dst = root / f"{src.name}-{stamp}"
                n = 1
                while dst.exists():  # the same step set aside twice within a second
                    dst, n = root / f"{src.name}-{stamp}-{n}", n + 1
                try:
                    src.rename(dst)
                except OSError as e:
                    raise RuntimeError(
                        f"cannot move the damaged checkpoint {src} to {dst} ({e}); move or "
                        "delete it by hand, then rerun"
                    ) from e
                moved.append((src, dst))
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("dvp_jax.checkpoint.set_aside")
        self.manager.reload()
        return moved

    def close(self):
        """Waits for the last save (re-raising its error), then closes the manager."""
        try:
            self.wait()
        finally:
            self.manager.close()


class _IteratorItem:
    """An iterator as Grain's checkpoint handler sees it (its non-`DatasetIterator` branch).

    The handler writes `get_state()` (bytes: the iterator's state dict as JSON) to
    `data/process_<i>-of-<n>.json` and restores with `set_state(bytes)` then
    `start_prefetch()`. Going through bytes keeps the iterator's own `get_state`/`set_state`
    (a `PromptIterator` checks its pipeline fingerprint there).
    """

    def __init__(self, iterator: Any):
        self.iterator = iterator

    def get_state(self) -> bytes:
        return json.dumps(self.iterator.get_state(), indent=2, sort_keys=True).encode()

    def set_state(self, state: bytes) -> None:
        self.iterator.set_state(json.loads(state.decode()))

    def start_prefetch(self) -> None:
        start = getattr(self.iterator, "start_prefetch", None)
        if start is not None:
            start()


def _restore_args(abstract_state: Any, data: Any) -> ocp.args.Composite:
    return ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state),
        data=grain_checkpoint.CheckpointRestore(item=_IteratorItem(data)),
        extra=ocp.args.JsonRestore(),
    )


def data_file(path: epath.Path) -> epath.Path:
    """This process's iterator-state file in a step directory (Grain's handler's name)."""
    return path / "data" / f"process_{jax.process_index()}-of-{jax.process_count()}.json"


def _check_layout(path: epath.Path) -> None:
    """Raises FileNotFoundError naming the first missing item directory, the state metadata or
    this process's iterator-state file."""
    for item in ITEMS:
        if not (path / item).is_dir():
            raise FileNotFoundError(f"missing item directory {path / item}")
    metadata = path / "state" / "_METADATA"
    if not metadata.is_file():
        raise FileNotFoundError(f"missing {metadata}")
    if not data_file(path).is_file():
        raise FileNotFoundError(
            f"missing {data_file(path)} (this process's data iterator state; a checkpoint "
            "saved with another number of processes has other files)"
        )


def _one_line(error: BaseException) -> str:
    """`Type: first line` of an error's root cause (TensorStore puts the reason there), then
    the error raised, when different."""

    def line(e: BaseException, limit: int) -> str:
        text = str(e).strip().splitlines()
        first = text[0].split(" See full TensorStore details")[0] if text else ""
        return f"{type(e).__name__}: {first[:limit]}"

    root = error
    while (root.__cause__ or root.__context__) is not None:
        root = root.__cause__ or root.__context__
    if root is error:
        return line(error, 400)
    return f"{line(root, 400)} (raised as {line(error, 160)})"


def _discard_abandoned_reads() -> None:
    """Collects the array reads Orbax abandons when one read of a restore fails.

    Each is a coroutine that, when garbage-collected, prints about 65 lines ("Exception ignored
    in: <coroutine object _read_array_index_and_device_put>" and a TensorStore spec) that would
    bury the one-line warning. They are collected now and only those reports are dropped; any
    other report goes to the usual hook.
    """
    previous = sys.unraisablehook

    def hook(report):
        code = getattr(report.object, "cr_code", None)
        if getattr(code, "co_name", "") != "_read_array_index_and_device_put":
            previous(report)

    sys.unraisablehook = hook
    try:
        gc.collect()
    finally:
        sys.unraisablehook = previous


def _failed_processes(failed_here: bool) -> list[int]:
    """Indices of the processes that failed (one process: [0] or [])."""
    if jax.process_count() == 1:
        return [0] if failed_here else []
    flags = multihost_utils.process_allgather(np.int32(failed_here))
    return [int(i) for i in np.flatnonzero(flags)]


def abstract_like(state: Any, shardings: Any | None) -> Any:
    """ShapeDtypeStructs of `state` with the given shardings (or each array's own)."""
    if shardings is None:
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
        )
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings
    )
