"""The DVP-RLOO training loop (docs/design.md section 3), readable top to bottom.

  prompts (grain) -> rollouts (`Rollout.generate`: the bf16 engine, min-p sampling, E4)
    -> rewards (host, `evaluation`) -> RLOO advantages (E8) -> packed rows (`packing.pack`)
    -> jitted fp32 update (`step.rl_update`: chunked pruned logprobs E2/E5, loss E7/E9, optax)
    -> weight sync (`Rollout.update_weights`: cast + reshard) -> metrics / eval / checkpoints.

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
from dvp_jax import trackers as trackers_lib
from dvp_jax.checkpoint import Checkpointer, abstract_like
from dvp_jax.dvp import advantages as adv
from dvp_jax.rollout.offline import RolloutInterrupted
from dvp_jax.train import batch as batch_lib
from dvp_jax.train import evaluation, packing, report, resume, sft
from dvp_jax.train import step as step_lib
from dvp_jax.train.build import build_parts
from dvp_jax.train.config import ExperimentConfig
from dvp_jax.train.preemption import Preemption
from dvp_jax.train.resume import WorkdirMismatchError, check_workdir
from dvp_jax.train.sources import make_source
from dvp_jax.train.state import with_fresh_optimizer
from dvp_jax.workdir import WorkdirLock, as_path, check_writable, remove_if_empty, write_atomic

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
    """One run: its parts (`build.RunParts`), its train state, its workdir and what is written
    there (checkpoints, metrics log, the trackers' outputs: samples.jsonl, event files, W&B).

    Nothing is written to the workdir before `run()` knows the run fits it: the config is
    checked against the workdir's config.json here, the checkpoint is restored in `run()`, and
    only then are config.json, model_config.json, the metrics log and the trackers touched.
    """

    def __init__(self, cfg: ExperimentConfig, workdir: str):
        self.cfg = cfg
        self.workdir = as_path(workdir)  # an epath: local, gs://, ...
        check_workdir(cfg, self.workdir)
        # A tracker whose package is missing fails here, naming the extra to install.
        trackers_lib.check_installed(cfg.train.tracker_names)
        created = not self.workdir.exists()
        check_writable(self.workdir)  # an unreachable or read-only workdir fails here, by name
        self.is_lead = jax.process_index() == 0
        self.lock = WorkdirLock(self.workdir)
        if self.is_lead:
            self.lock.acquire()  # a second trainer on this workdir stops here, by name
        try:
            self.parts, self.state = build_parts(cfg)
            c = cfg.checkpoint
            self.checkpointer = Checkpointer(self.workdir, c.keep, every=c.every)
            self.metrics_log = metrics_lib.MetricsLog(self.workdir, write=self.is_lead)
            self.trackers = None  # opened by `_open_outputs` once the run is known to fit
            self.preemption = Preemption(self.checkpointer)
        except BaseException:
            self.lock.release()
            if created and self.is_lead:  # a run that failed before any work leaves nothing
                remove_if_empty(self.workdir)
            raise
        # Where each step's rollouts come from: synchronous, or partial (`train/sources.py`).
        self.source = make_source(
            cfg,
            self.parts.rollout,
            self.parts.data,
            lambda step: self._key(step, _ROLLOUT_STREAM),
            lambda: self.preemption.requested(),  # looked up at each call (tests replace it)
            self.parts.tokenizer,
        )
        # Seconds of work in earlier attempts of this run (up to their last checkpoint).
        self._earlier_wall_time = 0.0
        self._attempt_start = time.time()

    # The parts other code reads off a trainer (`main.py`, experiments, tests).
    rollout = property(lambda self: self.parts.rollout)
    graphdef = property(lambda self: self.parts.graphdef)
    tokenizer = property(lambda self: self.parts.tokenizer)
    data = property(lambda self: self.parts.data)

    # ==========================================================================================
    # Pieces
    # ==========================================================================================
    def _log(self, step: int, metrics: dict[str, Any]) -> None:
        self.metrics_log.append(step, metrics)  # checks every name is declared first
        self.trackers.scalars(step, metrics)

    def _open_outputs(self, resumed_step: int | None) -> None:
        """The run fits this workdir: trim the metrics log to the checkpoint (everything on a
        fresh start), record the config and architecture, open the trackers (which trim
        samples.jsonl alike)."""
        redone = self.metrics_log.truncate_after(resumed_step)
        flat = resume.flat_fields(self.cfg)
        if self.is_lead:
            write_atomic(self.workdir / "config.json", json.dumps(flat, indent=2))
            # The architecture as a Hugging Face config.json, for the server.
            write_atomic(
                self.workdir / "model_config.json",
                json.dumps(self.cfg.model.to_hf(), indent=2),
            )
        self.trackers = trackers_lib.Trackers(
            self.workdir,
            self.cfg.train.tracker_names,
            write=self.is_lead,
            config=flat,
            resumed_step=resumed_step,
            kept_rows=self.metrics_log.num_rows,
            redone_rows=redone,
            wandb=self.cfg.train.wandb,
        )

    def _wall_time(self) -> float:
        return self._earlier_wall_time + time.time() - self._attempt_start

    def _save(self, step: int, extra: dict, *, force: bool = False) -> None:
        """Offers step `step` to the checkpoint manager (multiples of `checkpoint.every`,
        Orbax's agreed preemption step) or forces it; the array files are written in the
        background (`Checkpointer.wait` before preempting or exiting)."""
        extra = {**extra, **self.source.checkpoint_extra(), "wall_time_s": self._wall_time()}
        self.checkpointer.save(step, self.state, self.parts.data, extra, force=force)

    def _sync_weights(self) -> None:
        """Trainer fp32 params -> the rollout (and evaluation) engine (`Rollout.update_weights`)."""
        self.parts.rollout.update_weights(nnx.merge(self.parts.graphdef, self.state.params))

    def _key(self, step: int, stream: int) -> jax.Array:
        """fold_in(run key, stream, step): a pure function of the checkpointed key, the same on
        every host (prompts then fold in their global index, so results do not depend on the
        number of hosts)."""
        key = jax.random.wrap_key_data(jax.device_get(self.state.rng))
        return jax.random.fold_in(jax.random.fold_in(key, stream), step)

    def evaluate(self, step: int, sample_rows: list | None = None) -> dict[str, float]:
        """avg@k and pass@k of every validation set (`parts.heldout`: the held-out set, then
        `eval.sets`) with the evaluation engine (`eval.dtype`), sampled without the
        experimental logit noise unless `eval.with_rollout_noise`; `sample_rows` collects a
        few responses per set (`evaluation.evaluate`)."""
        engine = self.parts.rollout.eval_engine
        sampling = None
        if not self.cfg.eval.with_rollout_noise:
            sampling = engine.config.sampling_params(noise_std=0.0)
        return evaluation.evaluate_sets(
            engine,
            self.parts.heldout,
            self._key(step, _EVAL_STREAM),
            prompt_len=self.cfg.data.max_prompt_len,
            sampling=sampling,
            should_stop=self.preemption.requested,
            sample_rows=sample_rows,
        )

    def _evaluate(self, step: int, name: str = "eval") -> dict[str, float]:
        """`evaluate`, its sample generations sent to the trackers (and samples.jsonl) as
        `name` ("eval"; `trackers.FINAL_EVAL` after the last step)."""
        rows = []
        metrics = self.evaluate(step, rows)
        self.trackers.samples(step, name, rows)
        return metrics

    def warm_up(self) -> bool:
        """Supervised warm-up (`train/sft.py`); RL then starts with a fresh optimizer.

        Returns False if preempted (SIGTERM) during the warm-up. Called outside `run()` (a
        trainer used as a library, as experiments/e001 does), it starts the workdir's outputs
        as a fresh run first.
        """
        cfg, p = self.cfg, self.parts
        if cfg.sft.steps == 0 or p.task is None:
            return True
        if self.trackers is None:
            self._open_outputs(None)
        params = sft.warm_up(
            nnx.merge(p.graphdef, self.state.params),
            p.task,
            p.tokenizer,
            cfg.sft,
            step_fn=p.sft_step,
            sharder=p.sharder,
            max_len=cfg.sequence_length,
            seed=cfg.train.seed,
            log=self._log,
            stop=self.preemption.reached,  # polled with the (negative) warm-up step
        )
        if params is None:
            return False
        self.state = with_fresh_optimizer(self.state, params, p.optimizer, p.state_shardings)
        return True

    # ==========================================================================================
    # One RL iteration: rollout -> rewards -> advantages -> update(s) -> weight sync
    # ==========================================================================================
    def rl_iteration(self, step: int) -> dict[str, float]:
        cfg = self.cfg
        t0 = time.time()
        rollouts, answers, source_metrics = self.source.generate(step)
        t_rollout = time.time() - t0

        # Weighted rewards on host (text terms give a truncated response 0), then RLOO (E8).
        scores = evaluation.rollout_reward_terms(
            self.parts.tokenizer,
            rollouts,
            answers,
            cfg.data.reward_terms,
            max_decode_length=cfg.rollout.max_decode_length,
        )
        reward = scores.total
        advantages = np.asarray(adv.rloo(jnp.asarray(reward), cfg.train.group_size))
        zero_adv = adv.zero_advantage(reward, cfg.train.group_size)
        trained = np.flatnonzero(~zero_adv if cfg.train.skip_zero_advantage else zero_adv | True)

        # Train (fp32), possibly several PPO mini-batch updates on this rollout batch.
        t1 = time.time()
        metrics = self._update(*self.source.for_update(rollouts, step), advantages, trained)
        metrics.update(source_metrics)
        t_train = time.time() - t1
        self._sync_weights()

        # Host-side figures over the global batch (every host gets the same sums).
        rows, tokens, reward_sum, finished, zero = evaluation.sum_over_hosts(
            [
                rollouts.num_rows,
                rollouts.response_mask.sum(),
                reward.sum(),
                rollouts.finished.sum(),
                zero_adv.sum(),
            ]
        )
        metrics.update(
            zero_advantage_fraction=zero / rows,
            reward_mean=reward_sum / rows,
            response_length=tokens / rows,
            frac_finished=finished / rows,
            truncation_rate=1.0 - finished / rows,
            rollout_s=t_rollout,
            train_s=t_train,
            rollout_tok_s=tokens / max(t_rollout, 1e-9),  # global tokens / this host's time
            train_precision=cfg.train.precision,
        )
        metrics.update(evaluation.reward_metrics(scores))  # reward/<term>, reward_failures/<term>
        return metrics

    def _with_logprobs(self, host_batch, params, name: str) -> batch_lib.RLBatch:
        """`host_batch` with `<name>_logp` and `<name>_in_safe` (log pi_S and its safe set under
        `params`, this host's rows), computed before any update on it: "old", the policy of
        the decoupled PPO clip (E9); "ref", the frozen reference of the KL term (E11)."""
        p = self.parts
        shardings = p.batch_shardings and step_lib.logprob_inputs(p.batch_shardings)
        inputs = batch_lib.to_global(step_lib.logprob_inputs(host_batch), shardings)
        return batch_lib.with_logprobs(host_batch, name, p.logprobs(params, inputs))

    def _update(self, rollouts, version, advantages, trained) -> dict[str, float]:
        """`train.updates_per_batch` updates, one per slice of the `trained` rows of `rollouts`
        (each packed into the update's rows, `packing.pack`, with each token's age from
        `version` under partial rollouts); the metrics' mean."""
        u = self.cfg.train.updates_per_batch
        batches = [
            packing.pack(rollouts, advantages, self.parts.layout, part, version)
            for part in np.array_split(trained, u)
        ]
        if u > 1:
            batches = [self._with_logprobs(b, self.state.params, "old") for b in batches]
        if self.cfg.loss.uses_reference:
            batches = [self._with_logprobs(b, self.state.ref_params, "ref") for b in batches]
        all_metrics = []
        for host_batch in batches:
            mb = batch_lib.to_global(host_batch, self.parts.batch_shardings)
            self.state, metrics = self.parts.update(self.state, mb)
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
            abstract_like(self.state, self.parts.state_shardings), self.parts.data
        )
        if restored is None:
            report.banner(cfg, self.parts.mesh, self.workdir, None)
            self._open_outputs(None)
            if not self.warm_up():
                logging.warning("preempted during the supervised warm-up: rerun to start again")
                return {"preempted_at": "warm-up"}
            self._sync_weights()
            extra = {}
        else:  # the data iterator is set in place (Grain's handler)
            latest, self.state, _, extra = restored
            self.source.resumed(extra)
            if latest > cfg.train.steps:  # before anything is written
                raise WorkdirMismatchError(
                    f"{self.workdir} holds a checkpoint at step {latest}, past train.steps = "
                    f"{cfg.train.steps}: raise train.steps to go on, or use a fresh workdir"
                )
            report.banner(cfg, self.parts.mesh, self.workdir, latest)
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
            data_position = self.parts.data.get_state()
            try:
                metrics = self.rl_iteration(step)
            except RolloutInterrupted:  # this step never happened: rewind its prompts
                self.parts.data.set_state(data_position)
                return self._stop(step - 1, extra)
            if cfg.eval.every and step % cfg.eval.every == 0 and step != cfg.train.steps:
                try:
                    metrics.update(self._evaluate(step))
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
            # Overlaps the final step's write.
            final_eval = self._evaluate(cfg.train.steps, trackers_lib.FINAL_EVAL)
        except RolloutInterrupted:  # the final checkpoint is taken; the eval is redone
            return self._stop(cfg.train.steps, extra)
        self.checkpointer.wait()  # the final step is on disk before the summary says done
        self._log(cfg.train.steps, {**final_eval, "phase": 1.0})
        summary = self._summary(extra.get("start_eval", {}), final_eval, self._wall_time())
        if self.is_lead:
            write_atomic(self.workdir / "summary.json", json.dumps(summary, indent=2))
        self.trackers.summary(summary)
        self.trackers.flush()
        return summary

    def _finish_interrupted(self, step: int, extra: dict) -> dict:
        """What a stop left undone at checkpoint `step`: the evaluation before RL (a fresh run,
        or one stopped during it) or a periodic one (the step's row waits in `unlogged`).
        Both are pure functions of the checkpointed params and key, so redoing them is exact.
        """
        if "start_eval" not in extra and step == 0:
            start_eval = self._evaluate(0)
            self._log(0, {**start_eval, "phase": 0.0})
            extra = {**extra, "start_eval": start_eval}
            self._save(0, extra, force=True)  # kept if step 0 is there already
        unlogged = extra.get("unlogged")
        if unlogged is not None and unlogged["step"] == step:
            metrics = {k: v for k, v in unlogged.items() if k != "step"}
            metrics.update(self._evaluate(step))
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
        data_report = self.parts.data.report  # None for a generated task
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
            "data_malformed_rows": data_report.num_malformed if data_report is not None else 0,
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
            if self.trackers is not None:
                self.trackers.close()
            self.preemption.close()
            self.parts.rollout.close()
            self.lock.release()


def train(cfg: ExperimentConfig, workdir: str) -> dict[str, Any]:
    trainer = Trainer(cfg, workdir)
    try:
        return trainer.run()
    finally:
        trainer.close()
