"""The weight sync, in one module: where the rollout engines sit and how the trainer's
parameters reach them.

`engine_mesh` places an engine once, when the rollout is built: on a tensor row of the
trainer's mesh when the tensor degrees agree (then a sync needs no host and no
whole-parameter copy per chip), else on the first devices of its host. `WeightSync` takes that
placement as given and, at every sync, moves the trainer's parameters into every engine:

- an engine on a tensor row of the trainer's mesh: one jitted cast whose outputs are laid out
  for the rollout on the trainer's mesh (`RolloutEngine.sync_program`), the engine's arrays
  being the shards already on its devices (`local_arrays`);
- otherwise: the cast where the trainer's arrays live (`Programs.cast`), then a copy to the
  engine's devices (`jax.device_put`);
- with several processes and an engine that is not on a tensor row: the trainer's parameters,
  cast to the widest engine parameter dtype on the devices, are first gathered to every host
  (each host's engine holds the full weights on its own devices).

The cast itself (the rollout policy's weight quantization, then the dtype) is the engine's
(`RolloutEngine.update_params`); this module decides which path and feeds it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from dvp_jax.errors import ConfigError
from dvp_jax.sharding import MESH_AXES, MeshConfig, make_mesh


# ==============================================================================================
# Placement (decided once)
# ==============================================================================================
def engine_mesh(trainer_mesh, tensor_parallel: int, process: int) -> jax.sharding.Mesh:
    """The devices of process `process`'s engine: a tensor row of the trainer's mesh on that
    process when the tensor degrees agree (`trainer_row_mesh` then says so), else its first
    `tensor_parallel` devices.

    Raises:
      ConfigError: `tensor_parallel` exceeds the devices of one host.
    """
    if trainer_mesh is not None and trainer_mesh.shape["tensor"] == tensor_parallel:
        for row in np.asarray(trainer_mesh.devices).reshape(-1, tensor_parallel):
            if all(d.process_index == process for d in row):
                return make_mesh(MeshConfig(1, 1, tensor_parallel), list(row))
    # The devices of this program (a TPU topology's for `dvp_jax.aot`), else jax's.
    pool = jax.devices() if trainer_mesh is None else trainer_mesh.devices.flat
    devices = [d for d in pool if d.process_index == process]
    if tensor_parallel > len(devices):
        raise ConfigError(
            f"config.rollout.tensor_parallel={tensor_parallel} exceeds the {len(devices)} "
            "devices of one host"
        )
    return make_mesh(MeshConfig(1, 1, tensor_parallel), devices[:tensor_parallel])


def trainer_row_mesh(engine_mesh: jax.sharding.Mesh, trainer_mesh) -> jax.sharding.Mesh | None:
    """`trainer_mesh` when the engine's devices are, in order, one (data, fsdp) row of it with
    the engine's tensor-parallel degree (the trainer's parameters live on it, split over
    tensor like the engine's), else None (another layout, or no trainer mesh)."""
    if trainer_mesh is None or tuple(trainer_mesh.axis_names) != MESH_AXES:
        return None
    tp = engine_mesh.shape["tensor"]
    if trainer_mesh.shape["tensor"] != tp or engine_mesh.size != tp:
        return None
    ours = list(engine_mesh.devices.flat)
    rows = np.asarray(trainer_mesh.devices).reshape(-1, tp)
    return trainer_mesh if any(list(row) == ours for row in rows) else None


# ==============================================================================================
# The sync
# ==============================================================================================
class WeightSync:
    """Trainer parameters -> every engine's parameters, on the paths decided once here.

    Args:
      engines: the rollout engines (the same engine twice counts once).
      trainer_mesh: the mesh the trainer's parameters live on (None: plain arrays).

    Attributes:
      engines: the distinct engines, in order.
      row_meshes: per engine, the trainer mesh it is a tensor row of (the on-device sync), or
        None (cast where the trainer's arrays live, then copy).
      gather_dtype: the widest engine parameter dtype, at which a multi-host sync gathers.
      through_host: whether the parameters are gathered to every host first.
    """

    def __init__(self, engines: Sequence[Any], trainer_mesh=None):
        self.engines = tuple({id(e): e for e in engines}.values())
        self.gather_dtype = functools.reduce(
            jnp.promote_types, [e.policy.param_dtype for e in self.engines]
        )
        rows = [trainer_row_mesh(e.mesh, trainer_mesh) for e in self.engines]
        self.through_host = jax.process_count() > 1 and any(m is None for m in rows)
        # Gathered parameters are host arrays: every engine then takes the copying path.
        self.row_meshes = tuple(None if self.through_host else m for m in rows)

    @property
    def paths(self) -> tuple[str, ...]:
        """Per engine, "on_device" or "via_host" (what `dvp_jax.aot` names the sync program)."""
        return tuple("via_host" if m is None else "on_device" for m in self.row_meshes)

    def __call__(self, trainer_params: Any) -> None:
        """Casts and moves `trainer_params` (what `RolloutEngine.update_params` takes: an
        `nnx.State` or a `Transformer` of the engines' architecture) into every engine."""
        if self.through_host:
            from jax.experimental import multihost_utils

            state = trainer_params
            if isinstance(state, nnx.Module):
                state = nnx.state(state, nnx.Param)
            trainer_params = multihost_utils.process_allgather(
                jax.tree.map(lambda x: x.astype(self.gather_dtype), state), tiled=True
            )
        for engine, row_mesh in zip(self.engines, self.row_meshes, strict=True):
            engine.update_params(trainer_params, trainer_mesh=row_mesh)


# ==============================================================================================
# Host-side pieces of one engine's update
# ==============================================================================================
def matching_leaves(trainer_params: Any, paths: list, abstract: list) -> list:
    """The leaves of `trainer_params` (an `nnx.State` or a module) in the order of `paths`.

    Raises:
      ValueError: naming the first missing, unexpected or mis-shaped parameter path.
    """
    if isinstance(trainer_params, nnx.Module):
        trainer_params = nnx.state(trainer_params, nnx.Param)
    src = {}
    for path, var in nnx.to_flat_state(trainer_params):
        src[path] = var.get_value() if isinstance(var, nnx.Variable) else var
    missing = [p for p in paths if p not in src]
    extra = [p for p in src if p not in set(paths)]
    if missing or extra:
        raise ValueError(
            f"update_params: parameter paths differ from the rollout model's (missing "
            f"{missing[:3]}, unexpected {extra[:3]}); pass the trainer's nnx.state(model) "
            "for the same ModelConfig"
        )
    leaves = []
    for path, want in zip(paths, abstract, strict=True):
        value = src[path]
        if tuple(value.shape) != tuple(want.shape):
            raise ValueError(
                f"update_params: parameter {'/'.join(map(str, path))} has shape "
                f"{tuple(value.shape)}, the rollout model expects {tuple(want.shape)}"
            )
        leaves.append(value)
    return leaves


def local_arrays(cast: list[jax.Array], shardings: list[NamedSharding]) -> list[jax.Array]:
    """The engine's arrays (`shardings`) built from the shards of `cast` already on its
    devices (no copy)."""
    local = []
    for x, sharding in zip(cast, shardings, strict=True):
        by_device = {shard.device: shard.data for shard in x.addressable_shards}
        devices = sharding.addressable_devices_indices_map(x.shape)
        local.append(
            jax.make_array_from_single_device_arrays(
                x.shape, sharding, [by_device[d] for d in devices]
            )
        )
    return local
