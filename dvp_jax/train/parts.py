"""What one RL run is built from, built once: `build_parts(cfg) -> (RunParts, TrainState)`.

The order is the order of failure cost: the config's host shares, the tokenizer and the data
(a bad data file fails in a second, not after a model init), then the mesh, the trainer model
and its train state, the rollout and evaluation engines, and the trainer's jitted programs
(`programs.trainer_programs`, which `dvp_jax.aot` compiles too). Not here: the workdir, the
checkpoints and the outputs (`trainer.Trainer`), the loop.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from absl import logging
from flax import nnx

from dvp_jax.data import pipeline
from dvp_jax.data.tasks import GeneratedTask
from dvp_jax.errors import ConfigError, DataError
from dvp_jax.rollout.engine import RolloutEngine
from dvp_jax.sharding import TRAIN_RULES, Sharder, make_mesh
from dvp_jax.train import evaluation
from dvp_jax.train.builders import build_engine, build_model, load_run_tokenizer
from dvp_jax.train.config import ExperimentConfig
from dvp_jax.train.packing import Layout
from dvp_jax.train.programs import train_optimizer, trainer_programs
from dvp_jax.train.state import TrainState, init_train_state


@dataclasses.dataclass(frozen=True)
class RunParts:
    """The fixed parts of a run; the train state, which every step replaces, is kept apart.

    Attributes:
      tokenizer, task: the run's tokenizer and generated task (None for a math file).
      data: this host's prompt iterator (checkpointed with the state); heldout: the
        validation sets (`evaluation.heldout_sets`).
      mesh, sharder, graphdef, optimizer, state_shardings: the trainer side.
      engine, eval_engine: the rollout engine and the evaluation engine (the same object
        unless `eval.dtype` asks for another precision); sync_dtype: the widest param dtype of
        the two, at which a multi-host weight sync gathers.
      layout: one update's rows on this host (`packing.Layout`).
      batch_shardings: of one update's global (mini-)batch.
      update: `step.rl_update` jitted with the state donated: (state, batch) -> (state, metrics).
      logprobs: jitted (params, `step.logprob_inputs(batch)`) -> `TokenLogprobs` of the policy
        before an update (the decoupled PPO clip, `train.updates_per_batch > 1`) and of the
        frozen reference (the KL term, `loss.kl_coef > 0`); None when neither is on.
      sft_step: the warm-up's jitted step (None without a warm-up).
    """

    tokenizer: Any
    task: GeneratedTask | None
    data: pipeline.PromptIterator
    heldout: list[evaluation.HeldoutSet]
    mesh: jax.sharding.Mesh | None
    sharder: Sharder
    graphdef: nnx.GraphDef
    optimizer: optax.GradientTransformation
    state_shardings: Any
    engine: RolloutEngine
    eval_engine: RolloutEngine
    sync_dtype: Any
    layout: Layout
    batch_shardings: Any
    update: Callable
    logprobs: Callable | None
    sft_step: Callable | None


def build_parts(cfg: ExperimentConfig) -> tuple[RunParts, TrainState]:
    """The parts of a run and its initial train state (see the module docstring)."""
    _check_host_shares(cfg)
    tokenizer = load_run_tokenizer(cfg.data.tokenizer)
    task = cfg.data.make_task()
    data, heldout = _load_data(cfg, task, tokenizer)

    try:
        mesh = make_mesh(cfg.mesh)
    except ValueError as e:  # a mesh shape the devices do not fill
        raise ConfigError(f"config.mesh: {e}") from e
    sharder = Sharder(mesh, TRAIN_RULES)
    model = build_model(cfg, sharder)
    t = cfg.train
    optimizer = train_optimizer(t)
    reference_dtype = cfg.loss.kl_reference_dtype if cfg.loss.uses_reference else None
    graphdef, state, state_sh = init_train_state(model, optimizer, t.seed, sharder, reference_dtype)

    engine = eval_engine = build_engine(cfg, tokenizer, model)
    if cfg.eval.dtype and cfg.eval.dtype != cfg.rollout.dtype:
        eval_engine = build_engine(cfg, tokenizer, model, cfg.eval.dtype)
    sync_dtype = jnp.promote_types(engine.policy.param_dtype, eval_engine.policy.param_dtype)
    programs = trainer_programs(cfg, sharder, graphdef, optimizer, state_sh, jax.process_count())
    parts = RunParts(
        tokenizer=tokenizer,
        task=task,
        data=data,
        heldout=heldout,
        mesh=mesh,
        sharder=sharder,
        graphdef=graphdef,
        optimizer=optimizer,
        state_shardings=state_sh,
        engine=engine,
        eval_engine=eval_engine,
        sync_dtype=sync_dtype,
        layout=programs.layout,
        batch_shardings=programs.batch_shardings,
        update=programs.update,
        logprobs=programs.logprobs,
        sft_step=programs.sft_step,
    )
    return parts, state


def _check_host_shares(cfg: ExperimentConfig) -> None:
    """Each host takes an equal share of every batch."""
    for name, value in [
        ("train.prompts_per_step", cfg.train.prompts_per_step),
        ("sft.batch_size", cfg.sft.batch_size if cfg.sft.steps else 0),
    ]:
        if value % jax.process_count():
            raise ConfigError(
                f"config.{name}={value} must be divisible by the number of processes "
                f"({jax.process_count()}): each host takes an equal share of the batch"
            )


def _load_data(cfg: ExperimentConfig, task, tokenizer):
    """This host's prompt iterator (the task, or the math file) and the held-out prompts."""
    try:
        data = pipeline.make_prompt_iterator(
            task if task is not None else cfg.data.path,
            tokenizer,
            batch_size=cfg.train.prompts_per_step // jax.process_count(),
            max_prompt_len=cfg.data.max_prompt_len,
            seed=cfg.data.seed,
            chat_format=cfg.data.chat_format,
            fields=cfg.data.fields,
        )
    except (OSError, ValueError) as e:  # pyarrow's errors are ValueErrors too
        raise DataError(f"config.data.path: {e}") from e
    if data.report is not None:
        logging.info("data: %s", data.report.summary())
    heldout = evaluation.heldout_sets(cfg.data, cfg.eval, task, tokenizer)  # raises DataError
    return data, heldout
