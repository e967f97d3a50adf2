"""The DVP-RLOO training loop (DESIGN.md section 3), readable top to bottom.

  prompts (grain) -> rollout engine (JetStream Engine API, bf16, min-p sampling, E4)
    -> rewards (host) -> RLOO advantages (E8) -> jitted fp32 train step (chunked pruned
    logprobs E2/E5, loss E7/E9, optax) -> weight sync (cast + reshard) -> metrics / eval /
    checkpoints.

`train(cfg, workdir)` resumes automatically from the latest checkpoint in `workdir`.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from clu import metric_writers
from flax import nnx

from dvp_jax.data import pipeline, rewards, tasks
from dvp_jax.dvp import advantages as adv
from dvp_jax.model import TRAIN_POLICY, Transformer
from dvp_jax.model.hf_import import load_hf, load_hf_config
from dvp_jax.rollout.engine import EngineConfig, RolloutEngine
from dvp_jax.rollout.offline import RolloutBatch, generate_rollouts
from dvp_jax.rollout.tokenizers import load_tokenizer
from dvp_jax.sharding import TRAIN_RULES, MeshConfig, Sharder, init_sharded, make_mesh
from dvp_jax.train import step as step_lib
from dvp_jax.checkpoint import Checkpointer, abstract_like
from dvp_jax.train.config import ExperimentConfig
from dvp_jax.train.state import TrainState, init_train_state, make_optimizer

# Key streams folded into the run's key: rollouts, evaluation.
_ROLLOUT_STREAM, _EVAL_STREAM = 0, 1


class _Preemption:
    """Turns SIGTERM into a flag the loop checks after each step (then checkpoints and exits)."""

    def __init__(self):
        self.requested = False
        try:
            signal.signal(signal.SIGTERM, self._handle)
        except ValueError:  # not the main thread (e.g. inside a test runner thread)
            pass

    def _handle(self, signum, frame):
        del signum, frame
        logging.warning("SIGTERM received: checkpointing after the current step")
        self.requested = True


def _reward_kind(cfg: ExperimentConfig) -> str:
    return "exact_match" if cfg.data.task == "arithmetic" else "math_verify"


def _host_float_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in jax.device_get(metrics).items()}


def _response_texts(tokenizer, batch: RolloutBatch) -> list[str]:
    stop = set(getattr(tokenizer, "stop_tokens", ()) or ())
    out = []
    for i in range(batch.num_rows):
        ids = [int(t) for t in batch.response(i) if int(t) not in stop]
        out.append(tokenizer.decode(ids))
    return out


def _check_same_architecture(ours, theirs, path: str) -> None:
    fields = [
        "vocab_size",
        "d_model",
        "n_layers",
        "n_heads",
        "n_kv_heads",
        "head_dim",
        "d_ff",
        "rope_theta",
        "rms_norm_eps",
        "tie_embeddings",
    ]
    diff = [
        f"{f}: config {getattr(ours, f)!r} vs checkpoint {getattr(theirs, f)!r}"
        for f in fields
        if getattr(ours, f) != getattr(theirs, f)
    ]
    if diff:
        raise ValueError(
            f"config.model does not match the checkpoint {path!r}: "
            + "; ".join(diff)
            + " (set config.model.preset / fields to match)"
        )


def rl_batch_from_rollouts(batch: RolloutBatch, advantages: np.ndarray) -> step_lib.RLBatch:
    """Host RolloutBatch (stats at the column of the token they describe) -> RLBatch (targets).

    The train step predicts tokens[:, 1:] from tokens[:, :-1], so every per-token array is
    shifted by one column; the prompt and its response are contiguous in each row.
    """
    n, t = batch.tokens.shape
    valid = batch.prompt_mask | batch.response_mask
    shift = lambda x: np.ascontiguousarray(x[:, 1:])
    return step_lib.RLBatch(
        tokens=batch.tokens.astype(np.int32),
        positions=np.broadcast_to(np.arange(t, dtype=np.int32), (n, t)).copy(),
        valid=valid,
        response_mask=shift(batch.response_mask),
        logp_rollout=shift(batch.behaviour_logprobs).astype(np.float32),
        logp_full_rollout=shift(batch.unpruned_logprobs).astype(np.float32),
        pruned_mass_rollout=shift(batch.pruned_mass).astype(np.float32),
        safe_size_rollout=shift(batch.safe_size).astype(np.float32),
        advantages=advantages.astype(np.float32),
        logp_old=np.zeros((n, t - 1), np.float32),
    )


def _to_global(tree, shardings):
    """Host-local numpy arrays -> global jax Arrays (each process contributes its rows)."""
    if shardings is None:
        return jax.tree.map(jnp.asarray, tree)
    return jax.tree.map(lambda x, s: jax.make_array_from_process_local_data(s, x), tree, shardings)


class Trainer:
    """Owns the model, engine, data and checkpoints of one run."""

    def __init__(self, cfg: ExperimentConfig, workdir: str):
        self.cfg = cfg
        self.workdir = os.path.abspath(workdir)
        os.makedirs(self.workdir, exist_ok=True)
        self.is_lead = jax.process_index() == 0

        # ------------------------------------------------------------------ tokenizer, mesh
        self.tokenizer = load_tokenizer(cfg.data.tokenizer)
        self.mesh = make_mesh(cfg.mesh)
        self.sharder = Sharder(self.mesh, TRAIN_RULES)

        # ------------------------------------------------------------------ trainer model
        if cfg.train.prompts_per_step % jax.process_count():
            raise ValueError(
                f"config.train.prompts_per_step={cfg.train.prompts_per_step} must be divisible "
                f"by the number of processes ({jax.process_count()})"
            )
        self.prompts_per_host = cfg.train.prompts_per_step // jax.process_count()
        if cfg.init_hf_path:
            _check_same_architecture(cfg.model, load_hf_config(cfg.init_hf_path), cfg.init_hf_path)
            model = load_hf(
                cfg.init_hf_path, TRAIN_POLICY, self.sharder, cfg=cfg.model, remat=cfg.train.remat
            )
        else:
            model = init_sharded(
                lambda: Transformer(
                    cfg.model,
                    TRAIN_POLICY,
                    self.sharder,
                    rngs=nnx.Rngs(cfg.train.seed),
                    remat=cfg.train.remat,
                ),
                self.sharder,
            )
        self.optimizer = make_optimizer(
            cfg.train.learning_rate,
            cfg.train.warmup_steps,
            cfg.train.weight_decay,
            cfg.train.grad_clip,
            cfg.train.b1,
            cfg.train.b2,
        )
        self.graphdef, self.state, self.state_sh = init_train_state(
            model, self.optimizer, cfg.train.seed, self.sharder
        )

        # ------------------------------------------------------------------ rollout engine
        # One engine per host on its local devices; weights arrive by `_sync_weights`.
        self.engine = RolloutEngine(
            cfg.model,
            EngineConfig(
                dtype=cfg.rollout.dtype,
                noise_std=cfg.rollout.logit_noise,
                max_concurrent_decodes=cfg.rollout.num_slots,
                max_prefill_length=cfg.data.max_prompt_len,
                prefill_buckets=(cfg.data.max_prompt_len,),
                max_decode_length=cfg.rollout.max_new_tokens,
                temperature=cfg.rollout.temperature,
                log_rho=cfg.rollout_log_rho,
                seed=cfg.train.seed,
            ),
            tokenizer=self.tokenizer,
            params=model,
            mesh=make_mesh(
                MeshConfig(1, 1, cfg.rollout.tensor_parallel),
                jax.local_devices()[: cfg.rollout.tensor_parallel],
            ),
        )

        # ------------------------------------------------------------------ data
        if cfg.data.task == "arithmetic":
            self.task = cfg.data.arithmetic_task()
            source = self.task
        else:
            self.task = None
            source = cfg.data.path
        self.data = pipeline.make_prompt_iterator(
            source,
            self.tokenizer,
            batch_size=self.prompts_per_host,
            max_prompt_len=cfg.data.max_prompt_len,
            seed=cfg.data.seed,
            chat_format=cfg.data.chat_format,
        )
        if self.data.report is not None:
            logging.info("data: %s", self.data.report.summary())
        self.heldout = self._heldout_examples()

        # ------------------------------------------------------------------ steps (jit once)
        self._rl_step = None  # built on the first batch (its shapes fix the shardings)
        self._logprob_fn = jax.jit(
            lambda params, b: step_lib.token_logprobs(
                params,
                self.graphdef,
                b.tokens,
                b.positions,
                b.valid,
                log_rho=cfg.loss.effective_log_rho,
                temperature=cfg.loss.temperature,
                chunk_size=cfg.train.chunk_size,
            )
        )

        # ------------------------------------------------------------------ output
        self.checkpointer = Checkpointer(self.workdir, cfg.checkpoint.keep)
        self.writer = metric_writers.create_default_writer(
            self.workdir, just_logging=not self.is_lead, asynchronous=False
        )
        self.metrics_path = os.path.join(self.workdir, "metrics.jsonl")
        if self.is_lead:  # the architecture, for tools that read checkpoints (the server)
            with open(os.path.join(self.workdir, "model_config.json"), "w") as fh:
                json.dump(cfg.model.to_hf(), fh, indent=2)
        self.preemption = _Preemption()

    # ==========================================================================================
    # Pieces
    # ==========================================================================================
    def _heldout_examples(self) -> list[tasks.Example]:
        if self.task is not None:
            return self.task.heldout_examples(self.cfg.eval.num_prompts)
        if self.cfg.data.eval_path:
            examples, report = tasks.load_math_dataset(
                self.cfg.data.eval_path,
                self.tokenizer,
                max_prompt_tokens=self.cfg.data.max_prompt_len,
                chat_format=self.cfg.data.chat_format,
            )
            logging.info("eval data: %s", report.summary())
            return examples[: self.cfg.eval.num_prompts]
        return []

    def _sync_weights(self) -> None:
        """Trainer fp32 params -> rollout engine (cast to the rollout dtype, resharded)."""
        params = self.state.params
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            # Each host's engine needs the full weights on its local devices: cast to the
            # rollout dtype on device first so the gather moves half the bytes (bf16).
            dtype = self.cfg.rollout.policy.param_dtype
            params = multihost_utils.process_allgather(
                jax.tree.map(lambda x: x.astype(dtype), params), tiled=True
            )
        self.engine.update_params(nnx.merge(self.graphdef, params))

    def _rollout_key(self, step: int, stream: int) -> jax.Array:
        """fold_in(run key, stream, step, host): a pure function of the checkpointed key."""
        key = jax.random.wrap_key_data(jax.device_get(self.state.rng))
        key = jax.random.fold_in(jax.random.fold_in(key, stream), step)
        return jax.random.fold_in(key, jax.process_index())

    def evaluate(self, step: int) -> dict[str, float]:
        """Held-out accuracy avg@k: k sampled responses per held-out prompt, mean reward.

        Samples with the rollout engine (its precision and min-p rule), without the
        experimental logit noise unless `eval.with_rollout_noise`.
        """
        if not self.heldout:
            return {}
        k = self.cfg.eval.k
        batch = generate_rollouts(
            self.engine,
            [ex.prompt for ex in self.heldout],
            k,
            self._rollout_key(step, _EVAL_STREAM),
            prompt_len=self.cfg.data.max_prompt_len,
            sampling=None
            if self.cfg.eval.with_rollout_noise
            else self.engine.config.sampling_params(noise_std=0.0),
        )
        texts = _response_texts(self.tokenizer, batch)
        answers = [ex.answer for ex in self.heldout for _ in range(k)]
        r = rewards.compute_rewards(_reward_kind(self.cfg), texts, answers)
        return {
            "eval_accuracy": float(np.mean(r)),
            "eval_pass_at_k": float(np.mean(r.reshape(-1, k).max(axis=1))),
        }

    def _log(self, step: int, metrics: dict[str, float]) -> None:
        self.writer.write_scalars(step, metrics)
        if self.is_lead:
            with open(self.metrics_path, "a") as fh:
                fh.write(json.dumps({"step": step, **metrics}) + "\n")

    def _truncate_metrics(self, step: int) -> None:
        """On resume, drop log rows written after the checkpoint (they will be redone)."""
        if not (self.is_lead and os.path.exists(self.metrics_path)):
            return
        with open(self.metrics_path) as fh:
            rows = [json.loads(line) for line in fh if line.strip()]
        with open(self.metrics_path, "w") as fh:
            for row in rows:
                if row["step"] <= step:
                    fh.write(json.dumps(row) + "\n")

    def _save(self, step: int, extra: dict) -> None:
        self.checkpointer.save(step, self.state, self.data.get_state(), extra)

    # ==========================================================================================
    # Supervised warm-up
    # ==========================================================================================
    def warmup(self) -> None:
        sft = self.cfg.sft
        if sft.steps == 0 or self.task is None:
            return
        logging.info("supervised warm-up: %d steps of batch %d", sft.steps, sft.batch_size)
        optimizer = make_optimizer(sft.learning_rate, sft.warmup_steps, 0.0, 1.0)
        _, sft_state, sft_sh = init_train_state(
            nnx.merge(self.graphdef, self.state.params),
            optimizer,
            self.cfg.train.seed,
            self.sharder,
        )
        max_len = self.cfg.data.max_prompt_len + self.cfg.rollout.max_new_tokens
        fn = jax.jit(
            lambda s, b: step_lib.sft_step(
                s,
                b,
                graphdef=self.graphdef,
                optimizer=optimizer,
                chunk_size=self.cfg.train.chunk_size,
            ),
            donate_argnums=0,
        )
        start = time.time()
        for i in range(sft.steps):
            b = pipeline.sft_batch_for_step(
                self.task, self.tokenizer, step=i, batch_size=sft.batch_size, max_len=max_len
            )
            sft_state, metrics = fn(sft_state, (b.tokens, b.loss_mask, b.lengths))
            if (i + 1) % max(1, sft.steps // 10) == 0 or i + 1 == sft.steps:
                loss = float(metrics["sft_loss"])
                rate = (i + 1) / (time.time() - start)
                logging.info(
                    "sft %d/%d | loss %.4f | %.1f steps/s | ETA %.0fs",
                    i + 1,
                    sft.steps,
                    loss,
                    rate,
                    (sft.steps - i - 1) / rate,
                )
                self._log(-sft.steps + i + 1, {"sft_loss": loss, "phase_sft": 1.0})
        # RL starts from the warmed-up weights with a fresh optimizer.
        del sft_sh
        self.state = jax.jit(
            lambda p, s: TrainState(
                step=s.step, params=p, opt_state=self.optimizer.init(p), rng=s.rng
            ),
            out_shardings=self.state_sh,
        )(sft_state.params, self.state)

    # ==========================================================================================
    # One RL step
    # ==========================================================================================
    def rl_step(self, step: int) -> dict[str, float]:
        cfg = self.cfg
        t0 = time.time()
        prompts = next(self.data)
        token_lists = [prompts.tokens[i, : prompts.lengths[i]] for i in range(len(prompts.lengths))]
        rollouts = generate_rollouts(
            self.engine,
            token_lists,
            cfg.train.group_size,
            self._rollout_key(step, _ROLLOUT_STREAM),
            prompt_len=cfg.data.max_prompt_len,
        )
        t_rollout = time.time() - t0

        # Rewards on host, then RLOO advantages (E8).
        texts = _response_texts(self.tokenizer, rollouts)
        answers = [a for a in prompts.answers for _ in range(cfg.train.group_size)]
        reward = rewards.compute_rewards(_reward_kind(cfg), texts, answers)
        advantages = np.asarray(adv.rloo(jnp.asarray(reward), cfg.train.group_size))
        host_batch = rl_batch_from_rollouts(rollouts, advantages)

        # Train (fp32), possibly several PPO mini-batch updates on this rollout batch.
        t1 = time.time()
        metrics = self._update(host_batch)
        t_train = time.time() - t1
        self._sync_weights()

        n_tokens = int(rollouts.response_mask.sum())
        metrics.update(
            reward_mean=float(reward.mean()),
            response_length=float(rollouts.response_lengths.mean()),
            frac_finished=float(rollouts.finished.mean()),
            rollout_s=t_rollout,
            train_s=t_train,
            rollout_tok_s=n_tokens / max(t_rollout, 1e-9),
        )
        return metrics

    def _update(self, host_batch: step_lib.RLBatch) -> dict[str, float]:
        cfg = self.cfg
        u = cfg.train.updates_per_batch
        rows = host_batch.tokens.shape[0]
        if u > 1:
            # Decoupled PPO: log pi_S_old from the params before the first update on this batch.
            full = _to_global(host_batch, self._batch_sh(host_batch))
            old = self._logprob_fn(self.state.params, full).logp
            if jax.process_count() > 1:
                from jax.experimental import multihost_utils

                pid = jax.process_index()
                old = multihost_utils.process_allgather(old, tiled=True)[
                    pid * rows : (pid + 1) * rows
                ]
            host_batch.logp_old = np.asarray(jax.device_get(old), np.float32)
        per = rows // u
        all_metrics = []
        for i in range(u):
            mb = jax.tree.map(lambda x, i=i: x[i * per : (i + 1) * per], host_batch)
            batch = _to_global(mb, self._batch_sh(mb))
            if self._rl_step is None:
                self._rl_step = step_lib.jit_step(
                    lambda s, b: step_lib.rl_step(
                        s,
                        b,
                        graphdef=self.graphdef,
                        optimizer=self.optimizer,
                        loss_cfg=cfg.loss,
                        chunk_size=cfg.train.chunk_size,
                        micro_batches=cfg.train.micro_batches,
                    ),
                    self.state_sh,
                    self._batch_sh(mb),
                    self.sharder,
                )
            self.state, metrics = self._rl_step(self.state, batch)
            all_metrics.append(_host_float_metrics(metrics))
        return {k: float(np.mean([m[k] for m in all_metrics])) for k in all_metrics[0]}

    def _batch_sh(self, host_batch):
        if self.mesh is None:
            return None
        global_batch = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(
                (x.shape[0] * jax.process_count(),) + x.shape[1:], x.dtype
            ),
            host_batch,
        )
        return step_lib.batch_shardings(global_batch, self.sharder)

    # ==========================================================================================
    # The run
    # ==========================================================================================
    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        start_time = time.time()
        latest = self.checkpointer.latest_step()
        if latest is None:
            self.warmup()
            self._sync_weights()
            start_eval = self.evaluate(0)
            self._log(0, {**start_eval, "phase": 0.0})
            extra = {"start_eval": start_eval}
            self._save(0, extra)
        else:
            abstract = abstract_like(self.state, self.state_sh)
            self.state, data_state, extra = self.checkpointer.restore(abstract, latest)
            self.data.set_state(data_state)
            self._truncate_metrics(latest)
            self._sync_weights()
            logging.info("resumed from step %d in %s", latest, self.workdir)
        start_eval = extra.get("start_eval", {})

        first = int(jax.device_get(self.state.step))
        last_eval = dict(start_eval)
        t_loop = time.time()
        for step in range(first + 1, cfg.train.steps + 1):
            metrics = self.rl_step(step)
            if cfg.eval.every and step % cfg.eval.every == 0 and step != cfg.train.steps:
                last_eval = self.evaluate(step)
                metrics.update(last_eval)
            if step % cfg.log_every == 0 or step == cfg.train.steps:
                self._log(step, metrics)
                done = step - first
                rate = done / (time.time() - t_loop)
                logging.info(
                    "step %d/%d | reward %.3f | loss %.4f | ppl_gap %.4f | excluded %.3f | "
                    "%.2f steps/s | ETA %.0fs",
                    step,
                    cfg.train.steps,
                    metrics["reward_mean"],
                    metrics["loss"],
                    metrics.get("ppl_gap", math.nan),
                    metrics.get("frac_responses_excluded", math.nan),
                    rate,
                    (cfg.train.steps - step) / max(rate, 1e-9),
                )
            if (
                (cfg.checkpoint.every and step % cfg.checkpoint.every == 0)
                or step == cfg.train.steps
                or self.preemption.requested
            ):
                self._save(step, extra)
            if self.preemption.requested:
                logging.warning(
                    "preempted: checkpoint saved at step %d; rerun the same command to resume", step
                )
                return {"preempted_at": step}

        final_eval = self.evaluate(cfg.train.steps)
        self._log(cfg.train.steps, {**final_eval, "phase": 1.0})
        summary = {
            "steps": cfg.train.steps,
            "method": cfg.method,
            "rollout_dtype": cfg.rollout.dtype,
            "start_eval_accuracy": start_eval.get("eval_accuracy"),
            "eval_accuracy": final_eval.get("eval_accuracy"),
            "eval_pass_at_k": final_eval.get("eval_pass_at_k"),
            "wall_time_s": time.time() - start_time,
            "skipped_updates": float(jax.device_get(self.state.opt_state.total_notfinite)),
            "data_malformed_rows": (
                self.data.report.num_malformed if self.data.report is not None else 0
            ),
        }
        summary.update(
            self._tail_means(
                [
                    "ppl_gap",
                    "log_ppl_diff",
                    "reward_mean",
                    "frac_responses_excluded",
                    "frac_outside_train_safe",
                ]
            )
        )
        if self.is_lead:
            with open(os.path.join(self.workdir, "summary.json"), "w") as fh:
                json.dump(summary, fh, indent=2)
        self.writer.flush()
        return summary

    def _tail_means(self, keys, last: int = 5) -> dict[str, float]:
        if not os.path.exists(self.metrics_path):
            return {}
        with open(self.metrics_path) as fh:
            rows = [json.loads(line) for line in fh if line.strip()]
        rows = [r for r in rows if r["step"] > 0 and "loss" in r][-last:]
        return {
            f"final_{k}": float(np.mean([r[k] for r in rows if k in r]))
            for k in keys
            if any(k in r for r in rows)
        }

    def close(self):
        self.checkpointer.close()
        self.writer.close()


def train(cfg: ExperimentConfig, workdir: str) -> dict[str, Any]:
    trainer = Trainer(cfg, workdir)
    try:
        return trainer.run()
    finally:
        trainer.close()
