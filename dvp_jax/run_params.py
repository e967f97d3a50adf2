"""A run's policy params read from its newest trainer checkpoint (the rollout server serves them):
only the `params` of the `state` item, cast and sharded as the caller asks while Orbax reads.
Saving and resuming a run is `dvp_jax.checkpoint`'s.
"""

from __future__ import annotations

import os
from typing import Any

import orbax.checkpoint as ocp
from absl import logging
from etils import epath

from dvp_jax.workdir import as_path


def state_item_dir(path: str | os.PathLike) -> epath.Path:
    """The `state` item of the latest step under a run workdir, a checkpoints dir or a step dir.

    Step directories set aside as damaged (`checkpoints/damaged/`) are not steps.
    """
    path = as_path(path)
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    if (root / "state").is_dir():
        return root / "state"
    steps = [int(d.name) for d in root.iterdir() if d.name.isdigit() and (d / "state").is_dir()]
    if not steps:
        raise FileNotFoundError(f"no trainer checkpoint (<step>/state) under {path}")
    return root / str(max(steps)) / "state"


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
