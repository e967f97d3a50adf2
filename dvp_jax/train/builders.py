"""What a run is built from: the trainer model, the rollout engine, the workdir check and the
preemption signals. `Trainer` (train/trainer.py) wires them into the loop."""

from __future__ import annotations

import json
import signal

import jax
import numpy as np
from absl import logging
from flax import nnx

from dvp_jax.checkpoint import Checkpointer
from dvp_jax.errors import ConfigError, UserError
from dvp_jax.model import DTypePolicy, Transformer
from dvp_jax.model.hf_import import load_hf
from dvp_jax.rollout.engine import EngineConfig, RolloutEngine
from dvp_jax.sharding import MeshConfig, Sharder, init_sharded, make_mesh
from dvp_jax.train import resume
from dvp_jax.train.config import ExperimentConfig
from dvp_jax.workdir import as_path


class Preemption:
    """Whether the run should checkpoint and stop: SIGTERM or SIGINT, agreed on by every host.

    One process: handlers set a flag that `requested()` reads at any moment, so the trainer
    stops between evaluation and rollout dispatches as well as after a step. The first SIGINT
    (Ctrl-C) is handled like SIGTERM; a second one interrupts at once (KeyboardInterrupt).
    Several processes: JAX's distributed runtime catches SIGTERM (its preemption notifier) and
    Orbax's `reached_preemption(step)` answers True on every host at the same step, so all
    hosts enter the collective save together; no Python handler is installed there (it would
    replace JAX's), and `requested()` is always False (hosts stop at step boundaries only: a
    host leaving a rollout alone would leave the others waiting in the next collective).
    """

    EXIT_CODES = {"SIGTERM": 75, "SIGINT": 130}  # EX_TEMPFAIL "try again"; 128 + SIGINT

    def __init__(self, checkpointer: Checkpointer):
        self._checkpointer = checkpointer
        self.signal_name: str | None = None
        self._polls = -1
        self._previous = {}  # the handlers ours replaced, put back by `close`
        if jax.process_count() == 1:
            try:
                for sig in (signal.SIGTERM, signal.SIGINT):
                    self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. inside a test runner thread)
                pass

    def close(self) -> None:
        """Puts back the handlers this object replaced (a library user's Ctrl-C works again
        once the trainer is closed)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    @property
    def exit_code(self) -> int:
        return self.EXIT_CODES.get(self.signal_name or "SIGTERM", 75)

    def _handle(self, signum, frame):
        del frame
        name = signal.Signals(signum).name
        if signum == signal.SIGINT:  # a second Ctrl-C stops at once
            signal.signal(signal.SIGINT, signal.default_int_handler)
        if self.signal_name is None:
            logging.warning("%s received: saving a checkpoint and stopping", name)
            self.signal_name = name

    def requested(self) -> bool:
        """Whether this process was asked to stop (one process only; see the class doc)."""
        return self.signal_name is not None

    def reached(self, step: int) -> bool:
        """Call after step `step` on every host (the same steps on all of them).

        The hosts agree through a poll counter (0, 1, 2, ... in call order, the same on every
        host), not `step` itself: warm-up steps are negative and JAX's sync manager reads an
        unset sync point as -1, so asking with step -1 would answer True with no SIGTERM.
        """
        del step
        if jax.process_count() == 1:
            return self.requested()
        self._polls += 1
        return self._checkpointer.manager.reached_preemption(self._polls)


# ==============================================================================================
# Building the pieces of a run
# ==============================================================================================
def load_run_tokenizer(spec: str):
    """`config.data.tokenizer` loaded; a path that does not load is the user's mistake."""
    from dvp_jax.rollout.tokenizers import load_tokenizer

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


def rollout_weights(params: nnx.State, dtype, engines=()) -> nnx.State:
    """The trainer's params as this host's engines take them (weight sync).

    One process, or engines that are each a tensor row of the trainer's mesh
    (`RolloutEngine.trainer_row_mesh`: they cast and reshard on the devices, no host): the
    params as they are. Otherwise, with several processes, the engine of each host holds the
    full weights on its local devices while the trainer's params are sharded over every host's
    devices: they are cast to `dtype` (the widest engine param dtype) on device and gathered to
    every host (`process_allgather`, through the host).
    """
    leaves = jax.tree.leaves(params)
    on_device = engines and all(e.trainer_row_mesh(leaves) is not None for e in engines)
    if jax.process_count() == 1 or on_device:
        return params
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(
        jax.tree.map(lambda x: x.astype(dtype), params), tiled=True
    )


def engine_config(cfg: ExperimentConfig, dtype: str = "") -> EngineConfig:
    """The rollout engine's settings for a run (precision `dtype`, default `rollout.dtype`)."""
    # `rollout.*` fields carry EngineConfig's names. Prompts are padded to the smallest of
    # EngineConfig's default buckets (16 ... 8192, and max_prompt_len) that holds the longest
    # prompt of a prefill call, not to max_prompt_len: 2,048 for ~200-token prompts was 10x
    # the prefill work.
    return EngineConfig.take(
        cfg.rollout,
        dtype=dtype or cfg.rollout.dtype,
        max_prefill_length=cfg.data.max_prompt_len,
        log_rho=cfg.loss.effective_log_rho,  # the trainer's rule (E1): -inf when pruning is off
        seed=cfg.train.seed,
    )


def build_engine(cfg: ExperimentConfig, tokenizer, model, dtype: str = "") -> RolloutEngine:
    """One rollout engine per host on its local devices, with `model`'s weights, at precision
    `dtype` (default `rollout.dtype`; the evaluation engine passes `eval.dtype`)."""
    r = cfg.rollout
    dtype = dtype or r.dtype
    return RolloutEngine(
        cfg.model,
        engine_config(cfg, dtype),
        tokenizer=tokenizer,
        params=rollout_weights(nnx.state(model, nnx.Param), DTypePolicy.named(dtype).param_dtype),
        mesh=engine_mesh(model.sharder.mesh, r.tensor_parallel, jax.process_index()),
    )


def engine_mesh(trainer_mesh, tensor_parallel: int, process: int) -> jax.sharding.Mesh:
    """The devices of process `process`'s engine: a tensor row of the trainer's mesh on that
    process when the tensor degrees agree (the weight sync then stays on the devices,
    `RolloutEngine.trainer_row_mesh`), else its first `tensor_parallel` devices."""
    if trainer_mesh is not None and trainer_mesh.shape["tensor"] == tensor_parallel:
        for row in np.asarray(trainer_mesh.devices).reshape(-1, tensor_parallel):
            if all(d.process_index == process for d in row):
                return make_mesh(MeshConfig(1, 1, tensor_parallel), list(row))
    # The devices of this program (a TPU topology's for `dvp_jax.aot`), else jax's.
    pool = jax.devices() if trainer_mesh is None else trainer_mesh.devices.flat
    devices = [d for d in pool if d.process_index == process]
    if tensor_parallel > len(devices):
        raise ConfigError(
            f"config.rollout.tensor_parallel={tensor_parallel} exceeds the {len(devices)} "
            "devices of one host"
        )
    return make_mesh(MeshConfig(1, 1, tensor_parallel), devices[:tensor_parallel])


class WorkdirMismatchError(ValueError, UserError):
    """The workdir holds a run started with a different config."""


def check_workdir(cfg: ExperimentConfig, workdir: str) -> None:
    """Raises `WorkdirMismatchError` (one line naming the fields) if `workdir`'s config.json
    differs from `cfg` in a field a resumed run may not change (`resume.RESUMABLE_FIELDS`)."""
    path = as_path(workdir) / "config.json"
    if not path.exists():
        return
    saved = json.loads(path.read_text())
    diff = resume.resume_mismatch(saved, cfg)
    if diff:
        raise WorkdirMismatchError(
            f"{workdir} holds a run with a different config ({'; '.join(diff)}); rerun with "
            "that config to resume it, or pass a new --workdir"
        )
