"""Grain pipelines on the host (NumPy): RL prompt batches and supervised warm-up batches.

`make_prompt_iterator` reads a generated task's train split, a math file or a list of examples
in a global shuffled order cut into global batches; each host reads its rows of every global
batch, so the union over hosts is what one process with the global batch reads and results do
not depend on the number of hosts. Its state (`get_state` / `set_state`) is JSON and
checkpointed. `sft_batch` / `sft_batch_for_step` make warm-up sequences with a loss mask; a
warm-up batch is a pure function of its step, so the step is its only state. Not here:
loading and validating math rows (`math_data`), the tasks themselves (`tasks`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import grain
import jax
import numpy as np

from dvp_jax.data import math_data, tasks

# Index space of the generated task: the per-host shard and its shuffle are lazy (grain's
# index shuffle), so the size costs nothing.
_ARITH_SPAN = 2**40
RL_STREAM, SFT_STREAM = 0, 1


# ----------------------------------------------------------------------------------------------
# Batches
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PromptBatch:
    """P prompts for one rollout step.

    Attributes:
      tokens: [P, L] int32, BOS (when the tokenizer adds one) + prompt ids, right-padded with
        `tokenizer.pad_id` to L = max_prompt_len.
      lengths: [P] int32 true lengths (BOS included).
      prompts, answers: the prompt texts and their ground truths (for the reward).
      indices: [P] int64 source index (train example number / file row).
    """

    tokens: np.ndarray
    lengths: np.ndarray
    prompts: tuple[str, ...]
    answers: tuple[str, ...]
    indices: np.ndarray


@dataclasses.dataclass(frozen=True)
class SFTBatch:
    """Supervised warm-up sequences [BOS] + prompt + response + [EOS], right-padded.

    Attributes:
      tokens: [B, L] int32.
      loss_mask: [B, L] float32, 1.0 where tokens[b, t] is a response token or the EOS (a token
        the model must predict): loss = CE(logits[:, :-1], tokens[:, 1:]) * loss_mask[:, 1:].
        E.g. (char tokenizer, "3+4=" -> "7"): <bos> 3 + 4 = 7 <eos> has mask 0 0 0 0 0 1 1.
      lengths, prompt_lengths: [B] int32 (BOS included).
    """

    tokens: np.ndarray
    loss_mask: np.ndarray
    lengths: np.ndarray
    prompt_lengths: np.ndarray


def _default_hosts(process_index: int | None, process_count: int | None) -> tuple[int, int]:
    index = jax.process_index() if process_index is None else int(process_index)
    count = jax.process_count() if process_count is None else int(process_count)
    if not 0 <= index < count:
        raise ValueError(f"need 0 <= process_index < process_count, got {index}, {count}")
    return index, count


def _add_bos(tokenizer, add_bos: bool | None) -> bool:
    return bool(getattr(tokenizer, "add_bos", True) if add_bos is None else add_bos)


def _encode_prompt(ex: tasks.Example, tokenizer, bos: bool, max_len: int) -> dict[str, Any]:
    ids = ([tokenizer.bos_id] if bos else []) + list(tokenizer.encode_ids(ex.prompt))
    if len(ids) > max_len:
        raise ValueError(
            f"prompt {ex.prompt[:60]!r} has {len(ids)} tokens > max_prompt_len={max_len}; "
            "raise max_prompt_len or make the task's prompts shorter"
        )
    tokens = np.full((max_len,), tokenizer.pad_id, np.int32)
    tokens[: len(ids)] = ids
    return {"tokens": tokens, "length": len(ids), "example": ex}


def _collate_prompts(items: Sequence[dict[str, Any]]) -> PromptBatch:
    return PromptBatch(
        tokens=np.stack([it["tokens"] for it in items]),
        lengths=np.asarray([it["length"] for it in items], np.int32),
        prompts=tuple(it["example"].prompt for it in items),
        answers=tuple(it["example"].answer for it in items),
        indices=np.asarray([it["example"].index for it in items], np.int64),
    )


# ----------------------------------------------------------------------------------------------
# RL prompt iterator
# ----------------------------------------------------------------------------------------------


class PromptIterator:
    """Iterator of `PromptBatch`es with a JSON-serialisable, checkpointable state."""

    def __init__(self, dataset: grain.IterDataset, fingerprint: dict[str, Any], report=None):
        self._it = iter(dataset)
        self._fingerprint = fingerprint
        self.report: math_data.LoadReport | None = report

    def __iter__(self) -> PromptIterator:
        return self

    def __next__(self) -> PromptBatch:
        return next(self._it)

    def get_state(self) -> dict[str, Any]:
        return {"grain": self._it.get_state(), "config": dict(self._fingerprint)}

    def set_state(self, state: dict[str, Any]) -> None:
        saved = state.get("config", {})
        diff = sorted(
            k
            for k in set(saved) | set(self._fingerprint)
            if saved.get(k) != self._fingerprint.get(k)
        )
        if diff:
            raise ValueError(
                "iterator state was saved by a differently configured pipeline; differing "
                + ", ".join(
                    f"{k}: saved {saved.get(k)!r} vs now {self._fingerprint.get(k)!r}" for k in diff
                )
            )
        self._it.set_state(state["grain"])


def make_prompt_iterator(
    source: tasks.GeneratedTask | str | os.PathLike | Sequence[tasks.Example],
    tokenizer,
    *,
    batch_size: int,
    max_prompt_len: int,
    seed: int = 0,
    shuffle: bool = True,
    num_epochs: int | None = None,
    add_bos: bool | None = None,
    process_index: int | None = None,
    process_count: int | None = None,
    chat_format: str = "chatml",
    fields: math_data.RowFields | None = None,
    read_threads: int = 0,
) -> PromptIterator:
    """An endless (`num_epochs=None`) or finite iterator of this host's `PromptBatch`es.

    Args:
      source: a `tasks.GeneratedTask` (its train split, stream 0, an endless index space), a
        jsonl / parquet / datasets-directory math file (loaded whole, its rows read at
        `fields`; its `LoadReport` is `iterator.report`), or a sequence of `Example`s.
      batch_size: prompts per host per batch; the global batch is batch_size * process_count.
      max_prompt_len: L; a generated prompt longer than this raises ValueError (a file row
        that long was skipped at load as malformed).
      seed, shuffle: the global order, reshuffled every epoch. Host h reads rows
        [h * batch_size, (h + 1) * batch_size) of each global batch, lazily (only its own
        examples are generated and encoded); with finite `num_epochs` all hosts run out after
        the same number of batches (the remainder is dropped).
      process_index, process_count: default `jax.process_index()` / `jax.process_count()`.

    `set_state(state)` on an iterator built with the same arguments continues exactly where the
    saved one was; a state of a differently configured iterator is refused, naming the fields.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if max_prompt_len < 1:
        raise ValueError(f"max_prompt_len must be >= 1, got {max_prompt_len}")
    index, count = _default_hosts(process_index, process_count)
    bos = _add_bos(tokenizer, add_bos)
    report = None

    # The global source, identical on every host.
    if isinstance(source, tasks.GeneratedTask):
        task = source
        examples = grain.MapDataset.range(_ARITH_SPAN).map(
            lambda i: task.train_example(i, RL_STREAM)
        )
        name = repr(task)
    elif isinstance(source, (str, os.PathLike)):
        # Every host reads the whole file (parsing is cheap next to a rollout), so that all
        # hosts agree on the global order; the report is the same on every host.
        loaded, report = math_data.load_math_dataset(
            source,
            tokenizer,
            max_prompt_tokens=max_prompt_len,
            chat_format=chat_format,
            fields=fields or math_data.RowFields(),
            add_bos=bos,
            process_index=0,
            process_count=1,
        )
        examples = grain.MapDataset.source(loaded)
        name = os.fspath(source)
    else:
        examples = grain.MapDataset.source(list(source))
        name = f"examples[{len(source)}]"
    source_size = len(examples)
    if source_size == 0:
        raise ValueError(f"{name}: no examples to read")
    # Global order (reshuffled every epoch), cut into global batches of batch_size * count;
    # host h reads rows [h * batch_size, (h + 1) * batch_size) of each, so the union of the
    # hosts' batches at any step is what one process with the global batch size would read.
    order = grain.MapDataset.range(source_size)
    if shuffle:
        order = order.shuffle(seed=seed)
    order = order.repeat(num_epochs)
    global_batch = batch_size * count
    per_host = (len(order) // global_batch) * batch_size
    if per_host == 0:
        raise ValueError(
            f"{name}: {source_size} examples x num_epochs={num_epochs} is less than one global "
            f"batch ({batch_size} per process x {count} processes)"
        )

    def host_item(j: int):
        position = (j // batch_size) * global_batch + index * batch_size + j % batch_size
        return examples[order[position]]

    ds = grain.MapDataset.range(per_host).map(host_item)
    ds = ds.map(lambda ex: _encode_prompt(ex, tokenizer, bos, max_prompt_len))
    ds = ds.batch(batch_size, drop_remainder=True, batch_fn=_collate_prompts)
    iter_ds = ds.to_iter_dataset(
        grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=2 * read_threads)
    )
    fingerprint = {
        "source": name,
        "batch_size": batch_size,
        "max_prompt_len": max_prompt_len,
        "seed": seed,
        "shuffle": shuffle,
        "num_epochs": num_epochs,
        "add_bos": bos,
        "process_index": index,
        "process_count": count,
        "source_size": source_size,
    }
    return PromptIterator(iter_ds, fingerprint, report)


# ----------------------------------------------------------------------------------------------
# Supervised warm-up
# ----------------------------------------------------------------------------------------------


def sft_batch(
    examples: Sequence[tasks.Example], tokenizer, *, max_len: int, add_bos: bool | None = None
) -> SFTBatch:
    """[BOS] + prompt + response + [EOS] sequences with a loss mask on response + EOS, the
    response being the example's `target` (the reference response) or else its `answer`."""
    bos = _add_bos(tokenizer, add_bos)
    b = len(examples)
    tokens = np.full((b, max_len), tokenizer.pad_id, np.int32)
    mask = np.zeros((b, max_len), np.float32)
    lengths = np.zeros((b,), np.int32)
    prompt_lengths = np.zeros((b,), np.int32)
    for row, ex in enumerate(examples):
        prompt = ([tokenizer.bos_id] if bos else []) + list(tokenizer.encode_ids(ex.prompt))
        response = ex.target or ex.answer
        target = list(tokenizer.encode_ids(response)) + [tokenizer.eos_id]
        n = len(prompt) + len(target)
        if n > max_len:
            raise ValueError(
                f"SFT sequence for {ex.prompt!r} -> {response[:60]!r} has {n} tokens > "
                f"max_len={max_len}; raise max_len"
            )
        tokens[row, :n] = prompt + target
        mask[row, len(prompt) : n] = 1.0
        lengths[row], prompt_lengths[row] = n, len(prompt)
    return SFTBatch(tokens=tokens, loss_mask=mask, lengths=lengths, prompt_lengths=prompt_lengths)


def sft_batch_for_step(
    task: tasks.GeneratedTask,
    tokenizer,
    *,
    step: int,
    batch_size: int,
    max_len: int,
    process_index: int | None = None,
    process_count: int | None = None,
) -> SFTBatch:
    """This host's warm-up batch number `step` (a pure function of the arguments)."""
    index, count = _default_hosts(process_index, process_count)
    start = (int(step) * count + index) * batch_size
    return sft_batch(task.train_examples(batch_size, start, SFT_STREAM), tokenizer, max_len=max_len)
