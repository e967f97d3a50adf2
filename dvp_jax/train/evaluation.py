"""Rewards and held-out evaluation on the host: responses -> text -> reward terms -> scores."""

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
    tokenizer,
    batch: RolloutBatch,
    answers: Sequence[str],
    spec: str | Sequence[rewards.RewardTerm],
    *,
    max_decode_length: int | None = None,
) -> np.ndarray:
    """[N] float32 weighted rewards of a rollout batch against each row's reference answer
    (`rollout_reward_terms(...).total`); a response cut at `max_decode_length` (no stop token)
    gets 0 from every text term whatever it contains."""
    return rollout_reward_terms(
        tokenizer, batch, answers, spec, max_decode_length=max_decode_length
    ).total


def rollout_reward_terms(
    tokenizer,
    batch: RolloutBatch,
    answers: Sequence[str],
    spec: str | Sequence[rewards.RewardTerm],
    *,
    max_decode_length: int | None = None,
) -> rewards.RewardScores:
    """Each reward term's values and failures and the weighted total of a rollout batch.

    `spec` is a reward spec string ("math_verify", "exact_match=1,integer_format=0.1", ...) or
    parsed terms (`DataConfig.reward_terms`). Text terms are not called on a response cut at
    `max_decode_length` (no stop token) and give it 0; length terms see every response's
    length in tokens (its stop token included); "soft_overlong" needs `max_decode_length`.
    """
    terms = rewards.parse_rewards(spec) if isinstance(spec, str) else tuple(spec)
    return rewards.score(
        terms,
        response_texts(tokenizer, batch),
        list(answers),
        finished=batch.finished,
        lengths=batch.response_lengths,
        max_decode_length=max_decode_length,
    )


def reward_metrics(scores: rewards.RewardScores) -> dict[str, float]:
    """Per-term metrics of the global batch, summed over hosts (every host calls this with the
    same terms): `reward/<name>`, the term's unweighted mean, and `reward_failures/<name>`, the
    responses on which it raised or returned a non-finite value."""
    names = list(scores.values)
    sums = sum_over_hosts(
        [scores.total.size]
        + [scores.values[n].sum(dtype=np.float64) for n in names]
        + [scores.failures[n] for n in names]
    )
    rows, values, failures = sums[0], sums[1 : 1 + len(names)], sums[1 + len(names) :]
    out = {f"reward/{n}": v / max(rows, 1.0) for n, v in zip(names, values, strict=True)}
    out |= {f"reward_failures/{n}": f for n, f in zip(names, failures, strict=True)}
    return out


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
