"""Per-chip memory plan of a config on a TPU slice, from shapes only (nothing is allocated).

  python -m experiments.scale_plan [--config configs/paper_qwen3_14b.py[:ARG]] \
      [--topology v5p-64] [--set rollout.max_concurrent_decodes=32 ...] [--out plan.json]

Parameters, AdamW moments and the KV cache are built with `jax.eval_shape` and laid out on a
`jax.sharding.AbstractMesh` (no devices needed): each array's PartitionSpec comes from
`Sharder(mesh, rules).spec(names, shape)` exactly as in a real run, and its per-chip bytes are the
shard's shape times the itemsize. The decoder blocks are one stacked entry per parameter
(`blocks.attn.q_proj [L, d, n, h]`, the layer axis replicated, docs/design.md section 3).

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

Activations are estimated from the layout, not traced (a full-size step cannot be traced on CPU
in seconds); every term is printed with its arithmetic. One train micro-batch, sequence T =
max_prompt_len + max_decode_length, rows split over data x fsdp (t tokens per chip), heads,
d_ff and the vocabulary over tensor, activations in the trainer policy's compute dtype:
* the planned layout (what the totals use): the blocks under `nnx.scan` with the config's
  `train.remat` (under "full" the scan keeps only each block's [t, d] input), and a fused
  (flash-style) attention, modelled as keeping no [T, T] scores: only its output and a
  per-head log-sum-exp, its tiles being negligible. The fused kernel is being added
  (`dvp_jax/model/attention.py`); this plan assumes nothing else of it. On top of the saved
  inputs comes the larger of the chunked loss's temporaries and the working set of the one
  block being recomputed (its forward buffers, the gradients in flight, its weights gathered
  over fsdp with the next layer's prefetched, and its weight gradient before the reduce-scatter);
* for comparison, the same with today's einsum attention (one layer's fp32 [T, T] scores,
  probabilities and their gradients live while that block runs), and with no remat at all.
XLA's own choices (fusion, scheduling, fragmentation) are not modelled: the headroom against
HBM is what must absorb them. The fused kernels at hand (cuDNN flash attention, Pallas splash
attention) take 16-bit inputs: under a 32-bit trainer policy (`train.precision="float32"`, the
paper's fp32 trainer) attention runs as einsums, the einsum row is the one that applies, and the
plan says so in a warning.

The trainer runs three phases, each with its own peak: the rollout (trainer state + engine
weights + KV cache), the train step (the decode state, KV cache included, is freed when the
rollout returns; the engine keeps its weights) and the weight sync (old and new engine weights).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import textwrap
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AbstractMesh, PartitionSpec

from dvp_jax.model import Transformer
from dvp_jax.model.attention import CACHE_AXES, KVCache
from dvp_jax.model.config import DTypePolicy, ModelConfig
from dvp_jax.pyfile import load_file
from dvp_jax.rollout.engine import RECORD_FIELDS
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
F32 = 4  # bytes


def gib(b: float) -> str:
    return f"{b / GiB:.2f} GiB"


def term(bytes_: float, arithmetic: str) -> dict:
    """One row of the plan: its per-chip bytes and how they were computed."""
    return dict(bytes=int(bytes_), arithmetic=arithmetic)


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
    """(path, shape, dtype, logical axes) of every parameter; stacked blocks are one entry."""
    rows = []
    for path, var in nnx.to_flat_state(state):
        value = var.get_value()
        names = var.get_metadata().get("logical_axes") or (None,) * len(value.shape)
        rows.append((".".join(map(str, path)), tuple(value.shape), value.dtype, tuple(names)))
    return rows


def _split(n: int, ways: int) -> int:
    """n / ways when `ways` divides n, else n (the Sharder then replicates that dimension)."""
    return n // ways if n % ways == 0 else n


# ------------------------------------------------------------------------------------------------
# Activations of one train micro-batch.
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TrainGeometry:
    """What one chip holds of a train micro-batch (module docstring).

    Attributes:
      seq: T = prompt + response tokens per row.
      micro_batch_rows: rows of one micro-batch over the whole mesh.
      rows: rows per chip (the batch is split over data x fsdp where that divides it).
      heads, kv_heads, d_ff, vocab: n, k, f, V per chip (split over tensor where divisible).
      chunk: C, vocabulary columns per chunk of the chunked loss (<= the local V).
      itemsize: bytes of one activation (the trainer policy's compute dtype).
    """

    seq: int
    micro_batch_rows: int
    rows: int
    heads: int
    kv_heads: int
    d_ff: int
    vocab: int
    chunk: int
    itemsize: int

    @property
    def tokens(self) -> int:
        """t: tokens per chip."""
        return self.rows * self.seq


def train_geometry(cfg: ExperimentConfig, mesh: AbstractMesh, sharder: Sharder) -> TrainGeometry:
    m, tc = cfg.model, cfg.train
    seq = cfg.data.max_prompt_len + cfg.rollout.max_decode_length
    rows_global = tc.prompts_per_step * tc.group_size // tc.updates_per_batch // tc.micro_batches
    act = (rows_global, seq, m.d_model)
    rows = shard_shape(act, sharder.spec(("act_batch", "act_seq", "act_embed"), act), mesh)[0]
    tensor = mesh.shape["tensor"]
    vocab = _split(m.vocab_size, tensor)
    return TrainGeometry(
        seq=seq,
        micro_batch_rows=rows_global,
        rows=rows,
        heads=_split(m.n_heads, tensor),
        kv_heads=_split(m.n_kv_heads, tensor),
        d_ff=_split(m.d_ff, tensor),
        vocab=vocab,
        chunk=min(tc.chunk_size, vocab),
        itemsize=jnp.dtype(DTypePolicy.named(tc.precision).compute_dtype).itemsize,
    )


def activation_terms(m: ModelConfig, g: TrainGeometry, remat: str, fused: bool) -> dict:
    """Per-chip activation bytes of one train micro-batch, term by term with the arithmetic.

    Args:
      m: the architecture (d, L, head_dim, V).
      g: the per-chip geometry (`train_geometry`).
      remat: one of `REMAT_POLICIES`: what the layer scan keeps for the backward pass.
      fused: True for a flash-style attention (no [T, T] scores kept), False for today's einsum
        attention (fp32 scores, probabilities and their two gradients, per layer).
    Returns:
      {"saved", "block", "weights", "loss", "peak"}: each a `term` (bytes and the
      arithmetic); peak = saved + max(loss, block + weights).
    """
    t, d, h, L, a = g.tokens, m.d_model, m.head_dim, m.n_layers, g.itemsize
    n, k, f = g.heads, g.kv_heads, g.d_ff
    sym = f"t={t}, d={d}, n={n}, k={k}, h={h}, f={f} per chip, a={a} B"
    # Everything a block's backward reads besides its input: norm1, x + attn, norm2 [t, d];
    # q raw and roped, the attention output (q-sized); k raw and roped, v (kv-sized);
    # gate, up, silu(gate) * up [t, f]; the fused attention's log-sum-exp [n, t] in fp32.
    res_elems = 3 * d + 3 * (n + k) * h + 3 * f
    residuals = a * t * res_elems + F32 * t * n
    scores = g.rows * n * g.seq**2  # elements of one layer's [rows, n, T, T]
    if remat == "full":
        per_layer, what = a * t * d, "the block input [t, d]"
    elif remat in ("save_dots", "save_dots_no_batch"):
        # Under fused attention both keep the projection and MLP matmul outputs (the kernel's
        # q.k and p.v are not XLA dots); with einsum attention "save_dots" also keeps scores.
        per_layer = a * t * (d + (n + 2 * k) * h + 2 * d + 2 * f)
        what = "input, q/k/v, o_proj and down outputs [t, d + (n+2k)h + 2d + 2f]"
        if remat == "save_dots" and not fused:
            per_layer += F32 * scores
            what += " + fp32 scores"
    else:  # "none": every residual of every layer
        per_layer = a * t * d + residuals
        what = "input + all residuals [t, 4d + 3(n+k)h + 3f] + lse"
        if not fused:
            per_layer += (F32 + a) * scores
            what += " + fp32 scores and probs [rows, n, T, T]"
    if remat == "full":
        saved = term(
            L * per_layer, f"L x t x d x a = {L} x {t} x {d} x {a} B = {gib(L * per_layer)}"
        )
    else:
        saved = term(L * per_layer, f"L x {what} = {L} x {gib(per_layer)} = {gib(L * per_layer)}")
    in_flight = a * t * (2 * d + (n + 2 * k) * h + 2 * f) + F32 * t * n * h
    block_bytes = in_flight + (residuals if remat != "none" else 0)
    block_what = "gradients in flight a t (2d + (n+2k)h + 2f) + fp32 dq t n h"
    if remat != "none":
        block_what = f"forward residuals a t (3d + 3(n+k)h + 3f) + {block_what}"
    if not fused:
        # The layer being differentiated: fp32 scores, probs, d probs, fp32 d scores, and the
        # [rows, T, T] bool causal + padding mask.
        block_bytes += (2 * F32 + 2 * a) * scores + g.rows * g.seq**2
        block_what += (
            f" + [rows, n, T, T] scores, probs and their gradients ({2 * F32 + 2 * a} B each) "
            f"+ the [rows, T, T] bool mask (rows={g.rows}, T={g.seq})"
        )
    block = term(block_bytes, f"{block_what} ({sym}) = {gib(block_bytes)}")

    layer_params = d * (2 * n * h + 2 * k * h + 3 * f)  # one layer's weights per chip
    weights = term(
        layer_params * (2 * a + F32),
        f"one layer's weights gathered over fsdp d(2nh + 2kh + 3f) = {layer_params / 1e6:.1f}M "
        f"x (2 x {a} B, this layer's and the prefetched next + 4 B, its fp32 gradient before "
        f"the reduce-scatter) = {gib(layer_params * (2 * a + F32))}",
    )

    v, c = g.vocab, g.chunk
    loss_parts = [
        (d * v * a, f"W gathered over fsdp [d, V/tensor] = {d} x {v} x {a} B"),
        (d * v * F32, f"dW accumulator fp32 {d} x {v} x 4 B"),
        (3 * t * c * F32, f"3 fp32 [t, C] chunk buffers (z, p/q, dz) = 3 x {t} x {c} x 4 B"),
        (d * c * (a + F32), f"W chunk and its fp32 dW chunk [d, C] = {d} x {c} x ({a} + 4) B"),
        (
            t * d * (3 * a + F32),
            f"last block output, final hidden, its [:, :-1] copy and fp32 dh [t, d] = "
            f"{t} x {d} x (3 x {a} + 4) B",
        ),
    ]
    loss_bytes = sum(b for b, _ in loss_parts)
    loss = term(
        loss_bytes, " + ".join(f"{s} ({gib(b)})" for b, s in loss_parts) + f" = {gib(loss_bytes)}"
    )
    step_work = max(loss_bytes, block_bytes + weights["bytes"])
    which = "loss" if loss_bytes >= block_bytes + weights["bytes"] else "block + weights"
    total = saved["bytes"] + step_work
    peak = term(
        total,
        f"saved {gib(saved['bytes'])} + max(loss "
        f"{gib(loss_bytes)}, block + weights {gib(block_bytes + weights['bytes'])}) [{which}] "
        f"= {gib(total)}",
    )
    return dict(saved=saved, block=block, weights=weights, loss=loss, peak=peak)


# ------------------------------------------------------------------------------------------------
# The plan.
# ------------------------------------------------------------------------------------------------
# What each phase (and each comparison) of `build_plan` adds up.
PHASES = {
    "rollout": "trainer state + engine weights + KV cache + decode",
    "train_step": "trainer state + engine weights + grads + batch + activations",
    "weight_sync": "trainer state + old and new engine weights + bf16 cast",
    "train_step_einsum_attention": "the train step with einsum attention (32-bit policies)",
    "train_step_no_remat_einsum_attention": "... and no remat",
}


def build_plan(cfg: ExperimentConfig, chips: int, chips_per_host: int, hbm_bytes: float) -> dict:
    """Per-chip bytes of every part of each phase, and the parameter layouts."""
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
    m = cfg.model

    # Parameters, trainer (fp32 master copy under every trainer policy) and rollout layouts.
    p_train = param_table(abstract_params(cfg, DTypePolicy.named(cfg.train.precision)))
    p_roll = {
        path: (shape, dt)
        for path, shape, dt, _ in param_table(abstract_params(cfg, rollout_policy))
    }
    layouts: dict[str, dict] = {}
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
        layouts[path] = dict(
            shape=list(shape),
            logical_axes=list(names),
            stacked_layers=shape[0] if names and names[0] == "layers" else 0,
            train_spec=str(ts),
            rollout_spec=str(rs),
            train_bytes_per_chip=tb,
            rollout_bytes_per_chip=rb,
            total_bytes_fp32=math.prod(shape) * 4,
        )

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

    # Rollout: KV cache, the per-slot records of the engine's decode state, decode temporaries.
    slots = cfg.rollout.max_concurrent_decodes
    prompt, response = cfg.data.max_prompt_len, cfg.rollout.max_decode_length
    cache_len = prompt + response
    kv = jax.eval_shape(lambda: KVCache.zeros(m, slots, cache_len, rollout_policy.cache_dtype))
    kv_spec = rollout.spec(CACHE_AXES, kv.k.shape)
    kv_bytes = 2 * per_device_bytes(kv.k.shape, kv.k.dtype, kv_spec, rollout_mesh)
    kv_item = jnp.dtype(kv.k.dtype).itemsize
    k_r, n_r, f_r = (_split(x, tp) for x in (m.n_kv_heads, m.n_heads, m.d_ff))
    ra = jnp.dtype(rollout_policy.compute_dtype).itemsize
    records = slots * (response * len(RECORD_FIELDS) + m.vocab_size) * 4  # replicated
    # One decode step: the sampler's [slots, V] fp32 buffers (scaled logits, exponentials,
    # race keys, mask) and one layer's [slots, n, S] fp32 scores and probabilities.
    decode_tmp = slots * (4 * m.vocab_size + 2 * n_r * cache_len) * F32
    # One prompt's prefix cache in flight (its G inserts done, it is dropped) and the prefill of
    # one max-length prompt (fused attention, its [P, d] and [P, f] buffers).
    prefix = 2 * m.n_layers * prompt * k_r * m.head_dim * kv_item
    prefill = prompt * (6 * m.d_model + 3 * (n_r + 2 * k_r) * m.head_dim + 3 * f_r) * ra

    # Train step.
    geo = train_geometry(cfg, train_mesh, train)
    remat = cfg.train.remat
    planned = activation_terms(m, geo, remat, fused=True)
    einsum_attn = activation_terms(m, geo, remat, fused=False)
    no_remat = activation_terms(m, geo, "none", fused=False)
    n_batch = cfg.train.prompts_per_step * cfg.train.group_size // cfg.train.updates_per_batch
    batch_rows = shard_shape(
        (n_batch, geo.seq), train.spec(("act_batch", None), (n_batch, geo.seq)), train_mesh
    )[0]
    # RLBatch per row-token: tokens, positions int32, valid bool; response_mask bool, 5 fp32
    # (behaviour_logp, _full, _pruned_mass, _safe_size, old_logp), old_in_safe bool; plus the
    # scan's stacked TokenLogprobs and PositionStats (7 x 4 B).
    per_token = 4 + 4 + 1 + 1 + 5 * 4 + 1 + 7 * 4
    batch_bytes = batch_rows * geo.seq * per_token

    pt, pr = totals["params_train"], totals["params_rollout"]
    n_chips = math.prod(train_mesh.shape.values())
    parts = {
        "trainer params (fp32)": term(
            pt,
            f"{totals['params'] / 1e9:.2f}B x 4 B, split over fsdp x tensor "
            f"({n_chips} ways; norms replicated) = {gib(pt)}",
        ),
        "optimizer state (AdamW mu + nu)": term(
            opt_bytes, f"2 x the params' layout + step counters = {gib(opt_bytes)}"
        ),
        f"rollout params ({cfg.rollout.dtype})": term(
            pr,
            f"{totals['params'] / 1e9:.2f}B x {jnp.dtype(rollout_policy.param_dtype).itemsize} B"
            f" / tensor={tp} (embed dims replicated) = {gib(pr)}",
        ),
        f"KV cache ({slots} slots x {cache_len}, {jnp.dtype(kv.k.dtype).name})": term(
            kv_bytes,
            f"2 (k, v) x L={m.n_layers} x slots={slots} x (prompt {prompt} + response "
            f"{response}) x kv_heads {m.n_kv_heads}/tensor {tp} x h={m.head_dim} x {kv_item} B "
            f"= {gib(kv_bytes)}",
        ),
        "decode records + pending logits": term(
            records,
            f"slots x ({len(RECORD_FIELDS)} records x {response} + V={m.vocab_size}) x 4 B, "
            f"replicated = {gib(records)}",
        ),
        "decode step temporaries": term(
            decode_tmp,
            f"slots x (4 x V + 2 x n {n_r} x S {cache_len}) x 4 B = {gib(decode_tmp)}",
        ),
        "prefix in flight + prefill": term(
            prefix + prefill,
            f"2 x L x P={prompt} x k {k_r} x h x {kv_item} B + P (6d + 3(n+2k)h + 3f) x {ra} B"
            f" = {gib(prefix + prefill)}",
        ),
        "gradients (accumulator + micro-batch)": term(
            2 * pt, f"2 x the fp32 params' layout = {gib(2 * pt)}"
        ),
        "batch on device (RLBatch + per-token outputs)": term(
            batch_bytes,
            f"{batch_rows} rows x T={geo.seq} x {per_token} B = {gib(batch_bytes)}",
        ),
        "activations: saved by the layer scan": planned["saved"],
        "activations: one block, recomputed + backward": planned["block"],
        "activations: one layer's gathered weights": planned["weights"],
        "activations: chunked loss temporaries": planned["loss"],
        "activations, planned peak": planned["peak"],
        "activations, einsum attention, peak": einsum_attn["peak"],
        "activations, no remat + einsum attention, peak": no_remat["peak"],
    }
    b = {name: p["bytes"] for name, p in parts.items()}
    state = pt + opt_bytes
    kv_name = next(n for n in parts if n.startswith("KV cache"))
    rollout_phase = state + pr + b[kv_name] + records + decode_tmp + b["prefix in flight + prefill"]
    train_base = state + pr + 2 * pt + batch_bytes
    phases = {
        "rollout": rollout_phase,
        "train_step": train_base + planned["peak"]["bytes"],
        "weight_sync": state + 2 * pr + pt // 2,
    }
    peak_phase = max(phases, key=phases.get)
    warnings = []
    row_ways = train_mesh.shape["data"] * train_mesh.shape["fsdp"]
    if geo.rows * row_ways != geo.micro_batch_rows:
        warnings.append(
            f"a micro-batch's {geo.micro_batch_rows} rows do not split over data x fsdp = "
            f"{row_ways}: each chip holds {geo.rows} rows (set config.train.micro_batches so "
            f"that prompts_per_step * group_size / (updates_per_batch * micro_batches) is a "
            f"multiple of {row_ways})"
        )
    if geo.itemsize > 2:
        warnings.append(
            f"train.precision={cfg.train.precision!r} computes in {8 * geo.itemsize}-bit: the "
            "fused attention kernels (cuDNN flash attention, Pallas splash attention) take "
            "16-bit inputs, so this trainer runs the einsum attention and the "
            "train_step_einsum_attention row is the one that applies (or train with "
            "train.precision='mixed_bf16')"
        )
    compare = {
        "train_step_einsum_attention": train_base + einsum_attn["peak"]["bytes"],
        "train_step_no_remat_einsum_attention": train_base + no_remat["peak"]["bytes"],
    }
    return dict(
        config=dict(method=cfg.method, model=dataclasses.asdict(m)),
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
        train=dict(
            precision=cfg.train.precision,
            remat=remat,
            attention="fused (flash-style): no [T, T] scores kept",
            **dataclasses.asdict(geo),
            tokens_per_chip=geo.tokens,
        ),
        per_chip_bytes=b,
        arithmetic={name: p["arithmetic"] for name, p in parts.items()},
        phases=phases,
        peak_phase=peak_phase,
        peak_bytes=phases[peak_phase],
        fits=phases[peak_phase] <= hbm_bytes,
        comparison=compare,
        warnings=warnings,
        parameter_layouts=layouts,
    )


# ------------------------------------------------------------------------------------------------
# Output.
# ------------------------------------------------------------------------------------------------
def format_plan(plan: dict) -> str:
    hbm = plan["hbm_bytes_per_chip"]
    tr, m = plan["train"], plan["config"]["model"]
    lines = [
        f"{plan['num_params'] / 1e9:.2f}B parameters ({m['n_layers']} layers, d={m['d_model']}, "
        f"V={m['vocab_size']}) on {plan['chips']} chips ({plan['hosts']} hosts x "
        f"{plan['chips_per_host']}); train mesh {plan['train_mesh']}, rollout mesh (per host) "
        f"{plan['rollout_mesh']}; HBM {hbm / 1e9:.0f} GB = {hbm / GiB:.1f} GiB per chip",
        f"train micro-batch: {tr['micro_batch_rows']} rows x T={tr['seq']}, {tr['rows']} row(s) "
        f"= {tr['tokens_per_chip']} tokens per chip; policy {tr['precision']} "
        f"({tr['itemsize']} B activations), remat {tr['remat']!r}, attention {tr['attention']}",
        "",
        f"{'per chip (each row: its arithmetic below it)':<58}{'GiB':>9}{'HBM':>7}",
    ]
    for name, b in plan["per_chip_bytes"].items():
        lines.append(f"{name:<58}{b / GiB:>9.2f}{100 * b / hbm:>6.0f}%")
        lines += textwrap.wrap(
            plan["arithmetic"][name], 100, initial_indent="    ", subsequent_indent="      "
        )
    lines += ["", f"{'phase: the rows it holds':<86}{'GiB':>9}{'HBM':>7}"]
    for name, b in {**plan["phases"], **plan["comparison"]}.items():
        mark = "  <- peak" if name == plan["peak_phase"] else ""
        label = f"{name}: {PHASES[name]}"
        lines.append(f"{label:<86}{b / GiB:>9.2f}{100 * b / hbm:>6.0f}%{mark}")
    verdict = "fits" if plan["fits"] else "does NOT fit"
    lines += [
        f"PEAK {plan['peak_bytes'] / GiB:.2f} GiB of {hbm / GiB:.1f} GiB: {verdict} "
        f"({plan['peak_phase']})",
        *(f"WARNING: {w}" for w in plan["warnings"]),
        f"KV cache {plan['kv_cache_shape']} spec {plan['kv_cache_spec']}",
        "",
        f"{'parameter':<30}{'shape':<24}{'train spec':<34}{'GiB/chip':>9}  "
        f"{'rollout spec':<34}{'GiB/chip':>9}",
    ]
    for path, k in plan["parameter_layouts"].items():
        lines.append(
            f"{path:<30}{str(tuple(k['shape'])):<24}{k['train_spec']:<34}"
            f"{k['train_bytes_per_chip'] / GiB:>9.3f}  {k['rollout_spec']:<34}"
            f"{k['rollout_bytes_per_chip'] / GiB:>9.3f}"
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
