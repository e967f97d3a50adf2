"""Rewards and held-out evaluation on the host: responses -> text -> reward terms -> scores.

The validation sets of a run (`heldout_sets`): its own held-out set (the task's split or
`data.eval_path`, logged as eval_accuracy / eval_pass_at_k) and the named `eval.sets` (logged
as eval/<name>/accuracy, eval/<name>/pass_at_k), each with its k and reward. `evaluate` scores
one set with a rollout engine; `evaluate_sets` all of them. Not here: building engines or
loading weights (`parts`, `dvp_jax.evaluate`).
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Sequence

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from dvp_jax.data import math_data, rewards, tasks
from dvp_jax.errors import DataError
from dvp_jax.rollout.engine import RolloutEngine
from dvp_jax.rollout.offline import RolloutBatch, generate_rollouts
from dvp_jax.rollout.sampling import SamplingParams
from dvp_jax.train.eval_sections import HELDOUT, EvalConfig
from dvp_jax.train.sections import DataConfig

# Sample rows (prompt, response, reward, ...) returned per set, from its first prompts.
SAMPLE_ROWS = 8


def response_texts(tokenizer, batch: RolloutBatch, rows: int | None = None) -> list[str]:
    """Each row's (of the first `rows`: all by default) response decoded to text, stop tokens
    removed."""
    stop = set(getattr(tokenizer, "stop_tokens", ()) or ())
    out = []
    for i in range(batch.num_rows if rows is None else min(rows, batch.num_rows)):
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


@dataclasses.dataclass(frozen=True)
class HeldoutSet:
    """One validation set: its prompts, k samples each, scored by the reward spec `reward`.

    `name` is `eval_sections.HELDOUT` for the run's own held-out set, else its `eval.sets` name.
    """

    name: str
    examples: list[tasks.Example]
    k: int
    reward: str

    @property
    def metric_names(self) -> tuple[str, str]:
        """(avg@k, pass@k) metric names (declared in `dvp_jax.metrics`)."""
        if self.name == HELDOUT:
            return "eval_accuracy", "eval_pass_at_k"
        return f"eval/{self.name}/accuracy", f"eval/{self.name}/pass_at_k"


def load_examples(
    path: str, tokenizer, data: DataConfig, fields: math_data.RowFields, num_prompts: int
) -> list[tasks.Example]:
    """The first `num_prompts` usable rows of a math file (ValueError if it has none)."""
    examples, report = math_data.load_math_dataset(
        path,
        tokenizer,
        max_prompt_tokens=data.max_prompt_len,
        chat_format=data.chat_format,
        fields=fields,
    )
    logging.info("eval data: %s", report.summary())
    if not examples:
        raise ValueError(f"no usable rows: {report.summary()}")
    return examples[:num_prompts]


def heldout_examples(data: DataConfig, task, tokenizer, num_prompts: int) -> list[tasks.Example]:
    """The held-out prompts: the task's own split, or `data.eval_path` for math data."""
    if task is not None:
        return task.heldout_examples(num_prompts)
    if not data.eval_path:
        return []
    return load_examples(data.eval_path, tokenizer, data, data.fields, num_prompts)


def heldout_sets(data: DataConfig, eval_cfg: EvalConfig, task, tokenizer) -> list[HeldoutSet]:
    """The run's validation sets: its held-out set (if any), then `eval.sets` in order, each
    loaded and checked now; a file that cannot be used raises `DataError` naming its field."""
    out = []
    try:
        main = heldout_examples(data, task, tokenizer, eval_cfg.num_prompts)
    except (OSError, ValueError) as e:
        raise DataError(f"config.data.eval_path: {e}") from e
    if main:
        # Accuracy is the task's answer check, not the training reward's shaping terms.
        out.append(HeldoutSet(HELDOUT, main, eval_cfg.k, data.verifier))
    for i, s in enumerate(eval_cfg.sets):
        try:
            examples = load_examples(
                s.path, tokenizer, data, s.fields(data), s.num_prompts or eval_cfg.num_prompts
            )
        except (OSError, ValueError) as e:
            raise DataError(f"config.eval.sets[{i}] ({s.name}): {e}") from e
        out.append(HeldoutSet(s.name, examples, s.k or eval_cfg.k, s.reward or data.verifier))
    return out


def evaluate(
    engine: RolloutEngine,
    examples: Sequence[tasks.Example],
    k: int,
    key: jax.Array,
    *,
    prompt_len: int,
    reward: str,
    sampling: SamplingParams | None = None,
    should_stop=None,
    name: str = HELDOUT,
    sample_rows: list | None = None,
) -> dict[str, float]:
    """Held-out accuracy avg@k (mean reward of k samples per prompt) and pass@k of one set
    (`name`: the metric names of `HeldoutSet.metric_names`), scored by the reward spec `reward`.

    Each process evaluates its contiguous share of `examples` (`host_share`) with the rollout
    engine (its precision and min-p rule) and `sampling` (default the engine's); example i is
    sampled with `fold_in(key, i)` whichever host runs it, and the sums are added over
    processes, so every host returns the figures one process would. Returns {} when there are
    no held-out prompts. `should_stop` is asked between rollout dispatches
    (`generate_rollouts`, which raises `RolloutInterrupted`).

    `sample_rows`: if a list, process 0 appends one dict per sampled response of the first
    prompts (at most `SAMPLE_ROWS`): set, prompt, response, answer, reward, finished. (The
    rollout samples inside its own safe set, so a RolloutBatch records no excluded tokens.)
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
        r = rollout_rewards(
            engine.tokenizer,
            batch,
            answers,
            reward,
            max_decode_length=engine.config.max_decode_length,
        )
        sums = [r.sum(), r.size, r.reshape(-1, k).max(axis=1).sum(), len(mine)]
        if sample_rows is not None and start == 0:
            sample_rows.extend(_sample_rows(name, mine, k, batch, r, engine.tokenizer))
    sums = sum_over_hosts(sums)
    accuracy, pass_at_k = HeldoutSet(name, [], k, reward).metric_names
    return {accuracy: float(sums[0] / sums[1]), pass_at_k: float(sums[2] / sums[3])}


def _sample_rows(name, examples, k, batch: RolloutBatch, r: np.ndarray, tokenizer) -> list[dict]:
    """The first `SAMPLE_ROWS` responses (row i: prompt i // k) as dicts."""
    return [
        {
            "set": name,
            "prompt": examples[i // k].prompt,
            "response": text,
            "answer": examples[i // k].answer,
            "reward": float(r[i]),
            "finished": bool(batch.finished[i]),
        }
        for i, text in enumerate(response_texts(tokenizer, batch, SAMPLE_ROWS))
    ]


def evaluate_sets(
    engine: RolloutEngine,
    sets: Sequence[HeldoutSet],
    key: jax.Array,
    *,
    prompt_len: int,
    sampling: SamplingParams | None = None,
    should_stop=None,
    sample_rows: list | None = None,
) -> dict[str, float]:
    """`evaluate` of every set, their metrics in one dict. The run's held-out set is sampled
    with `key`, a named set with `fold_in(key, crc32(name))`: its figures do not depend on
    which other sets there are or their order."""
    metrics = {}
    for s in sets:
        set_key = key if s.name == HELDOUT else jax.random.fold_in(key, _name_hash(s.name))
        metrics |= evaluate(
            engine,
            s.examples,
            s.k,
            set_key,
            prompt_len=prompt_len,
            reward=s.reward,
            sampling=sampling,
            should_stop=should_stop,
            name=s.name,
            sample_rows=sample_rows,
        )
    return metrics


def _name_hash(name: str) -> int:
    return zlib.crc32(name.encode()) & 0x7FFFFFFF
