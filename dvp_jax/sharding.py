"""Device mesh, logical-axis rules, and sharded initialisation.

Model code names only *logical* axes (e.g. `("vocab", "embed")` for the embedding). One rules
table per use maps logical names to mesh axes of the mesh `(data, fsdp, tensor)`:

* `TRAIN_RULES`: parameters fully sharded over `fsdp` and `tensor` (ZeRO-3 style), activations
  sharded over the batch on `(data, fsdp)` and over heads / ffw / vocab on `tensor`.
* `ROLLOUT_RULES`: parameters replicated over `data`/`fsdp` and split over `tensor` only, so
  decode steps need no parameter all-gathers; the KV cache is split by batch and by KV head.

Both tables replicate `layers`, the leading axis of the stacked decoder-block parameters
(`dvp_jax/model/transformer.py`), and `cache_layers`, the KV cache's.

Parameter and activation names must never share a name, since a parameter dim and an
activation dim may map to the same mesh axis in one spec (e.g. `embed -> fsdp` for params while
`act_batch -> (data, fsdp)` for activations).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

Rules = tuple[tuple[str, Any], ...]

TRAIN_RULES: Rules = (
    # parameters
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("norm", None),
    # The leading [L] axis of the stacked decoder-block parameters: never sharded, so each scan
    # step slices one layer locally and gathers only that layer's fsdp shards.
    ("layers", None),
    # activations
    ("act_batch", ("data", "fsdp")),
    ("act_seq", None),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_head_dim", None),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
    # KV cache
    ("cache_layers", None),
    ("cache_batch", ("data", "fsdp")),
    ("cache_seq", None),
)

ROLLOUT_RULES: Rules = tuple(
    (name, None if name in ("embed",) else axes) for name, axes in TRAIN_RULES
)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh shape. `-1` on one axis means "all remaining devices"."""

    data: int = 1
    fsdp: int = -1
    tensor: int = 1

    def shape(self, n_devices: int) -> tuple[int, int, int]:
        dims = [self.data, self.fsdp, self.tensor]
        if dims.count(-1) > 1:
            raise ValueError(f"MeshConfig: at most one axis may be -1, got {dims}")
        if -1 in dims:
            known = math.prod(d for d in dims if d != -1)
            if n_devices % known:
                raise ValueError(f"MeshConfig {dims}: {n_devices} devices not divisible by {known}")
            dims[dims.index(-1)] = n_devices // known
        if math.prod(dims) != n_devices:
            raise ValueError(
                f"MeshConfig (data, fsdp, tensor)={tuple(dims)} needs {math.prod(dims)} devices, "
                f"have {n_devices}"
            )
        return tuple(dims)


def make_mesh(cfg: MeshConfig = MeshConfig(), devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Creates a `(data, fsdp, tensor)` mesh over `devices` (default: all devices)."""
    devices = list(jax.devices() if devices is None else devices)
    shape = cfg.shape(len(devices))
    # Auto axes: GSPMD propagates shardings from the logical constraints we place; explicit
    # (sharding-in-types) mode would ask every gather for an out_sharding.
    axis_types = (AxisType.Auto,) * len(MESH_AXES)
    if devices == list(jax.devices()):
        return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types, devices=devices)
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=axis_types)


@dataclasses.dataclass(frozen=True)
class Sharder:
    """A mesh plus a rules table: turns logical axis names into shardings.

    `Sharder(None, rules)` is the single-device / no-op sharder. A mesh axis that does not divide
    the array dimension is dropped from that dimension's spec (the dim is replicated instead),
    so tiny test configs work on any mesh.
    """

    mesh: Mesh | None = None
    rules: Rules = TRAIN_RULES

    def spec(
        self, names: Sequence[str | None], shape: Sequence[int] | None = None
    ) -> PartitionSpec:
        table = dict(self.rules)
        used: set[str] = set()
        out = []
        for i, name in enumerate(names):
            axes = table.get(name) if name is not None else None
            if name is not None and name not in table:
                raise KeyError(f"logical axis {name!r} has no rule; rules: {sorted(table)}")
            axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
            kept = []
            size = 1
            for ax in axes:
                if ax in used or self.mesh is None:
                    continue
                n = self.mesh.shape[ax]
                if shape is not None and shape[i] % (size * n):
                    continue
                kept.append(ax)
                size *= n
            used.update(kept)
            out.append(tuple(kept) if len(kept) > 1 else (kept[0] if kept else None))
        return PartitionSpec(*out)

    def sharding(self, names: Sequence[str | None], shape: Sequence[int] | None = None):
        if self.mesh is None:
            return None
        return NamedSharding(self.mesh, self.spec(names, shape))

    def constrain(self, x: jax.Array, names: Sequence[str | None]) -> jax.Array:
        """`with_sharding_constraint` by logical names; identity without a mesh."""
        if self.mesh is None:
            return x
        return jax.lax.with_sharding_constraint(x, self.sharding(names, x.shape))

    @property
    def platform(self) -> str:
        """The platform the sharded program runs on ("cpu", "gpu", "tpu"): the mesh's devices',
        which for a program compiled ahead of time for a TPU topology is "tpu" on any host."""
        if self.mesh is None:
            return jax.default_backend()
        return self.mesh.devices.flat[0].platform

    def replicated(self):
        return None if self.mesh is None else NamedSharding(self.mesh, PartitionSpec())


# XLA options the project's TPU programs compile with. "while-loop-all-reduce-code-motion"
# (which moves the gradient all-reduce of a micro-batch loop out of the loop) fails a RET_CHECK
# in libtpu 0.0.42.1 (`user->opcode() == HloOpcode::kAdd`) on the mixed_bf16 update of a model
# with an untied unembedding and micro_batches > 1; without the pass each micro-batch reduces
# its own gradients (the same values; more collectives, no more memory: docs/design.md 3).
TPU_COMPILER_OPTIONS = {"xla_disable_hlo_passes": "while-loop-all-reduce-code-motion"}


def compiler_options(sharder: Sharder) -> dict[str, str] | None:
    """`jax.jit(..., compiler_options=)` for a program on `sharder`'s mesh: the TPU options
    above on a TPU, None (XLA's defaults) elsewhere."""
    return dict(TPU_COMPILER_OPTIONS) if sharder.platform == "tpu" else None


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def state_shardings(state: nnx.State, sharder: Sharder) -> Any:
    """NamedShardings for an (abstract) NNX state, from each Variable's `logical_axes`."""

    def one(var):
        names = var.get_metadata().get("logical_axes")
        if names is None:
            names = (None,) * len(var.get_value().shape)
        return var.replace(sharder.sharding(names, var.get_value().shape))

    return jax.tree.map(one, state, is_leaf=_is_var)


def init_sharded(make_module: Callable[[], nnx.Module], sharder: Sharder) -> nnx.Module:
    """Creates a module with its parameters born sharded.

    The module is first traced under `jax.eval_shape` (no memory), the shardings are derived from
    the logical axis metadata, and a jit with `out_shardings` materialises each parameter directly
    on its devices: full parameters never exist on one device.
    """
    abstract = nnx.eval_shape(make_module)
    graphdef, abstract_state = nnx.split(abstract)
    if sharder.mesh is None:
        return make_module()
    shardings = state_shardings(abstract_state, sharder)

    init = jax.jit(lambda: nnx.state(make_module()), out_shardings=shardings)
    return nnx.merge(graphdef, init())


def count_params(state: Any) -> int:
    """Number of scalars in a (possibly abstract) state."""
    return sum(math.prod(x.shape) for x in jax.tree.leaves(state))
