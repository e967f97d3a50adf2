"""Per-chip memory plan of a config on a TPU slice, from shapes only (nothing is allocated).

  python -m experiments.scale_plan [--config configs/paper_qwen3_14b.py[:ARG]] \
      [--topology v5p-64] [--set rollout.max_concurrent_decodes=32 ...] [--out plan.json]

The trainer state is built with `jax.eval_shape` and laid out on a `jax.sharding.AbstractMesh`
(no devices needed): each array's PartitionSpec comes from `Sharder(mesh, rules).spec(names,
shape)` exactly as in a real run, and its per-chip bytes are the shard's shape times the itemsize.

Two meshes, as the trainer builds them (dvp_jax/train/trainer.py):
* train: the config's `mesh` over every chip of the slice, TRAIN_RULES (ZeRO-3: parameters and
  AdamW moments split over fsdp x tensor, activations over the batch on data x fsdp);
* rollout: one JetStream engine per host on `(1, 1, rollout.tensor_parallel)` local chips,
  ROLLOUT_RULES (bf16 weights split over tensor only, KV cache over slots and KV heads).

v5p-64 is 32 chips (the suffix counts TensorCores; JAX sees one device per chip in megacore
mode), 4 chips and one process per host, 8 hosts, 95 GB HBM per chip (Cloud TPU v5p docs). The
paper config's train mesh is (data, fsdp, tensor) = (1, 8, 4): tensor=4 divides the 40 query
heads, the 8 KV heads, d_ff and the vocabulary, and matches the 4-chip host the rollout engine
uses; fsdp=8 takes the rest (params and moments are still split 32 ways); data=1 since with one
slice there is no slower network for a separate data axis to hide.

Activations are estimated, not traced (a full-size train step cannot be traced on CPU in
seconds). Two variants, both per micro-batch, fp32 compute (the trainer policy), sequence
T = max_prompt_len + max_decode_length, rows split over data x fsdp, heads / d_ff over tensor:
* planned: every decoder block rematerialised (only its [t, d] input saved; `train.remat`, which
  the paper config sets) and a flash-style attention that never materialises the [heads, T, T]
  scores (not implemented yet: attention is plain einsum + softmax); the working set of the one
  block being recomputed (forward + backward) and of the chunked loss (`train.chunk_size` columns of
  fp32 logits, forward + recompute + gradient) comes on top;
* no remat: no rematerialisation, attention scores and probabilities materialised in fp32 and
  kept for the backward pass (the code with `train.remat=False`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AbstractMesh, PartitionSpec

from dvp_jax.model import Transformer
from dvp_jax.model.attention import CACHE_AXES, KVCache
from dvp_jax.model.config import DTypePolicy
from dvp_jax.pyfile import load_file
from dvp_jax.sharding import MESH_AXES, ROLLOUT_RULES, TRAIN_RULES, Sharder
from dvp_jax.train.config import ExperimentConfig
from dvp_jax.train.state import make_optimizer
from experiments.launch import REPO, parse_assignments

GiB = 2**30
# name: (chips, chips per host, HBM bytes per chip). Cloud TPU docs; v5p/v4 suffixes count cores.
TOPOLOGIES = {
    "v5p-8": (4, 4, 95e9),
    "v5p-16": (8, 4, 95e9),
    "v5p-32": (16, 4, 95e9),
    "v5p-64": (32, 4, 95e9),
    "v5p-128": (64, 4, 95e9),
    "v5p-256": (128, 4, 95e9),
    "v5e-64": (64, 4, 16e9),
    "v6e-64": (64, 4, 32e9),
}
HF_VOCAB = 151_936  # Qwen3 tokenizers (the brief's value for configs with a tokenizer.json)


# ------------------------------------------------------------------------------------------------
# Shapes and shards.
# ------------------------------------------------------------------------------------------------
def shard_shape(shape, spec: PartitionSpec, mesh: AbstractMesh) -> tuple[int, ...]:
    """The per-device block of an array of `shape` laid out by `spec` on `mesh`."""
    out = []
    for i, dim in enumerate(shape):
        axes = spec[i] if i < len(spec) else None
        axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        n = math.prod(mesh.shape[a] for a in axes)
        out.append(-(-dim // n))
    return tuple(out)


def per_device_bytes(shape, dtype, spec: PartitionSpec, mesh: AbstractMesh) -> int:
    return math.prod(shard_shape(shape, spec, mesh)) * jnp.dtype(dtype).itemsize


def abstract_params(cfg: ExperimentConfig, policy: DTypePolicy) -> nnx.State:
    """The model's parameters as ShapeDtypeStructs carrying their logical axes."""
    model = nnx.eval_shape(lambda: Transformer(cfg.model, policy, Sharder(), rngs=nnx.Rngs(0)))
    return nnx.state(model, nnx.Param)


def param_table(state: nnx.State) -> list[tuple[str, tuple[int, ...], Any, tuple]]:
    """(path, shape, dtype, logical axes) of every parameter."""
    rows = []
    for path, var in nnx.to_flat_state(state):
        value = var.get_value()
        names = var.get_metadata().get("logical_axes") or (None,) * len(value.shape)
        rows.append((".".join(map(str, path)), tuple(value.shape), value.dtype, tuple(names)))
    return rows


def kind_of(path: str) -> str:
    """`layers.7.attn.q_proj` -> `layers.*.attn.q_proj` (one row per parameter kind)."""
    return ".".join("*" if p.isdigit() else p for p in path.split("."))


# ------------------------------------------------------------------------------------------------
# The plan.
# ------------------------------------------------------------------------------------------------
def activation_bytes(cfg: ExperimentConfig, mesh: AbstractMesh, sharder: Sharder) -> dict:
    """Estimated per-chip activation bytes of one train micro-batch (see the module docstring)."""
    m, t_cfg = cfg.model, cfg.train
    seq = cfg.data.max_prompt_len + cfg.rollout.max_decode_length
    rows_global = t_cfg.prompts_per_step * t_cfg.group_size // t_cfg.micro_batches
    act = (rows_global, seq, m.d_model)
    rows = shard_shape(act, sharder.spec(("act_batch", "act_seq", "act_embed"), act), mesh)[0]
    tensor = mesh.shape["tensor"]
    n_c = m.n_heads // tensor if m.n_heads % tensor == 0 else m.n_heads
    k_c = m.n_kv_heads // tensor if m.n_kv_heads % tensor == 0 else m.n_kv_heads
    f_c = m.d_ff // tensor if m.d_ff % tensor == 0 else m.d_ff
    t = rows * seq  # tokens on one chip
    f32 = 4
    qkv = t * (n_c + 2 * k_c) * m.head_dim
    block_in = t * m.d_model * f32
    loss = (2 * t * m.d_model + 3 * t * min(t_cfg.chunk_size, m.vocab_size)) * f32
    # One block, forward + backward: ~6 residual-stream [t, d] buffers, q/k/v and their
    # gradients, the attention output and its gradient, ~6 [t, f] MLP buffers.
    block_work = (6 * t * m.d_model + 2 * qkv + 2 * t * n_c * m.head_dim + 6 * t * f_c) * f32
    planned = m.n_layers * block_in + block_work + loss
    # No remat: per layer ~5 [t, d] buffers, q/k/v before and after norm/RoPE, scores and
    # probabilities [rows, heads, T, T], 4 [t, f] MLP buffers, all kept for the backward pass.
    scores = rows * n_c * seq * seq * f32
    per_layer = (5 * t * m.d_model + 2 * qkv + 4 * t * f_c) * f32 + 2 * scores
    current = m.n_layers * per_layer + loss
    return dict(
        rows_per_chip=rows,
        seq_len=seq,
        tokens_per_chip=t,
        micro_batch_rows=rows_global,
        planned=planned,
        current=current,
        attention_scores_per_layer=2 * scores,
    )


def build_plan(cfg: ExperimentConfig, chips: int, chips_per_host: int, hbm_bytes: float) -> dict:
    """Per-chip bytes of every part of the train and rollout state, and the parameter layouts."""
    train_mesh = AbstractMesh(cfg.mesh.shape(chips), MESH_AXES)
    tp = cfg.rollout.tensor_parallel
    if tp > chips_per_host:
        raise ValueError(
            f"config.rollout.tensor_parallel={tp} exceeds the {chips_per_host} "
            "chips of a host (the engine uses local devices only)"
        )
    rollout_mesh = AbstractMesh((1, 1, tp), MESH_AXES)
    train = Sharder(train_mesh, TRAIN_RULES)
    rollout = Sharder(rollout_mesh, ROLLOUT_RULES)
    rollout_policy = DTypePolicy.named(cfg.rollout.dtype)

    # Parameters, trainer (fp32) and rollout (bf16) layouts.
    p_train = param_table(abstract_params(cfg, DTypePolicy.named("float32")))
    p_roll = {
        path: (shape, dt)
        for path, shape, dt, _ in param_table(abstract_params(cfg, rollout_policy))
    }
    kinds: dict[str, dict] = {}
    totals = dict(params=0, params_train=0, params_rollout=0, params_rollout_total=0)
    param_specs = {}
    for path, shape, dtype, names in p_train:
        ts, rs = train.spec(names, shape), rollout.spec(names, shape)
        param_specs[path] = ts
        tb = per_device_bytes(shape, dtype, ts, train_mesh)
        r_shape, r_dtype = p_roll[path]
        rb = per_device_bytes(r_shape, r_dtype, rs, rollout_mesh)
        totals["params"] += math.prod(shape)
        totals["params_train"] += tb
        totals["params_rollout"] += rb
        totals["params_rollout_total"] += math.prod(r_shape) * jnp.dtype(r_dtype).itemsize
        k = kinds.setdefault(
            kind_of(path),
            dict(
                shape=list(shape),
                logical_axes=list(names),
                count=0,
                train_spec=str(ts),
                rollout_spec=str(rs),
                train_bytes_per_chip=tb,
                rollout_bytes_per_chip=rb,
                total_bytes_fp32=math.prod(shape) * 4,
            ),
        )
        k["count"] += 1

    # AdamW moments, sharded like the parameters they track (as init_train_state does).
    optimizer = make_optimizer(1e-6, 0, 0.0, 1.0)
    flat_params = {p: jax.ShapeDtypeStruct(s, d) for p, s, d, _ in p_train}
    opt_state = jax.eval_shape(optimizer.init, flat_params)
    opt_specs = optax.tree_map_params(
        optimizer,
        lambda _, spec: spec,
        opt_state,
        param_specs,
        transform_non_params=lambda _: PartitionSpec(),
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )
    opt_bytes = sum(
        per_device_bytes(leaf.shape, leaf.dtype, spec, train_mesh)
        for leaf, spec in zip(
            jax.tree.leaves(opt_state),
            jax.tree.leaves(opt_specs, is_leaf=lambda x: isinstance(x, PartitionSpec)),
            strict=True,
        )
    )

    # Rollout: KV cache and the per-slot records of the engine's decode state.
    slots = cfg.rollout.max_concurrent_decodes
    cache_len = cfg.data.max_prompt_len + cfg.rollout.max_decode_length
    kv = jax.eval_shape(
        lambda: KVCache.zeros(cfg.model, slots, cache_len, rollout_policy.cache_dtype)
    )
    kv_spec = rollout.spec(CACHE_AXES, kv.k.shape)
    kv_bytes = 2 * per_device_bytes(kv.k.shape, kv.k.dtype, kv_spec, rollout_mesh)
    records = slots * (cfg.rollout.max_decode_length * 5 + cfg.model.vocab_size) * 4  # replicated

    act = activation_bytes(cfg, train_mesh, train)
    grads = 2 * totals["params_train"]  # the accumulator plus one micro-batch's gradient
    trainer_state = totals["params_train"] + opt_bytes
    engine = totals["params_rollout"] + kv_bytes + records
    rows = {
        "trainer params (fp32)": totals["params_train"],
        "optimizer state (AdamW mu + nu)": opt_bytes,
        "gradients (accumulator + micro-batch)": grads,
        "activations, planned (block remat + flash attention)": act["planned"],
        "activations, no remat (T x T scores kept)": act["current"],
        f"rollout params ({cfg.rollout.dtype})": totals["params_rollout"],
        f"KV cache ({slots} slots x {cache_len}, {jnp.dtype(kv.k.dtype).name})": kv_bytes,
        "decode records + pending logits": records,
        "PEAK rollout (trainer state + engine)": trainer_state + engine,
        "PEAK train step, planned, engine freed": trainer_state + grads + act["planned"],
        "PEAK train step, planned, engine kept": trainer_state + grads + act["planned"] + engine,
    }
    return dict(
        config=dict(method=cfg.method, model=dataclasses.asdict(cfg.model)),
        chips=chips,
        chips_per_host=chips_per_host,
        hosts=chips // chips_per_host,
        hbm_bytes_per_chip=hbm_bytes,
        train_mesh=dict(train_mesh.shape),
        rollout_mesh=dict(rollout_mesh.shape),
        num_params=totals["params"],
        rollout_params_total_bytes=totals["params_rollout_total"],
        kv_cache_spec=str(kv_spec),
        kv_cache_shape=list(kv.k.shape),
        activations=act,
        per_chip_bytes=rows,
        parameter_layouts=kinds,
    )


# ------------------------------------------------------------------------------------------------
# Output.
# ------------------------------------------------------------------------------------------------
def format_plan(plan: dict) -> str:
    hbm = plan["hbm_bytes_per_chip"]
    lines = [
        f"{plan['num_params'] / 1e9:.2f}B parameters on {plan['chips']} chips "
        f"({plan['hosts']} hosts x {plan['chips_per_host']}); train mesh {plan['train_mesh']}, "
        f"rollout mesh (per host) {plan['rollout_mesh']}; HBM {hbm / GiB:.1f} GiB per chip",
        "",
        f"{'per chip':<58}{'GiB':>9}{'HBM':>7}",
    ]
    for name, b in plan["per_chip_bytes"].items():
        lines.append(f"{name:<58}{b / GiB:>9.2f}{100 * b / hbm:>7.0f}%")
    a = plan["activations"]
    lines += [
        f"(activations: micro-batch {a['micro_batch_rows']} rows x T={a['seq_len']}, "
        f"{a['rows_per_chip']} row(s) = {a['tokens_per_chip']} tokens per chip; attention "
        f"scores + probs per layer today: {a['attention_scores_per_layer'] / GiB:.1f} GiB)",
        f"KV cache {plan['kv_cache_shape']} spec {plan['kv_cache_spec']}",
        "",
        f"{'parameter kind':<32}{'shape':<20}{'x':>4}  {'train spec':<28}{'GiB/chip':>9}  "
        f"{'rollout spec':<28}{'GiB/chip':>9}",
    ]
    for kind, k in plan["parameter_layouts"].items():
        lines.append(
            f"{kind:<32}{str(tuple(k['shape'])):<20}{k['count']:>4}  {k['train_spec']:<28}"
            f"{k['count'] * k['train_bytes_per_chip'] / GiB:>9.3f}  {k['rollout_spec']:<28}"
            f"{k['count'] * k['rollout_bytes_per_chip'] / GiB:>9.3f}"
        )
    return "\n".join(lines)


def load_config(spec: str, overrides: list[str]):
    """`path[:arg]` -> ConfigDict, with `key=value` overrides (values parsed as Python literals)."""
    path, _, arg = spec.partition(":")
    module = load_file(path)
    cd = module.get_config(arg) if arg else module.get_config()
    cd.lock()  # as main.py does: an override of an undeclared field fails
    cd.update_from_flattened_dict(parse_assignments(overrides, what="--set"))
    return cd


def tokenizer_vocab(spec: str) -> int:
    if spec == "char":
        from dvp_jax.rollout.tokenizers import CharTokenizer

        return CharTokenizer().vocab_size
    return HF_VOCAB  # a tokenizer.json path: not read (it need not exist on this machine)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=os.path.join(REPO, "configs", "paper_qwen3_14b.py"))
    p.add_argument("--topology", default="v5p-64", choices=sorted(TOPOLOGIES))
    p.add_argument("--chips", type=int, default=None, help="override the topology's chip count")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override, e.g. rollout.max_concurrent_decodes=32 (repeatable)",
    )
    p.add_argument("--out", default=None, help="write the plan as JSON here")
    args = p.parse_args(argv)
    chips, per_host, hbm = TOPOLOGIES[args.topology]
    chips = args.chips or chips
    cd = load_config(args.config, args.set)
    cfg = ExperimentConfig.from_config_dict(cd, tokenizer_vocab(cd.data.tokenizer))
    plan = build_plan(cfg, chips, per_host, hbm)
    plan["topology"] = args.topology
    print(format_plan(plan))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                plan,
                f,
                indent=1,
                default=lambda o: o.item() if isinstance(o, np.generic) else str(o),
            )
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
