"""The weight sync's host-side pieces: which trainer leaves, which path, which shards.

`RolloutEngine.update_params` casts the trainer's parameters into the rollout dtype and layout
with one jitted program (`Programs.cast`, or `RolloutEngine.sync_program` on the trainer's
mesh); this module holds what runs around it on the host: matching the trainer's parameters to
the rollout model's paths and shapes, deciding whether the engine's devices are a tensor row of
the trainer's mesh (then the sync needs no host), and taking the engine's arrays from the shards
the on-device cast left on its devices. Nothing here compiles or copies.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from dvp_jax.sharding import MESH_AXES


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


def trainer_row_mesh(engine_mesh: jax.sharding.Mesh, leaves) -> jax.sharding.Mesh | None:
    """The trainer mesh whose tensor axis the engine's devices are one row of, or None.

    When the trainer's params live on a `(data, fsdp, tensor)` mesh with the engine's
    tensor-parallel degree and the engine's devices are, in order, one (data, fsdp) row of it,
    the weight sync needs no host and no whole-parameter copy per chip. Else (another layout,
    plain arrays) None.
    """
    shardings = [getattr(x, "sharding", None) for x in leaves]
    if not shardings or not all(isinstance(s, NamedSharding) for s in shardings):
        return None
    mesh = shardings[0].mesh
    if any(s.mesh != mesh for s in shardings) or tuple(mesh.axis_names) != MESH_AXES:
        return None
    tp = engine_mesh.shape["tensor"]
    if mesh.shape["tensor"] != tp or engine_mesh.size != tp:
        return None
    ours = list(engine_mesh.devices.flat)
    rows = np.asarray(mesh.devices).reshape(-1, tp)
    return mesh if any(list(row) == ours for row in rows) else None


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
