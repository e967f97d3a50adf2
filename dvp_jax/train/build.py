"""What one RL run is built from, built once: `build_parts(cfg) -> (RunParts, TrainState)`, and
the pieces the evaluation command, the server and `dvp_jax.aot` build the same way (the run's
tokenizer, the trainer model, its rollout side).

`build_parts` goes in the order of failure cost: the config's host shares, the tokenizer and
the data (a bad data file fails in a second, not after a model init), then the mesh, the trainer
model and its train state, the rollout side (`rollout.Rollout`: engines, their devices, the
weight sync), and the trainer's jitted programs (`programs.trainer_programs`, which
`dvp_jax.aot` compiles too). Not here: the workdir, the checkpoints and the outputs
(`trainer.Trainer`), the loop, the preemption signals (`preemption.py`), the workdir's config
check (`resume.check_workdir`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import optax
from absl import logging
from flax import nnx

from dvp_jax.data import pipeline
from dvp_jax.data.tasks import GeneratedTask
from dvp_jax.errors import ConfigError, DataError, UserError
from dvp_jax.model import DTypePolicy, Transformer
from dvp_jax.model.hf_import import load_hf
from dvp_jax.rollout.engine import EngineConfig, device_memory_bytes
from dvp_jax.rollout.rollout import Rollout
from dvp_jax.sharding import TRAIN_RULES, Sharder, init_sharded, make_mesh
from dvp_jax.train import evaluation
from dvp_jax.train.config import ExperimentConfig
from dvp_jax.train.packing import Layout
from dvp_jax.train.programs import train_optimizer, trainer_programs
from dvp_jax.train.state import TrainState, init_train_state


# ==============================================================================================
# The pieces
# ==============================================================================================
def load_run_tokenizer(spec: str):
    """`config.data.tokenizer` loaded; a path that does not load is the user's mistake."""
    from dvp_jax.tokenizers import load_tokenizer

    try:
        return load_tokenizer(spec)
    except ConfigError:  # a Hub repo id that does not resolve: the message names the field
        raise
    except (OSError, ValueError) as e:
        raise UserError(f"config.data.tokenizer={spec!r}: {e}") from e


def train_policy(cfg: ExperimentConfig, platform: str) -> DTypePolicy:
    """The trainer's dtype policy on `platform`: `train.precision` with its attention kernel
    and tile (`DTypePolicy.for_platform`)."""
    t = cfg.train
    return DTypePolicy.named(t.precision, t.attention_impl, t.attention_block).for_platform(
        platform
    )


def model_factory(cfg: ExperimentConfig, sharder: Sharder):
    """A function building the trainer model of `cfg` at random init (`train.precision`'s
    policy, `train.remat`, seed `train.seed`): materialised by `build_model`, shaped by
    `nnx.eval_shape` in `dvp_jax.aot`."""
    policy = train_policy(cfg, sharder.platform)
    return lambda: Transformer(
        cfg.model, policy, sharder, rngs=nnx.Rngs(cfg.train.seed), remat=cfg.train.remat
    )


def build_model(cfg: ExperimentConfig, sharder: Sharder) -> Transformer:
    """The trainer model (`train.precision`: true fp32 by default), born sharded: from
    `model.hf_path` (resolved and its config.json checked by `ExperimentConfig`) or a random
    init."""
    if cfg.init_hf_path:
        policy = train_policy(cfg, sharder.platform)
        return load_hf(cfg.init_hf_path, policy, sharder, cfg=cfg.model, remat=cfg.train.remat)
    return init_sharded(model_factory(cfg, sharder), sharder)


def engine_config(cfg: ExperimentConfig, dtype: str = "") -> EngineConfig:
    """The rollout engine's settings for a run (precision `dtype`, default `rollout.dtype`):
    the one place a run's config becomes an `EngineConfig`.

    The `rollout` section's fields (`EngineConfig`'s own, with its defaults and checks), then
    what the run decides elsewhere: the longest prompt (`data.max_prompt_len`), the min-p rule
    the trainer prunes with (E1; -inf when pruning is off) and the seed. Prompts are padded to
    the smallest of the engine's default prefill buckets (16 ... 8192, and max_prompt_len) that
    holds the longest prompt of a prefill call, not to max_prompt_len (2,048 for ~200-token
    prompts was 10x the prefill work).
    """
    r = cfg.rollout
    return EngineConfig(
        dtype=dtype or r.dtype,
        noise_std=r.noise_std,
        noise_tail_gap=r.noise_tail_gap,
        temperature=r.temperature,
        max_decode_length=r.max_decode_length,
        max_concurrent_decodes=r.max_concurrent_decodes,
        decode_attention=r.decode_attention,
        page_size=r.page_size,
        kv_pages=r.kv_pages,
        top_k=r.top_k,
        top_p=r.top_p,
        max_kept=r.max_kept,
        max_prefill_length=cfg.data.max_prompt_len,
        log_rho=cfg.loss.effective_log_rho,
        seed=cfg.train.seed,
    )


def check_rollout_memory(cfg: ExperimentConfig) -> None:
    """Refuses, in one line, a rollout KV cache larger than one of this host's devices can hold
    (`EngineConfig.check_pool_fits`): run before the workdir or any model is touched."""
    engine_config(cfg).check_pool_fits(
        cfg.model, cfg.rollout.tensor_parallel, device_memory_bytes(), "config.rollout"
    )


def build_rollout(
    cfg: ExperimentConfig, tokenizer, model, mesh, *, process: int | None = None
) -> Rollout:
    """The run's rollout side (`rollout.Rollout`): process `process`'s engine (default this
    one's) at `rollout.dtype`, placed by `weights.engine_mesh` against the trainer's `mesh`,
    and the evaluation engine when `eval.dtype` asks for another precision, filled with the
    weights of `model` (the trainer's `Transformer`; None: programs only, for `dvp_jax.aot`,
    whose mesh is a TPU topology's)."""
    return Rollout(
        cfg.model,
        engine_config(cfg),
        tokenizer=tokenizer,
        params=model,
        trainer_mesh=mesh,
        tensor_parallel=cfg.rollout.tensor_parallel,
        eval_config=engine_config(cfg, cfg.eval.dtype) if cfg.eval.dtype else None,
        process=process,
        abstract=model is None,
    )


# ==============================================================================================
# A run's parts
# ==============================================================================================
@dataclasses.dataclass(frozen=True)
class RunParts:
    """The fixed parts of a run; the train state, which every step replaces, is kept apart.

    Attributes:
      tokenizer, task: the run's tokenizer and generated task (None for a math file).
      data: this host's prompt iterator (checkpointed with the state); heldout: the
        validation sets (`evaluation.heldout_sets`).
      mesh, sharder, graphdef, optimizer, state_shardings: the trainer side.
      rollout: the rollout side (`rollout.Rollout`: the rollout and evaluation engines and
        the weight sync).
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
    rollout: Rollout
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

    rollout = build_rollout(cfg, tokenizer, model, mesh)
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
        rollout=rollout,
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
