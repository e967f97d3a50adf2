"""Supervised warm-up on the generated task, before RL, with its own optimizer.

RL from a random model learns nothing on the arithmetic task (no response is ever rewarded), so
the small configs first fit the task's reference answers for `sft.steps` steps. The warm-up is
its own phase: it gets the model's params, trains them with a fresh AdamW of its own and hands
them back; the RL optimizer starts fresh afterwards. Its rows in metrics.jsonl have steps
-sft.steps .. -1 (`sft_loss`, `phase_sft`); step 0 is the evaluation before RL.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
from absl import logging

from dvp_jax.data import pipeline
from dvp_jax.sharding import Sharder, compiler_options
from dvp_jax.train import batch as batch_lib
from dvp_jax.train.report import duration
from dvp_jax.train.sections import SFTConfig
from dvp_jax.train.state import TrainState, init_train_state, make_optimizer
from dvp_jax.train.step import apply_gradients, token_logprobs


def sft_step(state: TrainState, batch, *, graphdef, optimizer, chunk_size: int):
    """Supervised warm-up: mean negative log-likelihood of the masked (answer) tokens.

    Args:
      batch: (tokens [B, T] int32 right-padded, loss_mask [B, T] 1.0 on tokens to predict,
        lengths [B] int32 real lengths).
    """
    tokens, loss_mask, lengths = batch
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    valid = positions < lengths[:, None]
    mask = loss_mask[:, 1:].astype(jnp.float32)

    def loss_fn(params):
        tl = token_logprobs(
            params,
            graphdef,
            tokens,
            positions,
            valid,
            log_rho=None,
            temperature=1.0,
            chunk_size=chunk_size,
        )
        return -jnp.sum(tl.logp_full * mask) / jnp.maximum(jnp.sum(mask), 1.0)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    new_state, metrics = apply_gradients(state, grads, optimizer)
    metrics["sft_loss"] = loss
    return new_state, metrics


def sft_optimizer(cfg: SFTConfig):
    """The warm-up's own AdamW (no weight decay, clip 1): `sft.learning_rate` after
    `sft.warmup_steps` of linear warm-up."""
    return make_optimizer(cfg.learning_rate, cfg.warmup_steps, 0.0, 1.0)


def jit_sft_step(graphdef, optimizer, chunk_size: int, sharder: Sharder):
    """`sft_step` jitted as the warm-up runs it (the state donated; `dvp_jax.aot` compiles it)."""
    return jax.jit(
        functools.partial(sft_step, graphdef=graphdef, optimizer=optimizer, chunk_size=chunk_size),
        donate_argnums=0,
        compiler_options=compiler_options(sharder),
    )


def warm_up(
    model,
    task,
    tokenizer,
    cfg: SFTConfig,
    *,
    step_fn,
    sharder: Sharder,
    max_len: int,
    seed: int,
    log: Callable[[int, dict[str, float]], None],
    stop: Callable[[int], bool] = lambda step: False,
):
    """Trains `model`'s params for `cfg.steps` supervised steps; returns the new params.

    Returns None instead when `stop(step)` turns true (asked after every step, with the
    phase's negative step number: preemption).

    Args:
      model: the (sharded) trainer model to start from.
      task: the generated task (`tasks.GeneratedTask`) whose reference responses are fitted.
      tokenizer: the run's tokenizer.
      cfg: steps, global batch size (divisible by the number of processes), learning rate and
        warm-up of this phase.
      step_fn: the jitted step (`jit_sft_step` with `sft_optimizer(cfg)`, as
        `programs.trainer_programs` builds it).
      sharder: the trainer's mesh and rules (params keep their shardings).
      max_len: longest example in tokens (prompt + response).
      seed: seed of the phase's (unused) state key.
      log: `log(step, metrics)` for the rows of this phase (step < 0).
      stop: asked after each step; True abandons the warm-up (it is redone on resume).
    """
    logging.info("supervised warm-up: %d steps of batch %d", cfg.steps, cfg.batch_size)
    _, state, _ = init_train_state(model, sft_optimizer(cfg), seed, sharder)
    every = max(1, cfg.steps // 10)
    window_start, window_time = 0, time.time()
    # Each host builds its rows of the global batch; together they form one global array.
    host_rows = cfg.batch_size // jax.process_count()
    shardings = None
    for i in range(cfg.steps):
        b = pipeline.sft_batch_for_step(
            task, tokenizer, step=i, batch_size=host_rows, max_len=max_len
        )
        host_batch = (b.tokens, b.loss_mask, b.lengths)
        if shardings is None:
            shardings = batch_lib.global_shardings(host_batch, sharder)
        state, metrics = step_fn(state, batch_lib.to_global(host_batch, shardings))
        if (i + 1) % every == 0 or i + 1 == cfg.steps:
            loss = float(metrics["sft_loss"])
            now = time.time()
            rate = (i + 1 - window_start) / max(now - window_time, 1e-9)
            window_start, window_time = i + 1, now
            logging.info(
                "warm-up %d/%d | loss %.4f | %.1f steps/s | ETA %s",
                i + 1,
                cfg.steps,
                loss,
                rate,
                duration((cfg.steps - i - 1) / rate),
            )
            log(i - cfg.steps, {"sft_loss": loss, "phase_sft": 1.0})
        if stop(i - cfg.steps):
            logging.warning("supervised warm-up stopped at step %d/%d", i + 1, cfg.steps)
            return None
    return state.params
