"""A run's programs as `compiled.Spec`s for a TPU topology's devices, built by the code the run
builds them with (the trainer's `programs.trainer_programs`, the rollout side's
`build.build_rollout` and the weight sync), with the same shardings and the shapes the config
implies. Nothing is compiled here (`compiled.compile_spec` does that) and no weights are read.
"""

from __future__ import annotations

import math
from typing import Any

from dvp_jax.plan.compiled import Spec, per_chip_bytes


def _structs(tree, shardings):
    import jax

    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


def train_specs(cfg, devices) -> tuple[list[Spec], dict[str, Any]]:
    """The trainer's programs on all of `devices` (`programs.trainer_programs`, as a run builds
    them), and what they share with the engine."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from dvp_jax.sharding import TRAIN_RULES, Sharder, make_mesh
    from dvp_jax.train import batch as batch_lib
    from dvp_jax.train import sft as sft_lib
    from dvp_jax.train import step as step_lib
    from dvp_jax.train.build import model_factory
    from dvp_jax.train.programs import train_optimizer, trainer_programs
    from dvp_jax.train.state import abstract_train_state

    try:
        mesh = make_mesh(cfg.mesh, devices)
    except ValueError as e:
        raise ValueError(f"config.mesh on {len(devices)} devices: {e}") from e
    sharder = Sharder(mesh, TRAIN_RULES)
    abstract_model = nnx.eval_shape(model_factory(cfg, sharder))
    optimizer = train_optimizer(cfg.train)
    reference = cfg.loss.kl_reference_dtype if cfg.loss.uses_reference else None
    graphdef, state, state_sh = abstract_train_state(abstract_model, optimizer, sharder, reference)
    hosts = len({d.process_index for d in devices})
    programs = trainer_programs(cfg, sharder, graphdef, optimizer, state_sh, hosts)
    layout, batch = programs.layout, programs.batch

    specs = [Spec("rl_update", programs.update, (state, batch), chips=mesh.size)]
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    per_micro = layout.rows * hosts // layout.micro_batches
    if per_micro % shards:
        specs[0].warning = (
            f"a micro-batch of {per_micro} rows does not split over the {shards} data x fsdp "
            "shards: every chip holds all of its rows (set config.train.micro_batches so that "
            "the update's rows / micro_batches is a multiple)"
        )
    if programs.logprobs is not None:
        inputs = step_lib.logprob_inputs(batch)
        specs.append(Spec("logprobs", programs.logprobs, (state.params, inputs), chips=mesh.size))
    if programs.sft_step is not None:
        _, sft_state, _ = abstract_train_state(
            abstract_model, sft_lib.sft_optimizer(cfg.sft), sharder
        )
        n, length = cfg.sft.batch_size, cfg.sequence_length
        host = (
            jax.ShapeDtypeStruct((n, length), jnp.int32),
            jax.ShapeDtypeStruct((n, length), jnp.bool_),
            jax.ShapeDtypeStruct((n,), jnp.int32),
        )
        sft_batch = _structs(host, batch_lib.batch_shardings(host, sharder))
        specs.append(Spec("sft_step", programs.sft_step, (sft_state, sft_batch), chips=mesh.size))
    shared = {"state": state, "params": state.params, "mesh": mesh, "programs": programs}
    return specs, shared


def engine_specs(
    cfg, devices, trainer: dict[str, Any], all_buckets: bool
) -> tuple[list[Spec], int]:
    """The rollout engine programs of the first host, built as the run builds its rollout side
    (`build.build_rollout`: the engine on the devices `weights.engine_mesh` gives it) and the
    weight sync into it; and the bytes per chip the engines keep meanwhile."""
    import jax
    import jax.numpy as jnp

    from dvp_jax.rollout.decode import raw_key_shape
    from dvp_jax.rollout.scheduler import MIN_STEPS
    from dvp_jax.train.build import build_rollout

    hosts = len({d.process_index for d in devices})
    rollout = build_rollout(cfg, "char", None, trainer["mesh"], process=devices[0].process_index)
    engine, mesh = rollout.engine, rollout.mesh
    programs, ec, params = engine.programs, engine.config, engine.params
    trainer_state = per_chip_bytes(trainer["state"])
    sampling = engine.replicated_structs(ec.sampling_params())
    state = engine.abstract_decode_state()
    specs = []

    def spec(name, jitted, *args, while_trips=1):
        specs.append(Spec(name, jitted, args, mesh.size, while_trips, trainer_state))

    spec("engine/init_state", programs.init_state, sampling)
    # Prompts per prefill call: a refill of the free slots takes ceil(slots / G) new prompts,
    # at most this host's share of the step's prompts (`offline.generate_rollouts`).
    b = ec.max_concurrent_decodes
    prompts = min(-(-cfg.train.prompts_per_step // hosts), -(-b // cfg.train.group_size), b)
    rows = min(n for n in ec.row_buckets if n >= prompts)
    for bucket in ec.buckets if all_buckets else ec.buckets[-1:]:
        args = engine.replicated_structs(
            (
                jax.ShapeDtypeStruct((rows, bucket), jnp.int32),
                jax.ShapeDtypeStruct((rows,), jnp.int32),
                jax.ShapeDtypeStruct((rows,) + raw_key_shape(), jnp.uint32),
            )
        )
        spec(f"engine/prefill[{rows}x{bucket}]", programs.prefill, params, *args)
    # The prefix of the largest bucket as insert receives it.
    prefix = engine.abstract_prefix(rows, ec.buckets[-1])
    slots = engine.replicated_structs(jax.ShapeDtypeStruct((b,), jnp.int32))
    spec("engine/insert_batch", programs.insert, prefix, state, slots, slots, slots)
    # The dispatch size is traced (one program for every size): priced at the scheduler's
    # smallest sized dispatch.
    k = MIN_STEPS
    steps = engine.replicated_structs(jax.ShapeDtypeStruct((), jnp.int32))
    flag = engine.replicated_structs(jax.ShapeDtypeStruct((), jnp.bool_))
    if ec.paged:  # one program whatever the lengths (the kernel); the XLA path: a page bucket
        spans = ec.page_buckets if all_buckets and engine.paged_impl == "xla" else [None]
        for pages in spans:
            span = engine.page_bucket(pages)
            name = f"engine/decode_loop[k={k},{engine.paged_impl},pages={span or 'own'}]"
            spec(name, programs.loop, params, state, steps, span, flag, while_trips=k)
    for kv in [] if ec.paged else ec.kv_buckets if all_buckets else ec.kv_buckets[-1:]:
        name = f"engine/decode_loop[k={k},kv={kv}]"
        spec(name, programs.loop, params, state, steps, kv, flag, while_trips=k)
    # Weight sync: the trainer's params (on the trainer mesh) cast to the rollout dtype, on the
    # devices into the rollout layout when the engine is a tensor row of the trainer's mesh,
    # else cast in place and copied through the host (`weights.WeightSync`, decided once).
    trainer_params = jax.tree.leaves(trainer["params"])
    row_mesh = rollout.sync.row_meshes[0]
    if row_mesh is not None:
        cast = engine.sync_program(row_mesh)
        sync = Spec("weight_sync/on_device", cast, (trainer_params,), trainer["mesh"].size)
        out = _structs(jax.eval_shape(cast, trainer_params), engine.sync_shardings(row_mesh))
        own = [
            jax.ShapeDtypeStruct(x.shape, y.dtype, sharding=x.sharding)
            for x, y in zip(trainer_params, out, strict=True)
        ]
        sync.moved = per_chip_bytes(out) - per_chip_bytes(own)
    else:
        chips = trainer["mesh"].size
        sync = Spec("weight_sync/via_host", programs.cast, (trainer_params,), chips)
        sync.moved = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(params))
    # Meanwhile: the engine's current weights and the rest of the trainer state.
    sync.resident = per_chip_bytes(params) + trainer_state - per_chip_bytes(trainer_params)
    specs.append(sync)
    # What the engines keep on a chip while the trainer runs: their weights (the decode state
    # lives only during rollouts); a second engine for evaluation at another precision too.
    weights = sum(per_chip_bytes(e.params) for e in rollout.engines)
    return specs, weights
