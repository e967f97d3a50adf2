"""How the chunked E1-E3 pass (`dvp_jax/dvp/chunked.py`) is laid out on a device mesh.

`mesh_axes` picks the static partitioning of one call (`MeshAxes`: row axes, the vocabulary
axis, W's embedding axis) from a mesh; the small collectives below combine the vocabulary
shards inside `shard_map` and are the identity without a mesh. No E1-E3 arithmetic lives here.
"""

from __future__ import annotations

from typing import NamedTuple

import jax

# Mesh axes of the vocabulary-parallel path, as `dvp_jax.sharding.TRAIN_RULES` lays out the
# unembedding W [d, V] ("embed" -> fsdp, "vocab" -> tensor).
VOCAB_MESH_AXIS = "tensor"
EMBED_MESH_AXIS = "fsdp"


class MeshAxes(NamedTuple):
    """Static partitioning of one chunked call, inside `shard_map` (all empty outside).

    Attributes:
      rows: mesh axes the rows of h, y and the outputs are split over.
      vocab: the mesh axis W's V is split over (each device holds V / n_vocab columns), or None.
      embed: the mesh axis W's d is split over on entry (one of `rows`), or None; the local W
        shard is all-gathered over it in the forward and again in the backward pass, and dW is
        reduce-scattered back over it.
      n_vocab: number of vocabulary shards (1 without `vocab`).
    """

    rows: tuple[str, ...] = ()
    vocab: str | None = None
    embed: str | None = None
    n_vocab: int = 1


LOCAL = MeshAxes()


def vocab_max(x, axes: MeshAxes):
    return jax.lax.pmax(x, axes.vocab) if axes.vocab else x


def vocab_sum(x, axes: MeshAxes):
    return jax.lax.psum(x, axes.vocab) if axes.vocab else x


def gather_w(w, axes: MeshAxes):
    """The local W `[d / n_embed, V / n_vocab]` -> `[d, V / n_vocab]` (never gathers V)."""
    return jax.lax.all_gather(w, axes.embed, axis=0, tiled=True) if axes.embed else w


def reduce_dw(dw, axes: MeshAxes):
    """Sums per-row-shard dW `[d, V / n_vocab]` over the row axes, back in W's local layout."""
    if axes.embed:
        dw = jax.lax.psum_scatter(dw, axes.embed, scatter_dimension=0, tiled=True)
    rest = tuple(a for a in axes.rows if a != axes.embed)
    return jax.lax.psum(dw, rest) if rest else dw


def first_column(w, axes: MeshAxes):
    """Global id of the local vocabulary shard's first column."""
    return jax.lax.axis_index(axes.vocab) * w.shape[1] if axes.vocab else 0


def reshape_to(x, shape, sharding):
    """`x.reshape(shape)`, resharded to `sharding` unless it is None (Explicit axes; under
    `auto_axes`, so merging or splitting sharded leading dims needs no typed intermediate)."""
    if sharding is None:
        return x.reshape(shape)
    if x.shape == tuple(shape):
        return jax.sharding.reshard(x, sharding)
    return jax.sharding.auto_axes(lambda a: a.reshape(shape), out_sharding=sharding)(x)


def find_mesh(h, w, mesh):
    """The mesh to partition over: `mesh`, else the mesh of Explicit-typed h / w, else the
    context mesh; None for a single device, no mesh, or a mesh whose axes are already Manual
    (inside someone else's shard_map)."""
    if mesh is None:
        for x in (h, w):
            m = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
            if m is not None and not m.empty and jax.sharding.AxisType.Explicit in m.axis_types:
                # Outside jit, the array's concrete mesh (shard_map needs its devices there).
                concrete = None if isinstance(x, jax.core.Tracer) else getattr(x, "sharding", None)
                mesh = getattr(concrete, "mesh", m)
                break
    if mesh is None:
        mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or mesh.size == 1:
        return None
    if jax.sharding.AxisType.Manual in mesh.axis_types:
        return None
    return mesh


def mesh_axes(mesh, n: int, d: int, vocab: int) -> MeshAxes:
    """How `chunked_pruned_logprobs` splits `[N, d] x [d, V]` over `mesh` (see its docstring)."""
    sizes = dict(mesh.shape)
    n_vocab = sizes.get(VOCAB_MESH_AXIS, 1)
    vocab_axis = VOCAB_MESH_AXIS if n_vocab > 1 and vocab % n_vocab == 0 else None
    rows, size = [], 1
    for name in mesh.axis_names:  # like `Sharder.spec`: keep the axes that divide N
        if name != vocab_axis and sizes[name] > 1 and n % (size * sizes[name]) == 0:
            rows.append(name)
            size *= sizes[name]
    embed = EMBED_MESH_AXIS if EMBED_MESH_AXIS in rows and d % sizes[EMBED_MESH_AXIS] == 0 else None
    return MeshAxes(tuple(rows), vocab_axis, embed, n_vocab if vocab_axis else 1)
