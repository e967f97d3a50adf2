"""The trainer's compiled programs, built by one function for a run and for the TPU compile.

`trainer_programs` jits what a run calls on its devices: the RL update on the packed rows of one
update (`step.rl_update`, the state donated), the forward alone when the config needs log-probs
before an update (`step.batch_logprobs`: the decoupled PPO's old policy, E9; the KL reference,
E11) and the supervised warm-up's step (`sft.sft_step`) when it has one. `build.build_parts`
builds a run's with it and `dvp_jax.aot` compiles exactly these for a TPU topology, with the
same optimizer (`train_optimizer`, `sft.sft_optimizer`), the same layout of rows
(`update_layout`) and the same shardings, so the compile check cannot drift from the run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import optax

from dvp_jax.rollout.state import EngineConfig
from dvp_jax.sharding import Sharder
from dvp_jax.train import batch as batch_lib
from dvp_jax.train import sft
from dvp_jax.train import step as step_lib
from dvp_jax.train.config import ExperimentConfig
from dvp_jax.train.packing import Layout, make_layout
from dvp_jax.train.sections import TrainConfig
from dvp_jax.train.state import make_optimizer


def train_optimizer(t: TrainConfig) -> optax.GradientTransformation:
    """The RL optimizer of `train.*` (AdamW, `state.make_optimizer`)."""
    return make_optimizer(t.learning_rate, t.warmup_steps, t.weight_decay, t.grad_clip, t.b1, t.b2)


def update_layout(cfg: ExperimentConfig, hosts: int) -> Layout:
    """One update's rows on each of `hosts` hosts: its share of the step's responses, cut into
    `train.updates_per_batch` updates, packed (`train.packing`) into rows of `train.row_length`
    tokens in `train.micro_batches` micro-batches."""
    t = cfg.train
    per_host = t.prompts_per_step // hosts * t.group_size
    return make_layout(
        sequences=-(-per_host // t.updates_per_batch),
        longest=cfg.sequence_length,
        row_length=t.row_length,
        micro_batches=t.micro_batches,
        packed=t.packing,
    )


def needs_logprobs(cfg: ExperimentConfig) -> bool:
    """Whether a run computes log-probs before its updates (PPO's old policy, the KL
    reference)."""
    return cfg.train.updates_per_batch > 1 or cfg.loss.uses_reference


@dataclasses.dataclass(frozen=True)
class TrainerPrograms:
    """A run's trainer programs (module docstring) and the batch they take.

    Attributes:
      layout: one update's rows on one host.
      batch: the global batch of one update, `jax.ShapeDtypeStruct`s with their shardings.
      batch_shardings: of that batch (None without a mesh).
      update: (state, batch) -> (state, metrics), the state donated.
      logprobs: (params, `step.logprob_inputs(batch)`) -> `TokenLogprobs`; None when the config
        needs none (`needs_logprobs`).
      sft_step: (sft state, (tokens, loss mask, lengths)) -> (state, metrics); None without a
        warm-up.
    """

    layout: Layout
    batch: Any
    batch_shardings: Any
    update: Callable
    logprobs: Callable | None
    sft_step: Callable | None


def trainer_programs(
    cfg: ExperimentConfig,
    sharder: Sharder,
    graphdef,
    optimizer: optax.GradientTransformation,
    state_shardings,
    hosts: int,
) -> TrainerPrograms:
    """The jitted programs of a run whose trainer has `graphdef`, `optimizer` and its state laid
    out as `state_shardings` on `sharder`'s mesh, over `hosts` hosts."""
    t = cfg.train
    layout = update_layout(cfg, hosts)
    batch = batch_lib.abstract_batch(
        layout.rows * hosts,
        layout.row_length,
        cfg.loss.uses_reference,
        EngineConfig.truncation_width(cfg.rollout),  # E13's kept ids per token (0: none)
        ages=cfg.rollout.partial,
    )
    batch_sh = batch_lib.batch_shardings(batch, sharder)
    if batch_sh is not None:
        batch = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), batch, batch_sh
        )
    per_row = layout.sequences_per_row if layout.packed else None
    common = dict(
        graphdef=graphdef,
        loss_cfg=cfg.loss,
        chunk_size=t.chunk_size,
        micro_batches=layout.micro_batches,
        sequences_per_row=per_row,
        batch_shardings=batch_sh,
        sharder=sharder,
    )
    update = step_lib.jit_rl_update(optimizer=optimizer, state_shardings=state_shardings, **common)
    logprobs = None
    if needs_logprobs(cfg):
        params_sh = None if state_shardings is None else state_shardings.params
        logprobs = step_lib.jit_batch_logprobs(param_shardings=params_sh, **common)
    sft_step = None
    if cfg.sft.steps > 0:
        sft_step = sft.jit_sft_step(graphdef, sft.sft_optimizer(cfg.sft), t.chunk_size, sharder)
    return TrainerPrograms(layout, batch, batch_sh, update, logprobs, sft_step)
