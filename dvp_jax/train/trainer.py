"""The DVP-RLOO training loop (docs/design.md section 3), readable top to bottom.

  prompts (grain) -> rollout engine (JetStream Engine API, bf16, min-p sampling, E4)
    -> rewards (host, `evaluation`) -> RLOO advantages (E8) -> `batch.from_rollouts`
    -> jitted fp32 update (`step.rl_update`: chunked pruned logprobs E2/E5, loss E7/E9, optax)
    -> weight sync (cast + reshard) -> metrics / eval / checkpoints.

`train(cfg, workdir)` resumes automatically from the latest checkpoint in `workdir`. A fresh run
first does the supervised warm-up of `train/sft.py` when the config asks for one.
"""

from __future__ import annotations

import json
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx

from dvp_jax import metrics as metrics_lib
from dvp_jax.checkpoint import Checkpointer, abstract_like
from dvp_jax.data import pipeline
from dvp_jax.dvp import advantages as adv
from dvp_jax.errors import ConfigError, DataError
from dvp_jax.rollout.offline import RolloutInterrupted, generate_rollouts
from dvp_jax.sharding import TRAIN_RULES, Sharder, make_mesh
from dvp_jax.train import batch as batch_lib
from dvp_jax.train import resume
from dvp_jax.train import evaluation, report, sft
from dvp_jax.train import step as step_lib
from dvp_jax.train.builders import (
    Preemption,
    WorkdirMismatchError,
    build_engine,
    build_model,
    check_workdir,
    load_run_tokenizer,
    rollout_weights,
)
from dvp_jax.train.config import ExperimentConfig
from dvp_jax.train.state import TrainState, init_train_state, make_optimizer
from dvp_jax.workdir import (
    WorkdirLock,
    as_path,
    check_writable,
    remove_if_empty,
    write_atomic,
)

# Key streams folded into the run's key: rollouts, evaluation.
_ROLLOUT_STREAM, _EVAL_STREAM = 0, 1

# Metrics averaged over the last RL steps into summary.json as `final_<name>`.
SUMMARY_TAIL_METRICS = (
    "ppl_gap",
    "log_ppl_diff",
    "reward_mean",
    "frac_responses_excluded",
    "frac_tokens_outside_train_safe",
)


class Trainer:
    """Owns the model, engine, data and checkpoints of one run.

    Nothing is written to the workdir before `run()` knows the run fits it: the config is
    checked against the workdir's config.json here, the checkpoint is restored in `run()`, and
    only then are config.json, model_config.json, the metrics log and the event files touched.
    """

    def __init__(self, cfg: ExperimentConfig, workdir: str):
        self.cfg = cfg
        self.workdir = as_path(workdir)  # an epath: local, gs://, ...
        check_workdir(cfg, self.workdir)
        created = not self.workdir.exists()
        check_writable(self.workdir)  # an unreachable or read-only workdir fails here, by name
        self.is_lead = jax.process_index() == 0
        self.lock = WorkdirLock(self.workdir)
        if self.is_lead:
            self.lock.acquire()  # a second trainer on this workdir stops here, by name
        try:
            self._build(cfg)
        except BaseException:
            self.lock.release()
            if created and self.is_lead:  # a run that failed before any work leaves nothing
                remove_if_empty(self.workdir)
            raise

    def _build(self, cfg: ExperimentConfig) -> None:
        for name, value in [
            ("train.prompts_per_step", cfg.train.prompts_per_step),
            ("sft.batch_size", cfg.sft.batch_size if cfg.sft.steps else 0),
        ]:
            if value % jax.process_count():
                raise ConfigError(
                    f"config.{name}={value} must be divisible by the number of processes "
                    f"({jax.process_count()}): each host takes an equal share of the batch"
                )

        self.tokenizer = load_run_tokenizer(cfg.data.tokenizer)
        # Data first, before the model: a bad data file fails in a second, not after a model init.
        # The generated task (or a math file), this host's share of each prompt batch.
        self.task = cfg.data.make_task()  # a generated task, or None for a math file
        try:
            self.data = pipeline.make_prompt_iterator(
                self.task if self.task is not None else cfg.data.path,
                self.tokenizer,
                batch_size=cfg.train.prompts_per_step // jax.process_count(),
                max_prompt_len=cfg.data.max_prompt_len,
                seed=cfg.data.seed,
                chat_format=cfg.data.chat_format,
            )
        except (OSError, ValueError) as e:  # pyarrow's errors are ValueErrors too
            raise DataError(f"config.data.path: {e}") from e
        if self.data.report is not None:
            logging.info("data: %s", self.data.report.summary())
        try:
            self.heldout = evaluation.heldout_examples(
                cfg.data, self.task, self.tokenizer, cfg.eval.num_prompts
            )
        except (OSError, ValueError) as e:
            raise DataError(f"config.data.eval_path: {e}") from e
        self.reward_kind = evaluation.reward_kind(cfg.data)

        try:
            self.mesh = make_mesh(cfg.mesh)
        except ValueError as e:  # a mesh shape the devices do not fill
            raise ConfigError(f"config.mesh: {e}") from e
        self.sharder = Sharder(self.mesh, TRAIN_RULES)
        model = build_model(cfg, self.sharder)
        t = cfg.train
        self.optimizer = make_optimizer(
            t.learning_rate, t.warmup_steps, t.weight_decay, t.grad_clip, t.b1, t.b2
        )
        self.graphdef, self.state, self.state_sh = init_train_state(
            model, self.optimizer, t.seed, self.sharder
        )
        self.engine = build_engine(cfg, self.tokenizer, model)
        self.eval_engine = self.engine
        if cfg.eval.dtype and cfg.eval.dtype != cfg.rollout.dtype:
            self.eval_engine = build_engine(cfg, self.tokenizer, model, cfg.eval.dtype)
        # Weight sync gathers (multi-host) at the widest param dtype of the two engines.
        self._sync_dtype = jnp.promote_types(
            self.engine.policy.param_dtype, self.eval_engine.policy.param_dtype
        )

        # The update is jitted on the first batch (its shapes fix the shardings).
        self._update_fn = None
        self._logprobs_fn = jax.jit(
            lambda params, b: step_lib.token_logprobs(
                params,
                self.graphdef,
                b.tokens,
                b.positions,
                b.valid,
                log_rho=cfg.loss.effective_log_rho,
                temperature=cfg.loss.temperature,
                chunk_size=t.chunk_size,
            )
        )

        # Output (the writer is made by `_open_outputs` once the run is known to fit).
        self.checkpointer = Checkpointer(
            self.workdir, cfg.checkpoint.keep, every=cfg.checkpoint.every
        )
        self.metrics_log = metrics_lib.MetricsLog(self.workdir, write=self.is_lead)
        self.writer = None
        self.preemption = Preemption(self.checkpointer)
        # Seconds of work in earlier attempts of this run (up to their last checkpoint).
        self._earlier_wall_time = 0.0
        self._attempt_start = time.time()

    # ==========================================================================================
    # Pieces
    # ==========================================================================================
    def _log(self, step: int, metrics: dict[str, Any]) -> None:
        self.metrics_log.append(step, metrics)  # checks every name is declared first
        numbers = {k: v for k, v in metrics.items() if not isinstance(v, str)}
        self.writer.write_scalars(step, numbers)  # event files hold numbers only

    def _open_outputs(self, resumed_step: int | None) -> None:
        """The run fits this workdir: trim the metrics log to the checkpoint (everything on a
        fresh start), record the config and architecture, open the event-file writer."""
        self.metrics_log.truncate_after(resumed_step)
        if self.is_lead:
            flat = resume.flat_fields(self.cfg)
            write_atomic(self.workdir / "config.json", json.dumps(flat, indent=2))
            # The architecture as a Hugging Face config.json, for the server.
            write_atomic(
                self.workdir / "model_config.json",
                json.dumps(self.cfg.model.to_hf(), indent=2),
            )
        self.writer = metrics_lib.EventFiles(
            self.workdir, write=self.is_lead, kept_through=resumed_step
        )

    def _wall_time(self) -> float:
        return self._earlier_wall_time + time.time() - self._attempt_start

    def _save(self, step: int, extra: dict, *, force: bool = False) -> None:
        """Offers step `step` to the checkpoint manager (multiples of `checkpoint.every`,
        Orbax's agreed preemption step) or forces it; the array files are written in the
        background (`Checkpointer.wait` before preempting or exiting)."""
        extra = {**extra, "wall_time_s": self._wall_time()}
        self.checkpointer.save(step, self.state, self.data, extra, force=force)

    def _sync_weights(self) -> None:
        """Trainer fp32 params -> rollout (and evaluation) engine: cast, resharded."""
        engines = {id(e): e for e in (self.engine, self.eval_engine)}.values()
        params = rollout_weights(self.state.params, self._sync_dtype, tuple(engines))
        params = nnx.merge(self.graphdef, params)
        self.engine.update_params(params)
        if self.eval_engine is not self.engine:
            self.eval_engine.update_params(params)

    def _key(self, step: int, stream: int) -> jax.Array:
        """fold_in(run key, stream, step): a pure function of the checkpointed key, the same on
        every host (prompts then fold in their global index, so results do not depend on the
        number of hosts)."""
        key = jax.random.wrap_key_data(jax.device_get(self.state.rng))
        return jax.random.fold_in(jax.random.fold_in(key, stream), step)

    def evaluate(self, step: int) -> dict[str, float]:
        """Held-out avg@k with the evaluation engine (`eval.dtype`), sampled without the
        experimental logit noise unless `eval.with_rollout_noise`."""
        sampling = None
        if not self.cfg.eval.with_rollout_noise:
            sampling = self.eval_engine.config.sampling_params(noise_std=0.0)
        return evaluation.evaluate(
            self.eval_engine,
            self.heldout,
            self.cfg.eval.k,
            self._key(step, _EVAL_STREAM),
            prompt_len=self.cfg.data.max_prompt_len,
            kind=self.reward_kind,
            sampling=sampling,
            should_stop=self.preemption.requested,
        )

    def warm_up(self) -> bool:
        """Supervised warm-up (`train/sft.py`); RL then starts with a fresh optimizer.

        Returns False if preempted (SIGTERM) during the warm-up. Called outside `run()` (a
        trainer used as a library, as experiments/e001 does), it starts the workdir's outputs
        as a fresh run first.
        """
        cfg = self.cfg
        if cfg.sft.steps == 0 or self.task is None:
            return True
        if self.writer is None:
            self._open_outputs(None)
        params = sft.warm_up(
            nnx.merge(self.graphdef, self.state.params),
            self.task,
            self.tokenizer,
            cfg.sft,
            sharder=self.sharder,
            max_len=cfg.data.max_prompt_len + cfg.rollout.max_decode_length,
            chunk_size=cfg.train.chunk_size,
            seed=cfg.train.seed,
            log=self._log,
            stop=self.preemption.reached,  # polled with the (negative) warm-up step
        )
        if params is None:
            return False
        self.state = jax.jit(
            lambda p, s: TrainState(
                step=s.step, params=p, opt_state=self.optimizer.init(p), rng=s.rng
            ),
            out_shardings=self.state_sh,
        )(params, self.state)
        return True

    # ==========================================================================================
    # One RL iteration: rollout -> rewards -> advantages -> update(s) -> weight sync
    # ==========================================================================================
    def rl_iteration(self, step: int) -> dict[str, float]:
        cfg = self.cfg
        t0 = time.time()
        prompts = next(self.data)  # this host's rows of the global prompt batch
        n_prompts = len(prompts.lengths)
        token_lists = [prompts.tokens[i, : prompts.lengths[i]] for i in range(n_prompts)]
        rollouts = generate_rollouts(
            self.engine,
            token_lists,
            cfg.train.group_size,
            self._key(step, _ROLLOUT_STREAM),
            prompt_len=cfg.data.max_prompt_len,
            first_prompt_index=jax.process_index() * n_prompts,
            should_stop=self.preemption.requested,
        )
        t_rollout = time.time() - t0

        # Rewards on host (0 for a truncated response), then RLOO advantages (E8).
        answers = [a for a in prompts.answers for _ in range(cfg.train.group_size)]
        reward = evaluation.rollout_rewards(self.tokenizer, rollouts, answers, self.reward_kind)
        advantages = np.asarray(adv.rloo(jnp.asarray(reward), cfg.train.group_size))
        host_batch = batch_lib.from_rollouts(rollouts, advantages)

        # Train (fp32), possibly several PPO mini-batch updates on this rollout batch.
        t1 = time.time()
        metrics = self._update(host_batch)
        t_train = time.time() - t1
        self._sync_weights()

        # Host-side figures over the global batch (every host gets the same sums).
        rows, tokens, reward_sum, finished = evaluation.sum_over_hosts(
            [
                rollouts.num_rows,
                rollouts.response_mask.sum(),
                reward.sum(),
                rollouts.finished.sum(),
            ]
        )
        metrics.update(
            reward_mean=reward_sum / rows,
            response_length=tokens / rows,
            frac_finished=finished / rows,
            truncation_rate=1.0 - finished / rows,
            rollout_s=t_rollout,
            train_s=t_train,
            rollout_tok_s=tokens / max(t_rollout, 1e-9),  # global tokens / this host's time
            train_precision=cfg.train.precision,
        )
        return metrics

    def _old_policy(self, host_batch: batch_lib.RLBatch) -> None:
        """Decoupled PPO: log pi_S_old and its safe set, from the params before the first
        update on this batch, into `host_batch.old_logp` / `old_in_safe` (this host's rows)."""
        rows = host_batch.tokens.shape[0]
        full = batch_lib.to_global(host_batch, batch_lib.global_shardings(host_batch, self.sharder))
        old = self._logprobs_fn(self.state.params, full)
        old = (old.logp, old.in_safe)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            pid = jax.process_index()
            old = [
                multihost_utils.process_allgather(x, tiled=True)[pid * rows : (pid + 1) * rows]
                for x in old
            ]
        host_batch.old_logp = np.asarray(jax.device_get(old[0]), np.float32)
        host_batch.old_in_safe = np.asarray(jax.device_get(old[1]), bool)

    def _update(self, host_batch: batch_lib.RLBatch) -> dict[str, float]:
        cfg = self.cfg
        u = cfg.train.updates_per_batch
        if u > 1:
            self._old_policy(host_batch)
        per = host_batch.tokens.shape[0] // u
        all_metrics = []
        for i in range(u):
            mb = jax.tree.map(lambda x, i=i: x[i * per : (i + 1) * per], host_batch)
            shardings = batch_lib.global_shardings(mb, self.sharder)
            if self._update_fn is None:
                self._update_fn = step_lib.jit_rl_update(
                    graphdef=self.graphdef,
                    optimizer=self.optimizer,
                    loss_cfg=cfg.loss,
                    chunk_size=cfg.train.chunk_size,
                    micro_batches=cfg.train.micro_batches,
                    state_shardings=self.state_sh,
                    batch_shardings=shardings,
                    sharder=self.sharder,
                )
            self.state, metrics = self._update_fn(self.state, batch_lib.to_global(mb, shardings))
            all_metrics.append({k: float(v) for k, v in jax.device_get(metrics).items()})
        return {k: float(np.mean([m[k] for m in all_metrics])) for k in all_metrics[0]}

    # ==========================================================================================
    # The run
    # ==========================================================================================
    def run(self) -> dict[str, Any]:
        """Trains to `train.steps`, resuming from the newest intact checkpoint of the workdir.

        Returns the summary, or `{"preempted_at": step}` after SIGTERM / SIGINT (`"warm-up"`
        when it came during the supervised warm-up, which has no checkpoint and is redone on
        resume). A stop is honoured within one rollout dispatch: a step whose rollouts were
        cut short is dropped (the checkpoint is the step before it, the data position rewound
        to it); an evaluation cut short is redone on resume, from the checkpoint of its step.
        """
        cfg = self.cfg
        restored = self.checkpointer.restore_latest(
            abstract_like(self.state, self.state_sh), self.data
        )
        if restored is None:
            report.banner(cfg, self.mesh, self.workdir, None)
            self._open_outputs(None)
            if not self.warm_up():
                logging.warning("preempted during the supervised warm-up: rerun to start again")
                return {"preempted_at": "warm-up"}
            self._sync_weights()
            extra = {}
        else:  # the data iterator is set in place (Grain's handler)
            latest, self.state, _, extra = restored
            if latest > cfg.train.steps:  # before anything is written
                raise WorkdirMismatchError(
                    f"{self.workdir} holds a checkpoint at step {latest}, past train.steps = "
                    f"{cfg.train.steps}: raise train.steps to go on, or use a fresh workdir"
                )
            report.banner(cfg, self.mesh, self.workdir, latest)
            self._open_outputs(latest)
            self._earlier_wall_time = float(extra.get("wall_time_s", 0.0))
            self._sync_weights()
        first = int(jax.device_get(self.state.step))
        try:
            extra = self._finish_interrupted(first, extra)
        except RolloutInterrupted:
            return self._stop(first, extra)

        progress = report.Progress(
            cfg.train.steps,
            first,
            max(1, cfg.train.steps // 20),
            extra.get("start_eval", {}).get("eval_accuracy"),
        )
        for step in range(first + 1, cfg.train.steps + 1):
            self.checkpointer.check()  # a failed background write stops the run here
            data_position = self.data.get_state()
            try:
                metrics = self.rl_iteration(step)
            except RolloutInterrupted:  # this step never happened: rewind its prompts
                self.data.set_state(data_position)
                return self._stop(step - 1, extra)
            if cfg.eval.every and step % cfg.eval.every == 0 and step != cfg.train.steps:
                try:
                    metrics.update(self.evaluate(step))
                except RolloutInterrupted:  # the step is done; its row waits for the eval
                    return self._stop(step, {**extra, "unlogged": {"step": step, **metrics}})
            self._log_step(step, metrics)
            progress(step, metrics)
            preempted = self.preemption.reached(step)  # every host asks at every step
            # Every host offers every step; the manager saves multiples of checkpoint.every.
            self._save(step, extra, force=preempted or step == cfg.train.steps)
            if preempted:
                return self._stop(step, extra)

        try:
            final_eval = self.evaluate(cfg.train.steps)  # overlaps the final step's write
        except RolloutInterrupted:  # the final checkpoint is taken; the eval is redone
            return self._stop(cfg.train.steps, extra)
        self.checkpointer.wait()  # the final step is on disk before the summary says done
        self._log(cfg.train.steps, {**final_eval, "phase": 1.0})
        summary = self._summary(extra.get("start_eval", {}), final_eval, self._wall_time())
        if self.is_lead:
            write_atomic(self.workdir / "summary.json", json.dumps(summary, indent=2))
        self.writer.flush()
        return summary

    def _finish_interrupted(self, step: int, extra: dict) -> dict:
        """What a stop left undone at checkpoint `step`: the evaluation before RL (a fresh run,
        or one stopped during it) or a periodic one (the step's row waits in `unlogged`).
        Both are pure functions of the checkpointed params and key, so redoing them is exact.
        """
        if "start_eval" not in extra and step == 0:
            start_eval = self.evaluate(0)
            self._log(0, {**start_eval, "phase": 0.0})
            extra = {**extra, "start_eval": start_eval}
            self._save(0, extra, force=True)  # kept if step 0 is there already
        unlogged = extra.get("unlogged")
        if unlogged is not None and unlogged["step"] == step:
            metrics = {k: v for k, v in unlogged.items() if k != "step"}
            metrics.update(self.evaluate(step))
            self._log_step(step, metrics)
        return {k: v for k, v in extra.items() if k != "unlogged"}

    def _log_step(self, step: int, metrics: dict[str, Any]) -> None:
        if step % self.cfg.log_every == 0 or step == self.cfg.train.steps:
            self._log(step, metrics)

    def _stop(self, step: int, extra: dict) -> dict[str, Any]:
        """Checkpoints step `step` (unless it is on disk already), waits for it, and reports
        the preemption."""
        self._save(step, extra, force=True)
        self.checkpointer.wait()  # on disk before the process exits
        logging.warning(
            "preempted: checkpoint saved at step %d; rerun the same command to resume", step
        )
        return {"preempted_at": step}

    def _summary(self, start_eval: dict, final_eval: dict, wall_time_s: float) -> dict[str, Any]:
        summary = {
            "steps": self.cfg.train.steps,
            "method": self.cfg.method,
            "rollout_dtype": self.cfg.rollout.dtype,
            "train_precision": self.cfg.train.precision,
            "start_eval_accuracy": start_eval.get("eval_accuracy"),
            "eval_accuracy": final_eval.get("eval_accuracy"),
            "eval_pass_at_k": final_eval.get("eval_pass_at_k"),
            "wall_time_s": wall_time_s,
            "skipped_updates": float(jax.device_get(self.state.opt_state.total_notfinite)),
            "data_malformed_rows": (
                self.data.report.num_malformed if self.data.report is not None else 0
            ),
        }
        rows = self.metrics_log.read()
        for name in SUMMARY_TAIL_METRICS:
            value = metrics_lib.tail_mean(rows, name)
            if value is not None:
                summary[f"final_{name}"] = value
        return summary

    def close(self):
        try:
            self.checkpointer.close()
        finally:
            if self.writer is not None:
                self.writer.close()
            self.preemption.close()
            self.lock.release()


def train(cfg: ExperimentConfig, workdir: str) -> dict[str, Any]:
    trainer = Trainer(cfg, workdir)
    try:
        return trainer.run()
    finally:
        trainer.close()
