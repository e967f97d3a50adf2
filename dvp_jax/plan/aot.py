"""Compiles a run's programs for a TPU topology on any host, and says whether they fit.

  python -m dvp_jax.aot --config configs/paper_qwen3_14b.py --topology v5p:4x4x2 \
      [--config.train.precision=mixed_bf16 ...] [--all_buckets] [--json_out PATH]

Same config handling and overrides as `dvp_jax.main`. The programs are the ones a run jits,
built by the same code with the same shardings and the shapes the config implies: the RL update
(the accumulated step and one micro-batch of it), the SFT step when the config has a warm-up,
the weight sync, and one host's engine programs (`RolloutEngine.programs`: batched prefill,
insert and decode loop at the largest bucket; every bucket with `--all_buckets`). The real TPU
compiler (libtpu; no TPU needed) compiles each for the topology; `aot_report` turns the results
into a table of per-chip bytes against HBM, FLOPs and compile seconds, then one JSON line. Exit
status 1, with one line naming the program and the reason, when a program does not compile or
its peak exceeds `--hbm_fraction` of HBM; 2 for a mistake in the input.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from typing import Any

import numpy as np
from absl import app, flags
from ml_collections import config_flags

from dvp_jax import length_mix
from dvp_jax.aot_report import Program, Spec, compile_spec, failures, per_chip_bytes, table
from dvp_jax.cli import USAGE_EXIT_CODE, fail, flag_error, parse_flags
from dvp_jax.errors import ConfigError
from dvp_jax.model.config import PRESETS as MODEL_PRESETS

# Usable HBM per JAX device in GiB, as the TPU compiler reports it ("exceeds available HBM")
# for libtpu 0.0.42.1. A v4 chip is two devices (16 GiB each); v5p, v5e, v6e one per chip.
CHIP_HBM_GIB = {"v4": 15.25, "v5e": 15.75, "v5p": 95.74, "v6e": 31.25}
# Dense bf16 matmul peak per JAX device, FLOP/s (Cloud TPU system-architecture pages: v5p 459,
# v5e 197, v6e 918 TFLOP/s per chip; v4 275 per chip, two devices).
CHIP_BF16_FLOPS = {"v4": 137.5e12, "v5e": 197e12, "v5p": 459e12, "v6e": 918e12}
# HBM bandwidth per JAX device, bytes/s (the same pages: v5p 2,765, v5e 819, v6e 1,640 GB/s per
# chip; v4 1,228 per chip, two devices).
CHIP_HBM_BYTES_PER_S = {"v4": 0.614e12, "v5e": 0.819e12, "v5p": 2.765e12, "v6e": 1.64e12}

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
# Programs of a run
# ==============================================================================================
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


# ==============================================================================================
# Running and reporting
# ==============================================================================================
def compile_config(
    cfg,
    topology: str,
    all_buckets: bool = False,
    programs: tuple[str, ...] = (),
    log=print,
    skip: tuple[str, ...] = (),
) -> list[Program]:
    """Every program of `cfg` compiled for `topology` (`programs`: names or prefixes to keep;
    `skip`: exact names to leave out)."""
    devices = topology_devices(topology)
    keep = lambda name: (
        name not in skip and (not programs or any(name.startswith(p) for p in programs))
    )
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


def length_mixes(cfg, opts) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """Each step the length flags describe, as (name, prompt lengths, response lengths), each
    [prompts_per_step * group_size]: one per mean of --response_length_mean (a comma-separated
    list), or the file of --response_lengths; [] when neither is given (no cost at real lengths
    is printed).

    Raises:
      ValueError: a mean that is not a number >= 1, a bad file, both flags, a bad prompt length.
    """
    means, path = opts["response_length_mean"] or [], opts["response_lengths"]
    if not means and not path:
        return []
    if means and path:
        raise ValueError("give one of --response_length_mean and --response_lengths")
    n = cfg.train.prompts_per_step * cfg.train.group_size
    prompt = opts["prompt_length"] or cfg.data.max_prompt_len
    if not 1 <= prompt <= cfg.data.max_prompt_len:
        raise ValueError(
            f"--prompt_length={prompt} must be in [1, data.max_prompt_len="
            f"{cfg.data.max_prompt_len}]"
        )
    prompts = np.full((n,), prompt, np.int64)
    cap = cfg.rollout.max_decode_length
    if path:
        return [(path, prompts, length_mix.response_lengths(n, cap, path=path))]
    out = []
    for text in means:
        try:
            mean = float(text)
        except ValueError:
            raise ValueError(
                f"--response_length_mean: {text!r} is not a number (a mean, or a comma-separated "
                "list of means)"
            ) from None
        name = f"mean {mean:g}, lognormal"
        out.append((name, prompts, length_mix.response_lengths(n, cap, mean=mean)))
    return out


def step_lengths(cfg, opts) -> tuple[np.ndarray, np.ndarray] | None:
    """The first step of `length_mixes` as (prompt lengths, response lengths), or None."""
    mixes = length_mixes(cfg, opts)
    return mixes[0][1:] if mixes else None


def update_cost_report(cfg, opts, results: list[Program], mixes) -> list[dict]:
    """Prints the update's cost at each step's real lengths (`train/cost.py`), all from the one
    compiled `rl_update`, and returns them for the JSON line; says so when `rl_update` was not
    compiled (`--programs`)."""
    from dvp_jax.train import cost

    update = next((p for p in results if p.name == "rl_update" and not p.error), None)
    if update is None:
        print("\n(rl_update was not compiled: no update cost at real lengths)", flush=True)
        return []
    chip = chip_of(opts["topology"])
    hosts = len({d.process_index for d in topology_devices(opts["topology"])})
    out = []
    for name, prompts, responses in mixes:
        print(
            f"\nupdate at real lengths: responses {name} (mean {responses.mean():,.0f}, max "
            f"{responses.max():,}), prompts {prompts.mean():,.0f} tokens",
            flush=True,
        )
        costs = cost.update_costs(
            cfg,
            prompts,
            responses,
            hosts=hosts,
            flops=update.flops,
            attention_flops=update.attention_flops,
            peak_flops=CHIP_BF16_FLOPS[chip],
        )
        print(cost.table(costs, cfg.train.precision, CHIP_BF16_FLOPS[chip]), flush=True)
        out.append(
            {
                "lengths": name,
                "response_length_mean": float(responses.mean()),
                "prompt_length_mean": float(prompts.mean()),
                "peak_bf16_tflops": CHIP_BF16_FLOPS[chip] / 1e12,
                "passes": cost.PASSES[cfg.train.precision],
                "layouts": [c.row() for c in costs],
            }
        )
    return out


def rollout_cost_report(cfg, opts, mixes) -> list[dict]:
    """Prints the rollout's cost at each step's real lengths, dense, paged kernel and paged
    XLA (`rollout/cost.py`, replaying the engine's scheduler), with bytes per chip from one
    host's abstract engine (its weights' and its cache's shardings), and returns them for the
    JSON line."""
    import jax

    from dvp_jax.model.paged import paged_cache_shape, paged_cache_sharding
    from dvp_jax.rollout import cost
    from dvp_jax.rollout.engine import RolloutEngine
    from dvp_jax.sharding import MeshConfig, make_mesh
    from dvp_jax.train.build import engine_config

    devices = topology_devices(opts["topology"])
    chip, hosts = chip_of(opts["topology"]), len({d.process_index for d in devices})
    tp = cfg.rollout.tensor_parallel
    mesh = make_mesh(MeshConfig(1, 1, tp), devices[:tp])
    engine = RolloutEngine(cfg.model, engine_config(cfg), "char", mesh=mesh, abstract=True)
    ec = engine.config
    shape = paged_cache_shape(cfg.model, ec.num_pages, ec.page_size)
    pool = jax.ShapeDtypeStruct(
        shape,
        engine.policy.cache_dtype,
        sharding=paged_cache_sharding(engine.sharder, shape, cfg.model.n_kv_heads),
    )
    kv_per_position = 2 * per_chip_bytes(pool) / (ec.num_pages * ec.page_size)  # k and v
    weights = per_chip_bytes(engine.params)
    bandwidth = CHIP_HBM_BYTES_PER_S[chip]
    out = []
    for name, prompts, responses in mixes:
        print(
            f"\nrollout at real lengths: responses {name} (mean {responses.mean():,.0f}, max "
            f"{responses.max():,}), {ec.max_concurrent_decodes} slots per host, weights "
            f"{weights / 1e9:.2f} GB and KV {kv_per_position / 1024:.0f} KiB per position per chip",
            flush=True,
        )
        costs = cost.rollout_costs(
            prompts,
            responses,
            hosts=hosts,
            config=ec,
            weight_bytes=weights,
            kv_bytes_per_position=kv_per_position,
            hbm_bytes_per_s=bandwidth,
        )
        print(cost.table(costs, bandwidth), flush=True)
        out.append(
            {
                "lengths": name,
                "response_length_mean": float(responses.mean()),
                "hbm_tb_per_s": bandwidth / 1e12,
                "decodes": [c.row() for c in costs],
            }
        )
    return out


def step_lower_bound(update: list[dict], rollout: list[dict]) -> list[dict]:
    """Prints and returns the whole step's lower bound at each length mix: the padded update
    with the dense rollout, and the packed update with each paged rollout (the kernel on TPU,
    the ragged XLA path elsewhere)."""
    out = []
    if not update or not rollout:
        return out
    print("\nwhole step (update at peak FLOPs + rollout at HBM bandwidth; a lower bound):")
    for u, r in zip(update, rollout, strict=True):
        padded, packed = (c["seconds_at_peak"] for c in u["layouts"])
        dense, kernel, xla = (c["seconds"] for c in r["decodes"])
        row = {
            "lengths": u["lengths"],
            "padded_dense_s": padded + dense,
            "packed_kernel_s": packed + kernel,
            "packed_xla_s": packed + xla,
        }
        print(
            f"  {row['lengths']:<26} padded + dense {row['padded_dense_s']:>8,.0f} s, packed + "
            f"paged kernel {row['packed_kernel_s']:>8,.0f} s, packed + paged XLA "
            f"{row['packed_xla_s']:>8,.0f} s"
        )
        out.append(row)
    return out


def check_architecture_source(config) -> None:
    """Where `model.hf_path` is not a local directory here, `model.preset` must say the
    architecture (compiling "tiny" for someone's 14B checkpoint would report nothing useful)."""
    hf_path = config.model.get("hf_path") or ""
    if (
        hf_path
        and not os.path.isdir(os.path.expanduser(hf_path))
        and not config.model.get("preset")
    ):
        raise ConfigError(
            f"config.model.hf_path={hf_path!r} is not a local directory here, so its config.json "
            "cannot give the architecture: set config.model.preset (one of "
            f"{sorted(MODEL_PRESETS)}) to compile without the checkpoint"
        )


def main(argv):
    if len(argv) > 1:
        fail(f"unexpected arguments {argv[1:]}: every option is a --flag", USAGE_EXIT_CODE)
    import jax

    jax.config.update("jax_platforms", "cpu")  # the host side; the programs are for TPU
    opts = {name: flag.value for name, flag in _FLAGS.items() if name != "config"}
    from dvp_jax.errors import UserError
    from dvp_jax.train.build import load_run_tokenizer
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
        # aot never reads weights: a checkpoint that lives on the pod need not exist here.
        check_architecture_source(config)
        cfg = ExperimentConfig.from_config_dict(config, vocab, read_checkpoint=False)
        mixes = length_mixes(cfg, opts)
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
    report = {
        "topology": opts["topology"],
        "hbm_gib": hbm,
        "hbm_fraction_limit": opts["hbm_fraction"],
        "ok": not bad,
        "programs": [p.row(hbm) for p in results],
    }
    if mixes:
        update = report["update_at_real_lengths"] = update_cost_report(cfg, opts, results, mixes)
        rollout = report["rollout_at_real_lengths"] = rollout_cost_report(cfg, opts, mixes)
        report["step_lower_bound"] = step_lower_bound(update, rollout)
    line = json.dumps(report)
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
    f["response_length_mean"] = flags.DEFINE_list(
        "response_length_mean",
        [],
        "Price a step at real lengths: responses of this mean length, long-tailed "
        "(`dvp_jax.length_mix`); a comma-separated list prices each from the one compile.",
    )
    f["response_lengths"] = flags.DEFINE_string(
        "response_lengths",
        "",
        "Price a step at real lengths: a text file of response lengths (ints), in order, "
        "repeated to fill the step.",
    )
    f["prompt_length"] = flags.DEFINE_integer(
        "prompt_length",
        None,
        "With --response_length_mean / --response_lengths: every prompt's length in tokens "
        "(default data.max_prompt_len).",
    )
    f["verbose"] = flags.DEFINE_bool("verbose", False, "Tracebacks for every error.")
    flags.mark_flags_as_required(["config", "topology"])


def run():
    _define_flags()
    parse_flags(sys.argv)
    app.run(main, argv=[sys.argv[0]])


if __name__ == "__main__":
    run()
