"""Compiles a run's programs for a TPU topology on any host, and says whether they fit.

  python -m dvp_jax.aot --config configs/paper_qwen3_14b.py --topology v5p:4x4x2 \
      [--config.train.precision=mixed_bf16 ...] [--all_buckets] [--json_out PATH]

Same config handling and overrides as `dvp_jax.main`. The programs are the ones a run jits,
built by the same code with the same shardings and the shapes the config implies: the trainer's
RL update (the accumulated step and one micro-batch of it), the SFT step when the config has a
warm-up, the weight sync (trainer params -> rollout dtype), and on one host's engine the batched
prefill, insert and decode loop at the largest bucket (every bucket with `--all_buckets`). JAX
compiles each for the topology with the real TPU compiler (libtpu, installed by `make install`;
no TPU is needed: "deviceless" compilation) and the table gives per chip: argument, output,
temporary and aliased (donated) bytes, the program's peak (args + outputs + temps - aliases +
code) plus what the other phase keeps resident on the chip meanwhile (the trainer state during
rollout, the engine's weights during the update), against the chip's HBM; the dot FLOPs of one
call with every loop counted by its trip count (the compiler's `cost_analysis` counts a loop body
once); compile seconds. One JSON line follows. Exit status 1, with one line naming the program
and the reason, when a program does not compile or its peak exceeds `--hbm_fraction` of HBM;
2 for a mistake in the input.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
import time
from typing import Any

from absl import app, flags
from ml_collections import config_flags

from dvp_jax.cli import USAGE_EXIT_CODE, fail, flag_error, parse_flags

# Usable HBM per JAX device in GiB, as the TPU compiler reports it ("exceeds available HBM")
# for libtpu 0.0.42.1. A v4 chip is two devices (16 GiB each); v5p, v5e, v6e one per chip.
CHIP_HBM_GIB = {"v4": 15.25, "v5e": 15.75, "v5p": 95.74, "v6e": 31.25}
_GIB = 1024**3

# The command line's flags, defined when the module runs as a program (`_define_flags`): the
# library functions here are imported by tests next to other absl programs' flags.
_FLAGS: dict = {}


# ==============================================================================================
# Topologies
# ==============================================================================================
def topology_devices(name: str) -> list:
    """The devices of TPU topology `name` (e.g. "v5p:2x2x1"), compiled for from this host.

    Raises:
      ValueError: naming the allowed chips and the form, for a name that is not one.
    """
    from jax.experimental import topologies

    match = re.fullmatch(r"(v4|v5e|v5p|v6e):(\d+(?:x\d+){1,2})", name)
    if match is None:
        raise ValueError(
            f"--topology {name!r} is not <chip>:<dims> with chip one of {sorted(CHIP_HBM_GIB)} "
            "and dims like 2x2 or 4x4x2 (e.g. v5p:4x4x2 is a v5p-64, 32 chips)"
        )
    try:
        return list(topologies.get_topology_desc(platform="tpu", topology_name=name).devices)
    except Exception as e:  # libtpu missing, or a shape this chip does not come in
        raise ValueError(f"--topology {name!r}: {str(e).splitlines()[0]}") from e


def chip_of(topology: str) -> str:
    return topology.split(":")[0]


# ==============================================================================================
# FLOPs with loop trip counts
# ==============================================================================================
def dot_flops(closed_jaxpr, while_trips: int = 1) -> float:
    """Multiply-add FLOPs (2 per MAC) of every dot in a jaxpr, loops counted by trip count.

    Scans count `length` times; a `while` (trip count known only at run time) counts
    `while_trips` times; `shard_map` bodies count once per shard; Pallas kernels count their
    own cost estimate, and one without (the splash kernel gives none) counts 0: see
    `uncounted_kernels`. Elementwise work is not counted (small beside a transformer's
    matmuls).
    """
    return _flops(closed_jaxpr.jaxpr, while_trips)


def uncounted_kernels(closed_jaxpr) -> int:
    """Pallas kernel calls in a jaxpr that give no cost estimate (their FLOPs are not in
    `dot_flops`)."""
    counts = []
    _flops(closed_jaxpr.jaxpr, 1, counts)
    return len(counts)


def _flops(jaxpr, while_trips: int, uncounted: list | None = None) -> float:
    total = 0.0
    recurse = lambda inner: _flops(inner, while_trips, uncounted)
    for eqn in jaxpr.eqns:
        name, params = eqn.primitive.name, eqn.params
        if name == "dot_general":
            (lhs_contract, _), _ = params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            out = eqn.outvars[0].aval.shape
            total += 2.0 * math.prod(out) * math.prod(lhs[i] for i in lhs_contract)
        elif name == "scan":
            total += params["length"] * recurse(params["jaxpr"].jaxpr)
        elif name == "while":
            total += while_trips * recurse(params["body_jaxpr"].jaxpr)
        elif name == "cond":
            total += max(recurse(b.jaxpr) for b in params["branches"])
        elif name == "shard_map":
            total += params["mesh"].size * recurse(_inner(params["jaxpr"]))
        elif name == "pallas_call":
            estimate = params.get("cost_estimate")
            if estimate is None and uncounted is not None:
                uncounted.append(eqn)
            total += float(getattr(estimate, "flops", 0) or 0)
        else:
            for value in params.values():
                inner = _inner(value)
                if inner is not None:
                    total += recurse(inner)
    return total


def _inner(value):
    """The Jaxpr of a ClosedJaxpr / Jaxpr parameter, else None."""
    from jax.extend import core

    if isinstance(value, core.ClosedJaxpr):
        return value.jaxpr
    if isinstance(value, core.Jaxpr):
        return value
    return None


# ==============================================================================================
# Programs
# ==============================================================================================
@dataclasses.dataclass
class Program:
    """One compiled program's per-chip bytes (or why it did not compile)."""

    name: str
    argument: int = 0
    output: int = 0
    temp: int = 0
    alias: int = 0
    code: int = 0
    resident: int = 0  # bytes the other phase keeps on the chip while this one runs
    moved: int = 0  # weight sync: bytes a chip (on device) or a host (via host) receives
    flops: float = 0.0  # per chip, per call, loops by trip count
    compile_s: float = 0.0
    mosaic_kernels: int = 0  # Pallas (Mosaic) kernel calls in the program, e.g. splash
    uncounted_kernels: int = 0  # of those, the ones whose FLOPs `flops` leaves out
    warning: str = ""  # what explains a number the config makes worse than it needs to be
    error: str = ""

    @property
    def peak(self) -> int:
        return self.argument + self.output + self.temp - self.alias + self.code + self.resident

    def row(self, hbm: float) -> dict[str, Any]:
        gib = lambda b: round(b / _GIB, 3)
        return {
            "program": self.name,
            "argument_gib": gib(self.argument),
            "output_gib": gib(self.output),
            "temp_gib": gib(self.temp),
            "alias_gib": gib(self.alias),
            "resident_gib": gib(self.resident),
            "moved_gib": gib(self.moved),
            "peak_gib": gib(self.peak),
            "hbm_fraction": round(self.peak / (hbm * _GIB), 4),
            "tflop_per_call": round(self.flops / 1e12, 6),
            "compile_s": round(self.compile_s, 2),
            "warning": self.warning,
            "mosaic_kernels": self.mosaic_kernels,
            "uncounted_kernels": self.uncounted_kernels,
            "error": self.error,
        }


@dataclasses.dataclass
class Spec:
    """A program to build: the jitted function a run calls and its (abstract) arguments;
    `while_trips` counts the trips of its while loops for the FLOPs; `resident` is bytes per
    chip the other phase keeps meanwhile."""

    name: str
    jitted: Any
    args: tuple
    chips: int
    while_trips: int = 1
    resident: int = 0
    moved: int = 0  # weight sync: bytes a chip (on device) or a host (via host) receives
    warning: str = ""


def per_chip_bytes(tree) -> int:
    """Largest per-device bytes of a tree of sharded ShapeDtypeStructs / arrays."""
    import jax

    per_device: dict[Any, int] = {}
    for x in jax.tree.leaves(tree):
        sharding = x.sharding
        shard = math.prod(sharding.shard_shape(x.shape)) * x.dtype.itemsize
        for d in sharding.device_set:
            per_device[d] = per_device.get(d, 0) + shard
    return max(per_device.values(), default=0)


def _structs(tree, shardings):
    import jax

    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


def train_specs(cfg, devices) -> tuple[list[Spec], dict[str, Any]]:
    """The trainer's programs on all of `devices`, and what they share with the engine."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from dvp_jax.model import Transformer
    from dvp_jax.sharding import TRAIN_RULES, Sharder, make_mesh
    from dvp_jax.train import batch as batch_lib
    from dvp_jax.train import sft as sft_lib
    from dvp_jax.train import step as step_lib
    from dvp_jax.train.builders import train_policy
    from dvp_jax.train.state import abstract_train_state, make_optimizer

    try:
        mesh = make_mesh(cfg.mesh, devices)
    except ValueError as e:
        raise ValueError(f"config.mesh on {len(devices)} devices: {e}") from e
    sharder = Sharder(mesh, TRAIN_RULES)
    t = cfg.train
    abstract_model = nnx.eval_shape(
        lambda: Transformer(
            cfg.model, train_policy(cfg, sharder.platform), sharder, rngs=nnx.Rngs(0), remat=t.remat
        )
    )
    optimizer = make_optimizer(t.learning_rate, t.warmup_steps, t.weight_decay, t.grad_clip)
    graphdef, state, state_sh = abstract_train_state(abstract_model, optimizer, sharder)
    rows = t.prompts_per_step * t.group_size // t.updates_per_batch
    length = cfg.data.max_prompt_len + cfg.rollout.max_decode_length

    def rl_batch(n):
        shapes = dict(
            tokens=((n, length), jnp.int32),
            positions=((n, length), jnp.int32),
            valid=((n, length), jnp.bool_),
            response_mask=((n, length - 1), jnp.bool_),
            behaviour_logp=((n, length - 1), jnp.float32),
            behaviour_logp_full=((n, length - 1), jnp.float32),
            behaviour_pruned_mass=((n, length - 1), jnp.float32),
            behaviour_safe_size=((n, length - 1), jnp.float32),
            advantages=((n,), jnp.float32),
            old_logp=((n, length - 1), jnp.float32),
            old_in_safe=((n, length - 1), jnp.bool_),
        )
        batch = batch_lib.RLBatch(**{k: jax.ShapeDtypeStruct(*v) for k, v in shapes.items()})
        return _structs(batch, batch_lib.batch_shardings(batch, sharder))

    def update_spec(name, n, micro_batches):
        batch = rl_batch(n)
        fn = step_lib.jit_rl_update(
            graphdef=graphdef,
            optimizer=optimizer,
            loss_cfg=cfg.loss,
            chunk_size=t.chunk_size,
            micro_batches=micro_batches,
            state_shardings=state_sh,
            batch_shardings=jax.tree.map(lambda x: x.sharding, batch),
            sharder=sharder,
        )
        return Spec(name, fn, (state, batch), chips=mesh.size)

    specs = [update_spec("rl_update", rows, t.micro_batches)]
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    if (rows // t.micro_batches) % shards:
        specs[0].warning = (
            f"a micro-batch of {rows // t.micro_batches} rows does not split over the "
            f"{shards} data x fsdp shards: every chip holds all of its rows (set "
            "config.train.micro_batches so that rows / micro_batches is a multiple)"
        )
    if t.micro_batches > 1:
        specs.append(update_spec("rl_update/one_micro_batch", rows // t.micro_batches, 1))
    if cfg.sft.steps > 0:
        sft_opt = make_optimizer(cfg.sft.learning_rate, cfg.sft.warmup_steps, 0.0, 1.0)
        _, sft_state, sft_sh = abstract_train_state(abstract_model, sft_opt, sharder)
        n = cfg.sft.batch_size
        host = (
            jax.ShapeDtypeStruct((n, length), jnp.int32),
            jax.ShapeDtypeStruct((n, length), jnp.bool_),
            jax.ShapeDtypeStruct((n,), jnp.int32),
        )
        sft_batch = _structs(host, batch_lib.batch_shardings(host, sharder))
        fn = sft_lib.jit_sft_step(graphdef, sft_opt, t.chunk_size, sharder)
        specs.append(Spec("sft_step", fn, (sft_state, sft_batch), chips=mesh.size))
    shared = {"state": state, "params": state.params, "mesh": mesh}
    return specs, shared


def engine_specs(
    cfg, devices, trainer: dict[str, Any], all_buckets: bool
) -> tuple[list[Spec], int]:
    """The rollout engine programs of the first host (on the devices `builders.engine_mesh`
    gives it, as the trainer does) and the weight sync into it; and the bytes per chip the
    engines keep meanwhile."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from dvp_jax.rollout.engine import RolloutEngine
    from dvp_jax.rollout.offline import STEPS_PER_SYNC
    from dvp_jax.train.builders import engine_config, engine_mesh

    r = cfg.rollout
    mesh = engine_mesh(trainer["mesh"], r.tensor_parallel, devices[0].process_index)
    hosts = len({d.process_index for d in devices})
    engine = RolloutEngine(
        cfg.model, engine_config(cfg), tokenizer="char", mesh=mesh, abstract=True
    )
    rep = NamedSharding(mesh, PartitionSpec())
    struct = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=rep)
    ec = engine.config
    params = engine.params
    trainer_state = per_chip_bytes(trainer["state"])
    sampling = jax.tree.map(lambda x: struct(x.shape, x.dtype), ec.sampling_params())
    state = _structs(jax.eval_shape(engine._init_state_impl, sampling), engine._state_shardings)
    key_shape = engine._base_key.shape
    specs = []

    def spec(name, jitted, *args, while_trips=1):
        specs.append(Spec(name, jitted, args, mesh.size, while_trips, trainer_state))

    spec("engine/init_state", engine._init_state_jit, sampling)
    # Prompts per prefill call: a refill of the free slots takes ceil(slots / G) new prompts,
    # at most this host's share of the step's prompts (`offline.generate_rollouts`).
    b = ec.max_concurrent_decodes
    prompts = min(-(-cfg.train.prompts_per_step // hosts), -(-b // cfg.train.group_size), b)
    rows = min(n for n in ec.row_buckets if n >= prompts)
    for bucket in ec.buckets if all_buckets else ec.buckets[-1:]:
        args = (
            params,
            struct((rows, bucket), jnp.int32),
            struct((rows,), jnp.int32),
            struct((rows,) + key_shape, jnp.uint32),
        )
        spec(f"engine/prefill[{rows}x{bucket}]", engine._prefill_batch_jit, *args)
    # The prefix of the largest bucket as insert receives it: its cache sharded like the
    # decode state's, the rest replicated.
    prefix = jax.tree.map(
        lambda x: struct(x.shape, x.dtype), jax.eval_shape(engine._prefill_batch_impl, *args)
    )
    prefix = prefix.replace(cache=jax.tree.map(lambda x: _cache_struct(x, engine), prefix.cache))
    slots = struct((b,), jnp.int32)
    spec("engine/insert_batch", engine._insert_batch_jit, prefix, state, slots, slots, slots)
    k = STEPS_PER_SYNC
    for kv in ec.kv_buckets if all_buckets else ec.kv_buckets[-1:]:
        spec(
            f"engine/decode_loop[k={k},kv={kv}]",
            engine._generate_steps_jit,
            params,
            state,
            k,
            kv,
            struct((), jnp.bool_),
            while_trips=k,
        )
    # Weight sync: the trainer's params (on the trainer mesh) cast to the rollout dtype, on the
    # devices into the rollout layout when the engine is a tensor row of the trainer's mesh
    # (`RolloutEngine.trainer_row_mesh`), else cast in place and copied through the host.
    trainer_params = jax.tree.leaves(trainer["params"])
    row_mesh = engine.trainer_row_mesh(trainer_params)
    if row_mesh is not None:
        layout = engine._sync_shardings(row_mesh)
        cast = jax.jit(engine._cast, out_shardings=layout)
        sync = Spec("weight_sync/on_device", cast, (trainer_params,), trainer["mesh"].size)
        out = _structs(jax.eval_shape(cast, trainer_params), layout)
        own = [
            jax.ShapeDtypeStruct(x.shape, y.dtype, sharding=x.sharding)
            for x, y in zip(trainer_params, out, strict=True)
        ]
        sync.moved = per_chip_bytes(out) - per_chip_bytes(own)
    else:
        chips = trainer["mesh"].size
        sync = Spec("weight_sync/via_host", engine._cast_jit, (trainer_params,), chips)
        sync.moved = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(params))
    # Meanwhile: the engine's current weights and the rest of the trainer state.
    sync.resident = per_chip_bytes(params) + trainer_state - per_chip_bytes(trainer_params)
    specs.append(sync)
    # What the engines keep on a chip while the trainer runs: their weights (the decode state
    # lives only during rollouts); a second engine for evaluation at another precision too.
    weights = per_chip_bytes(params)
    if cfg.eval.dtype and cfg.eval.dtype != r.dtype:
        evaluation = RolloutEngine(
            cfg.model,
            engine_config(cfg, cfg.eval.dtype),
            tokenizer="char",
            mesh=mesh,
            abstract=True,
        )
        weights += per_chip_bytes(evaluation.params)
    return specs, weights


def _cache_struct(x, engine):
    import jax

    from dvp_jax.model.attention import seq_axis

    length = x.shape[seq_axis(engine.cache_layout)]
    return jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=engine._cache_sharding(x.shape[1], length)
    )


def compile_spec(spec: Spec) -> Program:
    """Lowers and compiles one program; errors become the program's `error`."""
    program = Program(spec.name, resident=spec.resident, moved=spec.moved, warning=spec.warning)
    start = time.time()
    try:
        traced = spec.jitted.trace(*spec.args)
        lowered = traced.lower()
        program.mosaic_kernels = lowered.as_text().count("@tpu_custom_call(")
        compiled = lowered.compile()
    except Exception as e:  # the compiler's reason, first line
        program.error = _reason(e)
        program.compile_s = time.time() - start
        return program
    program.compile_s = time.time() - start
    m = compiled.memory_analysis()
    program.argument = m.argument_size_in_bytes
    program.output = m.output_size_in_bytes
    program.temp = m.temp_size_in_bytes
    program.alias = m.alias_size_in_bytes
    program.code = m.generated_code_size_in_bytes
    program.flops = dot_flops(traced.jaxpr, spec.while_trips) / spec.chips
    program.uncounted_kernels = uncounted_kernels(traced.jaxpr)
    return program


def _reason(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = lines[0] if lines else type(error).__name__
    for line in lines:  # the compiler's own diagnosis beats the wrapper's first line
        if any(key in line for key in ("RESOURCE_EXHAUSTED", "RET_CHECK", "NotImplemented")):
            text = line
            break
    return f"{type(error).__name__}: {text}"[:400]


# ==============================================================================================
# Running and reporting
# ==============================================================================================
def compile_config(
    cfg, topology: str, all_buckets: bool = False, programs: tuple[str, ...] = (), log=print
) -> list[Program]:
    """Every program of `cfg` compiled for `topology` (`programs`: names or prefixes to keep)."""
    devices = topology_devices(topology)
    keep = lambda name: not programs or any(name.startswith(p) for p in programs)
    specs, trainer = train_specs(cfg, devices)
    engine, engine_weights = engine_specs(cfg, devices, trainer, all_buckets)
    for spec in specs:
        spec.resident = engine_weights
    specs += engine
    out = []
    for spec in specs:
        if not keep(spec.name):
            continue
        log(f"compiling {spec.name} ...")
        out.append(compile_spec(spec))
    return out


def failures(programs: list[Program], hbm: float, fraction: float) -> list[str]:
    lines = []
    for p in programs:
        if p.error:
            lines.append(f"{p.name} does not compile: {p.error}")
        elif p.peak > fraction * hbm * _GIB:
            lines.append(
                f"{p.name} does not fit: peak {p.peak / _GIB:.1f} GiB per chip (resident "
                f"{p.resident / _GIB:.1f}) > {fraction:.0%} of {hbm} GiB"
            )
    return lines


def table(programs: list[Program], hbm: float) -> str:
    head = (
        f"{'program':<34} {'args':>7} {'out':>7} {'temp':>7} {'alias':>7} {'resid':>7} "
        f"{'peak':>7} {'%HBM':>6} {'TFLOP':>9} {'compile':>8}"
    )
    lines = [head, "-" * len(head)]
    for p in programs:
        if p.error:
            lines.append(f"{p.name:<34} FAILED  {p.error[:120]}")
            continue
        g = lambda b: f"{b / _GIB:7.2f}"
        mark = "*" if p.uncounted_kernels else " "
        lines.append(
            f"{p.name:<34} {g(p.argument)} {g(p.output)} {g(p.temp)} {g(p.alias)} "
            f"{g(p.resident)} {g(p.peak)} {100 * p.peak / (hbm * _GIB):5.1f}% "
            f"{p.flops / 1e12:8.3f}{mark} {p.compile_s:7.1f}s"
        )
    for p in programs:
        if p.warning:
            lines.append(f"warning: {p.name}: {p.warning}")
        if p.moved:
            where = "per chip, over the devices' links" if "on_device" in p.name else "per host"
            lines.append(f"{p.name}: {p.moved / _GIB:.2f} GiB received {where} per sync")
    lines.append(
        f"(GiB per chip; HBM {hbm} GiB; resid: the other phase's arrays on the chip; TFLOP per "
        "chip per call, loops by trip count; * leaves out Mosaic kernels without a cost "
        "estimate, e.g. splash attention)"
    )
    return "\n".join(lines)


def main(argv):
    if len(argv) > 1:
        fail(f"unexpected arguments {argv[1:]}: every option is a --flag", USAGE_EXIT_CODE)
    import jax

    jax.config.update("jax_platforms", "cpu")  # the host side; the programs are for TPU
    opts = {name: flag.value for name, flag in _FLAGS.items() if name != "config"}
    from dvp_jax.errors import UserError
    from dvp_jax.train.builders import load_run_tokenizer
    from dvp_jax.train.config import ExperimentConfig

    try:
        config = _FLAGS["config"].value
        config.data  # noqa: B018  (a config file that failed to load raises on first use)
    except Exception as e:
        fail(flag_error(e, sys.argv), USAGE_EXIT_CODE, e)
    try:
        vocab = config.model.get("vocab_size", -1)
        if vocab in (None, -1):
            vocab = load_run_tokenizer(config.data.tokenizer).vocab_size
        cfg = ExperimentConfig.from_config_dict(config, vocab)
    except (UserError, ValueError) as e:
        fail(str(e), USAGE_EXIT_CODE, e)
    programs = tuple(p for p in opts["programs"].split(",") if p)
    log = lambda line: print(line, file=sys.stderr, flush=True)
    try:
        results = compile_config(cfg, opts["topology"], opts["all_buckets"], programs, log)
    except ValueError as e:  # a topology name, or a mesh / tensor_parallel it cannot hold
        fail(str(e), USAGE_EXIT_CODE, e)
    hbm = CHIP_HBM_GIB[chip_of(opts["topology"])]
    print(table(results, hbm), flush=True)
    bad = failures(results, hbm, opts["hbm_fraction"])
    line = json.dumps(
        {
            "topology": opts["topology"],
            "hbm_gib": hbm,
            "hbm_fraction_limit": opts["hbm_fraction"],
            "ok": not bad,
            "programs": [p.row(hbm) for p in results],
        }
    )
    print(line, flush=True)
    if opts["json_out"]:
        with open(opts["json_out"], "w") as f:
            f.write(line + "\n")
    if bad:
        fail(bad[0] + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""), 1)


def _define_flags() -> None:
    f = _FLAGS
    f["config"] = config_flags.DEFINE_config_file(
        "config", None, "Experiment config file (as for dvp_jax.main)."
    )
    f["topology"] = flags.DEFINE_string(
        "topology",
        None,
        "TPU topology, <chip>:<dims>, chip one of v4, v5e, v5p, v6e (v5p:4x4x2).",
    )
    f["all_buckets"] = flags.DEFINE_bool(
        "all_buckets", False, "Compile every prefill and KV-cache bucket, not only the largest."
    )
    f["programs"] = flags.DEFINE_string(
        "programs", "", "Comma-separated program names or prefixes to compile (default: all)."
    )
    f["hbm_fraction"] = flags.DEFINE_float(
        "hbm_fraction", 0.9, "A program fits when its peak is at most this fraction of HBM."
    )
    f["json_out"] = flags.DEFINE_string("json_out", "", "Also write the JSON line to this file.")
    f["verbose"] = flags.DEFINE_bool("verbose", False, "Tracebacks for every error.")
    flags.mark_flags_as_required(["config", "topology"])


def run():
    _define_flags()
    parse_flags(sys.argv)
    app.run(main, argv=[sys.argv[0]])


if __name__ == "__main__":
    run()
