"""Math datasets: the prompts and ground truths of a local jsonl / parquet file (DAPO-Math layout).

`load_math_dataset` reads this host's rows (row r goes to host r % process_count) into `Example`s:
the prompt is `prompt` (else `problem` / `question`), a string or chat messages rendered by
`render_messages`; the ground truth is `reward_model.ground_truth`, else `answer` (a string or an
integer). A malformed row (bad JSON or UTF-8, a missing or mistyped field, text the tokenizer
rejects, a prompt over `max_prompt_tokens`) is skipped, logged and listed with its index in the
`LoadReport`; it never stops the load. A file-level problem (missing, unreadable, corrupt parquet)
raises an error naming the path. Not here: the generated tasks (`tasks`), the batching (`pipeline`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
from absl import logging

from dvp_jax.data.tasks import Example
from dvp_jax.workdir import as_path

_CHAT_FORMATS = ("chatml", "plain")
_PROMPT_FIELDS = ("prompt", "problem", "question")
_LOG_FIRST_N = 20
# What one bad row can raise while it is parsed, converted and tokenized: json's errors (a
# JSONDecodeError, or a ValueError for an integer over sys.get_int_max_str_digits() digits), a
# RecursionError for nesting deeper than the interpreter's limit, UnicodeError (a ValueError),
# pyarrow's conversion errors (ArrowInvalid is a ValueError; OverflowError for out-of-range
# dates), a TypeError for a value of the wrong kind, and the tokenizer's ValueError. Anything
# else (AttributeError, NameError, ...) is a bug and is not swallowed.
_ROW_ERRORS = (ValueError, TypeError, OverflowError, RecursionError)


class _Malformed(Exception):
    """A row problem; the message is the reason stored in the report."""


@dataclasses.dataclass
class LoadReport:
    """What happened to the rows of one file on this host.

    `num_rows` counts the rows this host read (its shard); `malformed` lists (row index, reason)
    for every skipped row, row indices being global (file) positions.
    """

    path: str
    num_rows: int = 0
    num_loaded: int = 0
    malformed: list[tuple[int, str]] = dataclasses.field(default_factory=list)

    @property
    def num_malformed(self) -> int:
        return len(self.malformed)

    @property
    def malformed_indices(self) -> list[int]:
        return [i for i, _ in self.malformed]

    def summary(self) -> str:
        head = ", ".join(str(i) for i in self.malformed_indices[:50])
        more = " ..." if self.num_malformed > 50 else ""
        return (
            f"{self.path}: {self.num_rows} rows read, {self.num_loaded} loaded, "
            f"{self.num_malformed} malformed skipped (rows: {head}{more})"
        )


def render_messages(messages: Sequence[dict[str, str]], chat_format: str = "chatml") -> str:
    """Chat messages -> prompt text ending where the assistant's answer starts."""
    if chat_format == "chatml":
        turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return turns + "<|im_start|>assistant\n"
    if chat_format == "plain":
        return "\n".join(m["content"] for m in messages)
    raise ValueError(f"chat_format must be one of {_CHAT_FORMATS}, got {chat_format!r}")


def _short(e: BaseException, limit: int = 300) -> str:
    """An exception's message cut to `limit` characters (a reason line, not a data dump)."""
    text = str(e)
    return text if len(text) <= limit else text[:limit] + "..."


def _check_text(value: Any, what: str) -> str:
    if isinstance(value, (bytes, bytearray)):
        try:
            value = bytes(value).decode("utf-8")
        except UnicodeDecodeError as e:
            raise _Malformed(f"{what}: undecodable UTF-8 ({e.reason} at byte {e.start})") from None
    if not isinstance(value, str):
        raise _Malformed(f"{what}: expected a string, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise _Malformed(f"{what}: undecodable text (unpaired surrogate)") from None
    if not value.strip():
        raise _Malformed(f"{what}: empty")
    return value


def _row_to_example(row: Any, index: int, chat_format: str) -> Example:
    if not isinstance(row, dict):
        raise _Malformed(f"row is a {type(row).__name__}, not an object")
    field = next((f for f in _PROMPT_FIELDS if row.get(f) is not None), None)
    if field is None:
        raise _Malformed(f"missing prompt (none of {list(_PROMPT_FIELDS)})")
    prompt = row[field]
    if isinstance(prompt, (list, tuple)):
        if not prompt:
            raise _Malformed(f"{field}: empty message list")
        messages = []
        for j, m in enumerate(prompt):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise _Malformed(f"{field}[{j}]: expected {{'role', 'content'}}, got {m!r:.60}")
            messages.append(
                {
                    "role": _check_text(m["role"], f"{field}[{j}].role"),
                    "content": _check_text(m["content"], f"{field}[{j}].content"),
                }
            )
        text = render_messages(messages, chat_format)
    else:
        text = _check_text(prompt, field)

    reward_model = row.get("reward_model")
    if isinstance(reward_model, dict) and reward_model.get("ground_truth") is not None:
        truth, where = reward_model["ground_truth"], "reward_model.ground_truth"
    elif row.get("answer") is not None:
        truth, where = row["answer"], "answer"
    else:
        raise _Malformed("missing ground truth (reward_model.ground_truth or answer)")
    if isinstance(truth, (int, np.integer)) and not isinstance(truth, (bool, np.bool_)):
        truth = str(int(truth))
    truth = _check_text(truth, where).strip()
    return Example(prompt=text, answer=truth, key=f"row{index}", index=index)


def _jsonl_rows(path: str, process_index: int, process_count: int):
    """Yields (row index, parsed object or _Malformed) for this host's lines."""
    with as_path(path).open("rb") as f:
        for index, raw in enumerate(f):
            if index % process_count != process_index or not raw.strip():
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield index, _Malformed(f"undecodable UTF-8 ({e.reason} at byte {e.start})")
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                row = _Malformed(f"invalid JSON ({e.msg} at column {e.colno})")
            except RecursionError:
                row = _Malformed(
                    f"invalid JSON: nested deeper than Python's recursion limit "
                    f"({sys.getrecursionlimit()})"
                )
            except ValueError as e:  # e.g. an integer over the int-string digit limit.
                row = _Malformed(f"invalid JSON value ({_short(e)})")
            yield index, row


def _parquet_rows(path: str, process_index: int, process_count: int):
    """Yields (row index, row dict or _Malformed) for this host's rows."""
    try:
        import pyarrow.parquet as pq
    except ImportError as e:  # pyarrow is a test extra; a parquet user needs it installed.
        raise ImportError(f"reading {path} needs pyarrow: pip install pyarrow") from e
    import pyarrow as pa

    try:
        with as_path(path).open("rb") as f:  # any epath backend (gs://...)
            table = pq.read_table(f)
    except pa.ArrowException as e:  # A file-level problem: corrupt or not parquet.
        raise ValueError(f"{path}: cannot read as parquet: {e}") from e
    used = [c for c in (*_PROMPT_FIELDS, "reward_model", "answer") if c in table.column_names]
    indices = np.arange(process_index, table.num_rows, process_count)
    shard = table.select(used).take(indices)
    try:
        rows = shard.to_pylist()
    except _ROW_ERRORS:  # e.g. invalid UTF-8 in a string column: convert one row at a time.
        rows = []
        for j in range(shard.num_rows):
            try:
                rows.append(shard.slice(j, 1).to_pylist()[0])
            except _ROW_ERRORS as e:
                rows.append(_Malformed(f"undecodable row ({type(e).__name__}: {_short(e)})"))
    yield from zip(indices.tolist(), rows, strict=True)


def load_math_dataset(
    path: str | os.PathLike,
    tokenizer,
    *,
    max_prompt_tokens: int,
    chat_format: str = "chatml",
    add_bos: bool | None = None,
    process_index: int = 0,
    process_count: int = 1,
) -> tuple[list[Example], LoadReport]:
    """Loads this host's shard of a math `.jsonl` / `.json` (one object a line) or `.parquet` file.

    Row `r` (the 0-based line number of a jsonl file, whitespace-only lines keeping their
    number; the row number of a parquet table) is parsed by host `r % process_count ==
    process_index` only. A parquet file is converted for the columns used only, so a bad value
    in another column costs no row. Only the errors one row can cause (`_ROW_ERRORS`) mark it
    malformed; any other exception is a bug and propagates with the path and row in a note.

    Returns:
      (examples, report): the loaded `Example`s (key "row<r>", index r) and the `LoadReport`.
    """
    path = os.fspath(path)
    if chat_format not in _CHAT_FORMATS:
        raise ValueError(f"chat_format must be one of {_CHAT_FORMATS}, got {chat_format!r}")
    if not 0 <= process_index < process_count:
        raise ValueError(
            f"need 0 <= process_index < process_count, got {process_index}, {process_count}"
        )
    if not as_path(path).exists():
        raise FileNotFoundError(f"math dataset {path!r} does not exist; check the data path")
    ext = as_path(path).suffix.lower()
    if ext in (".jsonl", ".json"):
        rows = _jsonl_rows(path, process_index, process_count)
    elif ext == ".parquet":
        rows = _parquet_rows(path, process_index, process_count)
    else:
        raise ValueError(f"{path}: unsupported extension {ext!r}; use .jsonl, .json or .parquet")
    add_bos = getattr(tokenizer, "add_bos", True) if add_bos is None else add_bos

    report = LoadReport(path=path)
    examples = []
    for index, row in rows:
        report.num_rows += 1
        try:
            if isinstance(row, _Malformed):
                raise row
            ex = _row_to_example(row, index, chat_format)
            try:
                n_tokens = len(tokenizer.encode_ids(ex.prompt)) + int(add_bos)
            except _ROW_ERRORS as e:  # The tokenizer's message is the reason.
                raise _Malformed(f"tokenizer rejected the prompt: {_short(e)}") from None
            if n_tokens > max_prompt_tokens:
                raise _Malformed(
                    f"prompt has {n_tokens} tokens > max_prompt_tokens={max_prompt_tokens}"
                )
        except (_Malformed, *_ROW_ERRORS) as e:
            reason = str(e) if isinstance(e, _Malformed) else f"{type(e).__name__}: {_short(e)}"
            report.malformed.append((index, reason))
            if report.num_malformed <= _LOG_FIRST_N:
                logging.warning("%s: skipping malformed row %d: %s", path, index, reason)
            continue
        except Exception as e:
            e.add_note(f"while loading row {index} of {path}")
            raise
        examples.append(ex)
    report.num_loaded = len(examples)
    if report.num_malformed:
        logging.warning("%s", report.summary())
    else:
        logging.info("%s", report.summary())
    return examples, report
