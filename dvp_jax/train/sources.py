"""Where a step's rollouts come from: the trainer asks `source.generate(step)` for this host's P
groups of G responses, their answers and the source's metrics.

`SyncSource` (the default): the step's P prompts from the data iterator, every response decoded
to its end (`Rollout.generate`). `PartialSource` (`rollout.partial`, `rollout/partial.py`):
the groups in flight are fed from the run's prompt stream (the data iterator yields this host's
P prompts at a time; prompts not yet drawn wait in a buffer); the b-th batch drawn is keyed as
the synchronous rollout keys step b's, `fold_in(key(b), first_prompt_index + i)`; with
`train.skip_zero_advantage` a complete group whose rewards are all equal is dropped and a later
group takes its place (DAPO's dynamic sampling), counting the groups completed per group
trained. In-flight groups and the buffer are not checkpointed: a resumed run starts without
them (`rollout/partial.py`), its batch count from the checkpoint.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from absl import logging

from dvp_jax.dvp import advantages as adv
from dvp_jax.rollout.offline import RolloutBatch
from dvp_jax.rollout.partial import PartialRollout
from dvp_jax.train import evaluation


class SyncSource:
    """The step's P prompts, each response decoded to its end (the paper's setting).

    Args:
      cfg: the run's `ExperimentConfig`.
      rollout: the run's `Rollout`.
      data: the prompt iterator (`next` gives this host's prompts of one step).
      key: step -> the step's rollout key.
      should_stop: asked between dispatches (a preemption).
    """

    def __init__(self, cfg, rollout, data, key: Callable[[int], jax.Array], should_stop):
        self.cfg, self.rollout, self.data, self.key = cfg, rollout, data, key
        self.should_stop = should_stop

    def generate(self, step: int) -> tuple[RolloutBatch, list[Any], dict[str, float]]:
        prompts = next(self.data)  # this host's rows of the global prompt batch
        n, g = len(prompts.lengths), self.cfg.train.group_size
        batch = self.rollout.generate(
            [prompts.tokens[i, : prompts.lengths[i]] for i in range(n)],
            g,
            self.key(step),
            prompt_len=self.cfg.data.max_prompt_len,
            first_prompt_index=jax.process_index() * n,
            should_stop=self.should_stop,
        )
        return batch, [a for a in prompts.answers for _ in range(g)], {}

    def for_update(self, rollouts: RolloutBatch, step: int) -> tuple[RolloutBatch, int | None]:
        """The rollouts as the update takes them, and the weight version their ages count
        from (None: no ages)."""
        del step
        return rollouts, None

    def checkpoint_extra(self) -> dict:
        """What a checkpoint records of the source (nothing: every step starts afresh)."""
        return {}

    def resumed(self, extra: dict) -> None:
        """The run resumed from a checkpoint with `extra` (nothing to restore)."""
        del extra


class PartialSource:
    """The run's partial rollouts (module docstring); arguments as `SyncSource`'s, with the
    run's tokenizer (rewards, for `skip_zero_advantage`)."""

    def __init__(self, cfg, rollout, data, key: Callable[[int], jax.Array], should_stop, tokenizer):
        self.cfg, self.data, self.key, self.tokenizer = cfg, data, key, tokenizer
        self.should_stop = should_stop
        self.engine = rollout.engine
        self.hosts = jax.process_count()
        self.first = jax.process_index() * (cfg.train.prompts_per_step // self.hosts)
        self.buffer = collections.deque()  # (token ids, answer, raw key) not yet drawn
        self.rollout = None
        self.completed, self.trained, self.rejected = 0, 0, 0
        self.dropped = 0  # responses in flight lost at a resume, logged with the next step
        self.batches = 0  # data batches drawn in the run (checkpointed: their keys)

    def _draw(self, n: int) -> list:
        """n prompts from the buffer, refilled a data batch at a time. The b-th batch drawn in
        the run is keyed as the synchronous rollout keys step b's batch (`key(b)`), so every
        prompt has its own key however many batches a step draws."""
        while len(self.buffer) < n:
            prompts = next(self.data)
            self.batches += 1
            k = len(prompts.lengths)
            keys = _prompt_keys(self.key(self.batches), self.first + np.arange(k, dtype=np.int32))
            for i in range(k):
                ids = prompts.tokens[i, : prompts.lengths[i]]
                self.buffer.append((ids, prompts.answers[i], keys[i]))
        return [self.buffer.popleft() for _ in range(n)]

    def _accept(self, group) -> bool:
        """A complete group is trained unless skip_zero_advantage drops it (equal rewards)."""
        self.completed += 1
        if not self.cfg.train.skip_zero_advantage:
            return True
        batch = self.rollout.batch_of([group])
        scores = evaluation.rollout_reward_terms(
            self.tokenizer,
            batch,
            [group.payload] * len(group.responses),
            self.cfg.data.reward_terms,
            max_decode_length=self.cfg.rollout.max_decode_length,
        )
        keep = not adv.zero_advantage(scores.total, len(group.responses)).all()
        self.rejected += not keep
        return keep

    def generate(self, step: int) -> tuple[RolloutBatch, list[Any], dict[str, float]]:
        """This step's P groups (`PartialRollout.generate`), their answers and metrics."""
        c, g = self.cfg, self.cfg.train.group_size
        if self.rollout is None:
            self.rollout = PartialRollout(
                self.engine,
                g,
                c.train.prompts_per_step // self.hosts,
                c.rollout.oversample,
                c.rollout.max_staleness,
                prompt_len=c.data.max_prompt_len,
            )
        rejected = self.rejected
        batch, answers, stats = self.rollout.generate(
            self.engine.params,
            step,
            self._draw,
            accept=self._accept,
            should_stop=self.should_stop,
        )
        self.trained += len(answers)
        metrics = {
            "partial_decode_steps": stats.decode_steps,
            "partial_groups_in_flight": stats.groups_in_flight,
            "partial_carried_out": stats.carried_out,
            "partial_stale_restarts": stats.stale_restarts,
            "partial_groups_rejected": self.rejected - rejected,
            "partial_groups_per_trained": self.completed / max(self.trained, 1),
            "partial_dropped_on_resume": self.dropped,
        }
        self.dropped = 0
        return batch, [a for a in answers for _ in range(g)], metrics

    def for_update(self, rollouts: RolloutBatch, step: int) -> tuple[RolloutBatch, int | None]:
        """The rollouts as the update takes them (with `loss.mask_stale_tokens`, the tokens of
        older weight versions out of the loss) and the version their ages count from."""
        if self.cfg.loss.mask_stale_tokens:
            fresh = rollouts.response_mask & (rollouts.behaviour_version == step)
            rollouts = dataclasses.replace(rollouts, response_mask=fresh)
        return rollouts, step

    def checkpoint_extra(self) -> dict:
        """The responses in flight at the checkpoint (a resume drops them and says so)."""
        n = 0 if self.rollout is None else self.rollout.in_flight_responses()
        return {"partial_in_flight": n, "partial_batches": self.batches}

    def resumed(self, extra: dict) -> None:
        self.dropped = int(extra.get("partial_in_flight", 0))
        self.batches = int(extra.get("partial_batches", 0))
        if self.dropped:
            logging.warning(
                "partial rollouts: %d responses in flight at the checkpoint are dropped (they "
                "are not checkpointed; their prompts are not drawn again)",
                self.dropped,
            )


def _prompt_keys(base: jax.Array, indices: np.ndarray) -> np.ndarray:
    """`[n, 2]` raw keys fold_in(base, i) of the prompts' global indices (as
    `offline.generate_rollouts` keys its prompts)."""
    fold = jax.vmap(lambda i: jax.random.key_data(jax.random.fold_in(base, i)))
    return np.asarray(jax.device_get(fold(indices)))


def make_source(cfg, rollout, data, key, should_stop, tokenizer):
    """The run's source: `PartialSource` with `rollout.partial`, else `SyncSource`."""
    if cfg.rollout.partial:
        return PartialSource(cfg, rollout, data, key, should_stop, tokenizer)
    return SyncSource(cfg, rollout, data, key, should_stop)
