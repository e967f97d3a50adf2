"""Orbax checkpoints of the train state and the data iterator, and reading a run's policy params.

Used by the trainer (save / resume) and by the rollout server (serve a run's latest params);
it sits at the package top so neither imports the other.

One `CheckpointManager` per workdir (`<workdir>/checkpoints`), keeping the last K steps. Each
checkpoint holds two items: `state` (the `TrainState` pytree: params, optimizer, step, RNG) and
`data` (the grain iterator state as JSON). Orbax writes each step into a temporary directory and
renames it when complete, so a checkpoint is never half-written; an interrupted save leaves the
previous one as the latest. Saves are synchronous so that a kill right after `save` returns
cannot lose it.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging


class Checkpointer:
    def __init__(self, workdir: str, keep: int):
        self.directory = os.path.join(os.path.abspath(workdir), "checkpoints")
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, create=True, enable_async_checkpointing=False
            ),
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, data_state: dict[str, Any], extra: dict) -> None:
        """Saves step `step` (overwrites nothing: an existing step is skipped)."""
        if step in self.manager.all_steps():
            return
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                data=ocp.args.JsonSave(data_state),
                extra=ocp.args.JsonSave(extra),
            ),
        )
        self.manager.wait_until_finished()
        logging.info("saved checkpoint %d to %s", step, self.directory)

    def restore(self, abstract_state: Any, step: int | None = None):
        """Restores (state, data_state, extra) at `step` (default: latest) into the given layout.

        Args:
          abstract_state: a TrainState of `jax.ShapeDtypeStruct`s carrying the target shardings
            (from `jax.eval_shape` + the step's shardings), so every array lands sharded.
        """
        step = self.latest_step() if step is None else step
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state),
                data=ocp.args.JsonRestore(),
                extra=ocp.args.JsonRestore(),
            ),
        )
        logging.info("restored checkpoint %d from %s", step, self.directory)
        return restored["state"], restored["data"], restored["extra"]

    def close(self):
        self.manager.close()


def abstract_like(state: Any, shardings: Any | None) -> Any:
    """ShapeDtypeStructs of `state` with the given shardings (or each array's own)."""
    if shardings is None:
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
        )
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings
    )


def state_item_dir(path: str) -> str:
    """The `state` item of the latest step under a run workdir, a checkpoints dir or a step dir."""
    path = os.path.abspath(path)
    root = (
        os.path.join(path, "checkpoints")
        if os.path.isdir(os.path.join(path, "checkpoints"))
        else path
    )
    if os.path.isdir(os.path.join(root, "state")):
        return os.path.join(root, "state")
    steps = [
        int(d)
        for d in os.listdir(root)
        if d.isdigit() and os.path.isdir(os.path.join(root, d, "state"))
    ]
    if not steps:
        raise FileNotFoundError(f"no trainer checkpoint (<step>/state) under {path!r}")
    return os.path.join(root, str(max(steps)), "state")


def restore_params(path: str, target: Any) -> Any:
    """Restores only the policy params of a trainer checkpoint (no optimizer state is read).

    Args:
      path: a run workdir, its `checkpoints` dir, or one step's dir.
      target: pure dict of `jax.ShapeDtypeStruct` (dtype and sharding to restore into, e.g.
        bf16 on the rollout mesh: Orbax casts while reading).
    """
    item_dir = state_item_dir(path)
    restore_args = ocp.checkpoint_utils.construct_restore_args(target)
    with ocp.PyTreeCheckpointer() as checkpointer:
        out = checkpointer.restore(
            item_dir,
            args=ocp.args.PyTreeRestore(
                item={"params": target}, restore_args={"params": restore_args}, partial_restore=True
            ),
        )
    logging.info("restored policy params from %s", item_dir)
    return out["params"]
