"""Rewards and held-out evaluation on the host: responses -> text -> verifier -> scores."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from dvp_jax.data import math_data, rewards, tasks
from dvp_jax.rollout.engine import RolloutEngine
from dvp_jax.rollout.offline import RolloutBatch, generate_rollouts
from dvp_jax.rollout.sampling import SamplingParams
from dvp_jax.train.sections import DataConfig


def response_texts(tokenizer, batch: RolloutBatch) -> list[str]:
    """Each row's response decoded to text, stop tokens removed."""
    stop = set(getattr(tokenizer, "stop_tokens", ()) or ())
    out = []
    for i in range(batch.num_rows):
        ids = [int(t) for t in batch.response(i) if int(t) not in stop]
        out.append(tokenizer.decode(ids))
    return out


def rollout_rewards(
    tokenizer, batch: RolloutBatch, answers: Sequence[str], kind: str
) -> np.ndarray:
    """[N] float rewards of a rollout batch against each row's reference answer; a response cut
    at `max_decode_length` (no stop token) gets 0 whatever it contains."""
    r = rewards.compute_rewards(kind, response_texts(tokenizer, batch), list(answers))
    return np.where(batch.finished, r, 0.0).astype(r.dtype)


def sum_over_hosts(values: Sequence[float]) -> list[float]:
    """Each value summed over processes (float64), the same list on every host."""
    sums = np.asarray(values, np.float64)
    if jax.process_count() > 1:
        sums = np.asarray(multihost_utils.process_allgather(sums)).sum(axis=0)
    return [float(x) for x in sums]


def host_share(num: int) -> tuple[int, int]:
    """[start, stop) of this process's contiguous share of `num` items (the first
    `num % process_count` hosts take one more)."""
    count, index = jax.process_count(), jax.process_index()
    base, extra = divmod(num, count)
    start = index * base + min(index, extra)
    return start, start + base + (index < extra)


def heldout_examples(data: DataConfig, task, tokenizer, num_prompts: int) -> list[tasks.Example]:
    """The held-out prompts: the task's own split, or `data.eval_path` for math data."""
    if task is not None:
        return task.heldout_examples(num_prompts)
    if not data.eval_path:
        return []
    examples, report = math_data.load_math_dataset(
        data.eval_path,
        tokenizer,
        max_prompt_tokens=data.max_prompt_len,
        chat_format=data.chat_format,
    )
    logging.info("eval data: %s", report.summary())
    return examples[:num_prompts]


def evaluate(
    engine: RolloutEngine,
    examples: Sequence[tasks.Example],
    k: int,
    key: jax.Array,
    *,
    prompt_len: int,
    kind: str,
    sampling: SamplingParams | None = None,
    should_stop=None,
) -> dict[str, float]:
    """Held-out accuracy avg@k (mean reward of k samples per prompt) and pass@k.

    Each process evaluates its contiguous share of `examples` (`host_share`) with the rollout
    engine (its precision and min-p rule) and `sampling` (default the engine's); example i is
    sampled with `fold_in(key, i)` whichever host runs it, and the sums are added over
    processes, so every host returns the figures one process would. Returns {} when there are
    no held-out prompts. `should_stop` is asked between rollout dispatches
    (`generate_rollouts`, which raises `RolloutInterrupted`).
    """
    if not examples:
        return {}
    start, stop = host_share(len(examples))
    mine = list(examples)[start:stop]
    sums = [0.0] * 4  # reward sum, samples, pass@k sum, prompts
    if mine:
        batch = generate_rollouts(
            engine,
            [ex.prompt for ex in mine],
            k,
            key,
            prompt_len=prompt_len,
            sampling=sampling,
            first_prompt_index=start,
            should_stop=should_stop,
        )
        answers = [ex.answer for ex in mine for _ in range(k)]
        r = rollout_rewards(engine.tokenizer, batch, answers, kind)
        sums = [r.sum(), r.size, r.reshape(-1, k).max(axis=1).sum(), len(mine)]
    sums = sum_over_hosts(sums)
    return {
        "eval_accuracy": float(sums[0] / sums[1]),
        "eval_pass_at_k": float(sums[2] / sums[3]),
    }
